"""`job.registry`: the nodes `docker pull` the job's tags from a registry instead of receiving a
push from this machine (a cluster with its own registry, EC2 boxes pulling from a cloud one).

Each node pulls REGISTRY/TAG (or TAG itself when it already names the registry) with its own
docker CLI and tags the result as the job's tag, so plans, `check` and `status` see the same tag
either way. Credentials: RUNNER_REGISTRY_USER / RUNNER_REGISTRY_PASSWORD in job.env_file, or the
node's own `docker login` when those are absent. The env_file's credentials reach the node on a
command's stdin, as a 0600 config.json in a private 0700 directory (DOCKER_CONFIG) that the
node's shell removes when the pull ends, or when the runner's connection does (PULL_SH): never
in an argv, a log line, or the job's containers, and not left behind by a dropped connection.

A node whose registry does not answer or lacks the tag: one line naming the node, job.registry
and docker's own reason, before any container starts. A node whose engine has no room for what it
lacks of the image (where this machine has the tag: its layers' sizes, layer_sizes.py) is refused
before it pulls a byte, by the rule push follows (disk_room.py): a pull that fills the data root
stops half-way with `no space left on device` and leaves the node's disk full.
"""

from __future__ import annotations

import base64
import json
import logging
import shlex
import time

from runner.core.errors import UserError
from runner.core.redact import hide
from runner.delivery import disk_room
from runner.delivery.layer_sizes import HostLayers, engine_room_for
from runner.delivery.push_result import PushResult
from runner.inventory.job_data import registry_ref
from runner.transport.ssh import Remote

log = logging.getLogger("runner.registry")
PULL_TIMEOUT_S = 3600.0  # a 2 GB image onto a Pi over Wi-Fi


def docker_config(registry: str, user: str, password: str) -> bytes:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return json.dumps({"auths": {registry: {"auth": token}}}).encode()


# With credentials: the node's shell makes the private DOCKER_CONFIG, reads the login from stdin,
# pulls, and removes it on every way out. The runner holds stdin open for the whole pull, so its
# connection dropping (EOF) ends the pull and with it the login (a cleanup sent from here would
# need the very connection that was lost). Logins a killed shell left (a node rebooted mid-pull)
# are swept once they are older than any pull can be.
PULL_SH = r"""
umask 077
find "$1" -maxdepth 1 -name '.runner-registry-*' -mmin +$4 -exec rm -rf {} + 2>/dev/null
d=$(mktemp -d "$1/.runner-registry-XXXXXXXX") || exit 125
trap 'rm -rf "$d"' EXIT
trap 'exit 129' HUP INT TERM
head -c "$2" > "$d/config.json"
DOCKER_CONFIG="$d" docker pull -q "$3" & pull=$!
exec 3<&0
(cat <&3; [ -d "$d" ] && kill "$pull") >/dev/null 2>&1 &
wait "$pull"
"""


def pull_one(remote: Remote, registry: str, tag: str, auth: tuple[str, str] | None, home: str,
             host: HostLayers | None = None) -> tuple[dict, float]:
    """Pull and tag on one node; (the node's image attrs for tag, seconds). With `host` (this
    machine's build of tag), the node's engine must have room for what it lacks of it first."""
    import docker

    name = remote.node.name
    ref = registry_ref(registry, tag)
    t0 = time.time()
    if host is not None:
        check_pull_room(remote, host, f"job.registry {registry}: {ref}")
    if auth is None:
        res = remote.run(["docker", "pull", "-q", ref], timeout=PULL_TIMEOUT_S)
    else:
        login = docker_config(registry, *auth)
        res = remote.run(["sh", "-c", PULL_SH, "runner-pull", home.rstrip("/") or "/", str(len(login)), ref,
                          str(int(2 * PULL_TIMEOUT_S / 60))], stdin=login, hold_stdin=True, timeout=PULL_TIMEOUT_S)
    if res.rc != 0:
        why = " ".join(res.err.strip().splitlines())[-300:] or f"exit {res.rc}"
        raise UserError(f"node {name}: job.registry {registry}: pulling {ref} failed: {why}")
    if ref != tag:
        res = remote.run(["docker", "tag", ref, tag], timeout=60)
        if res.rc != 0:
            raise UserError(f"node {name}: tagging {ref} as {tag} failed: {res.err.strip()[-200:]}")
    try:
        attrs = remote.docker().images.get(tag).attrs
    except docker.errors.ImageNotFound:
        raise UserError(f"node {name}: {tag} is missing after pulling {ref}") from None
    return attrs, time.time() - t0


def check_pull_room(remote: Remote, host: HostLayers, what: str) -> None:
    """NoRoom when the node's engine cannot take what it lacks of `host` (disk_room.engine_shortage)."""
    why = engine_room_for(remote, host, what, how="docker pull", then="nothing was pulled: free space there (docker "
                          "image prune, docker system df), then run again")[3]
    if why:
        raise disk_room.NoRoom(f"node {remote.node.name}: {why}")


def pull_to_nodes(cl, tags: dict[str, str], host: dict[str, HostLayers | None]) -> list:
    """Every node pulls its tag; where this machine has the tag too, the node must end with the
    same image id (a registry holding another build of the tag is an error, not a surprise)."""
    job = cl.inv.job
    auth = job.registry_auth()
    hide(auth or ())
    remotes = [cl[n.name] for n in cl.inv.nodes]

    def one(r: Remote) -> PushResult:
        tag = tags[r.node.name]
        attrs, seconds = pull_one(r, job.registry, tag, auth, r.home, host.get(tag))
        have = host.get(tag)
        got, want = attrs["Id"], have.image_id if have else None
        if want is not None and got != want:
            raise UserError(f"node {r.node.name}: {registry_ref(job.registry, tag)} is image {got[7:19]}, but this "
                            f"machine's {tag} is {want[7:19]}: push the current build to the registry "
                            f"(docker push {shlex.quote(registry_ref(job.registry, tag))})")
        # The node fetched the bytes itself: none went through this machine.
        rootfs, size = attrs.get("RootFS"), attrs.get("Size")  # the node engine's word
        layers = rootfs.get("Layers") if isinstance(rootfs, dict) else None
        return PushResult(r.node.name, tag, got, "pulled", layers_total=len(layers) if isinstance(layers, list) else 0,
                          image_bytes=size if isinstance(size, int) and size >= 0 else 0, seconds=seconds)

    out, errors = [], []
    for r, val, err in cl.map(remotes, one):
        if err is not None:
            errors.append(str(err) if isinstance(err, UserError) else f"node {r.node.name}: job.registry: {err}")
        else:
            out.append(val)
            log.info("pull %s: %s from %s (%.1fs)", val.node, val.tag, job.registry, val.seconds)
    if errors:
        raise UserError("; ".join(errors))
    return out
