"""Forward pre-hooks of megatron-core's DDP (overlapped parameter all-gather): when to turn them off,
and off around a checkpoint save, whose tensors the all-gather must not change under it.

Megatron Bridge's names (``should_disable_forward_pre_hook``, ``enable_forward_pre_hook``,
``disable_forward_pre_hook``), re-exported at their Bridge path :mod:`bridge_hpc.training.train`.
"""

from __future__ import annotations

import contextlib
from typing import Any, List

from bridge_hpc.training.state import GlobalState


def should_disable_forward_pre_hook(use_megatron_fsdp: bool, use_distributed_optimizer: bool,
                                    overlap_param_gather: bool) -> bool:
    """Whether checkpoint saves must turn megatron-core DDP's forward pre-hooks off (Bridge's rule).

    With the distributed optimizer and ``overlap_param_gather``, ``optimizer.step()`` updates only
    this rank's shard of the parameters; the all-gather that brings the other shards is started by
    forward pre-hooks during the next forward. Between the step and that forward the model's
    parameters are stale outside the local shard, and a save would write them.
    :func:`disable_forward_pre_hook` with ``param_sync=True`` finishes the all-gather first.
    Megatron FSDP gathers parameters its own way, so the rule does not apply to it (this toolkit
    has no FSDP: callers pass False).
    """
    return not use_megatron_fsdp and use_distributed_optimizer and overlap_param_gather


def enable_forward_pre_hook(model: List[Any]) -> None:
    """Register megatron-core DDP's forward pre-hooks again on every model chunk (after
    :func:`disable_forward_pre_hook`). Raises TypeError for a chunk that is not megatron-core DDP."""
    for chunk in _megatron_ddp_chunks(model):
        chunk.enable_forward_pre_hook()


def disable_forward_pre_hook(model: List[Any], param_sync: bool = True) -> None:
    """Remove megatron-core DDP's forward pre-hooks from every model chunk; with ``param_sync`` first
    run the parameter all-gather synchronously, so that every chunk holds its current parameters.
    Raises TypeError for a chunk that is not megatron-core DDP."""
    for chunk in _megatron_ddp_chunks(model):
        chunk.disable_forward_pre_hook(param_sync=param_sync)


def _megatron_ddp_chunks(model: List[Any]) -> List[Any]:
    from megatron.core.distributed import DistributedDataParallel

    for chunk in model:
        if not isinstance(chunk, DistributedDataParallel):
            raise TypeError(f"forward pre-hooks exist only on megatron-core DistributedDataParallel chunks (the GPU "
                            f"path); got {type(chunk).__module__}.{type(chunk).__qualname__}")
    return list(model)


@contextlib.contextmanager
def forward_pre_hooks_off(state: GlobalState, model: List[Any]):
    """Parameters all-gathered and forward pre-hooks off inside, on again after, when
    :func:`should_disable_forward_pre_hook` holds for ``ddp.use_distributed_optimizer`` and
    ``ddp.overlap_param_gather`` (exactly when megatron-core DDP registers the hooks). Nothing to do
    on CPU: there the chunks are torch DDP, which ignores both settings and has no such hooks."""
    d = state.cfg.ddp
    toggle = should_disable_forward_pre_hook(False, d.use_distributed_optimizer, d.overlap_param_gather)
    if toggle:
        from megatron.core.distributed import DistributedDataParallel

        toggle = all(isinstance(chunk, DistributedDataParallel) for chunk in model)
    if not toggle:
        yield
        return
    disable_forward_pre_hook(model, param_sync=True)
    try:
        yield
    finally:
        enable_forward_pre_hook(model)
