"""The training loop: :func:`train` calls :func:`train_step` until an exit reason comes up.

Read top to bottom: one step (zero grads, forward/backward over the micro-batches, optimizer and
scheduler step, loss reduction), then bookkeeping (counters, evaluation, the step log), then
:func:`checkpoint_and_decide_exit` (:mod:`bridge_hpc.training.resilience.exit_policy`), the single place that
decides about saving and stopping.
The same code runs on CPU (torch DDP + torch optimizer) and GPU (megatron-core DDP + optimizer);
the few differences sit in :func:`zero_grads` and :func:`finalize_grads`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import time
from collections import deque
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import get_rerun_state_machine

from bridge_hpc.training.engine import moe, parallel
from bridge_hpc.training.engine.collectives import (
    comm_device,
    reduce_loss_dicts_and_flags,
    start_reduce_loss_dicts_and_flags,
)
from bridge_hpc.training.engine.cuda_graphs import FullIterationCudaGraph

# Bridge's names in bridge.training.train. They live with what they serve: the DDP hooks with the
# engine, the save path with the exit policy (which imports nothing from this module).
from bridge_hpc.training.engine.ddp_hooks import (  # noqa: F401
    disable_forward_pre_hook,
    enable_forward_pre_hook,
    forward_pre_hooks_off,
    should_disable_forward_pre_hook,
)
from bridge_hpc.training.engine.grad_reduce_rider import GradReduceRider
from bridge_hpc.training.engine.moe_config import is_moe
from bridge_hpc.training.engine.optimizer import installed_fused_step
from bridge_hpc.training.process import bytecode_cache, heap
from bridge_hpc.training.resilience import rerun
from bridge_hpc.training.resilience.exit_policy import (  # noqa: F401
    any_rank,
    checkpoint_and_decide_exit,
    compute_throughputs_and_append_to_progress_log,
    get_start_time_from_progress_log,
    local_observations,
    save_checkpoint_and_time,
    signal_seen,
)
from bridge_hpc.training.resilience.fault_tolerance import FaultTolerance
from bridge_hpc.training.resilience.straggler import StragglerDetector
from bridge_hpc.training.state import GlobalState
from bridge_hpc.training.utils.train_utils import (
    logical_and_across_model_parallel_group,
    num_floating_point_operations,
    prepare_forward_step_func,
    reduce_max_stat_across_model_parallel_group,
    training_log,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Forward/backward over the micro-batches of one global batch
# ---------------------------------------------------------------------------------------------


def zero_grads(model: List[torch.nn.Module], optimizer) -> None:
    """Clear gradients; megatron-core DDP keeps them in a contiguous buffer of its own."""
    for chunk in model:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    optimizer.zero_grad()


def finalize_grads(model: List[torch.nn.Module]) -> None:
    """Finish the data-parallel gradient reduction.

    torch DDP has already all-reduced during the last backward, except the expert parameters of expert
    parallelism, reduced here over their own group; megatron-core DDP reduces here.
    """
    if isinstance(model[0], torch.nn.parallel.DistributedDataParallel):
        if model[0].parameters_to_ignore:
            from bridge_hpc.training.engine import moe

            moe.reduce_expert_grads(model[0].module)
    elif hasattr(model[0], "zero_grad_buffer"):
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(model)


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def forward_backward(forward_step_func: Callable, data_iterator, model: List[torch.nn.Module], num_microbatches: int,
                     optimizer=None, forward_only: bool = False, collect_non_loss_data: bool = False,
                     validate_loss: Optional[Callable[[torch.Tensor], None]] = None,
                     before_grad_sync: Optional[Callable[[List[Any]], None]] = None) -> List[Any]:
    """Run ``num_microbatches`` forward (and backward) steps; return what each loss function reported.

    Semantics of megatron-core's ``forward_backward_no_pipelining`` (whose token counter lives on
    ``cuda`` and so cannot run on CPU): a loss function returning ``(loss, num_tokens, report)``
    has its loss divided by the token count and the number of micro-batches; ``(loss, report)`` by
    the number of micro-batches; with ``collect_non_loss_data`` it is called as
    ``loss_func(output, non_loss_data=True)`` and whatever it returns is collected. Gradients are
    synchronized only on the last micro-batch (``no_sync`` before). ``validate_loss`` gets each
    micro-batch's loss as the loss function returned it (:func:`bridge_hpc.training.resilience.rerun.validate_loss`).
    ``before_grad_sync`` gets every micro-batch's report just before the last backward, the one that
    synchronizes the gradients (:class:`~bridge_hpc.training.engine.grad_reduce_rider.GradReduceRider`).
    As megatron-core's schedules do, each model's ``set_is_first_microbatch()`` is called first: with FP8,
    Transformer Engine's layers otherwise keep the FP8 copies of their weights from the first step on.
    """
    chunk = model[0]
    store: List[Any] = []
    if is_moe(getattr(_unwrapped(chunk), "config", None)) and not forward_only:
        moe.set_aux_loss_scale(optimizer, num_microbatches, comm_device())
    for each in model:  # Transformer Engine's FP8 layers re-quantize their weights at a step's first micro-batch
        inner = _unwrapped(each)
        if hasattr(inner, "set_is_first_microbatch"):
            inner.set_is_first_microbatch()

    def one_microbatch(last: bool) -> None:
        output, loss_func = forward_step_func(data_iterator, chunk)
        if loss_func is None:
            store.append(output)
            return
        if collect_non_loss_data:
            store.append(loss_func(output, non_loss_data=True))
            return
        outputs = loss_func(output)
        if validate_loss is not None and len(outputs) in (2, 3):
            validate_loss(outputs[0])
        if len(outputs) == 3:
            loss, num_tokens, report = outputs
            loss = loss / torch.clamp(num_tokens, min=1) / num_microbatches
        elif len(outputs) == 2:
            loss, report = outputs
            loss = loss / num_microbatches
        else:
            raise ValueError("a loss function must return (loss, report) or (loss, num_tokens, report), "
                             f"got {len(outputs)} values")
        store.append(report)
        if not forward_only:
            if last and before_grad_sync is not None:
                before_grad_sync(store)
            optimizer.scale_loss(loss).backward()

    grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()
    no_sync = chunk.no_sync if (hasattr(chunk, "no_sync") and not forward_only) else contextlib.nullcontext
    with grad_context:
        with no_sync():
            for _ in range(num_microbatches - 1):
                one_microbatch(last=False)
        one_microbatch(last=True)
    if not forward_only:
        finalize_grads(model)
    return store


def run_microbatches(forward_step_func: Callable, data_iterator, model: List[torch.nn.Module], global_state: GlobalState,
                     optimizer=None, forward_only: bool = False, collect_non_loss_data: bool = False,
                     validate_loss: Optional[Callable[[torch.Tensor], None]] = None,
                     before_grad_sync: Optional[Callable[[List[Any]], None]] = None,
                     evaluation: bool = False) -> List[Any]:
    """One global batch's micro-batches: :func:`forward_backward`, or with pipeline parallelism
    megatron-core's pipeline schedule (:func:`bridge_hpc.training.engine.parallel.pipelined_forward_backward`),
    whose reports only the last stage has. ``evaluation``: a batch of the evaluation sizes
    (``validation.eval_global_batch_size`` / ``eval_micro_batch_size``)."""
    cfg = global_state.cfg
    num_microbatches = get_num_microbatches(global_state, evaluation)
    if parallel.pipeline_size() > 1:
        micro_batch_size = cfg.validation.eval_micro_batch_size if evaluation else cfg.train.micro_batch_size
        return parallel.pipelined_forward_backward(forward_step_func, data_iterator, model, num_microbatches,
                                                   cfg.model.seq_length, micro_batch_size,
                                                   forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                                                   validate_loss=validate_loss)
    return forward_backward(forward_step_func, data_iterator, model, num_microbatches, optimizer=optimizer,
                            forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                            validate_loss=validate_loss, before_grad_sync=before_grad_sync)


def reduce_reports_and_flags(reports: List[Dict[str, torch.Tensor]], purpose: str,
                             flags: Optional[Dict[str, bool]] = None
                             ) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, bool]]]:
    """The micro-batches' reports reduced over the data-parallel (and context-parallel) group, and
    ``flags`` agreed by every rank; with pipeline parallelism the last stage's values then reach
    every rank (rank 0 logs them), in the all-reduce that agrees on the flags."""
    return start_reduce_reports_and_flags(reports, purpose, flags)()


def start_reduce_reports_and_flags(reports: List[Dict[str, torch.Tensor]], purpose: str,
                                   flags: Optional[Dict[str, bool]] = None
                                   ) -> Callable[[], Tuple[Dict[str, torch.Tensor], Optional[Dict[str, bool]]]]:
    """:func:`reduce_reports_and_flags` issued now, read by the function it returns
    (:func:`~bridge_hpc.training.engine.collectives.start_reduce_loss_dicts_and_flags`); with pipeline
    parallelism it completes here."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if parallel.pipeline_size() == 1:
        return start_reduce_loss_dicts_and_flags(reports, group, flags)
    reduced, _ = reduce_loss_dicts_and_flags(reports, group)
    shared = parallel.share_last_stage_values(reduced, flags, purpose, comm_device())
    return lambda: shared


