"""Helpers the loop calls: forward-step state injection, FLOPs, the step log and its reports (memory,
throughput, runtime, gradient and parameter norms) and the model-parallel collectives behind them;
at the end, in a section of its own, the model hooks (value head, frozen MoE router) that Bridge's
page documents for external trainers and the loop never calls. The loop's own loss reduction is
:mod:`bridge_hpc.training.engine.collectives`.

The names, signatures and behaviour are those of Megatron Bridge's
``megatron.bridge.training.utils.train_utils``, so code written against Bridge works unchanged.
Where this module differs it says so in the function's docstring; the differences are that nothing
assumes a CUDA device (collectives use the CPU under gloo, see :func:`comm_device`), and that the
step reports run on log steps (``step % logger.log_interval == 0``) rather than every TensorBoard step.

The injection rules are Megatron Bridge's, so a Bridge ``forward_step`` works unchanged:
``(data_iterator, model)``, ``(data_iterator, model, return_schedule_plan=False)``,
``(state: GlobalState, data_iterator, model)`` and
``(state: GlobalState, data_iterator, model, return_schedule_plan=False)``; the state is found by a
``GlobalState`` type hint on any parameter, else by the first parameter being named ``state`` or
``global_state``.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
from collections import defaultdict
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

from bridge_hpc.contracts import metrics_file
from bridge_hpc.training.config import ProfilingConfig, TrainingConfig
from bridge_hpc.training.engine.collectives import comm_device
from bridge_hpc.training.state import GlobalState, TrainState
from bridge_hpc.training.state import get_rank_safe as _rank
from bridge_hpc.training.state import get_world_size_safe as _world_size
from bridge_hpc.training.utils.model_hooks import (  # noqa: F401 - Bridge's names at Bridge's path
    LinearForLastLayer,
    ModelHook,
    ModelList,
    _ensure_model_list,
    _freeze_parameter_if_present,
    create_value_head_hook,
    freeze_moe_router,
    make_value_model,
)

logger = logging.getLogger(__name__)



# ---------------------------------------------------------------------------------------------
# Forward-step functions
# ---------------------------------------------------------------------------------------------


def _is_global_state_annotation(annotation: Any) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if annotation is GlobalState:
        return True
    # ``from __future__ import annotations`` leaves the hint as a string; Bridge's own class counts too.
    if isinstance(annotation, str):
        return annotation.split(".")[-1].strip("'\"") == "GlobalState"
    return getattr(annotation, "__name__", None) == "GlobalState"


def needs_global_state_injection(forward_step_func: Callable) -> bool:
    """Whether ``forward_step_func`` wants the GlobalState as its first argument.

    First any parameter annotated ``GlobalState``; failing that, a first parameter named
    ``state`` or ``global_state``. For functors ``inspect.signature`` reads ``__call__`` (without
    ``self``).
    """
    params = list(inspect.signature(forward_step_func).parameters.values())
    if any(_is_global_state_annotation(p.annotation) for p in params):
        return True
    return bool(params) and params[0].name in ("state", "global_state")


def maybe_inject_state(forward_step_func: Callable, state: GlobalState,
                       needs_injection: Optional[bool] = None) -> Callable:
    """``functools.partial(forward_step_func, state)`` when it wants the state, else the function."""
    if needs_injection is None:
        needs_injection = needs_global_state_injection(forward_step_func)
    return partial(forward_step_func, state) if needs_injection else forward_step_func


def prepare_forward_step_func(forward_step_func: Callable, state: GlobalState) -> Callable:
    """Inspect once and wrap once, before the loop.

    The partial holds a reference to ``state`` (not a copy), so counters it reads stay current;
    a functor is wrapped as the same instance, so its own attributes keep counting.
    """
    return maybe_inject_state(forward_step_func, state, needs_global_state_injection(forward_step_func))


# ---------------------------------------------------------------------------------------------
# Throughput bookkeeping
# ---------------------------------------------------------------------------------------------


def num_floating_point_operations(cfg, batch_size: int) -> float:
    """Rough training FLOPs of one global batch: 6·N·tokens for the weights a token passes through
    plus attention.

    Used for the cumulative ``floating_point_operations_so_far`` counter and TFLOP/s (and MFU) in the
    log; it is an estimate (causal attention counted at half of the full score matrix). In an MoE layer
    N counts the *active* parameters: the router, the ``moe_router_topk`` experts a token is sent to and
    the shared expert, not every expert.
    """
    m = cfg.model
    h, s, layers = m.hidden_size, m.seq_length, m.num_layers
    kv = (m.kv_channels or h // m.num_attention_heads) * m.num_query_groups
    q = (m.kv_channels or h // m.num_attention_heads) * m.num_attention_heads
    gated = 2 if m.activation_func == "swiglu" else 1

    def mlp(width: int) -> int:
        return h * width * gated + width * h

    moe_layers = sum(m.moe_layer_pattern()) if getattr(m, "num_moe_experts", None) else 0
    attention_params = h * (q + 2 * kv) + q * h
    mlp_params = (layers - moe_layers) * mlp(m.ffn_hidden_size)
    if moe_layers:
        mlp_params += moe_layers * (sum(mlp(width) for width in m.active_ffn_widths()) + h * m.num_moe_experts)
    tokens = batch_size * s
    dense = 6 * tokens * (layers * attention_params + mlp_params + h * m.vocab_size)
    attention = 6 * tokens * layers * s * q  # QK^T and AV, fwd+bwd, causal half of 2·2·s·q each
    return float(dense + attention)


# ---------------------------------------------------------------------------------------------
# CUDA memory history
# ---------------------------------------------------------------------------------------------


def memory_snapshot_file(profiling: ProfilingConfig, rank: int, tag: str = "") -> str:
    """Where a rank's snapshot goes: ``<memory_snapshot_path stem>_<tag><rank><ext>`` (Bridge's names:
    ``snapshot_0.pickle`` at ``profile_step_end``, ``snapshot_oom_rank-0.pickle`` on an out-of-memory)."""
    base, ext = os.path.splitext(profiling.memory_snapshot_path)
    return f"{base}_{tag}{rank}{ext}"


def start_memory_history_recording(profiling: Optional[ProfilingConfig]) -> None:
    """Enable the CUDA caching allocator trace so memory snapshots contain history.

    ``torch.cuda.memory._snapshot()`` only includes allocation/free events and Python stack context
    after ``_record_memory_history()`` has been enabled. Without this call, dumped snapshots contain
    only the current live allocations: no timeline, no call sites.

    Must be invoked before model construction so every tensor allocation is captured. Guarded by
    ``profile_ranks`` so only ranks that will dump a snapshot pay the recording overhead. Does
    nothing unless ``profiling.record_memory_history``. The snapshot is written by :func:`training_log`
    at step ``profiling.profile_step_end`` (and on an out-of-memory error) and opens in
    https://pytorch.org/memory_viz.

    Without a CUDA device there is no caching allocator to trace: a warning says so and nothing is
    recorded (no snapshot will be written).
    """
    if profiling is None or not profiling.record_memory_history:
        return
    rank = _rank()
    if rank not in profiling.profile_ranks:
        return
    if not torch.cuda.is_available():
        logger.warning("profiling.record_memory_history is on, but rank %d has no CUDA device: CUDA memory "
                       "history is not recorded and no snapshot will be written", rank)
        return
    # Up to 100k alloc/free events, each with its Python and C++ stack (memory_viz shows the call sites).
    torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _oom_observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        """Dump a snapshot on OOM, to see what was live at the failure."""
        filename = memory_snapshot_file(profiling, rank, "oom_rank-")
        torch.cuda.memory._dump_snapshot(filename)
        logger.info("[OOM] rank %d saved memory snapshot to %s", rank, filename)

    if hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
        torch._C._cuda_attach_out_of_memory_observer(_oom_observer)
    logger.info("Memory history recording enabled (rank %d); snapshots will be written to '%s'.", rank,
                memory_snapshot_file(profiling, rank))


def _maybe_dump_memory_snapshot(profiling: ProfilingConfig, step: int) -> Optional[str]:
    """At ``profile_step_end``, on profiled ranks with CUDA: write the allocator snapshot; returns its path."""
    if not profiling.record_memory_history or step != profiling.profile_step_end:
        return None  # every other step: decided without asking torch.distributed for the rank
    rank = _rank()
    if rank not in profiling.profile_ranks or not torch.cuda.is_available():
        return None
    filename = memory_snapshot_file(profiling, rank)
    torch.cuda.memory._dump_snapshot(filename)
    logger.info("Saved memory snapshot to %s", filename)
    return filename


# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------

#: ``torch.cuda.memory_stats()`` key -> the name :func:`report_memory` reports it under ("bytes"
#: becomes "gigabytes" in the name, as the value is converted).
MEMORY_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "active_bytes.all.current": "mem-active-bytes",
    "inactive_split_bytes.all.current": "mem-inactive-bytes",
    "reserved_bytes.all.current": "mem-reserved-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
    "active_bytes.all.peak": "mem-max-active-bytes",
    "inactive_split_bytes.all.peak": "mem-max-inactive-bytes",
    "reserved_bytes.all.peak": "mem-max-reserved-bytes",
    "num_alloc_retries": "mem-alloc-retires",
    "allocation.all.current": "mem-allocated-count",
}


def param_is_not_shared(param: nn.Parameter) -> bool:
    """Check if a parameter is marked as not shared.

    megatron-core marks the second copy of a tied weight (the output layer's copy of the word
    embeddings on the last pipeline stage) ``shared = True``; norms count it once, on the first stage.

    Returns:
        bool: True if the parameter does not have a 'shared' attribute or if param.shared is False.
    """
    return not hasattr(param, "shared") or not param.shared


def _norm_squared(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared L2 norms of ``tensors`` as a 1-element fp32 tensor on ``device`` (for collectives).

    ``torch._foreach_norm`` computes the per-tensor norms in one fused kernel per device and dtype on
    CUDA (what Bridge gets from apex/TE's ``multi_tensor_l2norm``) and works on CPU too.
    """
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch._foreach_norm(list(tensors))
    return torch.stack([n.float().to(device) for n in norms]).square().sum().reshape(1)


