"""The cyclic garbage collector kept off while a run builds its per-tensor objects.

Indexing, planning and laying out a checkpoint make a few objects per tensor and no cycles;
the collector's passes over them, each one over everything built so far, cost a fifth to a
third of a 100,000-tensor run (#44). What is built lives as long as the run, so on the way
out it goes straight to the oldest generation: freeze then unfreeze moves it there without a
scan (unless the caller froze objects itself, which unfreeze would undo).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """No collection inside; the collector as it was after (nested uses leave it off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()
