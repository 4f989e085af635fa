"""The pure plan and `runner up --dry-run`: ranks, commands, env and masking, with no socket opened
(the Pi and EC2 addresses in hosts/ must never be contacted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.delivery.resume_sync import Copy, Description, Listing, candidates, incomplete, plan_copies
from runner.inventory import load_inventory
from runner.planning.plan import LABEL_NODE, LABEL_RANK, LABEL_RUN, MASK, Facts, make_plan
from tests.support.runner_helpers import opened_files, run_cli, shipped

SECRET = "hf_SUPERSECRET_123"


# What a dry-run adds under its first line for the image labels it cannot read (runner/planning/plan.py).
DRY_LAUNCH = ("  launch images labelled io.runner.gate=3 (this project's) run `torchrun` as `python -m "
              "runner.agents.torchrun` (exit barrier mended), workers behind `python -m runner.agents.gate` "
              "until the master listens")


def inventory(tmp_path: Path, nodes: str, job: str = "") -> Path:
    envf = tmp_path / ".env"
    envf.write_text(f"HF_TOKEN={SECRET}\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model: {preset: tiny}\n")
    p = tmp_path / "inv.yaml"
    p.write_text(f"nodes:\n{nodes}job:\n  image: {{amd64: t:amd, arm64: t:arm}}\n  config: {cfg}\n"
                 f"  env_file: {envf}\n  env: {{OMP_NUM_THREADS: '2', HF_TOKEN: visible-would-leak}}\n{job}")
    return p


NODES3 = ("  - {name: w1, host: 10.9.0.2, arch: arm64}\n"
          "  - {name: m, host: 10.9.0.1, arch: amd64, role: master, slots: 2}\n"
          "  - {name: w2, host: 10.9.0.3, arch: arm64, env: {EXTRA: '1'}}\n")


def test_addr_is_what_the_ranks_use_host_what_ssh_uses(tmp_path, no_network):
    """A node's `addr` (default: its `host`) is MASTER_ADDR, torchrun's --master-addr and the
    address every node's interface probe routes to; SSH still goes to `host`."""
    nodes = ("  - {name: m, host: 198.51.100.7, addr: 10.9.0.1, arch: amd64, role: master}\n"
             "  - {name: w1, host: 198.51.100.8, arch: arm64}\n")
    inv = load_inventory(inventory(tmp_path, nodes, "  master_port: 29555\n"))
    assert [(n.host, n.addr, n.rank_addr) for n in inv.nodes] == [
        ("198.51.100.7", "10.9.0.1", "10.9.0.1"), ("198.51.100.8", None, "198.51.100.8")]
    plan = make_plan(inv, "r1", {"m": Facts(ifname="eth0"), "w1": Facts(ifname="eth1")}, strict=True)
    assert plan.master_addr == "10.9.0.1"
    for n in plan.nodes:
        assert n.env["MASTER_ADDR"] == "10.9.0.1"
        assert n.command[n.command.index("--master-addr") + 1] == "10.9.0.1"
    assert [n.host for n in plan.nodes] == ["198.51.100.7", "198.51.100.8"]
    with pytest.raises(UserError, match=r"no interface routes to master 10\.9\.0\.1 \(`ip route get 10\.9\.0\.1`"):
        make_plan(inv, "r1", {"m": Facts(ifname="eth0"), "w1": Facts()}, strict=True)
    rc, out = run_cli("up", "-i", str(tmp_path / "inv.yaml"), "--dry-run")
    assert rc == 0 and "master m (10.9.0.1:29555)" in out and out.count("MASTER_ADDR=10.9.0.1") == 2, out


@pytest.mark.parametrize("text, where, why", [
    ("  - {name: m, host: 10.9.0.1, addr: 'a b'}\n", "nodes[0].addr", "'a b' is not an IP address or host name"),
    ("  - {name: m, host: 10.9.0.1, addr: [1]}\n", "nodes[0].addr", "must be a non-empty string, got a list (node m)"),
])
def test_bad_addr_is_one_line(tmp_path, no_network, text, where, why):
    with pytest.raises(UserError) as e:
        load_inventory(inventory(tmp_path, text))
    msg = str(e.value)
    assert "\n" not in msg and f"{tmp_path / 'inv.yaml'}:" in msg and where in msg and why in msg, msg


