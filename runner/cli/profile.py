"""`runner profile`: the command around runner.api's profile (runner/profile/measure.py): push, probe every node,
print the table (`--json` for tools) and the split `parallel.partition: auto` would use."""

from __future__ import annotations

import argparse
import json
import sys

from runner.cli.common import add_inventory_args, open_backend


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure every node for the job's pipeline (parallel.partition auto)",
                       description="Time the job's layer kinds, memory and links on every node, in the job's image "
                                   "under the node's limits; cached per node, image and model shape. Extra trainer "
                                   "args go after `--`.")
    add_inventory_args(p)
    p.add_argument("--job", help="YAML file with a job section, overriding the inventory's")
    p.add_argument("--json", action="store_true", help="print the profile and the auto split as JSON")
    p.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    p.add_argument("--no-push", action="store_true", help="do not push images (fail if a node lacks one)")
    p.add_argument("--min-seconds", type=float, default=2.0, help="timed seconds per layer kind (default 2.0)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the probes may take (default 900)")
    p.add_argument("trainer_args", nargs="*", help="extra trainer arguments (after --)")
    p.set_defaults(func=main)


def main(args) -> int:
    backend = open_backend(args)
    prof, split, uniform, problem = backend.profile(refresh=args.refresh, no_push=args.no_push,
                                                    min_seconds=args.min_seconds, timeout=args.timeout,
                                                    trainer_args=list(args.trainer_args), quiet=args.json)
    if args.json:
        doc = prof.as_dict()
        doc["split"] = None if split is None else {"spec": split.spec, "bounds": split.bounds,
                                                   "bottleneck_s": split.bottleneck_s,
                                                   "step_s": split.step_s(problem.microbatches)}
        doc["uniform"] = None if uniform is None else {"spec": uniform.spec, "bottleneck_s": uniform.bottleneck_s,
                                                       "step_s": uniform.step_s(problem.microbatches)}
        print(json.dumps(doc, indent=1))
        return 0
    print_table(prof, backend.inventory)
    if split is not None:
        from runner.profile.auto import render_plan

        print(render_plan(split, uniform, problem, prof))
    return 0


# ------------------------------------------------------------------ display


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GiB"


def print_table(prof, inv) -> None:
    """The profile as a table (prof: runner/profile/measure.py's ClusterProfile)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    m = prof.model
    t = Table("node", "limits", "embed ms", "layer ms", "head ms", "optim ms (layer)", "memory avail.", "link to next",
              "source", title=Text(f"{m['family']} {m['num_layers']} layers, hidden {m['hidden_size']}, microbatch "
                                   f"{m['microbatch']} x {m['seq_len']} ({m['dtype']}); forward + backward per microbatch"))
    for i, n in enumerate(prof.nodes):
        lk = prof.links[i] if i < len(prof.links) else None
        link = "-" if lk is None else f"{lk['latency_s'] * 1e6:.0f} us, {lk['bandwidth_Bps'] / 1e6:.0f} MB/s"
        limits = " ".join(x for x in (f"cpus {n['cpus_limit']:g}" if n.get("cpus_limit") else "",
                                      f"mem {n['memory_limit']}" if n.get("memory_limit") else "") if x) or "none"
        ts = n["time_s"]
        t.add_row(n["node"], limits, _ms(ts["embed"]), _ms(ts["block"]), _ms(ts["head"]), _ms(n["optim_s"]["block"]),
                  _gib(n["memory_available"]), link, "cached" if prof.cached.get(n["node"]) else "measured")
    # Piped (a log, a test): wide enough that no cell wraps.
    Console(width=None if sys.stdout.isatty() else 160).print(t)
