"""Model parallelism on GPUs: tokens/s, MFU and memory of data, tensor and pipeline parallelism on one
~1.3 B GPT, the data-parallel scaling against one GPU, and the checks of the parallelism issue.

Every run is the rank entry point (``python -m bridge_hpc.rank``), one process per GPU started
directly (as srun starts a job step's tasks), on mock data with dropout off, so a global batch is the
same samples at every layout:

1. ``dp1``: one GPU from scratch; its final weights ``W`` (saved without the optimizer) are where the
   other runs start (``checkpoint.pretrained_checkpoint``: weights loaded at their own layout, a fresh
   optimizer), so their loss curves compare step by step.
2. ``dp2``, ``tp2``, ``pp2`` (and ``tp2pp2``, ``tp2pp2-vpp2`` / ``dp4`` with 4 GPUs): the same steps from ``W``: tokens/s,
   MFU (the toolkit's 6·N·tokens + attention FLOPs over the H100's dense bf16 peak), peak memory per
   GPU, and each loss curve against ``dp2``'s (the DP-only reference): the largest relative
   difference over the steps, against a tolerance of 2 % (bf16 training in a different reduction
   order drifts by about 0.1-1 % over tens of steps).
3. Exact resume under TP2: ``tp2-deterministic`` is ``tp2`` with ``model.deterministic_mode`` (the
   fastest GPU kernels are not deterministic: two runs agree only to about 1e-5); ``tp2-usr1`` starts
   like it, gets SIGUSR1 (Slurm's preemption notice) on every rank mid-run, checkpoints
   (``dist_ckpt_optim_fully_reshardable``) and exits; ``tp2-resume`` resumes it to the end. Its
   losses must equal ``tp2-deterministic``'s bit for bit.
4. Another layout: ``dp2-from-tp2`` loads ``tp2-usr1``'s TP2 checkpoint at TP1 × DP2 (weights and
   optimizer resharded) and trains to the end; its losses follow ``tp2-deterministic``'s within the
   tolerance. These checks run on 2 GPUs whatever ``--gpus`` is (with 4, ``tp2`` and ``pp2`` are
   TP2 × DP2 and PP2 × DP2, and ``tp2pp2`` uses all 4).

Memory: the peak allocated per GPU, and from it the largest GPT of this shape (more layers) that each
layout fits in the GPU's memory (model state grows with the layers; activations per layer too).

Run: ``python benchmarks/parallel.py [--gpus 2] [--steps 20] [--tiny] [--json FILE]`` on a machine with
that many GPUs; prints a table and writes JSON (default ``benchmarks/results/parallel.json``).
``--gpus 1``: the ``dp1`` row alone (tokens/s and MFU against the one-GPU target of 50 %), with
``ddp.overlap_param_gather`` off (one GPU has nothing to gather; on, it keeps the step out of the CUDA graph).
``--tiny``: a small GPT, a check of the script (still on GPUs). ``--scaling-only --set KEY=VALUE``:
only ``dp1`` and data parallelism on 2 (and 4) GPUs with a variant (bucket size, reduce dtype,
overlap), to tune the DP scaling; ``--global-batch N`` changes the sequences per step (32: 8
micro-batches on one GPU, 4 per rank on two), the share of a step the gradient reduce can hide behind.
``--layouts tp2pp2-vpp2``: only those layouts (with dp1 and the DP reference), without the resume checks.
A layout that fails (other than dp1 and the reference) is reported and the others still run; the
benchmark then exits 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bridge_test_helpers import direct_rank_env, free_port  # noqa: E402

#: ~1.3 B parameters (24 layers of hidden 2048: 1.21 B, embeddings and output layer 0.13 B).
GPT_1_3B = {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "vocab_size": 32768,
            "seq_length": 2048, "micro_batch_size": 4, "global_batch_size": 32}
TINY = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "vocab_size": 4096, "seq_length": 256,
        "micro_batch_size": 4, "global_batch_size": 32}
#: H100 SXM dense bf16 peak, FLOP/s (the MFU denominator of the other GPU benchmarks).
PEAK_FLOPS = 989e12
LOSS_TOLERANCE = 0.02
#: The parallelism issue's data-parallel scaling targets, tokens/s against one GPU, by GPU count.
TARGET_DP_SCALING = {2: 1.96, 4: 3.85}
#: Layouts by GPU count: name -> (tensor, pipeline sizes, other overrides); data parallelism is the rest.
#: ``tp2pp2-vpp2``: the interleaved pipeline schedule (2 model chunks per stage). Sequence parallelism
#: needs Transformer Engine's layers (model.sequence_parallel), which this benchmark does not assume.
INTERLEAVED = ("model.virtual_pipeline_model_parallel_size=2",)
#: ``--gpus 1``: the dp1 row alone (its tokens/s and MFU; issue 48's one-GPU MFU target).
TARGET_DP1_MFU = 0.50
LAYOUTS = {1: {},
           2: {"dp2": (1, 1, ()), "tp2": (2, 1, ()), "pp2": (1, 2, ())},
           4: {"dp4": (1, 1, ()), "tp2": (2, 1, ()), "pp2": (1, 2, ()), "tp2pp2": (2, 2, ()),
               "tp2pp2-vpp2": (2, 2, INTERLEAVED)}}


def job_sections(shape: Dict[str, int], run_dir: Path) -> Dict[str, Dict[str, object]]:
    """The benchmark's job for a GPT of ``shape`` (bf16, distributed Adam with overlapped reduce and
    all-gather, mock data), as TOML sections; ``benchmarks/peft.py`` fine-tunes the same job."""
    return {
        "job": {"name": "parallel", "run_dir": str(run_dir)},
        "train": {"train_iters": 20, "micro_batch_size": shape["micro_batch_size"],
                  "global_batch_size": shape["global_batch_size"]},
        "model": {**{k: shape[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                                            "seq_length")},
                  "hidden_dropout": 0.0, "attention_dropout": 0.0, "bf16": True},
        "optimizer": {"optimizer": "adam", "lr": 1e-4, "min_lr": 1e-5, "bf16": True},
        "scheduler": {"lr_warmup_iters": 2},
        "ddp": {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True, "overlap_grad_reduce": True,
                "overlap_param_gather": True},
        "checkpoint": {"save_interval": 1000000, "dist_ckpt_optim_fully_reshardable": True},
        "logger": {"log_interval": 1, "log_memory_to_tensorboard": True, "tensorboard_dir": ""},
        "dataset": {"seq_length": shape["seq_length"]},
    }


def job_toml(shape: Dict[str, int], run_dir: Path) -> str:
    import toml

    return toml.dumps(job_sections(shape, run_dir))


def launch(job: Path, gpus: int, overrides: List[str], log: Path) -> List[subprocess.Popen]:
    """``gpus`` ranks of the entry point, one per GPU, started directly with torch.distributed's variables."""
    port = free_port()
    procs = []
    out = open(log, "w")
    for rank in range(gpus):
        env = direct_rank_env(rank, gpus, port)
        cmd = [sys.executable, "-m", "bridge_hpc.rank", str(job)]
        for item in overrides:
            cmd += ["--set", item]
        procs.append(subprocess.Popen(cmd, cwd=job.parent, env=env, stdout=out, stderr=subprocess.STDOUT))
    out.close()
    return procs