def test_addr_is_per_node_not_a_default(tmp_path, no_network):
    p = tmp_path / "inv.yaml"
    p.write_text("defaults: {addr: 10.9.0.1}\nnodes:\n  - {name: m, host: 10.9.0.1}\njob: {image: t:x}\n")
    with pytest.raises(UserError, match=r"inv\.yaml:1: .*defaults\.addr"):
        load_inventory(p)


def test_plan_ranks_env_commands(tmp_path, no_network):
    inv = load_inventory(inventory(tmp_path, NODES3, "  master_port: 29555\n  args: [--train_steps, '5']\n"))
    facts = {"m": Facts(ifname="eth0"), "w1": Facts(ifname="wlan0"), "w2": Facts(ifname="eth1")}
    plan = make_plan(inv, "20260101-000000-abcd", facts, secret_keys=list(inv.job.secrets()), strict=True)
    assert [(n.node, n.rank) for n in plan.nodes] == [("m", 0), ("w1", 1), ("w2", 2)]
    assert [n.image for n in plan.nodes] == ["t:amd", "t:arm", "t:arm"]
    m, w1, w2 = plan.nodes
    tr = m.command[m.command.index("torchrun"):]
    assert tr == ["torchrun", "--nnodes", "3", "--node-rank", "0", "--nproc-per-node", "2",
                  "--master-addr", "10.9.0.1", "--master-port", "29555", "--rdzv-backend", "static",
                  "--max-restarts", "0", "-m", "trainer", "--config", "/out/config.yaml", "--train_steps", "5"]
    assert "--node-rank" in w2.command and w2.command[w2.command.index("--node-rank") + 1] == "2"
    assert w1.command[w1.command.index("--nproc-per-node") + 1] == "1"
    for n, ifn in ((m, "eth0"), (w1, "wlan0"), (w2, "eth1")):
        assert n.env["GLOO_SOCKET_IFNAME"] == n.env["NCCL_SOCKET_IFNAME"] == ifn
        assert n.env["MASTER_ADDR"] == "10.9.0.1" and n.env["MASTER_PORT"] == "29555"
        assert n.env["NNODES"] == "3" and n.env["NODE_RANK"] == str(n.rank) and n.env["NODE_NAME"] == n.node
        assert n.env["RUN_ID"] == "20260101-000000-abcd" and n.env["OUTPUT_DIR"] == "/out"
        assert n.env["OMP_NUM_THREADS"] == "2"
        # torchrun forwards SIGUSR1 too, and waits for the ranks' preempt checkpoint inside the
        # grace `down` gives (job.grace_period defaults to 30 s).
        assert n.env["PET_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
        assert n.env["PET_SHUTDOWN_TIMEOUT"] == "28"
        assert "HF_TOKEN" not in n.env  # the env_file wins, and it never sits in container config
        assert n.labels[LABEL_RUN] == "20260101-000000-abcd" and n.labels[LABEL_NODE] == n.node
        assert n.labels[LABEL_RANK] == str(n.rank)
        assert n.container == f"runner-20260101-000000-abcd-{n.node}"
        assert n.mounts["/out"] == n.run_dir and n.run_dir.endswith("/runs/20260101-000000-abcd")
        assert n.secrets_file and n.mounts["/run/runner/secrets.env"] == n.secrets_file
        assert SECRET not in repr(n)
    assert w2.env["EXTRA"] == "1" and "EXTRA" not in m.env


def test_strict_plan_demands_probed_facts(tmp_path):
    inv = load_inventory(inventory(tmp_path, "  - {name: a, host: 10.9.0.1}\n", "  master_port: 29555\n"))
    with pytest.raises(UserError, match="arch unknown"):
        make_plan(inv, "r", {}, strict=True)
    with pytest.raises(UserError, match="no interface routes to master"):
        make_plan(inv, "r", {"a": Facts(arch="amd64")}, strict=True)
    plan = make_plan(inv, "r", {"a": Facts(arch="arm64", ifname="eth0", home="/home/pi")}, strict=True)
    assert plan.nodes[0].image == "t:arm" and plan.nodes[0].run_dir == "/home/pi/runner/runs/r"


def test_dry_run_masks_secrets_and_opens_nothing(tmp_path, no_network, capsys):
    p = inventory(tmp_path, NODES3)
    rc, out = run_cli("up", "--inventory", str(p), "--dry-run", "--", "--train_steps", "7")
    assert rc == 0
    assert SECRET not in out + capsys.readouterr().err
    assert f"HF_TOKEN={MASK}" in out and "visible-would-leak" not in out
    assert "[m/0] 10.9.0.1" in out and "[w1/1] 10.9.0.2" in out and "[w2/2] 10.9.0.3" in out
    assert "--train_steps 7" in out and "--node-rank 2" in out
    assert "GLOO_SOCKET_IFNAME=<probed at launch>" in out


def test_dry_run_shows_an_inventorys_escapes_and_newlines_instead_of_sending_them(tmp_path, no_network):
    """Found by an audit: the plan went to the terminal raw, so a job.env value could retitle the
    window (OSC 0), clear the screen, or start a line of its own that reads like the plan's."""
    job = "  args: [\"\\e[31mred\"]\n"
    p = inventory(tmp_path, NODES3, job)
    p.write_text(p.read_text().replace("OMP_NUM_THREADS: '2'", 'MSG: "ok\\e]0;owned\\a\\e[2J\\nFAKE LINE"'))
    rc, out = run_cli("up", "--inventory", str(p), "--dry-run")
    assert rc == 0
    assert "\x1b" not in out and "\x07" not in out
    assert not any(ln.startswith("FAKE LINE") for ln in out.splitlines())
    assert "    env       MSG=ok^[]0;owned^G^[[2J^JFAKE LINE" in out.splitlines()
    assert "'^[[31mred'" in out


def test_dry_run_of_10000_nodes_plans_every_node_with_its_rank_and_env(tmp_path, no_network):
    """The 10,000-node dry-run of docs/performance.md (bench/fanout.py's generated inventory, whose timing is the
    benchmark's): every node planned once, in inventory order, with its rank, its torchrun and its
    env, master n0; nothing contacted."""
    from bench.fanout import generated_inventory

    n = 10_000
    rc, out = run_cli("up", "-i", str(generated_inventory(tmp_path, n)), "--dry-run")
    assert rc == 0
    head, *blocks = out.split("\n[")
    assert head == f"run <new run id>: {n} node(s), master n0 (10.0.0.0:<auto>), static rendezvous\n{DRY_LAUNCH}"
    assert len(blocks) == n
    env_same = {"GLOO_SOCKET_IFNAME": "<probed at launch>", "NCCL_SOCKET_IFNAME": "<probed at launch>",
                "MASTER_ADDR": "10.0.0.0", "MASTER_PORT": "<auto>", "NNODES": str(n), "OMP_NUM_THREADS": "1",
                "OUTPUT_DIR": "/out", "PET_SHUTDOWN_TIMEOUT": "28", "PYTHONUNBUFFERED": "1", "RUN_ID": "<new run id>",
                "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
    for i, block in enumerate(blocks):
        lines = block.rstrip("\n").split("\n")
        host = f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"
        assert lines[0] == f"n{i}/{i}] {host}  arch=amd64  image=runner-trainer:latest", lines[0]
        assert lines[1].startswith(f"    container runner-<new run id>-n{i}  network=host  "), lines[1]
        assert lines[2] == "    run dir   ~/runner/runs/<new run id> -> /out"
        assert lines[3] == (f"    command   torchrun --nnodes {n} --node-rank {i} --nproc-per-node 1 --master-addr "
                            "10.0.0.0 --master-port '<auto>' --rdzv-backend static --max-restarts 0 --no-python "
                            "python -c 'print(1)'"), lines[3]
        env = dict(ln.removeprefix("    env       ").split("=", 1) for ln in lines[4:])
        assert env == {**env_same, "NODE_NAME": f"n{i}", "NODE_RANK": str(i)}, (i, env)


@pytest.mark.parametrize("name", ["pis.yaml", "ec2.yaml"])
def test_dry_run_shipped_inventories_no_connection(tmp_path, no_network, name, monkeypatch):
    # A laptop without the cluster's keys: a dry-run opens no key or known_hosts file (not even
    # to find it missing) and no socket.
    monkeypatch.setenv("HOME", str(tmp_path))
    p = shipped(name, tmp_path)
    with opened_files() as opened:
        rc, out = run_cli("up", "--inventory", str(p), "--dry-run")
    assert rc == 0
    assert [f for f in opened if f.startswith(f"{tmp_path}/.ssh/") and f != f"{tmp_path}/.ssh/config"] == []
    assert str(p) in opened  # (the hook sees what is opened)
    if name == "pis.yaml":
        for i, host in enumerate(("192.168.1.10", "192.168.1.11", "192.168.1.12")):
            assert f"[pi-{i}/{i}] {host}  arch=arm64  image=runner-trainer:arm64" in out
        assert "--train_steps 5 --batch_size 16 --microbatch_num 4 --profile_batch 1" in out
        assert "MASTER_ADDR=192.168.1.10" in out and "--nnodes 3" in out
    else:
        assert "--nproc-per-node 4" in out and "gpus=all" in out and "MASTER_PORT=29500" in out


def test_mixed_arch_dry_run_with_given_arch(tmp_path, no_network):
    p = inventory(tmp_path, "  - {name: a, host: 10.9.0.1}\n  - {name: b, host: 10.9.0.2}\n")
    rc, out = run_cli("up", "--inventory", str(p), "--dry-run", "--arch", "a=amd64", "--arch", "b=aarch64")
    assert rc == 0
    assert "[a/0] 10.9.0.1  arch=amd64  image=t:amd" in out and "[b/1] 10.9.0.2  arch=arm64  image=t:arm" in out


# --- runner up --resume: which checkpoint, and which files go where (runner/delivery/resume_sync.py) ---------

RANK0_FILES = {".metadata": 900, "trainer_state.json": 400, "config.yaml": 300}


def _node_files(rank: int, shard: int) -> dict[str, int]:
    """What the trainer leaves on node `rank` (one rank per node, no shared storage)."""
    return {**RANK0_FILES, f"__{rank}_0.distcp": shard, f"rank{rank}.pt": 50, f"manifest.rank{rank}.json": 120}


def _ddp3(name: str = "step-3", latest: str | None = "step-3") -> dict[str, Listing]:
    # DDP: rank 0 wrote every replicated tensor (big shard); ranks 1, 2 almost nothing.
    return {f"node-{k}": Listing(latest, {name: _node_files(k, 5000 if k == 0 else 10)}) for k in range(3)}


def _desc(listings: dict[str, Listing], name: str = "step-3", step: int = 3) -> Description:
    manifests = {k: {f: (listings[f"node-{k}"].checkpoints[name][f], None)
                     for f in (f"__{k}_0.distcp", f"rank{k}.pt")} for k in range(3)}
    manifests[0].update({f: (s, None) for f, s in RANK0_FILES.items()})
    return Description(step=step, world_size=3, manifests=manifests)


def _hashes(listings: dict[str, Listing], name: str = "step-3", **override: str) -> dict[str, dict[str, str]]:
    return {n: {f: override.get(f"{n}:{f}", f"sha-{f}") for f in li.checkpoints[name]} for n, li in listings.items()}


def test_resume_sync_each_node_gets_exactly_what_it_lacks():
    li = _ddp3()
    assert incomplete("step-3", li, _desc(li)) is None
    copies = plan_copies("step-3", li, _hashes(li))
    got = {(c.file, c.src, c.dst) for c in copies}
    want = set()
    for k in range(3):
        for f in (f"__{k}_0.distcp", f"rank{k}.pt", f"manifest.rank{k}.json"):
            want |= {(f, f"node-{k}", f"node-{j}") for j in range(3) if j != k}
    assert got == want  # the files every node already has (.metadata, ...) are never copied
    big = [c for c in copies if c.file == "__0_0.distcp"]
    assert [(c.dst, c.size, c.sha256) for c in big] == [("node-1", 5000, "sha-__0_0.distcp"),
                                                        ("node-2", 5000, "sha-__0_0.distcp")]
    # After the copies every node holds the union.
    union = {f for li_ in li.values() for f in li_.checkpoints["step-3"]}
    for n, li_ in li.items():
        assert set(li_.checkpoints["step-3"]) | {c.file for c in copies if c.dst == n} == union


def test_resume_sync_never_replaces_and_spreads_sources():
    # node-1 already has node-0's big shard (an earlier, interrupted sync): it is not a destination,
    # and it serves the file to node-2 because node-0 is busier.
    li = _ddp3()
    li["node-1"].checkpoints["step-3"]["__0_0.distcp"] = 5000
    li["node-0"].checkpoints["step-3"]["big-extra.pt"] = 9000
    li["node-1"].checkpoints["step-3"]["big-extra.pt"] = 9000
    copies = plan_copies("step-3", li, _hashes(li))
    assert not [c for c in copies if c.dst == "node-1" and c.file in ("__0_0.distcp", "big-extra.pt")]
    srcs = {c.file: c.src for c in copies if c.dst == "node-2" and c.file in ("__0_0.distcp", "big-extra.pt")}
    assert sorted(srcs.values()) == ["node-0", "node-1"]  # one each, not both from node-0
    assert all(isinstance(c, Copy) and c.src != c.dst for c in copies)


def test_resume_sync_conflicting_copies_refused():
    li = _ddp3()
    with pytest.raises(UserError, match=r"step-3: \.metadata differs between node-0, node-1, node-2"):
        plan_copies("step-3", li, _hashes(li, **{"node-2:.metadata": "other"}))


def test_resume_sync_incomplete_unions():
    li = _ddp3()
    d = _desc(li)
    # A rank's manifest nowhere.
    short = {n: Listing(x.latest, {"step-3": {f: s for f, s in x.checkpoints["step-3"].items()
                                               if f != "manifest.rank2.json"}}) for n, x in li.items()}
    assert "manifest.rank2.json (rank 2's shard set) is on no node" in incomplete("step-3", short, Description(
        3, 3, {k: v for k, v in d.manifests.items() if k != 2}))
    # A listed shard nowhere.
    gone = {n: Listing(x.latest, {"step-3": {f: s for f, s in x.checkpoints["step-3"].items() if f != "__1_0.distcp"}})
            for n, x in li.items()}
    assert incomplete("step-3", gone, d) == "step-3/__1_0.distcp (listed in manifest.rank1.json) is on no node"
    # Two nodes disagree on a size; a size that differs from the manifest.
    li2 = _ddp3()
    li2["node-2"].checkpoints["step-3"][".metadata"] = 899
    assert incomplete("step-3", li2, d) == "step-3/.metadata is 900 bytes on node-0 but 899 on node-2"
    li3 = _ddp3()
    li3["node-0"].checkpoints["step-3"]["__0_0.distcp"] = 4000
    assert "__0_0.distcp is 4000 bytes on node-0, manifest.rank0.json says 5000" in incomplete("step-3", li3, d)
    assert incomplete("step-3", li, Description(3, None, d.manifests)) == "step-3/trainer_state.json is unreadable"


def test_resume_sync_candidates_order():
    both = {f"node-{k}": Listing("step-4", {"step-2": {}, "step-4": {}, "step-3.preempt": {}}) for k in range(2)}
    steps = {"step-2": 2, "step-4": 4, "step-3.preempt": 3}
    assert candidates(both, steps) == ["step-4", "step-3.preempt", "step-2"]
    # Every node's latest names step-2 (say, step-4 was saved by another run layout): it goes first.
    pinned = {n: Listing("step-2", li.checkpoints) for n, li in both.items()}
    assert candidates(pinned, steps)[0] == "step-2"
    # A crash between two nodes' renames: step-6 only on node-0, latests differ -> newest first;
    # whether node-0's copy holds node-1's files too (checkpoint.replicas) is `incomplete`'s to say.
    split = {"node-0": Listing("step-6", {"step-4": {}, "step-6": {}}), "node-1": Listing("step-4", {"step-4": {}})}
    assert candidates(split, {"step-4": 4, "step-6": 6}) == ["step-6", "step-4"]
    # Same step: the trainer's own tie-break, (step, name) -> the .preempt one.
    tie = {"n": Listing(None, {"step-6": {}, "step-6.preempt": {}})}
    assert candidates(tie, {"step-6": 6, "step-6.preempt": 6}) == ["step-6.preempt", "step-6"]


def test_torchrun_shutdown_timeout_follows_the_grace_period(tmp_path):
    # A big model's preempt checkpoint may need minutes: torchrun must not SIGKILL the ranks at its
    # own 30 s default while `down` still waits.
    inv = load_inventory(inventory(tmp_path, NODES3, "  grace_period: 180\n"))
    plan = make_plan(inv, "r", {n: Facts(ifname="eth0") for n in ("m", "w1", "w2")}, master_port=29500, strict=True)
    assert {n.env["PET_SHUTDOWN_TIMEOUT"] for n in plan.nodes} == {"178"}
    assert {n.labels["io.runner.grace-period"] for n in plan.nodes} == {"180.0"}


def test_gated_workers_wait_for_the_go_file_and_the_master_does_not(tmp_path):
    inv = load_inventory(inventory(tmp_path, NODES3, "  master_port: 29555\n  args: [--train_steps, '5']\n"))
    facts = {"m": Facts(ifname="eth0", gate="runner.agents.gate"), "w1": Facts(ifname="eth0", gate="runner.agents.gate"),
             "w2": Facts(ifname="eth0")}  # w2's image has no gate: started after the master
    plain = make_plan(inv, "r1", facts, strict=True)
    plan = make_plan(inv, "r1", facts, strict=True, launch_token="t0k3n", gate_timeout=180)
    m, w1, w2 = plan.nodes
    assert m.go_file is None and m.command == plain.nodes[0].command  # the master never waits
    assert w2.go_file is None and w2.command == plain.nodes[2].command
    assert [n.go_file for n in plain.nodes] == [None, None, None]      # no token: no gate
    wd = w1.workdir
    assert w1.go_file == f"{wd}/gates/r1/go-t0k3n"
    assert w1.mounts == {"/out": w1.run_dir, "/run/runner/gate": f"{wd}/gates/r1"}
    torchrun = plain.nodes[1].command
    assert torchrun[0] == "torchrun"
    assert w1.command == ["python", "-m", "runner.agents.gate", "/run/runner/gate/go-t0k3n", "180", "--", *torchrun[1:]]



def test_an_image_with_the_mended_torchrun_runs_it_on_the_master(tmp_path):
    """Label io.runner.gate "3" (this project's image): the master runs runner.agents.torchrun with
    torchrun's own arguments, the workers the gate (which runs it too); "2" (an older image of this
    project) keeps the torchrun on PATH, and an image without the label is left as it was."""
    from runner.planning.plan import GATE_MODULES, TORCHRUN_MODULES

    inv = load_inventory(inventory(tmp_path, NODES3, "  master_port: 29555\n"))

    def facts(label):
        return Facts(ifname="eth0", gate=GATE_MODULES.get(label), torchrun=TORCHRUN_MODULES.get(label))

    plain = make_plan(inv, "r1", {n: Facts(ifname="eth0") for n in ("m", "w1", "w2")}, strict=True).nodes
    m, w1, w2 = make_plan(inv, "r1", {"m": facts("3"), "w1": facts("3"), "w2": facts("2")}, strict=True,
                          launch_token="t0k3n", gate_timeout=180).nodes
    torchrun = plain[0].command
    assert torchrun[0] == "torchrun"
    assert m.command == ["python", "-m", "runner.agents.torchrun", *torchrun[1:]]
    assert w1.command == ["python", "-m", "runner.agents.gate", "/run/runner/gate/go-t0k3n", "180", "--",
                          *plain[1].command[1:]]
    assert w2.command == w1.command[:3] + ["/run/runner/gate/go-t0k3n", "180", "--", *plain[2].command[1:]]
    assert GATE_MODULES.get("0") is None and TORCHRUN_MODULES.get("2") is None
    # The dry-run, which reads no label, says what such an image runs in place of the `torchrun`
    # it shows; a plan whose every node was probed shows what runs and no such line.
    launch = [ln for ln in make_plan(inv, "r1", {n: Facts(ifname="eth0") for n in ("m", "w1", "w2")}).render()
              .splitlines() if ln.startswith("  launch ")]
    assert launch == [DRY_LAUNCH]
    probed = make_plan(inv, "r1", {n: facts("3") for n in ("m", "w1", "w2")}, launch_token="t0k3n").render()
    assert "  launch " not in probed and "    command   python -m runner.agents.torchrun --nnodes 3 " in probed

def test_containers_run_as_the_ssh_users_uid_gid(tmp_path, no_network):
    """A non-root SSH user's containers run as its uid:gid with a writable HOME (the image has no
    passwd entry for it) and USER (getpass); root keeps the image's own user and env. The
    dry-run shows it: probed for `pi`, the image's for root."""
    nodes = ("  - {name: m, host: 10.9.0.1, arch: amd64, role: master, user: pi}\n"
             "  - {name: w1, host: 10.9.0.2, arch: amd64}\n")
    p = inventory(tmp_path, nodes, "  master_port: 29555\n")
    inv = load_inventory(p)
    facts = {"m": Facts(ifname="eth0", uid=1000, gid=1001, user="pi"), "w1": Facts(ifname="eth0", uid=0, gid=0)}
    m, w1 = make_plan(inv, "r", facts, strict=True).nodes
    assert (m.user, m.env["HOME"], m.env["USER"]) == ("1000:1001", "/tmp", "pi")
    assert w1.user is None and "HOME" not in w1.env and "USER" not in w1.env
    nameless = {**facts, "m": Facts(ifname="eth0", uid=1000, gid=1001)}  # `id -un` printed nothing
    assert make_plan(inv, "r", nameless, strict=True).nodes[0].env["USER"] == "1000"
    # The job's env may set its own HOME.
    inv.job.env["HOME"] = "/data/home"
    assert make_plan(inv, "r", facts, strict=True).nodes[0].env["HOME"] == "/data/home"
    assert make_plan(inv, "r", facts, strict=True).as_dict()["nodes"][0]["user"] == "1000:1001"
    rc, out = run_cli("up", "-i", str(p), "--dry-run")
    assert rc == 0
    assert "container runner-<new run id>-m  network=host  user=<probed at launch>  gpus=none" in out, out
    assert "container runner-<new run id>-w1  network=host  user=image default  gpus=none" in out, out


def test_a_direct_plan_runs_a_one_rank_node_without_torchrun(tmp_path, no_network):
    """An in-place newcomer (runner/backends/ssh/elastic_loop.py joiner): one rank, its place from
    regroup.json, so no torchrun agent importing torch beside it; a node of two ranks keeps torchrun."""
    inv = load_inventory(inventory(tmp_path, NODES3, "  master_port: 29555\n  args: [--train_steps, '5']\n"))
    facts = {"m": Facts(ifname="eth0"), "w1": Facts(ifname="wlan0"), "w2": Facts(ifname="eth1")}
    plan = make_plan(inv, "20260101-000000-abcd", facts, secret_keys=list(inv.job.secrets()), strict=True,
                     direct=True)
    m, w1, _ = plan.nodes
    # the env_file still sourced in the container, the trainer exec'd as its process
    assert w1.command == ["/bin/sh", "-c", 'set -a; . /run/runner/secrets.env; set +a; exec "$@"', "runner-env",
                          "python", "-m", "trainer", "--config", "/out/config.yaml", "--train_steps", "5"]
    assert "torchrun" in m.command and m.command[m.command.index("--nproc-per-node") + 1] == "2"
    plain = load_inventory(inventory(tmp_path, NODES3, "  command: [python, my.py]\n"))
    plain.job.env_file = None
    got = make_plan(plain, "r", facts, master_port=29555, strict=True, direct=True).nodes[1].command
    assert got == ["python", "my.py"]