def get_num_microbatches(global_state: GlobalState, evaluation: bool = False) -> int:
    """Micro-batches per global batch on each data-parallel rank: of training's sizes, or with
    ``evaluation`` of ``validation.eval_global_batch_size`` / ``eval_micro_batch_size``."""
    cfg = global_state.cfg
    if evaluation:
        v = cfg.validation
        return v.eval_global_batch_size // (v.eval_micro_batch_size * cfg.data_parallel_size)
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.data_parallel_size)


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------


def train_step(forward_step_func: Callable, data_iterator, model: List[torch.nn.Module], optimizer, scheduler,
               global_state: GlobalState) -> Tuple[Dict[str, torch.Tensor], int, bool, bool, int,
                                                   Optional[float], Optional[int]]:
    """One optimizer step over one global batch.

    Returns Bridge's 7-tuple ``(loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code,
    grad_norm, num_zeros_in_grad)``. ``forward_step_func`` must already be prepared
    (:func:`prepare_forward_step_func`). An optimizer step that reports failure (fp16 overflow,
    non-finite gradients) is a skipped iteration: the scheduler does not advance.

    megatron-core's rerun state machine (:mod:`bridge_hpc.training.resilience.rerun`) decides how often the
    forward/backward runs: again on the same micro-batches (``data_iterator`` a ``RerunDataIterator``)
    when a loss failed validation. When it says stop, the step is abandoned before the optimizer step.
    """
    cfg = global_state.cfg
    timers = global_state.timers
    rerun_state_machine = get_rerun_state_machine()
    validate = partial(rerun.validate_loss, config=cfg.rerun_state_machine)
    # The loss and the ranks' stop observations (the exit decision after this step reads them:
    # exit_policy.exit_reasons) are reduced in one collective: the gradients' own where a rider is
    # installed (CPU ranks), else their own, issued before the optimizer step and read after it.
    rider = GradReduceRider.on(model[0])
    load_rider = (lambda reports: rider.load(reports, local_observations(global_state))) if rider else None

    graph = global_state.full_iteration_graph  # model.cuda_graph_impl = "full_iteration"

    barrier = cfg.logger.barrier_with_L1_time  # level-1 timers start and stop together on every rank
    timers("forward-backward", log_level=1).start(barrier=barrier)
    while rerun_state_machine.should_run_forward_backward(data_iterator):
        zero_grads(model, optimizer)
        _handle_mxfp8_param_buffer_copy(optimizer, model=model,
                                        reuse_grad_buf_for_mxfp8_param_ag=cfg.optimizer.reuse_grad_buf_for_mxfp8_param_ag,
                                        overlap_param_gather=cfg.ddp.overlap_param_gather)
        if graph is not None:
            fused_step = installed_fused_step(optimizer)
            reports = graph.forward_backward(forward_step_func, data_iterator, model, get_num_microbatches(global_state),
                                             optimizer, validate,
                                             before_loss_checks=fused_step.queue_grad_norm if fused_step else None)
        else:
            reports = run_microbatches(forward_step_func, data_iterator, model, global_state, optimizer=optimizer,
                                       validate_loss=validate, before_grad_sync=load_rider)
    timers("forward-backward", log_level=1).stop()
    should_checkpoint, should_exit, exit_code = rerun_state_machine.should_checkpoint_and_exit()
    if should_exit:
        return {}, 1, should_checkpoint, should_exit, exit_code, None, None

    finish_reduce = (rider.take() if rider else None) or start_reduce_reports_and_flags(
        reports, "train", local_observations(global_state))
    if cfg.train.empty_unused_memory_level >= 2 and torch.cuda.is_available():
        torch.cuda.empty_cache()  # Megatron's level 2: also between forward-backward and the optimizer step
    timers("optimizer", log_level=1).start(barrier=barrier)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    timers("optimizer", log_level=1).stop()
    if cfg.model.model_parallel_size > 1:  # ranks that hold parts of one model agree
        mp_group = parallel_state.get_model_parallel_group()
        if cfg.train.check_optimizer_step_success:
            update_successful = logical_and_across_model_parallel_group(update_successful, mp_group)
        if not cfg.train.skip_sync_grad_norm_across_mp:
            grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm, mp_group)
    if update_successful:
        scheduler.step(increment=cfg.train.global_batch_size)
    skipped_iter = 0 if update_successful else 1

    loss_dict, global_state.agreed_observations = finish_reduce()
    if is_moe(cfg.model):  # the load-balancing and z losses, logged with the language-model loss
        loss_dict.update(moe.aux_losses(cfg.model, get_num_microbatches(global_state)))
    return loss_dict, skipped_iter, False, False, 0, grad_norm, num_zeros_in_grad


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


