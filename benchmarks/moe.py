"""A Mixture-of-Experts GPT on one GPU: bridge_hpc against megatron-core's bare loop (issue 47).

The question: does the toolkit keep its lead over a bare megatron-core loop when the model routes its
tokens to experts? The model (``moe-1.7b``): 16 layers x 1024, 16 heads, 16 experts of width 3072 each,
top-2 routing, seq 2048 x micro-batch 4, vocab 32768, bf16, adam, dropout 0, mock data: about 1.7 B
parameters in all, 0.3 B active per token. Rows:

- **bridge-local**: ``pretrain`` with the job file's defaults on a GPU, megatron-core's local layers
  (the all-gather dispatcher; the fast path runs the experts' ``SequentialMLP`` parameters as torch's
  grouped GEMM, ``model.moe_grouped_gemm``: bridge_hpc/training/engine/grouped_experts.py);
- **bridge-local-sequential**: the same with ``model.moe_grouped_gemm = false`` (two GEMMs per expert
  each way, as megatron-core's ``SequentialMLP`` runs them);
- **bare-local**: megatron-core's bare loop of ``loop_overhead.py`` (GPTModel, Float16Module, megatron-core's
  DDP and ``get_megatron_optimizer``, nothing else per step) on the same model with the local layer spec;
- **bridge-te** / **bare-te**: the same on Transformer Engine's layers, with the experts as one grouped
  GEMM (``model.moe_grouped_gemm = true``); skipped, saying why, where TE does not import.

Every row is one ``torchrun`` of ``benchmarks/te.py`` in worker mode (its launcher and ``loop_overhead.py``'s
figures: steady tokens/s over the steps after ``--warmup``, MFU over the *active* parameters
(``num_floating_point_operations`` counts the router's top-k experts, not all 16) against the dense
bf16 peak of 989 TFLOP/s, peak memory); the job loader checks every row first, and a row it refuses or that
fails is a row saying why. Prints the table and the target (bridge's fastest row >= 1.2x the bare loop of the
same layers), writes ``benchmarks/results/moe.json``. ``--tiny --device cpu`` checks the script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))

from indexed_vs_mock import TINY  # noqa: E402
from loop_overhead import GPT_370M, ON_GPU, PLAIN, job_toml, mock_section, speed_overrides  # noqa: E402
from te import H200_BF16_PEAK, LOCAL, TE, device_name, git_head, launch, te_available, te_version  # noqa: E402

SHAPE = dict(GPT_370M, num_layers=16, micro_batch_size=4)
#: Bridge's MoE models have no linear biases (megatron-core's local experts at EP1 refuse them).
MOE = {"add_bias_linear": "false", "num_moe_experts": 16, "moe_router_topk": 2, "moe_ffn_hidden_size": 3072,
       "moe_aux_loss_coeff": 0.01}
TINY_MOE = dict(MOE, num_moe_experts=4, moe_ffn_hidden_size=64)
GROUPED = "model.moe_grouped_gemm=true"
#: Row -> (loop_overhead.py's worker, the job's --set items).
ROWS = {
    "bridge-local": ("bridge", [ON_GPU, LOCAL]),
    "bridge-local-sequential": ("bridge", [ON_GPU, LOCAL, "model.moe_grouped_gemm=false"]),
    "bare-local": ("bare", [PLAIN, LOCAL]),
    "bridge-te": ("bridge", [ON_GPU, TE, GROUPED]),
    # A job that asks for no GPUs cannot ask for the grouped GEMM (a GPU kernel): this bare loop's job asks
    # for one and turns off what the loader would choose for it, so that it runs megatron-core's defaults.
    "bare-te": ("bare", [ON_GPU, TE, GROUPED, *speed_overrides(False, False, False)]),
}
#: Each bridge row's bare loop of the same layers.
BARE_OF = {"bridge-local": "bare-local", "bridge-local-sequential": "bare-local", "bridge-te": "bare-te"}
TARGET = 1.2


def total_and_active(shape: Dict[str, int], moe: Dict[str, Any]) -> Dict[str, float]:
    """Parameters of the model, all and those one token passes through (top-k experts), for the table."""
    h, layers, vocab = shape["hidden_size"], shape["num_layers"], shape["vocab_size"]
    attention = 4 * h * h
    expert = 2 * h * moe["moe_ffn_hidden_size"]
    embed = 2 * vocab * h
    return {"total": layers * (attention + moe["num_moe_experts"] * expert + h * moe["num_moe_experts"]) + embed,
            "active": layers * (attention + moe["moe_router_topk"] * expert + h * moe["num_moe_experts"]) + embed}


def benchmark(args: argparse.Namespace, rows: List[str], tmp: Path) -> Dict[str, Any]:
    from bridge_hpc.contracts.errors import ConfigError
    from bridge_hpc.jobfile.jobconfig import load_job_config

    cuda = args.device == "cuda"
    shape, moe = (TINY, TINY_MOE) if args.tiny else (SHAPE, MOE)
    job = tmp / "moe.toml"
    job.write_text(job_toml(shape, args.steps, tmp / "unused", mock_section(shape), gpu=cuda))
    common = [f"train.train_iters={args.steps}", "train.eval_interval=0"] + [f"model.{k}={v}" for k, v in moe.items()]
    no_te = te_available(args.device) if any(TE in ROWS[r][1] for r in rows) else None
    runs: List[Dict[str, Any]] = []
    started = time.perf_counter()
    for n, row in enumerate(rows, 1):
        kind, sets = ROWS[row]
        sets = [s for s in sets if cuda or s not in (ON_GPU, PLAIN)]
        overrides = common + [f'job.run_dir="{tmp / row}"'] + sets
        run: Dict[str, Any] = {"row": row, "worker": kind, "overrides": sets}
        if no_te and TE in sets:
            run.update(status="skipped", reason=no_te)
        else:
            try:  # the loader the ranks use: a job it refuses fails here, without a launch
                run["fast_path"] = load_job_config(job, overrides, cwd=tmp).training.fast_path.line()
            except ConfigError as err:
                run.update(status="failed", reason=f"the job loader refuses it: {err.key}: {err.message}")
        if "status" not in run:
            print(f"[moe] {n}/{len(rows)} {row}: started ({time.perf_counter() - started:.0f} s in)",
                  file=sys.stderr, flush=True)
            run.update(launch(kind, args.device, job, overrides, None, args.warmup, tmp / f"{row}.json", args.timeout,
                              args.kernels / f"{row}.kernels.txt" if args.kernels else None))
        end = (f"{run['tokens_per_s']:,.0f} tokens/s, MFU {run.get('mfu', 0):.1%}" if run["status"] == "ok"
               else f"{run['status']}: {run['reason']}")
        print(f"[moe] {n}/{len(rows)} {row}: {end}", file=sys.stderr, flush=True)
        runs.append(run)
    return {"card": device_name(args.device), "device": args.device, "date": datetime.datetime.now().astimezone()
            .isoformat(timespec="seconds"), "git_head": git_head(), "transformer_engine": te_version(),
            "steps": args.steps, "warmup": args.warmup, "tiny": args.tiny, "peak_flops": H200_BF16_PEAK,
            "profiled": args.kernels is not None, "shape": dict(shape, **moe),
            "parameters": total_and_active(shape, moe), "rows": rows,
            "wall_s": time.perf_counter() - started, "runs": runs}


def ok(runs: List[Dict[str, Any]], row: str) -> Optional[Dict[str, Any]]:
    return next((r for r in runs if r["row"] == row and r["status"] == "ok"), None)


def verdict(r: Dict[str, Any]) -> Dict[str, Any]:
    """Bridge's fastest row over the bare loop of the same layers (None where a run is missing)."""
    pairs = [(row, ok(r["runs"], row), ok(r["runs"], bare)) for row, bare in BARE_OF.items()]
    measured = [(row, a["tokens_per_s"] / b["tokens_per_s"], a["tokens_per_s"]) for row, a, b in pairs if a and b]
    if not measured:
        return {"what": f"bridge's fastest row >= {TARGET:.1f}x the bare loop of its layers", "figure": None,
                "holds": None}
    row, x, _ = max(measured, key=lambda m: m[2])
    if r.get("profiled"):  # the profiler's cost per operator is in every figure: no speed verdict from them
        return {"what": f"bridge's fastest row >= {TARGET:.1f}x the bare loop of its layers", "row": row, "figure": x,
                "holds": None, "why": "profiled runs (--kernels): the profiler's cost is in every figure"}
    return {"what": f"bridge's fastest row >= {TARGET:.1f}x the bare loop of its layers", "row": row, "figure": x,
            "holds": x >= TARGET}


