"""A tiny loop for the CPU straggler test: ranks of a gloo group, rank --slow-rank made slower from
step --slow-from on. Writes <out>/straggler_rank<r>.json (the reports seen and where it stopped).
Started with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment."""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bridge_hpc.training.config import NVRxStragglerDetectionConfig  # noqa: E402
from bridge_hpc.training.resilience.straggler import StragglerDetector  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--slow-from", type=int, default=10)
    p.add_argument("--interval", type=int, default=5)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = NVRxStragglerDetectionConfig(enabled=True, stop_if_detected=True, report_time_interval=1.0)
    det = StragglerDetector(cfg, backend="auto", interval_steps=args.interval)
    det.setup()
    reports = []
    stopped_at = None
    x = torch.ones(2)
    for iteration in range(args.steps):
        det.step_start()
        slow = rank == args.slow_rank and iteration >= args.slow_from
        time.sleep(args.step_time * (args.slow_factor if slow else 1.0))
        det.step_end()
        dist.all_reduce(x)  # the gradient all-reduce: outside the timed compute
        stop = det.check(iteration)
        if det.last_report is not None and (not reports or reports[-1]["iteration"] != det.last_report.iteration):
            reports.append(det.last_report.to_dict())
        if stop:
            stopped_at = iteration
            break
    det.shutdown()
    with open(os.path.join(args.out, f"straggler_rank{rank}.json"), "w") as f:
        json.dump({"backend": "steptime" if reports and reports[-1]["backend"] == "steptime" else None,
                   "reports": reports, "stopped_at": stopped_at}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