def evaluate(state: GlobalState, forward_step_func: Callable, data_iterator, model: List[torch.nn.Module],
             process_non_loss_data_func: Optional[Callable] = None,
             non_loss_data_func: Optional[Callable] = None) -> Tuple[Dict[str, torch.Tensor], Any]:
    """``validation.eval_iters`` forward-only batches of ``validation.eval_global_batch_size`` samples;
    returns (reduced loss dict, non-loss data).

    Losses are reduced over all micro-batches of all eval iterations and all data-parallel ranks at
    once, so a per-token loss is the mean over every evaluated token.
    """
    cfg = state.cfg
    for chunk in model:
        chunk.eval()
    reports: List[Dict[str, torch.Tensor]] = []
    for _ in range(cfg.validation.eval_iters):
        if state.signal_handler is not None:
            state.signal_handler.rearm()  # as before each training step: C code may have taken the signals
        # A long evaluation must not sit on a preemption notice: stop early, all ranks together.
        if any_rank({"signal": signal_seen(state)})["signal"]:
            if state.rank == 0:
                print(f"evaluation cut short after {len(reports)} micro-batches: stop signal received", flush=True)
            break
        reports += run_microbatches(forward_step_func, data_iterator, model, state, forward_only=True, evaluation=True)
        state.train_state.consumed_valid_samples += cfg.validation.eval_global_batch_size
    collected = None
    last_rank = state.rank == state.world_size - 1
    if process_non_loss_data_func is not None:
        if non_loss_data_func is not None:
            collected = non_loss_data_func(model) if last_rank else None
        elif last_rank or state.cfg.model.model_parallel_size > 1:
            # With model parallelism the forward spans ranks (stages, tensor-parallel peers): every rank
            # runs it, the last rank keeps what it collected.
            collected = run_microbatches(forward_step_func, data_iterator, model, state, forward_only=True,
                                         collect_non_loss_data=True, evaluation=True)
            collected = collected if last_rank else None
    for chunk in model:
        chunk.train()
    return reduce_reports_and_flags(reports, "eval")[0], collected


