"""Errors a user can act on: the CLI prints the message as one line and exits non-zero."""

from __future__ import annotations


class UserError(Exception):
    """Expected failure caused by input or environment; printed as one line, no traceback."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class Terminated(KeyboardInterrupt):
    """SIGTERM to the runner (`kill`, a CI job's timeout, systemd stopping it): every command
    cleans up as on Ctrl-C (`up` stops its run on every node), then exits 128 + 15."""

    exit_code = 143


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM always interrupt, whatever the runner inherited: a shell script's
    background job (`runner up ... &`) starts with SIGINT ignored, and SIGTERM's default would kill
    the runner without stopping the containers it started."""
    import signal

    def _terminated(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
