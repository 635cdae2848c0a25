"""A user's forward step (Bridge's GPT step) whose C code takes SIGUSR1 from Python at one step, as
some library's C code did on the GPU fast path (tests/test_stop_signal_taken_back.py): through libc,
the process's handler for SIGUSR1 becomes SIG_IGN, while ``signal.getsignal`` still names Python's.

``TEST_TAKE_SIGUSR1_AT = "<step>"`` (the rank's environment): the training step (of every run) at which it
does so; ``"eval"``: the first evaluation batch instead. One line says where; in an evaluation, another
after 20 more of its micro-batches (the loop has checked its signals since).
"""

import ctypes
import os
import signal

from bridge_hpc.training.engine.model import forward_step as gpt_forward_step

_libc = ctypes.CDLL(None, use_errno=True)
_libc.signal.restype = ctypes.c_void_p
_libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
SIG_IGN = 1  # <signal.h>'s SIG_IGN, ((sighandler_t) 1)
_taken = []
_since = []


def forward_step(state, data_iterator, model):
    step, at = state.train_state.step, os.environ["TEST_TAKE_SIGUSR1_AT"]
    in_evaluation = not model.training
    if not _taken and (in_evaluation if at == "eval" else (not in_evaluation and step >= int(at))):
        _taken.append(step)
        _libc.signal(signal.SIGUSR1, SIG_IGN)
        print(f"TEST TOOK SIGUSR1 {'in the evaluation after' if in_evaluation else 'at'} step {step}", flush=True)
    elif _taken and in_evaluation and at == "eval":
        _since.append(step)
        if len(_since) == 20:
            print("TEST 20 EVALUATION MICRO-BATCHES SINCE", flush=True)
    return gpt_forward_step(state, data_iterator, model)
