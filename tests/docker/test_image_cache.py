"""The host's export cache (runner/delivery/images.py): bounded, and never pruned under a push that is using
an entry. Real `docker save` from the host engine of small FROM-scratch images; two exports in one
process hold their locks through separate open files, exactly as two runner processes would."""

from __future__ import annotations

import os

import pytest

from runner.delivery.images import export
from tests.support.runner_helpers import build_scratch_image, remove_host_image

pytestmark = [pytest.mark.docker]


@pytest.fixture
def five_images(host_docker):
    tags = [f"runner-test-cache-{os.getpid()}-{i}:t" for i in range(5)]
    for t in tags:
        build_scratch_image(t, [os.urandom(64)])
    yield tags
    for t in tags:
        remove_host_image(t)


def test_an_export_in_use_is_not_pruned_by_another_push(five_images, tmp_path):
    cache = tmp_path / "cache"
    first = export(five_images[0], cache)  # a push of image 0 is under way (its layers being sent)
    others = [export(t, cache) for t in five_images[1:4]]  # three other pushes fill the cache (3)
    for e in others:
        e.release()
    # Before, the third export pruned image 0's entry mid-push (the push then failed reading it).
    assert first.dir.is_dir() and (first.dir / first.layers[0]).is_file()
    first.release()
    last = export(five_images[4], cache)
    last.release()
    kept = sorted(p.name for p in cache.iterdir() if p.is_dir())
    # Bounded again once released: the three newest stay.
    assert kept == sorted(e.dir.name for e in [*others[1:], last]), kept
