"""Inventories and the files they name, read as an attacker would write them (issue 23): reading
runs nothing and asks nothing of the network (ssh configs with `Match exec`, an inventory that is
its own ssh_config), YAML that explodes while it is built, values with a trailing newline or a
spelling that hides what they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import load_inventory
from tests import REPO
from tests.support.runner_helpers import no_socket_env


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    h = tmp_path / "home"
    (h / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(h))
    return h


def _cli(tmp_path: Path, *args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI in a child where opening a socket or looking a name up is fatal."""
    env = no_socket_env(tmp_path)
    with open(tmp_path / "guard" / "sitecustomize.py", "a") as fh:
        fh.write("def _no_dns(*a, **k):\n    raise SystemExit('NAME LOOKUP')\n"
                 "for _f in ('getaddrinfo', 'gethostbyname', 'gethostbyname_ex', 'gethostbyaddr', 'getfqdn'):\n"
                 "    setattr(socket, _f, _no_dns)\n")
    if home is not None:
        env["HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)


MATCH_EXEC = """\
Match exec "touch {marker}"
    User mallory
Host gpu-0
    HostName 10.9.0.10
    User admin
    IdentityFile ~/.ssh/id_gpu
"""


def test_an_inventory_ssh_config_with_match_exec_runs_nothing(tmp_path, home, no_network):
    marker = tmp_path / "pwned"
    cfg = tmp_path / "ssh_config"
    cfg.write_text(MATCH_EXEC.format(marker=marker))
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"defaults: {{ssh_config: {cfg}}}\nnodes:\n  - {{name: a, host: gpu-0, arch: amd64}}\n")
    node = load_inventory(inv, check_files=False).nodes[0]
    assert not marker.exists(), "reading the inventory ran the ssh config's Match exec"
    assert (node.host, node.user) == ("10.9.0.10", "admin")  # the Host block still applies


def test_home_ssh_config_match_exec_runs_nothing_in_a_dry_run(tmp_path, home):
    marker = tmp_path / "pwned"
    (home / ".ssh" / "config").write_text(MATCH_EXEC.format(marker=marker))
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes:\n  - {name: a, host: gpu-0, arch: amd64}\njob:\n  image: t:1\n")
    proc = _cli(tmp_path, "up", "-i", str(inv), "--dry-run", home=home)
    assert not marker.exists(), "runner up --dry-run ran ~/.ssh/config's Match exec"
    assert proc.returncode == 0, proc.stderr
    assert "10.9.0.10" in proc.stdout


def test_an_inventory_that_is_its_own_ssh_config_runs_nothing(tmp_path, home):
    """Every line is both YAML and an ssh_config line; the last one hides `Match exec` in a job arg."""
    marker = tmp_path / "pwned"
    inv = tmp_path / "inv.yaml"
    inv.write_text("defaults : {ssh_config: ./inv.yaml}\n"
                   "nodes : [{name: a, host: gpu-0, arch: amd64}]\n"
                   "job : {image: t-1, args: [x,\n"
                   f'  Match exec "touch {marker}" host "*" user "q"]}}\n')
    for cmd in (("up", "-i", str(inv), "--dry-run"), ("export", "-i", str(inv), "--to", "kubernetes", "-o", str(tmp_path / "out.yaml"))):
        proc = _cli(tmp_path, *cmd, home=home)
        assert not marker.exists(), f"runner {cmd[0]} ran the inventory's own Match exec"
        assert proc.returncode == 0, proc.stderr


def test_a_match_block_for_other_hosts_is_silent_one_for_a_node_is_named(tmp_path, home, no_network, caplog):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Match host *.corp.example exec \"true\"\n    User worker\n"  # not for these nodes
                   "Match originalhost gpu-*\n    ProxyJump jump\n"           # for them: not applied, named
                   "Match all\n    ForwardAgent yes\n"                         # nothing the runner uses
                   "Host gpu-0\n    HostName 10.9.0.10\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"defaults: {{ssh_config: {cfg}}}\nnodes:\n  - {{name: a, host: gpu-0, arch: amd64}}\n"
                   "  - {name: b, host: gpu-1, arch: amd64}\n")
    with caplog.at_level("WARNING"):
        nodes = load_inventory(inv, check_files=False).nodes
    assert [n.proxy_jump for n in nodes] == [None, None]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and f"{cfg}:3:" in warned[0] and "ProxyJump" in warned[0], warned
    assert "worker" not in warned[0]


