"""Transformer Engine against bridge_hpc's local fast path, in bf16 and FP8, on one GPU (issue 46).

The question: does Transformer Engine (TE) pay for bridge_hpc, and where? The local fast path
(megatron-core's local layers with SDPA attention, the toolkit's Triton kernels, the whole step as
one CUDA graph) beat a bare megatron-core loop by 1.4x on the 370 M GPT, where TE's own layers gained
little; TE's FP8 pays only where the matrix multiplies are large (shared/tools/te-device/README.md).
So three shapes, from launch-bound to matmul-bound, each with these rows:

- **bridge-local**: ``pretrain`` with the job file's defaults on a GPU (``slurm.gpus_per_node = 1``:
  the loader's fast path, whatever it picks for the shape: :mod:`bridge_hpc.training.engine.speed_defaults`),
  the local layers pinned (``model.transformer_impl = "local"``: the loader may take TE's layers by
  default where this script measured them faster, and this row is what they are measured against);
- **bridge-te**: the same with ``model.transformer_impl = "transformer_engine"``. Nothing else is set:
  the loader keeps the fast path (megatron-core's fusions, the toolkit's Triton cross entropy, which
  is all ``model.fused_kernels`` does on TE's layers, the CUDA graph, the fused Adam step);
- **bridge-te-fp8-delayed** / **-tensorwise**: plus Bridge's ``bf16_with_fp8_delayed_scaling_mixed`` /
  ``bf16_with_fp8_current_scaling_mixed`` fields in ``[mixed_precision]`` (bf16, ``fp8 = "hybrid"``: E4M3
  forward, E5M2 backward; delayed scaling from a 1024-step amax history) without their FP8 weights, with
  what the loader keeps of the fast path for FP8 (the JSON's ``fast_path``; the table says whether the
  steps replayed a CUDA graph);
- **bare-te**: megatron-core's bare loop of ``loop_overhead.py`` (its ``bare`` worker: GPTModel,
  ``Float16Module``, megatron-core's DDP and ``get_megatron_optimizer``, nothing else per step) on
  a job that asks for no GPUs (megatron-core's defaults, unfused) with the TE layer spec
  (``get_gpt_layer_with_transformer_engine_spec``, via the toolkit's GPT builder);
- **bare-te-fp8** (not by default): that loop with ``TransformerConfig(fp8="hybrid",
  fp8_recipe="delayed")``, set on the config the builder makes.

Shapes (bf16, adam, dropout 0, untied output layer, ``grad_reduce_in_fp32``, mock data, ffn
4 x hidden, vocab 32768, seq 2048, one micro-batch a step): ``370m`` 24 layers x 1024, 16 heads,
micro-batch 8; ``1.3b`` 24 x 2048, 16 heads, mb 4; ``8x4096`` 8 x 4096, 32 heads, mb 2.

Each run is one ``torchrun --standalone`` of this file in worker mode (it hands over to
``loop_overhead.py``'s workers, so the clock, the steady window and the figures are that script's):
steady tokens/s is tokens over the elapsed time of the steps after ``--warmup`` (the device
synchronized at the window's ends); MFU is the toolkit's 6·N·tokens + attention FLOPs
(``num_floating_point_operations``, the same for every row, FP8 too) over the dense bf16 peak of
989 TFLOP/s (the H200's, the same as the H100's); peak memory is ``torch.cuda.max_memory_allocated``.
Every run has its own time limit; one that fails or times out is a row saying why (the last error
line of its output) and the others go on. The bridge rows also say whether the step was captured
as a CUDA graph or fell back to eager steps (the rank's log).

Run: ``python benchmarks/te.py [--shapes 370m,1.3b,8x4096] [--rows ...] [--steps 30] [--warmup 10]``;
prints a table per shape, the targets that hold, the shapes where FP8 loses to bf16, and writes
``benchmarks/results/te.json`` with every run. ``--tiny --device cpu`` checks the script.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))  # bridge_hpc, where it is not installed

from indexed_vs_mock import TINY  # noqa: E402
from loop_overhead import GPT_370M, H100_BF16_PEAK, ON_GPU, PLAIN, job_toml, mock_section, run_figures  # noqa: E402

#: The H200's dense bf16 peak (SXM), the same as the H100's: the MFU denominator of loop_overhead.py.
H200_BF16_PEAK = H100_BF16_PEAK
SHAPES = {"370m": GPT_370M,
          "1.3b": dict(GPT_370M, hidden_size=2048, micro_batch_size=4),
          "8x4096": dict(GPT_370M, num_layers=8, hidden_size=4096, num_attention_heads=32, micro_batch_size=2)}
TE = 'model.transformer_impl="transformer_engine"'
#: bridge-local pins the local layers: the loader may take TE's layers by default where they measured faster.
LOCAL = 'model.transformer_impl="local"'
#: FP8 on bf16, as Bridge's ``bf16_with_fp8_*_mixed`` recipes set it: ``[mixed_precision]`` writes every
#: precision field of the model, so FP8 alone would leave the model in fp32 (``bf16`` defaults to false
#: there), whose attention runs unfused in fp32 (the 0.13x FP8 figures of 2026-12-02 were that). The
#: recipes' FP8 weights (``fp8_param_gather``) are left out: they need the distributed optimizer, which
#: the bf16 row does not run.
def _recipe_sets(name: str) -> List[str]:
    """A mixed-precision recipe's fields (:func:`bridge_hpc.training.mixed_precision.recipe_fields`, the
    table a job file's ``mixed_precision = NAME`` becomes) as ``--set`` items."""
    from bridge_hpc.training.mixed_precision import recipe_fields

    return [f"mixed_precision.{k}={json.dumps(v)}" for k, v in recipe_fields(name).items()]