def evaluate_and_print_results(state: GlobalState, prefix: str, forward_step_func: Callable, data_iterator,
                               model: List[torch.nn.Module], process_non_loss_data_func: Optional[Callable] = None,
                               non_loss_data_func: Optional[Callable] = None) -> Dict[str, float]:
    """Evaluate, print one line on rank 0, send scalars to TensorBoard; returns ``{key: value}``.
    With ``train.manual_gc`` and ``train.manual_gc_eval``, a full collection before and after."""
    collect = state.cfg.train.manual_gc and state.cfg.train.manual_gc_eval
    if collect:
        gc.collect()
    loss_dict, collected = evaluate(state, forward_step_func, data_iterator, model, process_non_loss_data_func,
                                    non_loss_data_func)
    if collect:
        gc.collect()
    values = {key: float(value) for key, value in loss_dict.items()}
    step = state.train_state.step
    if state.rank == 0:
        parts = [f"validation loss at {prefix}"]
        for key, value in values.items():
            parts.append(f"{key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E}")
        print(" | ".join(parts), flush=True)
    state.metrics.validation(step, values, perplexity=state.cfg.logger.log_validation_ppl_to_tensorboard)
    if collected is not None:
        process_non_loss_data_func(collected, step, state.tensorboard_logger)
    return values


# ---------------------------------------------------------------------------------------------
# After each step
# ---------------------------------------------------------------------------------------------


