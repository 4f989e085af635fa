"""Images: export from this host's engine once (cached by image id), work out which layers a node
lacks, and build the partial `docker save` archive that carries only those.

Why a partial archive works: `docker load` walks the image's diff_ids and, for each prefix,
looks the layer's chain id up in the node's layer store; only layers it does not have are read
from the archive (moby image/tarexport/load.go). So manifest.json + config + the missing
layer.tar files are enough, and an unchanged base is never sent again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from runner.core.errors import UserError
from runner.delivery.host_engine import host_engine
from runner.inventory import BuildSpec
from runner.transport.digest import sha256_file
from runner.transport.ssh import Remote

log = logging.getLogger("runner.images")
CACHE = Path(os.environ.get("RUNNER_IMAGE_CACHE", os.path.expanduser("~/.cache/runner/images")))


def chain_ids(diff_ids: list[str]) -> list[str]:
    """OCI chain ids: chain[0] = diff[0]; chain[i] = sha256(chain[i-1] + " " + diff[i])."""
    out: list[str] = []
    for d in diff_ids:
        out.append(d if not out else "sha256:" + hashlib.sha256(f"{out[-1]} {d}".encode()).hexdigest())
    return out


@dataclass
class Exported:
    tag: str
    image_id: str
    dir: Path                 # extracted `docker save` archive
    config: str               # archive path of the config json
    layers: list[str]         # archive paths of layer tars, in diff_id order
    diff_ids: list[str]
    sizes: list[int]          # uncompressed bytes per layer
    arch: str | None = None   # the image config's architecture (amd64, arm64): the node's too
    hold: IO[str] | None = None  # the entry's shared "in use" lock: no other process prunes it meanwhile

    def release(self) -> None:
        """Let other processes prune this export again (also done by this process's exit)."""
        if self.hold is not None:
            self.hold.close()
            self.hold = None

    @property
    def chains(self) -> list[str]:
        return chain_ids(self.diff_ids)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def tag_manifest(self) -> Path:
        return self.dir / "tags" / hashlib.sha256(self.tag.encode()).hexdigest()[:24] / "manifest.json"

    def archive_cmd(self, layers: list[int]) -> list[str]:
        """tar argv writing a `docker load` archive to stdout: this tag's manifest, the config and
        the given layers (by index)."""
        return ["tar", "-cf", "-", "-C", str(self.tag_manifest.parent), "manifest.json",
                "-C", str(self.dir), self.config, *(self.layers[i] for i in layers)]


def host_client():
    """This machine's engine (DOCKER_HOST, the docker context, the default socket: runner/delivery/host_engine.py)."""
    return host_engine().client()


def build_image(tag: str, spec: BuildSpec) -> str:
    """Build tag on this host's engine from spec (classic builder, host network: base images and
    wheels come from loopback, no registry needed); returns the image id."""
    client = host_client()
    log.info("building %s from %s (%s)", tag, spec.context, spec.dockerfile)
    try:
        for chunk in client.api.build(path=spec.context, dockerfile=spec.dockerfile, tag=tag, buildargs=spec.args,
                                      platform=spec.platform, network_mode="host", rm=True, forcerm=True,
                                      decode=True):
            if "error" in chunk:
                raise UserError(f"build of {tag} ({spec.context}/{spec.dockerfile}) failed: "
                                f"{chunk['error'].strip()[-300:]}")
            line = chunk.get("stream", "").strip()
            if line.startswith("Step "):
                log.info("build %s: %s", tag, line)
        return client.images.get(tag).id
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - API errors (bad dockerfile path, engine gone) as one line
        raise UserError(f"build of {tag} ({spec.context}/{spec.dockerfile}) failed: "
                        f"{str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__}"
                        ) from None
    finally:
        client.close()


def host_image_ids(tags: list[str]) -> dict[str, str | None]:
    """{tag: image id on this host's engine, or None} (on_host_engine)."""
    return on_host_engine(tags, _image_id)


def _image_id(client, tag: str) -> str | None:
    import docker

    try:
        return client.images.get(tag).id
    except docker.errors.ImageNotFound:
        return None


def on_host_engine(tags: list[str], read) -> dict:
    """{tag: read(client, tag)} on this host's engine (read gives None for a tag it lacks); all None
    when the engine does not answer (check still reports what the nodes have, just not whether it is
    current; a registry pull is then not compared with this host's build)."""
    try:
        client = host_client()
    except UserError as exc:
        log.warning("%s; image ids not compared", exc)
        return dict.fromkeys(tags)
    try:
        return {t: read(client, t) for t in tags}
    finally:
        client.close()


def host_image(client, tag: str):
    """tag's image on this host's engine, or the one-line error that says what to do."""
    import docker

    try:
        return client.images.get(tag)
    except docker.errors.ImageNotFound:
        raise UserError(f"image {tag} is not on this host's engine; build it first "
                        "(scripts/build-image.sh), say how in job.build, or fix job.image") from None


def export(tag: str, cache: Path = CACHE) -> Exported:
    """`docker save` of tag from this host's engine into cache/<image id>/ (skipped when cached).
    The entry stays in use (a shared lock on <id>.use) until the returned export is released or
    this process ends, so another push's export cannot prune it mid-transfer."""
    img = host_image(host_client(), tag)
    image_id = img.id
    d = cache / image_id.split(":", 1)[1]
    cache.mkdir(parents=True, exist_ok=True)
    use = open(cache / f"{d.name}.use", "w")
    try:
        fcntl.flock(use, fcntl.LOCK_SH)  # waits while a pruner removes it; then it is re-exported
        with open(cache / f"{d.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent pushes of one image export it once
            if not (d / ".complete").exists() or not _intact(d):
                _export_into(img, tag, image_id, d, cache)
        exp = _load_export(tag, image_id, d)
    except BaseException:
        use.close()
        raise
    exp.hold = use
    return exp


def _export_into(img, tag: str, image_id: str, d: Path, cache: Path) -> None:
    tmp = d.with_name(f"{d.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log.info("exporting %s (%s) from the host engine", tag, image_id[:19])
    if shutil.which("docker") and shutil.which("tar"):
        # The CLI piped into tar runs at disk speed (4x the SDK's chunked stream + tarfile).
        save = subprocess.Popen([*host_engine().cli(), "save", tag], stdout=subprocess.PIPE)
        untar = subprocess.run(["tar", "-x", "-C", str(tmp)], stdin=save.stdout, capture_output=True)
        assert save.stdout is not None  # a PIPE
        save.stdout.close()
        if save.wait() != 0 or untar.returncode != 0:
            raise UserError(f"docker save {tag} failed: {untar.stderr.decode(errors='replace')[-200:]}")
    else:
        stream = _IterReader(img.save(chunk_size=1 << 20, named=True))
        # (stream mode only reads its fileobj: the protocol of tarfile's stubs asks for seek, tell, ...)
        with tarfile.open(fileobj=stream, mode="r|") as tf:  # type: ignore[call-overload]
            tf.extractall(tmp, filter="tar") if hasattr(tarfile, "data_filter") else tf.extractall(tmp)  # noqa: S202
    cfg_name = json.loads((tmp / "manifest.json").read_text())[0]["Config"]
    got = "sha256:" + sha256_file(tmp / cfg_name)
    if got != image_id:  # the tag moved between inspect and save (a concurrent rebuild)
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"image {tag} changed while exporting ({image_id[:19]} -> {got[:19]}); retry")
    (tmp / ".complete").write_text(image_id)
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    _prune(cache, keep=d)


def _intact(d: Path) -> bool:
    """Every file the manifest names is there (a cache entry someone pruned by hand is re-exported
    instead of failing every push of that image)."""
    try:
        m = json.loads((d / "manifest.json").read_text())[0]
        return all((d / p).is_file() for p in [m["Config"], *m["Layers"]])
    except (OSError, ValueError, KeyError, IndexError):
        return False


def cached_layer_sizes(image_id: str, cache: Path = CACHE) -> list[int] | None:
    """The layer tars' bytes, in diff_id order, of image_id's complete export in cache, or None (not
    exported, or pruned meanwhile). Read without taking the entry: sizes only."""
    d = cache / image_id.split(":", 1)[-1]
    try:
        if not (d / ".complete").is_file() or not _intact(d):
            return None
        return [(d / p).stat().st_size for p in json.loads((d / "manifest.json").read_text())[0]["Layers"]]
    except (OSError, ValueError, KeyError, IndexError):
        return None


def _load_export(tag: str, image_id: str, d: Path) -> Exported:
    manifest = json.loads((d / "manifest.json").read_text())[0]
    config = json.loads((d / manifest["Config"]).read_text())
    diff_ids = config["rootfs"]["diff_ids"]
    layers = manifest["Layers"]
    sizes = [(d / p).stat().st_size for p in layers]
    exp = Exported(tag, image_id, d, manifest["Config"], layers, diff_ids, sizes, config.get("architecture"))
    _write_tag_manifest(exp, manifest)
    return exp


def _write_tag_manifest(exp: Exported, manifest: dict) -> None:
    """The export's manifest naming `exp.tag` alone. The cache is keyed by image id, and one id can
    carry many tags (`docker tag`, a rebuild from cached layers): sending the manifest `docker save`
    wrote would make `docker load` tag whatever name the first export had."""
    path = exp.tag_manifest
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"manifest.json.tmp{os.getpid()}")
    tmp.write_text(json.dumps([{**manifest, "RepoTags": [exp.tag]}]))
    os.replace(tmp, path)  # atomic: a concurrent push of the same tag reads one whole file


def _prune(cache: Path, keep: Path, max_entries: int = 3) -> None:
    """Keep the cache bounded: the newest few exports survive, and none another process is using
    (a concurrent push's export removed mid-transfer failed that push)."""
    entries = sorted((p for p in cache.iterdir() if p.is_dir() and p != keep and ".tmp" not in p.name),
                     key=lambda p: p.stat().st_mtime)
    for p in entries[: max(0, len(entries) - (max_entries - 1))]:
        with open(cache / f"{p.name}.use", "w") as use:
            try:
                fcntl.flock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use: pruned by a later export once released
            shutil.rmtree(p, ignore_errors=True)


class _IterReader:
    """File-like over an iterator of bytes chunks (for tarfile's stream mode)."""

    def __init__(self, it):
        self.it, self.buf = iter(it), b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self.buf) < n:
            try:
                self.buf += next(self.it)
            except StopIteration:
                break
        if n < 0:
            out, self.buf = self.buf, b""
        else:
            out, self.buf = self.buf[:n], self.buf[n:]
        return out


