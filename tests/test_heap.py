"""bridge_hpc.training.process.heap: what each freeze covers, and that the process gets its collector back."""

import gc
import weakref

import pytest

from bridge_hpc.training.process import heap


class _Cycle:
    """An object only the cycle collector frees: it refers to itself."""

    def __init__(self):
        self.me = self


def _dropped_cycle() -> weakref.ref:
    probe = _Cycle()
    alive = weakref.ref(probe)
    del probe
    return alive


@pytest.mark.parametrize("collect_first", [True, False])
def test_frozen_defers_the_garbage_it_covers_unless_told_to_collect_first(collect_first):
    before = _dropped_cycle()
    with heap.frozen(collect_first):
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert (before() is None) is collect_first  # frozen garbage waits; an aborted attempt's does not
        inside = _dropped_cycle()
        gc.collect()
        assert inside() is None  # what the run makes is collected as ever
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None


@pytest.mark.parametrize("manual_gc", [True, False])
def test_steps_frozen_collects_first_freezes_and_gives_the_collector_back(manual_gc):
    set_up_garbage = _dropped_cycle()
    assert gc.isenabled()
    with heap.steps_frozen(manual_gc):
        assert set_up_garbage() is None  # set-up's garbage: freed before the steps
        assert gc.get_freeze_count() > 0
        assert gc.isenabled() is not manual_gc
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_an_error_inside_unfreezes_and_restores_the_collector():
    with pytest.raises(RuntimeError):
        with heap.frozen(False), heap.steps_frozen(True):
            raise RuntimeError("a failed step")
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_later_run_in_the_process_collects_what_the_runs_before_it_left_before_freezing(monkeypatch):
    """The first run freezes its imports as they are; a later one (an in-process restart's attempt, a
    sweep, a test suite) first frees the garbage of the runs before it, their models and optimizers,
    instead of keeping it frozen for its whole run."""
    monkeypatch.setattr(heap, "_runs_started", 0)
    first_garbage = _dropped_cycle()
    with heap.run_frozen():
        gc.collect()
        assert first_garbage() is not None  # the first run: frozen as it was, no walk
        earlier_run_garbage = _dropped_cycle()
    with heap.run_frozen():
        assert first_garbage() is None and earlier_run_garbage() is None
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_imports_uncollected_keeps_the_collector_out_then_freezes_what_they_made():
    assert gc.isenabled()
    try:
        with heap.imports_uncollected():
            assert not gc.isenabled()
            made = [_Cycle() for _ in range(1000)]  # what imports leave: live objects
        assert gc.isenabled() and gc.get_freeze_count() >= 1000
        assert gc.get_count()[0] < 100  # nothing young left for the next automatic collection to walk
    finally:
        gc.unfreeze()
    del made


def test_imports_uncollected_gives_a_disabled_collector_back_disabled():
    gc.disable()
    try:
        with heap.imports_uncollected():
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