FP8 = _recipe_sets("bf16_mixed") + ['mixed_precision.fp8="hybrid"']
#: Row -> (loop_overhead.py's worker, the job's --set items, the bare loop's TransformerConfig fp8_recipe).
ROWS = {
    "bridge-local": ("bridge", [ON_GPU, LOCAL], None),
    "bridge-te": ("bridge", [ON_GPU, TE], None),
    "bridge-te-fp8-delayed": ("bridge", [ON_GPU, TE, *FP8, 'mixed_precision.fp8_recipe="delayed"',
                                         "mixed_precision.fp8_amax_history_len=1024",
                                         'mixed_precision.fp8_amax_compute_algo="max"'], None),
    "bridge-te-fp8-tensorwise": ("bridge", [ON_GPU, TE, *FP8, 'mixed_precision.fp8_recipe="tensorwise"'], None),
    "bare-te": ("bare", [PLAIN, TE], None),
    "bare-te-fp8": ("bare", [PLAIN, TE], "delayed"),
}
DEFAULT_ROWS = [r for r in ROWS if r != "bare-te-fp8"]
#: FP8 row -> the bf16 row it is compared with.
FP8_OF = {"bridge-te-fp8-delayed": "bridge-te", "bridge-te-fp8-tensorwise": "bridge-te", "bare-te-fp8": "bare-te"}
#: Issue 46's targets: bridge-te's tokens/s over bare-te's, per shape; bridge FP8 (best recipe) over bridge-te.
TARGET_TE = {"370m": 1.5, "1.3b": 1.15, "8x4096": 1.05}
TARGET_FP8 = ("8x4096", 1.15)
TORCHRUN = re.compile(r"torch[./]distributed[./](elastic|run)")
ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*)?(Error|Exception|Exit|Interrupt|Failure)\b(:|$)")


# ---------------------------------------------------------------------------------------------
# Worker side (one rank under torchrun): loop_overhead.py's worker, with FP8 for the bare loop
# ---------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    from loop_overhead import worker_main

    if args.bare_fp8:
        # The builder passes only GPTModelConfig's fields to TransformerConfig; FP8 is set on the config
        # it makes (megatron-core's blocks read config.fp8 and fp8_recipe in their forward).
        from bridge_hpc.training.engine import model as engine_model

        build = engine_model.transformer_config

        def fp8_config(cfg):
            config = build(cfg)
            config.fp8, config.fp8_recipe = "hybrid", args.bare_fp8
            return config

        engine_model.transformer_config = fp8_config
    return worker_main(argparse.Namespace(worker=args.worker, device=args.device, job=args.job, set=args.set,
                                          warmup=args.warmup, out=args.out, kernels=args.kernel_window, profile=False,
                                          sections=False))


# ---------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------


