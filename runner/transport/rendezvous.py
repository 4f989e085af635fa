"""The master's rendezvous port (torchrun's TCPStore): picked free on the master just before its
container starts (not from the preflight probe, minutes earlier, before the push), and taken as
listening only when the listening socket belongs to the master's container: workers must never
be sent to another run's store that happens to hold the port.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time

from runner.core.errors import JobFailed, UserError
from runner.planning.plan import NodePlan
from runner.transport.container_logs import log_tail
from runner.transport.ssh import Remote

log = logging.getLogger("runner.up")
# master_port auto: the first free port from AUTO_PORT_BASE + (0..AUTO_PORT_OFFSETS-1, from the run
# id), searching AUTO_PORT_SPAN ports. `runner check` reports on the same window.
AUTO_PORT_BASE, AUTO_PORT_OFFSETS, AUTO_PORT_SPAN = 29500, 400, 500
POLL_S = 0.1


def port_offset(run_id: str) -> int:
    """0..AUTO_PORT_OFFSETS-1 from the run id (any string: `--resume myrun` too), so two concurrent
    launches on one master rarely try the same port."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:4], "big") % AUTO_PORT_OFFSETS


def pick_master_port(listening: set[int], run_id: str) -> int:
    """First port nothing listens on, from the run id's place in torchrun's default neighbourhood."""
    start = AUTO_PORT_BASE + port_offset(run_id)
    for p in range(start, start + AUTO_PORT_SPAN):
        if p not in listening:
            return p
    raise UserError(f"no free master port in {start}..{start + AUTO_PORT_SPAN - 1} on the master; set job.master_port")


def choose_port(master: Remote, wanted: int | str, run_id: str) -> int:
    """job.master_port, checked free now, or for `auto` the first free one now."""
    listening = master.listening_ports()
    if wanted == "auto":
        return pick_master_port(listening, run_id)
    if int(wanted) in listening:
        raise UserError(f"master {master.node.name}: master_port {wanted} is already in use; "
                        "choose another or use master_port: auto")
    return int(wanted)


def container_sockets(container) -> set[str] | None:
    """Socket inodes held by the container's processes (its own /proc: its PID namespace), or
    None when the image cannot tell (no sh)."""
    try:
        res = container.exec_run(["sh", "-c", "ls -l /proc/[0-9]*/fd 2>/dev/null"])
    except Exception as exc:  # noqa: BLE001 - the engine refused the exec: cannot tell
        log.debug("socket check in %s: %s", container.name, exc)
        return None
    if res.exit_code not in (0, 1, 2):
        return None
    return {m.decode() for m in re.findall(rb"socket:\[(\d+)\]", res.output or b"")}


def wait_listening(remote: Remote, np: NodePlan, port: int, timeout: float) -> None:
    """Poll the master node until the master container's own socket listens on the port."""
    deadline = time.time() + timeout
    c = remote.docker().containers.get(np.container)
    i, foreign = 0, False
    while time.time() < deadline:
        inodes = remote.listeners().get(port)
        if inodes:
            mine = container_sockets(c)
            if mine is None or inodes & mine:
                return  # an image without sh cannot tell: the port was free when the master started
            if not foreign:
                log.warning("[%s/0] port %d is held by a process outside the master's container; waiting for "
                            "the master's own", np.node, port)
            foreign = True
        i += 1
        if i % 5 == 0 or foreign:
            c.reload()
            if c.status not in ("running", "created"):
                code = c.exit_code
                if code == 0 and not foreign:
                    return  # a job this short (one node) may finish before we look
                tail = [ln for ln in log_tail(c, 10) if ln.strip()]
                raise JobFailed(f"node {np.node}: master container exited ({code}) before its port {port} listened"
                                + (" (another process holds that port)" if foreign else "")
                                + f"; last line: {tail[-1][:300] if tail else '(no output)'}")
        time.sleep(POLL_S if not foreign else 0.5)
    raise UserError(f"node {np.node}: master port {port} did not listen within {timeout:.0f}s "
                    f"(--rendezvous-timeout); check `runner logs --node {np.node}`"
                    + ("; another process holds that port" if foreign else ""))
