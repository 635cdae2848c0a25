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
started (as Slurm's ``scancel --signal=USR1`` does), waits until the rank and every one of those
processes is gone (Slurm ends a job step only then), and starts the next run, which resumes.
Allocated time lost per preemption = signal -> all gone (the step in flight, the synchronous exit
save, teardown) + the next run's start-up to its first step (progress.txt's ``First step`` line:
imports, init, model build, checkpoint load and that step), less one step time (work, not loss) +
lost steps x step time. Target (issue 30): <= 10 s. It also prints where each run's start-up went,
phase by phase (``First step``'s ``Start-up phases``), what the second and third steps of each
requeued run cost beyond the median step, and each part against its floor on this machine,
measured after the cycles where the run writes: the state's bytes over the disk's write bandwidth
(4 files written at once, fsynced) for the exit save, over the page cache's read bandwidth for the
load, and a process start (Python, torch imported, CUDA initialized). Then (unless
``--no-compare``) the bitwise check: the same job with ``model.deterministic_mode`` (with the
job's defaults two uninterrupted runs differ from the second step on) is preempted once and
resumed, and every step's loss is compared bit for bit with that job trained without a stop. ``--new-node`` drops the
checkpoints from the page cache before each restart, as a requeued job finds them on another node
(where the rank reads its checkpoint ahead while it imports). ``--tiny`` runs the same cycles with a
small model on CPU: it checks the script (and the direct start, signal and resume path), not the
figure.
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
    descendants,
    direct_rank_env,
    drive,
    evict_from_page_cache,
    losses,
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


def _gpu_job(folder: Path, tiny: bool, deterministic: bool = False) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from indexed_vs_mock import GPT_370M, TINY, job_toml, mock_section

    shape = TINY if tiny else GPT_370M
    text = job_toml(shape, 100000, folder / "run", mock_section(shape), gpu=not tiny)
    text = text.replace("[checkpoint]\n", "[checkpoint]\nasync_save = true\n")
    # progress.txt gives the start-up, load and lost steps of each run (the Slurm path's jobs log it too).
    text = text.replace("[logger]\n", "[logger]\nlog_progress = true\n")
    if deterministic:
        text = text.replace("[model]\n", "[model]\ndeterministic_mode = true\n")
    job = folder / "job.toml"
    job.write_text(text)
    return job


#: The issue's target for the allocated time lost per preemption on the GPU path (issue 30).
GPU_TARGET_S = 10.0


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs: its ``/proc`` entry exists and it is no zombie (a zombie's memory
    is freed; only its exit status waits to be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _start_rank(job: Path, folder: Path, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bridge_hpc.rank", str(job)], cwd=folder,
                            env=direct_rank_env(), stdout=log, stderr=subprocess.STDOUT)


def _run_until(proc: subprocess.Popen, run_dir: Path, step: int, what: str) -> None:
    deadline = time.time() + 600
    while steps_done(run_dir) < step:
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"{what} ended or stalled before step {step}")
        time.sleep(0.05)


def gpu_preemptions(folder: Path, cycles: int, steps: int, tiny: bool = False, new_node: bool = False,
                    deterministic: bool = False) -> dict:
    """``cycles`` preemptions of a one-GPU run, ``steps`` steps after each start (see the module doc).
    ``new_node``: before each restart the checkpoints are dropped from the page cache, as a requeued
    job finds them on another node. ``deterministic``: the job sets ``model.deterministic_mode``."""
    import signal

    job, run_dir = _gpu_job(folder, tiny, deterministic), folder / "run"
    exits = []
    for cycle in range(cycles + 1):
        log = open(folder / f"run{cycle}.log", "w")
        start_step = steps_done(run_dir)
        checkpoints = run_dir / CHECKPOINTS_DIR
        if new_node and checkpoints.is_dir():
            evict_from_page_cache([str(p) for p in checkpoints.rglob("*") if p.is_file()])
        proc = _start_rank(job, folder, log)
        try:
            _run_until(proc, run_dir, start_step + steps, f"run {cycle} (see {folder / f'run{cycle}.log'})")
            if cycle == cycles:
                break  # the last run only restarts: stopped below, not measured
            before = tracker_iteration(run_dir)
            # The step's processes as Slurm sees them: the rank and everything it started (its
            # checkpoint worker, the write-results Manager). Slurm ends the job step, and so the
            # allocation's use, only when all of them are gone.
            tree = [proc.pid] + descendants(proc.pid)
            t0 = time.time()
            signal_tree(proc.pid, signal.SIGUSR1)
            durable, rank_gone = time_exit(run_dir, before, t0, lambda rank=proc: rank.poll() is not None, limit_s=300)
            returncode = proc.wait(timeout=60)  # one still running after the limit fails the benchmark here
            rank_gone = rank_gone if rank_gone is not None else time.time() - t0
            while any(_alive(pid) for pid in tree) and time.time() - t0 < 300:
                time.sleep(0.005)
            gone = max(time.time() - t0, rank_gone)
            exits.append({"at_step": steps_done(run_dir), "signal_at": t0, "durable_s": durable,
                          "rank_gone_s": rank_gone, "gone_s": gone, "processes": len(tree),
                          "returncode": returncode})
            print(f"  preempted at step {exits[-1]['at_step']}: exit checkpoint durable after "
                  f"{durable if durable is not None else float('nan'):.2f} s, rank gone after {rank_gone:.2f} s, "
                  f"all {len(tree)} processes after {gone:.2f} s", flush=True)
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
    # The second and third steps of each requeued run against the median step: what start-up work
    # left running in the background (host memory being pinned, say) costs the steps after the first.
    by_step = {m["step"]: m["step_time_s"] for m in metrics}
    after_first = [sum(by_step.get(e["at_step"] + k, step_s) - step_s for k in (2, 3)) for e in exits]
    model = "tiny GPT on CPU (a check of the script)" if tiny else "370M GPT, seq 2048 x mb 8, bf16, adam"
    return {"device": "cpu" if tiny else "cuda", "model": model + ", async_save", "cycles": cycles, "new_node": new_node,
            "steps_per_run": steps, "exits": exits, "step_s": step_s, "startup_to_first_step_s": startups,
            "load_s": loads, "exit_save_s": exit_saves, "lost_steps": lost, "lost_per_preemption_s": per_preemption,
            "steps_2_3_extra_s": after_first, "target_s": GPU_TARGET_S, "startup_phases_s": startup_phases(runs),
            "final_step": steps_done(run_dir), "job": str(job)}


def uninterrupted_losses(folder: Path, job: Path, last_step: int) -> dict:
    """Step -> loss of the same job trained from scratch without a stop up to ``last_step`` (then killed:
    nothing after it is compared)."""
    straight = folder / "straight"
    straight.mkdir()
    text = job.read_text().replace(str(folder / "run"), str(straight / "run"))
    straight_job = straight / "job.toml"
    straight_job.write_text(text)
    with open(straight / "run.log", "w") as log:
        proc = _start_rank(straight_job, straight, log)
        try:
            _run_until(proc, straight / "run", last_step, f"the uninterrupted run (see {straight / 'run.log'})")
        finally:
            proc.kill()
            proc.wait()
    return losses(straight / "run")


def measure_floors(folder: Path, state_bytes: int, threads: int = 4) -> dict:
    """This machine's floors for a preemption's parts, measured where the run writes: the disk's
    write bandwidth (``state_bytes`` of random data in ``threads`` files written at once, each
    fsynced: what the exit save must at least take), the page-cache read bandwidth of the same
    files (a same-node load's read), and the start of a process (bare Python; Python with torch
    imported and CUDA initialized, then gone)."""
    import os
    import threading

    chunk = os.urandom(16 << 20)
    paths = [folder / f"floor_{i}.bin" for i in range(threads)]
    share = state_bytes // threads

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            for _ in range(max(share // len(chunk), 1)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())

    def read(path: Path) -> None:
        buf = bytearray(16 << 20)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def timed(fn) -> float:
        began = time.perf_counter()
        workers = [threading.Thread(target=fn, args=(p,)) for p in paths]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - began

    written = max(share // len(chunk), 1) * len(chunk) * threads
    write_s = timed(write)
    read_s = timed(read)
    for path in paths:
        path.unlink()

    from bridge_hpc.training.process.bytecode_cache import compiles_every_time, default_cache_dir

    env = dict(os.environ)
    if "PYTHONPYCACHEPREFIX" not in env and compiles_every_time():
        env["PYTHONPYCACHEPREFIX"] = default_cache_dir()  # the bytecode cache a rank uses here

    def wall(code: str) -> float:
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=env)
        return time.perf_counter() - began

    return {"bytes": written, "write_gb_s": written / write_s / 1e9, "read_gb_s": written / read_s / 1e9,
            "python_start_s": min(wall("pass") for _ in range(3)),
            "torch_cuda_start_s": min(wall("import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()")
                                      for _ in range(2))}


def checkpoint_bytes(run_dir: Path) -> int:
    """Bytes of the model and optimizer state in the run's newest checkpoint (its DCP shards)."""
    newest = tracker_iteration(run_dir)
    folder = run_dir / CHECKPOINTS_DIR / f"iter_{newest:07d}"
    return sum(p.stat().st_size for p in folder.glob("*.distcp"))


def print_floors(r: dict) -> None:
    """Each part of a preemption against its floor on this machine (``r["floors"]``)."""
    f, gb = r["floors"], r["state_bytes"] / 1e9
    save_floor = r["state_bytes"] / (f["write_gb_s"] * 1e9)
    load_floor = r["state_bytes"] / (f["read_gb_s"] * 1e9)
    phases = r["startup_phases_s"][1:]

    def median(values) -> float:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else float("nan")

    teardown = median(e["gone_s"] - (e["durable_s"] or 0.0) for e in r["exits"])
    rows = [
        ("step in flight", r["step_s"], r["step_s"], "at most one step"),
        ("exit save", median(r["exit_save_s"]), save_floor,
         f"{gb:.2f} GB at {f['write_gb_s']:.2f} GB/s (4 files, write + fsync)"),
        ("durable -> all gone", teardown, 0.0, "the processes' exit (in the floor's process start)"),
        ("launch and imports", median(p.get("launch and imports") for p in phases), f["torch_cuda_start_s"],
         "python + import torch + CUDA init"),
        ("group, set-up, model, optim", median(sum(p.get(k, 0.0) for k in ("process group", "set-up", "model", "optimizer"))
                                                for p in phases), 0.0, ""),
        ("checkpoint load", median(p.get("checkpoint load") for p in phases), load_floor,
         f"{gb:.2f} GB read at {f['read_gb_s']:.1f} GB/s from the page cache"),
        ("first step - one step", median(p.get("first step") for p in phases) - r["step_s"], 0.0, ""),
    ]
    print(f"\n{'part (median of the preemptions)':>32} {'s':>7} {'floor s':>8} {'above':>7}  floor")
    for name, value, floor, how in rows:
        print(f"{name:>32} {value:>7.2f} {floor:>8.2f} {value - floor:>7.2f}  {how}")
    total_floor = r["step_s"] + save_floor + f["torch_cuda_start_s"]
    print(f"{'lost per preemption':>32} {median(r['lost_per_preemption_s']):>7.2f} {total_floor:>8.2f} "
          f"{median(r['lost_per_preemption_s']) - total_floor:>7.2f}  one step + state bytes / write bandwidth + "
          "a process start with torch and CUDA")
    r["floor_s"] = {"exit_save": save_floor, "load": load_floor, "total": total_floor}


def gpu_main(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="bridge-preemption-gpu-", dir=args.dir))
    r = gpu_preemptions(work, args.cycles, args.steps, args.tiny, args.new_node)
    if args.compare:
        # Resumed bit for bit: the losses of a run preempted once against a run that never stopped.
        # With the job's defaults two uninterrupted runs already differ from step 2 on (on an H100:
        # SDPA's flash backward accumulates in no fixed order), so the pair sets deterministic_mode.
        exact = work / "exact"
        exact.mkdir()
        e = gpu_preemptions(exact, 1, args.compare_steps, args.tiny, deterministic=True)
        preempted = losses(exact / "run")
        straight = uninterrupted_losses(exact, Path(e["job"]), e["final_step"])
        steps = sorted(set(preempted) & set(straight))
        differ = [s for s in steps if preempted[s] != straight[s]]
        r["exact"] = {"preempted_at": e["exits"][0]["at_step"], "final_step": e["final_step"],
                      "compared_steps": len(steps), "differing_steps": differ[:20],
                      "lost_per_preemption_s": e["lost_per_preemption_s"],
                      "losses_bitwise_equal": not differ and steps == list(range(1, e["final_step"] + 1))}
    if not args.tiny:
        r["state_bytes"] = checkpoint_bytes(work / "run")
        r["floors"] = measure_floors(work, r["state_bytes"])
    print()
    print(f"{'preemption':>10} {'exit save s':>12} {'signal->durable s':>18} {'->rank gone s':>14} {'->all gone s':>13} "
          f"{'restart to 1st step s':>22} {'load s':>7} {'steps 2-3 +s':>13} {'lost steps':>11} {'lost s':>7} {'target':>7}")
    for i, lost_s in enumerate(r["lost_per_preemption_s"]):
        e = r["exits"][i]
        save = r["exit_save_s"][i] if i < len(r["exit_save_s"]) else float("nan")
        durable = e["durable_s"] if e["durable_s"] is not None else float("nan")
        print(f"{i + 1:>10} {save:>12.2f} {durable:>18.2f} {e['rank_gone_s']:>14.2f} {e['gone_s']:>13.2f} "
              f"{r['startup_to_first_step_s'][i + 1]:>22.2f} {r['load_s'][i]:>7.2f} {r['steps_2_3_extra_s'][i]:>13.2f} "
              f"{r['lost_steps'][i]:>11} {lost_s:>7.2f} {'<= %g' % GPU_TARGET_S:>7} "
              f"{'ok' if lost_s <= GPU_TARGET_S else 'ABOVE'}")
    if r["new_node"]:
        print("(checkpoints dropped from the page cache before each restart: a requeue onto another node)")
    print(f"first run's start-up to its first step: {r['startup_to_first_step_s'][0]:.1f} s; step {r['step_s']:.3f} s")
    if args.compare:
        x = r["exact"]
        print(f"deterministic_mode, preempted at step {x['preempted_at']} (lost {x['lost_per_preemption_s'][0]:.2f} s): "
              f"losses of steps 1-{x['final_step']} against an uninterrupted run: "
              + ("bitwise equal" if x["losses_bitwise_equal"] else
                 f"NOT equal ({x['compared_steps']} compared; differing steps {x['differing_steps']})"))
    print_startup_phases(r["startup_phases_s"])
    if "floors" in r:
        print_floors(r)
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
    p.add_argument("--no-compare", dest="compare", action="store_false",
                   help="cuda: skip the bitwise check (a run with model.deterministic_mode preempted once, "
                        "and the same run uninterrupted)")
    p.add_argument("--compare-steps", type=int, default=12,
                   help="cuda: steps of each run of the bitwise check (default 12)")
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
