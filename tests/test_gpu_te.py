"""Transformer Engine's layers on one GPU (issue 46): skipped without CUDA and the transformer_engine package.

The tiny GPT of tests/data/tiny.toml in bf16, its job asking for a GPU, ``model.transformer_impl =
"transformer_engine"`` (megatron-core's TE layer spec), each run a real rank (``python -m
bridge_hpc.rank``) with real checkpoints (megatron-core's dist_checkpointing):

* bf16 on TE's layers (the default path around them: fusions, the whole-step CUDA graph, async saves),
  FP8 with delayed scaling (``[mixed_precision] fp8 = "hybrid"``, its amax history in each layer's
  ``_extra_state``) and FP8 with current scaling: a run stopped by SIGUSR1 and resumed reproduces the
  uninterrupted run bit for bit;
* LoRA on TE's layers (the adapter inside TE's fused linear): stopped and resumed bit for bit, its
  checkpoints holding the adapters only;
* a checkpoint moves between the layouts: ``bridge-hf import`` into either, ``bridge-hf export`` of
  either gives the same tensors bit for bit, and a run saved on TE's layers resumes on the local ones and
  back (one warning line: the per-layer state the other layout lacks starts fresh).

Run: ``python -m pytest -q tests/test_gpu_te.py`` (a few minutes on an H200).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from bridge_test_helpers import (
    FAULTY_FORWARD_STEP,
    direct_rank_env,
    run_one_gpu_rank,
    set_args,
    signal_tree,
    tiny_job,
    tiny_run_dir,
)
from hf_models import make_hf_model, safetensors_in

from bridge_hpc.contracts import run_folder
from bridge_hpc.training.engine.metrics import read_metrics
from bridge_hpc.training.mixed_precision import recipe_fields

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
                                reason="needs a CUDA GPU and Transformer Engine")

TE = ('model.transformer_impl="transformer_engine"', "slurm.gpus_per_node=1", "model.bf16=true", "optimizer.bf16=true")
#: FP8 on bf16, as Bridge's ``bf16_with_fp8_*`` recipes: ``[mixed_precision]`` writes the model's
#: precision fields, and its ``bf16`` defaults to false (FP8 alone trains the rest in fp32); so the
#: ``bf16_mixed`` recipe's fields come with it, from the recipe itself.
BF16_FP8 = tuple(f"mixed_precision.{k}={json.dumps(v)}" for k, v in recipe_fields("bf16_mixed").items()) + (
    'mixed_precision.fp8="hybrid"',)
PRECISIONS = {
    "bf16": (),
    "fp8-delayed": BF16_FP8 + ('mixed_precision.fp8_recipe="delayed"', "mixed_precision.fp8_amax_history_len=16",
                               'mixed_precision.fp8_amax_compute_algo="max"'),
    "fp8-tensorwise": BF16_FP8 + ('mixed_precision.fp8_recipe="tensorwise"',),
}
#: The forward step with a gate (tests/data/faulty_forward_step.py's TEST_HOLD): Bridge's GPT step.
HELD_STEP = 12
RUN_TIMEOUT_S = 300
CAPTURED = "full-iteration CUDA graph captured"
ABSENT = "their FP8 scaling state starts fresh"


def _losses(job: str) -> dict:
    records = read_metrics(os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE))
    return {step: r["loss"] for step, r in records.items()}


def _stopped_by_sigusr1(job: str, overrides, gate: str) -> str:
    """Run the rank directly (as srun starts a task), send SIGUSR1 while it waits at step
    :data:`HELD_STEP`'s gate (or, on a replayed graph, as the capture is logged), then open the gate;
    its output. The watchdog only kills a run that hangs."""
    env = {**direct_rank_env(), "PYTHONUNBUFFERED": "1", "TEST_HOLD": f"{HELD_STEP}:{gate}"}
    rank = subprocess.Popen([sys.executable, "-m", "bridge_hpc.rank", *set_args(job, overrides)],
                            cwd=os.path.dirname(job), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    watchdog = threading.Timer(RUN_TIMEOUT_S, signal_tree, args=(rank.pid, signal.SIGKILL))
    watchdog.start()
    metrics = os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE)

    def signal_at_the_gate():
        while rank.poll() is None:
            if os.path.exists(metrics) and max(read_metrics(metrics), default=0) >= HELD_STEP:
                os.kill(rank.pid, signal.SIGUSR1)
                time.sleep(0.5)  # (the handler runs at once; the gate only has to open after it)
                open(gate, "w").close()
                return
            time.sleep(0.05)

    waiter = threading.Thread(target=signal_at_the_gate, daemon=True)
    waiter.start()
    try:
        lines = []
        for line in rank.stdout:
            lines.append(line)
            if CAPTURED in line and not os.path.exists(gate):  # a replayed step does not call the forward step
                os.kill(rank.pid, signal.SIGUSR1)
                open(gate, "w").close()
        rank.wait()
    finally:
        watchdog.cancel()
    out = "".join(lines)
    assert rank.returncode == 0 and "signal received" in out, out[-6000:]
    return out


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_te_layers_stop_on_sigusr1_and_resume_bit_exact(tmp_path, precision):
    overrides = TE + PRECISIONS[precision] + (f"job.forward_step={FAULTY_FORWARD_STEP}:forward_step",
                                               "logger.log_interval=1")
    straight = tiny_job(tmp_path / "straight")
    out = run_one_gpu_rank(straight, *overrides, timeout_s=RUN_TIMEOUT_S)
    assert "model.transformer_impl" in out  # the fast-path line names the layers
    stopped = tiny_job(tmp_path / "stopped")
    _stopped_by_sigusr1(stopped, overrides, str(tmp_path / "gate"))
    at = run_folder.tracked_iteration(os.path.join(tiny_run_dir(stopped), run_folder.CHECKPOINTS_DIR))
    assert 3 < at < 40, at
    resumed = run_one_gpu_rank(stopped, *overrides, timeout_s=RUN_TIMEOUT_S)
    assert "loaded checkpoint" in resumed and ABSENT not in resumed, resumed[-4000:]
    a, b = _losses(straight), _losses(stopped)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    assert all(a[s] == b[s] for s in a), [(s, a[s], b[s]) for s in a if a[s] != b[s]][:3]
    if precision != "bf16":
        assert CAPTURED not in out and "FP8 steps are not captured" in out


def test_lora_on_te_layers_resumes_bit_exact_with_adapter_only_checkpoints(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    base = tiny_job(tmp_path / "base")
    run_one_gpu_rank(base, "job.run_dir=runs/base", "train.train_iters=10", *TE, timeout_s=RUN_TIMEOUT_S)
    lora = TE + ("job.entry=finetune", "job.run_dir=runs/finetune", "peft.type=lora",
                 "checkpoint.pretrained_checkpoint=../base/runs/base/checkpoints")
    losses = {}
    for name, stops in (("straight", ()), ("stopped", ("train.exit_interval=15",))):
        job = tiny_job(tmp_path / name)
        out = run_one_gpu_rank(job, *lora, *stops, timeout_s=RUN_TIMEOUT_S)
        if stops:
            out = run_one_gpu_rank(job, *lora, timeout_s=RUN_TIMEOUT_S)
            assert "loaded checkpoint" in out and "loaded pretrained weights" in out, out[-4000:]
        losses[name] = {s: r["loss"] for s, r in read_metrics(
            os.path.join(os.path.dirname(job), "runs", "finetune", run_folder.METRICS_FILE)).items()}
    a, b = losses["straight"], losses["stopped"]
    assert sorted(a) == sorted(b) == list(range(1, 41))
    assert all(a[s] == b[s] for s in a), [(s, a[s], b[s]) for s in a if a[s] != b[s]][:3]
    assert sum(a[s] for s in range(36, 41)) < sum(a[s] for s in range(1, 6))  # the adapters learn
    last = os.path.join(str(tmp_path / "stopped"), "runs", "finetune", run_folder.CHECKPOINTS_DIR, "iter_0000040")
    metadata = FileSystemReader(last).read_metadata().state_dict_metadata
    model_keys = [k for k in metadata if not k.startswith("optimizer.") and hasattr(metadata[k], "size")]
    assert model_keys and all(".adapter." in k for k in model_keys), [k for k in model_keys if ".adapter." not in k]


_tensors = safetensors_in


def _bridge_hf(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.hf", *args], capture_output=True, text=True,
                          env=direct_rank_env(), timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-4000:]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_import_and_export_give_the_same_tensors_on_either_layers(tmp_path, family):
    original = str(tmp_path / "hf")
    make_hf_model(family, original)
    exported = {}
    for impl in ("local", "transformer_engine"):
        _bridge_hf("import", original, str(tmp_path / f"ckpt-{impl}"), "--transformer-impl", impl)
        _bridge_hf("export", str(tmp_path / f"ckpt-{impl}"), str(tmp_path / f"out-{impl}"))
        exported[impl] = _tensors(str(tmp_path / f"out-{impl}"))
    before = _tensors(original)
    assert sorted(exported["local"]) == sorted(exported["transformer_engine"]) == sorted(before)
    for name, tensor in before.items():
        for impl in exported:
            assert torch.equal(exported[impl][name], tensor), (impl, name)


def test_a_run_moves_between_the_layouts_and_back(tmp_path):
    """Saved on TE's layers at step 20, resumed on the local ones to 30, then on TE's again to 40: each
    load says what starts fresh, and the losses follow TE's uninterrupted run within bf16's rounding."""
    straight = tiny_job(tmp_path / "straight")
    run_one_gpu_rank(straight, *TE, timeout_s=RUN_TIMEOUT_S)
    moved = tiny_job(tmp_path / "moved")
    run_one_gpu_rank(moved, *TE, "train.exit_interval=20", timeout_s=RUN_TIMEOUT_S)
    local = ('model.transformer_impl="local"',) + TE[1:]
    out = run_one_gpu_rank(moved, *local, "train.exit_interval=30", timeout_s=RUN_TIMEOUT_S)
    assert "loaded checkpoint" in out, out[-4000:]
    out = run_one_gpu_rank(moved, *TE, timeout_s=RUN_TIMEOUT_S)
    assert "loaded checkpoint" in out and ABSENT in out, out[-4000:]
    a, b = _losses(straight), _losses(moved)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    assert all(a[s] == b[s] for s in range(1, 21))
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in range(21, 41))
    assert worst <= 2e-2, worst  # the local layers round bf16 otherwise (as in test_gpu_speed_defaults)
