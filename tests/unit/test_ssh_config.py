"""The user's ssh config applied to the inventory (issue 12, part 2), without a network: Host
aliases, the inventory-wins rule, `ssh_config: none`, one bastion hop only, and values that would
reach an argv or a shell refused in one line naming the inventory file, line and node."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from runner.core.errors import UserError
from runner.inventory import Jump, load_inventory
from runner.inventory.ssh_config import parse_jump
from runner.transport.jump import proxy_command

# Addresses from the documentation ranges (RFC 5737): parsed, never contacted (no_network).
CONFIG = """\
Host gpu-*
    User admin
    Port 2200
    IdentityFile {key}
    ProxyJump jump
Host gpu-0
    HostName 10.0.1.10
Host gpu-1
    HostName 10.0.1.11
Host jump
    HostName 198.51.100.7
    User jumper
    Port 2022
    IdentityFile {bkey}
"""


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for k in ("key", "bkey", "inv_key"):
        out[k] = tmp_path / k
        out[k].write_text("not a real key: only its existence is checked\n")
    return out


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    """A HOME of its own, so ~/.ssh/config is what the test writes (or nothing)."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    return h


def _write(tmp_path: Path, config: str, inventory: str, keys: dict[str, Path]) -> Path:
    cfg = tmp_path / "ssh_config"
    cfg.write_text(config.format(**{k: str(v) for k, v in keys.items()}))
    inv = tmp_path / "inv.yaml"
    inv.write_text(inventory.format(cfg=cfg, **{k: str(v) for k, v in keys.items()}))
    return inv


def _error(inv: Path) -> str:
    with pytest.raises(UserError) as exc:
        load_inventory(inv)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{inv}:"), msg
    return msg


def test_an_alias_fills_hostname_user_port_identity_and_proxyjump(tmp_path, keys, home, no_network):
    inv = _write(tmp_path, CONFIG, "defaults: {{ssh_config: {cfg}}}\nnodes:\n  - {{name: a, host: gpu-0}}\n"
                 "  - {{name: b, host: gpu-1, addr: 10.9.9.9}}\n", keys)
    a, b = load_inventory(inv).nodes
    assert (a.host, a.user, a.port, a.identity_file) == ("10.0.1.10", "admin", 2200, str(keys["key"]))
    assert a.rank_addr == "10.0.1.10" and b.rank_addr == "10.9.9.9"  # HostName is where the ranks meet too
    assert a.proxy_jump == Jump("198.51.100.7", 2022, "jumper", str(keys["bkey"]))
    assert str(a.proxy_jump) == "jumper@198.51.100.7:2022"
    assert a.ssh_config == str(tmp_path / "ssh_config")


def test_the_inventory_wins_over_the_ssh_config(tmp_path, keys, home, no_network):
    inv = _write(tmp_path, CONFIG,
                 "defaults: {{ssh_config: {cfg}, user: ubuntu}}\nnodes:\n"
                 "  - {{name: a, host: gpu-0, port: 22, identity_file: {inv_key}, proxy_jump: 'ops@203.0.113.9:2'}}\n"
                 "  - {{name: b, host: gpu-1, proxy_jump: none}}\n", keys)
    a, b = load_inventory(inv).nodes
    assert (a.host, a.user, a.port, a.identity_file) == ("10.0.1.10", "ubuntu", 22, str(keys["inv_key"]))
    # The inventory's bastion is still looked up in the config (nothing there for it): the node's
    # identity_file is its key.
    assert a.proxy_jump == Jump("203.0.113.9", 2, "ops", str(keys["inv_key"]))
    assert (b.user, b.port, b.proxy_jump) == ("ubuntu", 2200, None)


def test_home_ssh_config_is_the_default_and_none_turns_it_off(tmp_path, keys, home, no_network):
    (home / ".ssh").mkdir()
    (home / ".ssh" / "config").write_text(CONFIG.format(key=keys["key"], bkey=keys["bkey"]))
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes:\n  - {name: a, host: gpu-0}\n")
    (a,) = load_inventory(inv).nodes
    assert (a.host, a.user, a.ssh_config) == ("10.0.1.10", "admin", str(home / ".ssh" / "config"))
    inv.write_text("defaults: {ssh_config: none}\nnodes:\n  - {name: a, host: gpu-0}\n")
    (a,) = load_inventory(inv).nodes
    assert (a.host, a.user, a.port, a.proxy_jump, a.ssh_config) == ("gpu-0", "root", 22, None, None)
    (home / ".ssh" / "config").unlink()
    inv.write_text("nodes:\n  - {name: a, host: gpu-0}\n")
    assert load_inventory(inv).nodes[0].host == "gpu-0"  # no file, nothing applied


