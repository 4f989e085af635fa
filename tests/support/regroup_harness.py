"""Real multi-process gloo runs for tests/distributed/test_regroup.py (issue 58), as a script:

    python tests/support/regroup_harness.py blocks CTL_DIR stop|kill [ROUNDS]
    python tests/support/regroup_harness.py exact CTL_DIR stop|kill VICTIM CONFIG [TRAINER ARGS...]

This process plays the runner: it forks the ranks (each one "node", with its own run dir
CTL_DIR/node-<r>), stops (SIGSTOP: a hung node, a cut link: nothing closes) or kills (SIGKILL) rank 2,
and writes each epoch's regroup.json (contract/regroup.py) into the survivors' run dirs with a port it
chose. The ranks do what trainer/runtime/regroup.py and trainer/parallel/stage_*.py provide; each
writes CTL_DIR/result<r>.json, and this process CTL_DIR/result.json, which the tests read.

- blocks: rank 0 blocked in recv from rank 2, rank 1 in an all_reduce with it; the survivors leave and
  meet again, then ROUNDS-1 more times in a row (each time blocked again, on each other); the stopped
  rank, woken, tries the new port without the epoch's token and must fail.
- exact: the real Trainer (train.py, unchanged) on CONFIG as pp 3 with stage replicas; rank VICTIM
  lost after step LOSE_AFTER (4) (rank 0: the master, whose stage then crosses the network); the
  survivors catch the step's error, regroup to pp 2, assemble their stages from memory and train on
  to the end: what train.run must do once integrated (tests/support/regroup_exact.py).

Forked from one warm process (the tests start it through the warm trainer: tests/support/trainer_zygote.py),
so no rank imports torch again. Run heavy things under `flock /tmp/heavy-tests.lock`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from contract.regroup import REGROUP_FILE, NewLayout, Regroup, dumps  # noqa: E402

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
VICTIM = 2
LOSE_AFTER = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flag(ctl: Path, name: str, value: object = "") -> None:
    tmp = ctl / f".{name}.tmp"
    tmp.write_text(json.dumps(value))
    os.replace(tmp, ctl / name)


def wait_flag(ctl: Path, name: str, timeout: float = 120.0, procs: list | None = None) -> object:
    end = time.time() + timeout
    while time.time() < end:
        if (ctl / name).exists():
            return json.loads((ctl / name).read_text() or '""')
        if procs and any(p.exitcode not in (None, 0) for p in procs):
            raise RuntimeError(f"a rank failed ({[p.exitcode for p in procs]}) before {name}")
        time.sleep(0.01)
    raise TimeoutError(f"no {name} within {timeout} s")


def write_spec(ctl: Path, nodes: list[str], spec: Regroup) -> float:
    """The runner's part: the file into every node of the new layout, whole (a rename)."""
    text, t = dumps(spec), time.time()
    for node in nodes:
        d = ctl / node
        (d / f".{REGROUP_FILE}.tmp").write_text(text)
        os.replace(d / f".{REGROUP_FILE}.tmp", d / REGROUP_FILE)
    return t