def calc_params_l2_norm(model: Union[MegatronModule, list[MegatronModule]], model_config: Any,
                        use_megatron_fsdp: bool = False, force_create_fp32_copy: bool = False) -> float:
    """Calculate the L2 norm of model parameters across all GPUs.

    Handles parameter sharding (DP, TP, PP, EP) and different parameter types (dense, MoE, sharded
    main params), as megatron does: a parameter is counted on one rank only (tensor-parallel
    duplicates, i.e. parameters not split over TP, are counted on TP rank 0; ``shared`` copies of tied
    weights are skipped); dense squared norms are summed over the model-parallel group (TP x PP),
    expert ones over expert-TP x EP x PP, sharded fp32 main parameters (distributed optimizer) over
    DP x CP. Every rank gets the same value. Collective: every rank of the job must call it.

    Args:
        model (Union[torch.nn.Module, list[torch.nn.Module]]): The model or list of model chunks.
        model_config: The model configuration object (its ``bf16`` says whether parameters are bf16).
        use_megatron_fsdp: Parameters are DTensors of Megatron FSDP (see :func:`calc_dtensor_params_l2_norm`).
        force_create_fp32_copy (bool, optional): If True, always creates an FP32 copy for norm
            calculation, ignoring potential `main_param` attributes. Defaults to False.

    Returns:
        float: The L2 norm of all parameters.
    """
    if not isinstance(model, list):
        model = [model]
    if use_megatron_fsdp:
        params = []
        for chunk in model:
            chunk.stop_communication()
            for name, param in chunk.named_parameters():
                if not hasattr(param, "_local_tensor"):
                    raise RuntimeError(f"Megatron FSDP requires parameters are PyTorch DTensor. "
                                       f"Parameter {name} is not a DTensor.")
                params.append(param)
        return calc_dtensor_params_l2_norm(params)

    params_data: List[torch.Tensor] = []
    moe_params_data: List[torch.Tensor] = []
    sharded_params_data: List[torch.Tensor] = []
    data_parallel_group = None
    for chunk in model:
        for param in chunk.parameters():
            data_parallel_group = get_data_parallel_group_if_dtensor(param, data_parallel_group)
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            is_expert = not getattr(param, "allreduce", True)
            if not is_expert and not param_is_not_shared(param):
                continue
            param = to_local_if_dtensor(param)
            target = moe_params_data if is_expert else params_data
            if model_config.bf16:
                if not force_create_fp32_copy and hasattr(param, "main_param"):
                    if getattr(param, "main_param_sharded", False):
                        if param.main_param is not None:
                            sharded_params_data.append(param.main_param)
                    else:
                        target.append(param.main_param)
                else:
                    # No fp32 main copy to read: make one, so the norm is not computed in bf16.
                    target.append(param.data.float())
            else:
                target.append(param.data)

    device = comm_device()
    dist = torch.distributed
    norm_2 = _norm_squared(params_data, device)
    if data_parallel_group is not None:
        dist.all_reduce(norm_2, op=dist.ReduceOp.SUM, group=data_parallel_group)
    # Main parameters sharded by the distributed optimizer: each DP x CP rank holds a slice.
    sharded_norm_2 = _norm_squared(sharded_params_data, device)
    dist.all_reduce(sharded_norm_2, op=dist.ReduceOp.SUM, group=parallel_state.get_data_parallel_group(
        with_context_parallel=True))
    norm_2 += sharded_norm_2
    # Expert norms count even on ranks without expert parameters (zeros), so every rank joins the
    # same collectives whatever its layers.
    moe_norm_2 = _norm_squared(moe_params_data, device)
    dense_group = parallel_state.get_model_parallel_group()
    expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    if dist.get_process_group_ranks(dense_group) == dist.get_process_group_ranks(expert_group):
        norm_2 += moe_norm_2
        dist.all_reduce(norm_2, op=dist.ReduceOp.SUM, group=dense_group)
    else:
        dist.all_reduce(norm_2, op=dist.ReduceOp.SUM, group=dense_group)
        dist.all_reduce(moe_norm_2, op=dist.ReduceOp.SUM, group=expert_group)
        norm_2 += moe_norm_2
    return norm_2.item() ** 0.5


