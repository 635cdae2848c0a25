"""What a preemption costs, measured on the local cluster (``bridge-cluster up``). Table + JSON.

- signal-to-exit latency: ``scancel --signal=USR1`` -> checkpoint durable (the tracker file names the
  new iteration) -> the job step gone; against one step plus one save, the least it can take;
- steps lost per preemption (target 0): from the progress log, and checked against the metrics;
- restart overhead: start-up seconds to the first step of each requeued run against the first run's;
- goodput of a run preempted every N steps (bridge-report's totals: training over allocated time;
  the requeue hold between allocations is queue time and not counted as allocated).

Figures are ratios within one run; the machine is noisy. Run: ``python benchmarks/preemption.py``.

``--device cuda`` (a GPU machine without Slurm: the ``device`` tool's H100): the 370 M GPT of
``benchmarks/indexed_vs_mock.py`` (seq 2048 x micro-batch 8, bf16, adam, mock data) on one GPU, one
rank started directly (as ``srun`` starts it: no torchrun), ``checkpoint.async_save = true``. Each
cycle trains ``--steps`` steps past where it started, sends SIGUSR1 to the rank and every process it
started (as Slurm's ``scancel --signal=USR1`` does), waits for the rank to exit, and starts the next
run, which resumes. Allocated time lost per preemption = signal -> rank gone (the step in flight,
the synchronous exit save, teardown) + the next run's start-up to its first step (progress.txt's
``First step`` line: imports, init, model build, checkpoint load and that step), less one step time
(work, not loss) + lost steps x step time. Target (issue 11): <= 15 s. Both modes also print where
each run's start-up went, phase by phase (``First step``'s ``Start-up phases``). ``--new-node`` drops the
checkpoints from the page cache before each restart, as a requeued job finds them on another node
(where the rank reads its checkpoint ahead while it imports). ``--tiny`` runs the same
cycles with a small model on CPU: it checks the script (and the direct start, signal and resume
path), not the figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from bridge_test_helpers import (  # noqa: E402
    direct_rank_env,
    drive,
    evict_from_page_cache,
    signal_tree,
    steps_done,
    submit,
    wait_running_past,
)

from bridge_hpc.contracts.progress_log import (  # noqa: E402
    ENDING_JOB,
    FIRST_STEP,
    LOAD_SECONDS,
    LOADED_CHECKPOINT,
    SAVE_SECONDS,
    SAVED_CHECKPOINT,
    STARTUP_PHASES,
    STARTUP_SECONDS,
    STEPS_LOST,
    parse_progress,
)
from bridge_hpc.contracts.run_folder import CHECKPOINTS_DIR, METRICS_FILE, PROGRESS_FILE, tracked_iteration  # noqa: E402
from bridge_hpc.training.process.startup import parse_phases  # noqa: E402


def startup_phases(runs) -> list:
    """Each run's start-up phases (seconds by phase, from its progress log's ``First step`` line)."""
    return [parse_phases(r.last(FIRST_STEP).fields[STARTUP_PHASES]) for r in runs
            if r.last(FIRST_STEP) is not None and STARTUP_PHASES in r.last(FIRST_STEP).fields]


def print_startup_phases(phases: list) -> None:
    """Where start-up went: the first run's phases against the median of the requeued runs'."""
    if not phases:
        return
    later = phases[1:]
    print(f"\n{'start-up phase':>20} {'first run s':>12} {'requeued runs s (median)':>25}")
    for name in phases[0]:
        restart = statistics.median(p.get(name, 0.0) for p in later) if later else float("nan")
        print(f"{name:>20} {phases[0][name]:>12.2f} {restart:>25.2f}")


def step_gone(job_id: str) -> bool:
    """True once the job's training step (srun) is no longer running."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], capture_output=True, text=True).stdout
    return not any(line.strip().endswith(".0") for line in out.splitlines())


def tracker_iteration(run_dir: Path) -> Optional[int]:
    """The iteration the run's checkpoint tracker names (None: no usable tracker yet)."""
    return tracked_iteration(str(run_dir / CHECKPOINTS_DIR))


def time_exit(run_dir: Path, before: Optional[int], t0: float, is_gone: Callable[[], bool],
              limit_s: float) -> Tuple[Optional[float], Optional[float]]:
    """Seconds from ``t0`` (the signal) until the tracker names an iteration other than ``before``
    (the exit checkpoint is durable) and until ``is_gone()``; None for one not seen in ``limit_s``."""
    durable = gone = None
    while gone is None and time.time() - t0 < limit_s:
        if durable is None and tracker_iteration(run_dir) != before:
            durable = time.time() - t0
        if is_gone():
            gone = time.time() - t0
            if durable is None and tracker_iteration(run_dir) != before:
                durable = gone
        else:
            time.sleep(0.01)
    return durable, gone


