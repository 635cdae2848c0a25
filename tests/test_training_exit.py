"""checkpoint_and_decide_exit: which reasons stop the loop, and when a checkpoint is written.

Single process, no process group (the cross-rank agreement is exercised by the 2-rank SIGTERM test
in test_training_resume.py).
"""

import os
import shutil
import signal
import time

import pytest
from bridge_test_helpers import TINY

from bridge_hpc.contracts.requeue import REQUEUE_FILE_ENV, read_request
from bridge_hpc.rank import build_config
from bridge_hpc.training import train as train_module
from bridge_hpc.training.checkpoint import checkpointing
from bridge_hpc.training.resilience import exit_policy
from bridge_hpc.training.state import DistributedSignalHandler, GlobalState


@pytest.fixture
def state(tmp_path, monkeypatch):
    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    monkeypatch.chdir(tmp_path)
    st = GlobalState()
    st.cfg = build_config(str(job), ["checkpoint.save_interval=10", "train.exit_interval=0"])
    st.cfg.validate(world_size=1)
    saves = []
    monkeypatch.setattr(checkpointing, "save_checkpoint", lambda s, *args: saves.append(s.train_state.step))
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


def test_exit_interval_counts_steps_trained_not_loaded(state):
    state.cfg.train.exit_interval = 10
    state.train_state.step = state.run_start_step = 20  # resumed at a multiple: keep training
    assert decide(state, {"last_saved_step": 20})[0] is False
    state.train_state.step = 30
    assert decide(state)[0] and state.exit_reasons == ["exit_interval"]


@pytest.fixture
def slurm_end(state, monkeypatch):
    """The job's end time as Slurm would report it (squeue is asked through slurm_query)."""
    import bridge_hpc.slurm.query as slurm_query

    end = {"t": None, "start": time.time() - 60, "limit": 3600.0}
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setattr(slurm_query, "job_times",
                        lambda job_id: slurm_query.JobTimes(start=end["start"], end=end["t"], limit_s=end["limit"]))
    # Why Slurm stops the job (scontrol/sacct): None = it runs on (a warning signal); tests set it.
    end["cause"] = None
    monkeypatch.setattr(slurm_query, "stop_cause", lambda job_id, restarts: end["cause"])
    return end


def test_time_limit_exit_when_a_step_and_a_save_no_longer_fit(state, slurm_end, tmp_path, monkeypatch):
    monkeypatch.setenv(REQUEUE_FILE_ENV, str(tmp_path / "requeue"))
    state.slowest_step_s, state.last_save_s = 2.0, 3.0
    state.train_state.step = 5
    slurm_end["t"] = time.time() + exit_policy.TIME_LIMIT_MARGIN_S + 2.0 + 3.0 + 30  # fits
    assert decide(state)[0] is False
    state.job_times_checked = 0.0  # force the periodic re-read
    slurm_end["t"] = time.time() + exit_policy.TIME_LIMIT_MARGIN_S + 2.0 + 3.0 - 1  # does not fit
    stop, _ = decide(state)
    assert stop and state.saves == [5] and state.exit_reasons == ["time limit"]
    request = read_request(str(tmp_path / "requeue"))
    assert (request.reason, request.iteration) == ("time_limit", 5)


def test_signal_is_told_preemption_or_time_limit_by_the_end_time(state, slurm_end, tmp_path, monkeypatch):
    monkeypatch.setenv(REQUEUE_FILE_ENV, str(tmp_path / "requeue"))
    state.signal_handler = DistributedSignalHandler(["SIGTERM"]).__enter__()
    request = tmp_path / "requeue"
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        state.train_state.step = 5
        # Slurm's warning before the time limit: the end is still start + limit, and near
        slurm_end["start"] = time.time() + 90 - slurm_end["limit"]
        slurm_end["t"] = time.time() + 90
        assert decide(state)[0] and read_request(str(request)).reason == "time_limit"
        # preemption: Slurm pulled the end forward to now + GraceTime, long before start + limit
        slurm_end["start"], slurm_end["t"] = time.time() - 60, time.time() + 30
        assert decide(state, {"last_saved_step": 5})[0] and read_request(str(request)).reason == "signal"
        # a signal far from any end (scancel --signal): a preemption-like stop, not a time-out
        slurm_end["t"] = slurm_end["start"] + slurm_end["limit"]
        assert decide(state, {"last_saved_step": 5})[0] and read_request(str(request)).reason == "signal"
        # Slurm says why: a cancel is final (no request), a requeue or preemption requeues
        for cause, reason in (("requeued", "signal"), ("preempted", "signal"), ("time_limit", "time_limit")):
            request.unlink()
            slurm_end["cause"] = cause
            assert decide(state, {"last_saved_step": 5})[0] and read_request(str(request)).reason == reason
        request.unlink()
        slurm_end["cause"] = "cancelled"
        assert decide(state, {"last_saved_step": 5})[0] and not request.exists()
    finally:
        state.signal_handler.release()


def test_no_requeue_request_when_the_work_is_done(state, tmp_path, monkeypatch):
    monkeypatch.setenv(REQUEUE_FILE_ENV, str(tmp_path / "requeue"))
    state.train_state.step = 40
    assert decide(state)[0] and not (tmp_path / "requeue").exists()


def test_done_outranks_other_reasons_at_the_last_step(state, tmp_path, monkeypatch):
    monkeypatch.setenv(REQUEUE_FILE_ENV, str(tmp_path / "requeue"))
    state.cfg.train.exit_interval = 10
    state.train_state.step = 40
    assert decide(state)[0] and set(state.exit_reasons) == {"train_iters reached", "exit_interval"}
    assert exit_policy.progress_reason(state, state.exit_reasons) == "done"
    assert not (tmp_path / "requeue").exists()


def test_time_limit_rule_expects_the_saves_the_progress_log_measured(state, slurm_end):
    """Before this run has saved, the rule uses the longest recent save of earlier runs, not a guess:
    a 1-minute job whose saves take 1 s must not stop 50 s early in every allocation."""
    state.slowest_step_s = 1.0
    state.train_state.step = 5
    slurm_end["t"] = time.time() + exit_policy.TIME_LIMIT_MARGIN_S + 1.0 + 5.0
    assert exit_policy.expected_save_s(state) == exit_policy.FIRST_SAVE_GUESS_S
    assert decide(state)[0] and state.exit_reasons == ["time limit"]  # the 30 s guess does not fit
    state.logged_save_s = 1.0  # what earlier runs measured (progress.txt's Save seconds)
    state.job_times_checked = 0.0
    state.exit_reasons = []
    assert decide(state, {"last_saved_step": 5})[0] is False
