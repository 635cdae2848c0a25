"""Model parallelism on megatron-core: tensor (with sequence), pipeline (with virtual stages) and
context parallelism, on GPUs.

Everything here is megatron-core's own machinery, wired the way Megatron-LM wires it:

- the groups come from ``parallel_state.initialize_model_parallel`` (:func:`initialize`);
- with pipeline parallelism each rank builds the layers of its stage, one chunk per virtual stage
  (:func:`build_model_chunks`), and a step runs megatron-core's pipeline schedule from
  ``get_forward_backward_func`` (:func:`pipelined_forward_backward`) with its hooks set as Megatron
  sets them (:func:`install_schedule_hooks`); without it the loop's own
  :func:`bridge_hpc.training.train.forward_backward` runs, unchanged;
- gradients are finished by ``finalize_model_grads`` (data-parallel reduce, tied embeddings across
  stages, sequence-parallel norms across the tensor-parallel group); the gradient norm and clipping
  run over the optimizer's model-parallel statistics group (:mod:`bridge_hpc.training.engine.optimizer`);
- a micro-batch is read once per tensor-parallel group and broadcast within it, then cut into this
  rank's part of the sequence under context parallelism (:func:`broadcast_batch_within_tp`,
  :func:`bridge_hpc.training.gpt_step.get_batch`);
- losses exist only on the last pipeline stage; :func:`share_last_stage_values` brings them to every
  rank (rank 0 logs them) in the same all-reduce that agrees on the ranks' stop observations, so
  every stage of every group stops at the same iteration.

The CPU path (gloo, torch DDP) has one rank per model: megatron-core's schedules and sharded
checkpoints need CUDA, so a model-parallel size above 1 is refused there, naming the key. Expert
parallelism runs there too (:mod:`bridge_hpc.training.engine.moe`: the experts' all-gather dispatcher
over gloo, their gradients reduced over their own group).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from megatron.core import parallel_state

from bridge_hpc.contracts.errors import ConfigError


def check_supported(cfg) -> None:
    """On the ranks, before any group is built: model parallelism runs on GPUs."""
    m = cfg.model
    if m.model_parallel_size > 1 and not torch.cuda.is_available():
        key = next(f"model.{k}" for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                           "context_parallel_size") if getattr(m, k) > 1)
        raise ConfigError("model parallelism needs GPUs: megatron-core's pipeline schedules, distributed "
                          "optimizer and sharded checkpoints run on CUDA, and this rank has none", key=key)
    if m.is_moe and not torch.cuda.is_available():
        m.check_moe_kernels(gpus=False)


def initialize(cfg) -> None:
    """megatron-core's groups for ``[model]``'s sizes (data parallelism is what is left)."""
    m, d = cfg.model, cfg.dist
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=(m.virtual_pipeline_model_parallel_size
                                              if (m.virtual_pipeline_model_parallel_size or 1) > 1 else None),
        context_parallel_size=m.context_parallel_size,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size,
        distributed_timeout_minutes=cfg.dist.distributed_timeout_minutes,
        nccl_communicator_config_path=d.nccl_communicator_config_path,
        use_sharp=d.use_sharp,
        sharp_enabled_group=d.sharp_enabled_group,
        order="tp-cp-ep-pp-dp" if d.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        create_gloo_process_groups=d.use_gloo_process_groups,
        high_priority_stream_groups=list(d.high_priority_stream_groups or []) or None,
    )


def set_timeout_after_init(cfg) -> None:
    """``dist.distributed_timeout_seconds_after_init``: once the first step is done (start-up, with its
    compilation and checkpoint load, needed the long timeout), every process group of this rank waits at
    most that long, so a hung collective ends the job in seconds instead of ``distributed_timeout_minutes``.
    Uses torch's ``_set_pg_timeout`` (what Megatron-LM calls for the same option)."""
    seconds = cfg.dist.distributed_timeout_seconds_after_init
    if seconds is None or not torch.distributed.is_initialized():
        return
    import datetime

    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    timeout = datetime.timedelta(seconds=seconds)
    for group in list(_world.pg_map):
        _set_pg_timeout(timeout, group)


def model_parallel_sizes() -> Dict[str, int]:
    """This run's tensor/pipeline/context-parallel sizes (``tp``, ``pp``, ``cp``); the data-parallel size is
    the world over their product. A checkpoint records them in its ``run_config.json``."""
    if not parallel_state.model_parallel_is_initialized():
        return {"tp": 1, "pp": 1, "cp": 1}
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "cp": parallel_state.get_context_parallel_world_size()}


