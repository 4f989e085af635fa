"""profile.batch: which batch indices to record. Pure (no torch), so config validation can use it."""

from __future__ import annotations

import re

from trainer.config.schema import ConfigError

OFF = ("", "none", "off", "null", "-1", "false")
# Each recorded batch writes its own timeline (timeline_batch{k}_all.json): a handful is what anyone
# reads. Counted before a single index is made: "0-999999999999" filled memory with a set of them.
MAX_BATCHES = 1024
MAX_INDEX = 1 << 30                      # as trainer/config/bounds.py MAX_COUNT (steps)


def parse_batches(spec: str | int | list, key: str = "profile.batch") -> list[int]:
    """"1" | "1,3" | "2-4" (inclusive) | "2:5" (python range) | "[1, 2]" | "none" -> sorted indices,
    at most MAX_BATCHES of them, each at most MAX_INDEX."""
    if isinstance(spec, list):
        spec = ",".join(map(str, spec))
    text = str(spec).strip().strip("[]()")
    if text.lower() in OFF:
        return []
    shown = repr(str(spec)[:80])
    spans: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([0-9]{1,12})\s*(?:(-|\.\.|:)\s*([0-9]{1,12}))?", part)
        if m is None:
            raise ConfigError(f"{key}: cannot read {shown}; use a batch index, a list '1,3', "
                              f"a range '2-4' (inclusive) or 'none'")
        a = int(m.group(1))
        b = a if m.group(3) is None else int(m.group(3)) - (1 if m.group(2) == ":" else 0)
        if b < a:
            raise ConfigError(f"{key}: empty range {part[:40]!r} in {shown}")
        if b > MAX_INDEX:
            raise ConfigError(f"{key}: batch {b} in {shown} is past the last step a run may have ({MAX_INDEX})")
        spans.append((a, b))
        if sum(y - x + 1 for x, y in spans) > MAX_BATCHES:  # counted before any index is made
            raise ConfigError(f"{key}: {shown} names more than {MAX_BATCHES} batches; each writes its own "
                              "timeline: name fewer")
    return sorted({i for a, b in spans for i in range(a, b + 1)})
