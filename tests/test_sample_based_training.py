"""Training counted in samples (``train.train_samples``, ``scheduler.lr_*_samples``): the same run as
counted in iterations, bit for bit, and it resumes bit-exactly after a stop (2 CPU ranks, torchrun)."""

from __future__ import annotations

import os
import sys

import pytest
from bridge_test_helpers import TINY, assert_bitwise_equal, model_params, tiny_run_dir
from warm_ranks import run_job

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.engine.metrics import read_metrics

GBS = 8  # tiny.toml's global batch size


def _job(directory, by_samples: bool) -> str:
    """tiny.toml, counted in iterations as it is, or in samples: 40 iterations = 320 samples, warm-up
    4 iterations = 32 samples."""
    os.makedirs(directory, exist_ok=True)
    text = open(TINY, encoding="utf-8").read()
    if by_samples:
        text = text.replace("train_iters = 40", f"train_samples = {40 * GBS}")
        text = text.replace("lr_warmup_iters = 4", f"lr_warmup_samples = {4 * GBS}")
        assert "train_samples" in text and "lr_warmup_samples" in text
    path = os.path.join(directory, "job.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _run(job: str, *overrides: str) -> str:
    return run_job(job, overrides, cwd=os.path.dirname(job)).stdout


def test_a_run_counted_in_samples_equals_the_run_counted_in_iterations_and_resumes_exactly(tmp_path):
    iterations = _job(tmp_path / "iterations", by_samples=False)
    _run(iterations)
    samples = _job(tmp_path / "samples", by_samples=True)
    out = _run(samples, "train.exit_interval=20")  # stopped half-way, then resumed
    assert "exiting at iteration 20: exit_interval" in out
    out = _run(samples)
    assert "loaded checkpoint" in out and "iter_0000020" in out

    a = read_metrics(os.path.join(tiny_run_dir(iterations), "metrics.jsonl"))
    b = read_metrics(os.path.join(tiny_run_dir(samples), "metrics.jsonl"))
    assert sorted(a) == sorted(b) == list(range(1, 41))
    for step in range(1, 41):
        for key in ("loss", "lr", "grad_norm"):
            assert b[step][key] == a[step][key], (step, key)  # exact, not approximate
    assert a[2]["lr"] < a[4]["lr"]  # the warm-up is there in both (4 iterations = 32 samples)
    assert_bitwise_equal(
        model_params(os.path.join(tiny_run_dir(iterations), "checkpoints", "iter_0000040"), str(tmp_path)),
        model_params(os.path.join(tiny_run_dir(samples), "checkpoints", "iter_0000040"), str(tmp_path)))


def _container(**train):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_seed_config import _python_built

    cfg = _python_built()
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_samples_fill_train_iters_and_the_scheduler_steps():
    cfg = _container(train_iters=None, train_samples=100)
    cfg.scheduler.lr_warmup_iters = 0
    cfg.scheduler.lr_warmup_fraction = None
    cfg.scheduler.lr_warmup_samples = 10
    cfg.finalize_sections()
    cfg.validate(world_size=1)
    gbs = cfg.train.global_batch_size
    assert cfg.train.train_iters == 100 // gbs
    s = cfg.scheduler
    assert (s.lr_decay_steps, s.lr_warmup_steps, s.wd_incr_steps) == (100, 10, 100)


@pytest.mark.parametrize("train, scheduler, key", [
    ({"train_iters": 8, "train_samples": 64}, {}, "train.train_samples"),
    ({"train_iters": None, "train_samples": 64}, {"lr_decay_iters": 4}, "scheduler.lr_decay_iters"),
    ({}, {"lr_decay_samples": 40}, "scheduler.lr_decay_samples"),
    ({"train_iters": None, "train_samples": 64}, {"lr_warmup_samples": 64, "lr_warmup_fraction": None,
                                                  "lr_warmup_iters": 0}, "scheduler.lr_warmup_samples"),
])
def test_mixing_the_units_is_refused_naming_the_key(train, scheduler, key):
    cfg = _container(**train)
    for name, value in scheduler.items():
        setattr(cfg.scheduler, name, value)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        cfg.finalize_sections()
        cfg.validate(world_size=1)
    assert isinstance(err.value, ValueError)  # Bridge raises ValueError/AssertionError here