def pipeline_size() -> int:
    return parallel_state.get_pipeline_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1


def build_model_chunks(model_cfg, provider: Callable[..., torch.nn.Module]) -> List[torch.nn.Module]:
    """The model parts this rank holds: the whole model without pipeline parallelism, else its
    stage's layers, one chunk per virtual stage. ``provider(model_cfg, pre_process, post_process,
    vp_stage)`` builds one (the embedding where ``pre_process``, the output layer where ``post_process``)."""
    if pipeline_size() == 1:
        return [provider(model_cfg)]
    vpp = model_cfg.virtual_pipeline_model_parallel_size if (model_cfg.virtual_pipeline_model_parallel_size or 1) > 1 else None
    chunks = []
    for i in range(vpp or 1):
        vp_stage = i if vpp else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunks.append(provider(model_cfg, pre_process=first, post_process=last, vp_stage=vp_stage))
    return chunks


# ---------------------------------------------------------------------------------------------
# The pipelined step
# ---------------------------------------------------------------------------------------------


def install_schedule_hooks(model: List[torch.nn.Module], optimizer, cfg) -> None:
    """Set the model config's hooks that megatron-core's pipeline schedules call, as Megatron-LM's
    ``setup_model_and_optimizer`` does: no gradient sync until a chunk's last micro-batch (and, with
    overlapped reduce, each chunk's reduce started as its backward ends), the parameter all-gather
    of the next step per chunk (``comm_overlap.align_param_gather``; the reduce's start per chunk only
    with ``dist.align_grad_reduce``, Megatron-LM's rule), the gradient finalization
    and the loss scale. Pipeline communication: ``comm_overlap.overlap_p2p_comm`` /
    ``batch_p2p_comm`` (Bridge's defaults: overlapped with virtual stages, batched without)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    one = (lambda funcs: funcs[0]) if len(model) == 1 else (lambda funcs: funcs)
    d = cfg.ddp
    if d.overlap_grad_reduce:
        config.no_sync_func = one([chunk.no_sync for chunk in model])
        if cfg.dist.align_grad_reduce:  # Megatron-LM's rule: false lets every stage reduce at its own time
            config.grad_sync_func = one([chunk.start_grad_sync for chunk in model])
    overlap = cfg.comm_overlap
    interleaved = len(model) > 1
    align = overlap.align_param_gather if overlap is not None and overlap.align_param_gather is not None else interleaved
    if d.overlap_param_gather and align:
        config.param_sync_func = one([chunk.start_param_sync for chunk in model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    p2p_overlap = overlap.overlap_p2p_comm if overlap is not None and overlap.overlap_p2p_comm is not None else interleaved
    p2p_batch = overlap.batch_p2p_comm if overlap is not None and overlap.batch_p2p_comm is not None else not p2p_overlap
    if p2p_overlap and p2p_batch:
        raise ConfigError("comm_overlap.overlap_p2p_comm and comm_overlap.batch_p2p_comm cannot both be on",
                          key="comm_overlap.batch_p2p_comm")
    config.overlap_p2p_comm, config.batch_p2p_comm = p2p_overlap, p2p_batch


class ChunkViews:
    """One data iterator seen by every virtual-stage chunk of a rank: chunk ``c``'s ``k``-th read is
    the ``k``-th micro-batch of the one iterator (read when the first chunk asks, dropped when the
    last has had it). So the rank reads each micro-batch once and keeps one data position, the one
    its checkpoints record."""

    def __init__(self, iterator: Iterator, chunks: int):
        self.iterator = iterator
        self.reads = [0] * chunks
        self.buffer: List[Any] = []
        self.offset = 0  # micro-batches dropped from the front of the buffer

    def view(self, chunk: int) -> Iterator:
        views = self

        class _View:
            def __iter__(self):
                return self

            def __next__(self):
                return views.next_for(chunk)

        return _View()

    def next_for(self, chunk: int) -> Any:
        k = self.reads[chunk]
        while k - self.offset >= len(self.buffer):
            self.buffer.append(next(self.iterator))
        item = self.buffer[k - self.offset]
        self.reads[chunk] += 1
        done = min(self.reads) - self.offset
        if done > 0:
            del self.buffer[:done]
            self.offset += done
        return item


def pipelined_forward_backward(forward_step_func: Callable, data_iterator, model: List[torch.nn.Module],
                               num_microbatches: int, seq_length: int, micro_batch_size: int,
                               forward_only: bool = False, collect_non_loss_data: bool = False,
                               validate_loss: Optional[Callable[[torch.Tensor], None]] = None) -> List[Any]:
    """One global batch through megatron-core's pipeline schedule (1F1B, or interleaved with virtual
    stages); returns the loss functions' reports, which only the last stage has (an empty list
    elsewhere). ``validate_loss`` sees each micro-batch's loss as the loss function returned it,
    as in the loop's own :func:`bridge_hpc.training.train.forward_backward`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    step = _validating(forward_step_func, validate_loss) if validate_loss is not None else forward_step_func
    if len(model) > 1 and data_iterator is not None:
        views = ChunkViews(data_iterator, len(model))
        iterators: Any = [views.view(c) for c in range(len(model))]
    else:
        iterators = data_iterator
    grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_context:
        reports = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterators, model=model if len(model) > 1 else model[0],
            num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
            decoder_seq_length=seq_length, forward_only=forward_only, collect_non_loss_data=collect_non_loss_data)
    return list(reports) if reports else []


