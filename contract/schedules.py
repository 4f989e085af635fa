"""Pipeline schedules as both halves name them (torch-free): canonical names, torch's class names,
the spellings the seed systems' users type (`afab`, `interleaved`, `zb_v`, ...), and where each
puts its stages (round-robin `loop`, or the zig-zag `v` of ZBV/DualPipeV). The trainer runs them
(trainer/parallel/pipeline.py) and checks a name (trainer/config/schedules.py); the runner
sizes a rank's stages with them (runner/planning/sizing.py)."""

from __future__ import annotations

from dataclasses import dataclass


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


def canonical(name: str) -> str:
    """The canonical name of a schedule's spelling (the name itself if it is none known)."""
    return ALIASES.get(name.lower(), name.lower())


def stage_to_rank(stage: int, pp: int, num_stages: int, style: str = "loop") -> int:
    """Pipeline rank that runs `stage`: round-robin ('loop') or zig-zag ('v', for ZBV/DualPipeV)."""
    if style == "v":
        virt = stage // pp
        return stage % pp if virt % 2 == 0 else pp - 1 - stage % pp
    return stage % pp
