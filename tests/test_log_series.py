"""The extra log series of ``[logger]`` act in a real run (2 CPU ranks, torchrun): the loss scale, the world
size, the timers per ``timing_log_level`` / ``timing_log_option``, validation perplexity, and the
TensorBoard queue size (issue 27)."""

from __future__ import annotations

import math
import os
import re

import pytest
from bridge_test_helpers import tiny_job, tiny_run_dir
from warm_ranks import run_job

from bridge_hpc.training.engine.metrics import MetricsLogger, RunStart, read_metrics


def _run(job: str, *overrides: str) -> str:
    return run_job(job, ["train.train_iters=10", "logger.log_interval=5", "train.eval_interval=5",
                         'logger.tensorboard_dir="tb"', *overrides], cwd=os.path.dirname(job)).stdout


def _tensorboard(job: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(os.path.join(tiny_run_dir(job), "tb"), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    job = tiny_job(tmp_path_factory.mktemp("series"))
    out = _run(job, "logger.log_world_size_to_tensorboard=true", "logger.timing_log_level=1",
               "logger.log_timers_to_tensorboard=true", "logger.log_validation_ppl_to_tensorboard=true")
    return job, out


def test_loss_scale_world_size_and_timers_join_the_log_steps(logged):
    job, _ = logged
    metrics = read_metrics(os.path.join(tiny_run_dir(job), "metrics.jsonl"))
    for step in (5, 10):
        assert metrics[step]["loss_scale"] == 1.0  # no fp16 scaler on CPU: Megatron's 1.0
        assert metrics[step]["world_size"] == 2
        assert metrics[step]["forward-backward-time"] > 0 and metrics[step]["optimizer-time"] > 0
    assert "loss_scale" not in metrics[4] and "forward-backward-time" not in metrics[4]  # log steps only
    scalars = _tensorboard(job)
    assert [s for s, _ in scalars["loss-scale"]] == [5, 10] and [v for _, v in scalars["world-size"]] == [2, 2]
    assert [s for s, _ in scalars["forward-backward-time"]] == [5, 10]


def test_timers_are_printed_as_timing_log_option_says(logged):
    _, out = logged
    lines = [line for line in out.splitlines() if line.startswith("(ms per step, (min, max))")]
    assert len(lines) == 2  # minmax, the default, at steps 5 and 10
    assert re.search(r"forward-backward: \(\d+\.\d+, \d+\.\d+\)", lines[0])


def test_validation_perplexity_goes_to_tensorboard(logged):
    job, _ = logged
    scalars = _tensorboard(job)
    losses = dict(scalars["lm loss validation"])
    ppl = dict(scalars["lm loss validation ppl"])
    assert sorted(ppl) == [5, 10]
    for step, value in ppl.items():
        assert value == pytest.approx(math.exp(losses[step]), rel=1e-5)


def test_timers_stay_off_and_free_by_default(tmp_path):
    job = tiny_job(tmp_path)
    out = _run(job, "logger.timing_log_option=\"max\"")
    metrics = read_metrics(os.path.join(tiny_run_dir(job), "metrics.jsonl"))
    assert "forward-backward-time" not in metrics[5] and "world_size" not in metrics[5]
    assert "ms per step" not in out


def test_tensorboard_queue_size_is_the_writers(tmp_path):
    logger = MetricsLogger(None, 0, 1, str(tmp_path / "tb"), tensorboard_queue_size=7)
    logger.open(0, RunStart(restart_count=0, load_s=None, started_at=0.0))
    try:
        assert logger.writer.max_queue == 7
    finally:
        logger.close()