def calc_dtensor_params_l2_norm(params) -> float:
    """Calculate l2 norm of DTensor parameters.

    Local shards are grouped by their DTensor spec; a group's squared norm is summed over each mesh
    dimension the spec shards along (``Shard``) and taken once along replicated ones (``Replicate``).
    Other placements (``Partial``) raise. Collective over the meshes' groups.
    """
    params_data = defaultdict(list)
    for param in params:
        params_data[param._spec].append(param._local_tensor)
    device = comm_device()
    total_norm_2 = torch.zeros(1, dtype=torch.float32, device=device)
    for dtensor_spec, local_tensors in params_data.items():
        norm_2 = _norm_squared([t for t in local_tensors if t.numel() > 0], device)
        for pg, placement in zip(dtensor_spec.device_mesh.get_all_groups(), dtensor_spec.placements):
            if placement.is_shard():
                torch.distributed.all_reduce(norm_2, op=torch.distributed.ReduceOp.SUM, group=pg)
            elif placement.is_replicate():
                pass  # every rank of this dimension holds the same values: count them once
            else:
                raise RuntimeError(f"Unsupported placement {placement} for Megatron FSDP.")
        total_norm_2 += norm_2
    return total_norm_2.item() ** 0.5


# ---------------------------------------------------------------------------------------------
# Collectives over model-parallel groups
# ---------------------------------------------------------------------------------------------


def reduce_max_stat_across_model_parallel_group(stat: Optional[float], mp_group) -> Optional[float]:
    """Calculates the max of a stat across the model parallel group.

    Handles cases where some ranks might have the stat as None (e.g., grad norm on ranks without an
    optimizer). (Bridge stands None in as -1.0, so a stat of -1.0 everywhere reads as None there;
    here the stand-in is -inf.)

    Args:
        stat (float): The statistic value (or None) on the current rank.
        mp_group: The process group to reduce across (typically pg_collection.mp).

    Returns:
        float: The maximum value of the statistic across the model parallel group, or None if all
        ranks had None.
    """
    value = torch.tensor([float("-inf") if stat is None else float(stat)], dtype=torch.float32,
                         device=comm_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mp_group)
    result = value.item()
    return None if result == float("-inf") else result


def logical_and_across_model_parallel_group(input: bool, mp_group) -> bool:
    """Performs a logical AND operation across the model parallel group.

    Args:
        input (bool): The boolean value on the current rank.
        mp_group: The process group to reduce across (typically pg_collection.mp).

    Returns:
        bool: The result of the logical AND across all ranks in the group.
    """
    value = torch.tensor([1 if input is True else 0], dtype=torch.int, device=comm_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=mp_group)
    return bool(value.item())


def reduce_max_memory_across_pp_group(memory_report: dict[str, Union[int, float]],
                                      pp_group) -> dict[str, Union[int, float]]:
    """Reduce per-rank memory metrics across the PP group with MAX.

    With pipeline parallelism, peak GPU memory is typically dominated by the first PP stage
    (activation buildup), while TensorBoard writes on the last rank only; without aggregation the
    logged values would reflect only the last PP stage and under-report true peak headroom.

    This helper performs a single bulk all-reduce with MAX over the PP group so that the writer rank
    emits the per-metric peak across the pipeline. Counter-style integer keys (e.g. ``alloc_retries``)
    are preserved as ``int`` so dashboards continue to render them correctly.

    No-op when distributed is uninitialized, the PP group has a single rank, or the report is empty.
    All ranks of the group must pass the same keys in the same order.

    Args:
        memory_report: Mapping of metric name to per-rank value.
        pp_group: The pipeline-parallel process group to reduce across.

    Returns:
        A new dict with values replaced by the per-metric MAX across the PP group, or the input report
        unchanged when no reduction is needed.
    """
    if not memory_report:
        return memory_report
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return memory_report
    size = getattr(pp_group, "size", None)
    if not callable(size) or size() <= 1:
        return memory_report
    keys = list(memory_report.keys())
    values = torch.tensor([memory_report[k] for k in keys], dtype=torch.float64, device=comm_device())
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=pp_group)
    reduced: dict[str, Union[int, float]] = {}
    for key, max_val in zip(keys, values.tolist()):
        original = memory_report[key]
        reduced[key] = int(max_val) if isinstance(original, int) and not isinstance(original, bool) else max_val
    return reduced


