"""A serving process takes its startup heap out of the cyclic GC once the cluster is up (`freeze_startup_heap`):
afterwards a full collection walks only what was made since, and objects made since are still collected."""

from __future__ import annotations

import gc
import weakref

from nanocp.startup_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_a_full_collection_after_the_freeze_walks_only_new_objects_and_still_collects_them():
    startup = [Node() for _ in range(1000)]  # stand-ins for the model's and the engine's objects
    try:
        freeze_startup_heap()
        walked = {id(obj) for obj in gc.get_objects()}  # what a full collection walks now
        assert len(walked) < 100 and not any(id(node) in walked for node in startup)
        assert gc.get_freeze_count() >= len(startup)
        a, b = Node(), Node()  # a garbage cycle made after the freeze
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
    assert len(startup) == 1000
