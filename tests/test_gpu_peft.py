"""PEFT on one GPU, on the path a job on GPUs gets by default (issues 28 and 30); skipped without CUDA.

LoRA and DoRA fine-tuning of the tiny GPT of tests/data/tiny.toml in bf16, from a 10-step pretrained
run of it, the job asking for a GPU (``slurm.gpus_per_node = 1``) so that the adapters train under
the full-iteration CUDA graph, the toolkit's fused kernels (the frozen base linears keep
megatron-core's own path), the fused optimizer step and asynchronous interval saves, with
megatron-core's distributed optimizer:

* the losses equal those of the same fine-tuning on the plain path (the job asking for no GPUs:
  eager, unfused, synchronous saves) within bf16's tolerance, and the graph is captured once;
* a LoRA run stopped by ``train.exit_interval`` and resumed reproduces the uninterrupted run bit for
  bit, its base loaded again from the pretrained checkpoint;
* its checkpoint holds the adapters and the optimizer's moments of the adapters, nothing else, the
  asynchronous saves included (megatron-core's dist_checkpointing writer).

Run: ``python -m pytest -q tests/test_gpu_peft.py`` (a few minutes on an H100).
"""

from __future__ import annotations

import os

import pytest
import torch
from bridge_test_helpers import run_one_gpu_rank, tiny_job

from bridge_hpc.contracts import run_folder
from bridge_hpc.training.engine.metrics import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16 = ("model.bf16=true", "optimizer.bf16=true")
DIST_OPT = ("ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true")
CAPTURED = "full-iteration CUDA graph captured after 3 eager steps"
#: As in tests/test_gpu_speed_defaults.py: fused and unfused kernels round bf16 differently.
BF16_RTOL = 2e-2
RUN_TIMEOUT_S = 240
#: Elements megatron-core's gradient buffer may pad before each parameter of the distributed optimizer
#: (its 64-element alignment, doubled to leave room), counted against the adapters' size.
ALIGNMENT = 128


def _finetune(kind: str, gpus: int) -> tuple:
    return ("job.entry=finetune", "job.run_dir=runs/finetune", "checkpoint.pretrained_checkpoint=../base/runs/base/checkpoints",
            f"peft.type={kind}", f"slurm.gpus_per_node={gpus}") + BF16 + DIST_OPT


def _losses(job: str) -> dict:
    records = read_metrics(os.path.join(os.path.dirname(job), "runs", "finetune", run_folder.METRICS_FILE))
    return {step: r["loss"] for step, r in records.items()}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """The tiny GPT pretrained for 10 steps on this GPU (plain path); the folder holding its job."""
    folder = tmp_path_factory.mktemp("gpu-peft") / "base"
    job = tiny_job(folder)
    run_one_gpu_rank(job, "job.run_dir=runs/base", "train.train_iters=10", "slurm.gpus_per_node=0", *BF16,
                     timeout_s=RUN_TIMEOUT_S)
    return str(folder)


def _job(base: str, name: str) -> str:
    """A job beside the base's folder, so that ``../base/runs/base/checkpoints`` is the pretrained run."""
    return tiny_job(os.path.join(os.path.dirname(base), name))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapters_train_on_the_default_path_as_on_the_plain_path(base, kind):
    fast_job = _job(base, f"{kind}-default")
    out = run_one_gpu_rank(fast_job, *_finetune(kind, 1), timeout_s=RUN_TIMEOUT_S)
    assert out.count(CAPTURED) == 1, out[-4000:]
    assert "loaded pretrained weights" in out and "started asynchronous checkpoint save of iteration" in out
    plain_job = _job(base, f"{kind}-plain")
    plain_out = run_one_gpu_rank(plain_job, *_finetune(kind, 0), timeout_s=RUN_TIMEOUT_S)
    assert CAPTURED not in plain_out
    fast, plain = _losses(fast_job), _losses(plain_job)
    assert sorted(fast) == sorted(plain) == list(range(1, 41))
    worst = max(abs(fast[s] - plain[s]) / abs(plain[s]) for s in plain)
    assert worst <= BF16_RTOL, (worst, fast, plain)
    assert sum(fast[s] for s in range(36, 41)) < sum(fast[s] for s in range(1, 6))  # the adapters learn


def test_lora_stopped_and_resumed_on_the_default_path_is_bit_exact_with_adapter_sized_checkpoints(base):
    from torch.distributed.checkpoint import FileSystemReader

    straight = _job(base, "lora-straight")
    run_one_gpu_rank(straight, *_finetune("lora", 1), timeout_s=RUN_TIMEOUT_S)
    stopped = _job(base, "lora-stopped")
    run_one_gpu_rank(stopped, *_finetune("lora", 1), "train.exit_interval=15", timeout_s=RUN_TIMEOUT_S)
    out = run_one_gpu_rank(stopped, *_finetune("lora", 1), timeout_s=RUN_TIMEOUT_S)
    assert "loaded checkpoint" in out and "loaded pretrained weights" in out, out[-4000:]
    a, b = _losses(straight), _losses(stopped)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    assert all(a[s] == b[s] for s in a), [(s, a[s], b[s]) for s in a if a[s] != b[s]][:3]

    last = os.path.join(os.path.dirname(stopped), "runs", "finetune", run_folder.CHECKPOINTS_DIR, "iter_0000040")
    # megatron-core's sharded format (the GPU back end): model tensors under their own keys
    # ("decoder.layers...."), the distributed optimizer's state as flat buckets
    # ("optimizer.distributed....bucket_idx_0.exp_avg"), each holding the parameters that train, in
    # order, with megatron-core's alignment padding between them.
    metadata = FileSystemReader(last).read_metadata().state_dict_metadata
    model_keys = [k for k in metadata if not k.startswith("optimizer.") and hasattr(metadata[k], "size")]
    assert model_keys and all(".adapter." in k for k in model_keys), [k for k in model_keys if ".adapter." not in k]
    adapter_numel = sum(metadata[k].size.numel() for k in model_keys)
    for state in ("param", "exp_avg", "exp_avg_sq"):  # fp32 main weights and Adam's moments: adapter-sized
        buckets = [k for k in metadata if k.startswith("optimizer.distributed.") and k.endswith(f".{state}")]
        numel = sum(metadata[k].size.numel() for k in buckets)
        assert buckets and adapter_numel <= numel <= adapter_numel + ALIGNMENT * (len(model_keys) + 1), \
            (state, numel, adapter_numel)
