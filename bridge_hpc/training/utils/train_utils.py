"""Helpers the loop calls: forward-step state injection, loss reduction, FLOPs and the step log.

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
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional

import torch

from bridge_hpc.training.state import GlobalState

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
# Loss reduction
# ---------------------------------------------------------------------------------------------


def comm_device() -> torch.device:
    """Where tensors for collectives must live: the current GPU under nccl, else the CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_loss_dicts(loss_dicts: List[Dict[str, torch.Tensor]], group=None) -> Dict[str, torch.Tensor]:
    """Reduce the per-microbatch report dicts of one global batch to one value per key.

    As in Megatron Bridge: a 2-element value ``[loss_sum, num_tokens]`` is summed over
    microbatches and data-parallel ranks, then divided (a per-token mean over the global batch);
    a 1-element value is averaged over microbatches and then over data-parallel ranks.
    Keys are processed in sorted order so every rank issues the same collectives.
    """
    reduced: Dict[str, torch.Tensor] = {}
    if not loss_dicts:
        return reduced
    dp_size = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
    device = comm_device()
    for key in sorted(loss_dicts[0].keys()):
        values = [torch.as_tensor(d[key]).detach().float().view(-1).to(device) for d in loss_dicts]
        if values[0].numel() == 2:
            total = torch.vstack(values).sum(dim=0)
            if dp_size > 1:
                torch.distributed.all_reduce(total, group=group)
            reduced[key] = total[0] / total[1].clamp(min=1)
        elif values[0].numel() == 1:
            mean = torch.cat(values).mean()
            if dp_size > 1:
                torch.distributed.all_reduce(mean, group=group)
                mean = mean / dp_size
            reduced[key] = mean
        else:
            raise ValueError(f"loss report '{key}' must have 1 or 2 elements, got shape {tuple(values[0].shape)}")
    return reduced


# ---------------------------------------------------------------------------------------------
# Throughput bookkeeping
# ---------------------------------------------------------------------------------------------


def num_floating_point_operations(cfg, batch_size: int) -> float:
    """Rough training FLOPs of one global batch: 6·N·tokens for the dense weights plus attention.

    Used for the cumulative ``floating_point_operations_so_far`` counter and TFLOP/s in the log;
    it is an estimate (causal attention counted at half of the full score matrix).
    """
    m = cfg.model
    h, s, layers = m.hidden_size, m.seq_length, m.num_layers
    kv = (m.kv_channels or h // m.num_attention_heads) * m.num_query_groups
    q = (m.kv_channels or h // m.num_attention_heads) * m.num_attention_heads
    mlp_in = m.ffn_hidden_size * (2 if m.activation_func == "swiglu" else 1)
    dense_per_layer = h * (q + 2 * kv) + q * h + h * mlp_in + m.ffn_hidden_size * h
    tokens = batch_size * s
    dense = 6 * tokens * (layers * dense_per_layer + h * m.vocab_size)
    attention = 6 * tokens * layers * s * q  # QK^T and AV, fwd+bwd, causal half of 2·2·s·q each
    return float(dense + attention)


# ---------------------------------------------------------------------------------------------
# The step log
# ---------------------------------------------------------------------------------------------


def training_log(loss_dict: Dict[str, torch.Tensor], learning_rate: Optional[float], skipped_iter: int,
                 grad_norm: Optional[float], num_zeros_in_grad: Optional[int], step_time_s: float,
                 global_state: GlobalState, metrics) -> None:
    """Record one finished step: every step to ``metrics`` (JSON lines, TensorBoard), and a human
    line on rank 0 every ``logger.log_interval`` steps.

    The loss goes to the metrics file at full precision (``float`` of the reduced fp32 tensor) so
    two runs can be compared bit for bit.
    """
    cfg, ts = global_state.cfg, global_state.train_state
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    record: Dict[str, Any] = {"step": ts.step}
    for key, value in loss_dict.items():
        record["loss" if key == "lm loss" else key] = float(value)
    if "loss" not in record and loss_dict:
        record["loss"] = float(next(iter(loss_dict.values())))
    record.update(
        lr=learning_rate,
        grad_norm=None if grad_norm is None else float(grad_norm),
        tokens_per_s=tokens / step_time_s if step_time_s > 0 else None,
        step_time_s=step_time_s,
        consumed_samples=ts.consumed_train_samples,
        skipped=skipped_iter,
    )
    if num_zeros_in_grad is not None:
        record["num_zeros_in_grad"] = int(num_zeros_in_grad)
    metrics.log(record)

    if ts.step % cfg.logger.log_interval == 0 and global_state.rank == 0:
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
        parts.append(f"number of skipped iterations: {skipped_iter:3d}")
        print(" | ".join(parts), flush=True)
