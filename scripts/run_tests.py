"""``make test``: the suite as two pytest runs side by side, the Slurm tests in one, the rest in the other.

Why two: the Slurm tests share one local cluster of 2 CPUs (one job of 2 ranks fills it), reconfigure its
node count and read its queue, so they run one after another; about half of their time the machine's cores
are idle while they wait on Slurm (time limits, warning signals, requeues, fault-tolerance timeouts:
53 % busy on 2026-11-29, measured from /proc/stat over each test). The other tests need no cluster and fill
that time. Each run keeps its module fixtures and its order, as a plain ``pytest tests`` run does
(``tests/conftest.py``'s ``--part`` chooses the tests; ``make test-serial`` runs all in one pytest). pytest-xdist's
groups would do the same, but its group ids do not survive pytest 9.2's node ids.

Usage: ``python scripts/run_tests.py [pytest arguments...]`` (``make test`` passes ``-q tests``). Each line
of either run is printed as it comes, after ``[slurm]`` or ``[rest] ``, and once a minute a line says how
many tests each has finished (pytest's quiet output completes a line per 72 tests); the exit status is the first
failing run's (a part with no test collected counts as passed when the other ran tests). Ctrl-C or
SIGTERM is passed on to both runs, which are waited for. At the end, each part's failed tests (pytest's
``FAILED``/``ERROR`` summary lines) are printed again, so that the last lines of a log name them all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Sequence

PARTS = ("slurm", "rest")
#: pytest's exit status when no test was collected (a part that a file selection leaves empty)
NO_TESTS_COLLECTED = 5


#: the characters pytest's quiet progress writes, one per test (passed, failed, error, skipped, xfail, xpass)
RESULT_CHARS = frozenset(".FEsxX")
#: the starts of pytest's short summary lines for a failed test; a log's tail shows only the last lines,
#: so they are printed again at the end, whichever part they came from
SUMMARY_STARTS = ("FAILED ", "ERROR ")
#: how often a line says how many tests each part has finished (pytest writes a line per 72 tests)
PROGRESS_EVERY_S = 60.0


class ProgressCount:
    """Tests finished and failed, from pytest's quiet output as it comes: the result characters at the start
    of a line (``..F.s [ 12%]``), until the summary (its first line starts with ``=``)."""

    def __init__(self) -> None:
        self.finished = 0
        self.failed = 0
        self._line_start = True
        self._in_results = True
        self._summary = False

    def feed(self, text: str) -> None:
        for char in text:
            if self._summary:
                return
            if char == "\n":
                self._line_start = self._in_results = True
                continue
            if self._line_start and char == "=":
                self._summary = True
            elif self._in_results and char in RESULT_CHARS:
                self.finished += 1
                self.failed += char in "FE"
            else:
                self._in_results = False
            self._line_start = False


class Part:
    """One pytest run: its process, and its progress as its output says."""

    def __init__(self, name: str, argv: Sequence[str]) -> None:
        self.name = name
        self.prefix = f"[{name}]".ljust(8)
        self.proc = subprocess.Popen([sys.executable, "-m", "pytest", f"--part={name}", *argv],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.progress = ProgressCount()
        self.seconds = None
        #: pytest's short summary lines (``FAILED ...``, ``ERROR ...``), printed again once both parts end
        self.failures: List[str] = []

    def relay(self, lock: threading.Lock) -> None:
        """Each complete line, after the part's name."""
        pending = b""
        while True:
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                break
            self.progress.feed(chunk.decode(errors="replace"))
            pending += chunk
            *lines, pending = pending.split(b"\n")
            with lock:
                for line in lines:
                    text = line.decode(errors="replace")
                    if text.startswith(SUMMARY_STARTS):
                        self.failures.append(text)
                    sys.stdout.write(self.prefix + text + "\n")
                sys.stdout.flush()
        if pending:
            with lock:
                sys.stdout.write(self.prefix + pending.decode(errors="replace") + "\n")


def overall_status(codes: Sequence[int]) -> int:
    """The first failing part's status; a part with nothing collected passes beside a part that ran."""
    failing = [code for code in codes if code not in (0, NO_TESTS_COLLECTED)]
    if failing:
        return failing[0]
    return NO_TESTS_COLLECTED if all(code == NO_TESTS_COLLECTED for code in codes) else 0


def main(argv: List[str]) -> int:
    lock = threading.Lock()
    started = time.monotonic()
    parts = [Part(name, argv) for name in PARTS]

    def pass_on(signum, _frame):
        for part in parts:
            if part.proc.poll() is None:
                part.proc.send_signal(signum)

    signal.signal(signal.SIGINT, pass_on)
    signal.signal(signal.SIGTERM, pass_on)
    relays = [threading.Thread(target=part.relay, args=(lock,), daemon=True) for part in parts]
    for relay in relays:
        relay.start()
    next_progress = started + PROGRESS_EVERY_S
    while any(part.seconds is None for part in parts):
        for part in parts:
            if part.seconds is None and part.proc.poll() is not None:
                part.seconds = time.monotonic() - started
        if time.monotonic() >= next_progress:
            next_progress += PROGRESS_EVERY_S
            with lock:
                print("run_tests: " + "; ".join(
                    f"{part.name} {part.progress.finished} tests done ({part.progress.failed} failed)"
                    + ("" if part.seconds is None else ", ended") for part in parts)
                    + f" after {(time.monotonic() - started) / 60:.0f} min", flush=True)
        time.sleep(0.5)
    for relay in relays:
        relay.join()
    for part in parts:
        for failure in part.failures:
            print(f"run_tests: {part.name} part: {failure}")
    for part in parts:
        print(f"run_tests: {part.name} part exit status {part.proc.returncode} after {part.seconds / 60:.1f} min")
    status = overall_status([part.proc.returncode for part in parts])
    print(f"run_tests: exit status {status} after {(time.monotonic() - started) / 60:.1f} min")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
