"""A lost node is knocked at (runner/transport/knock.py answers: a TCP connect with a short timeout)
before the elastic run's retry pays an SSH handshake (runner/backends/ssh/elastic_loop.py): a full
connect blocks up to CONNECT_TIMEOUT while a link is down and sees it come back only at TCP's next
SYN retry. Real sockets on loopback; a bastion node opens none."""

from __future__ import annotations

import socket

from runner.inventory.model import Jump, Node
from runner.transport.knock import answers


def test_a_listening_port_answers_and_a_closed_one_does_not():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        assert answers(Node(name="n", host="127.0.0.1", port=port)) is True
    # the listener closed: refused at once
    assert answers(Node(name="n", host="127.0.0.1", port=port), timeout=0.5) is False


def test_a_node_behind_a_bastion_is_not_knocked_at(no_network):
    """Only the bastion could reach it: the caller connects through it (no socket is opened here)."""
    assert answers(Node(name="n", host="10.0.0.9", proxy_jump=Jump(host="bastion.example"))) is True
