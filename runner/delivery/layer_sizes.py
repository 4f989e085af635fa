"""What a node lacks of one of this host's images, in bytes, without a `docker save`: for `check`
(would push find room in the node engine's data root?) and for registry pulls (room before the
pull). Push itself knows the exact bytes from its export (images.py) and checks those.

A node lacks a suffix of an image's layers: its layer store holds a layer only together with the
layers under it (chain ids, images.chain_ids), so once one is missing every later one is too.

Per-layer sizes:
- exact, from this host's export cache when the image was exported before (the layer tars push
  sends);
- else from the engine's history of the image: one row per build step with the size of the layer
  it made (its unpacked bytes, as `docker history` shows). A step that changed no file (ENV, CMD,
  LABEL) made no layer, but a step that made an empty layer (WORKDIR of an existing folder) shows
  as size 0 too, so the rows of size > 0 may be fewer than the layers. The newest such rows are
  then taken for the newest layers: for any suffix that sums to at least its real size (the
  layers it wrongly includes are older, the ones it leaves out are empty), an upper bound.
  Tar headers make a layer's tar a little larger than its unpacked bytes (1-2% for this project's
  image), so the figure is given as "about".
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.delivery import disk_room
from runner.delivery.images import CACHE, cached_layer_sizes, chain_ids, node_chains


@dataclass(frozen=True)
class HostLayers:
    image_id: str
    chains: list[str]  # chain ids, oldest layer first
    sizes: list[int]   # bytes per layer, oldest first (exact, or per the module's rule an upper bound)
    exact: bool        # from the export cache

    def lacking(self, have: set[str]) -> tuple[int, int]:
        """(layers a node holding chain ids `have` lacks, their bytes)."""
        k = next((i for i, c in enumerate(self.chains) if c not in have), len(self.chains))
        return len(self.chains) - k, sum(self.sizes[k:])


def sizes_from_history(rows: list[dict], layers: int, total: int) -> list[int]:
    """Per-layer bytes, oldest first, from the engine's history rows (newest first, as the API gives
    them): see the module's note. Rows that do not fit (more sized rows than layers, sizes that are
    not counts) give the whole image's size to the newest layer: an upper bound for every suffix."""
    sized = [r.get("Size") for r in reversed(rows) if r.get("Size")]
    if layers == 0:
        return []
    if len(sized) > layers or not all(isinstance(s, int) and s > 0 for s in sized):
        return [0] * (layers - 1) + [max(0, total)]
    return [0] * (layers - len(sized)) + sized


def host_layers(client, tag: str, cache=CACHE) -> HostLayers | None:
    """tag on this host's engine (`client`), or None when it lacks the tag."""
    import docker

    try:
        img = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    diff_ids = img.attrs["RootFS"]["Layers"]
    chains = chain_ids(diff_ids)
    exact = cached_layer_sizes(img.id, cache)
    if exact is not None and len(exact) == len(chains):
        return HostLayers(img.id, chains, exact, True)
    sizes = sizes_from_history(img.history(), len(chains), int(img.attrs.get("Size") or 0))
    return HostLayers(img.id, chains, sizes, False)


def engine_room_for(remote, host: HostLayers, what: str, then: str, how: str = "docker load"
                    ) -> tuple[int, int, tuple[int, int] | None, str | None]:
    """(layers the node lacks of `host`, their bytes, its engine's room, why they do not fit or None):
    push's rule (disk_room.engine_shortage) on this module's sizes, for check and registry pulls.
    Raises UserError when the node's images cannot be listed."""
    layers, need = host.lacking(node_chains(remote))
    if layers == 0:
        return 0, 0, None, None
    room = disk_room.engine_room(remote)
    why = disk_room.engine_shortage(None, room, need, f"{what} ({layers} of {len(host.chains)} layers)",
                                    then=then, about=not host.exact, how=how)
    return layers, need, room, why
