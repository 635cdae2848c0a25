"""The loop's own collectives: the loss values and stop flags of a step reduced across data-parallel
ranks in one all-reduce (or riding on the last gradient bucket's), read on the host without a wait.

These are the loop's, not Megatron Bridge's API: :mod:`bridge_hpc.training.utils.train_utils` keeps
Bridge's documented names; the loop, the rerun state machine, the exit policy and the async writer
take these from here. Nothing assumes a CUDA device: under gloo the collectives run on the CPU
(:func:`comm_device`).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch


def comm_device() -> torch.device:
    """Where tensors for collectives must live: the current GPU under nccl, else the CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def slowest_rank(seconds: float) -> float:
    """``seconds`` measured on every rank -> the largest of them, on every rank (one all-reduce).

    A phase every rank goes through together (a checkpoint load) lasts as long as its slowest rank;
    each rank's own clock differs by its scheduling, so a figure that several ranks record (rank 0
    in progress.txt, the last rank in TensorBoard) must be agreed before it is written."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=comm_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value.item())


def reduce_loss_dicts(loss_dicts: List[Dict[str, torch.Tensor]], group=None) -> Dict[str, torch.Tensor]:
    """Reduce the per-microbatch report dicts of one global batch to one value per key.

    As in Megatron Bridge: a 2-element value ``[loss_sum, num_tokens]`` is summed over
    microbatches and data-parallel ranks, then divided (a per-token mean over the global batch);
    a 1-element value is averaged over microbatches and then over data-parallel ranks.
    """
    return reduce_loss_dicts_and_flags(loss_dicts, group)[0]


def reduce_loss_dicts_and_flags(loss_dicts: List[Dict[str, torch.Tensor]], group=None,
                                flags: Optional[Dict[str, bool]] = None
                                ) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, bool]]]:
    """:func:`reduce_loss_dicts`, and the logical OR of each of ``flags`` over all ranks, in ONE
    all-reduce (SUM) where ``group`` spans the world: every key's values and the flags packed in one
    tensor. Why: the loop needs both every step (the loss to log, the stop observations to agree
    on), and on gloo each small all-reduce cost about 1.5 ms of a 45 ms CPU step, most of it CPU
    time. Keys are packed in sorted order, so every rank issues the same collective. Returns
    ``(reduced, agreed flags or None)``."""
    return start_reduce_loss_dicts_and_flags(loss_dicts, group, flags)()


class PackedReports:
    """One global batch's loss reports (and optionally the ranks' stop observations) packed in ONE
    float tensor, so that one SUM all-reduce serves both, and read back from the reduced tensor.

    Keys are packed in sorted order, so every rank builds the same layout. A 2-element report
    ``[loss_sum, num_tokens]`` is summed over micro-batches (then over ranks, then divided: a
    per-token mean); a 1-element report is averaged over micro-batches (then over ranks). The flags
    ride along only when the data-parallel group is the world (``flags_ride``); a flag is agreed when
    any rank raised it (a SUM above 0). :func:`start_reduce_loss_dicts_and_flags` all-reduces
    :attr:`tensor` by itself; :class:`bridge_hpc.training.engine.grad_reduce_rider.GradReduceRider` appends
    it to the data-parallel gradient all-reduce instead."""

    def __init__(self, loss_dicts: List[Dict[str, torch.Tensor]], flags: Optional[Dict[str, bool]],
                 dp_size: int, world: int, device: torch.device):
        self.keys = sorted(loss_dicts[0].keys()) if loss_dicts else []
        self.dp_size = dp_size
        self.flags = flags
        parts, self.kinds = [], []
        for key in self.keys:
            values = [torch.as_tensor(d[key]).detach().float().view(-1).to(device) for d in loss_dicts]
            if values[0].numel() == 2:
                parts.append(torch.vstack(values).sum(dim=0))
            elif values[0].numel() == 1:
                parts.append(torch.cat(values).mean().view(1))
            else:
                raise ValueError(f"loss report '{key}' must have 1 or 2 elements, got shape {tuple(values[0].shape)}")
            self.kinds.append(values[0].numel())
        self.flag_names = list(flags) if flags is not None else []
        self.flags_ride = bool(self.flag_names) and dp_size == world
        if self.flags_ride:
            parts.append(torch.tensor([1.0 if flags[k] else 0.0 for k in self.flag_names], device=device))
        self.tensor: Optional[torch.Tensor] = torch.cat(parts) if parts else None

    def unpack(self, reduced: Optional[torch.Tensor],
               separate_flags: Optional[torch.Tensor] = None) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, bool]]]:
        """``(reduced report per key, agreed flags or None)`` from :attr:`tensor` after its SUM over the
        data-parallel group (``reduced``); ``separate_flags``: the flags' own MAX all-reduce when they
        did not ride along (None on a single rank: this rank's flags stand)."""
        out: Dict[str, torch.Tensor] = {}
        offset = 0
        for key, kind in zip(self.keys, self.kinds):
            if kind == 2:
                total = reduced[offset:offset + 2]
                out[key] = total[0] / total[1].clamp(min=1)
            else:
                out[key] = reduced[offset] / self.dp_size if self.dp_size > 1 else reduced[offset]
            offset += kind
        agreed = None
        if self.flags is not None:
            if self.flags_ride:
                agreed = {k: v > 0 for k, v in zip(self.flag_names, reduced[offset:].tolist())}
            elif separate_flags is not None:
                agreed = {k: bool(v) for k, v in zip(self.flag_names, separate_flags.tolist())}
            else:
                agreed = dict(self.flags)
        return out, agreed


def start_reduce_loss_dicts_and_flags(loss_dicts: List[Dict[str, torch.Tensor]], group=None,
                                      flags: Optional[Dict[str, bool]] = None
                                      ) -> Callable[[], Tuple[Dict[str, torch.Tensor], Optional[Dict[str, bool]]]]:
    """:func:`reduce_loss_dicts_and_flags` in two halves: this one packs (:class:`PackedReports`) and
    issues the all-reduce (asynchronously) and returns the function that waits for it and reads the
    result. The loop issues it before the optimizer step and reads it after: on GPUs the read then
    finds it done and what the loop does between steps overlaps the optimizer's kernels instead of
    following a drained GPU."""
    dp_size = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    device = comm_device()
    packed = PackedReports(loss_dicts, flags, dp_size, world, device)
    works = []
    if packed.tensor is not None and dp_size > 1:
        works.append(torch.distributed.all_reduce(packed.tensor, group=group, async_op=True))
    separate = None
    if flags is not None and not packed.flags_ride and world > 1:
        # the data-parallel group is not the world: the flags need their own collective
        separate = torch.tensor([1 if flags[k] else 0 for k in packed.flag_names], dtype=torch.int32, device=device)
        works.append(torch.distributed.all_reduce(separate, op=torch.distributed.ReduceOp.MAX, async_op=True))

    if device.type != "cuda" or packed.tensor is None:
        def finish() -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, bool]]]:
            for work in works:
                work.wait()
            return packed.unpack(packed.tensor, separate)

        return finish
    # On GPUs the loop reads the losses and the flags on the host every step, and a plain read would
    # wait for everything queued before it, the optimizer step included, leaving the GPU idle while the
    # host then prepares the next step. The copy to host is queued now, right behind the collectives
    # (the stream, not the host, waits for them), and ``finish`` waits for that copy only: the reports
    # it returns are host tensors.
    for work in works:
        work.wait()
    host_tensor = _copy_to_host_async(packed.tensor)
    host_separate = _copy_to_host_async(separate) if separate is not None else None
    copied = torch.cuda.Event()
    copied.record()

    def finish_from_host() -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, bool]]]:
        copied.synchronize()
        return packed.unpack(host_tensor, host_separate)

    return finish_from_host


def _copy_to_host_async(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


