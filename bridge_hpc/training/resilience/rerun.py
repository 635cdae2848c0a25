"""megatron-core's rerun state machine in the loop: a bad loss is re-run on the same batch, then judged.

``[rerun_state_machine]`` (:class:`~bridge_hpc.training.config.RerunStateMachineConfig`, Megatron
Bridge's fields) drives megatron-core's :class:`~megatron.core.rerun_state_machine.RerunStateMachine`
the way Megatron does:

* :func:`init_rerun_state` makes the process's machine (Bridge's ``_init_rerun_state``);
* the loop wraps its train iterator in a ``RerunDataIterator``, which can replay a step's micro-batches;
* :func:`bridge_hpc.training.train.train_step` runs the forward/backward inside
  ``while machine.should_run_forward_backward(...)`` and asks ``should_checkpoint_and_exit()`` before
  the optimizer step;
* every micro-batch's training loss goes through :func:`validate_loss`: Bridge's three checks with
  Bridge's messages (NaN and Inf, fatal, with ``check_for_nan_in_loss``; spiky, not fatal, with
  ``check_for_spiky_loss``: at or above ``spiky_loss_factor`` x the largest of the first 100 losses).

With ``rerun_mode = "validate_results"`` a rejected loss makes every rank run the step again, with the
RNG states of the step's start and the same micro-batches. A result the re-run reproduces is
*deterministic* (a bad batch, a diverging model: running it again cannot help); one it does not is
*transient* (a fault of the hardware). Then:

* NaN or Inf loss (fatal), deterministic: the run stops with a checkpoint of the step before, its
  ``Ending job`` reason is ``nan_loss`` / ``inf_loss``, status 0 and no requeue;
* NaN or Inf loss, transient: the run stops with a checkpoint of the step before, reason
  ``transient_fault``, and asks for a requeue: the next run redoes the step;
* spiky loss (not fatal), either way: training goes on with the re-run's result.

Each re-run is reported on rank 0 (a stdout line and a ``Result validation`` line in the progress
log: step, check, diagnosis, ranks, action). The stop itself is an exit reason
(:func:`stop_reason`) that :func:`bridge_hpc.training.resilience.exit_policy.checkpoint_and_decide_exit`, the one
place that saves and stops, acts on.

Where this differs from Megatron: after a deterministic fatal result Megatron saves and exits with
status 16 so that the job, resumed on another GPU, re-runs the step once more there (telling a faulty
GPU from a correct result); after a transient one it exits with 17. Here a deterministic fault ends
the job (a re-run elsewhere would only repeat it: this is for a person to look at, and the checkpoint
of the last good step is there to resume from), and a transient one requeues through the batch
script, as a preemption does. So the machine's own state (which only that second re-run needs) is not
saved in checkpoints. A resumed run does not validate its first step (megatron-core's rule: it
validates only after one optimizer step of the process), and the spiky-loss window starts again.

On CPU: megatron-core's machine assumes CUDA (its all-reduce on a ``cuda`` tensor, the CUDA RNG, the GPU
index in its messages). :class:`BridgeRerunStateMachine` does the all-reduce on the communication
device and saves only the RNG states there are; and it clears the failed call of an earlier step at
each step's start, which megatron-core keeps (a rank whose earlier spiky loss matched that stale record
during a re-run asked for by another rank would turn the other rank's fatal fault into "go on").
Its ``report_determinism_stats`` report is rewritten too: megatron-core's fails (AttributeError).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.rerun_state_machine import (
    Caller,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
    RerunValidationStatus,
    _set_rerun_state_machine,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
)

from bridge_hpc.training.config import RerunStateMachineConfig
from bridge_hpc.training.engine.collectives import comm_device
from bridge_hpc.training.state import GlobalState

__all__ = ["RerunDataIterator", "BridgeRerunStateMachine", "init_rerun_state", "destroy_rerun_state",
           "validate_loss", "report_rerun", "stop_reason", "position_of"]

logger = logging.getLogger(__name__)

#: Megatron Bridge's ``validate_result`` messages for the loss checks -> the check's name.
NAN_MESSAGE = "found NaN in local forward loss calculation"
INF_MESSAGE = "found Inf in local forward loss calculation"
SPIKY_MESSAGE = "Spiky loss"
CHECKS = {NAN_MESSAGE: "nan_loss", INF_MESSAGE: "inf_loss", SPIKY_MESSAGE: "spiky_loss"}
#: The name of a check this module does not make (a user's own ``validate_result`` call).
OTHER_CHECK = "other"
CHECK_NAMES = ("nan_loss", "inf_loss", "spiky_loss", OTHER_CHECK)
DIAGNOSES = ("deterministic", "transient")
_DIAGNOSIS = {RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE: "deterministic",
              RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE: "transient"}

#: Exit reasons (the vocabulary of :func:`bridge_hpc.training.resilience.exit_policy.exit_reasons`) of a run that a
#: failed result validation stops. Deterministic ones are final; the transient one requeues.
EXIT_NAN_LOSS = "NaN loss"
EXIT_INF_LOSS = "Inf loss"
EXIT_INVALID_RESULT = "invalid result"
EXIT_TRANSIENT_FAULT = "transient fault"
_DETERMINISTIC_EXIT = {"nan_loss": EXIT_NAN_LOSS, "inf_loss": EXIT_INF_LOSS}


class BridgeRerunStateMachine(RerunStateMachine):
    """megatron-core's machine, runnable on CPU, that also keeps what this rank's step found.

    ``attempts``: forward/backward runs of the current step (2 after a re-run in place; the same on
    every rank, as the machine decides a re-run collectively). ``step_failures``: this rank's
    ``(check, diagnosis)`` of the current step, from the machine's own verdicts. ``stop``: the exit
    reason once the ranks agreed to stop (:func:`report_rerun`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attempts = 0
        self.step_failures: List[Tuple[str, str]] = []
        self.stop: Optional[str] = None

    def should_run_forward_backward(self, data_iterator) -> bool:
        if self.state == RerunState.NOT_RUNNING_YET:
            self.attempts = 0
            self.step_failures = []
            # megatron-core never clears these; a stale match would misjudge a later step (module docstring)
            self.failed_validation_call = None
            self.initial_result = None
        run = super().should_run_forward_backward(data_iterator)
        self.attempts += int(run)
        return run

    def validate_result(self, result: Any, rejection_func, message: str, comparison_func=None,
                        tolerance: float = 0.0, fatal: bool = True) -> None:
        with _gpu_index_without_cuda():
            super().validate_result(result, rejection_func, message, comparison_func=comparison_func,
                                    tolerance=tolerance, fatal=fatal)

    def _log_validation_error_to_file(self, status: RerunValidationStatus, result: Any, message: str) -> None:
        """megatron-core calls this at each verdict; the first re-run's is this step's diagnosis."""
        diagnosis = _DIAGNOSIS.get(status)
        if diagnosis is not None:
            self.step_failures.append((CHECKS.get(message, OTHER_CHECK), diagnosis))
        super()._log_validation_error_to_file(status, result, message)

    def _reduce_any(self, value):
        """megatron-core's OR over all ranks, on the communication device (its own uses ``cuda``)."""
        values = value if isinstance(value, list) else [value]
        flags = [bool(v) for v in values]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=comm_device())
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            flags = [bool(v) for v in tensor.tolist()]
        return tuple(flags) if isinstance(value, list) else flags[0]

    def _maybe_report_stats(self) -> None:
        """``report_determinism_stats``: every REPORTING_INTERVAL_ITERATIONS steps, rank 0 logs how far
        the re-runs' results differed from the first runs', per check, over all ranks. megatron-core's own
        report names each caller's file and line, which its ``Caller`` no longer carries (AttributeError
        in 0.16 and after): the same figures, named by the check."""
        if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS != 0:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(dict(self.stats), gathered, dst=0)
            if dist.get_rank() != 0:
                for stats in self.stats.values():
                    stats.reset()
                return
            for others in gathered[1:]:
                for caller, stats in others.items():
                    self.stats[Caller(message=caller.message, rank=0)].combine([stats])
        for caller, stats in self.stats.items():
            logger.info("determinism of %r over the re-runs so far: %s", caller.message, stats.print_stats())

    def _save_state(self) -> None:
        if torch.cuda.is_available():
            super()._save_state()
            return
        self.saved_state = {
            "rng_state": {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                          "torch_rng_state": torch.get_rng_state()},
            "other_state": self.state_save_func() if self.state_save_func else None,
        }

    def _restore_state(self) -> None:
        if torch.cuda.is_available():
            super()._restore_state()
            return
        rng = self.saved_state["rng_state"]
        random.setstate(rng["random_rng_state"])
        np.random.set_state(rng["np_rng_state"])
        torch.set_rng_state(rng["torch_rng_state"])
        if self.saved_state["other_state"] and self.state_restore_func:
            self.state_restore_func(self.saved_state["other_state"])


