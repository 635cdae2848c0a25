"""Python's garbage collector in a training process: the heap of start-up is frozen, so that the
collections during the steps walk only what the steps make.

Imports of torch and megatron-core, the model, the optimizer and the data leave some 400 thousand
objects that the cycle collector tracks, and every automatic full collection walks all of them again:
0.28-0.35 s on a CPU rank of the demo model (``benchmarks/loop_overhead.py``), about once in 130 of its
steps, each rank at its own step, so the other ranks wait for it in the next collective. ``gc.freeze``
moves objects out of every later collection. Two freezes keep that off the start-up time as well
(and :func:`imports_uncollected` keeps the collector out of the imports themselves):

1. :func:`run_frozen`, around a run's set-up and training (``pretrain``): what the process holds
   when its first run starts (its imports, for the most part) is frozen at once, without a
   collection, which would walk all of it (0.3 s on a GPU host, in every requeued run's start-up);
   a later run in the same process (an in-process restart's attempt, a sweep, a test suite) collects
   first, since the runs before it left their models and optimizers, possibly in reference cycles
   that a freeze would keep for the whole run;
2. :func:`steps_frozen`, around the steps: one full collection, which walks only what set-up made
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
def imports_uncollected() -> Iterator[None]:
    """Around a rank's imports of torch, megatron-core and the training code: the cycle collector
    off, and what the imports made frozen when they end (as :func:`run_frozen` would freeze it, at
    once and without a collection), the collector's setting then restored.

    Why: the imports make the objects the collector tracks by the hundred thousand, and its automatic
    collections walk them again and again while the heap grows; import-time garbage in reference
    cycles is negligible. Importing the training core with megatron-core 0.19 took 2.9 s with the
    collector on and 2.3 s with it off (a 2-core CPU host, 3 runs each); on an H100 host 4.7-5.8 s
    and 4.4-4.8 s, with torch's compiler imports deferred as well 3.0-4.3 s and 2.6-3.5 s (2 runs
    each). A requeued run pays it before its first step."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def frozen(collect_first: bool) -> Iterator[None]:
    """Freeze what the process holds now, for what runs inside; unfreeze when it returns.

    ``collect_first``: one full collection before the freeze, so that the garbage there is now is
    freed rather than frozen."""
    if collect_first:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


#: Runs started in this process (:func:`run_frozen`): the first has only imports behind it.
_runs_started = 0


@contextlib.contextmanager
def run_frozen() -> Iterator[None]:
    """Around one run's set-up and training: :func:`frozen`, with a collection first unless this is the
    process's first run."""
    global _runs_started
    collect_first = _runs_started > 0
    _runs_started += 1
    with frozen(collect_first):
        yield


@contextlib.contextmanager
def steps_frozen(manual_gc: bool) -> Iterator[None]:
    """Around the steps: one full collection (what set-up dropped is freed), then everything there is
    frozen (:func:`frozen`); unfrozen when the steps end.

    ``manual_gc`` (``train.manual_gc``, Megatron's and Bridge's): automatic collection is off for the
    steps too (``train.post_training_step_callbacks`` collects every ``train.manual_gc_interval``
    steps). The caller's collector settings are back when the steps end."""
    was_enabled = gc.isenabled()
    if manual_gc:
        gc.disable()
    try:
        with frozen(collect_first=True):
            yield
    finally:
        if manual_gc and was_enabled:
            gc.enable()
