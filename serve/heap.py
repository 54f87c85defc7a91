"""The heap a serving process has made by the time it serves, kept out of the garbage collector's full passes.

A process that has imported torch (and built an engine) holds some 200,000 tracked objects; a full collection
walks them all and took 115-160 ms on CPU, and one falling inside a burst of submissions held back every request
behind it. :func:`freeze_startup_heap` collects once and freezes what is left (``gc.freeze``: the objects move to
a permanent generation no collection walks), so a collection while serving walks only what serving made; it is
called once the worker is up (``labkit serve``'s front end and the engine process); :func:`frozen_heap` does the
same around a block (the load client's measured window).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


def freeze_startup_heap() -> None:
    """Collect, then freeze every object alive now out of later collections (undone by :func:`thaw_heap`)."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (a server closed inside a longer-lived process: tests)."""
    gc.unfreeze()


@contextmanager
def frozen_heap():
    """:func:`freeze_startup_heap` for the block, :func:`thaw_heap` after it."""
    freeze_startup_heap()
    try:
        yield
    finally:
        thaw_heap()
