"""Result validation on megatron-core's rerun state machine ([rerun_state_machine], bridge_hpc.training.resilience.rerun).

Three layers, all on CPU in this process:

* the config section: Bridge's fields and defaults, and one clear error per bad value;
* the machine driven by a loop of the loop's shape (``should_run_forward_backward`` around the
  forward/backward, ``validate_loss`` on each loss, ``should_checkpoint_and_exit`` after), with losses
  chosen per step and attempt: which step is re-run, on which batch and RNG state, what the verdict is;
* ``pretrain`` on one rank with the test forward step that spoils a loss on purpose
  (tests/data/faulty_forward_step.py, ``TEST_BAD_LOSS``): a transient NaN stops the run with the step
  before saved and a requeue request, and the next run redoes the step to the same losses as a run
  that never failed. (The deterministic NaN and the spiky losses, on 2 ranks under Slurm:
  tests/test_rerun_slurm.py.)
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from bridge_test_helpers import TINY

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.progress_log import END_REASONS, RESULT_VALIDATION, ProgressLog, parse_progress
from bridge_hpc.contracts.requeue import read_request
from bridge_hpc.rank import build_config, load_forward_step
from bridge_hpc.training.config import RerunStateMachineConfig
from bridge_hpc.training.resilience import exit_policy, rerun
from bridge_hpc.training.state import GlobalState

FAULTY = os.path.join(os.path.dirname(__file__), "data", "faulty_forward_step.py")

# ---------------------------------------------------------------------------------------------
# The config section
# ---------------------------------------------------------------------------------------------


def _config(tmp_path, *overrides):
    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    return build_config(str(job), list(overrides))


def test_defaults_are_bridges(tmp_path):
    section = _config(tmp_path).rerun_state_machine
    assert section == RerunStateMachineConfig()
    assert (section.rerun_mode, section.check_for_nan_in_loss, section.check_for_spiky_loss,
            section.spiky_loss_factor, section.error_injection_rate, section.error_injection_type) == (
        "disabled", True, False, 10.0, 0, "transient_error")
    set_ = _config(tmp_path, 'rerun_state_machine.rerun_mode="validate_results"',
                   "rerun_state_machine.check_for_spiky_loss=true", "rerun_state_machine.spiky_loss_factor=4").rerun_state_machine
    assert (set_.rerun_mode, set_.check_for_spiky_loss, set_.spiky_loss_factor) == ("validate_results", True, 4.0)


@pytest.mark.parametrize("override, key, says", [
    ('rerun_state_machine.rerun_mode="report_stats"', "rerun_state_machine.rerun_mode", "report_determinism_stats"),
    ("rerun_state_machine.spiky_loss_factor=1", "rerun_state_machine.spiky_loss_factor", "> 1"),
    ("rerun_state_machine.error_injection_rate=-1", "rerun_state_machine.error_injection_rate", ">= 0"),
    ("rerun_state_machine.error_injection_rate=100", "rerun_state_machine.error_injection_rate", "validate_results"),
    ('rerun_state_machine.error_injection_type="bitflip"', "rerun_state_machine.error_injection_type",
     "persistent_error"),
    ("rerun_state_machine.check_for_nan=true", "rerun_state_machine.check_for_nan", "check_for_nan_in_loss"),
])
def test_bad_values_name_the_key(tmp_path, override, key, says):
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, override)
    assert err.value.key == key and says in err.value.message
    assert str(tmp_path / "job.toml") in err.value.format() or "--set" in err.value.format()


# ---------------------------------------------------------------------------------------------
# The machine, driven as train_step drives it
# ---------------------------------------------------------------------------------------------


class Batches:
    """Batch n for the n-th read; a step reads one (one micro-batch)."""

    def __init__(self):
        self.reads = 0

    def __next__(self):
        self.reads += 1
        return self.reads


@pytest.fixture
def machine_for():
    """``machine_for(**section)`` -> (config, machine, step function); the machine is dropped after."""
    made = []

    def make(**fields):
        config = RerunStateMachineConfig(**fields)
        machine = rerun.init_rerun_state(config)
        batches = rerun.RerunDataIterator(Batches())
        made.append(machine)

        def step(n, loss_of):
            """Run step ``n`` (1-based); ``loss_of(attempt)`` is its loss. Returns the attempts as
            (batch, a random draw), and should_checkpoint_and_exit()."""
            attempts = []
            while machine.should_run_forward_backward(batches):
                attempts.append((next(batches), torch.rand(()).item()))
                rerun.validate_loss(torch.tensor(loss_of(len(attempts))), config)
            return attempts, machine.should_checkpoint_and_exit()

        return config, machine, step

    yield make
    rerun.destroy_rerun_state()


def test_a_nan_that_comes_back_is_deterministic_and_stops(machine_for, capsys):
    _, machine, step = machine_for(rerun_mode="validate_results")
    attempts, verdict = step(1, lambda a: float("nan"))
    # the first step of a process is never validated (megatron-core's rule) ...
    assert [b for b, _ in attempts] == [1] and verdict == (False, False, 0) and machine.attempts == 1
    attempts, verdict = step(2, lambda a: 3.0)
    assert [b for b, _ in attempts] == [2] and verdict == (False, False, 0) and machine.attempts == 1
    attempts, verdict = step(3, lambda a: float("nan"))
    # ... from the second on, a NaN makes the step run again: on the same batch and the same RNG state
    assert len(attempts) == 2 and attempts[0] == attempts[1] and attempts[0][0] == 3
    assert verdict == (True, True, 16)  # megatron-core's "save and resume elsewhere"; the loop stops for good
    assert machine.step_failures == [("nan_loss", "deterministic")]
    state = GlobalState()
    failures = rerun.report_rerun(state, 3, should_exit=True)
    assert failures == [rerun.ValidationFailure("nan_loss", "deterministic", 1)]
    assert rerun.stop_reason() == rerun.EXIT_NAN_LOSS
    assert exit_policy.PROGRESS_REASONS[rerun.stop_reason()] == "nan_loss" in exit_policy.FINAL_REASONS
    out = capsys.readouterr().out
    assert "result validation at iteration 3: nan_loss on 1 rank(s), reproduced" in out and "not requeueing" in out


def test_a_nan_that_goes_away_is_transient_and_stops_for_a_requeue(machine_for):
    _, machine, step = machine_for(rerun_mode="validate_results")
    step(1, lambda a: 3.0)
    attempts, verdict = step(2, lambda a: float("nan") if a == 1 else 3.0)
    assert len(attempts) == 2 and attempts[0] == attempts[1]
    assert verdict == (True, True, 17)
    assert rerun.report_rerun(GlobalState(), 2, should_exit=True) == [rerun.ValidationFailure("nan_loss", "transient", 1)]
    assert rerun.stop_reason() == rerun.EXIT_TRANSIENT_FAULT
    assert exit_policy.PROGRESS_REASONS[rerun.stop_reason()] not in exit_policy.FINAL_REASONS  # requeued


def test_an_inf_that_comes_back_stops_as_inf_loss(machine_for):
    _, machine, step = machine_for(rerun_mode="validate_results")
    step(1, lambda a: 3.0)
    assert step(2, lambda a: float("inf"))[1] == (True, True, 16)
    rerun.report_rerun(GlobalState(), 2, should_exit=True)
    assert rerun.stop_reason() == rerun.EXIT_INF_LOSS


def test_spiky_losses_are_judged_and_training_goes_on(machine_for):
    """The spiky threshold by hand: the largest of the first 100 validated losses times the factor.

    Steps 2..101 are validated (100 losses, one per step): 2.0, except 4.0 at step 50, so the
    threshold is 4.0 x 10 = 40.0. A loss of 39.0 passes, 40.0 is spiky."""
    _, machine, step = machine_for(rerun_mode="validate_results", check_for_spiky_loss=True, spiky_loss_factor=10.0)
    for n in range(1, 102):
        assert step(n, lambda a, n=n: 4.0 if n == 50 else 2.0)[1] == (False, False, 0)
        assert machine.attempts == 1
    attempts, verdict = step(102, lambda a: 39.0)
    assert len(attempts) == 1 and verdict == (False, False, 0)
    # a spike that the re-run reproduces: deterministic; training goes on
    attempts, verdict = step(103, lambda a: 40.0)
    assert len(attempts) == 2 and attempts[0] == attempts[1] and verdict == (False, False, 0)
    assert rerun.report_rerun(GlobalState(), 103, should_exit=False) == [
        rerun.ValidationFailure("spiky_loss", "deterministic", 1)]
    # one that it does not: transient; training goes on with the re-run's result
    attempts, verdict = step(104, lambda a: 400.0 if a == 1 else 2.0)
    assert len(attempts) == 2 and attempts[0] == attempts[1] and verdict == (False, False, 0)
    assert rerun.report_rerun(GlobalState(), 104, should_exit=False) == [
        rerun.ValidationFailure("spiky_loss", "transient", 1)]
    assert rerun.stop_reason() is None
    # the spikes did not raise the threshold, and the next step reads the next batch
    attempts, verdict = step(105, lambda a: 39.0)
    assert [b for b, _ in attempts] == [105] and verdict == (False, False, 0)  # a step reads its own batch


@pytest.mark.parametrize("bad, message", [(float("nan"), "found NaN in"), (float("inf"), "found Inf in"),
                                          (float("-inf"), "found Inf in")])
def test_disabled_mode_stops_the_rank_at_a_nan_without_a_rerun(machine_for, bad, message):
    """megatron-core's behaviour without re-runs (Bridge's default mode): a RuntimeError naming the
    check. On CPU too (megatron-core names the GPU in that message). validate_loss asks the machine
    only about a loss that is not finite: the right check must still answer."""
    _, machine, step = machine_for()
    step(1, lambda a: 3.0)
    step(2, lambda a: 2.5)
    with pytest.raises(RuntimeError, match=message + " local forward loss calculation"):
        step(3, lambda a: bad)


def test_report_determinism_stats_runs_every_step_twice_on_the_same_batch(machine_for):
    _, machine, step = machine_for(rerun_mode="report_determinism_stats")
    for n in (1, 2, 3):
        attempts, verdict = step(n, lambda a: 3.0)
        assert len(attempts) == 2 and attempts[0] == attempts[1] and attempts[0][0] == n
        assert verdict == (False, False, 0)
        assert rerun.report_rerun(GlobalState(), n, should_exit=False) == []  # stats are not failures


def test_the_progress_log_records_validations_and_the_new_end_reasons(tmp_path):
    assert {"nan_loss", "inf_loss", "invalid_result", "transient_fault"} <= set(END_REASONS)
    assert set(exit_policy.PROGRESS_REASONS.values()) <= set(END_REASONS)
    log = ProgressLog(str(tmp_path / "progress.txt"), "7", 2)
    log.starting_job()
    log.result_validation(33, "nan_loss", "deterministic", 1, "stop")
    log.ending_job("nan_loss", 32, 0)
    (run,) = parse_progress(str(tmp_path / "progress.txt"))
    event = run.last(RESULT_VALIDATION)
    assert event.fields == {"Iteration": "33", "Check": "nan_loss", "Diagnosis": "deterministic", "Ranks": "1",
                            "Action": "stop"}
    assert run.last("Ending job").fields["Reason"] == "nan_loss"


# ---------------------------------------------------------------------------------------------
# pretrain on one rank: a transient NaN, then the requeued run
# ---------------------------------------------------------------------------------------------


def _train(tmp_path, name, iters, *overrides):
    """pretrain the tiny GPT on one rank with the faulty forward step; returns the config."""
    from bridge_hpc.training.pretrain import pretrain

    cfg = _config(tmp_path, f"job.run_dir={tmp_path / name}", f"train.train_iters={iters}", "train.global_batch_size=4",
                  "train.eval_interval=0", "checkpoint.save_interval=100", "logger.log_progress=true",
                  'rerun_state_machine.rerun_mode="validate_results"', *overrides)
    pretrain(cfg, load_forward_step(f"{FAULTY}:forward_step"))
    return cfg


def test_a_transient_nan_stops_with_the_step_before_saved_and_the_requeued_run_redoes_it(one_rank, tmp_path,
                                                                                        monkeypatch, capsys):
    from bridge_hpc.training.engine.metrics import read_metrics

    reference = read_metrics(_train(tmp_path, "reference", 6).logger.metrics_file)

    monkeypatch.setenv("TEST_BAD_LOSS", "transient_nan:4:0")
    cfg = _train(tmp_path, "faulty", 6)  # returns: the rank's status is 0
    out = capsys.readouterr().out
    assert out.count("TEST BAD LOSS transient_nan rank 0 step 4") == 1  # the first attempt's first micro-batch only
    assert "exiting at iteration 3: transient fault (recorded as transient_fault)" in out
    assert run_folder.tracked_iteration(cfg.checkpoint.save) == 3
    (run,) = parse_progress(os.path.join(cfg.checkpoint.save, "progress.txt"))
    assert run.last(RESULT_VALIDATION).fields == {"Iteration": "4", "Check": "nan_loss", "Diagnosis": "transient",
                                                  "Ranks": "1", "Action": "stop"}
    end = run.last("Ending job").fields
    assert (end["Reason"], end["Iteration"], end["Steps lost"]) == ("transient_fault", "3", "0")
    request = read_request(str(one_rank))
    assert (request.reason, request.iteration) == ("transient_fault", 3)
    assert sorted(read_metrics(cfg.logger.metrics_file)) == [1, 2, 3]  # the failed step was not counted

    # the requeued run (Slurm's restart 1: the transient fault is gone) resumes at 3 and redoes step 4
    one_rank.unlink()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    cfg = _train(tmp_path, "faulty", 6)
    assert not one_rank.exists()
    runs = parse_progress(os.path.join(cfg.checkpoint.save, "progress.txt"))
    assert [r.last("Ending job").fields["Reason"] for r in runs] == ["transient_fault", "done"]
    assert runs[1].last("Loaded checkpoint").fields["Iteration"] == "3"
    losses = {step: record["loss"] for step, record in read_metrics(cfg.logger.metrics_file).items()}
    assert losses == {step: record["loss"] for step, record in reference.items()}  # bit for bit, steps 1..6
