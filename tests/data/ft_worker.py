"""A tiny stand-in for the training loop, for tests/test_fault_tolerance.py and the FT benchmark.

Started by ft_launcher (or torchrun) with gloo ranks on CPU. It drives
``bridge_hpc.training.resilience.fault_tolerance.FaultTolerance`` exactly as the loop is meant to, and writes:

  <out>/steps_rank<r>.txt     one line per finished step: "<restart> <iteration> <epoch time>"
  <out>/start_rank<r>.jsonl   one JSON line per process start: restart count, start time, resumed
                              iteration, FT mode, seconds lost (in-job restart), timeouts after setup
  <out>/done_rank<r>.json     at the normal end: timeouts in force, restart count, steps run
  <out>/ckpt/                 "checkpoint": iteration + FT state (rank 0), ft_state.json
"""

import argparse
import json
import os
import sys
import time

T0 = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bridge_hpc.training.config import FaultToleranceConfig  # noqa: E402
from bridge_hpc.training.resilience.fault_tolerance import FaultTolerance  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--first-step-time", type=float, default=None)  # each worker group's first step (warm-up)
    p.add_argument("--save-interval", type=int, default=0)
    p.add_argument("--save-time", type=float, default=0.0)
    p.add_argument("--fault", default="none")  # rank_hung | rank_killed | random | none
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-delay", type=int, default=0)
    p.add_argument("--calc-timeouts", action="store_true")
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--min-timeout", type=float, default=1.0)
    p.add_argument("--no-ft", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = os.path.join(args.out, "ckpt")
    cfg = FaultToleranceConfig(
        enable_ft_package=not args.no_ft,
        calc_ft_timeouts=args.calc_timeouts,
        simulate_fault=args.fault != "none",
        simulated_fault_type=args.fault if args.fault != "none" else "random",
        simulated_fault_rank=args.fault_rank,
        simulated_fault_base_delay=args.fault_delay,
    )
    ft = FaultTolerance(cfg, checkpoint_dir=ckpt, min_iters_for_step_timeout=args.min_iters,
                        progress_mark_interval_s=0.5, min_computed_timeout_s=args.min_timeout)
    ft.setup()

    # "load the checkpoint"
    iteration = 0
    meta_path = os.path.join(ckpt, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        iteration = meta["iteration"]
        ft.load_state_dict(meta.get("fault_tolerance"))
        ft.on_checkpoint_loaded()
    with open(os.path.join(args.out, f"start_rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"restart": ft.restart_count, "t0": T0, "iteration": iteration, "mode": ft.mode,
                            "lost_s": ft.seconds_lost_before_restart(), "timeouts": ft.timeouts()}) + "\n")

    steps_file = open(os.path.join(args.out, f"steps_rank{rank}.txt"), "a", buffering=1)
    x = torch.ones(4)
    first = True
    while iteration < args.steps:
        ft.step_start(iteration)
        ft.maybe_simulate_fault(iteration)
        dist.all_reduce(x)
        x.fill_(1.0)
        time.sleep(args.first_step_time if first and args.first_step_time is not None else args.step_time)
        first = False
        ft.step_end(iteration)
        iteration += 1
        steps_file.write(f"{ft.restart_count} {iteration} {time.time():.3f}\n")
        if args.save_interval and iteration % args.save_interval == 0:
            with ft.checkpointing():
                time.sleep(args.save_time)
                dist.barrier()
                if rank == 0:
                    tmp = meta_path + ".tmp"
                    os.makedirs(ckpt, exist_ok=True)
                    with open(tmp, "w") as f:
                        json.dump({"iteration": iteration, "fault_tolerance": ft.state_dict()}, f)
                    os.replace(tmp, meta_path)
                dist.barrier()
    timeouts = ft.timeouts()
    ft.shutdown()
    with open(os.path.join(args.out, f"done_rank{rank}.json"), "w") as f:
        json.dump({"restart_count": ft.restart_count, "timeouts_before_shutdown": timeouts,
                   "state": (json.load(open(meta_path)) if os.path.exists(meta_path) else None),
                   "iteration": iteration}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