@contextlib.contextmanager
def _gpu_index_without_cuda() -> Iterator[None]:
    """megatron-core names the GPU (``torch.cuda.current_device()``) in its verdict messages, which
    raises on a torch without CUDA: there, for the duration of one ``validate_result``, it reads -1."""
    if torch.cuda.is_available():
        yield
        return
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: -1
    try:
        yield
    finally:
        torch.cuda.current_device = current_device


#: This process's machine (also megatron-core's singleton), kept here so that :func:`stop_reason`
#: never creates one: megatron-core's getter makes a default machine when there is none.
_MACHINE: Optional[BridgeRerunStateMachine] = None


def init_rerun_state(config: RerunStateMachineConfig) -> BridgeRerunStateMachine:
    """Make this process's machine from ``config`` (Bridge's ``_init_rerun_state``), replacing any earlier
    one (an in-process restart, or a second run in the same process). On GPU the model-parallel CUDA RNG
    tracker is saved and restored with the step, as in Bridge."""
    global _MACHINE
    destroy_rerun_state()
    save_func = restore_func = None
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        def save_func() -> Dict[str, Any]:
            return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}

        def restore_func(state: Dict[str, Any]) -> None:
            if state["rng_tracker_states"]:
                tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])

    machine = BridgeRerunStateMachine(
        state_save_func=save_func, state_restore_func=restore_func, mode=RerunMode(config.rerun_mode),
        error_injector=RerunErrorInjector(error_injection_rate=config.error_injection_rate,
                                          error_injection_type=RerunDiagnostic(config.error_injection_type)))
    _set_rerun_state_machine(machine)
    _MACHINE = machine
    return machine


