"""Secret values the runner holds (job.env_file's, the registry login), masked in whatever it prints
itself: its log lines and its one-line errors, which may quote a node's or a tool's words (a docker
or sbatch message echoing a value). Registered where they are read; the job's own output is the
job's business (shown as it wrote it, made visible: runner/core/node_output.py)."""

from __future__ import annotations

import logging
import re
import threading

from runner.core.node_output import visible

SECRET_NAME_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.I)


def looks_secret(name: str) -> bool:
    """Whether an env name looks like it holds a secret (its value is masked in all output)."""
    return bool(SECRET_NAME_RE.search(name))

MASK = "******"
MIN_LEN = 4  # a shorter value is no secret, and masking "1" would garble every line

_values: set[str] = set()
_lock = threading.Lock()


def hide(values) -> None:
    """Mask these values (the non-empty ones of at least MIN_LEN characters) from now on."""
    with _lock:
        _values.update(v for v in values if isinstance(v, str) and len(v) >= MIN_LEN)


def hide_job(job, secrets: dict[str, str]) -> None:
    """A job's secrets: its env_file's values and job.env's secret-looking ones (TOKEN, KEY, ...)."""

    hide(secrets.values())
    hide(v for k, v in job.env.items() if looks_secret(k))


def redact(text: str) -> str:
    """text with every registered secret value replaced by MASK (the longest first, so a value that
    contains another is masked whole)."""
    if not _values:
        return text
    for v in sorted(_values, key=len, reverse=True):
        if v in text:
            text = text.replace(v, MASK)
    return text


def printable(text: str) -> str:
    """A line the runner prints that may quote a node: secrets masked, control characters visible."""
    return visible(redact(text))


class Formatter(logging.Formatter):
    """The CLI's log lines, as printable() makes them (a traceback under -v keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))
