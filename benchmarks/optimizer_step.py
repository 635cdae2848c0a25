"""Milliseconds per optimizer step: megatron-core's default path against ``optimizer.fused_step``.

What one step is: everything ``optimizer.step()`` does after backward — on GPU megatron's
``ChainedOptimizer``: gradient copy to the fp32 main params, gradient norm, clipping, Adam, and the
copy of the fp32 main params back into the bf16 model params (see ``bridge_hpc/training/optimizer.py``
for what the fused step changes and why); on CPU :class:`TorchOptimizer`'s clip and AdamW.

The default shape is issue 11's: a 370 M GPT (24 layers, hidden 1024, 16 heads, vocab 32768) with
bf16 params, fp32 main params and fp32 gradient reduction, one GPU. Both optimizers are built on the
same model (the setup ``pretrain`` does: ``setup_model`` then ``setup_optimizer``, once with
``fused_step = false`` and once with ``true``), and their timed blocks alternate (default, fused,
default, ...) so a drift of the machine hits both; the figure is each one's median block, and the
ratio is taken within this one run. Gradients are random (fixed seed), written into megatron's
``main_grad`` buffers, with clip_grad = 1.0 so that clipping really scales them. Without CUDA it runs a
tiny GPT (configs/local-tiny.toml's shape) through the CPU optimizer instead.

Run: ``python benchmarks/optimizer_step.py [--steps 20] [--repeats 5] [--json PATH]``; prints a table
and writes ``benchmarks/results/optimizer_step.json`` (the JSON records the device and versions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GPT_370M = {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "vocab_size": 32768,
            "seq_length": 2048}
#: configs/local-tiny.toml's model.
GPT_TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256,
            "vocab_size": 128, "seq_length": 32}


def _config(model: dict, fused: bool, bf16: bool):
    from bridge_hpc.training.config import ConfigContainer

    sections = {
        "train": {"train_iters": 1000, "micro_batch_size": 1, "global_batch_size": 1},
        "model": {**model, "bf16": bf16, "hidden_dropout": 0.0, "attention_dropout": 0.0},
        "optimizer": {"lr": 3e-4, "min_lr": 3e-5, "bf16": bf16, "clip_grad": 1.0, "fused_step": fused},
        "ddp": {"grad_reduce_in_fp32": True},
        "dataset": {"seq_length": model["seq_length"]},
    }
    cfg = ConfigContainer.from_sections(sections, source="benchmarks/optimizer_step.py")
    cfg.validate(world_size=1)
    return cfg


def _init_single_process() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def _fill_gradients(model, gpu: bool) -> None:
    gen = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
    for p in model[0].parameters():
        target = p.main_grad if gpu else p
        shape = p.shape
        grad = torch.randn(shape, generator=gen, device=p.device, dtype=torch.float32) * 1e-2
        if gpu:
            target.copy_(grad)
        else:
            p.grad = grad


def _time_block(optimizer, model, steps: int, gpu: bool) -> float:
    _fill_gradients(model, gpu)  # the same gradients for every block (clipping scales them in place)
    if gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        ok, _, _ = optimizer.step()
        assert ok
    if gpu:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed block")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per optimizer, alternating")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "optimizer_step.json"))
    args = parser.parse_args()

    import megatron.core

    from bridge_hpc.training.engine.optimizer import FusedStep, TorchOptimizer, setup_optimizer
    from bridge_hpc.training.pretrain import set_random_seed, setup_model

    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(1)  # as the tiny config's ranks run (OMP_NUM_THREADS = 1)
    _init_single_process()
    shape = GPT_370M if gpu else GPT_TINY
    set_random_seed(1234)
    model = setup_model(_config(shape, fused=False, bf16=gpu))
    n_params = sum(p.numel() for p in model[0].parameters())
    optimizers = {}
    for name, fused in (("megatron default" if gpu else "torch default", False), ("fused", True)):
        optimizers[name] = setup_optimizer(_config(shape, fused=fused, bf16=gpu), model)
    fused_opt = optimizers["fused"]
    assert isinstance(fused_opt, TorchOptimizer) or isinstance(fused_opt.step.__self__, FusedStep)
    for optimizer in optimizers.values():  # warm-up: state allocation, kernel selection, caches
        _time_block(optimizer, model, 3, gpu)

    blocks = {name: [] for name in optimizers}
    for _ in range(args.repeats):
        for name, optimizer in optimizers.items():
            blocks[name].append(_time_block(optimizer, model, args.steps, gpu))
    ms = {name: statistics.median(values) for name, values in blocks.items()}
    baseline = next(iter(ms))

    device = torch.cuda.get_device_name() if gpu else "cpu (1 thread)"
    print(f"optimizer step, {n_params / 1e6:.1f} M parameters ({'bf16 params, fp32 main params' if gpu else 'fp32'}), "
          f"{device}, megatron-core {megatron.core.__version__}, torch {torch.__version__}")
    print(f"{'path':<18} {'ms/step (median)':>17} {'min':>8} {'max':>8} {'speed-up':>9}")
    for name, values in blocks.items():
        print(f"{name:<18} {ms[name]:>17.2f} {min(values):>8.2f} {max(values):>8.2f} {ms[baseline] / ms[name]:>8.2f}x")
    result = {
        "device": device, "megatron_core": megatron.core.__version__, "torch": torch.__version__,
        "parameters": n_params, "shape": shape, "bf16": gpu, "clip_grad": 1.0,
        "steps_per_block": args.steps, "repeats": args.repeats,
        "ms_per_step": ms, "blocks_ms": blocks, "speedup_fused": ms[baseline] / ms["fused"],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
