"""A rank's way out (``bridge_hpc.rank._leave``): ``os._exit`` once its outputs are durable.

A ``multiprocessing`` child that a library started, such as the write-results Manager that
megatron-core and nvidia-resiliency-ext start with *spawn* inside a save, must not outlive the rank.
An orphan would hold the job's output open, and whoever reads that output to its end would wait
forever. On a GPU host, a torchrun job under ``subprocess.run`` never ended that way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

RANK = """
import multiprocessing, sys
from bridge_hpc import rank
manager = multiprocessing.get_context("spawn").Manager()  # as a library's save starts one
results = manager.Queue()
results.put("write results")
print(manager._process.pid, flush=True)
rank._leave(0)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # ended, not yet reaped
    except FileNotFoundError:
        return True


def test_a_manager_started_by_a_library_does_not_outlive_the_rank():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = rank.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(rank.pid, signal.SIGKILL)  # the rank's own process group: the rank and what it started
        rank.communicate()
        pytest.fail("the rank's output stayed open after it left: a child process outlived it")
    assert rank.returncode == 0, err[-3000:]
    manager_pid = int(out.split()[0])
    deadline = time.time() + 10
    while not _gone(manager_pid) and time.time() < deadline:
        time.sleep(0.05)
    assert _gone(manager_pid), f"the Manager (pid {manager_pid}) is still running after its rank left"