# ---------------------------------------------------------------------------------------------
# Reports (one dict of TensorBoard tag -> value each)
# ---------------------------------------------------------------------------------------------


def report_memory(memory_keys: Optional[dict[str, str]]) -> dict:
    """Logs the memory usage of the model, from ``torch.cuda.memory_stats()`` of the current device.

    The statistics recorded by default (:data:`MEMORY_KEYS`): current and peak allocated, active,
    inactive (non-releasable) and reserved memory, in gigabytes (10^9 bytes, rounded to 5 significant
    digits; "bytes" in the name becomes "gigabytes"), the number of failed cudaMalloc calls that
    caused a cache flush and retry (``mem-alloc-retires``, Bridge's spelling) and the number of live
    allocations.

    Args:
        memory_keys (dict[str, str], optional): A dict specifying memory statistics to log. Keys are
            the names of memory statistics to log from `torch.cuda.memory_stats()`, and values are
            the names they will be logged under. If not provided, the above statistics are logged.

    Returns:
        Memory metrics dictionary. Empty without CUDA (``memory_stats()`` has nothing to report).
    """
    memory_stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    memory_keys = memory_keys if memory_keys else MEMORY_KEYS
    memory_report = {}
    for torch_name, name in memory_keys.items():
        if torch_name not in memory_stats:
            continue
        if "bytes" in torch_name:
            gigabytes = memory_stats[torch_name] / 1.0e9
            if gigabytes != 0:
                order_of_magnitude = int(math.floor(math.log10(abs(gigabytes))))
                gigabytes = round(gigabytes, -order_of_magnitude + 4)
            memory_report[name.replace("bytes", "gigabytes")] = gigabytes
        else:
            memory_report[name] = memory_stats[torch_name]
    return memory_report


def report_l2_norm_grad(model: list[MegatronModule]) -> dict:
    """Computes and logs the L2 norm of gradients.

    L2 norms are calculated after the reduction of gradients across GPUs. This function iterates over
    the parameters of the model and may cause a reduction in throughput while training large models.
    In order to ensure the correctness of the norm, this function should be called after gradient
    unscaling in cases where gradients are scaled. (After the optimizer step, as in the loop, the
    gradients are also clipped: ``optimizer.clip_grad`` clips them in place.)

    Records ``l2_norm/grad/<parameter name>`` for each parameter that requires a gradient and has one
    (megatron-core DDP's ``main_grad``, else ``.grad``) and ``l2_norm/grad/global``, the square root of
    the sum of their squares. The norms are of this rank's parameters (no model-parallel reduction).

    Args:
        model (Union[MegatronModule, list[MegatronModule]]): megatron model state.

    Returns:
        Dictionary with L2 norms for each layer.
    """
    names: List[str] = []
    grads: List[torch.Tensor] = []
    seen = set()
    for chunk in _ensure_model_list(model):
        for name, p in chunk.named_parameters():
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            key = f"l2_norm/grad/{name}"
            if p.requires_grad and grad is not None and key not in seen:
                seen.add(key)
                names.append(key)
                grads.append(grad)
    if not grads:
        return {"l2_norm/grad/global": 0.0}
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(grads[0].device) for g in grads])
    values = norms.tolist() + [float(norms.square().sum().sqrt())]  # one device sync for all of them
    return dict(zip(names + ["l2_norm/grad/global"], values))


_TIME_UNITS = {"seconds": 1, "minutes": 60, "hours": 60 * 60, "days": 60 * 60 * 24}


def report_runtime(train_state: TrainState, start_time: int, seq_length: int, train_iters: int,
                   time_unit: str = "seconds") -> dict:
    """Estimates total training time.

    The training time is computed by taking the time elapsed for the current duration and
    multiplying out to the full extended length of the training run. This is a best-attempt estimate:
    it is inaccurate if throughput changes, and on a resumed run (``start_time`` is this run's start
    while ``train_state.step`` counts earlier runs' steps too) it is optimistic.

    Records ``time/remaining_estimate`` (estimated time to completion), ``time/tokens`` (consumed
    tokens), ``time/samples`` (consumed samples), ``time/batches`` (steps) and ``time/total`` (time
    since ``start_time``), times in ``time_unit``.

    Args:
        train_state: the run's counters (``step`` >= 1).
        start_time (int): time when training was started (``time.time()`` seconds).
        seq_length (int): model sequence length.
        train_iters (int): number of train iters to be done per training.
        time_unit (str, optional): 'seconds', 'minutes', 'hours', or 'days'. Defaults to 'seconds'.
    """
    if time_unit not in _TIME_UNITS:
        raise ValueError(f'Invalid time_unit: {time_unit}. Must be one of "seconds", "minutes", "hours", or "days".')
    divider = _TIME_UNITS[time_unit]
    elapsed_dur = train_state.step / train_iters
    elapsed_time = time.time() - start_time
    remaining_time = elapsed_time / elapsed_dur * (1 - elapsed_dur)
    return {
        "time/remaining_estimate": remaining_time / divider,
        "time/tokens": train_state.consumed_train_samples * seq_length,
        "time/samples": train_state.consumed_train_samples,
        "time/batches": train_state.step,
        "time/total": elapsed_time / divider,
    }


