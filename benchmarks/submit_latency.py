"""How light is the login-node path? Prints a table and writes JSON.

1. ``bridge-submit --dry-run`` wall time (target: median under 0.3 s) and whether torch, megatron or
   nvidia_resiliency_ext show up in ``python -X importtime`` (target: none).
2. Submit-to-running latency on the local cluster: from starting ``bridge-submit job.toml`` to the
   first rank running, against a plain ``sbatch`` of the very script bridge-submit rendered, started
   the same way (target: within 0.3 s). The two are interleaved, and compared as medians of one run,
   because these machines are noisy.

Needs the local cluster for part 2 (``bridge-cluster up``); run: ``python benchmarks/submit_latency.py``.
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

import toml

ROOT = Path(__file__).resolve().parent.parent
RANK = """#!{python}
import os, time
name = "started." + os.environ.get("SLURM_JOB_ID", "x") + "." + os.environ["SLURM_PROCID"]
path = os.path.join(os.environ["BRIDGE_RUN_DIR"], name)
open(path, "w").write(repr(time.time()))
"""


def dry_run_times(n: int) -> list:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", "configs/local-tiny.toml", "--dry-run"],
                       cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def heavy_imports() -> list:
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "bridge_hpc.cli.submit", "configs/local-tiny.toml",
                          "--dry-run"], cwd=ROOT, capture_output=True, text=True, check=True)
    mods = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    return sorted(m for m in mods if m.split(".")[0] in ("torch", "megatron", "nvidia_resiliency_ext"))


def wait_started(run_dir: Path, job_id: str, timeout: float = 60.0) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = sorted(run_dir.glob(f"started.{job_id}.*"))
        if found:
            return min(float(p.read_text()) for p in found)
        time.sleep(0.02)
    raise TimeoutError(f"job {job_id} did not start within {timeout} s")


def wait_gone(job_id: str) -> None:
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
        time.sleep(0.1)


def submit_latencies(n: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bridge-bench-"))
    rank = work / "rank"
    rank.write_text(RANK.format(python=sys.executable))
    rank.chmod(0o755)
    doc = {"job": {"name": "bench", "python": str(rank), "run_dir": str(work / "run")},
           "slurm": {"time": "00:05:00", "ntasks_per_node": 1},
           "train": {"train_iters": 1, "micro_batch_size": 1, "global_batch_size": 1}, "optimizer": {"lr": 1e-3}}
    (work / "job.toml").write_text(toml.dumps(doc))
    run_dir = work / "run"
    out = {"bridge-submit": [], "sbatch": []}
    for i in range(n):
        for how in ("bridge-submit", "sbatch"):
            t0 = time.time()
            if how == "bridge-submit":
                res = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(work / "job.toml")],
                                     capture_output=True, text=True, check=True)
                job_id = res.stdout.split()[2]
            else:
                res = subprocess.run(["sbatch", "--parsable", str(run_dir / "job.sbatch")], capture_output=True,
                                     text=True, check=True)
                job_id = res.stdout.strip().split(";")[0]
            out[how].append(wait_started(run_dir, job_id) - t0)
            wait_gone(job_id)
        print(f"  round {i + 1}/{n}: bridge-submit {out['bridge-submit'][-1]:.3f} s, sbatch {out['sbatch'][-1]:.3f} s",
              flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "submit_latency.json"))
    p.add_argument("--no-cluster", action="store_true", help="only the dry-run part")
    args = p.parse_args()

    print("dry-run wall time ...", flush=True)
    dry = dry_run_times(max(5, args.rounds))
    heavy = heavy_imports()
    rows = [("bridge-submit --dry-run, median", f"{statistics.median(dry):.3f} s", "< 0.300 s",
             statistics.median(dry) < 0.3),
            ("heavy imports on the login path", ", ".join(heavy) or "none", "none", not heavy)]
    result = {"dry_run_s": dry, "heavy_imports": heavy}
    if not args.no_cluster:
        print("submit-to-running latency ...", flush=True)
        lat = submit_latencies(args.rounds)
        med = {k: statistics.median(v) for k, v in lat.items()}
        gap = med["bridge-submit"] - med["sbatch"]
        rows += [("plain sbatch -> first rank, median", f"{med['sbatch']:.3f} s", "", None),
                 ("bridge-submit -> first rank, median", f"{med['bridge-submit']:.3f} s", "", None),
                 ("bridge-submit minus sbatch", f"{gap:+.3f} s", "< +0.300 s", gap < 0.3)]
        result.update(latency_s=lat, median_s=med, gap_s=gap)
    print()
    print(f"{'measure':<40} {'value':>14}  {'target':>11}  ok")
    for name, value, target, ok in rows:
        print(f"{name:<40} {value:>14}  {target:>11}  {'' if ok is None else ('yes' if ok else 'NO')}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
