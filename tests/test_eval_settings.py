"""Evaluation's own settings, acted on in real runs (2 CPU ranks, torchrun): ``validation.eval_global_batch_size``
and ``eval_micro_batch_size`` (the batches evaluation reads), ``validation.start_eval_at_iter``, and
``train.manual_gc_eval``'s companion checks (issue 27)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from bridge_test_helpers import tiny_job, tiny_run_dir
from warm_ranks import run_job

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.metrics_file import VALIDATION_LOSS
from bridge_hpc.training.engine.metrics import read_metrics


def _run(job: str, *overrides: str) -> str:
    return run_job(job, ["train.train_iters=20", "checkpoint.save_interval=20", *overrides],
                   cwd=os.path.dirname(job)).stdout


def _validation_losses(job: str) -> dict:
    metrics = read_metrics(os.path.join(tiny_run_dir(job), "metrics.jsonl"))
    return {step: record[VALIDATION_LOSS] for step, record in metrics.items() if VALIDATION_LOSS in record}


def _consumed_valid_samples(job: str) -> int:
    state = torch.load(os.path.join(tiny_run_dir(job), "checkpoints", "iter_0000020", "train_state.pt"),
                       weights_only=False)
    return state["train_state"]["consumed_valid_samples"]


def test_evaluation_reads_batches_of_its_own_sizes(tmp_path):
    # tiny.toml: global batch 8, micro-batch 2, 2 ranks; eval_interval 10 here, eval_iters 2
    default = tiny_job(tmp_path / "default")
    _run(default, "train.eval_interval=10")
    micro = tiny_job(tmp_path / "micro")  # the same 8 samples per batch, read 4 at a time per rank
    _run(micro, "train.eval_interval=10", "validation.eval_micro_batch_size=4")
    bigger = tiny_job(tmp_path / "bigger")  # 16 samples per batch
    _run(bigger, "train.eval_interval=10", "validation.eval_global_batch_size=16", "validation.eval_micro_batch_size=4")

    a, b, c = _validation_losses(default), _validation_losses(micro), _validation_losses(bigger)
    assert sorted(a) == sorted(b) == sorted(c) == [10, 20]
    for step in (10, 20):
        # the same samples, a different grouping: the same mean loss up to the order of the sums
        assert b[step] == pytest.approx(a[step], rel=1e-5)
        assert c[step] != a[step]  # twice the samples: another mean
    assert _consumed_valid_samples(default) == _consumed_valid_samples(micro) == 2 * 2 * 8
    assert _consumed_valid_samples(bigger) == 2 * 2 * 16


def test_no_evaluation_before_start_eval_at_iter(tmp_path):
    job = tiny_job(tmp_path / "late")
    _run(job, "train.eval_interval=5", "validation.start_eval_at_iter=12")
    assert sorted(_validation_losses(job)) == [15, 20]


@pytest.mark.parametrize("eval_gbs, eval_mbs", [(6, 2), (8, 3)])
def test_evaluation_sizes_the_data_parallel_size_does_not_divide_are_refused(eval_gbs, eval_mbs):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_seed_config import _python_built

    cfg = _python_built()
    cfg.validation.eval_global_batch_size, cfg.validation.eval_micro_batch_size = eval_gbs, eval_mbs
    cfg.finalize_sections()
    with pytest.raises(ConfigError, match=r"validation\.eval_global_batch_size"):
        cfg.validate(world_size=2)


def test_iterations_to_skip_read_and_drop_their_batches_and_resume_exactly(tmp_path):
    straight = tiny_job(tmp_path / "straight")
    _run(straight, "train.iterations_to_skip=[5, 6]")
    stopped = tiny_job(tmp_path / "stopped")  # stopped after iteration 4, resumed across the skipped ones
    _run(stopped, "train.iterations_to_skip=[5, 6]", "train.exit_interval=4")
    _run(stopped, "train.iterations_to_skip=[5, 6]")
    plain = tiny_job(tmp_path / "plain")
    _run(plain)

    a = read_metrics(os.path.join(tiny_run_dir(straight), "metrics.jsonl"))
    b = read_metrics(os.path.join(tiny_run_dir(stopped), "metrics.jsonl"))
    c = read_metrics(os.path.join(tiny_run_dir(plain), "metrics.jsonl"))
    assert sorted(a) == sorted(b) == [i for i in range(1, 21) if i not in (5, 6)]
    for step in sorted(a):
        assert a[step]["loss"] == b[step]["loss"], step  # bit-exact across the resume
    assert all(a[step]["loss"] == c[step]["loss"] for step in range(1, 5))  # the same run until the skip
    assert a[7]["loss"] != c[7]["loss"]  # then other data on other weights
    state = torch.load(os.path.join(tiny_run_dir(straight), "checkpoints", "iter_0000020", "train_state.pt"),
                       weights_only=False)["train_state"]
    assert (state["consumed_train_samples"], state["skipped_train_samples"]) == (20 * 8, 2 * 8)
