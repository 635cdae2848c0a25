"""LoRA's fused layer against the unfused path, layer by layer, on one GPU (issue 35).

The four linear layers of one transformer layer of ``benchmarks/parallel.py``'s 1.3 B GPT (hidden 2048,
GELU MLP 8192, biases), bf16, frozen base, LoRA ``dim`` 16 (``alpha`` 32) on each, at
``benchmarks/peft.py``'s micro-batch (sequence 2048, batch 4), without tensor parallelism. Each layer runs
forward and backward (a gradient of the output's shape; the input requires a gradient, as inside the
model) ``--iters`` times after a warm-up, through :class:`~bridge_hpc.peft.lora_layers.LoRALinear`'s forward
(the fused path) and through the unfused expression it replaces (``to_wrap(x)`` plus ``adapter(x)``), the
two alternating in rounds; CUDA events time each. A profiled pass of each counts the kernels it launches
and their time (elementwise ones apart).

Run: ``python benchmarks/lora_fused.py`` (under a minute on an H100); prints a table and writes JSON
(``--json``, default ``benchmarks/results/lora_fused.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bridge_test_helpers import single_rank_world  # noqa: E402

LAYERS = {"linear_qkv": ("self_attention", "column", 3), "linear_proj": ("self_attention", "row", 1),
          "linear_fc1": ("mlp", "column", 4), "linear_fc2": ("mlp", "row", 4)}


def build(hidden: int, dim: int):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from bridge_hpc.peft.lora import LoRA
    from bridge_hpc.peft.lora_layers import LoRALinear, adapter_for

    model_parallel_cuda_manual_seed(0)  # megatron-core's GPU initialization draws from its tracker
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=16, ffn_hidden_size=4 * hidden,
                               bf16=True, params_dtype=torch.bfloat16)
    lora = LoRA(dim=dim, alpha=2 * dim, lora_B_init_method="normal")
    out = {}
    for name, (parent, kind, width) in LAYERS.items():
        init = torch.nn.init.xavier_normal_
        if kind == "column":
            # linear_qkv adds its bias; linear_fc1 leaves it to the fused bias-GELU (skip_bias_add)
            base = ColumnParallelLinear(hidden, width * hidden, config=config, init_method=init, bias=True,
                                        gather_output=False, skip_bias_add=name == "linear_fc1")
        else:
            base = RowParallelLinear(width * hidden, hidden, config=config, init_method=init, bias=True,
                                     input_is_parallel=True, skip_bias_add=True)
        for p in base.parameters():
            p.requires_grad = False
        layer = LoRALinear(base, adapter_for(lora, base, name, f"decoder.layers.0.{parent}"))
        assert layer.fusable_layout, name
        out[name] = layer
    return out


def step(layer, x, grad, fused: bool) -> None:
    """One forward and backward; the gradients are taken, not accumulated (none is there before)."""
    x.grad = layer.adapter.linear_in.weight.grad = layer.adapter.linear_out.weight.grad = None
    if fused:
        out, _ = layer(x)
    else:
        out, _ = layer.to_wrap(x)
        out = out + layer.adapter(x)
    out.backward(grad)


def kernels(layer, x, grad, fused: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(layer, x, grad, fused)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    elementwise = [e for e in events if "elementwise" in e.name]
    return {"launches": len(events), "kernel_ms": sum(e.device_time for e in events) / 1e3,
            "elementwise_launches": len(elementwise),
            "elementwise_ms": sum(e.device_time for e in elementwise) / 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--tokens", type=int, nargs=2, default=(2048, 4), metavar=("SEQ", "BATCH"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "lora_fused.json"))
    args = p.parse_args()
    world = single_rank_world("nccl")
    next(world)
    torch.manual_seed(0)
    layers = build(args.hidden, args.dim)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": {}}
    seq, batch = args.tokens
    for name, layer in layers.items():
        base = layer.to_wrap
        x = torch.randn(seq, batch, base.input_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(seq, batch, base.output_size, device="cuda", dtype=torch.bfloat16)
        times = {True: [], False: []}
        for fused in (True, False):  # warm-up
            for _ in range(3):
                step(layer, x, grad, fused)
        for _ in range(args.rounds):
            for fused in (True, False):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    step(layer, x, grad, fused)
                end.record()
                torch.cuda.synchronize()
                times[fused].append(start.elapsed_time(end) / args.iters)
        row = {"fused_ms": statistics.median(times[True]), "unfused_ms": statistics.median(times[False]),
               "fused_kernels": kernels(layer, x, grad, True), "unfused_kernels": kernels(layer, x, grad, False)}
        row["speedup"] = row["unfused_ms"] / row["fused_ms"]
        results["layers"][name] = row
        x.grad = None
    total_f = sum(r["fused_ms"] for r in results["layers"].values())
    total_u = sum(r["unfused_ms"] for r in results["layers"].values())
    results["total"] = {"fused_ms": total_f, "unfused_ms": total_u, "speedup": total_u / total_f}
    print(f"{results['device']}, seq {seq} x batch {batch}, hidden {args.hidden}, LoRA dim {args.dim}, bf16, "
          "forward + backward per layer (median ms)")
    print(f"{'layer':12} {'unfused':>9} {'fused':>9} {'speedup':>8}  launches u/f  elementwise u/f (ms)")
    for name, r in results["layers"].items():
        u, f = r["unfused_kernels"], r["fused_kernels"]
        print(f"{name:12} {r['unfused_ms']:9.3f} {r['fused_ms']:9.3f} {r['speedup']:7.2f}x  {u['launches']:5d}/"
              f"{f['launches']:<5d}  {u['elementwise_launches']}/{f['elementwise_launches']} "
              f"({u['elementwise_ms']:.3f}/{f['elementwise_ms']:.3f})")
    print(f"{'total':12} {total_u:9.3f} {total_f:9.3f} {total_u / total_f:7.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    try:
        next(world)
    except StopIteration:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