# --- YAML built from a few bytes into millions of values -----------------------------------------

ALIAS_BOMB = "".join(f"{k}: &{k} [{', '.join([f'*{p}' if p else 'x'] * 9)}]\n"
                     for p, k in zip(["", *"abcdefgh"], "abcdefghi", strict=True))


@pytest.mark.timeout(60)  # before: still expanding 9^9 values (26 s and 650 MB when killed)
@pytest.mark.parametrize("where", ["inventory", "job file", "slurm inventory"])
def test_a_yaml_alias_bomb_is_refused_before_it_is_built(tmp_path, where):
    from runner.inventory.slurm import load_slurm_inventory

    assert len(ALIAS_BOMB) < 1024
    bomb = tmp_path / "bomb.yaml"
    plain = tmp_path / "inv.yaml"
    plain.write_text("nodes:\n  - {name: a, host: 10.9.0.1, arch: amd64}\n")
    with pytest.raises(UserError) as exc:
        if where == "inventory":
            bomb.write_text(ALIAS_BOMB.replace("a: &a", "nodes: [{name: a, host: 10.9.0.1}]\na: &a"))
            load_inventory(bomb)
        elif where == "job file":
            bomb.write_text("job:\n  image: t:1\n" + ALIAS_BOMB)
            load_inventory(plain, job_path=str(bomb))
        else:
            bomb.write_text("slurm: {nodes: 1}\n" + ALIAS_BOMB)
            load_slurm_inventory(str(bomb))
    msg = str(exc.value)
    first = next(i for i, ln in enumerate(bomb.read_text().splitlines(), 1) if "&a" in ln)
    assert msg.startswith(f"{bomb}:{first}: YAML anchors and aliases") and "\n" not in msg, msg


