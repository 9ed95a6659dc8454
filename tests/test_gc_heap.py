"""`freeze_startup_heap`: what was alive at startup leaves the collector's generations (so collections do not walk
it), garbage made later is still collected, and garbage among the frozen objects is not (why only servers and
benchmarks call it)."""

from __future__ import annotations

import gc
import weakref

from kimiserve.utils.gc_heap import freeze_startup_heap


class Node:
    pass


def cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def test_startup_objects_leave_the_generations_and_later_garbage_is_collected():
    try:
        startup = cycle()
        frozen_cycle = weakref.ref(startup)
        assert freeze_startup_heap() > 0
        assert not any(o is startup for g in range(3) for o in gc.get_objects(generation=g))
        del startup
        gc.collect()
        assert frozen_cycle() is not None  # garbage among the frozen objects stays
        later = weakref.ref(cycle())
        gc.collect()
        assert later() is None  # garbage made after the freeze is collected as before
    finally:
        gc.unfreeze()
        gc.collect()
    assert frozen_cycle() is None
