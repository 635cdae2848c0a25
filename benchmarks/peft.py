"""LoRA against full fine-tuning of the ~1.3 B GPT of ``benchmarks/parallel.py`` on one GPU (issue 28).

Both variants fine-tune the same pretrained weights (``job.entry = "finetune"``,
``checkpoint.pretrained_checkpoint``): a 1-step run of the randomly initialized GPT, saved without its
optimizer (``checkpoint.save_optim = false``), made once at the start. Full fine-tuning is the job without
``[peft]``; LoRA is the same job with ``[peft] type = "lora"``, ``dim = 16`` on all four targets
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``). The runs alternate (``--order``, by
default full, lora, lora, full) so that a drift of the machine hits both, and every figure is a ratio
within one call. Each run is the rank entry point (``python -m bridge_hpc.rank``) started directly,
one process on one GPU, mock data, dropout off; after ``--steps`` steps it gets SIGUSR1 (Slurm's
preemption notice, sent to the rank and every process it started, as ``benchmarks/preemption.py`` does)
and exits through its synchronous exit save. Measured per run:

- tokens/s: the median of the steps after the first ``--warmup`` (``metrics.jsonl``);
- peak memory: the rank's ``torch.cuda.max_memory_allocated`` (the metrics' ``mem-max-allocated``, logged
  every step with ``logger.log_memory_to_tensorboard``), the largest over the run's steps;
- the exit save: its seconds (the rank's ``saved checkpoint ... in N s`` line, to 0.01 s; the progress
  log's last ``Saved checkpoint`` line, ``Save seconds``, to 0.1 s, is in the JSON too) and its bytes on
  disk (the files of that iteration's folder).

Targets (issue 28), LoRA over full, medians of each variant's runs: tokens/s >= 1.25x, peak memory
<= 0.6x, exit save seconds <= 0.2x.

Run: ``python benchmarks/peft.py`` on one GPU (``--device cuda``, the default; about 4 minutes on an
H100); prints a table and writes JSON (default ``benchmarks/results/peft.json``, ``--json`` to choose).
``--device cpu --tiny``: a tiny GPT (2 layers) on CPU for a few steps: checks the script's path (no GPU
memory to report there; its figures are not the targets').
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
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

from bridge_test_helpers import direct_rank_env, signal_tree, steps_done  # noqa: E402
from parallel import GPT_1_3B, job_sections  # noqa: E402

from bridge_hpc.contracts.progress_log import SAVE_SECONDS, SAVED_CHECKPOINT, parse_progress  # noqa: E402
from bridge_hpc.contracts.run_folder import CHECKPOINTS_DIR, METRICS_FILE, PROGRESS_FILE, tracked_iteration  # noqa: E402

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512, "seq_length": 128,
        "micro_batch_size": 2, "global_batch_size": 4}
LORA = {"dim": 16, "alpha": 32, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}
#: Issue 28's targets, LoRA over full fine-tuning: (measure, comparison, bound).
TARGETS = {"tokens_per_s": (">=", 1.25), "peak_gb": ("<=", 0.6), "exit_save_s": ("<=", 0.2)}


def job_toml(shape: Dict[str, int], gpu: bool, lora: bool, entry: str) -> str:
    """``benchmarks/parallel.py``'s job, fine-tuned (``entry``), with LoRA's ``[peft]`` when ``lora``; on CPU
    (``gpu`` false) in fp32 with plain DDP. ``job.run_dir``, ``train.train_iters`` and the checkpoint keys
    come as ``--set`` overrides."""
    import toml

    sections = job_sections(shape, Path("unused"))
    sections["job"] = {"name": "peft", "entry": entry}
    sections["train"]["train_iters"] = 1
    sections["checkpoint"] = {"save_interval": 1000000}
    sections["logger"]["log_progress"] = True
    if gpu:
        sections["slurm"] = {"gpus_per_node": 1}  # a GPU job: the loader gives it the fast path
    else:
        del sections["model"]["bf16"], sections["optimizer"]["bf16"]
        sections["ddp"] = {"grad_reduce_in_fp32": True}
    if lora:
        sections["peft"] = {"type": "lora", **LORA, "dropout": 0.0}
    return toml.dumps(sections)


def start(job: Path, run_dir: Path, sets: List[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bridge_hpc.rank", str(job)]
    for item in [f"job.run_dir={json.dumps(str(run_dir))}"] + sets:
        cmd += ["--set", item]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=job.parent, env=direct_rank_env(), stdout=out, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_tree(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit(f"the rank still ran after {timeout:.0f} s: see {log}") from None
    if proc.returncode != 0:
        raise SystemExit(f"the rank exited with status {proc.returncode}: see {log}\n" + log.read_text()[-4000:])


def make_base(work: Path, shape: Dict[str, int], gpu: bool) -> Path:
    """The pretrained weights both variants start from: one step of the randomly initialized GPT, saved
    without its optimizer. Returns its checkpoints folder."""
    job = work / "base.toml"
    job.write_text(job_toml(shape, gpu, lora=False, entry="pretrain"))
    run_dir, log = work / "base", work / "base.log"
    print("[peft] base: 1 step of the randomly initialized GPT, saved without the optimizer ...", flush=True)
    t0 = time.time()
    finish(start(job, run_dir, ["train.train_iters=1", "scheduler.lr_warmup_iters=0",
                                       "checkpoint.save_optim=false"], log), log)
    print(f"[peft] base: done in {time.time() - t0:.0f} s", flush=True)
    return run_dir / CHECKPOINTS_DIR


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fine_tune(work: Path, name: str, job: Path, base: Path, steps: int, warmup: int, sets: List[str] = ()) -> dict:
    """One fine-tuning run: ``steps`` steps, then SIGUSR1 and its exit save; its figures. ``sets``: more
    ``--set`` overrides."""
    run_dir, log = work / name, work / f"{name}.log"
    print(f"[peft] {name} ...", flush=True)
    t0 = time.time()
    # train_iters well past the signal: the run ends through the exit save, not at its last step
    proc = start(job, run_dir, [f"train.train_iters={steps + 1000}",
                                f"checkpoint.pretrained_checkpoint={json.dumps(str(base))}", *sets], log)
    deadline = time.time() + 600
    while steps_done(run_dir) < steps:
        if proc.poll() is not None or time.time() > deadline:
            if proc.poll() is None:
                signal_tree(proc.pid, signal.SIGKILL)
                proc.wait()
            raise SystemExit(f"{name} ended or stalled before step {steps}: see {log}\n" + log.read_text()[-4000:])
        time.sleep(0.05)
    signal_tree(proc.pid, signal.SIGUSR1)
    signalled = time.time()
    finish(proc, log)
    gone_s = time.time() - signalled

    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    steady = [r for r in records if r["step"] > warmup and r.get("tokens_per_s")]
    if not steady:
        raise SystemExit(f"{name}: no steps after the {warmup} warm-up steps")
    peaks = [v for r in records for k, v in r.items() if "max-allocated" in k and v is not None]
    runs = parse_progress(str(run_dir / CHECKPOINTS_DIR / PROGRESS_FILE))
    saved = runs[-1].last(SAVED_CHECKPOINT) if runs else None
    if saved is None or SAVE_SECONDS not in saved.fields:
        raise SystemExit(f"{name}: no exit save in its progress log")
    iteration = tracked_iteration(str(run_dir / CHECKPOINTS_DIR))
    ckpt = run_dir / CHECKPOINTS_DIR / f"iter_{iteration:07d}"
    if not ckpt.is_dir():
        raise SystemExit(f"{name}: the tracker names iteration {iteration}, but {ckpt} is missing")
    # the rank's own line has the save's seconds to 0.01 s (the progress log's to 0.1 s)
    found = re.findall(rf"saved checkpoint \S*{ckpt.name} in ([0-9.]+)s", log.read_text())
    save_s = float(found[-1]) if found else float(saved.fields[SAVE_SECONDS])
    result = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
              "step_s": statistics.median(r["step_time_s"] for r in steady), "steps_timed": len(steady),
              "peak_gb": max(peaks) if peaks else None, "exit_save_s": save_s,
              "exit_save_s_progress_log": float(saved.fields[SAVE_SECONDS]),
              "exit_save_bytes": folder_bytes(ckpt), "exit_save_iteration": iteration,
              "signal_to_gone_s": gone_s, "wall_s": time.time() - t0,
              "final_loss": records[-1].get("loss")}
    shutil.rmtree(run_dir / CHECKPOINTS_DIR)  # a full one is ~18 GB: two would crowd a 64 GB disk
    print(f"[peft] {name}: {result['tokens_per_s']:,.0f} tokens/s, exit save {result['exit_save_s']:.2f} s "
          f"({result['exit_save_bytes'] / 1e9:.3f} GB), done in {result['wall_s']:.0f} s", flush=True)
    return result


def write_results(path: str, results: dict, finished: bool = True) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(results, finished=finished), indent=2, default=str))
    tmp.replace(path)
    if finished:
        print(f"\nwrote {path}")


def ratio(lora: Optional[float], full: Optional[float]) -> Optional[float]:
    return lora / full if lora is not None and full else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT (2 layers): checks the script")
    p.add_argument("--steps", type=int, default=None, help="steps of each run (default 12; tiny 6)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of tokens/s (default 4; tiny 2)")
    p.add_argument("--order", default="full,lora,lora,full", help="the runs, in order (default full,lora,lora,full)")
    p.add_argument("--dir", default=None, help="where the runs go (default: a temporary folder, removed after)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "peft.json"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a job-file override for every fine-tuning run (repeatable), e.g. model.cuda_graph_impl=none")
    args = p.parse_args()
    order = args.order.split(",")
    if not set(order) <= {"full", "lora"} or set(order) != {"full", "lora"}:
        p.error("--order: a comma-separated list of full and lora, each at least once")
    gpu = args.device == "cuda"
    steps = args.steps or (6 if args.tiny else 12)
    warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 4)
    if steps <= warmup:
        p.error("--steps must be more than --warmup")

    import torch

    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU here (--device cpu --tiny checks the script on CPU)")
    shape = dict(TINY if args.tiny else GPT_1_3B)
    device = torch.cuda.get_device_name() if gpu else "cpu"
    work = Path(tempfile.mkdtemp(prefix="bridge-peft-", dir=args.dir))
    results: Dict[str, object] = {
        "model": "tiny GPT" if args.tiny else "~1.3B GPT (benchmarks/parallel.py)", "shape": shape,
        "device": device, "precision": "bf16, distributed adam" if gpu else "fp32, adam", "lora": LORA,
        "steps": steps, "warmup": warmup, "order": order, "sets": args.set, "runs": []}
    try:
        base = make_base(work, shape, gpu)
        results["base_bytes"] = folder_bytes(base)
        jobs = {}
        for variant in ("full", "lora"):
            jobs[variant] = work / f"{variant}.toml"
            jobs[variant].write_text(job_toml(shape, gpu, lora=variant == "lora", entry="finetune"))
        for i, variant in enumerate(order):
            r = fine_tune(work, f"{i + 1}-{variant}", jobs[variant], base, steps, warmup, args.set)
            results["runs"].append(dict(r, variant=variant))
            write_results(args.json, results, finished=False)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    def median(variant: str, key: str) -> Optional[float]:
        values = [r[key] for r in results["runs"] if r["variant"] == variant and r[key] is not None]
        return statistics.median(values) if values else None

    summary = {}
    for key in ("tokens_per_s", "step_s", "peak_gb", "exit_save_s", "exit_save_bytes"):
        full, lora = median("full", key), median("lora", key)
        summary[key] = {"full": full, "lora": lora, "lora_over_full": ratio(lora, full)}
    for key, (op, bound) in TARGETS.items():
        value = summary[key]["lora_over_full"]
        summary[key]["target"] = f"{op} {bound}"
        summary[key]["met"] = None if value is None else (value >= bound if op == ">=" else value <= bound)
    results["summary"] = summary

    print()
    print(f"{results['model']} on {device}: {shape['num_layers']} layers, hidden {shape['hidden_size']}, seq "
          f"{shape['seq_length']} x micro-batch {shape['micro_batch_size']}, global batch {shape['global_batch_size']}, "
          f"{results['precision']}; LoRA dim {LORA['dim']} on {', '.join(LORA['target_modules'])}; {steps} steps a "
          f"run, first {warmup} left out; exit save after SIGUSR1")
    print()
    print("| run | variant | tokens/s | step s | peak GB | exit save s | exit save GB | loss at the last step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(results["runs"]):
        peak = f"{r['peak_gb']:.2f}" if r["peak_gb"] is not None else "n/a"
        loss = f"{r['final_loss']:.4f}" if isinstance(r["final_loss"], (int, float)) else "?"
        print(f"| {i + 1} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {peak} "
              f"| {r['exit_save_s']:.2f} | {r['exit_save_bytes'] / 1e9:.4f} | {loss} |")
    print()
    names = {"tokens_per_s": "tokens/s", "peak_gb": "peak memory allocated", "exit_save_s": "exit save seconds"}
    for key in TARGETS:
        s = summary[key]
        value = "n/a" if s["lora_over_full"] is None else f"{s['lora_over_full']:.3f}x"
        met = "not measurable here" if s["met"] is None else "met" if s["met"] else "NOT met"
        print(f"LoRA / full, {names[key]} (medians): {value} (target {s['target']}x: {met})")
    s = summary["exit_save_bytes"]
    print(f"LoRA / full, exit save bytes: {s['lora_over_full']:.4f}x ({s['lora'] / 1e6:.1f} MB vs "
          f"{s['full'] / 1e6:.1f} MB); the base read by both: {results['base_bytes'] / 1e9:.3f} GB")
    if args.tiny or not gpu:
        print("(a tiny or CPU run checks the script; the targets are the 1.3 B GPT's on one GPU)")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
