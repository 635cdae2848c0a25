"""What does fault tolerance (nvidia-resiliency-ext under ft_launcher) cost, and how fast does it act?
Prints a table and writes JSON (benchmarks/results/fault_tolerance.json).

1. Per-step overhead of ``FaultTolerance.step_start()/step_end()`` against FT off, for the section and
   the heartbeat API (target: under 1 % of a step). One ft_launcher run per API, one rank, a fixed CPU
   step (matmuls, ``--step-ms``); blocks of steps with the FT calls and without alternate inside the
   run (ABBA order), and the ratio is taken between the two medians of that run. The cost of the calls
   themselves is also timed directly (it is far below the noise of the step-time difference).
   Both with the sender thread (default: the step pays a queue put) and with synchronous IPC (the step
   waits for the monitor's reply); heartbeats are sent at most once a second.
2. Detection latency against the configured timeout: a rank that hangs (``rank_hung``) is killed by its
   monitor after the step timeout plus at most ``workload_check_interval``; a killed rank
   (``rank_killed``) is seen by the launcher at once. 2 gloo ranks of tests/data/ft_worker.py.
3. Time from detection to the first step after the in-job restart (launcher stops the survivors,
   rendezvous, new processes import torch, connect, resume from the "checkpoint").

Run: ``python benchmarks/fault_tolerance.py`` (about 2-3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bridge_test_helpers import free_port  # noqa: E402

from bridge_hpc.launch.ft_launch import FTLaunchTimeouts, ft_launcher_argv  # noqa: E402

FT_WORKER = ROOT / "tests" / "data" / "ft_worker.py"


# -- part 1: the worker (runs under ft_launcher) ----------------------------------------------------


def overhead_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from bridge_hpc.training.config import FaultToleranceConfig
    from bridge_hpc.training.resilience.fault_tolerance import FaultTolerance

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ft = FaultTolerance(FaultToleranceConfig(enable_ft_package=True), None, progress_mark_interval_s=0,
                        async_ipc=not args.sync_ipc)
    ft.setup()
    a = torch.randn(192, 192)

    def work(n):
        for _ in range(n):
            a @ a

    work(50)
    t0 = time.perf_counter()
    work(200)
    per = (time.perf_counter() - t0) / 200
    reps = max(1, int(args.step_ms / 1000 / per))
    for _ in range(20):
        work(reps)
    on, off, calls = [], [], []
    it = 0
    for block in range(args.blocks):
        order = ("on", "off") if block % 2 == 0 else ("off", "on")
        for mode in order:
            for _ in range(args.block_steps):
                t0 = time.perf_counter()
                if mode == "on":
                    ft.step_start(it)
                    c1 = time.perf_counter()
                work(reps)
                if mode == "on":
                    c2 = time.perf_counter()
                    ft.step_end(it)
                    c3 = time.perf_counter()
                    calls.append((c1 - t0) + (c3 - c2))
                dt = time.perf_counter() - t0
                (on if mode == "on" else off).append(dt)
                it += 1
    mode = ft.mode
    ft.shutdown()
    with open(args.result, "w") as f:
        json.dump({"mode": mode, "on": on, "off": off, "calls": calls}, f)
    dist.destroy_process_group()


# -- driver ----------------------------------------------------------------------------------------


def launch(entry, nproc, timeouts, max_restarts=0, limit=120):
    argv = ft_launcher_argv(entry, python=sys.executable, nnodes=1, nproc_per_node=nproc,
                            rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id=f"bench{os.getpid()}",
                            max_restarts=max_restarts, timeouts=timeouts, workers_stop_timeout=3,
                            monitor_interval=0.2)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(ROOT), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=limit)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"ft_launcher failed ({proc.returncode}):\n{log[-3000:]}")
    return log


def log_times(log, pattern):
    out = []
    for line in log.splitlines():
        m = re.match(r"\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]?", line)
        if m and re.search(pattern, line):
            out.append(time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000)
    return out


def overhead(api: str, sync: bool, step_ms: float, blocks: int, block_steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        timeouts = FTLaunchTimeouts(setup=120, step=60, checkpointing=60, out_of_section=120,
                                    initial_heartbeat=120, heartbeat=120, use_sections=api == "sections")
        launch([str(Path(__file__).resolve()), "--bench-worker", "--result", result, "--step-ms", str(step_ms),
                "--blocks", str(blocks), "--block-steps", str(block_steps)] + (["--sync-ipc"] if sync else []),
               1, timeouts)
        r = json.load(open(result))
    on, off = statistics.median(r["on"]), statistics.median(r["off"])
    call = statistics.median(r["calls"])
    return {"api": r["mode"], "ipc": "sync" if sync else "async",
            "step_ms_median_ft_on": on * 1e3, "step_ms_median_ft_off": off * 1e3,
            "overhead_ratio": (on - off) / off, "ft_calls_us_per_step": call * 1e6,
            "ft_calls_fraction_of_step": call / off, "steps_each": len(r["on"]),
            "step_for_1pct_ms": call / 0.01 * 1e3}


def fault_run(fault: str, step_timeout: float, check: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        timeouts = FTLaunchTimeouts(setup=60, step=step_timeout, checkpointing=60, out_of_section=30,
                                    initial_heartbeat=60, heartbeat=step_timeout, workload_check_interval=check)
        log = launch([str(FT_WORKER), "--out", out, "--steps", "80", "--step-time", "0.05", "--save-interval",
                      "10", "--fault", fault, "--fault-rank", "1", "--fault-delay", "3"], 2, timeouts,
                     max_restarts=1)
        fault_at = float(re.search(r"SIMULATED FAULT \S+ rank \d+ iteration \d+ at ([\d.]+)", log).group(1))
        # the launcher's decision to restart (same words in 0.4.1 and 0.7.0)
        detected = min(log_times(log, r"attempts left; will restart worker group"))
        firsts = []
        for rank in (0, 1):
            rows = [line.split() for line in open(os.path.join(out, f"steps_rank{rank}.txt"))]
            firsts.append(min(float(t) for r, _, t in rows if r == "1"))
        first = max(firsts)
    return {"fault": fault, "step_timeout_s": step_timeout, "check_interval_s": check,
            "detection_s": detected - fault_at, "detection_minus_timeout_s": detected - fault_at - (
                step_timeout if fault == "rank_hung" else 0.0),
            "detection_to_first_step_s": first - detected, "fault_to_first_step_s": first - fault_at}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bench-worker", action="store_true")
    p.add_argument("--sync-ipc", action="store_true")
    p.add_argument("--result")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--block-steps", type=int, default=10)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fault_tolerance.json"))
    p.add_argument("--quick", action="store_true", help="fewer fault runs")
    args = p.parse_args()
    if args.bench_worker:
        overhead_worker(args)
        return 0

    result = {"nvidia_resiliency_ext": _version(), "cpus": os.cpu_count(), "step_ms_target": args.step_ms}
    print(f"1. per-step overhead, {args.step_ms:.0f} ms CPU step, 1 rank, {args.blocks} alternating blocks "
          f"of {args.block_steps} steps")
    print(f"{'API':<11}{'IPC':<6}{'step on ms':>11}{'step off ms':>12}{'ratio':>9}{'calls us':>10}{'calls/step':>11}"
          f"{'1% at ms':>10}")
    result["overhead"] = []
    for api, sync in (("sections", False), ("sections", True), ("heartbeats", False), ("heartbeats", True)):
        o = overhead(api, sync, args.step_ms, args.blocks, args.block_steps)
        result["overhead"].append(o)
        print(f"{o['api']:<11}{o['ipc']:<6}{o['step_ms_median_ft_on']:>11.2f}{o['step_ms_median_ft_off']:>12.2f}"
              f"{o['overhead_ratio'] * 100:>8.2f}%{o['ft_calls_us_per_step']:>10.0f}"
              f"{o['ft_calls_fraction_of_step'] * 100:>10.3f}%{o['step_for_1pct_ms']:>10.1f}")

    print("\n2./3. faults (2 gloo ranks, in-job restart by ft_launcher)")
    print(f"{'fault':<12}{'timeout s':>10}{'check s':>8}{'detect s':>9}{'-timeout':>9}{'->1st step':>11}"
          f"{'fault->step':>12}")
    runs = [("rank_hung", 2.0, 0.5), ("rank_hung", 4.0, 0.5), ("rank_hung", 2.0, 5.0), ("rank_killed", 2.0, 0.5)]
    if args.quick:
        runs = [runs[0], runs[-1]]
    result["faults"] = []
    for fault, timeout, check in runs:
        f = fault_run(fault, timeout, check)
        result["faults"].append(f)
        print(f"{fault:<12}{timeout:>10.1f}{check:>8.1f}{f['detection_s']:>9.2f}{f['detection_minus_timeout_s']:>9.2f}"
              f"{f['detection_to_first_step_s']:>11.2f}{f['fault_to_first_step_s']:>12.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")
    return 0


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-resiliency-ext")
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