def wait_all(procs: List[subprocess.Popen], log: Path, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.time() > deadline:
                raise SystemExit(f"ranks still running after {timeout:.0f} s: see {log}")
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(5)  # the others end through the failed collective, or are stopped below
                if any(p.poll() is None for p in procs):
                    break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise SystemExit(f"a rank exited with status {bad[0]}: see {log}\n" + log.read_text()[-4000:])


def metrics(run_dir: Path) -> Dict[int, dict]:
    from bridge_hpc.training.engine.metrics import read_metrics

    return read_metrics(str(run_dir / "metrics.jsonl"))


def steps_logged(run_dir: Path) -> int:
    return max(metrics(run_dir), default=0) if (run_dir / "metrics.jsonl").exists() else 0


def run(work: Path, name: str, job: Path, gpus: int, tp: int, pp: int, steps: int, extra: List[str] = (),
        usr1_at: Optional[int] = None, log_name: Optional[str] = None, common: List[str] = ()) -> Path:
    """One run into ``work/name``; with ``usr1_at`` every rank gets SIGUSR1 once that step is logged.
    ``common``: ``--set`` overrides of every run (a variant under test)."""
    run_dir = work / name
    # The job asks for the GPUs it runs on, as a job file on the cluster does: the loader then gives it
    # the fast path of a GPU job (bridge_hpc.training.engine.speed_defaults), which each rank's log line names.
    sets = [f"job.run_dir={json.dumps(str(run_dir))}", f"train.train_iters={steps}",
            f"slurm.ntasks_per_node={gpus}", f"slurm.gpus_per_node={gpus}",
            f"model.tensor_model_parallel_size={tp}", f"model.pipeline_model_parallel_size={pp}"] + list(common) + list(extra)
    log = work / f"{log_name or name}.log"
    print(f"[parallel] {log_name or name}: {gpus} GPU(s), TP{tp} PP{pp} ...", flush=True)
    started = time.time()
    procs = launch(job, gpus, sets, log)
    if usr1_at is not None:
        deadline = time.time() + 900
        while steps_logged(run_dir) < usr1_at and time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGUSR1)
    wait_all(procs, log)
    print(f"[parallel] {log_name or name}: done in {time.time() - started:.0f} s", flush=True)
    return run_dir