def _validating(forward_step_func: Callable, validate_loss: Callable[[torch.Tensor], None]) -> Callable:
    def step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def checked(output_tensor, *args, **kwargs):
            outputs = loss_func(output_tensor, *args, **kwargs)
            if not kwargs.get("non_loss_data") and isinstance(outputs, tuple) and len(outputs) in (2, 3):
                validate_loss(outputs[0])
            return outputs

        return output, checked

    return step


# ---------------------------------------------------------------------------------------------
# Losses and stop observations from the last stage to every rank
# ---------------------------------------------------------------------------------------------

#: Report keys of the last stage's loss function, per purpose ("train", "eval"): asked once, then
#: every step's values travel in one all-reduce (the keys must stay the same from step to step, as
#: Megatron's logging also assumes).
_LAST_STAGE_KEYS: Dict[str, List[str]] = {}


def share_last_stage_values(reduced: Dict[str, torch.Tensor], flags: Optional[Dict[str, bool]], purpose: str,
                            device: torch.device) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, bool]]]:
    """Under pipeline parallelism: the last stage's (data-parallel reduced) values on every rank, and
    each of ``flags`` OR-ed over all ranks, in one all-reduce over the world. Every rank of the last
    stage holds the same values (tensor-parallel ranks compute the same loss), so the sum over the
    world divided by the last stage's rank count is that value."""
    world = torch.distributed.get_world_size()
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    keys = _LAST_STAGE_KEYS.get(purpose)
    if keys is None:
        box = [sorted(reduced) if last_stage else None]
        torch.distributed.broadcast_object_list(box, src=world - 1)
        keys = _LAST_STAGE_KEYS[purpose] = list(box[0])
    if last_stage and sorted(reduced) != keys:
        raise RuntimeError(f"the loss function's report keys changed from {keys} to {sorted(reduced)}: "
                           "under pipeline parallelism they must stay the same from step to step")
    flag_names = list(flags) if flags is not None else []
    values = [float(reduced[k]) if last_stage else 0.0 for k in keys]
    packed = torch.tensor(values + [1.0 if flags[k] else 0.0 for k in flag_names], dtype=torch.float32, device=device)
    if packed.numel():
        torch.distributed.all_reduce(packed)
    holders = world // pipeline_size()
    shared = {k: packed[i] / holders for i, k in enumerate(keys)}
    agreed = {k: bool(packed[len(keys) + i] > 0) for i, k in enumerate(flag_names)} if flags is not None else None
    return shared, agreed


# ---------------------------------------------------------------------------------------------
# Data within the tensor-parallel group
# ---------------------------------------------------------------------------------------------


def broadcast_batch_within_tp(batch: Optional[Dict[str, torch.Tensor]], device: torch.device) -> Dict[str, torch.Tensor]:
    """The micro-batch that the tensor-parallel group's first rank read (``batch``; None on the
    others, whose data iterators only keep the position), on every rank of the group and on
    ``device``: its keys, shapes and dtypes first, then one broadcast per tensor."""
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    first = parallel_state.get_tensor_model_parallel_rank() == 0
    box = [[(k, tuple(v.shape), v.dtype) for k, v in batch.items()] if first else None]
    torch.distributed.broadcast_object_list(box, src=src, group=group, device=device)
    out = {}
    for key, shape, dtype in box[0]:
        tensor = batch[key].to(device, non_blocking=True) if first else torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(tensor, src=src, group=group)
        out[key] = tensor
    return out


def reads_data() -> bool:
    """Whether this rank reads micro-batches itself: the first of its tensor-parallel group does,
    and broadcasts them to the others."""
    if not parallel_state.model_parallel_is_initialized():
        return True
    return parallel_state.get_tensor_model_parallel_rank() == 0
