"""`runner check --links`: bandwidth and latency between every two of the job's nodes, measured
between the nodes themselves (never through this machine), over TCP between their rank addresses in
the job's image with host networking: the path gloo's point-to-point sends and a ring all-reduce
take. Each pair is measured by `python -m trainer probe --no-compute` (trainer/tools/probe_link.py:
ping-pongs for the latency, then LINK_ROUNDS acknowledged bulk sends of LINK_BYTES), the earlier
node (rank order) sending to the later one, through runner/profile/measure.py's run_probes.

Pairs are measured in rounds in which no node appears twice (runner/planning/links.py's rounds), so
no node's link carries two probes at once; N nodes take N - 1 rounds (N if N is odd), each a
container per node of the round. What was measured is cached per pair (runner/planning/links.py)
for the planners, and compared with what the job sends per step (runner/planning/step_load.py).
"""

from __future__ import annotations

import logging
from typing import Any

from contract.model_size import NotSized
from runner.core.errors import UserError
from runner.planning import links as linkmod
from runner.planning.links import LinkFigure, LinkMatrix
from runner.planning.step_load import step_load
from runner.profile.measure import refuse_custom_command, run_probes
from runner.transport.cluster import Cluster
from runner.transport.probe import Probe, probe

log = logging.getLogger("runner.profile")
# Per bandwidth round (3 rounds a pair): 1.7 s each at 10 Mbit/s, long enough for TCP to leave slow
# start on a LAN; a 10 Gbit/s link moves it in 2 ms, so its figure is a lower bound (still "fast").
LINK_BYTES = 2 << 20
TIMEOUT_S = 120.0


def measure_matrix(cl: Cluster, probes: dict[str, Probe], link_bytes: int = LINK_BYTES,
                   timeout: float = TIMEOUT_S) -> LinkMatrix:
    """Every pair of the cluster's nodes, one direction each (module doc)."""
    from runner.delivery.images import node_image_id

    inv = cl.inv
    order = inv.ordered()
    tags: dict[str, str] = {}
    for n in order:
        tag = inv.job.image_for(n.arch or probes[n.name].arch)
        if tag is None:
            raise UserError(f"check --links: node {n.name}: job.image names no image for its arch "
                            f"{n.arch or probes[n.name].arch}; add one")
        tags[n.name] = tag
    ids = cl.each(lambda r: node_image_id(r, tags[r.node.name]))
    lacking = [n for n, i in ids.items() if i is None]
    if lacking:
        raise UserError(f"check --links: node(s) {', '.join(lacking)} lack the job's image; run `runner push` first")
    by_name = {n.name: n for n in order}
    m = LinkMatrix([n.name for n in order])
    for rnd in linkmod.rounds(m.nodes):
        sub = [by_name[x] for pair in rnd for x in pair]  # a0, b0, a1, b1, ...: a_i measures to b_i
        docs = run_probes(cl, sub, probes, tags, set(), set(range(0, len(sub), 2)), 0.0, timeout, link_bytes)
        for a, b in rnd:
            lk = docs[a]["link"]
            fig = LinkFigure(float(lk["bandwidth_Bps"]), float(lk["latency_s"]))
            m.measured[a, b] = fig
            linkmod.save(by_name[a], by_name[b], fig)
            log.info("link %s -> %s: %.1f Mbit/s, %.2f ms", a, b, fig.bandwidth_Bps * 8 / 1e6, fig.latency_s * 1e3)
    return m


def check_links(backend: Any) -> tuple[LinkMatrix, list[str]]:
    """Connect, measure every pair, cache it; (the matrix, the lines saying which links are too slow
    for the job's step, or why that could not be judged). backend: the SSH backend (its inventory
    and `cluster`)."""
    inv = backend.inventory
    refuse_custom_command(inv)
    if len(inv.nodes) < 2:
        raise UserError(f"check --links: {inv.path} has one node; there is no link to measure")
    with backend.cluster(partial=False) as cl:
        probes = cl.each(lambda r: probe(r, inv.master.rank_addr, clock=False))
        matrix = measure_matrix(cl, probes)
    try:
        load = step_load(inv)
    except NotSized as exc:
        return matrix, [f"links not compared with the job's step: {exc}"]
    lines = linkmod.warnings(matrix, load)
    return matrix, lines or [f"every link carries the job's step traffic within {linkmod.SLOW_FRACTION:.0%} of its "
                             f"~{load.compute_s:.2f} s compute ({load.compute_from})"]