def destroy_rerun_state() -> None:
    """Forget the machine (megatron-core's singleton too): the next run in this process makes its own."""
    global _MACHINE
    destroy_rerun_state_machine()
    _MACHINE = None


def validate_loss(loss: torch.Tensor, config: RerunStateMachineConfig) -> None:
    """Bridge's loss checks on one micro-batch's training loss (as its loss function returned it),
    through the machine: NaN and Inf (fatal) with ``check_for_nan_in_loss``, spiky (not fatal) with
    ``check_for_spiky_loss``. Each check reads the loss's value: a device sync on GPU.

    With ``rerun_mode = "disabled"`` the machine only rejects (raises on a NaN or Inf loss): a finite
    loss, found by one check (one sync), skips the machine's two calls, which would both pass. In the
    other modes every call counts (the machine numbers them to match a re-run's calls with the first
    run's). A one-element loss (the usual) is read as a number for that check: one copy instead of
    two reductions and a copy (0.5 against 14 microseconds on a CPU rank)."""
    machine = get_rerun_state_machine()
    value = loss.detach()
    check_nan_and_inf = config.check_for_nan_in_loss and (
        machine.get_mode() != RerunMode.DISABLED or not _is_finite(value))
    if check_nan_and_inf:
        machine.validate_result(result=value, rejection_func=torch.isnan, message=NAN_MESSAGE, tolerance=0.0,
                                fatal=True)
        machine.validate_result(result=value, rejection_func=torch.isinf, message=INF_MESSAGE, tolerance=0.0,
                                fatal=True)
    if config.check_for_spiky_loss:
        machine.validate_result(result=value, rejection_func=partial(machine.is_unexpectedly_large,
                                                                     threshold=config.spiky_loss_factor, context="loss"),
                                message=SPIKY_MESSAGE, tolerance=0.0, fatal=False)