def report_throughput(train_config: TrainingConfig, iteration: int, seq_length: int, history_wct: list,
                      window_size: int) -> dict:
    """Logs the training throughput and utilization, once ``window_size`` step times are known.

    ``history_wct`` holds the wall-clock time (seconds since the run's start) at the end of each
    recent step, the last one being ``iteration``'s. The last ``window_size`` of them span
    ``window_size - 1`` steps of ``global_batch_size`` samples of ``seq_length`` tokens each. (Bridge
    uses its whole history, whose loop keeps ``window_size + 1`` times, against ``window_size - 1``
    steps, which under-reports by 1/window_size; here the times and steps always match.)

    Records ``throughput/batches_per_sec``, ``throughput/samples_per_sec``,
    ``throughput/tokens_per_sec``, the same divided by the world size under ``throughput/device/``,
    and ``throughput/micro_batch_size`` and ``throughput/global_batch_size``. Empty until the window
    is full, or when the times do not advance (a logged warning).

    Args:
        train_config (TrainingConfig): model train config.
        iteration (int): current train iteration.
        seq_length (int): model sequence length.
        history_wct (list): list of elapsed time per each iteration.
        window_size (int, optional): Number of batches to use for a rolling average of throughput.

    Returns:
        Dictionary with throughput metrics.
    """
    if len(history_wct) < window_size:
        return {}
    wct = list(history_wct)[-window_size:]
    elapsed_batches = window_size - 1
    elapsed_samples = elapsed_batches * train_config.global_batch_size
    elapsed_tokens = elapsed_samples * seq_length
    elapsed_wct = wct[-1] - wct[0]
    if elapsed_wct <= 0:
        logger.warning("elapsed_wct is %s, skipping throughput calculation at iteration %d", elapsed_wct, iteration)
        return {}
    world_size = _world_size()
    batches_per_sec = elapsed_batches / elapsed_wct
    samples_per_sec = elapsed_samples / elapsed_wct
    metrics = {
        "throughput/batches_per_sec": batches_per_sec,
        "throughput/samples_per_sec": samples_per_sec,
        "throughput/device/batches_per_sec": batches_per_sec / world_size,
        "throughput/device/samples_per_sec": samples_per_sec / world_size,
        "throughput/micro_batch_size": train_config.micro_batch_size,
        "throughput/global_batch_size": train_config.global_batch_size,
    }
    if elapsed_tokens > 0:
        tokens_per_sec = elapsed_tokens / elapsed_wct
        metrics["throughput/tokens_per_sec"] = tokens_per_sec
        metrics["throughput/device/tokens_per_sec"] = tokens_per_sec / world_size
    return metrics


# ---------------------------------------------------------------------------------------------
# The step log
# ---------------------------------------------------------------------------------------------


def _logging_groups(pg_collection: Optional[Any]) -> Tuple[Any, Any, Any]:
    """``(mp, pp, dp)``: the process groups :func:`training_log` reduces and reports over, those of
    ``pg_collection`` (Bridge's ``ProcessGroupCollection``, or any object with those attributes) where it
    has them, else megatron-core's (the trainer sets up megatron-core's global parallel state, which is
    what its models' ``pg_collection`` holds; Bridge reads the model's), None before that is set up."""
    initialized = parallel_state.model_parallel_is_initialized()

    def pick(name: str, default: Callable[[], Any]) -> Any:
        group = getattr(pg_collection, name, None) if pg_collection is not None else None
        return group if group is not None else (default() if initialized else None)

    return (pick("mp", parallel_state.get_model_parallel_group),
            pick("pp", parallel_state.get_pipeline_model_parallel_group),
            pick("dp", parallel_state.get_data_parallel_group))


def _max_learning_rate(learning_rate: Optional[float], mp_group: Any) -> Optional[float]:
    """Bridge's reduction of the learning rate over the model-parallel group (a rank without trainable
    parameters has none), in float64 so that the rate logged is the scheduler's to the last bit (Bridge's
    :func:`reduce_max_stat_across_model_parallel_group` rounds it to float32). A group of one rank has
    nothing to reduce: no collective."""
    if mp_group is None or not torch.distributed.is_initialized() or torch.distributed.get_world_size(mp_group) <= 1:
        return learning_rate
    value = torch.tensor([float("-inf") if learning_rate is None else float(learning_rate)], dtype=torch.float64,
                         device=comm_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mp_group)
    result = value.item()
    return None if result == float("-inf") else result


def _log_step_reports(global_state: GlobalState, model: Optional[ModelList],
                      history_wct: Optional[Sequence[float]], pp_group: Any = None) -> Dict[str, Any]:
    """The reports ``logger`` asks for, as TensorBoard tag -> value (``params_norm`` for the parameter
    norm). Collective where a report is (parameter norm, memory over ``pp_group``): every rank runs it on
    the same steps with the same settings."""
    cfg, ts = global_state.cfg, global_state.train_state
    log = cfg.logger
    reports: Dict[str, Any] = {}
    if log.log_params_norm and model is not None:
        reports["params_norm"] = calc_params_l2_norm(model, cfg.model)
    if log.log_memory_to_tensorboard:
        memory = report_memory(memory_keys=log.memory_keys)
        memory = reduce_max_memory_across_pp_group(memory, pp_group)
        reports.update({f"memory/{name}": value for name, value in memory.items()})
    if log.log_throughput_to_tensorboard and history_wct is not None:
        reports.update(report_throughput(cfg.train, ts.step, cfg.model.seq_length, list(history_wct),
                                         log.throughput_window_size))
    if log.log_runtime_to_tensorboard:
        reports.update(report_runtime(ts, global_state.start_time, cfg.model.seq_length, cfg.train.train_iters,
                                      log.runtime_time_unit))
    if log.log_l2_norm_grad_to_tensorboard and model is not None:
        reports.update(report_l2_norm_grad(model))
    return reports


