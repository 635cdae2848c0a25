"""``make test``: the suite as two pytest runs side by side, the Slurm tests in one, the rest in the other.

Why two: the Slurm tests share one local cluster of 2 CPUs (one job of 2 ranks fills it), reconfigure its
node count and read its queue, so they run one after another; most of their time is waiting on Slurm
(time limits, warning signals, requeues). The other tests need no cluster and fill that time. Each run
keeps its module fixtures and its order, as a plain ``pytest tests`` run does (``tests/conftest.py``'s
``--part`` chooses the tests). pytest-xdist's groups would do the same, but its group ids do not survive
pytest 9.2's node ids.

Usage: ``python scripts/run_tests.py [pytest arguments...]`` (``make test`` passes ``tests``). Each line
of either run is printed as it comes, after ``[slurm]`` or ``[rest] ``; the exit status is the first
failing run's (a part with no test collected counts as passed when the other ran tests). Ctrl-C or
SIGTERM is passed on to both runs, which are waited for.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import List, Sequence

PARTS = ("slurm", "rest")
#: pytest's exit status when no test was collected (a part that a file selection leaves empty)
NO_TESTS_COLLECTED = 5


def _relay(part: str, proc: subprocess.Popen, lock: threading.Lock) -> None:
    prefix = f"[{part}]".ljust(8)
    for line in proc.stdout:
        with lock:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()


def overall_status(codes: Sequence[int]) -> int:
    """The first failing part's status; a part with nothing collected passes beside a part that ran."""
    failing = [code for code in codes if code not in (0, NO_TESTS_COLLECTED)]
    if failing:
        return failing[0]
    return NO_TESTS_COLLECTED if all(code == NO_TESTS_COLLECTED for code in codes) else 0


def main(argv: List[str]) -> int:
    lock = threading.Lock()
    started = time.monotonic()
    procs = {part: subprocess.Popen([sys.executable, "-m", "pytest", f"--part={part}", *argv],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
             for part in PARTS}

    def pass_on(signum, _frame):
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGINT, pass_on)
    signal.signal(signal.SIGTERM, pass_on)
    relays = [threading.Thread(target=_relay, args=(part, proc, lock), daemon=True) for part, proc in procs.items()]
    for relay in relays:
        relay.start()
    seconds = {}
    waiting = dict(procs)
    while waiting:
        for part, proc in list(waiting.items()):
            if proc.poll() is not None:
                seconds[part] = time.monotonic() - started
                del waiting[part]
        time.sleep(0.5)
    for relay in relays:
        relay.join()
    codes = [procs[part].returncode for part in PARTS]
    for part in PARTS:
        print(f"run_tests: {part} part exit status {procs[part].returncode} after {seconds[part] / 60:.1f} min")
    status = overall_status(codes)
    print(f"run_tests: exit status {status} after {(time.monotonic() - started) / 60:.1f} min")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