def post_training_step_callbacks(model: List[torch.nn.Module], num_floating_point_operations_since_last_log_event: float,
                                 straggler_timer: Any, iteration: int, prof: Optional[torch.profiler.profile], config,
                                 should_toggle_forward_pre_hook: bool = False, nsys_nvtx_context=None) -> None:
    """Per-step housekeeping outside the step itself (Bridge's hook, after every step).

    - the profiler window: ``prof.step()`` each step, ``prof.stop()`` (the trace is written) at
      ``profiling.profile_step_end``; an NVTX context (``nsys_nvtx_context``, a
      :data:`bridge_hpc.training.profiling.TNvtxContext` a caller entered for nsys) is exited there too;
    - manual garbage collection every ``train.manual_gc_interval`` steps with ``train.manual_gc``;
    - ``train.train_sync_interval``: the host waits for the GPU every that many steps;
    - ``train.empty_unused_memory_level`` >= 1: the CUDA cache is emptied after every step;
    - ``train.check_weight_hash_across_dp_replicas_interval``: the replicas' weights are compared;

    Fault-tolerance sections and heartbeats, and nvidia-resiliency-ext's straggler timing, bracket the
    step in :func:`train` itself (they must see the step's start too). ``straggler_timer``,
    ``num_floating_point_operations_since_last_log_event`` and ``should_toggle_forward_pre_hook`` keep
    Bridge's signature; they serve Megatron's built-in straggler detector and weight-hash check, which
    this trainer does not run (``straggler.log_straggler`` is refused).
    """
    t = config.train
    if t.manual_gc and t.manual_gc_interval and iteration % t.manual_gc_interval == 0:
        gc.collect()
    if torch.cuda.is_available():
        if t.train_sync_interval and iteration % t.train_sync_interval == 0:
            torch.cuda.synchronize()
        if t.empty_unused_memory_level >= 1:
            torch.cuda.empty_cache()
    if t.check_weight_hash_across_dp_replicas_interval and iteration % t.check_weight_hash_across_dp_replicas_interval == 0:
        check_weight_hashes_across_dp_replicas(model, iteration)
    if config.profiling.use_nsys_profiler:
        nsys_step(config.profiling, iteration)
    if iteration == config.profiling.profile_step_end and nsys_nvtx_context is not None:
        nsys_nvtx_context.__exit__(None, None, None)
    if prof is not None:
        if iteration >= config.profiling.profile_step_end:
            prof.stop()
        else:
            prof.step()


def check_weight_hashes_across_dp_replicas(model: List[torch.nn.Module], iteration: int) -> None:
    """``train.check_weight_hash_across_dp_replicas_interval``: every parameter's SHA-1 (of its bytes as
    float32), gathered over the data-parallel group and compared with replica 0's; a replica that
    differs stops the run with the names of the parameters that differ (megatron-core's check does the
    same on GPU only). The gather runs on the backend's device."""
    import hashlib

    group = parallel_state.get_data_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return
    names, digests = [], []
    for i, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            names.append(f"{i}:{name}")
            data = param.detach().float().cpu().numpy()
            digests.append(torch.frombuffer(bytearray(hashlib.sha1(data.tobytes()).digest()), dtype=torch.uint8))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    local = torch.stack(digests).to(device)
    gathered = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, local, group=group)
    differ = [names[j] for j in range(len(names)) if any(not torch.equal(g[j], gathered[0][j]) for g in gathered)]
    if differ:
        raise RuntimeError(f"at iteration {iteration} the data-parallel replicas' weights differ "
                           f"({len(differ)} parameters, e.g. {', '.join(differ[:3])}): "
                           "train.check_weight_hash_across_dp_replicas_interval")


def nsys_step(p, iteration: int) -> None:
    """``profiling.use_nsys_profiler`` on ``profile_ranks``: the CUDA profiler API range nsys captures
    (``--capture-range=cudaProfilerApi``) opens when step ``profile_step_start`` begins and closes after
    step ``profile_step_end``; ``record_shapes`` goes to NVTX's autograd ranges. Nothing on CPU."""
    if not torch.cuda.is_available() or _rank() not in p.profile_ranks:
        return
    if iteration == _window_start(p):
        torch.cuda.profiler.start()
        _NSYS["nvtx"] = torch.autograd.profiler.emit_nvtx(record_shapes=p.record_shapes)
        _NSYS["nvtx"].__enter__()
    elif iteration == p.profile_step_end and "nvtx" in _NSYS:
        _NSYS.pop("nvtx").__exit__(None, None, None)
        torch.cuda.profiler.stop()


