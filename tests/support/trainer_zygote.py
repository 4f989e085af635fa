"""A warm trainer for the tests' runs: torch, transformers and the trainer imported once, forked
per run.

A tiny trainer run spends ~85% of its CPU importing torch and transformers (8-9 s of CPU per
process on a CI-sized machine, the steps ~1 s), and the suite makes hundreds of such runs.
`python -m tests.support.trainer_zygote SOCKET` imports everything once, then serves one run at a time:
for each request it forks a child that takes the request's environment, working directory and
argv, writes its stdout and stderr to the request's files and runs an entry point (ENTRIES): the
trainer's own `trainer.cli.main`; tests/support/trainer_sequence.py for run_trainers; or torchrun's own
`main` for a multi-process run, with `--start-method fork --run-path tests/support/trainer_entry.py`, so
that its workers are forked from the warm process and run the same `trainer.cli.main` that
`torchrun -m trainer` runs in new interpreters. The child ends as an interpreter does (non-daemon
threads joined, atexit handlers run) and exits with the run's status.

What a fork cannot give a run is an import-time environment of its own: the client
(tests/support/trainer_run.py) sends a run here only when every variable a library reads at import time
(IMPORT_TIME_PREFIXES) equals the zygote's. Runs that must be what users start stay fresh
interpreters: any run a test signals or watches (start_trainer), a multi-process run whose failure
a test reads (check=False: torchrun reports a forked worker's failure in other words), and runs
asked for with fresh=True. TESTS_FRESH_PROCESSES=1 turns the zygote off.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

# Variables torch, transformers, tokenizers, OpenMP, CUDA libraries or Python itself read when a
# module is imported or the interpreter starts (their values are frozen in the zygote).
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_",
                        "CUDA", "NCCL", "NVIDIA", "TOKENIZERS", "SAFETENSORS", "PYTHON", "LD_", "XDG_",
                        "MPLCONFIGDIR", "HOME", "TRITON", "USE_", "DISABLE_", "TF_", "GLOO_", "COVERAGE")
ENTRIES = {"trainer": "trainer.cli:main", "sequence": "tests.support.trainer_sequence:main_argv",
           "torchrun": "torch.distributed.run:main"}


def torchrun_argv(nproc: int, script: Path, args: list[str]) -> list[str]:
    """torchrun's own CLI, its workers forked from it (start method fork) and running `script`
    in the warm interpreter (--run-path) instead of `-m trainer` in a new one."""
    return ["--standalone", f"--nproc-per-node={nproc}", "--start-method=fork", "--run-path", str(script), *args]


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def _warm() -> None:
    import torch  # noqa: F401

    import tests.support.trainer_sequence  # noqa: F401
    import trainer.cli  # noqa: F401
    import trainer.tools.dry_run  # noqa: F401
    import trainer.train  # noqa: F401
    from trainer.models.build import FAMILIES, _transformers_attr

    for fam in FAMILIES.values():
        _transformers_attr(fam.config_cls)
        _transformers_attr(fam.model_cls)


def _run_child(req: dict) -> None:
    """In the forked child: become the run, then exit with its status (never returns)."""
    rc = 1
    try:
        os.setsid()  # the client's timeout kills this run's whole group
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        threads = req["env"].get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        module, _, name = ENTRIES[req["entry"]].partition(":")
        import importlib

        main = getattr(importlib.import_module(module), name)
        sys.argv = [req["entry"], *req["argv"]]
        try:
            rc = int(main(list(req["argv"])) or 0)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a crash is the run's own traceback and status 1, as in a process
        traceback.print_exc()
        rc = 1
    finally:
        # What the interpreter does at exit: join non-daemon threads (async checkpoint writers),
        # run atexit handlers (logging.shutdown flushes the log files), flush the streams.
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(rc & 0xFF if rc >= 0 else 1)


def serve(path: str) -> None:
    _warm()
    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    srv.settimeout(5)
    print("ready", flush=True)
    while os.getppid() == parent:  # the test session is gone: so is the zygote
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        with conn:
            req = json.loads(conn.makefile("r").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                srv.close()
                conn.close()
                _run_child(req)
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
            _, status = os.waitpid(pid, 0)
            conn.sendall((json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n").encode())


# --- the client (one zygote per test process, started on first use) ------------------------------

class Zygote:
    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.dir = tempfile.mkdtemp(prefix="trainer-zygote-")
        self.path = os.path.join(self.dir, "sock")
        self.env = import_time_env(env)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.trainer_zygote", self.path], env=env, cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        atexit.register(self.close)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"trainer zygote did not start (exit {self.proc.wait()})")

    def accepts(self, env: dict[str, str]) -> bool:
        ok = self.proc.poll() is None and import_time_env(env) == self.env
        if not ok and os.environ.get("TESTS_ZYGOTE_LOG"):  # why a run went to a fresh interpreter
            mine, theirs = import_time_env(env), self.env
            diff = {k: (theirs.get(k), mine.get(k)) for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
            with open(os.environ["TESTS_ZYGOTE_LOG"], "a") as f:
                f.write(f"fresh: zygote alive={self.proc.poll() is None} differing={diff}\n")
        return ok

    def run(self, entry: str, argv: list[str], env: dict[str, str], cwd: Path,
            timeout: float) -> tuple[int, str, str]:
        """(status, stdout, stderr) of one run; raises subprocess.TimeoutExpired like subprocess.run."""
        out_dir = tempfile.mkdtemp(dir=self.dir)
        req = {"entry": entry, "argv": argv, "env": env, "cwd": str(cwd),
               "stdout": os.path.join(out_dir, "out"), "stderr": os.path.join(out_dir, "err")}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.path)
            s.sendall((json.dumps(req) + "\n").encode())
            s.settimeout(timeout)
            reply = s.makefile("r")
            pid = json.loads(reply.readline())["pid"]
            try:
                rc = json.loads(reply.readline())["rc"]
            except BaseException as e:  # timed out, or the test was interrupted: the run goes too
                os.killpg(pid, signal.SIGKILL)
                s.settimeout(60)
                s.makefile("r").readline()  # the zygote has reaped it: free for the next run
                if isinstance(e, TimeoutError):
                    raise subprocess.TimeoutExpired([entry, *argv], timeout) from None
                raise
        texts = [Path(req[k]).read_text(errors="replace") for k in ("stdout", "stderr")]
        for k in ("stdout", "stderr"):
            os.unlink(req[k])
        os.rmdir(out_dir)
        return rc, texts[0], texts[1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for name in os.listdir(self.dir):
            p = os.path.join(self.dir, name)
            if os.path.isdir(p):
                for f in os.listdir(p):
                    os.unlink(os.path.join(p, f))
                os.rmdir(p)
            else:
                os.unlink(p)
        os.rmdir(self.dir)


_zygote: Zygote | None = None


def zygote_for(env: dict[str, str], base_env: dict[str, str], cwd: Path) -> Zygote | None:
    """The session's zygote (started with `base_env`) if it can serve a run with `env`, else None
    (the caller starts a process)."""
    global _zygote
    if os.environ.get("TESTS_FRESH_PROCESSES") == "1":
        return None
    if _zygote is None:
        _zygote = Zygote(base_env, cwd)
    return _zygote if _zygote.accepts(env) else None


if __name__ == "__main__":
    serve(sys.argv[1])
