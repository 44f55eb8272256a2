"""Pausing Python's cyclic garbage collector while metadata is decoded.

Decoding a manifest (or a thousand partial manifests) creates hundreds of thousands of small
objects that outlive the generation-0 threshold, so the collector runs again and again and every
full collection walks everything the process holds: at a thousand ranks it was the largest single
cost of a load and of the coordinator's merge (``benchmarks/README.md``, *Decode and merge, the
collector paused*). Those objects hold
no reference cycles; reference counting frees them. While paused, cyclic garbage made by other
threads (training continues beside the coordinator) is collected when the pause ends — seconds
later, never lost.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside (nested and concurrent uses share one pause); the
    collector's previous state comes back when the last one leaves."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
