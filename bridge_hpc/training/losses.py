"""Megatron Bridge's loss functions (``bridge.training.losses``) for a GPT's per-token losses.

A GPT forward with labels returns the cross-entropy of every position, ``[batch, seq]``. Which
positions count is the batch's ``loss_mask``: 0 for padding, for end-of-document tokens with
``eod_mask_loss``, for prompt tokens when fine-tuning. The loss function returns the *sum* over the
counted positions with their number — Bridge's token-aware ``(loss, num_tokens, report)`` pattern —
so the loop divides by the tokens actually counted instead of by the batch shape, and the report
``[sum, count]`` can be added across micro-batches and data-parallel ranks into an exact per-token mean.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch


def masked_token_loss(loss_mask: torch.Tensor,
                      output_tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Sum of the per-token losses where ``loss_mask`` is set, the number of such tokens, and the report.

    Returns ``(loss, num_tokens, {"lm loss": [loss, num_tokens]})``: ``loss`` is a float32 scalar
    that carries the gradient, ``num_tokens`` an int tensor, the report detached. The mask may be
    0/1 floats or bools; losses are summed in float32 whatever the model's precision.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


#: Bridge's name for the GPT step's loss (``bridge.training.losses.masked_next_token_loss``): the
#: per-token losses of next-token prediction under the mask, exactly :func:`masked_token_loss`.
masked_next_token_loss = masked_token_loss
