"""`job.elastic` (and `runner up --elastic`) as the inventory states it: how few nodes a run may
shrink to and whether a lost node that comes back is taken in again. What a shrink or a rejoin
does is runner/planning/elastic.py's; this module only reads and checks the field."""

from __future__ import annotations

from dataclasses import dataclass

FIELDS = {"min_nodes", "rejoin"}


@dataclass(frozen=True)
class ElasticSpec:
    min_nodes: int = 1       # below this many nodes the run stops (one line saying why)
    rejoin: bool = True      # a lost node that answers again is taken back at the next checkpoint
    line: int = 0            # where job.elastic is written (0: from --elastic)


def parse_elastic(c, v) -> ElasticSpec:
    """c: the inventory's checker, v: the `job.elastic` value (line-numbered). `true` is every
    default; a mapping names min_nodes and rejoin."""
    if v.value is True:
        return ElasticSpec(line=v.line)
    m = c.mapping(v, "job.elastic", FIELDS)
    out = ElasticSpec(line=v.line)
    if "min_nodes" in m:
        out = ElasticSpec(c.int_(m["min_nodes"][1], "job.elastic.min_nodes", 1, 1 << 20), out.rejoin, v.line)
    if "rejoin" in m:
        x = m["rejoin"][1]
        if not isinstance(x.value, bool):
            c.fail(x.line, "job.elastic.rejoin", f"must be true or false, got {x.value!r}")
        out = ElasticSpec(out.min_nodes, x.value, v.line)
    return out


def check_nodes(c, spec: ElasticSpec, nodes: int) -> None:
    """min_nodes no larger than the inventory: such a run could never lose a node."""
    if spec.min_nodes > nodes:
        c.fail(spec.line, "job.elastic.min_nodes",
               f"{spec.min_nodes} is more than the inventory's {nodes} node(s); give at most {nodes}")
