"""A pipeline schedule's name checked (torch-free, so config validation can check it before torch
loads): the names, spellings and placements are contract/schedules.py's, shared with the runner.
trainer/parallel/pipeline.py runs them.
"""

from __future__ import annotations

from contract.schedules import ALIASES, SCHEDULES, ScheduleSpec, canonical
from trainer.config.schema import ConfigError


class PipelineError(ConfigError, ValueError):
    """An impossible pipeline layout; the message is one line a user can act on."""


def schedule_spec(name: str, key: str = "parallel.pp_schedule") -> ScheduleSpec:
    canon = canonical(name)
    if canon not in SCHEDULES:
        raise PipelineError(f"{key}: unknown schedule {name!r}; choose one of "
                            f"{', '.join([*SCHEDULES, *sorted(ALIASES)])}")
    return SCHEDULES[canon]


__all__ = ["ALIASES", "SCHEDULES", "PipelineError", "ScheduleSpec", "schedule_spec"]