def print_report(r: Dict[str, Any]) -> None:
    p = r["parameters"]
    s = r["shape"]
    print(f"\nMoE GPT on {r['card']}, {r['date']}, git {r['git_head']}; transformer_engine "
          f"{r['transformer_engine'] or 'not installed'}; {r['steps']} steps a run, the first {r['warmup']} left out; "
          f"MFU over the active parameters and {r['peak_flops'] / 1e12:.0f} TFLOP/s (dense bf16)")
    print(f"{s['num_layers']} layers x {s['hidden_size']}, {s['num_moe_experts']} experts of {s['moe_ffn_hidden_size']} "
          f"top-{s['moe_router_topk']}, seq {s['seq_length']} x micro-batch {s['micro_batch_size']}"
          f"{' (--tiny)' if r['tiny'] else ''}: {p['total'] / 1e9:.2f} B parameters, {p['active'] / 1e9:.2f} B active\n")
    print("| row | tokens/s | MFU (active) | peak GiB | x its bare loop | CUDA graph |\n| --- | --- | --- | --- | --- | --- |")
    for x in r["runs"]:
        if x["status"] != "ok":
            print(f"| {x['row']} | {x['status']}: {x['reason']} | | | | |")
            continue
        bare = ok(r["runs"], BARE_OF.get(x["row"], ""))
        speedup = f"{x['tokens_per_s'] / bare['tokens_per_s']:.3f}" if bare else "-"
        mfu = f"{x['mfu']:.1%}" if "mfu" in x else "-"
        peak = f"{x['peak_allocated_gib']:.1f}" if x.get("peak_allocated_gib") is not None else "-"
        print(f"| {x['row']} | {x['tokens_per_s']:,.0f} | {mfu} | {peak} | {speedup} | {x.get('graph') or '-'} |")
    v = r["verdict"]
    state = (f"not measured ({v['why']})" if v.get("why") else "not measured" if v["holds"] is None
             else "holds" if v["holds"] else "does NOT hold")
    figure = "-" if v["figure"] is None else f"{v['figure']:.3f}x ({v['row']})"
    print(f"\ntarget{' (--tiny: checks the script)' if r['tiny'] else ''}: {v['what']}: {figure}: {state}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)} (default: all)")
    p.add_argument("--steps", type=int, default=30, help="steps a run (default 30)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out at the start of each run (default 10)")
    p.add_argument("--timeout", type=float, default=240, help="seconds a run may take, launch included (default 240)")
    p.add_argument("--tiny", action="store_true", help="a tiny MoE GPT: checks the script")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--kernels", type=Path, metavar="DIR",
                   help="profile each run's first steps after the warm-up (te.py's --kernels): DIR/<row>.kernels.txt")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "moe.json")
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = args.rows.split(",")
    if set(rows) - set(ROWS) or not rows:
        p.error(f"--rows: expected some of {', '.join(ROWS)}, got {args.rows!r}")
    if args.steps < args.warmup + 3:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by at least 3")
    with tempfile.TemporaryDirectory(prefix="moe-bench-", dir=os.environ.get("BENCH_TMP")) as tmp:
        result = benchmark(args, [r for r in ROWS if r in rows], Path(tmp))
    result["verdict"] = verdict(result)
    print_report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