def _is_finite(value: torch.Tensor) -> bool:
    """Whether every element of ``value`` is finite (a read of the value: a device sync on GPU)."""
    if value.numel() == 1:
        return math.isfinite(value.item())
    return bool(torch.isfinite(value).all())


@dataclass(frozen=True)
class ValidationFailure:
    """What the ranks agreed on after a re-run: ``ranks`` ranks failed ``check`` with ``diagnosis``."""

    check: str
    diagnosis: str
    ranks: int


def report_rerun(state: GlobalState, step: int, should_exit: bool) -> List[ValidationFailure]:
    """After :func:`~bridge_hpc.training.train.train_step` of ``step`` (1-based): when it was re-run, the
    ranks agree on what failed and how (one all-reduce, only then: every rank knows alike that it was),
    rank 0 reports it, and a stop gets its exit reason (:func:`stop_reason`). Returns the failures."""
    machine = _MACHINE
    if machine is None or machine.get_mode() != RerunMode.VALIDATE_RESULTS or machine.attempts < 2:
        return []
    pairs = [(check, diagnosis) for check in CHECK_NAMES for diagnosis in DIAGNOSES]
    counts = torch.tensor([int(pair in machine.step_failures) for pair in pairs], dtype=torch.int32,
                          device=comm_device())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    failures = [ValidationFailure(check, diagnosis, n) for (check, diagnosis), n in zip(pairs, counts.tolist()) if n]
    if should_exit:
        # megatron-core's verdict, the same on every rank: a fatal result reproduced somewhere, or not
        deterministic = machine.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
        machine.stop = _exit_reason(failures, deterministic)
    if state.rank == 0:
        action = "stop" if should_exit else "continue"
        for f in failures:
            print(f"result validation at iteration {step}: {f.check} on {f.ranks} rank(s), "
                  f"{'reproduced' if f.diagnosis == 'deterministic' else 'not reproduced'} by the re-run on the "
                  f"same batch ({f.diagnosis}); {'training goes on' if action == 'continue' else 'stopping'}",
                  flush=True)
            if state.progress is not None:
                state.progress.result_validation(step, f.check, f.diagnosis, f.ranks, action)
        if machine.stop is not None and machine.stop != EXIT_TRANSIENT_FAULT:
            print(f"not requeueing: iteration {step} fails the same way when run again; the checkpoint of "
                  f"iteration {step - 1} is kept to resume from once the cause (data, learning rate, model) "
                  f"is fixed", flush=True)
    return failures


def _exit_reason(failures: List[ValidationFailure], deterministic: bool) -> str:
    if not deterministic:
        return EXIT_TRANSIENT_FAULT
    checks = {f.check for f in failures if f.diagnosis == "deterministic"}
    return next((_DETERMINISTIC_EXIT[c] for c in _DETERMINISTIC_EXIT if c in checks), EXIT_INVALID_RESULT)


def stop_reason() -> Optional[str]:
    """The exit reason of a failed result validation this run stops for (the same on every rank), or None."""
    return _MACHINE.stop if _MACHINE is not None else None


class DataPosition:
    """A train iterator's position (its ``state_dict()``) as it was at the start of a step.

    A step that fails result validation does not count, but its micro-batches were read: the exit
    checkpoint of the step before must record where that step started, so the resumed run reads them again.
    """

    def __init__(self, state: Dict[str, Any]):
        self._state = dict(state)

    def state_dict(self) -> Dict[str, Any]:
        return dict(self._state)


def position_of(iterator: Any) -> Optional[DataPosition]:
    """The position to save if the step about to run is aborted; None for an iterator without a position."""
    return DataPosition(iterator.state_dict()) if hasattr(iterator, "state_dict") else None
