"""A job container answers the lookups torch makes of names without a DNS server (issue 58), on the
namespaced sandbox, whose nodes have none in reach: every lookup that reaches the resolver waits it
out (10 s: 5 s x 2 tries). torchrun's agent calls socket.getfqdn() on the node's hostname for each
event it records (torch/distributed/elastic/agent/server/api.py _get_fq_hostname) and c10d looks up
the name of each store connection's address. Docker writes the container's /etc/hosts itself once
it is given extra lines, and that file did not hold the node's hostname: a newcomer's torchrun took
22.8 s from its container's start to its trainer's exec (bench/elastic.py `exec_s`; 2.4 s with the
name answered). Here each node's container looks up its own hostname and the other nodes' names
with `getent hosts` (files and DNS, as glibc does for torch): each answers from /etc/hosts, with the
node's own address, or exits 2 (no DNS answer) and the test fails."""

from __future__ import annotations

import pytest
import yaml

from tests import IMAGE
from tests.sandbox.test_elastic_sandbox import NODES, existing_runs, first_run_id, run_dirs
from tests.support.runner_helpers import runner

pytestmark = [pytest.mark.sandbox, pytest.mark.docker]

# `getent ahostsv4`: the IPv4 answer (the plain `hosts` database prints the IPv6-mapped line first)
LOOKUP = ("h=$(cat /proc/sys/kernel/hostname); echo \"$h\" > /out/hostname; "
          "for n in \"$h\" node-0 node-1 node-2; do getent ahostsv4 \"$n\" > /out/lookup; "
          "echo \"$n $? $(head -1 /out/lookup)\"; done > /out/names.txt")


def test_each_container_answers_its_hostname_and_the_nodes_names_from_etc_hosts(netns_sandbox, tmp_path):
    inv, net = netns_sandbox["inv"], netns_sandbox["net"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"job": {"image": IMAGE, "command": ["sh", "-c", LOOKUP], "master_port": "auto",
                                           "grace_period": 5}}))
    since = existing_runs(inv)
    proc = runner("up", "-i", str(inv), "--job", str(job), "--logs-dir", str(tmp_path / "logs"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = run_dirs(inv, first_run_id(inv, since))
    addrs = {n: net.addr(i) for i, n in enumerate(NODES)}
    for n in NODES:
        host = (runs[n] / "hostname").read_text().strip()
        rows = [line.split() for line in (runs[n] / "names.txt").read_text().splitlines()]
        # name, getent's exit code (0: answered; 2: not found, after the resolver's wait), address, STREAM, name
        assert rows == [[host, "0", addrs[n], "STREAM", host]] + [[m, "0", addrs[m], "STREAM", m] for m in NODES], \
            (n, rows)
