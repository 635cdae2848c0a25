"""In-process restart (``[inprocess_restart]``, Bridge's InProcessRestartConfig) with nvidia-resiliency-ext.

``nvidia_resiliency_ext.inprocess.Wrapper`` re-runs the wrapped ``_pretrain`` in the same processes
after a fault: a monitor thread aborts the process groups to unblock ranks stuck in a collective, a
TCP store (``store``) coordinates the ranks, and the wrapped function gets the active ``CallWrapper``
(``inprocess_call_wrapper``), whose ``iteration`` prefixes the store of each attempt.

It is usable only where (1) the installed package has ``inprocess.Wrapper`` and ``CallWrapper``,
(2) CUDA/NCCL is present: the package's ``AbortTorchDistributed`` aborts NCCL communicators only
(0.4.1 and 0.7.0); a gloo collective waiting on a dead rank cannot be interrupted, so on CPU a fault
would hang instead of restarting, and (3) torch.distributed is not initialised yet (each attempt
brings the process group up through the wrapper's store). Otherwise :func:`check_supported` raises a
:class:`~bridge_hpc.contracts.errors.ConfigError` naming ``inprocess_restart.enabled`` at start-up.

As in Megatron Bridge, the wrapper owns the clean-up after a failed attempt, set-up failures included:
the wrapped ``_pretrain`` leaves its process group as it is when it raises (it tears down only the one
it brought up itself, after a normal end), the wrapper's abort (``AbortTorchDistributed``) destroys every
group, and its finalize drops megatron-core's references to them (Bridge's ``destroy_state``), so the
next attempt sets megatron-core's groups up again on its own process group.

Checked on an H100 with nvidia-resiliency-ext 0.7.0 and megatron-core 0.19.2
(tests/test_gpu_resiliency.py, skipped without CUDA): a fault at step 12 re-runs training in the same
process from the step-10 checkpoint, and all 20 losses equal an uninterrupted run bit for bit. The
wrapping mirrors Megatron Bridge's ``inprocess_restart.py`` in a reduced form.
"""

from __future__ import annotations

import importlib.util
import os
from datetime import timedelta
from typing import Any, Callable, Optional, Tuple

from bridge_hpc.contracts.errors import ConfigError

KEY = "inprocess_restart.enabled"


def unsupported_reason() -> Optional[str]:
    """Why in-process restart cannot run in this process, or None when it can."""
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        return "nvidia-resiliency-ext is not installed"
    try:
        import nvidia_resiliency_ext.inprocess as inprocess
    except Exception as exc:  # noqa: BLE001 - any import failure makes it unusable
        return f"nvidia_resiliency_ext.inprocess cannot be imported ({type(exc).__name__}: {exc})"
    if not (hasattr(inprocess, "Wrapper") and hasattr(inprocess, "CallWrapper")):
        return "the installed nvidia_resiliency_ext.inprocess has no Wrapper/CallWrapper"
    import torch

    if not torch.cuda.is_available():
        return ("it needs CUDA/NCCL: nvidia-resiliency-ext aborts NCCL process groups only, so on CPU "
                "(gloo) a rank blocked on a dead peer could not be restarted")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return ("torch.distributed is already initialised; the in-process wrapper must create the "
                "process group itself (call pretrain() before init_process_group)")
    return None


def check_supported() -> None:
    reason = unsupported_reason()
    if reason is not None:
        try:
            from importlib.metadata import version

            import nvidia_resiliency_ext  # noqa: F401

            installed = f" (nvidia-resiliency-ext {version('nvidia-resiliency-ext')})"
        except Exception:  # noqa: BLE001
            installed = ""
        raise ConfigError(f"in-process restart is not available here{installed}: {reason}. "
                          f"Set {KEY} = false (ft_launcher's in-job restart, [ft], works without it).", key=KEY)


def maybe_wrap_for_inprocess_restart(train_fn: Callable, config: Any) -> Tuple[Callable, Optional[Any]]:
    """``(train_fn, None)`` when disabled; else ``(wrapped train_fn, coordination store)``.
    Raises ConfigError (see :func:`check_supported`) where it cannot work."""
    if config is None or not config.enabled:
        return train_fn, None
    check_supported()
    import nvidia_resiliency_ext.inprocess as inprocess
    import torch

    port = int(os.environ["MASTER_PORT"])
    store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"], port=port + 1, world_size=int(os.environ.get("WORLD_SIZE", "1")),
        is_master=int(os.environ.get("RANK", "0")) == 0, timeout=timedelta(seconds=300), wait_for_workers=True)

    def seconds(value: float) -> timedelta:
        return timedelta(seconds=value)

    def adapter(*args, inprocess_call_wrapper=None, **kwargs):
        return train_fn(*args, inprocess_call_wrapper=inprocess_call_wrapper, **kwargs)

    # The wrapper passes its CallWrapper to the parameter annotated with that class; it compares
    # annotation objects, and this module's annotations are strings (``from __future__``), so set it.
    adapter.__annotations__ = {"inprocess_call_wrapper": Optional[inprocess.CallWrapper]}

    from megatron.core import parallel_state

    # Bridge's finalize, after the abort has destroyed the process groups: megatron-core forgets them.
    finalize = inprocess.Compose(inprocess.finalize.ThreadedFinalize(timeout=seconds(10),
                                                                     fn=parallel_state.destroy_model_parallel))
    health = [inprocess.health_check.CudaHealthCheck(timeout=seconds(10))]
    if config.max_rank_faults is not None:
        health.append(inprocess.health_check.FaultCounter(max_rank_faults=config.max_rank_faults))
    wrapped = inprocess.Wrapper(
        store_kwargs={"timeout": seconds(300), "port": port + 2},
        initialize=inprocess.initialize.RetryController(max_iterations=config.max_iterations,
                                                        min_world_size=config.active_world_size or 1),
        abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed()),
        finalize=finalize,
        health_check=inprocess.Compose(*health),
        heartbeat_interval=seconds(config.heartbeat_interval),
        heartbeat_timeout=seconds(config.heartbeat_timeout),
        barrier_timeout=seconds(config.barrier_timeout),
        completion_timeout=seconds(config.completion_timeout),
        monitor_process_interval=seconds(config.monitor_process_interval),
        monitor_thread_interval=seconds(config.monitor_thread_interval),
        progress_watchdog_interval=seconds(config.progress_watchdog_interval),
        last_call_wait=seconds(config.last_call_wait),
        soft_timeout=seconds(config.soft_timeout),
        hard_timeout=seconds(config.hard_timeout),
        termination_grace_time=seconds(config.termination_grace_time),
        monitor_process_logfile=None,
        enabled=True,
    )(adapter)
    return wrapped, store