def spec_for(epoch: int, port: int, nodes: list[str], pp: int, batch: int = 16,
             partition: str = "uniform_transformer", why: str = "lost node-2") -> Regroup:
    """The runner's file for `nodes` (new rank order; one rank each) as pp x dp, a fresh token."""
    world = len(nodes)
    return Regroup(epoch=epoch, token=secrets.token_hex(8), master_addr="127.0.0.1", master_port=port,
                   world_size=world, ranks={n: [r] for r, n in enumerate(nodes)},
                   layout=NewLayout(pp, world // pp, 1, batch, partition), timeout_s=60, why=why)


def _child_setup() -> None:
    for k in LAUNCH_ENV:
        os.environ.pop(k, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def usage() -> tuple[int, int]:
    """(native threads, open fds) of this process: what a leak would grow."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


# -- blocks ---------------------------------------------------------------------------------------

def _blocked(op, *args) -> tuple[str, float]:
    """Run a blocking op; ("returned" | the error's first words, epoch time it came back)."""
    try:
        op(*args)
        out = "returned"
    except Exception as e:  # noqa: BLE001 - the error is the finding
        out = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return out, time.time()


def _recv_from(peer: int):
    import torch
    import torch.distributed as dist

    return lambda: dist.recv(torch.empty(4), peer)


def _block_rank(r: int, ctl: Path, port: int, rounds: int) -> None:  # long: one rank's whole scenario, in order
    _child_setup()
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from trainer.runtime.regroup import ConnectionCut, Watcher, rejoin, write_status

    node, res = f"node-{r}", {"rank": r, "epochs": []}
    run_dir = ctl / node
    cut = ConnectionCut()
    watcher = Watcher(run_dir, node, 0, cut).start()
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("epoch0", store), rank=r, world_size=3,
                            timeout=timedelta(seconds=600))
    dist.all_reduce(torch.ones(1))
    flag(ctl, f"ready{r}")
    if r == VICTIM:
        res["blocked"] = _blocked(dist.recv, torch.empty(1), 0)
        spec = Regroup(**{**wait_flag(ctl, "stale.json", 60), "layout": NewLayout(2, 1, 1, 16, "x")})
        t0 = time.time()
        res["stale_join"] = _blocked(rejoin, spec, 1, "gloo", spec.timeout_s)[0]
        res["stale_join_s"] = time.time() - t0
        flag(ctl, "stale-done")
        json.dump(res, open(ctl / f"result{r}.json", "w"))
        os._exit(0)
    # Blocked on the victim: rank 0 in a p2p recv, rank 1 in a collective.
    op = (lambda: dist.recv(torch.empty(4), 2)) if r == 0 else (lambda: dist.all_reduce(torch.ones(4)))
    res["first_threads_fds"] = usage()
    for epoch in range(1, rounds + 1):
        outcome, t_back = _blocked(op)
        spec = watcher.wait(60)
        if spec is None or spec.epoch != epoch:
            raise RuntimeError(f"rank {r}: no regroup for epoch {epoch} (got {spec})")
        times = dict(watcher.times)
        new_rank = spec.rank_of(node, 0)
        dt = rejoin(spec, new_rank)
        watcher.done(spec)
        y = torch.full((4,), float(new_rank + 1))
        t1 = time.perf_counter()
        dist.all_reduce(y)
        first = time.perf_counter() - t1
        write_status(run_dir, 0, epoch, "joined", times, rank=new_rank)
        res["epochs"].append({"epoch": epoch, "outcome": outcome, "t_back": t_back, "times": times,
                              "rejoin_s": dt, "first_allreduce_s": first, "sum": float(y[0]),
                              "threads_fds": usage(), "python_threads": len(__import__("threading").enumerate())})
        flag(ctl, f"joined{epoch}.{r}")
        op = _recv_from(1 - new_rank)  # blocked on each other until the next epoch
    json.dump(res, open(ctl / f"result{r}.json", "w"))
    dist.destroy_process_group()
    watcher.stop()
    os._exit(0)


def blocks(ctl: Path, how: str, rounds: int = 5) -> dict:
    """The parent: see the module doc. Returns what it measured (and writes result.json)."""
    import torch.distributed as dist

    for r in range(3):
        (ctl / f"node-{r}").mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_block_rank, args=(r, ctl, port, rounds)) for r in range(3)]
    for p in procs:
        p.start()
    from datetime import timedelta

    store = dist.TCPStore("127.0.0.1", port, 3, True, wait_for_workers=False, timeout=timedelta(seconds=60))
    out: dict = {"how": how, "writes": {}}
    try:
        for r in range(3):
            wait_flag(ctl, f"ready{r}", 120, procs)
        time.sleep(0.5)  # the survivors are in their ops, waiting on rank 2
        os.kill(procs[VICTIM].pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        out["t_lost"] = time.time()
        time.sleep(1.0)  # nothing happens by itself to a stopped peer's survivors (a killed one's fail at once)
        for epoch in range(1, rounds + 1):
            port_e = free_port()
            nodes = ["node-0", "node-1"]
            out["writes"][epoch] = write_spec(ctl, nodes, spec_for(epoch, port_e, nodes, 2))
            for r in (0, 1):
                wait_flag(ctl, f"joined{epoch}.{r}", 120, procs[:2])
            if epoch == 1 and how == "stop":  # the stale rank wakes, knows the port but not the token
                flag(ctl, "stale.json", {**spec_for(1, port_e, ["node-0", "node-1"], 2).as_dict(), "token": "stale",
                                         "layout": None, "timeout_s": 1})
                os.kill(procs[VICTIM].pid, signal.SIGCONT)
                wait_flag(ctl, "stale-done", 60, [procs[VICTIM]])
            time.sleep(0.3)  # blocked on each other again before the next file
        for p in procs[:2]:
            p.join(60)
    finally:
        if how == "stop" and procs[VICTIM].is_alive():
            procs[VICTIM].join(10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    out["exitcodes"] = [p.exitcode for p in procs]
    out["ranks"] = [json.loads((ctl / f"result{r}.json").read_text()) for r in range(3)
                    if (ctl / f"result{r}.json").exists()]
    (ctl / "result.json").write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str]) -> int:
    scenario, ctl, how = argv[0], Path(argv[1]), argv[2]
    ctl.mkdir(parents=True, exist_ok=True)
    if scenario == "blocks":
        blocks(ctl, how, int(argv[3]) if len(argv) > 3 else 5)
    elif scenario == "in_place":
        from tests.support.regroup_in_place import in_place

        in_place(ctl, how, int(argv[3]), argv[4], argv[5:])
    elif scenario == "rejoin":
        from tests.support.regroup_rejoin import rejoin

        rejoin(ctl, argv[3], argv[4:])
    elif scenario == "exact":
        from tests.support.regroup_exact import exact

        exact(ctl, how, int(argv[3]), argv[4], argv[5:])
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