def error_line(text: str) -> str:
    """The line of a failed run's output that says why: the last exception line (not torchrun's own
    about it), else the last line of the rank's log (not a rule, a traceback frame or torchrun's)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if ERROR_LINE.match(line) and not TORCHRUN.search(line):
            return line[:300]
    frames = {i + 1 for i, line in enumerate(lines) if line.startswith("File ")} | {
        i for i, line in enumerate(lines) if line.startswith(("File ", "Traceback"))}
    rest = [line for i, line in enumerate(lines) if i not in frames and not set(line) <= set("=-_ *^~")
            and not TORCHRUN.search(line)]
    return rest[-1][:300] if rest else "no output"


def graph_state(log: str) -> Optional[str]:
    """Whether a bridge run's steps replayed a CUDA graph, from its rank's log (cuda_graphs.py's lines)."""
    match = re.search(r"cannot be captured as a CUDA graph \((.*)\): this run's steps stay eager", log)
    if match:
        return f"eager ({match.group(1)[:160]})"
    return "captured" if "full-iteration CUDA graph captured" in log else None


def te_available(device: str) -> Optional[str]:
    """Why the TE rows cannot run here, or None. Imported in a child, so a broken install (the meta
    package without its core library) is seen without breaking this process."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "no transformer_engine"
    probe = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch"], capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if probe.returncode != 0:
        return f"transformer_engine does not import ({error_line(probe.stderr)})"
    if device != "cuda":
        return "Transformer Engine's layers need CUDA (--device cpu)"
    return None


def te_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("transformer_engine")
    except Exception:  # noqa: BLE001 - not installed, or no metadata
        return None


def launch(kind: str, device: str, job: Path, overrides: List[str], bare_fp8: Optional[str], warmup: int,
           out: Path, timeout: float, kernels: Optional[Path] = None) -> Dict[str, Any]:
    """One torchrun of this file in worker mode, in its own process group (ended on timeout). With
    ``kernels`` (a file), loop_overhead.py's torch.profiler window runs after the warm-up and its tables
    (operators and kernels by device and by host time) are copied there; that run's speed is not comparable."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(Path(__file__).resolve()), "--worker", kind, "--device", device, "--job", str(job),
           "--warmup", str(warmup), "--out", str(out)] + [f"--set={item}" for item in overrides]
    if bare_fp8:
        cmd += ["--bare-fp8", bare_fp8]
    if kernels is not None:
        cmd.append("--kernel-window")
    env = dict(os.environ, PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)  # the group this call started: torchrun and its rank
            except ProcessLookupError:
                pass
            try:
                stdout, stderr = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    wall = time.perf_counter() - start
    log = stdout + stderr
    run: Dict[str, Any] = {"wall_s": wall, "cmd": cmd, "graph": graph_state(log)}
    lines = re.findall(r"fast path: .*", stderr)
    if lines:
        run["fast_path_on_rank"] = lines[-1]
    if timed_out:
        return dict(run, status="failed", reason=f"timed out after {timeout:.0f} s (last: {error_line(stderr)})")
    table = Path(f"{out}.kernels.txt")
    if kernels is not None and table.exists():
        kernels.parent.mkdir(parents=True, exist_ok=True)
        kernels.write_text(table.read_text())
        run["kernels"] = str(kernels)
    if proc.returncode != 0 or not out.exists():
        return dict(run, status="failed", reason=error_line(stderr), stderr_tail=stderr[-4000:])
    if run["graph"] is None and "model.cuda_graph_impl" not in run.get("fast_path_on_rank", "").split("; not chosen")[0]:
        run["graph"] = "off"
    return dict(run, status="ok", **run_figures(kind, device, out, warmup, wall))


def git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + (" (with uncommitted changes)" if dirty else "")


def device_name(device: str) -> str:
    if device == "cpu":
        return f"cpu ({os.cpu_count()} cores)"
    import torch

    return torch.cuda.get_device_name()


def shape_line(name: str, s: Dict[str, int], tiny: bool) -> str:
    return (f"{name}{' (--tiny)' if tiny else ''}: {s['num_layers']} layers x hidden {s['hidden_size']}, "
            f"{s['num_attention_heads']} heads, vocab {s['vocab_size']}, seq {s['seq_length']} x micro-batch "
            f"{s['micro_batch_size']}")


