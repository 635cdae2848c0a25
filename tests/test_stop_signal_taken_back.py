"""A stop signal taken from Python by C code is taken back (``StopSignalRecorder.rearm``, every step).

Seen on an H200 (2026-11-29): a one-GPU job on the fast path trained on through SIGUSR1, Slurm's
preemption notice, while ``signal.getsignal`` still named the rank's recorder; the same job without the
fast path's Triton kernels and compiled fusions stopped and saved. LLVM's handlers, which Triton
registers when it is imported, take SIGUSR1 and do nothing with it. Triton cannot run on these CPU
machines, so these tests take the signal the way C code does (libc's ``signal``, behind Python's back)
and check that the recorder and the loop take it back, and that Triton is asked not to take it.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time

from bridge_test_helpers import ROOT, direct_rank_env, kill_tree, set_args, steps_done, tiny_checkpoints, tiny_job, tiny_run_dir

from bridge_hpc.contracts import run_folder
from bridge_hpc.training.process.signal_recorder import TRITON_STACKTRACE_SWITCH, StopSignalRecorder

TAKING_FORWARD_STEP = ROOT / "tests" / "data" / "signal_taking_forward_step.py"
SIG_IGN = 1  # <signal.h>'s ((sighandler_t) 1)
#: How long a rank may take from SIGUSR1 to its exit (a tiny CPU model's exit save: well under a second).
EXIT_WAIT_S = 120.0


def _take_behind_pythons_back(signum: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signum, SIG_IGN)


def _deliver(recorder: StopSignalRecorder, signum: int) -> None:
    """``signum`` to this process's main thread (this one), and a moment for Python's handler to run."""
    signal.pthread_kill(threading.main_thread().ident, signum)
    for _ in range(100):  # Python runs a handler between bytecodes: one of these
        if recorder.received is not None:
            return
        time.sleep(0.001)


def test_rearm_takes_back_a_signal_that_c_code_took_behind_pythons_back():
    recorder = StopSignalRecorder(["SIGUSR1"]).__enter__()
    try:
        _take_behind_pythons_back(signal.SIGUSR1)
        assert signal.getsignal(signal.SIGUSR1) == recorder._record  # Python cannot tell
        _deliver(recorder, signal.SIGUSR1)
        assert recorder.received is None  # ignored by the C handler: lost
        recorder.rearm()
        _deliver(recorder, signal.SIGUSR1)
        assert recorder.received == signal.SIGUSR1
    finally:
        recorder.release()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_rearm_leaves_a_handler_installed_after_the_recorder_alone():
    recorder = StopSignalRecorder(["SIGUSR1"]).__enter__()
    try:
        def later(signum, frame):
            pass

        signal.signal(signal.SIGUSR1, later)  # Python code that replaced it on purpose
        recorder.rearm()
        assert signal.getsignal(signal.SIGUSR1) is later
    finally:
        recorder.release()


def test_triton_is_asked_not_to_register_llvms_signal_handlers(monkeypatch):
    monkeypatch.delenv(TRITON_STACKTRACE_SWITCH, raising=False)
    StopSignalRecorder(["SIGUSR1"]).__enter__().release()
    assert os.environ[TRITON_STACKTRACE_SWITCH] == "1"
    monkeypatch.setenv(TRITON_STACKTRACE_SWITCH, "0")  # a user's own choice stands
    StopSignalRecorder(["SIGUSR1"]).__enter__().release()
    assert os.environ[TRITON_STACKTRACE_SWITCH] == "0"


def test_a_rank_whose_c_code_took_sigusr1_mid_run_still_stops_and_saves_on_it(tmp_path):
    """The rank's forward step takes SIGUSR1 at step 3 (as LLVM would on a first compile); SIGUSR1 after
    step 10 must still end the run through its exit save, with Triton's switch set in the rank."""
    job = tiny_job(tmp_path / "taken")
    overrides = [f"job.forward_step='{TAKING_FORWARD_STEP}:forward_step'", "train.train_iters=100000",
                 "train.eval_interval=100000", "checkpoint.save_interval=100000", "logger.log_interval=1"]
    env = {**direct_rank_env(), "PYTHONUNBUFFERED": "1", "TEST_TAKE_SIGUSR1_AT": "3"}
    env.pop(TRITON_STACKTRACE_SWITCH, None)
    rank = subprocess.Popen([sys.executable, "-m", "bridge_hpc.rank", *set_args(job, overrides)],
                            cwd=os.path.dirname(job), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        while steps_done(tiny_run_dir(job)) < 10 and rank.poll() is None:
            time.sleep(0.05)
        assert rank.poll() is None, rank.communicate()[0][-4000:]
        os.kill(rank.pid, signal.SIGUSR1)
        out, _ = rank.communicate(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        kill_tree(rank)
        raise AssertionError(f"the rank trained on through SIGUSR1 for {EXIT_WAIT_S:.0f} s") from None
    assert rank.returncode == 0, out[-4000:]
    assert f"TEST TOOK SIGUSR1 at step 3 ({TRITON_STACKTRACE_SWITCH}=1)" in out, out[-4000:]
    stopped = re.search(r"exiting at iteration (\d+): signal received", out)
    assert stopped, out[-4000:]
    assert 10 <= int(stopped[1]) < 100000
    assert run_folder.tracked_iteration(tiny_checkpoints(job)) == int(stopped[1])  # the exit save
