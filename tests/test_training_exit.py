"""checkpoint_and_decide_exit: which reasons stop the loop, and when a checkpoint is written.

Single process, no process group (the cross-rank agreement is exercised by the 2-rank SIGTERM test
in test_training_resume.py).
"""

import os
import shutil
import signal
import time

import pytest

from bridge_hpc.run import build_config
from bridge_hpc.training import train as train_module
from bridge_hpc.training.state import DistributedSignalHandler, GlobalState

TINY = os.path.join(os.path.dirname(__file__), "data", "tiny.toml")


@pytest.fixture
def state(tmp_path, monkeypatch):
    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    monkeypatch.chdir(tmp_path)
    st = GlobalState()
    st.cfg = build_config(str(job), ["checkpoint.save_interval=10", "train.exit_interval=0"])
    st.cfg.validate(world_size=1)
    saves = []
    monkeypatch.setattr(train_module, "save_checkpoint", lambda s, *args: saves.append(s.train_state.step))
    st.saves = saves
    return st


def decide(state, context=None):
    context = {} if context is None else context
    return train_module.checkpoint_and_decide_exit(state, [], None, None, 0.0, context, None), context


def test_keep_going_without_reason(state):
    state.train_state.step = 7
    assert decide(state)[0] is False and state.saves == []


def test_save_interval_saves_without_exiting(state):
    state.train_state.step = 10
    assert decide(state)[0] is False and state.saves == [10]


def test_train_iters_done_saves_once(state):
    state.train_state.step = 40  # also a save_interval multiple: still one save
    stop, context = decide(state)
    assert stop and state.saves == [40] and context["last_saved_step"] == 40
    assert state.exit_reasons == ["train_iters reached"]


def test_exit_interval(state):
    state.cfg.train.exit_interval = 7
    state.train_state.step = 7
    assert decide(state)[0] and state.saves == [7] and state.exit_reasons == ["exit_interval"]


def test_exit_duration(state):
    state.cfg.train.exit_duration_in_mins = 1.0
    state.train_state.step = 3
    assert decide(state)[0] is False
    state.start_time = time.time() - 61
    assert decide(state)[0] and state.saves == [3] and state.exit_reasons == ["exit_duration_in_mins"]


def test_signal_is_only_recorded_then_acted_on(state):
    state.signal_handler = DistributedSignalHandler(["SIGUSR1"]).__enter__()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler only records it; the process lives on
        assert state.signal_handler.received == signal.SIGUSR1
        state.train_state.step = 5
        stop, _ = decide(state, {"last_saved_step": 5})  # this step is already saved: no second save
        assert stop and state.saves == [] and state.exit_reasons == ["signal received"]
    finally:
        state.signal_handler.release()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
