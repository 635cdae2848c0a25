"""A user's forward step (``[job] forward_step = "tests/data/faulty_forward_step.py:forward_step"``)
that misbehaves on purpose, for the fault-tolerance and straggler tests on the local cluster.

It is Bridge's GPT step (the same numerics, so losses stay comparable with an untouched run) plus
faults chosen by environment variables (set through the job's ``[env]``), each for one Slurm run of
the job (``SLURM_RESTART_COUNT``) and the first worker group of that run (``TORCHELASTIC_RESTART_COUNT``
= 0 under ft_launcher), so the run after it can be seen to succeed:

* ``TEST_HANG = "<slurm restart>:<step>:<rank>"``: that rank stops at that step, inside the training
  step (as a dead-locked kernel would), and never comes back.
* ``TEST_SLOW = "<slurm restart>:<from step>:<rank>:<seconds>"``: from that step on, that rank burns
  this much CPU before each of its forward passes (a slow or throttled processor).
* ``TEST_STEP_SLEEP = "<seconds>"``: every rank, in every run, sleeps this long before each forward
  pass (a slower machine: a floor under the step time, so that a test can count on a time limit
  being reached however fast the machine is).
* ``TEST_SAVE_DELAY = "<seconds>"``: every checkpoint save takes this much longer (a slow file
  system: a save longer than the FT step timeout, which must not be taken for a hang). The rank's
  ``checkpointing.save_checkpoint`` is wrapped when this module is imported.

Each fault prints one line with its wall-clock time, which the tests read.
"""

import os
import time

from bridge_hpc.training import checkpointing
from bridge_hpc.training.gpt import forward_step as gpt_forward_step

if float(os.environ.get("TEST_SAVE_DELAY", "0") or 0) > 0:
    _real_save = checkpointing.save_checkpoint

    def _slow_save(*args, **kwargs):
        result = _real_save(*args, **kwargs)
        time.sleep(float(os.environ["TEST_SAVE_DELAY"]))
        return result

    checkpointing.save_checkpoint = _slow_save


_announced = []


def _this_run(slurm_restart: str) -> bool:
    return (os.environ.get("SLURM_RESTART_COUNT", "0") == slurm_restart
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def _parse(name: str):
    value = os.environ.get(name)
    return value.split(":") if value else None


def _burn(seconds: float) -> None:
    start = time.thread_time()
    x = 0
    while time.thread_time() - start < seconds:
        x += 1


def forward_step(state, data_iterator, model):
    step, rank = state.train_state.step, state.rank
    hang = _parse("TEST_HANG")
    if hang and _this_run(hang[0]) and step == int(hang[1]) and rank == int(hang[2]):
        print(f"TEST HANG rank {rank} step {step} at {time.time():.3f}", flush=True)
        while True:
            time.sleep(3600)
    slow = _parse("TEST_SLOW")
    if slow and _this_run(slow[0]) and step >= int(slow[1]) and rank == int(slow[2]):
        if not _announced:
            _announced.append(step)
            print(f"TEST SLOW rank {rank} from step {step} at {time.time():.3f}", flush=True)
        _burn(float(slow[3]))
    time.sleep(float(os.environ.get("TEST_STEP_SLEEP", "0")))
    return gpt_forward_step(state, data_iterator, model)