def throughput(run_dir: Path, warmup: int, gpus: int, flops_per_step: float) -> dict:
    m = metrics(run_dir)
    steady = [m[s] for s in sorted(m) if s > warmup]
    step_s = statistics.median(r["step_time_s"] for r in steady)
    peaks = [v for r in steady for k, v in r.items() if "max-allocated" in k]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady), "step_s": step_s,
            "mfu": flops_per_step / step_s / (gpus * PEAK_FLOPS),
            "peak_gb_per_gpu": max(peaks) if peaks else None}


def compare(a: Dict[int, dict], b: Dict[int, dict], steps) -> dict:
    rel = [abs(a[s]["loss"] - b[s]["loss"]) / abs(b[s]["loss"]) for s in steps]
    return {"steps": [min(steps), max(steps)], "max_rel_diff": max(rel), "mean_rel_diff": sum(rel) / len(rel),
            "bitwise_equal": all(a[s]["loss"] == b[s]["loss"] for s in steps)}


def write_results(path: str, results: dict, finished: bool = True) -> int:
    """The JSON of the results, at ``path``; the exit status of a finished benchmark. Also written after
    every run with ``finished`` false, so that a benchmark stopped by a time limit still leaves its
    figures so far (``"finished": false`` in the file)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(results, finished=finished), indent=2, default=str))
    tmp.replace(path)
    if finished:
        print(f"\nwrote {path}")
    return 0


def resume_checks(results: dict, work: Path, job: Path, curves: dict, steps: int, start: List[str],
                  weights_only: List[str], args, flops: float, go) -> None:
    """Exact resume under TP2 after SIGUSR1 (deterministic kernels: two runs of the fastest ones agree
    only to about 1e-5), and the TP2 checkpoint at TP1 x DP2, on 2 GPUs."""
    half = steps // 2
    deterministic = ["model.deterministic_mode=true"]
    straight = go(work, "tp2-deterministic", job, 2, 2, 1, steps, weights_only + start + deterministic)
    curves["tp2-deterministic"] = metrics(straight)
    usr1 = go(work, "tp2-usr1", job, 2, 2, 1, steps, start + deterministic, usr1_at=half)
    stopped_at = max(metrics(usr1))
    from_tp2 = [f"checkpoint.load={json.dumps(str(usr1 / 'checkpoints'))}"]
    after = range(stopped_at + 1, steps + 1)
    try:
        cross = go(work, "dp2-from-tp2", job, 2, 1, 1, steps, weights_only + from_tp2)
        results["tp2_checkpoint_at_dp2"] = {"loaded_iteration": min(metrics(cross)) - 1,
                                            **compare(metrics(cross), curves["tp2-deterministic"], after)}
    except SystemExit as failure:  # reported, and the other results are still written
        results["tp2_checkpoint_at_dp2"] = {"error": str(failure)[-3000:]}
        print(f"[parallel] dp2-from-tp2 FAILED: {str(failure)[-3000:]}", flush=True)
    write_results(args.json, results, finished=False)
    # the same run folder: resumes its own checkpoint
    resumed = go(work, "tp2-usr1", job, 2, 2, 1, steps, weights_only + start + deterministic, log_name="tp2-resume")
    results["tp2_usr1_resume"] = {"stopped_at": stopped_at,
                                  **compare(metrics(resumed), curves["tp2-deterministic"], after),
                                  "tokens_per_s_deterministic": throughput(straight, args.warmup, 2, flops)["tokens_per_s"]}

    if args.gpus == 2 and "tp2" in curves:  # the same TP2 layout with the default kernels
        results["tp2_usr1_resume"]["deterministic_vs_default_kernels"] = compare(
            curves["tp2-deterministic"], curves["tp2"], range(1, steps + 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2, choices=sorted(LAYOUTS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timings")
    p.add_argument("--tiny", action="store_true", help="a small GPT: checks the script")
    p.add_argument("--dir", default=None, help="where the runs go (default: a temporary folder)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "parallel.json"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, to try a variant (e.g. ddp.bucket_size=20000000)")
    p.add_argument("--scaling-only", action="store_true",
                   help="only the data-parallel runs (1 GPU and all of them): tokens/s and the DP scaling")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step instead of the shape's 32 (more micro-batches per rank to hide the "
                        "gradient reduce behind)")
    p.add_argument("--layouts", default=None, metavar="NAMES",
                   help="comma-separated layouts to run (default: all of --gpus'); dp1 and the DP reference always "
                        "run, the 2-GPU resume checks only without this option")
    args = p.parse_args()
    if args.layouts and not set(args.layouts.split(",")) <= set(LAYOUTS[args.gpus]):
        p.error(f"--layouts: choose among {', '.join(LAYOUTS[args.gpus])}")

    import torch

    from bridge_hpc.training.config import ConfigContainer
    from bridge_hpc.training.utils.train_utils import num_floating_point_operations

    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, this machine has {torch.cuda.device_count()}")
    shape = dict(TINY if args.tiny else GPT_1_3B)
    if args.global_batch:
        shape["global_batch_size"] = args.global_batch
    work = Path(tempfile.mkdtemp(prefix="bridge-parallel-", dir=args.dir))
    job = work / "job.toml"
    job.write_text(job_toml(shape, work / "unused"))
    cfg = ConfigContainer.from_sections({"model": {k: shape[k] for k in ("num_layers", "hidden_size",
                                                                           "num_attention_heads", "vocab_size",
                                                                           "seq_length")},
                                         "train": {"micro_batch_size": shape["micro_batch_size"],
                                                   "global_batch_size": shape["global_batch_size"],
                                                   "train_iters": 1},
                                         "optimizer": {"lr": 1e-4}})
    cfg.finalize_sections()
    flops = num_floating_point_operations(cfg, shape["global_batch_size"])
    steps = args.steps
    weights_only = ["checkpoint.save_optim=false"]
    results: Dict[str, dict] = {"model": "~1.3B GPT" if not args.tiny else "tiny GPT", "shape": shape,
                                "gpus": args.gpus, "device": torch.cuda.get_device_name(), "steps": steps,
                                "warmup": args.warmup, "loss_tolerance": LOSS_TOLERANCE, "runs": {}}

    go = functools.partial(run, common=args.set)
    results["overrides"] = args.set
    # --gpus 1: nothing to gather on one GPU, and with ddp.overlap_param_gather on the fast path refuses the
    # whole-step CUDA graph (its pre-hooks wait for all-gathers started outside it), as benchmarks/peft.py says.
    one_gpu = ["ddp.overlap_param_gather=false"] if args.gpus == 1 else []
    dp1 = go(work, "dp1", job, 1, 1, 1, steps, weights_only + one_gpu)
    results["runs"]["dp1"] = dict(throughput(dp1, args.warmup, 1, flops), layout="1 GPU")
    write_results(args.json, results, finished=False)
    if args.gpus == 1:
        r = results["runs"]["dp1"]
        results["dp1_mfu_target"] = TARGET_DP1_MFU
        print(f"\n{results['model']} on 1 x {results['device']}: dp1 {r['tokens_per_s']:,.0f} tokens/s, step "
              f"{r['step_s']:.3f} s, MFU {r['mfu']:.1%} (target >= {TARGET_DP1_MFU:.0%}: "
              f"{'met' if r['mfu'] >= TARGET_DP1_MFU else 'not met'}), peak {r['peak_gb_per_gpu']} GB")
        return write_results(args.json, results)
    start = [f"checkpoint.pretrained_checkpoint={json.dumps(str(dp1 / 'checkpoints'))}"]
    curves = {}
    # name -> (GPUs, tensor, pipeline); --scaling-only: data parallelism on every GPU count up to --gpus
    layouts = ({f"dp{n}": (n, 1, 1, ()) for n in sorted(LAYOUTS) if 1 < n <= args.gpus} if args.scaling_only
               else {name: (args.gpus, *sizes) for name, sizes in LAYOUTS[args.gpus].items()
                     if not args.layouts or name in args.layouts.split(",") or name == f"dp{args.gpus}"})
    reference = f"dp{args.gpus}"
    failed: Dict[str, str] = {}
    for name, (gpus, tp, pp, extra) in layouts.items():
        layout = f"TP{tp} x PP{pp} x DP{gpus // (tp * pp)}" + (" (VPP2)" if extra == INTERLEAVED else "")
        try:
            run_dir = go(work, name, job, gpus, tp, pp, steps, weights_only + start + list(extra))
        except SystemExit as failure:
            if name in ("dp1", reference):
                raise
            failed[name] = str(failure)[-3000:]  # reported; the other layouts still run
            print(f"[parallel] {name} FAILED: {failed[name]}", flush=True)
            continue
        results["runs"][name] = dict(throughput(run_dir, args.warmup, gpus, flops), gpus=gpus, layout=layout)
        curves[name] = metrics(run_dir)
        write_results(args.json, results, finished=False)
    results["failed_layouts"] = failed
    for name in curves:
        if name != reference and layouts[name][0] == args.gpus:
            results["runs"][name]["loss_vs_dp"] = compare(curves[name], curves[reference], range(1, steps + 1))
    dp_name = f"dp{args.gpus}"
    results["dp_scaling_by_gpus"] = {
        n: {"scaling": results["runs"][f"dp{n}"]["tokens_per_s"] / results["runs"]["dp1"]["tokens_per_s"],
            "target": TARGET_DP_SCALING[n]} for n in TARGET_DP_SCALING if f"dp{n}" in results["runs"]}
    results["dp_scaling"] = results["dp_scaling_by_gpus"][args.gpus]["scaling"]
    results["dp_scaling_target"] = TARGET_DP_SCALING[args.gpus]
    if args.scaling_only:
        print(f"\nglobal batch {shape['global_batch_size']} x seq {shape['seq_length']}"
              f"{', with ' + ', '.join(args.set) if args.set else ''}; dp1 {results['runs']['dp1']['tokens_per_s']:,.0f} "
              f"tokens/s")
        for n, r in results["dp_scaling_by_gpus"].items():
            print(f"DP scaling, dp{n} vs dp1: {r['scaling']:.3f}x (target >= {r['target']}x on {n} GPUs); tokens/s "
                  f"{results['runs'][f'dp{n}']['tokens_per_s']:,.0f}")
        return write_results(args.json, results) or int(bool(failed))

    if not args.layouts:
        resume_checks(results, work, job, curves, steps, start, weights_only, args, flops, go)

    # Memory: the largest GPT of this shape (more layers) each layout fits, from its peak per GPU.
    capacity = torch.cuda.get_device_properties(0).total_memory / 1e9
    for r in results["runs"].values():
        if r["peak_gb_per_gpu"]:
            r["fits_layers"] = int(shape["num_layers"] * capacity * 0.95 / r["peak_gb_per_gpu"])
            r["fits_params_b"] = r["fits_layers"] * 12 * shape["hidden_size"] ** 2 / 1e9

    print()
    print(f"{results['model']} on {args.gpus} x {results['device']}: seq {shape['seq_length']} x micro-batch "
          f"{shape['micro_batch_size']}, global batch {shape['global_batch_size']}, bf16, distributed adam; "
          f"{steps} steps, first {args.warmup} left out")
    print()
    print("| run | layout | GPUs | tokens/s | step s | MFU | peak GB/GPU | fits (layers / B params) "
          "| loss vs DP (max rel. diff) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results["runs"].items():
        gpus = r.get("gpus", 1)
        loss = r.get("loss_vs_dp")
        loss_text = f"{loss['max_rel_diff']:.2e} ({'ok' if loss['max_rel_diff'] <= LOSS_TOLERANCE else 'ABOVE'})" \
            if loss else "reference" if name == reference else ""
        fits = f"{r.get('fits_layers', '?')} / {r.get('fits_params_b', 0):.1f}" if r["peak_gb_per_gpu"] else "?"
        peak = f"{r['peak_gb_per_gpu']:.1f}" if r["peak_gb_per_gpu"] else "?"
        print(f"| {name} | {r['layout']} | {gpus} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {r['mfu']:.1%} "
              f"| {peak} | {fits} | {loss_text} |")
    for name, error in failed.items():
        print(f"| {name} | FAILED: {error.strip().splitlines()[-1][:200] if error.strip() else '?'} |")
    print()
    print(f"DP scaling, {dp_name} vs dp1: {results['dp_scaling']:.3f}x (target >= {TARGET_DP_SCALING[args.gpus]}x "
          f"on {args.gpus} GPUs)")
    if "tp2_usr1_resume" not in results:
        return write_results(args.json, results) or int(bool(failed))
    r = results["tp2_usr1_resume"]
    print(f"TP2 with deterministic kernels ({r['tokens_per_s_deterministic']:,.0f} tokens/s), SIGUSR1 after step "
          f"{r['stopped_at']}, resumed to {steps}: losses bitwise equal to the uninterrupted run: "
          f"{r['bitwise_equal']} (max rel. diff {r['max_rel_diff']:.2e})")
    r = results["tp2_checkpoint_at_dp2"]
    if "error" in r:
        print(f"TP2 checkpoint resumed at TP1 x DP2: FAILED ({r['error'][-300:]})")
    else:
        print(f"TP2 checkpoint of iteration {r['loaded_iteration']} resumed at TP1 x DP2: max rel. loss diff against "
              f"TP2 {r['max_rel_diff']:.2e} ({'ok' if r['max_rel_diff'] <= LOSS_TOLERANCE else 'ABOVE'} "
              f"<= {LOSS_TOLERANCE})")
    return write_results(args.json, results) or int(bool(failed))


if __name__ == "__main__":
    sys.exit(main())
