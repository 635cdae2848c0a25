"""A user's forward step (``[job] forward_step = "tests/data/faulty_forward_step.py:forward_step"``)
that misbehaves on purpose, for the fault-tolerance and straggler tests on the local cluster.

It is Bridge's GPT step (the same numerics, so losses stay comparable with an untouched run) plus
faults chosen by environment variables (set through the job's ``[env]``), each for one Slurm run of
the job (``SLURM_RESTART_COUNT``) and the first worker group of that run (``TORCHELASTIC_RESTART_COUNT``
= 0 under ft_launcher), so the run after it can be seen to succeed:

* ``TEST_HANG = "<slurm restart>:<step>:<rank>"``: that rank stops at that step, inside the training
  step (as a dead-locked kernel would), and never comes back.
* ``TEST_KILL = "<slurm restart>:<step>:<rank>"``: that rank sends itself SIGKILL at that step (a
  process that dies: the launcher must see it), after whatever the steps before it saved, however
  long the job's start took.
* ``TEST_SLOW = "<slurm restart>:<from step>:<rank>:<seconds>"``: from that step on, that rank burns
  this much CPU before each of its forward passes (a slow or throttled processor).
* ``TEST_STEP_BURN = "<seconds>"``: every rank, in every run, burns this much CPU before each forward
  pass (a floor under each step's process CPU time, which the steptime straggler detector times: its
  report interval in steps is ``report_time_interval`` over that time, and on a fast machine a tiny
  GPT's steps cost so little CPU that no report would come before the run ends).
* ``TEST_STEP_SLEEP = "<seconds>"``: every rank, in every run, sleeps this long before each forward
  pass (a slower machine: a floor under the step time, so that a test can count on a time limit
  being reached however fast the machine is).
* ``TEST_HOLD = "<step>:<file>"``: every rank, in every run, waits at that step until the file exists
  (a test's gate: it acts while the job is known to be running mid-way, then lets it go on).
* ``TEST_HOLD_FOR_SIGNAL = "<step>"``: every rank, in the job's first run, waits at that step until its
  stop-signal recorder has a signal (a test's gate: it signals the job while it is known to be mid-run,
  and that step ends, and the ranks stop after it, only once the signal is in, however late it comes).
* ``TEST_SAVE_DELAY = "<seconds>"``: every checkpoint save takes this much longer (a slow file
  system: a save longer than the FT step timeout, which must not be taken for a hang). The rank's
  ``checkpointing.save_checkpoint`` is wrapped when this module is imported.
* ``TEST_BAD_LOSS = "<kind>:<step>:<rank>[:<factor>],..."``: that rank's training loss of that step
  (1-based: the step logged as ``iteration <step>``) is spoiled, for the result-validation tests
  (``[rerun_state_machine]``). ``nan`` / ``inf`` / ``spike`` (times ``factor``) spoil every attempt of
  the step in every run: a deterministic fault, which the step's re-run reproduces.
  ``transient_nan`` / ``transient_spike`` spoil only the first attempt in the job's first run (Slurm
  restart 0, first worker group), as a hardware fault would: the re-run gets the true loss.

Each fault prints one line with its wall-clock time, which the tests read.
"""

import os
import signal
import time

import torch

from bridge_hpc.training.checkpoint import checkpointing
from bridge_hpc.training.engine.model import forward_step as gpt_forward_step

if float(os.environ.get("TEST_SAVE_DELAY", "0") or 0) > 0:
    _real_save = checkpointing.save_checkpoint

    def _slow_save(*args, **kwargs):
        result = _real_save(*args, **kwargs)
        time.sleep(float(os.environ["TEST_SAVE_DELAY"]))
        return result

    checkpointing.save_checkpoint = _slow_save


_announced = []
#: (kind, step) of the transient faults this process has injected: the re-run of the step is spared.
_spoiled = set()


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
    kill = _parse("TEST_KILL")
    if kill and _this_run(kill[0]) and step == int(kill[1]) and rank == int(kill[2]):
        print(f"TEST KILL rank {rank} step {step} at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    slow = _parse("TEST_SLOW")
    if slow and _this_run(slow[0]) and step >= int(slow[1]) and rank == int(slow[2]):
        if not _announced:
            _announced.append(step)
            print(f"TEST SLOW rank {rank} from step {step} at {time.time():.3f}", flush=True)
        _burn(float(slow[3]))
    _burn(float(os.environ.get("TEST_STEP_BURN", "0")))
    time.sleep(float(os.environ.get("TEST_STEP_SLEEP", "0")))
    hold = os.environ.get("TEST_HOLD")
    if hold and step == int(hold.split(":", 1)[0]):
        while not os.path.exists(hold.split(":", 1)[1]):
            time.sleep(0.05)
    hold_for_signal = os.environ.get("TEST_HOLD_FOR_SIGNAL")
    if hold_for_signal and _this_run("0") and step == int(hold_for_signal):
        print(f"TEST HOLD FOR SIGNAL rank {rank} step {step} at {time.time():.3f}", flush=True)
        while state.signal_handler is None or state.signal_handler.received is None:
            time.sleep(0.05)
    output, loss_func = gpt_forward_step(state, data_iterator, model)
    for fault in filter(None, os.environ.get("TEST_BAD_LOSS", "").split(",")):
        kind, at, on_rank, *factor = fault.split(":")
        if int(at) != step + 1 or int(on_rank) != rank or not model.training:  # not an evaluation
            continue
        if kind.startswith("transient_"):
            if not _this_run("0") or (kind, step + 1) in _spoiled:
                continue
            _spoiled.add((kind, step + 1))
        print(f"TEST BAD LOSS {kind} rank {rank} step {step + 1} at {time.time():.3f}", flush=True)
        scale = {"nan": float("nan"), "inf": float("inf")}.get(kind.replace("transient_", ""))
        return output, _spoil(loss_func, scale if scale is not None else float(factor[0]))
    return output, loss_func


def _spoil(loss_func, scale: float):
    """The loss function with its loss (and reported loss) multiplied by ``scale``."""
    def spoiled(output_tensor):
        loss, num_tokens, report = loss_func(output_tensor)
        return loss * scale, num_tokens, {key: value * torch.tensor([scale, 1.0], device=value.device)
                                      for key, value in report.items()}

    return spoiled
