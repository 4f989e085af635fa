"""Pipeline schedule names (torch-free, so config validation can check them before torch loads).

Canonical names, their torch.distributed.pipelining class names, and the spellings users of the
seed systems type (`afab`, `interleaved`, `zb_v`, ...). trainer/parallel/pipeline.py runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.schema import ConfigError


class PipelineError(ConfigError, ValueError):
    """An impossible pipeline layout; the message is one line a user can act on."""


@dataclass(frozen=True)
class ScheduleSpec:
    name: str  # canonical name
    torch_name: str  # name for torch's get_schedule_class
    multi: bool  # several stages per rank
    style: str  # stage-to-rank placement: "loop" or "v"


SCHEDULES = {
    "gpipe": ScheduleSpec("gpipe", "GPipe", False, "loop"),
    "1f1b": ScheduleSpec("1f1b", "1F1B", False, "loop"),
    "interleaved1f1b": ScheduleSpec("interleaved1f1b", "Interleaved1F1B", True, "loop"),
    "interleaved_zb": ScheduleSpec("interleaved_zb", "InterleavedZeroBubble", True, "loop"),
    "zbv": ScheduleSpec("zbv", "ZBVZeroBubble", True, "v"),
    "dualpipev": ScheduleSpec("dualpipev", "DualPipeV", True, "v"),
}
ALIASES = {"afab": "gpipe", "all_forward_all_backward": "gpipe", "interleaved_1f1b": "interleaved1f1b",
           "interleaved": "interleaved1f1b", "interleavedzerobubble": "interleaved_zb",
           "zbvzerobubble": "zbv", "zb_v": "zbv", "dualpipe_v": "dualpipev"}


def schedule_spec(name: str, key: str = "parallel.pp_schedule") -> ScheduleSpec:
    canon = ALIASES.get(name.lower(), name.lower())
    if canon not in SCHEDULES:
        raise PipelineError(f"{key}: unknown schedule {name!r}; choose one of "
                            f"{', '.join([*SCHEDULES, *sorted(ALIASES)])}")
    return SCHEDULES[canon]
