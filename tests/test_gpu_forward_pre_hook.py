"""Checkpoint saves with megatron-core's distributed optimizer and overlapped parameter all-gather, on one
GPU (NCCL, world size 1). Skipped without CUDA; run on the device machine:
``python -m pytest -q tests/test_gpu_forward_pre_hook.py``.

``pretrain`` of the tiny GPT with ``ddp.use_distributed_optimizer``, ``ddp.overlap_param_gather`` (and
``overlap_grad_reduce``) builds megatron-core DDP, which registers forward pre-hooks that finish the
parameter all-gather in the next forward. Two runs of 20 steps: one saving every 5 steps through the
toolkit's checkpointing (``save_checkpoint_and_time``), one saving only at the end. The saving run
must (1) have the hooks off during each save and on again at every step after it, (2) write the
``Saved checkpoint`` lines, and (3) train exactly as the run without the interval saves (bitwise
equal losses: the all-gather forced before a save changes no parameter).

This file is also the worker: ``python tests/test_gpu_forward_pre_hook.py save|nosave OUT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ != "__main__":
    import pytest
    from bridge_test_helpers import direct_rank_env, losses

    torch = pytest.importorskip("torch")
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OVERRIDES = ["train.train_iters=20", "train.eval_interval=0", "logger.log_interval=1", "checkpoint.most_recent_k=-1",
             "logger.log_progress=true", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
             "ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true",
             "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true"]


def _run_worker(mode: str, out: Path, timeout: float = 300) -> dict:
    env = direct_rank_env()
    proc = subprocess.run([sys.executable, __file__, mode, str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


def test_saves_with_overlapped_param_gather_leave_training_unchanged(tmp_path):
    from bridge_hpc.contracts.progress_log import parse_events

    saving = _run_worker("save", tmp_path / "save")
    reference = _run_worker("nosave", tmp_path / "nosave")

    assert saving["ddp"] == "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel"
    # (1) hooks off during every save, on at every training step (also right after a save)
    assert [s for s, _ in saving["saves"]] == [5, 10, 15, 20]
    assert all(hooks == 0 for _, hooks in saving["saves"]), saving["saves"]
    # one entry per micro-batch forward: (iteration before the step, hooks registered)
    assert sorted({step for step, _ in saving["hooks_at_step"]}) == list(range(20))
    assert all(hooks > 0 for _, hooks in saving["hooks_at_step"]), saving["hooks_at_step"]
    assert [s for s, _ in reference["saves"]] == [20]
    # (2) the progress log's save lines, written by compute_throughputs_and_append_to_progress_log
    events = parse_events(str(tmp_path / "save" / "checkpoints" / "progress.txt"))
    saved = [e for e in events if e.name == "Saved checkpoint"]
    assert [int(e.fields["Iteration"]) for e in saved] == [5, 10, 15, 20]
    assert all(e.number("Job throughput") is not None and e.number("Floating-point operations") > 0 for e in saved)
    # (3) the same training
    got, want = losses(tmp_path / "save"), losses(tmp_path / "nosave")
    assert sorted(got) == list(range(1, 21))
    same = sum(got[step] == want[step] for step in got)
    print(f"overlap_param_gather + distributed optimizer: {same}/20 losses bitwise equal with and without saves")
    assert got == want


# ---------------------------------------------------------------------------------------------
# The worker (one process, one GPU)
# ---------------------------------------------------------------------------------------------


def _worker(mode: str, out: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from bridge_hpc.rank import build_config
    from bridge_hpc.training.checkpoint import checkpointing
    from bridge_hpc.training.engine import model as gpt
    from bridge_hpc.training.pretrain import pretrain

    overrides = [f"job.run_dir={out}", *OVERRIDES]
    overrides.append("checkpoint.save_interval=5" if mode == "save" else "checkpoint.save_interval=1000")
    cfg = build_config(str(ROOT / "tests" / "data" / "tiny.toml"), overrides)
    result = {"saves": [], "hooks_at_step": [], "ddp": None}

    real_save = checkpointing.save_checkpoint

    def recording_save(state, model, *args, **kwargs):  # how many pre-hooks are registered while saving
        result["saves"].append((state.train_state.step, len(model[0].remove_forward_pre_hook_handles)))
        return real_save(state, model, *args, **kwargs)

    checkpointing.save_checkpoint = recording_save  # exit_policy calls it through the module

    def forward_step(state, data_iterator, model):
        result["ddp"] = f"{type(model).__module__}.{type(model).__qualname__}"
        result["hooks_at_step"].append((state.train_state.step, len(model.remove_forward_pre_hook_handles)))
        return gpt.forward_step(state, data_iterator, model)

    pretrain(cfg, forward_step)
    return result


if __name__ == "__main__":
    mode_arg, out_arg = sys.argv[1], sys.argv[2]
    os.makedirs(out_arg, exist_ok=True)
    outcome = _worker(mode_arg, out_arg)
    with open(os.path.join(out_arg, "result.json"), "w") as f:
        json.dump(outcome, f)
