"""When the loop saves and when it stops: the one place that decides, after every step.

:func:`checkpoint_and_decide_exit` (Megatron Bridge's name) saves on ``checkpoint.save_interval`` and,
when an exit reason holds, saves once more (unless this step is saved already), records why the run
ended in the progress log and, with work left, asks the batch script to requeue the job.

Reasons come in two groups (:func:`exit_reasons`). Counters every rank shares (``train_iters``,
``exit_interval``) need no communication. What one rank can see before another (a stop signal, a
clock, Slurm's end time, which only rank 0 reads, a straggler verdict) is OR-ed across ranks in one
all-reduce, so all ranks stop at the same iteration.

A stop signal alone does not say why Slurm sent it: SIGTERM comes with a preemption, a time limit,
``scontrol requeue`` and a plain ``scancel`` alike. So rank 0 asks Slurm
(:func:`bridge_hpc.slurm.query.stop_cause`): a cancel ends the job with a checkpoint and no requeue
request; anything else requeues.

The time-limit rule stops when the slowest step, the expected save and a margin no longer fit before
Slurm's end time. The expected save is this run's last save, else the longest save of recent runs
that the progress log records, else a guess.

With ``checkpoint.async_save`` the interval saves are written in the background
(:mod:`bridge_hpc.training.checkpoint.async_writer`): after every step the ranks check, without waiting,
whether the one in flight is written, and finalize it then (tracker, ``Saved checkpoint`` line). Any
exit first waits for it, then saves synchronously, then requeues. A failed background save is
reported (stderr, and a ``Checkpoint save failed`` line in the progress log) and training goes on: the
next interval save retries. After ``checkpoint.async_save_max_failures`` failures in a row the run
stops with :class:`~bridge_hpc.training.checkpoint.checkpointing.CheckpointSaveError`.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from bridge_hpc.contracts import progress_log as progress_log
from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.requeue import request_requeue
from bridge_hpc.slurm import query
from bridge_hpc.slurm.job_environment import JobEnvironment
from bridge_hpc.training.checkpoint import async_writer as async_checkpoint
from bridge_hpc.training.checkpoint import auto_interval, checkpointing
from bridge_hpc.training.checkpoint.checkpointing import CheckpointSaveError
from bridge_hpc.training.config import ConfigContainer
from bridge_hpc.training.engine.collectives import comm_device
from bridge_hpc.training.engine.ddp_hooks import forward_pre_hooks_off
from bridge_hpc.training.resilience import rerun
from bridge_hpc.training.state import GlobalState

#: Exit reason -> the progress log's ``Ending job`` reason; the first that holds is reported (work
#: done outranks the rest: nothing is left to requeue for).
PROGRESS_REASONS = {"train_iters reached": "done",
                    # a step that failed result validation (bridge_hpc.training.resilience.rerun): it did not count
                    rerun.EXIT_NAN_LOSS: "nan_loss", rerun.EXIT_INF_LOSS: "inf_loss",
                    rerun.EXIT_INVALID_RESULT: "invalid_result", rerun.EXIT_TRANSIENT_FAULT: "transient_fault",
                    "straggler": "straggler", "signal received": "signal", "time limit": "time_limit",
                    "exit_duration_in_mins": "duration", "exit_interval": "interval"}
#: ``Ending job`` reasons after which the job is not requeued (a fault its step's re-run reproduced
#: would only recur).
FINAL_REASONS = ("done", "cancelled", "nan_loss", "inf_loss", "invalid_result")

#: Kept free before Slurm's end time on top of one (slowest) step and one save: the exit itself and
#: slack for a save slower than the last one.
TIME_LIMIT_MARGIN_S = 20.0
#: The expected save when neither this run nor the progress log has measured one.
FIRST_SAVE_GUESS_S = 30.0
#: How often rank 0 asks Slurm again for the end time (an admin may extend the job).
END_TIME_REFRESH_S = 300.0
#: A stop signal this close to the job's end is Slurm's time-limit warning (``--signal``, which can
#: come up to a minute early), not a preemption. Both requeue; only the recorded reason differs.
TIME_LIMIT_WARNING_WINDOW_S = 300.0


# ---------------------------------------------------------------------------------------------
# The progress log's baseline and the save line (Megatron Bridge's names)
# ---------------------------------------------------------------------------------------------


def get_start_time_from_progress_log(cfg: ConfigContainer) -> Tuple[datetime.datetime, float]:
    """Start time of the earliest job with this world size, and the FLOPs of the last saved checkpoint
    before it: the baseline of the cumulative throughput (Megatron Bridge's name and result).

    Reads ``<checkpoint.save>/progress.txt``; "earliest" counts from the last line written with another
    world size (a run at another size restarts the search). The world size is torch.distributed's,
    else the launcher's (``WORLD_SIZE`` / ``SLURM_NTASKS``). The rule itself is
    :func:`bridge_hpc.contracts.progress_log.cumulative_baseline`, which the progress log's writer uses too.
    Raises ValueError when ``checkpoint.save`` is unset or the log has no ``Starting job`` line of this
    world size, FileNotFoundError when there is no log.
    """
    if cfg.checkpoint.save is None:
        raise ValueError("get_start_time_from_progress_log needs checkpoint.save (the folder of progress.txt)")
    path = run_folder.checkpoint_file(cfg.checkpoint.save, run_folder.PROGRESS_FILE)
    world_size = dist.get_world_size() if dist.is_initialized() else JobEnvironment.from_env().world_size
    start, flops = progress_log.cumulative_baseline(progress_log.parse_events(path), world_size)
    if start is None:
        raise ValueError(f"{path} has no 'Starting job' line with # GPUs: {world_size} after the last line of "
                         f"another world size")
    return datetime.datetime.fromtimestamp(start), flops


def compute_throughputs_and_append_to_progress_log(state: GlobalState,
                                                   num_floating_point_operations_so_far: float) -> None:
    """Append the ``Saved checkpoint`` line of the save just made: iteration, job and cumulative
    TFLOP/s/GPU, FLOPs so far, tokens (consumed samples x sequence length), then bridge_hpc's ``Save
    seconds`` (``state.last_save_s``). Megatron Bridge's name; returns nothing, as there.

    Job throughput counts from this run's process start and the FLOPs of the checkpoint it loaded;
    cumulative throughput from the baseline of :func:`get_start_time_from_progress_log`, read once
    when the run's ``Starting job`` line was written (the file changes only by this writer meanwhile).
    The computation and the line's format are :meth:`bridge_hpc.contracts.progress_log.ProgressLog.saved_checkpoint`.
    A no-op where there is no progress log (``logger.log_progress`` off, no ``checkpoint.save``, or
    not rank 0). Unlike Bridge, a save with ``checkpoint.async_save`` is logged when it is durable (by
    :func:`maybe_finalize_async_save`), as ``Saved checkpoint``; this function logs synchronous saves.
    """
    if state.progress is None:
        return
    ts = state.train_state
    state.progress.saved_checkpoint(ts.step, num_floating_point_operations_so_far,
                                    ts.consumed_train_samples * state.cfg.model.seq_length, state.last_save_s)


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def save_checkpoint_and_time(state: GlobalState, model, optimizer, opt_param_scheduler,
                             num_floating_point_operations_so_far: float, checkpointing_context: Dict[str, Any],
                             non_persistent_ckpt: bool = False, train_data_iterator=None) -> None:
    """Save a checkpoint of the current step, timed, and remember that this step is saved.

    With ``ddp.use_distributed_optimizer`` and ``ddp.overlap_param_gather`` (GPU) the forward pre-hooks
    are off during the save and the parameters all-gathered before it (:func:`forward_pre_hooks_off`)."""
    timer = state.timers("save-checkpoint", log_level=0)
    timer.start(barrier=True)
    ft = state.fault_tolerance
    with ft.checkpointing() if ft is not None else contextlib.nullcontext():  # a long save is not a hang
        with forward_pre_hooks_off(state, model):
            checkpointing.save_checkpoint(state, model, optimizer, opt_param_scheduler, train_data_iterator)
    timer.stop(barrier=True)
    if state.straggler_detector is not None:
        state.straggler_detector.restart_window()  # the steps right after a save are not judged
    checkpointing_context["last_saved_step"] = state.train_state.step
    state.last_save_s = timer.elapsed(reset=True)
    state.metrics.log_checkpoint_saved(state.train_state.step, state.last_save_s)
    compute_throughputs_and_append_to_progress_log(state, num_floating_point_operations_so_far)


#: ``checkpointing_context`` key: set once per run, after its first step, when the checkpoint
#: worker's staging warm-up has been decided (:func:`checkpoint_and_decide_exit`).
STAGING_DECIDED = "worker_staging_decided"
#: ``checkpointing_context`` key: background saves that failed since the last one that finalized.
FAILED_SAVES = "failed_saves_in_a_row"
#: The progress log's event for a background save that failed (bridge_hpc's; Megatron has none).


def start_async_save_and_time(state: GlobalState, model, optimizer, opt_param_scheduler,
                              checkpointing_context: Dict[str, Any], train_data_iterator=None) -> None:
    """Start a background save of the current step (``checkpoint.async_save``); a save still in
    flight is finalized first (at most one is in flight). Collective."""
    maybe_finalize_async_save(state, checkpointing_context, blocking=True)
    writer = checkpointing_context[async_checkpoint.ASYNC_WRITER_KEY]
    try:
        # Not in fault tolerance's checkpointing section: it is short, and the section's timeout is
        # computed from the first save it sees, which must be a whole write.
        with forward_pre_hooks_off(state, model):  # the snapshot must hold all-gathered parameters
            async_checkpoint.start_async_save(state, model, optimizer, opt_param_scheduler, writer,
                                              train_data_iterator)
    except CheckpointSaveError as err:
        _async_save_failed(state, checkpointing_context, state.train_state.step, err)
        return
    if state.straggler_detector is not None:
        state.straggler_detector.restart_window()  # the worker writes during the next steps


def maybe_finalize_async_save(state: GlobalState, checkpointing_context: Dict[str, Any], blocking: bool) -> None:
    """Finalize the background save in flight once every rank has written it; ``blocking``: wait
    until they have. Megatron's name. Collective; nothing to do (no communication) without a save
    in flight, which all ranks know alike."""
    writer = checkpointing_context.get(async_checkpoint.ASYNC_WRITER_KEY)
    iteration = async_checkpoint.in_flight_iteration(writer)
    if iteration is None:
        return
    ft = state.fault_tolerance
    try:  # a blocking wait lasts up to a whole write: fault tolerance's checkpointing section
        with ft.checkpointing() if blocking and ft is not None else contextlib.nullcontext():
            finished = async_checkpoint.finalize_async_save(writer, blocking)
    except CheckpointSaveError as err:
        _async_save_failed(state, checkpointing_context, iteration, err)
        return
    if finished is None:
        return
    checkpointing_context["last_saved_step"] = finished.iteration
    checkpointing_context[FAILED_SAVES] = 0
    # The time-limit rule's expected save: the exit save is synchronous, and a background write
    # (slowed by training beside it) takes at least as long.
    state.last_save_s = finished.total_s
    state.metrics.log_checkpoint_saved(finished.iteration, finished.blocking_s)
    if state.progress is not None:
        counters = finished.common["train_state"]
        state.progress.saved_checkpoint(finished.iteration, counters["floating_point_operations_so_far"],
                                        counters["consumed_train_samples"] * state.cfg.model.seq_length,
                                        finished.blocking_s)


def _async_save_failed(state: GlobalState, checkpointing_context: Dict[str, Any], iteration: int,
                       err: CheckpointSaveError) -> None:
    """The rule for a failed background save (every rank has ``err``; the tracker still names the
    previous checkpoint): report it, go on training, and raise ``err``'s successor once
    ``checkpoint.async_save_max_failures`` saves in a row have failed."""
    failures = checkpointing_context.get(FAILED_SAVES, 0) + 1
    checkpointing_context[FAILED_SAVES] = failures
    limit = state.cfg.checkpoint.async_save_max_failures
    stop = failures >= limit
    action = "stopping" if stop else "training goes on; the next save retries"
    last = checkpointing_context.get("last_saved_step")
    if state.rank == 0:
        kept = f"the last checkpoint is iteration {last}" if last else "no checkpoint of this run yet"
        print(f"error: asynchronous checkpoint save of iteration {iteration} failed ({failures} in a row, "
              f"checkpoint.async_save_max_failures = {limit}): {action}; {kept}", file=sys.stderr, flush=True)
        if state.progress is not None:
            try:
                state.progress.checkpoint_save_failed(iteration, failures, stop, checkpointing._one_line(str(err)))
            except OSError as write_err:  # the disk may be the cause: the error is what matters
                print(f"warning: could not record the failed save in the progress log: {write_err}",
                      file=sys.stderr, flush=True)
    if stop:
        raise CheckpointSaveError(f"{failures} checkpoint saves in a row failed (checkpoint.async_save_max_failures"
                                  f" = {limit}); the last: {err}") from err


# ---------------------------------------------------------------------------------------------
# Reasons
# ---------------------------------------------------------------------------------------------


def any_rank(flags: Dict[str, bool]) -> Dict[str, bool]:
    """Logical OR of each flag over all ranks, in one all-reduce (MAX)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flags
    values = torch.tensor([1 if flags[k] else 0 for k in flags], dtype=torch.int32, device=comm_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {k: bool(v) for k, v in zip(flags, values.tolist())}


def signal_seen(state: GlobalState) -> bool:
    return state.signal_handler is not None and state.signal_handler.received is not None


def refresh_job_times(state: GlobalState, force: bool = False):
    """Rank 0 asks Slurm for the run's start, end and time limit (Slurm 22.05 has no
    SLURM_JOB_END_TIME), at most every END_TIME_REFRESH_S; the end time, not the arrival of Slurm's
    warning, drives the time-limit exit."""
    now = time.time()
    if state.rank == 0 and (force or now - state.job_times_checked >= END_TIME_REFRESH_S):
        job_id = JobEnvironment.from_env().job_id
        state.job_times = query.job_times(job_id) if job_id else None
        state.job_times_checked = now
    return state.job_times


def expected_save_s(state: GlobalState) -> float:
    """How long the next save will take: this run's last, else the longest of recent runs (the
    progress log's ``Save seconds``), else :data:`FIRST_SAVE_GUESS_S`."""
    if state.last_save_s is not None:
        return state.last_save_s
    if state.logged_save_s is not None:
        return state.logged_save_s
    return FIRST_SAVE_GUESS_S


def time_limit_reached(state: GlobalState) -> bool:
    """Whether another step plus a save might no longer fit before Slurm ends the job (rank 0)."""
    times = refresh_job_times(state)
    if times is None or state.slowest_step_s == 0.0:
        return False
    return time.time() + state.slowest_step_s + expected_save_s(state) + TIME_LIMIT_MARGIN_S >= times.end


def exit_reasons(state: GlobalState) -> List[str]:
    """Why the loop should stop after the current step (empty: keep going). Collective.

    A new reason goes in one of the two groups below and in PROGRESS_REASONS."""
    ts, t = state.train_state, state.cfg.train
    reasons = []
    # -- shared counters: identical on every rank -------------------------------------------------
    if ts.step >= t.train_iters:
        reasons.append("train_iters reached")
    if t.exit_interval and ts.step % t.exit_interval == 0 and ts.step > state.run_start_step:
        reasons.append("exit_interval")
    if rerun.stop_reason() is not None:  # the ranks agreed on it (rerun.report_rerun)
        reasons.append(rerun.stop_reason())
    if state.straggler_stop:  # the detector's verdict is collective: the same on every rank
        reasons.append("straggler")
    # -- per-rank observations: agreed on in the step's loss all-reduce, else here ----------------
    agreed, state.agreed_observations = state.agreed_observations, None
    if agreed is None:
        agreed = any_rank(local_observations(state))
    reasons += [name for name, flag in agreed.items() if flag]
    return reasons


def local_observations(state: GlobalState) -> Dict[str, bool]:
    """What this rank alone sees that may stop the run; the ranks agree on them (logical OR) before
    acting, so that every rank stops at the same step. ``train_step`` takes them once a step and agrees
    on them in the collective that reduces the step's loss: its own all-reduce after the backward, or
    on CPU ranks the gradient all-reduce of the last backward (taken just before it:
    :mod:`bridge_hpc.training.engine.grad_reduce_rider`)."""
    t = state.cfg.train
    return {
        "signal received": signal_seen(state),
        "exit_duration_in_mins": bool(t.exit_duration_in_mins)
        and (time.time() - state.start_time) / 60.0 >= t.exit_duration_in_mins,
        "time limit": state.rank == 0 and time_limit_reached(state),
    }


def progress_reason(state: GlobalState, reasons: List[str]) -> str:
    """The one reason recorded for this exit (rank 0).

    For a stop signal Slurm is asked why it came: a cancel is ``cancelled`` (final), a preemption or
    requeue ``signal``, a time-out ``time_limit``. Where Slurm cannot say (no Slurm, no scontrol in a
    container), the job's times decide: a signal near the end time is its warning."""
    reason = next(PROGRESS_REASONS[r] for r in PROGRESS_REASONS if r in reasons)
    if reason != "signal":
        return reason
    env = JobEnvironment.from_env()
    cause = query.stop_cause(env.job_id, env.restart_count) if env.job_id else None
    if cause == "cancelled":
        return "cancelled"
    if cause in ("requeued", "preempted"):
        return "signal"
    if cause == "time_limit":
        return "time_limit"
    times = refresh_job_times(state, force=True)
    if times is not None and not times.shortened and times.end - time.time() <= TIME_LIMIT_WARNING_WINDOW_S:
        return "time_limit"
    return "signal"


# ---------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------


def checkpoint_and_decide_exit(state: GlobalState, model, optimizer, opt_param_scheduler,
                               num_floating_point_operations_so_far: float, checkpointing_context: Dict[str, Any],
                               train_data_iterator) -> bool:
    """Save on ``checkpoint.save_interval``; on any exit reason save (unless this step is already
    saved, or nothing was trained yet) and return True. With work left and no cancel, rank 0 then
    asks the batch script to requeue the job: the checkpoint it resumes from is durable by then.

    With ``checkpoint.async_save`` the interval saves run in the background; a save in flight is
    finalized as soon as every rank has written it, and before any exit save."""
    cfg, step = state.cfg, state.train_state.step
    auto_interval.after_step(checkpointing_context, state)  # save_interval = "auto" timing its first steps
    reasons = exit_reasons(state)
    writer = checkpointing_context.get(async_checkpoint.ASYNC_WRITER_KEY)
    if writer is not None and STAGING_DECIDED not in checkpointing_context and not reasons \
            and step > state.run_start_step:
        # After this run's first step, when the optimizer's state exists: the first background save's
        # host-memory costs, paid by the worker in the background once (GPU only), and only where
        # this run will make a background save (they leave gigabytes of host memory pinned in the
        # worker, which its exit must unpin). Synchronous saves (the exit save) stage nothing.
        checkpointing_context[STAGING_DECIDED] = True
        if checkpointing._uses_megatron_dist(model) and async_checkpoint.interval_save_ahead(cfg, step):
            writer.warm_up_staging(checkpointing.megatron_save_tensors(
                model, optimizer, cfg.checkpoint.save_optim, cfg.checkpoint.dist_ckpt_optim_fully_reshardable))
    if async_checkpoint.in_flight_iteration(writer) is not None:
        maybe_finalize_async_save(state, checkpointing_context, blocking=False)
        in_flight = async_checkpoint.in_flight_iteration(writer)
        if reasons and in_flight is not None:
            if state.rank == 0:
                print(f"stopping at iteration {step}: the asynchronous checkpoint save of iteration {in_flight} "
                      f"is still being written; finishing it before the exit save", flush=True)
            maybe_finalize_async_save(state, checkpointing_context, blocking=True)
    if reasons and writer is not None:
        # Every save from here on is synchronous: the worker's teardown overlaps the exit save.
        writer.stop_processes()
    can_save = bool(cfg.checkpoint.save)
    saved_now = checkpointing_context.get("last_saved_step") == step
    args = (state, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, checkpointing_context)
    if can_save and step > 0 and not saved_now and cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
        if writer is not None and not reasons:
            start_async_save_and_time(state, model, optimizer, opt_param_scheduler, checkpointing_context,
                                      train_data_iterator)
        else:  # an exit save is synchronous: the requeued job must find it durable
            save_checkpoint_and_time(*args, train_data_iterator=train_data_iterator)
    if not reasons:
        return False
    if can_save and step > 0 and checkpointing_context.get("last_saved_step") != step:
        save_checkpoint_and_time(*args, train_data_iterator=train_data_iterator)
    state.exit_reasons = reasons
    if state.rank == 0:
        reason = progress_reason(state, reasons)
        print(f"exiting at iteration {step}: {', '.join(reasons)} (recorded as {reason})", flush=True)
        if state.progress is not None:
            state.progress.ending_job(reason, step, step - checkpointing_context.get("last_saved_step", 0))
        if reason not in FINAL_REASONS:
            detector = state.straggler_detector
            avoid = (detector.last_report.flagged_nodes
                     if reason == "straggler" and detector is not None and detector.last_report is not None else [])
            if request_requeue(reason, step, exclude_nodes=avoid):
                print(f"work left at iteration {step}: asked the batch script to requeue the job", flush=True)
        elif reason == "cancelled":
            print(f"the job was cancelled (scancel): checkpointed at iteration {step}, not requeueing", flush=True)
    return True