def benchmark(args: argparse.Namespace, shapes: List[str], rows: List[str], tmp: Path) -> Dict[str, Any]:
    device, cuda = args.device, args.device == "cuda"
    no_te = te_available(device) if any(TE in ROWS[r][1] for r in rows) else None
    common = [f"train.train_iters={args.steps}", "train.eval_interval=0"]
    runs: List[Dict[str, Any]] = []
    total = len(shapes) * len(rows)
    started = time.perf_counter()
    from bridge_hpc.contracts.errors import ConfigError
    from bridge_hpc.jobfile.jobconfig import load_job_config

    for shape_name in shapes:
        shape = TINY if args.tiny else SHAPES[shape_name]
        job = tmp / f"{shape_name}.toml"
        job.write_text(job_toml(shape, args.steps, tmp / "unused", mock_section(shape), gpu=cuda))
        for row in rows:
            kind, sets, bare_fp8 = ROWS[row]
            # On CPU the toolkit's jobs ask for no GPUs, as loop_overhead.py's (a CPU rank turns the fast path off anyway).
            sets = [s for s in sets if cuda or s not in (ON_GPU, PLAIN)]
            name = f"{shape_name}-{row}"
            overrides = common + [f'job.run_dir="{tmp / name}"'] + sets
            run: Dict[str, Any] = {"shape": shape_name, "row": row, "worker": kind, "overrides": sets,
                                   "bare_fp8_recipe": bare_fp8}
            n = len(runs) + 1
            if no_te and TE in sets:
                run.update(status="skipped", reason=no_te)
            else:
                try:  # the loader the ranks use: a job it refuses fails here, without a launch
                    run["fast_path"] = load_job_config(job, overrides, cwd=tmp).training.fast_path.line()
                except ConfigError as err:
                    why = f"{err.key}: {err.message}" if err.key else err.message
                    run.update(status="failed", reason=f"the job loader refuses it: {why}")
            if "status" not in run:
                print(f"[te] {n}/{total} {name}: started ({time.perf_counter() - started:.0f} s in)",
                      file=sys.stderr, flush=True)
                run.update(launch(kind, device, job, overrides, bare_fp8, args.warmup, tmp / f"{name}.json",
                                  args.timeout, args.kernels / f"{name}.kernels.txt" if args.kernels else None))
            if run["status"] == "ok":
                end = f"{run['tokens_per_s']:,.0f} tokens/s" + (f", MFU {run['mfu']:.1%}" if "mfu" in run else "")
            else:
                end = f"{run['status']}: {run['reason']}"
            print(f"[te] {n}/{total} {name}: {end}" + (f" ({run['wall_s']:.0f} s wall)" if "wall_s" in run else ""),
                  file=sys.stderr, flush=True)
            runs.append(run)
    return {"card": device_name(device), "device": device, "date": datetime.datetime.now().astimezone().isoformat(
                timespec="seconds"), "git_head": git_head(), "transformer_engine": te_version(),
            "steps": args.steps, "warmup": args.warmup, "tiny": args.tiny, "peak_flops": H200_BF16_PEAK,
            "profiled": args.kernels is not None, "shapes": {s: TINY if args.tiny else SHAPES[s] for s in shapes}, "rows": rows,
            "wall_s": time.perf_counter() - started, "runs": runs}


def ok(runs: List[Dict[str, Any]], shape: str, row: str) -> Optional[Dict[str, Any]]:
    return next((r for r in runs if r["shape"] == shape and r["row"] == row and r["status"] == "ok"), None)


def ratio(runs: List[Dict[str, Any]], shape: str, row: str, ref: str) -> Optional[float]:
    a, b = ok(runs, shape, row), ok(runs, shape, ref)
    return a["tokens_per_s"] / b["tokens_per_s"] if a and b else None


def verdicts(r: Dict[str, Any]) -> Dict[str, Any]:
    """Issue 46's targets, each with its figure (None where a run is missing), and FP8's losses to bf16."""
    runs, shapes = r["runs"], list(r["shapes"])
    targets = []
    for shape, target in TARGET_TE.items():
        if shape in shapes:
            x = ratio(runs, shape, "bridge-te", "bare-te")
            targets.append({"what": f"bridge-te >= {target:.2f}x bare-te at {shape}", "figure": x,
                            "holds": None if x is None else x >= target})
    shape, target = TARGET_FP8
    if shape in shapes:
        fp8 = {row: ratio(runs, shape, row, "bridge-te") for row in FP8_OF if row.startswith("bridge")}
        best = max((row for row in fp8 if fp8[row] is not None), key=lambda row: fp8[row], default=None)
        targets.append({"what": f"bridge FP8 (best recipe) >= {target:.2f}x bridge-te at {shape}", "best": best,
                        "figure": fp8[best] if best else None, "holds": fp8[best] >= target if best else None})
    if r.get("profiled"):  # the profiler's cost per operator is in every figure: no speed verdict from them
        for t in targets:
            t.update(holds=None, why="profiled runs (--kernels): the profiler's cost is in every figure")
    loses = [] if r.get("profiled") else [  # (profiled figures carry the profiler's cost: no comparison)
        {"shape": s, "row": row, "against": ref, "ratio": x} for s in shapes for row, ref in FP8_OF.items()
        for x in [ratio(runs, s, row, ref)] if x is not None and x < 1]
    return {"targets": targets, "fp8_loses_to_bf16": loses}


def fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(r: Dict[str, Any]) -> None:
    runs = r["runs"]
    print(f"\nTransformer Engine vs the local fast path on {r['card']}, {r['date']}, git {r['git_head']}; "
          f"transformer_engine {r['transformer_engine'] or 'not installed'}; {r['steps']} steps a run, the first "
          f"{r['warmup']} left out; MFU over {r['peak_flops'] / 1e12:.0f} TFLOP/s (dense bf16); whole call "
          f"{r['wall_s']:.0f} s")
    for shape, s in r["shapes"].items():
        print(f"\n{shape_line(shape, s, r['tiny'])}\n")
        print("| row | tokens/s | MFU | peak GiB | x bare-te | FP8 x bf16 | CUDA graph | wall s |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |")
        for x in (x for x in runs if x["shape"] == shape):
            wall = fmt(x.get("wall_s"), ".0f")
            if x["status"] != "ok":
                print(f"| {x['row']} | {x['status']}: {x['reason']} | | | | | | {wall} |")
                continue
            fp8 = ratio(runs, shape, x["row"], FP8_OF[x["row"]]) if x["row"] in FP8_OF else None
            print(f"| {x['row']} | {x['tokens_per_s']:,.0f} | {fmt(x.get('mfu'), '.1%')} | "
                  f"{fmt(x.get('peak_allocated_gib'), '.2f')} | {fmt(ratio(runs, shape, x['row'], 'bare-te'), '.3f')} | "
                  f"{fmt(fp8, '.3f')} | {x.get('graph') or '-'} | {wall} |")
    v = r["verdicts"]
    print("\ntargets" + (" (--tiny: these check the script, not the targets)" if r["tiny"] else "") + ":")
    for t in v["targets"]:
        state = (f"not measured ({t['why']})" if t.get("why") else "not measured" if t["holds"] is None
                 else "holds" if t["holds"] else "does NOT hold")
        best = f" ({t['best']})" if t.get("best") else ""
        print(f"- {t['what']}: {'-' if t['figure'] is None else format(t['figure'], '.3f') + 'x'}{best}: {state}")
    if v["fp8_loses_to_bf16"]:
        print("FP8 loses to bf16 at: " + "; ".join(f"{x['shape']} {x['row']} {x['ratio']:.3f}x {x['against']}"
                                                   for x in v["fp8_loses_to_bf16"]))
    else:
        measured = any(ratio(runs, s, row, ref) is not None for s in r["shapes"] for row, ref in FP8_OF.items())
        print("FP8 loses to bf16: " + ("at none of the shapes measured" if measured else "not measured (no FP8 row ran)"))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated, of {', '.join(ROWS)} (default: all but bare-te-fp8)")
    p.add_argument("--steps", type=int, default=30, help="steps a run (default 30)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out at the start of each run (default 10)")
    p.add_argument("--timeout", type=float, default=180, help="seconds a run may take, launch included (default 180)")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT for every shape: checks the script")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "te.json")
    p.add_argument("--kernels", type=Path, metavar="DIR",
                   help="profile each run's first steps after the warm-up (torch.profiler; the top operators and "
                        "kernels by device and host time, DIR/<shape>-<row>.kernels.txt): its figures then include "
                        "the profiler's cost")
    # Worker mode (internal: one rank, started by torchrun from launch).
    p.add_argument("--worker", choices=("bare", "bridge"), help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--bare-fp8", help=argparse.SUPPRESS)
    p.add_argument("--kernel-window", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        return worker(args)
    shapes, rows = args.shapes.split(","), args.rows.split(",")
    if set(shapes) - set(SHAPES) or not shapes:
        p.error(f"--shapes: expected some of {', '.join(SHAPES)}, got {args.shapes!r}")
    if set(rows) - set(ROWS) or not rows:
        p.error(f"--rows: expected some of {', '.join(ROWS)}, got {args.rows!r}")
    if args.steps < args.warmup + 3:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by at least 3")
    print(f"[te] {len(shapes)} shape(s) x {len(rows)} row(s) on {args.device}, {args.steps} steps a run, "
          f"each run limited to {args.timeout:.0f} s", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="te-bench-", dir=os.environ.get("BENCH_TMP")) as tmp:
        result = benchmark(args, shapes, [r for r in ROWS if r in rows], Path(tmp))
    result["verdicts"] = verdicts(result)
    print_report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