def node_image_id(remote: Remote, tag: str) -> str | None:
    """Through the node's Docker API (the connection is reused; an exec would cost a shell)."""
    import docker

    try:
        return remote.docker().images.get(tag).id
    except docker.errors.ImageNotFound:
        return None


def node_image_labels(remote: Remote, tag: str) -> dict[str, str] | None:
    """The labels of the node's image for tag ({} when it has none, None when it lacks the image)."""
    import docker

    try:
        return remote.docker().images.get(tag).labels or {}
    except docker.errors.ImageNotFound:
        return None


def node_chains(remote: Remote) -> set[str]:
    """Chain ids of every layer prefix of every image on the node (what its layer store holds)."""
    res = remote.run(["sh", "-c", "ids=$(docker image ls -aq --no-trunc | sort -u); "
                      "[ -z \"$ids\" ] || docker image inspect --format '{{json .RootFS.Layers}}' $ids"], timeout=60)
    if res.rc != 0:
        raise UserError(f"node {remote.node.name}: listing images failed: {res.err.strip()[:200]}")
    have: set[str] = set()
    for line in res.out.splitlines():
        line = line.strip()
        if line and line != "null":
            have.update(chain_ids(json.loads(line)))
    return have


def missing_layers(exp: Exported, have: set[str]) -> list[int]:
    return [i for i, c in enumerate(exp.chains) if c not in have]


