"""The checkpoint interval against unwarned interruptions: a simulation (CPU, seconds), no training.

A job must train ``--interruptions`` (2,000) mean times between interruptions of its trace, in steps of
``--step-s`` seconds (1 s). Unwarned
interruptions (node failures, OOM kills, hangs: the runs that end with no exit save) come from a trace
in allocated time; each costs a restart (``--restart-s``, the same whatever the interval) and the
training since the last *durable* checkpoint. A save blocks training for its cost; an asynchronous one is
durable ``--async-write-s`` after its blocking part, and one that comes due while the previous one is
still being written waits for it. Warned preemptions are left out: the exit save covers them, at the
same cost whatever the interval.

Traces (seeded): Poisson with a mean time between unwarned interruptions of 30 min, 4 h and 24 h, and
a bursty one (4 h on average: bursts of 6 interruptions about 10 min apart, the bursts Poisson 24 h
apart: a bad node until it is drained). Save costs: the GPU figures of the 370 M GPT (benchmarks/README.md: an
asynchronous save blocks 0.3 s and is written in ~6 s; the synchronous exit save 4 s) and a slow file
system (30 s, synchronous).

For each trace and save cost the lost time (allocated time less the work and the restarts: saves plus
work lost at interruptions) of

- every fixed interval from 10 to 5,000 steps (every step to 100, every 10 to 1,000, every 50 after):
  the best in hindsight, and 100 and 1,000, the intervals users commonly pick;
- ``"auto"``: :func:`bridge_hpc.contracts.save_interval.choose` -- the product's rule function, imported,
  not a copy -- applied on every (re)start to the history so far as the ranks read it from
  progress.txt (save costs, unwarned interruptions per allocated hour, step time), starting from no
  history (its defaults) and no ``[cluster]`` prior;
- an overhead bound as CheckFreq (FAST '21) sets it: the shortest interval whose saves cost at most
  3.5 % of the training time, blind to the interruption rate.

Prints the table and writes JSON (``--out``, default benchmarks/results/save_interval.json).
Run: ``python benchmarks/save_interval.py`` (about a minute on 2 busy cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bridge_hpc.contracts import save_interval as rule  # noqa: E402  (the product's rule, not a copy)

HOUR = 3600.0
FIXED = tuple(range(10, 100)) + tuple(range(100, 1000, 10)) + tuple(range(1000, 5001, 50))
COMMON = (100, 1000)
CHECKFREQ_OVERHEAD = 0.035


@dataclass(frozen=True)
class SaveCost:
    name: str
    blocking_s: float  # what a save holds training up
    write_s: float  # after that, until it is durable (0: synchronous)


SAVE_COSTS = (SaveCost("async 0.3 s (GPU)", 0.3, 6.0), SaveCost("sync 4 s (GPU exit save)", 4.0, 0.0),
              SaveCost("sync 30 s (slow FS)", 30.0, 0.0))


def poisson_trace(mtbf_s: float, horizon_s: float, rng: random.Random) -> List[float]:
    t, out = 0.0, []
    while t < horizon_s:
        t += rng.expovariate(1.0 / mtbf_s)
        out.append(t)
    return out


def bursty_trace(horizon_s: float, rng: random.Random, burst: int = 6, gap_s: float = 600.0,
                 between_s: float = 24 * HOUR) -> List[float]:
    """Bursts of ``burst`` interruptions ``gap_s`` apart on average, the bursts ``between_s`` apart."""
    t, out = 0.0, []
    while t < horizon_s:
        t += rng.expovariate(1.0 / between_s)
        for _ in range(burst):
            out.append(t)
            t += rng.expovariate(1.0 / gap_s)
    return out


#: (name, mean time between unwarned interruptions): the work each trace's job needs is
#: ``--interruptions`` of these, so that every trace holds about as many interruptions.
TRACES = (("Poisson, MTBF 30 min", 0.5 * HOUR), ("Poisson, MTBF 4 h", 4 * HOUR), ("Poisson, MTBF 24 h", 24 * HOUR),
          ("bursty, MTBF 4 h", 4 * HOUR))


def trace_of(name: str, mtbf_s: float, horizon_s: float, rng: random.Random) -> List[float]:
    return bursty_trace(horizon_s, rng) if name.startswith("bursty") else poisson_trace(mtbf_s, horizon_s, rng)


class RunningHistory(rule.History):
    """The product's History, its totals kept as runs are added (the same values; the rule reads them
    once per start, and a trace has thousands of starts)."""

    def __init__(self):
        super().__init__()
        self._allocated, self._unwarned = 0.0, 0

    def add(self, run: rule.RunSpan) -> None:
        self.runs.append(run)
        self._allocated += run.duration_s
        self._unwarned += run.unwarned

    @property
    def allocated_s(self) -> float:
        return self._allocated

    @property
    def unwarned(self) -> int:
        return self._unwarned


@dataclass
class Outcome:
    allocated_s: float
    lost_s: float  # allocated less work less restarts: saves and lost work
    interruptions: int
    intervals: List[int]


def simulate(trace: Sequence[float], cost: SaveCost, work_s: float, step_s: float, restart_s: float,
             interval: Optional[int] = None) -> Outcome:
    """One job through ``trace``: a fixed ``interval`` in steps, or None for ``"auto"`` (the product's rule
    on the history so far, chosen again on every start)."""
    done = 0.0  # durable training seconds
    t = 0.0  # allocated seconds
    restarts_s = 0.0
    history = RunningHistory()
    used: List[int] = []
    k = 0  # next interruption
    first_run = True
    while True:
        start = t
        next_fail = trace[k] if k < len(trace) else math.inf
        if interval is None:
            choice = rule.choose(history, async_save=cost.write_s > 0)
            if choice.interval is None:  # the first run times its first steps: the step time is step_s
                choice = choice.with_step(step_s, "timed")
            every_steps = choice.interval
        else:
            every_steps = interval
        used.append(every_steps)
        w = every_steps * step_s
        # blocking per save: its cost, plus the wait for the previous background write still running
        b = cost.blocking_s + max(0.0, cost.write_s - w) if cost.write_s > 0 else cost.blocking_s
        lag = cost.write_s
        restart = 0.0 if first_run else restart_s
        first_run = False
        left = work_s - done
        saves_before_end = max(math.ceil(left / w) - 1, 0)
        finish = start + restart + left + saves_before_end * b
        if finish <= next_fail:
            restarts_s += restart
            t = finish
            history.add(rule.RunSpan(start, t, True, start + restart, False))
            history.interval_save_costs += [b] * min(saves_before_end, rule.RECENT_SAVES)
            break
        # interrupted at next_fail
        restarts_s += min(restart, next_fail - start)
        trained_for = next_fail - start - restart  # allocated time after the restart
        trained = trained_for > 0
        durable_saves = 0
        if trained:
            durable_saves = max(0, math.floor((trained_for - lag) / (w + b)))
            durable_saves = min(durable_saves, saves_before_end)
            taken = min(int(trained_for // (w + b)), saves_before_end)
            history.interval_save_costs += [b] * min(taken, rule.RECENT_SAVES)
        done += durable_saves * w
        t = next_fail
        k += 1
        history.add(rule.RunSpan(start, t, trained, start + restart if trained else None, trained))
        history.step_s = step_s
        del history.interval_save_costs[:-rule.RECENT_SAVES]
    return Outcome(t, t - work_s - restarts_s, k, used)


def checkfreq_interval(cost: SaveCost, step_s: float) -> int:
    """The shortest interval whose saves cost at most 3.5 % of the training time (CheckFreq's bound)."""
    return max(1, math.ceil(cost.blocking_s / (CHECKFREQ_OVERHEAD * step_s)))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--interruptions", type=int, default=2000,
                   help="the training each trace's job needs, in mean times between interruptions: about this many "
                        "unwarned interruptions per trace, so that the best fixed interval in hindsight is not "
                        "the luck of a few")
    p.add_argument("--step-s", type=float, default=1.0, help="seconds per step")
    p.add_argument("--restart-s", type=float, default=12.0, help="seconds a restart costs (start-up and load)")
    p.add_argument("--seed", type=int, default=37)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "save_interval.json"))
    args = p.parse_args(argv)
    began = time.perf_counter()
    rng = random.Random(args.seed)
    rows = []
    for trace_name, mtbf in TRACES:
        work = args.interruptions * mtbf
        trace = trace_of(trace_name, mtbf, 3 * work, rng)
        for cost in SAVE_COSTS:
            fixed = {n: simulate(trace, cost, work, args.step_s, args.restart_s, n).lost_s for n in FIXED}
            best = min(fixed, key=fixed.get)
            auto = simulate(trace, cost, work, args.step_s, args.restart_s)
            cf_n = checkfreq_interval(cost, args.step_s)
            cf = simulate(trace, cost, work, args.step_s, args.restart_s, cf_n)
            worst_common = max(COMMON, key=lambda n: fixed[n])
            rows.append({
                "trace": trace_name, "save_cost": cost.name, "work_h": work / HOUR, "interruptions": auto.interruptions,
                "best_fixed": best, "best_fixed_lost_h": fixed[best] / HOUR,
                "auto_lost_h": auto.lost_s / HOUR, "auto_vs_best": auto.lost_s / fixed[best],
                "auto_intervals": {"first": auto.intervals[0], "last": auto.intervals[-1],
                                   "median": sorted(auto.intervals)[len(auto.intervals) // 2]},
                "fixed_100_lost_h": fixed[100] / HOUR, "fixed_1000_lost_h": fixed[1000] / HOUR,
                "worst_common": worst_common,
                "auto_less_than_worst_common": 1.0 - auto.lost_s / fixed[worst_common],
                "checkfreq_interval": cf_n, "checkfreq_lost_h": cf.lost_s / HOUR,
                "auto_goodput": work / auto.allocated_s,
            })
    seconds = time.perf_counter() - began
    header = ("| trace | save cost | unwarned | best fixed (lost h) | auto: lost h, vs best | auto's interval "
              "first / median / last | 100 | 1,000 | auto vs the worse of 100, 1,000 | CheckFreq 3.5 % (lost h) |")
    print(header)
    print("| " + " | ".join(["---"] * 10) + " |")
    for r in rows:
        ai = r["auto_intervals"]
        print(f"| {r['trace']} | {r['save_cost']} | {r['interruptions']} | {r['best_fixed']} ({r['best_fixed_lost_h']:.1f}) "
              f"| {r['auto_lost_h']:.1f}, {100 * (r['auto_vs_best'] - 1):+.1f} % | {ai['first']} / {ai['median']} / {ai['last']} "
              f"| {r['fixed_100_lost_h']:.1f} | {r['fixed_1000_lost_h']:.1f} "
              f"| {100 * r['auto_less_than_worst_common']:.0f} % less than {r['worst_common']} "
              f"| {r['checkfreq_interval']} ({r['checkfreq_lost_h']:.1f}) |")
    worst = max(r["auto_vs_best"] for r in rows)
    print(f"\nauto vs the best fixed interval in hindsight: at most {100 * (worst - 1):+.1f} % (target <= +3 %); "
          f"{len(FIXED)} fixed intervals per trace; {seconds:.1f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"command": "python benchmarks/save_interval.py " + " ".join(argv or sys.argv[1:]),
                   "interruptions_target": args.interruptions, "step_s": args.step_s, "restart_s": args.restart_s,
                   "seed": args.seed,
                   "save_costs": [c.__dict__ for c in SAVE_COSTS], "fixed_intervals": [FIXED[0], FIXED[-1], len(FIXED)],
                   "rows": rows, "auto_worst_vs_best": worst, "seconds": seconds}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
