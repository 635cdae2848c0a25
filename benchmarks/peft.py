"""LoRA and DoRA against full fine-tuning on one GPU, and against LoRA with ``transformers`` + ``peft``.

Every variant fine-tunes the same pretrained weights (``job.entry = "finetune"``,
``checkpoint.pretrained_checkpoint``). The base (``--base``):

- ``gpt`` (the default): the ~1.3 B GPT of ``benchmarks/parallel.py``, a 1-step run of it randomly
  initialized, saved without its optimizer (``checkpoint.save_optim = false``), made once at the start;
- ``llama``: a Llama-3.2-1B-shaped Hugging Face folder of random weights (``benchmarks/hf_import.py``'s,
  1.24 B parameters, bf16), which the jobs read directly (``pretrained_checkpoint`` = the folder). Only
  this base has the ``hf-lora`` variant: LoRA of the same rank on the same projections with Hugging Face
  ``transformers`` + ``peft`` on the same folder (``benchmarks/hf_peft_lora.py``: peft adapts q, k, v and
  gate, up separately, where the toolkit adapts the fused layers), the way users fine-tune without this
  toolkit.

Variants (``--order``): ``full`` is the job without ``[peft]``; ``lora`` the same job with
``[peft] type = "lora"``, ``dim = 16``, ``alpha = 32`` on all four targets (``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2``); ``dora`` the same with ``type = "dora"``; ``hf-lora``
above. The runs alternate (default ``full,lora,dora,lora,full``, with ``hf-lora`` in the middle for the
``llama`` base) so that a drift of the machine hits all, and every figure is a ratio within one call.
Each toolkit run is the rank entry point (``python -m bridge_hpc.rank``) started directly, one process on
one GPU, mock data, dropout off, global batch 32 of 4 x 2048 tokens, ``ddp.overlap_param_gather`` off
(parallel.py's multi-GPU job has it on; on one GPU there is nothing to gather, and on it keeps the
whole-step CUDA graph off); after ``--steps`` steps it gets
SIGUSR1 (Slurm's preemption notice, sent to the rank and every process it started, as
``benchmarks/preemption.py`` does) and exits through its synchronous exit save. Measured per run:

- tokens/s: the median of the steps after the first ``--warmup`` (``metrics.jsonl``);
- peak memory: the rank's ``torch.cuda.max_memory_allocated`` in 10^9 bytes (the metrics'
  ``mem-max-allocated-gigabytes``, logged every step with ``logger.log_memory_to_tensorboard``): the
  peak since the rank started, the base's load included (the largest of the steps' records);
- the exit save: its seconds (the rank's ``saved checkpoint ... in N s`` line, to 0.01 s; the progress
  log's last ``Saved checkpoint`` line, ``Save seconds``, to 0.1 s, is in the JSON too) and its bytes on
  disk (the files of that iteration's folder). ``hf-lora`` saves nothing (n/a).

Targets (issue 35), medians of each variant's runs: LoRA over full, tokens/s >= 1.4x, peak memory
<= 0.5x, exit save seconds <= 0.1x; LoRA over ``hf-lora``, tokens/s >= 2x. DoRA's ratios are stated
without a target.

Run: ``python benchmarks/peft.py`` on one GPU (``--device cuda``, the default; about 5 minutes on an
H100); prints a table and writes JSON (default ``benchmarks/results/peft.json``, ``--json`` to choose).
``--device cpu --tiny``: a tiny model (2 layers) on CPU for a few steps: checks the script's path (no GPU
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
from hf_import import SHAPES as HF_SHAPES  # noqa: E402
from hf_import import make_folder  # noqa: E402
from parallel import GPT_1_3B, job_sections  # noqa: E402
from te import graph_state  # noqa: E402

from bridge_hpc.contracts.fast_path import LINE_PREFIX as FAST_PATH_LINE  # noqa: E402
from bridge_hpc.contracts.progress_log import SAVE_SECONDS, SAVED_CHECKPOINT, parse_progress  # noqa: E402
from bridge_hpc.contracts.run_folder import CHECKPOINTS_DIR, METRICS_FILE, PROGRESS_FILE, tracked_iteration  # noqa: E402

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512, "seq_length": 128,
        "micro_batch_size": 2, "global_batch_size": 4}
LORA = {"dim": 16, "alpha": 32, "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}
VARIANTS = ("full", "lora", "dora", "hf-lora")
#: Issue 35's targets: (variant, over variant, measure, comparison, bound).
TARGETS = [("lora", "full", "tokens_per_s", ">=", 1.4), ("lora", "full", "peak_gb", "<=", 0.5),
           ("lora", "full", "exit_save_s", "<=", 0.1), ("lora", "hf-lora", "tokens_per_s", ">=", 2.0)]
#: Ratios printed without a target.
STATED = [("dora", "full", "tokens_per_s"), ("dora", "full", "peak_gb"), ("dora", "full", "exit_save_s"),
          ("dora", "lora", "tokens_per_s"), ("lora", "hf-lora", "peak_gb")]
NAMES = {"tokens_per_s": "tokens/s", "peak_gb": "peak memory allocated", "exit_save_s": "exit save seconds",
         "exit_save_bytes": "exit save bytes"}
LABELS = {"full": "full", "lora": "LoRA", "dora": "DoRA", "hf-lora": "transformers+peft LoRA"}


def job_toml(shape: Dict[str, int], gpu: bool, variant: str, entry: str, hf_base: bool = False) -> str:
    """``benchmarks/parallel.py``'s job, fine-tuned (``entry``), with ``[peft]`` for ``lora`` and ``dora``;
    on CPU (``gpu`` false) in fp32 with plain DDP. ``hf_base``: the architecture is the Hugging Face
    base folder's (``pretrained_checkpoint`` implies ``model.hf_config``), so ``[model]`` keeps only the
    sequence length, dropout and precision. ``job.run_dir``, ``train.train_iters`` and the checkpoint
    keys come as ``--set`` overrides."""
    import toml

    sections = job_sections(shape, Path("unused"))
    sections["job"] = {"name": "peft", "entry": entry}
    sections["train"]["train_iters"] = 1
    sections["checkpoint"] = {"save_interval": 1000000}
    sections["logger"]["log_progress"] = True
    if hf_base:
        sections["model"] = {k: v for k, v in sections["model"].items()
                             if k in ("seq_length", "hidden_dropout", "attention_dropout", "bf16")}
    if gpu:
        sections["slurm"] = {"gpus_per_node": 1}  # a GPU job: the loader gives it the fast path
        # One GPU: no data-parallel peers to gather parameters from. parallel.py's multi-GPU job overlaps
        # that gather, and left on it keeps the whole-step CUDA graph off (speed_defaults: its forward
        # pre-hooks wait outside the graph), so both variants ran eager: 2026-12-03, device-2026-12-03c.
        sections["ddp"]["overlap_param_gather"] = False
    else:
        del sections["model"]["bf16"], sections["optimizer"]["bf16"]
        sections["ddp"] = {"grad_reduce_in_fp32": True}
    if variant in ("lora", "dora"):
        sections["peft"] = {"type": variant, **LORA, "dropout": 0.0}
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
    job.write_text(job_toml(shape, gpu, "full", entry="pretrain"))
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
    text = log.read_text()
    found = re.findall(rf"saved checkpoint \S*{ckpt.name} in ([0-9.]+)s", text)
    save_s = float(found[-1]) if found else float(saved.fields[SAVE_SECONDS])
    result = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
              "step_s": statistics.median(r["step_time_s"] for r in steady), "steps_timed": len(steady),
              "peak_gb": max(peaks) if peaks else None, "exit_save_s": save_s,
              "exit_save_s_progress_log": float(saved.fields[SAVE_SECONDS]),
              "exit_save_bytes": folder_bytes(ckpt), "exit_save_iteration": iteration,
              "signal_to_gone_s": gone_s, "wall_s": time.time() - t0,
              "final_loss": records[-1].get("loss"),
              # what the step ran as: a LoRA step and a full one compare only on the same footing
              "cuda_graph": graph_state(text) or "off",
              "fast_path": next((line.strip() for line in text.splitlines() if FAST_PATH_LINE in line), None)}
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


def hf_lora(work: Path, name: str, folder: Path, shape: Dict[str, int], gpu: bool, steps: int,
            warmup: int) -> dict:
    """One ``transformers`` + ``peft`` LoRA run on the base folder (``benchmarks/hf_peft_lora.py``, its own
    process, so that its peak memory is its own); its figures, with no exit save (it saves nothing)."""
    log, out = work / f"{name}.log", work / f"{name}.json"
    print(f"[peft] {name} ...", flush=True)
    t0 = time.time()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "hf_peft_lora.py"), "--folder", str(folder),
           "--device", "cuda" if gpu else "cpu", "--steps", str(steps), "--warmup", str(warmup),
           "--micro-batch", str(shape["micro_batch_size"]), "--global-batch", str(shape["global_batch_size"]),
           "--seq-length", str(shape["seq_length"]), "--dim", str(LORA["dim"]), "--alpha", str(LORA["alpha"]),
           "--json", str(out)]
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    finish(proc, log)
    got = json.loads(out.read_text())
    result = {key: got[key] for key in ("tokens_per_s", "step_s", "steps_timed", "peak_gb", "final_loss")}
    result.update(exit_save_s=None, exit_save_s_progress_log=None, exit_save_bytes=None, exit_save_iteration=None,
                  signal_to_gone_s=None, wall_s=time.time() - t0, versions=got["versions"],
                  trainable_parameters=got["trainable_parameters"])
    print(f"[peft] {name}: {result['tokens_per_s']:,.0f} tokens/s, done in {result['wall_s']:.0f} s", flush=True)
    return result


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return numerator / denominator if numerator is not None and denominator else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (2 layers): checks the script")
    p.add_argument("--base", choices=("gpt", "llama"), default="gpt",
                   help="gpt: the 1.3 B GPT after one step (default); llama: a Llama-3.2-1B-shaped Hugging Face "
                        "folder, which also allows the hf-lora variant")
    p.add_argument("--steps", type=int, default=None, help="steps of each run (default 12; tiny 6)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of tokens/s (default 4; tiny 2)")
    p.add_argument("--order", default=None,
                   help="the runs, in order, from full, lora, dora and hf-lora (llama base only); default "
                        "full,lora,dora,lora,full, with hf-lora after dora for the llama base")
    p.add_argument("--dir", default=None, help="where the runs go (default: a temporary folder, removed after)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "peft.json"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a job-file override for every fine-tuning run (repeatable), e.g. model.cuda_graph_impl=none")
    args = p.parse_args()
    hf_base = args.base == "llama"
    default_order = "full,lora,dora,hf-lora,lora,full" if hf_base else "full,lora,dora,lora,full"
    order = (args.order or default_order).split(",")
    if not set(order) <= set(VARIANTS) or not {"full", "lora"} <= set(order):
        p.error(f"--order: a comma-separated list of {', '.join(VARIANTS)}, with full and lora at least once each")
    if "hf-lora" in order and not hf_base:
        p.error("--order: hf-lora needs a Hugging Face base (--base llama)")
    if "hf-lora" in order:
        import importlib.machinery

        # not this folder, where this script itself is a "peft"
        path = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
        missing = [name for name in ("transformers", "peft")
                   if importlib.machinery.PathFinder.find_spec(name, path) is None]
        if missing:  # before the toolkit's runs, not after them
            p.error(f"--order: hf-lora needs {' and '.join(missing)} (pip install {' '.join(missing)})")
    gpu = args.device == "cuda"
    steps = args.steps or (6 if args.tiny else 12)
    warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 4)
    if steps <= warmup:
        p.error("--steps must be more than --warmup")

    import torch

    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU here (--device cpu --tiny checks the script on CPU)")
    shape = dict(TINY if args.tiny else GPT_1_3B)
    hf_shape = HF_SHAPES["tiny" if args.tiny else "1b"]
    device = torch.cuda.get_device_name() if gpu else "cpu"
    work = Path(tempfile.mkdtemp(prefix="bridge-peft-", dir=args.dir))
    if hf_base:
        model = (f"Llama-3.2-1B-shaped Hugging Face folder ({hf_shape['layers']} layers, hidden {hf_shape['hidden']}, "
                 f"vocabulary {hf_shape['vocab']}; benchmarks/hf_import.py)")
    else:
        model = "tiny GPT" if args.tiny else "~1.3B GPT (benchmarks/parallel.py)"
    results: Dict[str, object] = {
        "model": model, "base": args.base, "shape": shape if not hf_base else dict(hf_shape, **{
            k: shape[k] for k in ("seq_length", "micro_batch_size", "global_batch_size")}),
        "device": device, "precision": "bf16, distributed adam" if gpu else "fp32, adam", "lora": LORA,
        "steps": steps, "warmup": warmup, "order": order, "sets": args.set, "runs": []}
    try:
        if hf_base:
            base = work / "hf-base"
            print(f"[peft] base: {model} ...", flush=True)
            make_folder(base, hf_shape)
        else:
            base = make_base(work, shape, gpu)
        results["base_bytes"] = folder_bytes(base)
        jobs = {}
        for variant in set(order) - {"hf-lora"}:
            jobs[variant] = work / f"{variant}.toml"
            jobs[variant].write_text(job_toml(shape, gpu, variant, entry="finetune", hf_base=hf_base))
        for i, variant in enumerate(order):
            name = f"{i + 1}-{variant}"
            if variant == "hf-lora":
                r = hf_lora(work, name, base, shape, gpu, steps, warmup)
            else:
                r = fine_tune(work, name, jobs[variant], base, steps, warmup, args.set)
            results["runs"].append(dict(r, variant=variant))
            write_results(args.json, results, finished=False)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    def median(variant: str, key: str) -> Optional[float]:
        values = [r[key] for r in results["runs"] if r["variant"] == variant and r[key] is not None]
        return statistics.median(values) if values else None

    present = [v for v in VARIANTS if v in order]
    summary: Dict[str, object] = {key: {v: median(v, key) for v in present} for key in NAMES}
    checks = []
    for numerator, denominator, key, op, bound in TARGETS:
        if numerator in order and denominator in order:
            value = ratio(median(numerator, key), median(denominator, key))
            met = None if value is None else (value >= bound if op == ">=" else value <= bound)
            checks.append({"of": numerator, "over": denominator, "measure": key, "ratio": value,
                           "target": f"{op} {bound}", "met": met})
    for numerator, denominator, key in STATED:
        if numerator in order and denominator in order:
            checks.append({"of": numerator, "over": denominator, "measure": key, "target": None, "met": None,
                           "ratio": ratio(median(numerator, key), median(denominator, key))})
    summary["ratios"] = checks
    results["summary"] = summary

    def cell(value: Optional[float], fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    print()
    print(f"{results['model']} on {device}: seq {shape['seq_length']} x micro-batch {shape['micro_batch_size']}, "
          f"global batch {shape['global_batch_size']}, {results['precision']}; LoRA/DoRA dim {LORA['dim']} alpha "
          f"{LORA['alpha']} on {', '.join(LORA['target_modules'])}; {steps} steps a run, first {warmup} left out; "
          f"exit save after SIGUSR1")
    print()
    print("| run | variant | tokens/s | step s | peak GB | exit save s | exit save GB | loss at the last step "
          "| CUDA graph |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(results["runs"]):
        save_gb = None if r["exit_save_bytes"] is None else r["exit_save_bytes"] / 1e9
        loss = f"{r['final_loss']:.4f}" if isinstance(r["final_loss"], (int, float)) else "?"
        print(f"| {i + 1} | {LABELS[r['variant']]} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} "
              f"| {cell(r['peak_gb'], '.2f')} | {cell(r['exit_save_s'], '.2f')} | {cell(save_gb, '.4f')} | {loss} "
              f"| {r.get('cuda_graph') or 'n/a'} |")
    print()
    for c in checks:
        value = "n/a" if c["ratio"] is None else f"{c['ratio']:.3f}x"
        if c["target"] is None:
            verdict = "stated, no target"
        else:
            verdict = f"target {c['target']}x: " + ("not measurable here" if c["met"] is None
                                                    else "met" if c["met"] else "NOT met")
        print(f"{LABELS[c['of']]} / {LABELS[c['over']]}, {NAMES[c['measure']]} (medians): {value} ({verdict})")
    full, lora = summary["exit_save_bytes"].get("full"), summary["exit_save_bytes"].get("lora")
    print(f"LoRA / full, exit save bytes: {cell(ratio(lora, full), '.4f')}x ({cell(lora and lora / 1e6, '.1f')} MB "
          f"vs {cell(full and full / 1e6, '.1f')} MB); the base read by all: {results['base_bytes'] / 1e9:.3f} GB")
    if args.tiny or not gpu:
        print("(a tiny or CPU run checks the script; the targets are the 1 B models' on one GPU)")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
