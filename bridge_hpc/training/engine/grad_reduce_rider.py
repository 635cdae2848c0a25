"""The step's loss reports and stop observations, reduced inside the data-parallel gradient all-reduce.

Every step the loop needs the global batch's loss (to log) and every rank's stop observations (so
that all ranks stop at the same step). Reduced by their own all-reduce, they cost a second
collective a step besides the gradients' own. On CPU ranks (gloo) that collective was most of the
loop's overhead against a bare loop: about 1.4 ms of wall time and 0.75 ms of CPU time of a 12-15 ms
step of the demo model (``benchmarks/loop_overhead.py``), where the target is 3 % in all.

Where torch's ``DistributedDataParallel`` reduces the gradients (CPU ranks), the values need no
collective of their own: :class:`GradReduceRider` registers a DDP communication hook that appends
them (a :class:`~bridge_hpc.training.engine.collectives.PackedReports`, a few floats) to the last
gradient bucket of the step's synchronizing backward and splits them off after the all-reduce. The
gradients are reduced as by torch's default hook (divided by the group size, then summed); the
values are summed as the separate all-reduce sums them, so the reduced losses and agreed flags are
the same bit for bit. On GPUs megatron-core's DDP reduces the gradients in buckets of its own and
the separate all-reduce, issued before the optimizer step, overlaps it: the rider is not installed.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from bridge_hpc.training.engine.collectives import PackedReports

#: The riders installed, by the DDP module whose gradients they ride on.
_RIDERS: "weakref.WeakKeyDictionary[torch.nn.Module, GradReduceRider]" = weakref.WeakKeyDictionary()


class GradReduceRider:
    """Values that ride along one DDP module's gradient all-reduce: :meth:`load` them before the
    backward that synchronizes the gradients, :meth:`take` them reduced after it."""

    def __init__(self) -> None:
        self._pending: Optional[PackedReports] = None
        self._reduced: Optional[Tuple[PackedReports, torch.Tensor]] = None

    @classmethod
    def install(cls, ddp: torch.nn.parallel.DistributedDataParallel) -> "GradReduceRider":
        rider = cls()
        ddp.register_comm_hook(None, rider._hook)
        _RIDERS[ddp] = rider
        return rider

    @staticmethod
    def on(module: torch.nn.Module) -> Optional["GradReduceRider"]:
        """The rider installed on ``module``, or None (megatron-core's DDP, a user's own wrapper)."""
        return _RIDERS.get(module)

    def load(self, loss_dicts: List[Dict[str, torch.Tensor]], flags: Optional[Dict[str, bool]]) -> None:
        """Pack the reports of the step's micro-batches and this rank's flags for the next synchronizing
        backward (a re-run of the step loads again and replaces them)."""
        world = dist.get_world_size()
        self._pending = PackedReports(loss_dicts, flags, world, world, torch.device("cpu"))
        self._reduced = None

    def take(self) -> Optional[Callable[[], Tuple[Dict[str, torch.Tensor], Optional[Dict[str, bool]]]]]:
        """The reduced reports and agreed flags of the last synchronizing backward, as the function
        :func:`~bridge_hpc.training.engine.collectives.start_reduce_loss_dicts_and_flags` returns; None
        when nothing rode along (nothing loaded, or a gradient dtype the values cannot share)."""
        reduced, self._reduced, self._pending = self._reduced, None, None
        if reduced is None:
            return None
        packed, values = reduced
        return lambda: packed.unpack(values)

    def _hook(self, process_group, bucket):  # un-annotated: torch checks the annotations' objects
        """The communication hook (``dist.GradBucket`` in, a future of its reduced buffer out)."""
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        buffer.div_(group.size())  # torch's default hook: the mean of the gradients
        packed = self._pending if bucket.is_last() else None
        if packed is None or packed.tensor is None or buffer.dtype != packed.tensor.dtype:
            return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])
        self._pending = None
        size = buffer.numel()
        carrier = torch.cat([buffer, packed.tensor])

        def split(fut: torch.futures.Future) -> torch.Tensor:
            reduced = fut.value()[0]
            buffer.copy_(reduced[:size])
            self._reduced = (packed, reduced[size:])
            return buffer

        return dist.all_reduce(carrier, group=group, async_op=True).get_future().then(split)
