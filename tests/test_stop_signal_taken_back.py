"""A stop signal taken from Python by C code is taken back (``StopSignalRecorder.rearm``, every step).

Seen on an H200 (2026-11-29): one-GPU ranks on the fast path trained on through SIGUSR1, Slurm's
preemption notice, while ``signal.getsignal`` still named the rank's recorder; the same job without the
fast path's Triton kernels and compiled fusions stopped and saved. Some C code had replaced the
process's handler behind Python's back. These tests take the signal the way C code does (libc's
``signal``) and check that the recorder notices, takes it back and says which handler held it.
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
from bridge_hpc.training.process.signal_recorder import TAKEN_FROM_PYTHON, StopSignalRecorder, describe_handler, process_handler

TAKING_FORWARD_STEP = ROOT / "tests" / "data" / "signal_taking_forward_step.py"
SIG_IGN = 1  # <signal.h>'s ((sighandler_t) 1)
#: Bounds that only a broken run reaches: the tiny CPU model's steps take milliseconds, its exit save
#: well under a second.
STEPS_WAIT_S = 300.0
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


def test_rearm_takes_back_a_signal_that_c_code_took_and_says_so(capsys):
    recorder = StopSignalRecorder(["SIGUSR1"]).__enter__()
    try:
        recorder.rearm()  # nothing taken: nothing done, nothing said
        assert capsys.readouterr().err == ""
        _take_behind_pythons_back(signal.SIGUSR1)
        assert signal.getsignal(signal.SIGUSR1) == recorder._record  # Python cannot tell
        assert process_handler(signal.SIGUSR1) == SIG_IGN
        _deliver(recorder, signal.SIGUSR1)
        assert recorder.received is None  # ignored by the process's handler: lost
        recorder.rearm()
        assert f"warning: SIGUSR1 {TAKEN_FROM_PYTHON} SIG_IGN (ignored); taken back" in capsys.readouterr().err
        _deliver(recorder, signal.SIGUSR1)
        assert recorder.received == signal.SIGUSR1
        _take_behind_pythons_back(signal.SIGUSR1)
        recorder.rearm()  # taken back again, said once
        assert capsys.readouterr().err == "" and process_handler(signal.SIGUSR1) not in (None, SIG_IGN)
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


def test_a_process_handler_is_named_by_its_library():
    recorder = StopSignalRecorder(["SIGUSR1"]).__enter__()
    try:
        named = describe_handler(process_handler(signal.SIGUSR1))  # Python's own C handler
    finally:
        recorder.release()
    assert re.fullmatch(r"a handler in \S*(python|libpython)\S*( \(\S+\))?", named), named
    assert describe_handler(None) == "the default action (SIG_DFL)"


def _run_and_signal(tmp_path, take_at: str, ready, overrides=()) -> str:
    """A tiny rank whose forward step takes SIGUSR1 (``TEST_TAKE_SIGUSR1_AT``); SIGUSR1 once
    ``ready(log text)``; its output, after it has stopped with status 0 on the signal."""
    job = tiny_job(tmp_path / "taken")
    overrides = [f"job.forward_step='{TAKING_FORWARD_STEP}:forward_step'", "train.train_iters=100000",
                 "checkpoint.save_interval=100000", "logger.log_interval=1", *overrides]
    env = {**direct_rank_env(), "PYTHONUNBUFFERED": "1", "TEST_TAKE_SIGUSR1_AT": take_at}
    log = tmp_path / "rank.log"
    with open(log, "w") as sink:
        rank = subprocess.Popen([sys.executable, "-m", "bridge_hpc.rank", *set_args(job, overrides)],
                                cwd=os.path.dirname(job), env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + STEPS_WAIT_S
        while not ready(job, log.read_text()) and rank.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank.poll() is None and ready(job, log.read_text()), log.read_text()[-4000:]
        os.kill(rank.pid, signal.SIGUSR1)
        try:
            rank.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the rank trained on through SIGUSR1 for {EXIT_WAIT_S:.0f} s") from None
    finally:
        if rank.poll() is None:
            kill_tree(rank)
    out = log.read_text()
    assert rank.returncode == 0, out[-4000:]
    assert out.count(f"warning: SIGUSR1 {TAKEN_FROM_PYTHON} SIG_IGN (ignored); taken back") == 1, out[-4000:]
    stopped = re.search(r"exiting at iteration (\d+): signal received", out)
    assert stopped, out[-4000:]
    assert 0 < int(stopped[1]) < 100000
    assert run_folder.tracked_iteration(tiny_checkpoints(job)) == int(stopped[1])  # the exit save
    return out


def test_a_rank_whose_c_code_took_sigusr1_mid_run_still_stops_and_saves_on_it(tmp_path):
    """The rank's forward step takes SIGUSR1 at step 3; SIGUSR1 after step 10 must still end the run
    through its exit save, and the rank says once that the signal was taken back."""
    out = _run_and_signal(tmp_path, "3", lambda job, log: steps_done(tiny_run_dir(job)) >= 10,
                          ["train.eval_interval=100000"])
    assert "TEST TOOK SIGUSR1 at step 3" in out, out[-4000:]
    assert int(re.search(r"exiting at iteration (\d+)", out)[1]) >= 10


def test_c_code_that_takes_sigusr1_in_an_evaluation_does_not_hold_the_evaluation_on_it(tmp_path):
    """Taken at the first batch of a very long evaluation (20,000 batches after step 5); SIGUSR1 then
    cuts the evaluation short and ends the run through its exit save."""
    # signalled 20 micro-batches after the take: past the next batch's check, not between the two
    out = _run_and_signal(tmp_path, "eval", lambda job, log: "TEST 20 EVALUATION MICRO-BATCHES SINCE" in log,
                          ["train.eval_interval=5", "train.eval_iters=20000"])
    assert "TEST TOOK SIGUSR1 in the evaluation after step 5" in out, out[-4000:]
    assert re.search(r"evaluation cut short after \d+ micro-batches: stop signal received", out), out[-4000:]
    # step 5's stop observations were agreed before its evaluation: the exit comes after step 6
    assert int(re.search(r"exiting at iteration (\d+): signal received", out)[1]) == 6, out[-4000:]
