"""What gets SSH nodes ready before a run, behind SshBackend's push, sync and profile: the job's
image on every node (runner/delivery/push.py), job.sync's files (runner/delivery/sync.py), and
each node measured for `parallel.partition: auto` (runner/profile/). The CLI prints the results."""

from __future__ import annotations

import copy

from runner.transport.probe import probe


def push(backend, full: bool, build: bool, direct: bool) -> list:
    """One PushResult per node (runner/delivery/push_result.py): every node gets its image, only
    the layers it lacks; nodes whose arch the inventory leaves out are probed for it first."""
    from runner.delivery.push import push_to_nodes

    inv = backend.inventory
    with backend.cluster(partial=False) as cl:
        arches: dict[str, str | None] = {}
        if any(n.arch is None for n in inv.nodes):
            arches = {k: p.arch for k, p in cl.each(lambda r: probe(r, inv.master.rank_addr)).items()}
        return push_to_nodes(cl, arches, force_full=full, build=build, relay=False if direct else None)


def sync(backend) -> list:
    """One SyncResult per node and job.sync source ([] when job.sync is empty)."""
    from runner.delivery.sync import scan, sync_to_nodes

    inv = backend.inventory
    if not inv.job.sync:
        return []
    trees = scan(inv.job.sync)
    with backend.cluster(partial=False) as cl:
        homes = cl.each(lambda r: r.home)
        return sync_to_nodes(cl, homes, trees)


def profile(backend, refresh: bool, no_push: bool, min_seconds: float, timeout: float, trainer_args: list[str],
            quiet: bool):
    """(ClusterProfile, split, uniform split, problem): the job's layer kinds, memory and links
    timed on every node in its image (cached per node, image and model shape), and the split
    `parallel.partition: auto` would use (runner/profile/auto.py)."""
    from runner.profile.auto import plan_from_profile
    from runner.profile.measure import profile_cluster, refuse_custom_command

    inv = copy.copy(backend.inventory)
    inv.job = copy.deepcopy(inv.job)
    if trainer_args:
        inv.job.args = list(inv.job.args) + list(trainer_args)
    refuse_custom_command(inv)  # before any connection
    with backend.cluster(partial=False, inventory=inv) as cl:
        probes = cl.each(lambda r: probe(r, inv.master.rank_addr, clock=False))
        if not no_push:
            from runner.delivery.push import push_to_nodes

            push_to_nodes(cl, {n: p.arch for n, p in probes.items()}, quiet=quiet)
        prof = profile_cluster(cl, probes, refresh=refresh, min_seconds=min_seconds, timeout=timeout)
    return (prof, *plan_from_profile(prof, inv))