def preempt_every(run_dir: Path, iters: int, every: int) -> dict:
    """Train ``iters`` steps, sending USR1 each time ``every`` more steps are done; time each exit."""
    job_id = submit(run_dir, iters)
    exits = []
    target = every
    while target < iters:
        wait_running_past(job_id, run_dir, target)
        before = tracker_iteration(run_dir)
        t0 = time.time()
        subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
        durable, gone = time_exit(run_dir, before, t0, lambda: step_gone(job_id), limit_s=120)
        exits.append({"at_step": steps_done(run_dir), "durable_s": durable, "gone_s": gone})
        print(f"  preempted at step {exits[-1]['at_step']}: checkpoint durable after {durable:.2f} s, "
              f"ranks gone after {gone:.2f} s", flush=True)
        target = steps_done(run_dir) + every
    state = drive(job_id)
    runs = parse_progress(str(run_dir / CHECKPOINTS_DIR / PROGRESS_FILE))
    report = json.loads(subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(run_dir), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    metrics = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    step_s = statistics.median(m["step_time_s"] for m in metrics)
    saves = [float(e.fields[SAVE_SECONDS]) for r in runs for e in r.of(SAVED_CHECKPOINT) if SAVE_SECONDS in e.fields]
    startups = [float(r.last(FIRST_STEP).fields[STARTUP_SECONDS]) for r in runs if r.last(FIRST_STEP)]
    lost = [int(r.last(ENDING_JOB).fields[STEPS_LOST]) for r in runs[:-1] if r.last(ENDING_JOB)]
    return {"job_id": job_id, "state": state, "every": every, "iters": iters, "exits": exits,
            "step_s": step_s, "save_s": statistics.median(saves) if saves else None, "startup_s": startups,
            "startup_phases_s": startup_phases(runs),
            "lost_steps": lost, "steps_logged": sorted(m["step"] for m in metrics) == list(range(1, iters + 1)),
            "goodput": report["totals"]["goodput"], "runs": report["totals"]["runs"]}


def _gpu_job(folder: Path, tiny: bool) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from indexed_vs_mock import GPT_370M, TINY, job_toml, mock_section

    shape = TINY if tiny else GPT_370M
    text = job_toml(shape, 100000, folder / "run", mock_section(shape), gpu=not tiny)
    text = text.replace("[checkpoint]\n", "[checkpoint]\nasync_save = true\n")
    # progress.txt gives the start-up, load and lost steps of each run (the Slurm path's jobs log it too).
    text = text.replace("[logger]\n", "[logger]\nlog_progress = true\n")
    job = folder / "job.toml"
    job.write_text(text)
    return job


def gpu_preemptions(folder: Path, cycles: int, steps: int, tiny: bool = False, new_node: bool = False) -> dict:
    """``cycles`` preemptions of a one-GPU run, ``steps`` steps after each start (see the module doc).
    ``new_node``: before each restart the checkpoints are dropped from the page cache, as a requeued
    job finds them on another node."""
    import signal

    job, run_dir = _gpu_job(folder, tiny), folder / "run"
    exits = []
    for cycle in range(cycles + 1):
        env = direct_rank_env()
        log = open(folder / f"run{cycle}.log", "w")
        start_step = steps_done(run_dir)
        checkpoints = run_dir / CHECKPOINTS_DIR
        if new_node and checkpoints.is_dir():
            evict_from_page_cache([str(p) for p in checkpoints.rglob("*") if p.is_file()])
        proc = subprocess.Popen([sys.executable, "-m", "bridge_hpc.training.run", str(job)], cwd=folder, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 600
            while steps_done(run_dir) < start_step + steps:
                if proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"run {cycle} ended or stalled before step {start_step + steps}: "
                                     f"see {folder / f'run{cycle}.log'}")
                time.sleep(0.05)
            if cycle == cycles:
                break  # the last run only restarts: stopped below, not measured
            before = tracker_iteration(run_dir)
            t0 = time.time()
            signal_tree(proc.pid, signal.SIGUSR1)
            durable, gone = time_exit(run_dir, before, t0, lambda rank=proc: rank.poll() is not None, limit_s=300)
            returncode = proc.wait(timeout=60)  # one still running after the limit fails the benchmark here
            gone = gone if gone is not None else time.time() - t0
            exits.append({"at_step": steps_done(run_dir), "signal_at": t0, "durable_s": durable, "gone_s": gone,
                          "returncode": returncode})
            print(f"  preempted at step {exits[-1]['at_step']}: exit checkpoint durable after "
                  f"{durable if durable is not None else float('nan'):.2f} s, rank gone after {gone:.2f} s", flush=True)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    runs = parse_progress(str(run_dir / CHECKPOINTS_DIR / PROGRESS_FILE))
    metrics = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    step_s = statistics.median(m["step_time_s"] for m in metrics)
    startups = [float(r.last(FIRST_STEP).fields[STARTUP_SECONDS]) for r in runs if r.last(FIRST_STEP)]
    loads = [float(r.last(LOADED_CHECKPOINT).fields[LOAD_SECONDS]) for r in runs if r.last(LOADED_CHECKPOINT)]
    lost = [int(r.last(ENDING_JOB).fields[STEPS_LOST]) for r in runs[:-1] if r.last(ENDING_JOB)]
    # the exit save of each preempted run: the last synchronous save it logged
    exit_saves = [float(r.last(SAVED_CHECKPOINT).fields[SAVE_SECONDS]) for r in runs[:-1]
                  if r.last(SAVED_CHECKPOINT) is not None and SAVE_SECONDS in r.last(SAVED_CHECKPOINT).fields]
    per_preemption = [e["gone_s"] + (startup - step_s) + n * step_s
                      for e, startup, n in zip(exits, startups[1:], lost)]
    model = "tiny GPT on CPU (a check of the script)" if tiny else "370M GPT, seq 2048 x mb 8, bf16, adam"
    return {"device": "cpu" if tiny else "cuda", "model": model + ", async_save", "cycles": cycles, "new_node": new_node,
            "steps_per_run": steps, "exits": exits, "step_s": step_s, "startup_to_first_step_s": startups,
            "load_s": loads, "exit_save_s": exit_saves, "lost_steps": lost, "lost_per_preemption_s": per_preemption,
            "target_s": 15.0,            "startup_phases_s": startup_phases(runs)}


def gpu_main(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="bridge-preemption-gpu-", dir=args.dir))
    r = gpu_preemptions(work, args.cycles, args.steps, args.tiny, args.new_node)
    print()
    print(f"{'preemption':>10} {'exit save s':>12} {'signal->durable s':>18} {'signal->gone s':>15} "
          f"{'restart to 1st step s':>22} {'load s':>7} {'lost steps':>11} {'lost s':>7} {'target':>7}")
    for i, lost_s in enumerate(r["lost_per_preemption_s"]):
        save = r["exit_save_s"][i] if i < len(r["exit_save_s"]) else float("nan")
        durable = r["exits"][i]["durable_s"] if r["exits"][i]["durable_s"] is not None else float("nan")
        print(f"{i + 1:>10} {save:>12.2f} {durable:>18.2f} {r['exits'][i]['gone_s']:>15.2f} "
              f"{r['startup_to_first_step_s'][i + 1]:>22.1f} "
              f"{r['load_s'][i]:>7.1f} {r['lost_steps'][i]:>11} {lost_s:>7.1f} {'<= 15':>7} "
              f"{'ok' if lost_s <= 15 else 'ABOVE'}")
    if r["new_node"]:
        print("(checkpoints dropped from the page cache before each restart: a requeue onto another node)")
    print(f"first run's start-up to its first step: {r['startup_to_first_step_s'][0]:.1f} s; step {r['step_s']:.3f} s")
    print_startup_phases(r["startup_phases_s"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=2))
    print(f"\nwrote {args.json}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--every", type=int, nargs="+", default=[150, 300])
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "preemption.json"))
    p.add_argument("--device", choices=("slurm", "cuda"), default="slurm",
                   help="slurm: the local cluster (default); cuda: one GPU without Slurm (see the module doc)")
    p.add_argument("--cycles", type=int, default=2, help="cuda: preemptions (default 2)")
    p.add_argument("--steps", type=int, default=30, help="cuda: steps of each run before its preemption (default 30)")
    p.add_argument("--tiny", action="store_true",
                   help="cuda: a small model on CPU instead: checks the script, not the figure")
    p.add_argument("--dir", default=None, help="cuda: where the run folder goes (default: a temporary folder)")
    p.add_argument("--new-node", action="store_true",
                   help="cuda: drop the checkpoints from the page cache before each restart, as a requeued job "
                        "finds them on another node (the checkpoint is then read ahead while the rank imports)")
    args = p.parse_args()
    if args.device == "cuda":
        return gpu_main(args)
    results = []
    work = Path(tempfile.mkdtemp(prefix="bridge-preemption-"))
    for every in args.every:
        print(f"preempting every {every} steps of {args.iters} ...", flush=True)
        results.append(preempt_every(work / f"every-{every}", args.iters, every))
    print()
    print(f"{'preempted every':>15} {'runs':>5} {'signal->durable s':>18} {'signal->gone s':>15} "
          f"{'step+save s':>12} {'lost steps':>11} {'first start-up s':>17} {'restart start-up s':>19} {'goodput':>8}")
    for r in results:
        durable = statistics.median(e["durable_s"] for e in r["exits"])
        gone = statistics.median(e["gone_s"] for e in r["exits"])
        restart = statistics.median(r["startup_s"][1:]) if len(r["startup_s"]) > 1 else float("nan")
        print(f"{r['every']:>15} {r['runs']:>5} {durable:>18.2f} {gone:>15.2f} {r['step_s'] + (r['save_s'] or 0):>12.2f} "
              f"{sum(r['lost_steps']):>11} {r['startup_s'][0]:>17.1f} {restart:>19.1f} {r['goodput']:>8.1%}")
        assert r["state"] == "COMPLETED" and r["steps_logged"], r
    for r in results:
        print(f"\npreempted every {r['every']} steps:", end="")
        print_startup_phases(r["startup_phases_s"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
