"""Megatron Bridge's GPT forward step (``bridge.training.gpt_step``): batch in, ``(output, loss_func)`` out.

It serves mock data and megatron-core's ``GPTDataset`` alike. A batch holds ``tokens``, ``labels``,
``loss_mask`` and ``position_ids``; samples from indexed data with ``reset_attention_mask`` (or with
``skip_getting_attention_mask_from_dataset = false``) also carry megatron's ``attention_mask``
(``[b, 1, s, s]``, True = masked out), which then goes to the model; without it the attention is
plain causal. A blend adds ``dataset_id``, which the step does not need. ``bridge_hpc.training.engine.model``
re-exports these names, their import path before this module existed.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, Iterable

import torch
from megatron.core import parallel_state

from bridge_hpc.training.engine.parallel import broadcast_batch_within_tp
from bridge_hpc.training.losses import masked_token_loss
from bridge_hpc.training.state import GlobalState


def get_batch(data_iterator: Iterable) -> Dict[str, torch.Tensor]:
    """Next micro-batch, its tensors on the current device (a blocking copy unless pinned).

    With tensor parallelism the group's first rank reads it and broadcasts it to the others (their
    iterators hand out None and keep the position); with context parallelism each rank then keeps its
    two balanced chunks of the sequence (megatron-core's ``get_batch_on_this_cp_rank``)."""
    batch = next(data_iterator)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if not parallel_state.model_parallel_is_initialized():
        return {key: value.to(device, non_blocking=True) for key, value in batch.items()}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        batch = broadcast_batch_within_tp(batch, device)
    else:
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
    if parallel_state.get_context_parallel_world_size() > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank

        # Per-token tensors only ([b, s], the mask [b, 1, s, s]); a blend's dataset_id is per sample.
        batch.update(get_batch_on_this_cp_rank({k: v for k, v in batch.items() if v.dim() >= 2}))
    return batch


def forward_step(state: GlobalState, data_iterator: Iterable, model, return_schedule_plan: bool = False):
    """Bridge's GPT forward step: read a batch, run the model with labels, return the masked loss function."""
    timer = state.timers("batch-generator", log_level=2)
    timer.start()
    batch = get_batch(data_iterator)
    timer.stop()
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(masked_token_loss, batch["loss_mask"])