class _MoeMetricFanoutWriter:
    """SummaryWriter-shaped adapter that fans add_scalar to MLFlow / Comet.

    megatron-core's ``track_moe_metrics`` and ``track_mtp_metrics`` emit metrics through a TensorBoard
    ``writer.add_scalar(name, value, iteration)`` call (and a separate ``wandb_writer.log(...)`` call).
    They do not know about MLFlow or Comet, so those backends would never see MoE / MTP metrics. This
    adapter wraps the real TB writer (or stands in for a missing one) and forwards every ``add_scalar`` to
    MLFlow and Comet with the same per-step value. W&B is unaffected: the helpers still get
    ``wandb_writer`` directly.

    Tensors are sanitized with ``.item()`` before being handed to MLFlow / Comet (TB tolerates 0-d
    tensors; MLFlow / Comet do not). Given ``GlobalState.mlflow_logger`` / ``comet_logger``, the values
    join the step's record and reach each backend once, when the step's checkpoint is saved
    (:mod:`bridge_hpc.training.utils.log_backends`).
    """

    def __init__(self, tb_writer: Optional[Any], comet_logger: Optional[Any], mlflow_logger: Optional[Any]) -> None:
        self._tb_writer = tb_writer
        self._comet_logger = comet_logger
        self._mlflow_logger = mlflow_logger

    @staticmethod
    def _sanitize(value: Any) -> Any:
        """Convert 0-d torch tensors to Python scalars; pass other values through."""
        if isinstance(value, torch.Tensor):
            try:
                return value.item()
            except (RuntimeError, ValueError):
                return value
        return value

    def add_scalar(self, name: str, value: Any, iteration: int) -> None:
        """Forward an add_scalar call to TB (if any), MLFlow, and Comet."""
        if self._tb_writer is not None:
            self._tb_writer.add_scalar(name, value, iteration)
        if self._mlflow_logger is not None or self._comet_logger is not None:
            from bridge_hpc.training.utils.log_backends import sanitize_mlflow_metrics

            metrics = {name: self._sanitize(value)}
            if self._mlflow_logger is not None:
                self._mlflow_logger.log_metrics(sanitize_mlflow_metrics(metrics), step=iteration)
            if self._comet_logger is not None:
                self._comet_logger.log_metrics(metrics, step=iteration)


def _timer_reports(global_state: GlobalState, record: Optional[Dict[str, Any]]) -> List[str]:
    """With ``logger.timing_log_level`` >= 1: each timer's milliseconds per step since the last log step,
    reduced over the ranks as ``logger.timing_log_option`` says (``max``; ``minmax``: the fastest and
    the slowest rank; ``all``: every rank), as Megatron's timers report them. Added to ``record`` (the
    max, ``<name>-time``) when given; returns the console lines (rank 0 prints them). A collective on
    log steps, which every rank reaches (the loop calls :func:`training_log` on every rank)."""
    cfg, timers = global_state.cfg, global_state.timers
    if cfg.logger.timing_log_level < 1:
        return []
    steps = max(cfg.logger.log_interval, 1)
    names = sorted(timers.elapsed_all(reset=False))
    if not names:
        return []
    local = torch.tensor([timers(name, 0).elapsed(reset=True) * 1000 / steps for name in names], dtype=torch.float64)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        device = comm_device()
        gathered = [torch.empty_like(local, device=device) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, local.to(device))
        per_rank = torch.stack([g.cpu() for g in gathered])
    else:
        per_rank = local.unsqueeze(0)
    if record is not None:
        record.update({f"{name}-time": float(per_rank[:, i].max()) for i, name in enumerate(names)})
    option = timers.log_option
    if option == "max":
        cells = [f"{name}: {float(per_rank[:, i].max()):.2f}" for i, name in enumerate(names)]
    elif option == "minmax":
        cells = [f"{name}: ({float(per_rank[:, i].min()):.2f}, {float(per_rank[:, i].max()):.2f})"
                 for i, name in enumerate(names)]
    else:
        cells = [f"{name}: " + ", ".join(f"{float(v):.2f}" for v in per_rank[:, i]) for i, name in enumerate(names)]
    what = {"max": "max", "minmax": "(min, max)", "all": "per rank"}[option]
    return [f"(ms per step, {what}) " + " | ".join(cells)]


def _build_moe_metric_writer(tb_writer: Optional[Any], comet_logger: Optional[Any],
                             mlflow_logger: Optional[Any]) -> Optional[Any]:
    """Return a writer suitable for megatron-core's MoE/MTP metric helpers: the TB writer itself when
    neither MLFlow nor Comet is on (no overhead), else a :class:`_MoeMetricFanoutWriter`, even without a TB
    writer (so that Comet / MLFlow on the last rank get MoE / MTP metrics with TensorBoard off)."""
    if comet_logger is None and mlflow_logger is None:
        return tb_writer
    return _MoeMetricFanoutWriter(tb_writer, comet_logger, mlflow_logger)


def _to_bridge_loggers(global_state: GlobalState, record: Dict[str, Any]) -> None:
    """The step's scalars to the loggers ``global_state`` exposes, with the calls Bridge's training_log makes:
    ``wandb_logger.log(scalars, step)``, ``mlflow_logger.log_metrics(scalars, step=step)`` (names sanitized
    as Bridge's MLflow rule says), ``comet_logger.log_metrics(scalars, step=step)``. The scalars are what
    TensorBoard gets of the record, under the same tags (:func:`~bridge_hpc.training.engine.metrics.tensorboard_scalars`):
    the learning rate, the losses, the grad norm, ``samples vs steps``, ``iteration-time``, and on log steps
    the batch size, loss scale, world size, parameter norm and the reports and timers turned on in
    ``[logger]``. The run's own backends (GlobalState's loggers while ``[logger]`` turns them on) get the
    record through the run's metrics already: these calls join the same step's values, sent once, when the
    step's checkpoint is saved (:mod:`bridge_hpc.training.utils.log_backends`)."""
    wandb_logger, mlflow_logger, comet_logger = (global_state.wandb_logger, global_state.mlflow_logger,
                                                 global_state.comet_logger)
    if wandb_logger is None and mlflow_logger is None and comet_logger is None:
        return
    from bridge_hpc.training.engine.metrics import tensorboard_scalars
    from bridge_hpc.training.utils.log_backends import sanitize_mlflow_metrics

    step, scalars = record[metrics_file.STEP], tensorboard_scalars(record)
    if wandb_logger is not None:
        wandb_logger.log(scalars, step)
    if mlflow_logger is not None:
        mlflow_logger.log_metrics(sanitize_mlflow_metrics(scalars), step=step)
    if comet_logger is not None:
        comet_logger.log_metrics(scalars, step=step)


