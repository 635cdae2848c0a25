"""Result validation on a GPU, where megatron-core's rerun state machine runs its own CUDA paths (the CUDA
RNG state, the GPU index in its verdicts) and the loop uses megatron-core's DDP and optimizer. Skipped
without a GPU (CI has none); run on the device machine: ``python -m pytest -q tests/test_gpu_rerun.py``.
The CPU counterparts: tests/test_rerun.py, tests/test_rerun_slurm.py."""

from __future__ import annotations

import os

import pytest
from bridge_test_helpers import with_test_layers
from test_rerun import FAULTY, _config

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.progress_log import RESULT_VALIDATION, parse_progress
from bridge_hpc.rank import load_forward_step
from bridge_hpc.training.config import RerunStateMachineConfig
from bridge_hpc.training.resilience import rerun
from bridge_hpc.training.state import GlobalState

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_machine_replays_the_step_and_judges_it_on_a_gpu():
    config = RerunStateMachineConfig(rerun_mode="validate_results")
    machine = rerun.init_rerun_state(config)
    batches = rerun.RerunDataIterator(iter(range(1, 100)))
    try:
        def step(loss_of):
            attempts = []
            while machine.should_run_forward_backward(batches):
                attempts.append((next(batches), torch.rand((), device="cuda").item(), torch.rand(()).item()))
                rerun.validate_loss(torch.tensor(loss_of(len(attempts)), device="cuda"), config)
            return attempts, machine.should_checkpoint_and_exit()

        assert step(lambda a: 3.0)[1] == (False, False, 0)
        attempts, verdict = step(lambda a: float("nan") if a == 1 else 3.0)  # transient
        assert len(attempts) == 2 and attempts[0] == attempts[1]  # same batch, same CUDA and CPU draws
        # (should_checkpoint, should_exit, exit code): megatron-core 0.16 asks for a checkpoint here and
        # 0.19 does not; the loop saves the last good step on every stop either way
        assert verdict[1:] == (True, 17) and machine.step_failures == [("nan_loss", "transient")]
        rerun.report_rerun(GlobalState(), 2, should_exit=True)
        assert rerun.stop_reason() == rerun.EXIT_TRANSIENT_FAULT
    finally:
        rerun.destroy_rerun_state()


def test_a_nan_stops_one_gpu_run_with_the_step_before_saved(one_rank, tmp_path, monkeypatch):
    from bridge_hpc.training.pretrain import pretrain

    monkeypatch.setenv("TEST_BAD_LOSS", "nan:4:0")
    cfg = _config(tmp_path, *with_test_layers([
        f"job.run_dir={tmp_path / 'gpu'}", "train.train_iters=6", "train.global_batch_size=4", "train.eval_interval=0",
        "checkpoint.save_interval=100", "logger.log_progress=true", 'rerun_state_machine.rerun_mode="validate_results"']))
    pretrain(cfg, load_forward_step(f"{FAULTY}:forward_step"))
    assert run_folder.tracked_iteration(cfg.checkpoint.save) == 3
    (run,) = parse_progress(os.path.join(cfg.checkpoint.save, "progress.txt"))
    assert run.last(RESULT_VALIDATION).fields["Diagnosis"] == "deterministic"
    assert run.last("Ending job").fields["Reason"] == "nan_loss"
    assert not one_rank.exists()  # no requeue request
