"""A user's forward step (Bridge's GPT step) whose C code takes SIGUSR1 from Python at one step, as
some library's C code did on the GPU fast path (tests/test_stop_signal_taken_back.py): through libc,
the process's handler for SIGUSR1 becomes SIG_IGN, while ``signal.getsignal`` still names Python's.

``TEST_TAKE_SIGUSR1_AT = "<step>"`` (the rank's environment): the step (of every run) at which it does
so; one line says the step.
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


def forward_step(state, data_iterator, model):
    step = state.train_state.step
    if not _taken and step >= int(os.environ["TEST_TAKE_SIGUSR1_AT"]):
        _taken.append(step)
        _libc.signal(signal.SIGUSR1, SIG_IGN)
        print(f"TEST TOOK SIGUSR1 at step {step}", flush=True)
    return gpt_forward_step(state, data_iterator, model)