#: ``total_loss_dict``'s counters of the log interval (Megatron's names).
ADVANCED_ITERS_KEY = "advanced iterations"
SKIPPED_ITERS_KEY = "skipped iterations"
NAN_ITERS_KEY = "nan iterations"


def _accumulate(total_loss_dict: Dict[str, Any], losses: Dict[str, float], skipped_iter: int) -> None:
    """Megatron's interval totals: advanced, skipped and NaN/inf iterations, and the sum of each loss over
    the advanced ones (reset on log steps by :func:`training_log`). ``losses``: the step's, as floats."""
    if not skipped_iter:
        total_loss_dict[ADVANCED_ITERS_KEY] = total_loss_dict.get(ADVANCED_ITERS_KEY, 0) + 1
    else:
        total_loss_dict.setdefault(ADVANCED_ITERS_KEY, 0)
    total_loss_dict[SKIPPED_ITERS_KEY] = total_loss_dict.get(SKIPPED_ITERS_KEY, 0) + skipped_iter
    got_nan = False
    for key, number in losses.items():
        if not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + number
        else:
            got_nan = got_nan or not math.isfinite(number)
    total_loss_dict[NAN_ITERS_KEY] = total_loss_dict.get(NAN_ITERS_KEY, 0) + int(got_nan)


