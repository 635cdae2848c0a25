"""``checkpoint.save_retain_interval`` (Megatron's): the checkpoints at its multiples are kept besides the
``most_recent_k`` newest, in a real run (2 CPU ranks, torchrun)."""

from __future__ import annotations

import os

import pytest
from bridge_test_helpers import tiny_checkpoints, tiny_job
from warm_ranks import run_job

from bridge_hpc.training.checkpoint.checkpointing import complete_iterations
from bridge_hpc.training.config import CheckpointConfig


def _run(job: str, *overrides: str) -> None:
    run_job(job, ["train.eval_interval=0", *overrides], cwd=os.path.dirname(job))


@pytest.mark.parametrize("most_recent_k, kept", [(-1, [20, 40]), (2, [20, 35, 40])])
def test_retained_checkpoints_are_the_multiples_and_the_newest(tmp_path, most_recent_k, kept):
    job = tiny_job(tmp_path)
    _run(job, "checkpoint.save_interval=5", "checkpoint.save_retain_interval=20",
         f"checkpoint.most_recent_k={most_recent_k}")
    assert complete_iterations(tiny_checkpoints(job)) == kept


@pytest.mark.parametrize("values, key", [({"save_retain_interval": 0, "save_interval": 5}, "save_retain_interval"),
                                         ({"save_retain_interval": 10}, "save_retain_interval"),
                                         ({"ckpt_step": -1, "load": "/x"}, "ckpt_step")])
def test_bad_retention_settings_name_the_key(values, key):
    with pytest.raises(ValueError, match=f"checkpoint.{key}"):
        CheckpointConfig(**values).finalize()
