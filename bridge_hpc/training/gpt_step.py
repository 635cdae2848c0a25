"""Megatron Bridge's GPT forward step (``bridge.training.gpt_step``): batch in, ``(output, loss_func)`` out.

It serves mock data and megatron-core's ``GPTDataset`` alike. A batch holds ``tokens``, ``labels``,
``loss_mask`` and ``position_ids``; samples from indexed data with ``reset_attention_mask`` (or with
``skip_getting_attention_mask_from_dataset = false``) also carry megatron's ``attention_mask``
(``[b, 1, s, s]``, True = masked out), which then goes to the model; without it the attention is
plain causal. A blend adds ``dataset_id``, which the step does not need. ``bridge_hpc.training.gpt``
re-exports these names, their import path before this module existed.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, Iterable

import torch

from bridge_hpc.training.losses import masked_token_loss
from bridge_hpc.training.state import GlobalState


def get_batch(data_iterator: Iterable) -> Dict[str, torch.Tensor]:
    """Next micro-batch, its tensors on the current device (a blocking copy unless pinned)."""
    batch = next(data_iterator)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def forward_step(state: GlobalState, data_iterator: Iterable, model, return_schedule_plan: bool = False):
    """Bridge's GPT forward step: read a batch, run the model with labels, return the masked loss function."""
    timer = state.timers("batch-generator", log_level=2)
    timer.start()
    batch = get_batch(data_iterator)
    timer.stop()
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(masked_token_loss, batch["loss_mask"])
