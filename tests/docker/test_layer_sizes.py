"""runner/delivery/layer_sizes.py: what a node lacks of this host's image, in bytes, without a
`docker save`: from the export cache (exact) or the engine's history (an upper bound where a layer
is empty). Checked against the real host engine and the tar sizes of a real export."""

from __future__ import annotations

import os

import pytest

from runner.delivery.images import cached_layer_sizes, chain_ids, export, host_client
from runner.delivery.layer_sizes import HostLayers, host_layers, sizes_from_history
from tests.support.runner_helpers import build_image, remove_host_image

KiB = 1 << 10


def rows(*sizes: int) -> list[dict]:
    """History rows as the engine's API gives them: newest first."""
    return [{"Size": s} for s in reversed(sizes)]


def test_history_rows_of_size_zero_without_a_layer_are_skipped():
    # ENV and CMD rows (0) made no layer: three layers, three sized rows.
    assert sizes_from_history(rows(100, 0, 20, 0, 3), 3, 123) == [100, 20, 3]


def test_an_empty_layer_makes_the_newest_rows_an_upper_bound_for_every_suffix():
    # Four layers, the third empty (WORKDIR): only three rows have a size. Real sizes 100, 20, 0, 3.
    got = sizes_from_history(rows(100, 20, 0, 3), 4, 123)
    assert got == [0, 100, 20, 3]
    real = [100, 20, 0, 3]
    for k in range(5):
        assert sum(got[k:]) >= sum(real[k:])


def test_rows_that_do_not_fit_give_the_whole_image_to_the_newest_layer():
    assert sizes_from_history(rows(5, 6, 7), 2, 99) == [0, 99]           # more sized rows than layers
    assert sizes_from_history([{"Size": "big"}], 1, 99) == [99]          # not a count
    assert sizes_from_history(rows(), 0, 0) == []


def test_a_node_lacks_the_suffix_from_its_first_missing_layer():
    chains = chain_ids(["sha256:a", "sha256:b", "sha256:c"])
    hl = HostLayers("sha256:x", chains, [10, 20, 30], False)
    assert hl.lacking(set()) == (3, 60)
    assert hl.lacking({chains[0]}) == (2, 50)
    assert hl.lacking(set(chains)) == (0, 0)
    assert hl.lacking({chains[0], "sha256:other"}) == (2, 50)


@pytest.fixture
def image(host_docker):
    """Three files in three layers, a metadata step (ENV: no layer) and an empty layer (WORKDIR of a
    new folder: the layer holds only the folder, 0 bytes unpacked)."""
    tag = f"runner-test-layer-sizes:{os.getpid()}"
    files = {"a": os.urandom(300 * KiB), "b": os.urandom(40 * KiB), "c": os.urandom(7 * KiB)}
    build_image(tag, {"Dockerfile": b"FROM scratch\nCOPY a /a\nENV X=1\nCOPY b /d/b\nWORKDIR /e\nCOPY c /c\n", **files})
    yield tag
    remove_host_image(tag)


def test_host_layers_from_the_engines_history_bound_what_push_sends_then_exactly_from_the_export(image, tmp_path):
    client = host_client()
    try:
        hl = host_layers(client, image, cache=tmp_path / "cache")
        img = client.images.get(image)
        assert hl.chains == chain_ids(img.attrs["RootFS"]["Layers"]) and not hl.exact
        # Four layers, three of them sized in the history: the empty one's place is not known.
        assert hl.sizes == [0, 300 * KiB, 40 * KiB, 7 * KiB]
        assert cached_layer_sizes(img.id, tmp_path / "cache") is None
        exp = export(image, cache=tmp_path / "cache")
        try:
            exact = host_layers(client, image, cache=tmp_path / "cache")
        finally:
            exp.release()
        assert exact.exact and exact.sizes == exp.sizes and exact.chains == hl.chains
        # For whatever a node lacks (a suffix), the estimate plus a few KiB of tar headers a layer is
        # at least the tars push would send.
        n = len(hl.chains)
        for k in range(n + 1):
            assert sum(hl.sizes[k:]) + 4 * KiB * (n - k) >= sum(exact.sizes[k:]), k
        assert host_layers(client, f"runner-test-layer-sizes:none-{os.getpid()}") is None
    finally:
        client.close()