def _window_start(p) -> int:
    """The step after which the profiled window opens: ``profile_step_start``, so that the window is the steps
    after it up to ``profile_step_end``; with ``profile_step_end == profile_step_start`` (Bridge allows it:
    one step) the window is that one step, opened after the one before it."""
    return p.profile_step_start if p.profile_step_end > p.profile_step_start else p.profile_step_end - 1


#: The NVTX context :func:`nsys_step` opened, until it closes it.
_NSYS: Dict[str, Any] = {}


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _start_profiler(state: GlobalState) -> Optional[torch.profiler.profile]:
    """A torch profiler covering steps [profile_step_start, profile_step_end) on the chosen ranks."""
    p = state.cfg.profiling
    step, start = state.train_state.step, _window_start(p)
    if not p.use_pytorch_profiler or state.rank not in p.profile_ranks or step >= start or start < 0:
        return None
    trace_dir = state.cfg.logger.tensorboard_dir or os.path.join(state.cfg.checkpoint.save or ".", "profile")
    prof = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=max(start - step - 1, 0), warmup=1 if start - step > 0 else 0,
                                         active=p.profile_step_end - start, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir),
        record_shapes=p.record_shapes or p.pytorch_profiler_collect_shapes,
        with_stack=p.pytorch_profiler_collect_callstack,
    )
    prof.start()
    return prof


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def train(forward_step_func: Callable, model: List[torch.nn.Module], optimizer, scheduler, train_data_iterator,
          valid_data_iterator, global_state: GlobalState, checkpointing_context: Dict[str, Any],
          process_non_loss_data_func: Optional[Callable] = None, non_loss_data_func: Optional[Callable] = None) -> None:
    """Train from ``global_state.train_state.step`` until an exit reason
    (:func:`bridge_hpc.training.resilience.exit_policy.exit_reasons`)."""
    cfg, ts = global_state.cfg, global_state.train_state
    forward_step_func = prepare_forward_step_func(forward_step_func, global_state)
    for chunk in model:
        chunk.train()
    global_state.run_start_step = ts.step
    global_state.full_iteration_graph = (FullIterationCudaGraph(forward_backward, cfg, zero_grads)
                                         if cfg.model.full_iteration_cuda_graph else None)
    # A stop signal during start-up (model build, checkpoint load) is honoured before any step.
    if checkpoint_and_decide_exit(global_state, model, optimizer, scheduler, ts.floating_point_operations_so_far,
                                  checkpointing_context, train_data_iterator):
        return
    prof = _start_profiler(global_state)
    # Fault tolerance (section "step" / heartbeats) and straggler timing around each step; no-ops when off.
    ft = global_state.fault_tolerance or FaultTolerance(None)
    straggler = global_state.straggler_detector or StragglerDetector(None)
    # Steps read through a replaying wrapper (a re-run reads the same micro-batches); checkpoints
    # record the position of the iterator itself.
    step_iterator = rerun.RerunDataIterator(train_data_iterator) if train_data_iterator is not None else None
    # End-of-step times for logger.log_throughput_to_tensorboard (train_utils.report_throughput's window).
    history_wct = deque(maxlen=cfg.logger.throughput_window_size) if cfg.logger.log_throughput_to_tensorboard else None
    report_memory_flag = True
    total_loss_dict: Dict[str, Any] = {}  # training_log's interval totals (Bridge's argument)
    with heap.steps_frozen(cfg.train.manual_gc):
        while True:
            if ts.step + 1 in cfg.train.iterations_to_skip:  # 1-indexed, as Megatron's option
                skip_iteration(global_state, step_iterator)
                if checkpoint_and_decide_exit(global_state, model, optimizer, scheduler,
                                              ts.floating_point_operations_so_far, checkpointing_context,
                                              train_data_iterator):
                    break
                continue
            # 1. one optimizer step
            if global_state.signal_handler is not None:
                # C code loaded on the way may have taken the stop signals without Python knowing:
                # taken back (one sigaction query a stop signal; signal_recorder)
                global_state.signal_handler.rearm()
            ft.step_start(ts.step)
            ft.maybe_simulate_fault(ts.step)
            straggler.step_start()
            # The step's time on the host clock, without synchronizing the device (a synchronization
            # here would leave the GPU idle while the host logs and prepares the next step): each step
            # waits for its own forward and backward (the loss checks), so the host runs at most one
            # optimizer step ahead, and the times add up to the wall time.
            step_start = time.perf_counter()
            start_position = rerun.position_of(train_data_iterator)
            loss_dict, skipped_iter, _, should_exit, _, grad_norm, num_zeros_in_grad = train_step(
                forward_step_func, step_iterator, model, optimizer, scheduler, global_state)
            step_time_s = time.perf_counter() - step_start
            straggler.step_end()
            ft.step_end(ts.step)
            rerun.report_rerun(global_state, ts.step + 1, should_exit)  # collective only after a re-run
            if should_exit:
                # The step failed result validation and does not count: save the one before (at the data
                # position this step started from) and stop, for the reason rerun.report_rerun agreed on.
                checkpoint_and_decide_exit(global_state, model, optimizer, scheduler, ts.floating_point_operations_so_far,
                                           checkpointing_context, start_position)
                break

            # 2. counters; the straggler verdict (collective on report steps, the same on every rank)
            step_flops = _count_step(global_state, step_time_s, skipped_iter)
            if ts.step == global_state.run_start_step + 1:  # start-up done: the short collective timeout
                parallel.set_timeout_after_init(cfg)
            if history_wct is not None:
                history_wct.append(time.time() - global_state.start_time)
            if straggler.check(ts.step):
                global_state.straggler_stop = True

            # 3. log, evaluate, housekeeping
            # (an evaluation first, so that its loss joins this step's record in metrics.jsonl)
            if (cfg.validation.eval_interval and ts.step % cfg.validation.eval_interval == 0
                    and ts.step >= (cfg.validation.start_eval_at_iter or 0) and valid_data_iterator is not None):
                # As Megatron: with overlapped param all-gather the shards from the last optimizer step
                # arrive only in the next training forward, so evaluation gathers them first.
                with forward_pre_hooks_off(global_state, model):
                    evaluate_and_print_results(global_state, f"iteration {ts.step}", forward_step_func,
                                               valid_data_iterator, model, process_non_loss_data_func, non_loss_data_func)
            learning_rate, decoupled_learning_rate = _learning_rates(optimizer, cfg)
            if not cfg.logger.skip_train_metrics_log:
                report_memory_flag = training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate,
                                                  _loss_scale(optimizer, cfg, ts.step),
                                                  report_memory_flag, skipped_iter, grad_norm, None, num_zeros_in_grad,
                                                  cfg, global_state, history_wct, model, step_time_s=step_time_s)
            post_training_step_callbacks(model, step_flops, None, ts.step, prof, cfg)
            if prof is not None and ts.step >= cfg.profiling.profile_step_end:
                prof = None

            # 4. save and/or stop
            if checkpoint_and_decide_exit(global_state, model, optimizer, scheduler, ts.floating_point_operations_so_far,
                                          checkpointing_context, train_data_iterator):
                break
    if prof is not None:
        prof.stop()
    _finish_train(global_state)


