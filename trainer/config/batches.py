"""profile.batch: which batch indices to record. Pure (no torch), so config validation can use it."""

from __future__ import annotations

import re

from trainer.config.schema import ConfigError

OFF = ("", "none", "off", "null", "-1", "false")


def parse_batches(spec: str | int | list, key: str = "profile.batch") -> list[int]:
    """"1" | "1,3" | "2-4" (inclusive) | "2:5" (python range) | "[1, 2]" | "none" -> sorted indices."""
    if isinstance(spec, list):
        spec = ",".join(map(str, spec))
    text = str(spec).strip().strip("[]()")
    if text.lower() in OFF:
        return []
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)\s*(?:(-|\.\.|:)\s*(\d+))?", part)
        if m is None:
            raise ConfigError(f"{key}: cannot read {spec!r}; use a batch index, a list '1,3', "
                              f"a range '2-4' (inclusive) or 'none'")
        a = int(m.group(1))
        b = a if m.group(3) is None else int(m.group(3)) - (1 if m.group(2) == ":" else 0)
        if b < a:
            raise ConfigError(f"{key}: empty range {part!r} in {spec!r}")
        out.update(range(a, b + 1))
    return sorted(out)
