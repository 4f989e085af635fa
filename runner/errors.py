"""Errors a user can act on: the CLI prints the message as one line and exits non-zero."""

from __future__ import annotations


class UserError(Exception):
    """Expected failure caused by input or environment; printed as one line, no traceback."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