def _finish_train(global_state: GlobalState, checkpoint_manager: Any = None) -> None:
    """The end of the loop (Bridge's function and signature): Bridge's ``checkpoint_manager``, when one is
    given, finishes its pending async saves (``finalize_async_saves(state=, blocking=True, terminate=True)``,
    as Bridge calls it); then the TensorBoard events written so far reach the file, so that an evaluation
    or a teardown after the loop that dies loses none of them. This loop passes no manager: its async
    saves are finished by the exit decision that ended it (:func:`checkpoint_and_decide_exit`), and fault
    tolerance and straggler detection shut down after the final evaluation (``pretrain``), which they
    still watch."""
    if checkpoint_manager is not None:
        checkpoint_manager.finalize_async_saves(state=global_state, blocking=True, terminate=True)
    writer = global_state.tensorboard_logger
    if writer is not None:
        writer.flush()


def _handle_mxfp8_param_buffer_copy(optimizer, reuse_grad_buf_for_mxfp8_param_ag: Any,
                                    overlap_param_gather: Any, model: Any = None) -> None:
    """Bridge's: with MXFP8 parameters whose all-gather reuses the gradient buffer and overlaps the
    forward, the main parameters are copied into the (shared) parameter buffer after the gradient
    buffer is zeroed, else the all-gather would send zeros. With ``model`` (Bridge's newer signature,
    ``(optimizer, model, reuse_grad_buf_for_mxfp8_param_ag, overlap_param_gather)``, by keyword or in
    that order), not while the forward pre-hooks are off (``model[0]`` has no
    ``remove_forward_pre_hook_handles``: the first step's parameters are in place already). The
    documented order without ``model`` works too. ``optimizer.reuse_grad_buf_for_mxfp8_param_ag`` needs
    Transformer Engine's MXFP8 and is refused without it, so here this runs only by reading; its
    condition and call are megatron-core's ``DistributedOptimizer._copy_main_params_to_param_buffer``."""
    if isinstance(model, bool) and not isinstance(reuse_grad_buf_for_mxfp8_param_ag, bool):
        # Bridge's newer positional order: (optimizer, model, reuse, overlap)
        model, reuse_grad_buf_for_mxfp8_param_ag, overlap_param_gather = (
            reuse_grad_buf_for_mxfp8_param_ag, overlap_param_gather, model)
    if not (reuse_grad_buf_for_mxfp8_param_ag and overlap_param_gather):
        return
    if model is not None and not getattr(model[0], "remove_forward_pre_hook_handles", None):
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, DistributedOptimizer):
            inner._copy_main_params_to_param_buffer()