def test_a_merge_key_is_an_alias_too(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("base: &base {arch: amd64}\nnodes:\n  - {<<: *base, name: a, host: 10.9.0.1}\n")
    with pytest.raises(UserError, match=rf"^{inv}:1: YAML anchors and aliases"):
        load_inventory(inv)


def test_yaml_nested_past_any_inventory_is_one_line(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes: [{name: a, host: 10.9.0.1}]\njob: {args: " + "[" * 900 + "]" * 900 + "}\n")
    with pytest.raises(UserError) as exc:  # a RecursionError traceback before
        load_inventory(inv)
    assert str(exc.value).startswith(f"{inv}:2: job.args") and "nested more than 32 levels" in str(exc.value)


# --- values: a trailing newline, a spelling that hides an address, a pin that cannot match, a mount
# that hands the job the node ------------------------------------------------------------------

def _inv(tmp_path: Path, node_b: str = "", job: str = "", host_b: str = "10.9.0.2") -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text("nodes:\n"
                 "  - {name: a, host: 10.9.0.1, arch: amd64}\n"
                 f"  - {{name: b, host: '{host_b}', arch: amd64{node_b}}}\n"
                 f"job:\n  image: t:1\n{job}")
    return p


def _refused(p: Path, where: str, why: str = "", **kw) -> str:
    with pytest.raises(UserError) as exc:
        load_inventory(p, check_files=False, **kw)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{p}:") and f": {where}: " in msg and why in msg, msg
    return msg


@pytest.mark.parametrize("node_b, job, where", [
    (', name: "b\\n"', "", "nodes[1].name"),
    (', addr: "10.9.0.2\\n"', "", "nodes[1].addr"),
    (', user: "ubuntu\\n"', "", "nodes[1].user"),
    (', host_key: "SHA256:' + "A" * 43 + '\\n"', "", "nodes[1].host_key"),
    (', workdir: "/srv/runner\\n"', "", "nodes[1].workdir"),
    ("", '  env: {"NAME\\n": x}\n', "job.env.NAME\\n"),  # the key shown escaped: still one line
    ("", '  mounts: {"/data\\n": /data}\n', "job.mounts./data\\n"),
    ("", '  mounts: {/data: "/data\\n"}\n', "job.mounts./data"),
])
def test_a_trailing_newline_is_refused_in_every_field(tmp_path, node_b, job, where):
    _refused(_inv(tmp_path, node_b, job), where)


def test_a_trailing_newline_in_host_or_image_is_refused(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text('nodes:\n  - {name: a, host: "gpu-0\\n", arch: amd64}\njob:\n  image: t:1\n')
    _refused(p, "nodes[0].host")
    p.write_text('nodes:\n  - {name: a, host: gpu-0, arch: amd64}\njob:\n  image: "t:1\\n"\n')
    _refused(p, "job.image")


@pytest.mark.parametrize("field, value", [
    ("partition", "gpu\\n"), ("account", "proj\\n"), ("qos", "high\\n"), ("time", "01:00:00\\n"),
    ("mem", "64G\\n"), ("workdir", "~/runner\\n"), ("image", "nvcr.io#nvidia/pytorch:24.01\\n"),
])
def test_slurm_values_with_a_newline_cannot_split_an_sbatch_line(tmp_path, field, value):
    """`#SBATCH --partition=gpu` + newline: sbatch stops reading directives at the first line that is
    not one, so every later #SBATCH line would be dropped without a word."""
    from runner.inventory.slurm import load_slurm_inventory

    p = tmp_path / "slurm.yaml"
    p.write_text(f'slurm:\n  nodes: 2\n  container: pyxis\n  {field}: "{value}"\njob:\n  image: t:1\n')
    with pytest.raises(UserError) as exc:
        load_slurm_inventory(str(p), check_files=False)
    assert str(exc.value).startswith(f"{p}:4: slurm.{field}: "), exc.value


def test_a_newline_in_an_sbatch_option_is_refused(tmp_path):
    from runner.inventory.slurm import load_slurm_inventory

    p = tmp_path / "slurm.yaml"
    p.write_text('slurm:\n  nodes: 2\n  sbatch: ["--constraint=a100\\n"]\njob:\n  image: t:1\n')
    with pytest.raises(UserError, match=r"slurm.yaml:3: slurm.sbatch\[0\]: "):
        load_slurm_inventory(str(p), check_files=False)


@pytest.mark.parametrize("host, canonical", [
    ("127.1", "127.0.0.1"), ("0x7f.1", "127.0.0.1"), ("2130706433", "127.0.0.1"), ("017.0.0.1", "15.0.0.1"),
    ("10.9.2", "10.9.0.2"),
])
def test_an_address_spelled_so_the_resolver_reads_another_is_refused(tmp_path, host, canonical):
    _refused(_inv(tmp_path, host_b=host), "nodes[1].host", f"read as the address {canonical}")


@pytest.mark.parametrize("first, second", [
    ("::1", "0:0::1"), ("10.9.0.1", "::ffff:10.9.0.1"), ("GPU-0.lan", "gpu-0.lan"), ("fe80::1%eth0", "FE80::1%eth0"),
])
def test_one_machine_under_two_spellings_is_a_duplicate(tmp_path, first, second):
    p = tmp_path / "inv.yaml"
    p.write_text(f"nodes:\n  - {{name: a, host: '{first}', arch: amd64}}\n  - {{name: b, host: '{second}', arch: amd64}}\n")
    _refused(p, "nodes[1].host", "is also node 'a'")


def test_ipv6_zone_ids_are_interface_names(tmp_path):
    _refused(_inv(tmp_path, host_b="fe80::1%$(reboot)"), "nodes[1].host", "interface name")
    _refused(_inv(tmp_path, host_b="fe80::1%a;b"), "nodes[1].host", "interface name")
    inv = load_inventory(_inv(tmp_path, host_b="FE80::0:1%eth0"), check_files=False)
    assert inv.nodes[1].host == "fe80::1%eth0"  # one spelling from here on


def test_a_pin_that_can_never_match_is_refused(tmp_path):
    never = "SHA256:" + "A" * 42 + "B"  # 43 base64 characters hold 258 bits: the last 2 must be 0
    _refused(_inv(tmp_path, f", host_key: '{never}'"), "nodes[1].host_key", "can never match")
    fine = "SHA256:" + "A" * 42 + "Q"
    assert load_inventory(_inv(tmp_path, f", host_key: '{fine}'"), check_files=False).nodes[1].host_key == fine


@pytest.mark.parametrize("mount, why", [
    ("/var/run/docker.sock: /var/run/docker.sock", "container engine socket"),   # read-only: still root
    ("/run/docker.sock: /d.sock", "container engine socket"),
    ("/srv/engine/docker.sock: /d.sock", "container engine socket"),
    ("/run: /hostrun", "container engine socket"),
    ("/: /host", "the node's whole filesystem"),
    ("/: '/host:rw'", "the node's whole filesystem"),
    ("/proc: /hostproc", "kernel interfaces"),
    ("/etc: '/hostetc:rw'", "system files or SSH keys, writable"),
    ("'~/.ssh': '/keys:rw'", "system files or SSH keys, writable"),
    ("/home: '/h:rw'", "system files or SSH keys, writable"),
])
def test_a_mount_that_hands_the_job_the_node_needs_its_name_in_unsafe_mounts(tmp_path, mount, why):
    node_path = mount.split(":")[0].strip("'")
    msg = _refused(_inv(tmp_path, job=f"  mounts: {{{mount}}}\n"), f"job.mounts.{node_path}", why)
    assert "job.unsafe_mounts" in msg
    inv = load_inventory(_inv(tmp_path, job=f"  mounts: {{{mount}}}\n  unsafe_mounts: ['{node_path}']\n"),
                         check_files=False)
    assert [m.node_path for m in inv.job.mounts] == [node_path]


def test_plain_data_mounts_need_no_opt_in_and_unsafe_mounts_must_name_a_mount(tmp_path):
    inv = load_inventory(_inv(tmp_path, job="  mounts: {/etc/ssl: /ssl, /nfs/ds: '/ds:rw', '~/hf': /hf}\n"),
                         check_files=False)
    assert len(inv.job.mounts) == 3
    _refused(_inv(tmp_path, job="  mounts: {/nfs: /nfs}\n  unsafe_mounts: [/]\n"), "job.unsafe_mounts",
             "'/' is not a job.mounts node path")


@pytest.mark.parametrize("job, where", [
    ("  mounts: {/data: //out}\n", "job.mounts./data"),
    ("  mounts: {/data: '//out:rw'}\n", "job.mounts./data"),
    ("  mounts: {/data: /data/../out}\n", "job.mounts./data"),
    ("  mounts: {/data/../var/run/docker.sock: /d}\n", "job.mounts./data/../var/run/docker.sock"),
    ("  mounts: {//run: /d}\n", "job.mounts.//run"),
    ("  mounts: {/srv/./x: /d}\n", "job.mounts./srv/./x"),
])
def test_paths_that_are_not_what_they_say_are_refused(tmp_path, job, where):
    """POSIX keeps a leading `//`, so `//out` passed a normpath comparison and did not overlap /out."""
    _refused(_inv(tmp_path, job=job), where, "normalized")


def test_sync_to_a_double_slash_out_is_refused(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    _refused(_inv(tmp_path, job=f"  sync: [{{src: {d}, dst: //out/x}}]\n"), "job.sync[0].dst", "normalized")


def test_one_node_path_at_two_mount_points_stays_two_mounts(tmp_path):
    from runner.delivery.sync import _HashCache, scan
    from runner.planning.plan import Facts, make_plan

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):  # equal contents: one tree on the node, mounted twice
        d.mkdir()
        (d / "w.bin").write_bytes(b"same")
    p = _inv(tmp_path, job=f"  sync: [{{src: {a}, dst: /sa}}, {{src: {b}, dst: /sb}}]\n"
                           "  mounts: {/data: /m1, /data/: /m2, '~/x': /m3, /home/u/x: '/m4:rw'}\n")
    inv = load_inventory(p, check_files=False)
    trees = scan(inv.job.sync, _HashCache(tmp_path / "h.json"))
    assert trees[0].digest == trees[1].digest
    facts = {n.name: Facts(arch="amd64", ifname="lo", home="/home/u") for n in inv.nodes}
    n = make_plan(inv, "r1", facts, master_port=29500, strict=True, trees=trees).node("a")
    tree = f"/home/u/runner/data/trees/{trees[0].digest}"
    assert {d: n.mounts[d] for d in ("/sa", "/sb", "/m1", "/m2", "/m3", "/m4")} == {
        "/sa": tree, "/sb": tree, "/m1": "/data", "/m2": "/data", "/m3": "/home/u/x", "/m4": "/home/u/x"}
    assert n.writable == frozenset({"/out", "/m4"})
