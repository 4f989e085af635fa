"""Did-you-mean for both CLIs: a mistyped command, flag, inventory field or config key is answered
with the closest real one (difflib's ratio, as git and pip do)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_matches(word: str, choices: Iterable[str], n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The n choices closest to word (difflib ratio >= cutoff), best first; compared without
    leading dashes, case and with `_` read as `-` (`--Train_Step` finds `--train-steps`)."""
    def norm(s: str) -> str:
        return s.lstrip("-").replace("_", "-").lower()

    by_norm: dict[str, str] = {}
    for c in choices:
        by_norm.setdefault(norm(c), c)
    return [by_norm[m] for m in difflib.get_close_matches(norm(word), list(by_norm), n=n, cutoff=cutoff)]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or '' when none is close."""
    found = close_matches(word, choices)
    return f" (did you mean {found[0]}?)" if found else ""