def _learning_rates(optimizer, cfg) -> Tuple[Optional[float], Optional[float]]:
    """The learning rate of the first parameter group without a decoupled one, and with
    ``optimizer.decoupled_lr`` the rate of the groups that follow it (the embedding and output layer's;
    see ``engine.config.default_config_overrides``), as Bridge's loop reports both."""
    groups = optimizer.param_groups
    decoupled = cfg.optimizer.decoupled_lr
    if decoupled is None:
        return (groups[0]["lr"] if groups else None), None
    plain = [g["lr"] for g in groups if g.get("max_lr") != decoupled]
    coupled = [g["lr"] for g in groups if g.get("max_lr") == decoupled]
    return (plain[0] if plain else None), (coupled[0] if coupled else None)


def _loss_scale(optimizer, cfg, step: int) -> float:
    """The fp16 loss scale, read on log steps only (reading it waits for the device); 1.0 otherwise and
    without a scaler (bf16, fp32, CPU)."""
    if step % cfg.logger.log_interval != 0:
        return 1.0
    return float(optimizer.get_loss_scale())


def skip_iteration(state: GlobalState, data_iterator) -> None:
    """``train.iterations_to_skip`` (Megatron's): the iteration's micro-batches are read and dropped, so
    the data position moves on as if it had trained; there is no forward, no update and no scheduler
    step; the iteration counts, its samples as consumed and skipped (``skipped_train_samples``)."""
    cfg, ts = state.cfg, state.train_state
    if data_iterator is not None:
        for _ in range(get_num_microbatches(state)):
            next(data_iterator)
        data_iterator.advance()  # the RerunDataIterator keeps nothing of a skipped iteration for a re-run
    ts.step += 1
    ts.consumed_train_samples += cfg.train.global_batch_size
    ts.skipped_train_samples += cfg.train.global_batch_size
    if state.rank == 0:
        logger.info("iteration %d skipped (train.iterations_to_skip): its %d samples read and dropped", ts.step,
                    cfg.train.global_batch_size)


def _count_step(state: GlobalState, step_time_s: float, skipped_iter: int) -> float:
    """Advance the counters a checkpoint carries and the timings the exit policy reads; the progress
    log gets ``First step`` after a run's first one. Returns the step's FLOPs."""
    cfg, ts = state.cfg, state.train_state
    first_of_run = ts.step == state.run_start_step
    state.slowest_step_s = max(state.slowest_step_s, step_time_s)
    state.last_step_time = time.time()
    ts.step += 1
    ts.consumed_train_samples += cfg.train.global_batch_size
    if skipped_iter:
        ts.skipped_train_samples += cfg.train.global_batch_size
    step_flops = num_floating_point_operations(cfg, cfg.train.global_batch_size)
    ts.floating_point_operations_so_far += step_flops
    if first_of_run and state.startup is not None:
        state.startup.mark("first step")
        phases = state.startup.describe()
        if state.rank == 0:
            logger.info("start-up to the first step: %s%s", phases, "" if bytecode_cache.in_use is None else
                        f" (the installed packages have no bytecode: compiled modules kept in {bytecode_cache.in_use})")
        if state.progress is not None:
            state.progress.first_step(ts.step, phases)
    return step_flops
