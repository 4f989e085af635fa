"""Whether a node's SSH port answers at all, before anything pays an SSH handshake."""

from __future__ import annotations

import socket

from runner.inventory import Node


def answers(node: Node, timeout: float = 1.0) -> bool:
    """Whether the node's SSH port takes a TCP connection within `timeout` (closed at once): a lost
    node's retry knocks this way before paying an SSH handshake. A full connect waits up to
    CONNECT_TIMEOUT while a link is down and only sees it come back at TCP's next SYN retry (1, 3,
    7 s into the attempt); a knock a second sees it within about a second. True for a node behind a
    bastion: only the bastion could tell, so the caller connects."""
    if node.proxy_jump is not None:
        return True
    try:
        socket.create_connection((node.host, node.port), timeout=timeout).close()
        return True
    except OSError:
        return False