def training_log(loss_dict: Dict[str, torch.Tensor], total_loss_dict: Dict[str, Any], learning_rate: Optional[float],
                 decoupled_learning_rate: Optional[float], loss_scale: float, report_memory_flag: bool,
                 skipped_iter: int, grad_norm: Optional[float], params_norm: Optional[float],
                 num_zeros_in_grad: Optional[int], config, global_state: GlobalState, history_wct: Optional[list],
                 model: Optional[ModelList], pg_collection: Optional[Any] = None,
                 log_max_attention_logit: Optional[float] = None, loaded_iteration: int = 0,
                 seq_length: Optional[int] = None, *, step_time_s: Optional[float] = None, metrics=None) -> bool:
    """Log training stats (losses, learning rate, timings, etc.): Megatron Bridge's signature. Every step
    goes to ``global_state.metrics`` (metrics.jsonl, TensorBoard, W&B, MLflow, Comet), with a human line on
    rank 0 every ``logger.log_interval`` steps; on multiples of ``logger.tensorboard_log_interval`` its
    scalars also go to ``global_state.wandb_logger`` / ``mlflow_logger`` / ``comet_logger`` with Bridge's
    calls (:func:`_to_bridge_loggers`), the timers among them. Returns the updated ``report_memory_flag``.

    Args (Bridge's, in Bridge's order): ``loss_dict`` (this step's reduced losses); ``total_loss_dict``
    (accumulates Megatron's interval totals, ``advanced iterations``, ``skipped iterations``, ``nan
    iterations`` and each loss's sum, reset on log steps); ``learning_rate``; ``decoupled_learning_rate``
    (recorded as ``decoupled_lr`` when not None); ``loss_scale`` (recorded on log steps with
    ``logger.log_loss_scale_to_tensorboard``, Megatron's ``loss-scale``); ``report_memory_flag``;
    ``skipped_iter``; ``grad_norm``; ``params_norm`` (used when given, else computed on log steps with
    ``logger.log_params_norm``); ``num_zeros_in_grad``; ``config``; ``global_state``; ``history_wct`` (end
    times of recent steps, ``time.time() - global_state.start_time``); ``model``; ``pg_collection`` (the
    groups of the logging reductions, as in Bridge: the learning rate is the max over its ``mp`` group, a
    rank without trainable parameters having none; its ``pp`` group reduces the memory report; rank 0 of
    its ``dp`` group prints the memory report; megatron-core's groups where it has none, see
    :func:`_logging_groups`); ``log_max_attention_logit`` (``max-attention-logit`` on log steps when given;
    ``logger.log_max_attention_logit`` is refused by the config); ``loaded_iteration``; ``seq_length``
    (tokens per sample, default ``model.seq_length``).

    bridge_hpc's keyword-only extras: ``step_time_s`` (the step's own time, as the loop measures it; else
    the last interval of ``history_wct``) and ``metrics`` (default ``global_state.metrics``).

    The loss goes to the metrics file at full precision (``float`` of the reduced fp32 tensor) so
    two runs can be compared bit for bit.

    On log steps (``step % logger.log_interval == 0``) only, so that the steps in between pay nothing,
    the reports turned on in ``[logger]`` join the step's record (metrics.jsonl, and TensorBoard under
    Megatron Bridge's tags): ``log_params_norm`` (``params-norm``, also on the console line; needs
    ``model``), ``log_memory_to_tensorboard`` (``memory/...``, the MAX over pipeline stages),
    ``log_throughput_to_tensorboard`` (``throughput/...`` over the last ``throughput_window_size`` times
    of ``history_wct``), ``log_runtime_to_tensorboard`` (``time/...``) and
    ``log_l2_norm_grad_to_tensorboard`` (``l2_norm/grad/...``; needs ``model``),
    ``batch-size`` (and ``skipped-train-samples`` once there are any), ``log_loss_scale_to_tensorboard``
    (``loss-scale``), ``log_world_size_to_tensorboard`` (``world-size``),
    ``log_device_memory_used`` (``mem-device-memory-used-gb``, what the driver reports as used on this
    rank's GPU), and with ``timing_log_level`` >= 1 the step's timers (:func:`_timer_reports`: on the
    console line, and with ``log_timers_to_tensorboard`` as ``<name>-time``). Every
    ``log_memory_interval`` steps rank 0 of each data-parallel group prints its memory report. TensorBoard writes a
    record on multiples of ``tensorboard_log_interval``, so keep it a divisor of ``log_interval``.
    With ``report_memory_flag`` the log step prints this rank's memory report once per data-parallel
    group (as Bridge, until the run's second step: by then the optimizer state is allocated). At step
    ``profiling.profile_step_end`` a CUDA memory snapshot is written when ``record_memory_history`` is on.

    The reports that are collectives (parameter norm, memory over PP, the learning rate over a
    model-parallel group of several ranks) must be called by every rank on the same steps: this function
    is, by the loop.
    """
    del loaded_iteration
    metrics = global_state.metrics if metrics is None else metrics
    if step_time_s is None:
        step_time_s = history_wct[-1] - history_wct[-2] if history_wct is not None and len(history_wct) >= 2 else 0.0
    losses = {key: float(value) for key, value in loss_dict.items()}
    _accumulate(total_loss_dict, losses, skipped_iter)
    cfg, ts = global_state.cfg, global_state.train_state
    mp_group, pp_group, dp_group = _logging_groups(pg_collection)
    learning_rate = _max_learning_rate(learning_rate, mp_group)
    tokens = cfg.train.global_batch_size * (seq_length or cfg.model.seq_length)
    record: Dict[str, Any] = {metrics_file.STEP: ts.step}
    for key, value in losses.items():
        record[metrics_file.LOSS if key == "lm loss" else key] = value
    if metrics_file.LOSS not in record and losses:
        record[metrics_file.LOSS] = next(iter(losses.values()))
    record.update({
        metrics_file.LR: learning_rate,
        metrics_file.GRAD_NORM: None if grad_norm is None else float(grad_norm),
        metrics_file.TOKENS_PER_S: tokens / step_time_s if step_time_s > 0 else None,
        metrics_file.STEP_TIME_S: step_time_s,
        metrics_file.CONSUMED_SAMPLES: ts.consumed_train_samples,
        metrics_file.SKIPPED: skipped_iter,
    })
    if decoupled_learning_rate is not None:
        record["decoupled_lr"] = float(decoupled_learning_rate)
    if num_zeros_in_grad is not None:
        record["num_zeros_in_grad"] = int(num_zeros_in_grad)
    log_step = ts.step % cfg.logger.log_interval == 0
    if log_step:
        record.update(_log_step_reports(global_state, model, history_wct, pp_group))
        if params_norm is not None:
            record["params_norm"] = float(params_norm)
        log = cfg.logger
        record["batch_size"] = cfg.train.global_batch_size  # Bridge's batch-size (no batch-size ramp-up here)
        if ts.skipped_train_samples > 0:
            record["skipped_train_samples"] = ts.skipped_train_samples
        if log_max_attention_logit is not None:
            record["max_attention_logit"] = float(log_max_attention_logit)
        if log.log_loss_scale_to_tensorboard:
            record["loss_scale"] = float(loss_scale)
        if log.log_world_size_to_tensorboard:
            record["world_size"] = global_state.world_size
        if log.log_device_memory_used and torch.cuda.is_available():
            record["device_memory_used_gb"] = torch.cuda.device_memory_used() / 2**30
        timer_lines = _timer_reports(global_state, record if log.log_timers_to_tensorboard else None)
        for key in list(total_loss_dict):  # Megatron's interval totals start again
            total_loss_dict[key] = 0 if key in (ADVANCED_ITERS_KEY, SKIPPED_ITERS_KEY, NAN_ITERS_KEY) else 0.0
    metrics.log(record)
    if ts.step % cfg.logger.tensorboard_log_interval == 0:
        _to_bridge_loggers(global_state, record)
    _maybe_dump_memory_snapshot(cfg.profiling, ts.step)

    if log_step and global_state.rank == 0:
        flops = num_floating_point_operations(cfg, cfg.train.global_batch_size)
        tflops = flops / step_time_s / 1e12 / max(global_state.world_size, 1) if step_time_s > 0 else 0.0
        parts = [
            time.strftime("[%Y-%m-%d %H:%M:%S]"),
            f"iteration {ts.step:8d}/{cfg.train.train_iters:8d}",
            f"consumed samples: {ts.consumed_train_samples:12d}",
            f"elapsed time per iteration (ms): {step_time_s * 1000:.1f}",
            f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}",
            f"tokens/s: {record['tokens_per_s'] or 0:.0f}",
            f"learning rate: {learning_rate:.6E}" if learning_rate is not None else "learning rate: n/a",
            f"global batch size: {cfg.train.global_batch_size:5d}",
        ]
        parts += [f"{key}: {float(value):.6E}" for key, value in loss_dict.items()]
        if grad_norm is not None:
            parts.append(f"grad norm: {float(grad_norm):.3f}")
        if "params_norm" in record:
            parts.append(f"params norm: {record['params_norm']:.3f}")
        if cfg.optimizer.fp16:
            parts.append(f"loss scale: {float(loss_scale):.1f}")
        if "num_zeros_in_grad" in record:
            parts.append(f"num zeros: {record['num_zeros_in_grad']}")
        if "decoupled_lr" in record:
            parts.append(f"decoupled learning rate: {record['decoupled_lr']:.6E}")
        parts.append(f"number of skipped iterations: {skipped_iter:3d}")
        print(" | ".join(parts), flush=True)
        for line in timer_lines:
            print(line, flush=True)
    interval = cfg.logger.log_memory_interval
    if (log_step and report_memory_flag) or (interval and ts.step % interval == 0):
        memory = report_memory(cfg.logger.memory_keys)
        dp_rank = torch.distributed.get_rank(group=dp_group) if dp_group is not None else 0
        if memory and dp_rank == 0:
            line = " | ".join(f"{name}: {value}" for name, value in memory.items())
            print(f"[Rank {global_state.rank}] (after {ts.step} iterations) memory (GB) | {line}", flush=True)
        if ts.step > global_state.run_start_step + 1:
            report_memory_flag = False
    return report_memory_flag
