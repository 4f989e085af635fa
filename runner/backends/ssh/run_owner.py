"""Run dirs the SSH user owns, also on nodes where it is not root (a Raspberry Pi's `pi`).

Containers run as the SSH user's uid:gid (plan.py), so everything a run writes on a node is the
user's: the runner, logged in as that user, can copy checkpoint files into it before a resume and
remove it in `down --keep-runs`. Runs made by an earlier runner, whose containers ran as root,
hold root-owned files the user can neither write into nor delete. The user's engine can (a member
of the docker group may start a container as root: that is what the group means), so such a run
is handed back to the user, or removed, by a throwaway root container of an image the node has,
with only that directory mounted. A node without any such image gets one line saying what to do.
"""

from __future__ import annotations

import logging
import posixpath
import shlex
from collections.abc import Callable

from runner.core.errors import UserError
from runner.planning.plan import GATE_MODULES, LABEL_GATE
from runner.transport.ssh import Remote

log = logging.getLogger("runner.owner")
MOUNT = "/runner-reclaim"


def not_owned(remote: Remote, path: str, uid: int) -> str | None:
    """The first file or directory under path (itself included) that uid does not own; None when
    they all are uid's or the path does not exist."""
    res = remote.run(["find", path, "!", "-user", str(uid), "-print", "-quit"], timeout=300)
    lines = res.out.strip().splitlines()
    return lines[0] if lines else None


def as_root(remote: Remote, image: str | None, mount: str, argv: list[str], what: str, by_hand: str) -> None:
    """argv in a throwaway root container of `image` (else of this project's trainer image on the
    node), `mount` (a node path) at MOUNT; UserError naming the node, `what` and the command that
    does it by hand if it fails."""
    import docker

    d = remote.docker()
    if image:
        try:
            d.images.get(image)
        except docker.errors.ImageNotFound:
            image = None  # that run's image is gone from the node since
    image = image or trainer_image(remote)
    if image is None:
        raise UserError(f"node {remote.node.name}: cannot {what}: it holds files of another user (root, from an "
                        f"earlier runner's containers) and the node has no image to reach them with; "
                        f"run `{by_hand}` on the node")
    try:
        d.containers.run(image, argv[1:], entrypoint=argv[:1], user="0:0", network_mode="none", remove=True,
                         volumes={mount: {"bind": MOUNT, "mode": "rw"}})
    except docker.errors.DockerException as exc:  # refused, failed, or answered malformed (docker_answers)
        first = (str(exc).strip().removeprefix(f"node {remote.node.name}: ").splitlines() or [type(exc).__name__])[0]
        raise UserError(f"node {remote.node.name}: cannot {what}: a root container of {image} failed: {first}; "
                        f"run `{by_hand}` on the node") from None


def trainer_image(remote: Remote) -> str | None:
    """A tag of this project's trainer image on the node (label io.runner.gate), newest first."""
    images = [i for i in remote.docker().images.list(filters={"label": LABEL_GATE})
              if i.labels.get(LABEL_GATE) in GATE_MODULES]
    images.sort(key=lambda i: str(i.attrs.get("Created", "")), reverse=True)  # an ISO time, or the node's word
    return next((t for i in images for t in i.tags), None)


def hand_back(remote: Remote, run_dir: str, image: str | None, uid: int, gid: int) -> str | None:
    """Make every file of run_dir uid:gid's (before a resume: the relaunched ranks run as that
    user). The first file that was not, or None when all were (nothing started)."""
    first = not_owned(remote, run_dir, uid)
    if first is not None:
        as_root(remote, image, run_dir, ["chown", "-R", f"{uid}:{gid}", MOUNT], f"take back {run_dir}",
                f"sudo chown -R {uid}:{gid} {shlex.quote(run_dir)}")
    return first


def remove_dirs(remote: Remote, parent: str, names: list[str],
                image_of: Callable[[list[str]], str | None] = lambda left: None) -> None:
    """rm -rf parent/name for each name, as the SSH user; what that leaves (files of another user)
    through a root container of image_of(the names left) (None: the node's trainer image)."""
    paths = [posixpath.join(parent, n) for n in names]
    if not paths:
        return
    res = remote.run(["rm", "-rf", "--", *paths], timeout=600)
    if res.rc == 0:
        return
    left = [n for n, p in zip(names, paths, strict=True) if remote.stat(p) is not None]
    if not left:
        return
    log.debug("node %s: rm -rf left %s: %s", remote.node.name, left, res.err.strip()[:200])
    shown = [posixpath.join(parent, n) for n in left]
    as_root(remote, image_of(left), parent, ["rm", "-rf", "--", *(posixpath.join(MOUNT, n) for n in left)],
            f"remove {', '.join(shown)}", shlex.join(["sudo", "rm", "-rf", "--", *shown]))
