"""Errors a user can act on (one line, no traceback) and the exit codes that tell a script what
happened. Each code means one thing (README "Exit codes"):

  0    success
  1    `check` found a node that is not ready (an internal error also exits 1, with a traceback)
  2    user error: bad input or an environment problem named in one line; nothing was started
  3    partial: `down`/`collect` reached only some nodes (or some files failed); run it again
  4    the job failed: a rank or container exited non-zero, or a node was lost mid-run
  5    the job hung: a rank made no progress past its hang timeout (contract/hang.py); every rank's
       stacks were taken (hang-rank<R>.txt in the run dir) and the run stopped
  130  interrupted (Ctrl-C); 143 terminated (SIGTERM); the run was stopped first
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_NOT_READY = 1
EXIT_USER = 2
EXIT_PARTIAL = 3
EXIT_JOB_FAILED = 4
EXIT_HUNG = 5
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class UserError(Exception):
    """Expected failure caused by input or environment; printed as one line, no traceback."""

    exit_code = EXIT_USER

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NotReady(UserError):
    """`check` found what would stop a run (a node, the cluster): exit 1."""

    exit_code = EXIT_NOT_READY


class Partial(UserError):
    """`down` or `collect` reached only some of it (nodes away, files changed): run it again; exit 3."""

    exit_code = EXIT_PARTIAL


class Unsupported(UserError):
    """What the backend a run goes to does not have: a verb (`push` on Slurm) or another backend's
    option (`--no-push` on a Slurm run). The message names the backend and what to do instead."""


class JobFailed(UserError):
    """The job itself failed (e.g. the master's container exited before it listened): not the
    user's input, so not exit 2, whatever code the job's own process exited with."""

    exit_code = EXIT_JOB_FAILED


class Terminated(KeyboardInterrupt):
    """SIGTERM to the runner (`kill`, a CI job's timeout, systemd stopping it): every command
    cleans up as on Ctrl-C (`up` stops its run on every node), then exits 128 + 15."""

    exit_code = EXIT_TERMINATED


def interrupt_code(exc: BaseException) -> int:
    """130 for Ctrl-C, 143 for SIGTERM."""
    return getattr(exc, "exit_code", EXIT_INTERRUPTED)


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM always interrupt, whatever the runner inherited: a shell script's
    background job (`runner up ... &`) starts with SIGINT ignored, and SIGTERM's default would kill
    the runner without stopping the containers it started."""
    import signal

    def _terminated(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