def test_a_missing_ssh_config_is_named_unless_only_planning(tmp_path, home, no_network):
    inv = tmp_path / "inv.yaml"
    inv.write_text("defaults:\n  ssh_config: /nonexistent/ssh_config\nnodes:\n  - {name: a, host: gpu-0}\n")
    assert ":2: defaults.ssh_config: file not found: /nonexistent/ssh_config" in _error(inv)
    assert load_inventory(inv, check_files=False).nodes[0].host == "gpu-0"  # --dry-run on a laptop


@pytest.mark.parametrize("config, field, expected", [
    ("Host gpu-0\n  ProxyJump a.example,b.example\n", "nodes[0].proxy_jump",
     "ProxyJump 'a.example,b.example' is a chain of 2 jump hosts; only one bastion is supported"),
    ("Host gpu-0\n  ProxyJump jump\nHost jump\n  ProxyJump other\n", "nodes[0].proxy_jump",
     "bastion 'jump' in {cfg} has ProxyJump 'other' of its own: a chain of jump hosts"),
    ("Host gpu-0\n  ProxyJump jump\nHost jump\n  ProxyCommand nc %h %p\n", "nodes[0].proxy_jump",
     "bastion 'jump' in {cfg} has a ProxyCommand of its own"),
    ("Host gpu-0\n  ProxyCommand ssh -W %h:%p jump\n", "nodes[0].host",
     "'gpu-0' in {cfg}: ProxyCommand is not supported"),
])
def test_more_than_one_hop_is_refused_in_one_line(tmp_path, keys, home, no_network, config, field, expected):
    inv = _write(tmp_path, config, "defaults: {{ssh_config: {cfg}}}\nnodes:\n  - {{name: a, host: gpu-0}}\n", keys)
    msg = _error(inv)
    assert f"{inv}:3: {field}: " in msg and expected.format(cfg=tmp_path / "ssh_config") in msg, msg
    assert msg.endswith("(node a)"), msg


def test_a_chain_in_the_inventory_is_refused_where_it_is_written(tmp_path, home, no_network):
    inv = tmp_path / "inv.yaml"
    inv.write_text("defaults:\n  proxy_jump: a.example,b.example\nnodes:\n  - {name: a, host: gpu-0}\n")
    assert ":2: defaults.proxy_jump: 'a.example,b.example' is a chain of 2 jump hosts" in _error(inv)


def test_host_star_proxyjump_does_not_loop_through_the_bastion_itself(tmp_path, keys, home, no_network):
    # ssh ignores a ProxyJump that names the destination itself; so does the runner.
    inv = _write(tmp_path, "Host jump\n  HostName 198.51.100.7\nHost *\n  ProxyJump jump\n",
                 "defaults: {{ssh_config: {cfg}}}\nnodes:\n  - {{name: a, host: 10.0.1.10}}\n", keys)
    assert load_inventory(inv).nodes[0].proxy_jump == Jump("198.51.100.7")


@pytest.mark.parametrize("config, field, expected", [
    ("Host gpu-0\n  HostName -oProxyCommand=touch/tmp/pwned\n", "host", "HostName '-oProxyCommand=touch/tmp/pwned' is not"),
    ("Host gpu-0\n  HostName a;reboot\n", "host", "HostName 'a;reboot' is not an IP address or host name"),
    ("Host gpu-0\n  User -oProxyCommand=x\n", "user", "User '-oProxyCommand=x' is not a user name"),
    ("Host gpu-0\n  User \"a b\"\n", "user", "User 'a b' is not a user name"),
    ("Host gpu-0\n  User root$(id)\n", "user", "is not a user name"),
    ("Host gpu-0\n  Port 22;id\n", "port", "Port '22;id' is not a port in 1..65535"),
    ("Host gpu-0\n  Port 0\n", "port", "Port '0' is not a port"),
    ("Host gpu-0\n  ProxyJump -oProxyCommand=x\n", "proxy_jump", "'-oProxyCommand=x' is not an IP address or host name"),
    ("Host gpu-0\n  ProxyJump root@-x\n", "proxy_jump", "'-x' is not an IP address or host name"),
    ("Host gpu-0\n  ProxyJump -l@x\n", "proxy_jump", "'-l' is not a user name"),
    ("Host gpu-0\n  ProxyJump jump\nHost jump\n  HostName -F/tmp/x\n", "proxy_jump", "HostName '-F/tmp/x' is not"),
    ("Host gpu-0\n  ProxyJump jump\nHost jump\n  User `id`\n", "proxy_jump", "User '`id`' is not a user name"),
    ("Host gpu-0\n  IdentityFile /tmp/a\x01b\n", "identity_file", "has a control character"),
])
def test_hostile_values_from_the_config_are_refused(tmp_path, keys, home, no_network, config, field, expected):
    inv = _write(tmp_path, config, "defaults: {{ssh_config: {cfg}}}\nnodes:\n  - {{name: a, host: gpu-0}}\n", keys)
    msg = _error(inv)
    assert f"{inv}:3: nodes[0].{field}: " in msg and expected in msg and msg.endswith("(node a)"), msg


