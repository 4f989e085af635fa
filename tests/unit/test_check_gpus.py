"""`runner check` on a node the inventory gives GPUs: nvidia-smi must see them and docker must be
able to hand them to a container (the NVIDIA Container Toolkit). No GPU node exists here, so the
probe's facts are written by hand; the probe script's lines are parsed as a node would print them."""

from __future__ import annotations

from runner.backends.ssh.check import NodeCheck, _node_problems
from runner.inventory import Node
from runner.transport.probe import Probe


def _problems(gpus_asked: int, gpus_seen: int, runtime: bool | None) -> list[str]:
    p = Probe(ifname="eth0", gpus=gpus_seen, gpu_runtime=runtime, docker="24.0.7")
    nc = NodeCheck(node="gpu", host="gpu.example")
    _node_problems(nc, Node(name="gpu", host="gpu.example", gpus=gpus_asked), p, "gpu.example")
    return nc.problems


def test_gpus_without_the_container_toolkit_are_a_problem_naming_it():
    assert _problems(8, 8, True) == []
    assert _problems(8, 0, None) == ["inventory asks for GPUs, nvidia-smi sees none"]
    [line] = _problems(8, 8, False)
    assert "NVIDIA Container Toolkit" in line and "nvidia-ctk runtime configure --runtime=docker" in line
    assert _problems(0, 8, False) == []  # a CPU job on a GPU box: nothing to say
