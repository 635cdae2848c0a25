"""Megatron Bridge's ``CommOverlapConfig``: accepted, validated, and applied where it can act here.

The data-parallel overlaps ``overlap_grad_reduce``, ``overlap_param_gather`` and ``bucket_size`` are
written into ``[ddp]`` by :meth:`CommOverlapConfig.setup` (megatron-core DDP on GPU; torch DDP on CPU
ignores them). As in Bridge, they are only applied with the distributed optimizer, default to on
when the data-parallel size is above 1, and a value the user sets wins. The pipeline ones,
``overlap_p2p_comm``, ``batch_p2p_comm`` and ``align_param_gather``, go to megatron-core's schedule
hooks with pipeline parallelism (:func:`bridge_hpc.training.engine.parallel.install_schedule_hooks`; Bridge's
defaults: overlapped point-to-point and aligned all-gathers with virtual stages, batched without).

No effect here, said once as a warning by :meth:`setup` when set: ``tp_comm_overlap`` (and its
``tp_comm_overlap_cfg``, ``tp_comm_bootstrap_backend``), ``defer_embedding_wgrad_compute`` and
``wgrad_deferral_limit``: they overlap tensor-parallel communication with Transformer Engine's
userbuffers GEMMs, which the local layers here do not have; ``overlap_param_gather_with_optimizer_step``:
megatron's optimizer-driven all-gather, which this loop does not run.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, List, Optional

from bridge_hpc.contracts.errors import ConfigError

logger = logging.getLogger(__name__)

#: Field -> why it has no effect in this trainer.
NO_EFFECT = {
    "tp_comm_overlap": "it overlaps tensor-parallel communication with Transformer Engine's userbuffers GEMMs",
    "tp_comm_overlap_cfg": "it configures Transformer Engine's userbuffers tensor-parallel overlap",
    "tp_comm_bootstrap_backend": "it starts Transformer Engine's userbuffers tensor-parallel overlap",
    "overlap_param_gather_with_optimizer_step": "megatron's optimizer-driven parameter all-gather is not run by "
                                                "this loop (the all-gather overlaps the next forward)",
    "defer_embedding_wgrad_compute": "needs Transformer Engine with tensor-parallel overlap",
    "wgrad_deferral_limit": "needs Transformer Engine with tensor-parallel overlap",
}

#: Bridge's bucket size (in elements, as megatron-core counts) when it turns data-parallel overlap on.
DEFAULT_BUCKET_SIZE = 128 * 1024 * 1024
TP_COMM_BOOTSTRAP_BACKENDS = ("nccl", "mpi", "gloo")


@dataclass(kw_only=True)
class CommOverlapConfig:
    """Bridge's fields (``tp_comm_overlap`` is required there too). ``data_parallel_size`` is filled by
    the caller (Bridge's ``set_data_parallel_size``) before :meth:`setup`."""

    tp_comm_overlap: bool
    tp_comm_overlap_cfg: Optional[Any] = None
    tp_comm_bootstrap_backend: Optional[str] = None
    overlap_p2p_comm: Optional[bool] = None
    batch_p2p_comm: Optional[bool] = None
    overlap_grad_reduce: Optional[bool] = None
    overlap_param_gather: Optional[bool] = None
    overlap_param_gather_with_optimizer_step: Optional[bool] = None
    align_param_gather: Optional[bool] = None
    bucket_size: Optional[int] = None
    defer_embedding_wgrad_compute: Optional[bool] = None
    wgrad_deferral_limit: Optional[int] = None
    data_parallel_size: Optional[int] = None

    def finalize(self) -> None:
        """Check the values on their own; raises ConfigError naming the key."""
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ConfigError(f"must be > 0, got {self.bucket_size}", key="comm_overlap.bucket_size")
        if self.tp_comm_bootstrap_backend not in (None,) + TP_COMM_BOOTSTRAP_BACKENDS:
            raise ConfigError(f"must be one of {', '.join(TP_COMM_BOOTSTRAP_BACKENDS)}, got "
                              f"{self.tp_comm_bootstrap_backend!r}", key="comm_overlap.tp_comm_bootstrap_backend")
        if self.data_parallel_size is not None and self.data_parallel_size < 1:
            raise ConfigError(f"must be >= 1, got {self.data_parallel_size}", key="comm_overlap.data_parallel_size")
        if self.overlap_param_gather and self.overlap_grad_reduce is False:
            # Megatron-LM's rule: the parameter all-gather overlap is built on the bucketed reduce.
            raise ConfigError("needs comm_overlap.overlap_grad_reduce (left unset or true)",
                              key="comm_overlap.overlap_param_gather")

    def without_effect(self) -> List[str]:
        """The fields set to something that has no effect in this trainer (see :data:`NO_EFFECT`)."""
        return [name for name in NO_EFFECT if getattr(self, name) not in (None, False)]

    def setup(self, model_config: Any, optimizer_config: Any, ddp_config: Any) -> None:
        """Apply to the sections (Bridge's method): warn once about each field without effect, then,
        with ``ddp.use_distributed_optimizer``, set ``ddp.overlap_grad_reduce``,
        ``ddp.overlap_param_gather`` (on when the data-parallel size is above 1, unless set here) and
        ``ddp.bucket_size``. The pipeline options are read where the schedule is set up."""
        self.finalize()
        for name in self.without_effect():
            logger.warning("comm_overlap.%s = %r has no effect in bridge_hpc: %s", name, getattr(self, name),
                           NO_EFFECT[name])
        if not ddp_config.use_distributed_optimizer:
            if self.overlap_param_gather:
                raise ConfigError("needs ddp.use_distributed_optimizer = true (only the distributed optimizer "
                                  "gathers parameters)", key="comm_overlap.overlap_param_gather")
            return
        dp_overlap = (self.data_parallel_size or 1) > 1
        param_gather = dp_overlap if self.overlap_param_gather is None else self.overlap_param_gather
        grad_reduce = (dp_overlap or param_gather) if self.overlap_grad_reduce is None else self.overlap_grad_reduce
        bucket = (DEFAULT_BUCKET_SIZE if dp_overlap else None) if self.bucket_size is None else self.bucket_size
        for name, value in (("overlap_grad_reduce", grad_reduce), ("overlap_param_gather", param_gather),
                            ("bucket_size", bucket)):
            if getattr(ddp_config, name) != value:
                logger.debug("comm_overlap: ddp.%s %r -> %r", name, getattr(ddp_config, name), value)
                setattr(ddp_config, name, value)
        if dataclasses.is_dataclass(ddp_config) and hasattr(ddp_config, "finalize"):
            ddp_config.finalize()  # the section's own rules (overlap_param_gather needs the dist. optimizer)
