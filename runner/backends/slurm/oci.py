"""`container: oci`: the job's image, from this machine's engine, as a root filesystem on the
cluster's shared filesystem, for Slurm's native OCI support (`srun --container`, oci.conf).

Exported once per image id (`<bundle_dir>/<id>/rootfs` + `image.json`, placed by a rename once
complete): a code change is a new image id and a new export; an unchanged image is reused. The
bundle's config.json (slurm_plan.oci_config) is written at submission.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess

from runner.backends.slurm.plan import resolve
from runner.backends.slurm.shell import LocalShell, LoginShell, Shell
from runner.core.errors import UserError
from runner.inventory.slurm import SlurmInventory


def ensure_bundle(sh: Shell, inv: SlurmInventory, wd: str) -> tuple[str, list[str], str]:
    """(bundle dir on the cluster, the image's env, its WorkingDir) for the job's image, exported
    if the cluster does not have it yet."""
    import docker
    from runner.delivery.host_engine import host_engine

    tag = inv.slurm.image or inv.job.image_for(inv.slurm.arch)
    engine = host_engine()
    try:
        client = engine.client()
        img = client.images.get(tag)
    except docker.errors.ImageNotFound:
        raise UserError(f"{inv.where('container')}: oci: image {tag} is not on this machine's engine; build it "
                        "(scripts/build-image.sh) or pull it") from None
    except docker.errors.DockerException as exc:
        raise UserError(f"oci: {engine.unreachable()}: {exc}") from None
    env = list(img.attrs.get("Config", {}).get("Env") or [])
    workdir = img.attrs.get("Config", {}).get("WorkingDir") or "/"
    root = resolve(inv.slurm.bundle_dir or f"{wd}/bundles", sh.home())
    dest = f"{root}/{img.id.split(':')[-1][:16]}"
    if sh.read_bytes(f"{dest}/image.json") is not None:
        return dest, env, workdir
    tmp = f"{dest}.tmp-{os.getpid()}"
    print(f"oci: exporting {tag} ({img.id[:19]}) to {dest} on {sh.where}", flush=True)
    container = client.containers.create(img.id, command=["/bin/true"])
    try:
        _extract(sh, container.export(chunk_size=1 << 20), f"{tmp}/rootfs")
    finally:
        container.remove(force=True)
    sh.put_bytes(f"{tmp}/image.json", json.dumps({"tag": tag, "id": img.id, "env": env}, indent=1).encode())
    res = sh.run(["sh", "-c", 'rm -rf "$2" && mv "$1" "$2"', "runner-oci", tmp, dest], timeout=600)
    if res.rc != 0:
        raise UserError(f"oci: placing the bundle at {dest} failed: {(res.err or res.out).strip()[:200]}")
    return dest, env, workdir


def _extract(sh: Shell, chunks, target: str) -> None:
    """`docker export`'s tar stream into `tar -x` where the shared filesystem is."""
    cmd = f"mkdir -p {shlex.quote(target)} && tar -x -C {shlex.quote(target)}"
    if isinstance(sh, LocalShell):
        proc = subprocess.Popen(["sh", "-c", cmd], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            for chunk in chunks:
                proc.stdin.write(chunk)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        err = proc.stderr.read().decode(errors="replace")
        if proc.wait() != 0:
            raise UserError(f"oci: unpacking the image into {target} failed: {err.strip()[:200]}")
        return
    assert isinstance(sh, LoginShell)
    chan = sh.remote.open_exec(cmd)
    for chunk in chunks:
        chan.sendall(chunk)
    chan.shutdown_write()
    rc = chan.recv_exit_status()
    err = chan.makefile_stderr("rb").read().decode(errors="replace")
    chan.close()
    if rc != 0:
        raise UserError(f"oci: unpacking the image into {target} on {sh.where} failed: {err.strip()[:200]}")