def test_an_unparsable_config_is_one_line(tmp_path, keys, home, no_network):
    inv = _write(tmp_path, "Host gpu-0\n  =novalue\n", "defaults: {{ssh_config: {cfg}}}\n"
                 "nodes:\n  - {{name: a, host: gpu-0}}\n", keys)
    assert "cannot use ssh config" in _error(inv)


@pytest.mark.parametrize("text, expected", [
    ("bastion", (None, "bastion", None)),
    ("ubuntu@bastion.example.com", ("ubuntu", "bastion.example.com", None)),
    ("ubuntu@198.51.100.7:2222", ("ubuntu", "198.51.100.7", 2222)),
    ("ssh://ops@bastion:22", ("ops", "bastion", 22)),
    ("[2001:db8::1]:22", (None, "2001:db8::1", 22)),
])
def test_jump_forms(text, expected):
    assert parse_jump(text) == expected


@pytest.mark.parametrize("text", ["", "a,b", "u@", "@h", "h:0", "h:99999", "h:x", "2001:db8::1", "-J", "h/p",
                                  "u@h@h"])
def test_bad_jump_forms(text):
    with pytest.raises(ValueError):
        parse_jump(text)


def test_the_streams_proxycommand_quotes_every_piece():
    """What reaches OpenSSH's ProxyCommand (run by a shell, % expanded): an identity path with
    blanks, quotes and % comes back intact from the shell's own split."""
    key = "/home/u/my keys/it's 100%.pem"
    opts = ["-F", "/dev/null", "-o", "StrictHostKeyChecking=yes", "-o", "UserKnownHostsFile=/tmp/kh dir/known_hosts"]
    cmd = proxy_command(Jump("198.51.100.7", 2022, "jumper", key), opts, "10.0.1.10", 2200)
    assert "%" not in cmd.replace("%%", "")  # the outer ssh expands no token of ours
    argv = shlex.split(cmd.replace("%%", "%"))
    assert argv == ["ssh", *opts, "-p", "2022", "-l", "jumper", "-i", key.replace("%", "%%"),
                    "-o", "IdentitiesOnly=yes", "-W", "10.0.1.10:2200", "198.51.100.7"]
    assert proxy_command(Jump("2001:db8::7"), [], "2001:db8::10", 22).split()[-2:] == ["'[2001:db8::10]:22'",
                                                                                         "2001:db8::7"]


def test_the_readme_bastion_examples_mean_what_they_say(tmp_path, home, no_network):
    from tests import REPO

    text = (REPO / "docs" / "inventory.md").read_text()
    section = text[text.index("**`~/.ssh/config` and bastions.**"):]
    inline = section[section.index("```yaml\n") + 8:section.index("```\n", section.index("```yaml\n") + 8)]
    config = section[section.index("```\nHost ") + 4:]
    config = config[:config.index("```")]
    key = str(home / ".ssh" / "ec2-training.pem")
    inv = tmp_path / "inline.yaml"
    inv.write_text(inline)
    gpu0, gpu1 = load_inventory(inv, check_files=False).nodes
    assert (gpu0.host, gpu0.user, gpu1.host) == ("10.0.1.10", "ubuntu", "10.0.1.11")
    assert gpu0.proxy_jump == Jump("203.0.113.7", 22, "ec2-user", key)
    cfg = tmp_path / "ssh_config"
    cfg.write_text(config)
    inv.write_text(f"defaults: {{ssh_config: {cfg}}}\nnodes:\n  - {{name: gpu-0, host: gpu-0}}\n")
    (n,) = load_inventory(inv, check_files=False).nodes
    assert (n.host, n.user, n.port, n.identity_file) == ("10.0.1.10", "ubuntu", 22, key)
    assert n.proxy_jump == Jump("203.0.113.7", 22, "ec2-user", key)
