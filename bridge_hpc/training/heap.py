"""Python's garbage collector in a training process: the heap of start-up is frozen, so that the
collections during the steps walk only what the steps make.

Imports of torch and megatron-core, the model, the optimizer and the data leave some 400 thousand
objects that the cycle collector tracks, and every automatic full collection walks all of them again:
0.28-0.35 s on a CPU rank of the demo model (``benchmarks/loop_overhead.py``), about once in 130 of its
steps, each rank at its own step, so the other ranks wait for it in the next collective. ``gc.freeze``
moves objects out of every later collection. Two freezes keep that off the start-up time as well:

1. :func:`imports_frozen`, around a run's set-up and training: what the process holds when
   ``pretrain`` starts (its imports, for the most part) is frozen at once, without a collection,
   which would walk all of it (0.3 s on a GPU host, in every requeued run's start-up);
2. :func:`set_up_frozen`, around the steps: one full collection, which walks only what set-up made
   (model, optimizer, checkpoint load) and frees its garbage, then that is frozen too.

What a freeze covers is not lost: an object of it that the steps drop is freed by reference counting
as before; only one in a reference cycle waits until training returns, when the heap is unfrozen
(``gc.unfreeze``) and the next full collection sees it.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def imports_frozen(collect_first: bool) -> Iterator[None]:
    """Freeze what the process holds now, for the run inside; unfreeze when it returns.

    ``collect_first``: collect before freezing, where the heap may hold garbage worth freeing now, as
    the aborted attempt an in-process restart leaves behind (its model and optimizer, possibly in
    reference cycles, which would otherwise stay for the whole next attempt)."""
    if collect_first:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def set_up_frozen(manual_gc: bool) -> Iterator[None]:
    """Around the steps: one full collection (what set-up dropped is freed), then everything there is
    frozen; unfrozen when the steps end.

    ``manual_gc`` (``train.manual_gc``, Megatron's and Bridge's): automatic collection is off for the
    steps too (``train.post_training_step_callbacks`` collects every ``train.manual_gc_interval``
    steps). The caller's collector settings are back when the steps end."""
    was_enabled = gc.isenabled()
    if manual_gc:
        gc.disable()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if manual_gc and was_enabled:
            gc.enable()
