"""The ``[ft]``, ``[straggler]``, ``[nvrx_straggler]``, ``[inprocess_restart]`` and
``[rerun_state_machine]`` sections: torch-free dataclasses with Megatron Bridge's field names,
re-exported by :mod:`bridge_hpc.training.config` (Bridge's path for them). They live beside the
resilience components that read them; the login node imports them without torch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Optional

from bridge_hpc.contracts.schema import check as _check

logger = logging.getLogger(__name__)


@dataclass
class FaultToleranceConfig:
    """nvidia-resiliency-ext fault tolerance: ranks report sections (or heartbeats) to ft_launcher.

    The first six fields are Bridge's (rank side). The rest are launcher side (Bridge leaves them to
    the ft_launcher command line; the batch script renders them, see ``bridge_hpc.launch.ft_launch``), named
    after nvidia-resiliency-ext's own ``FaultToleranceConfig`` fields where it has one:
    ``max_restarts`` (in-job restarts of all workers before the job gives up and the batch script's
    requeue path takes over), the per-section timeouts (``setup``: start-up incl. checkpoint load
    and the run's first step, its warm-up; ``step``; ``checkpointing``: one save),
    ``rank_out_of_section_timeout`` (between sections: logging, evaluation), the heartbeat timeouts
    (used only when the package has no section API),
    ``workload_check_interval`` (how often a monitor looks: detection comes at most that long after
    the timeout), ``safety_factor`` (computed timeout = longest observed interval x this) and
    ``min_computed_timeout_s`` (floor for every computed timeout). Seconds throughout.
    """

    enable_ft_package: bool = False
    calc_ft_timeouts: bool = False
    simulate_fault: bool = False
    simulated_fault_type: Literal["rank_hung", "rank_killed", "random"] = "random"
    simulated_fault_rank: Optional[int] = None
    simulated_fault_base_delay: int = 0
    max_restarts: int = 3
    setup_timeout: float = 600.0
    step_timeout: float = 180.0
    checkpointing_timeout: float = 420.0
    rank_out_of_section_timeout: float = 300.0
    initial_rank_heartbeat_timeout: float = 3600.0
    rank_heartbeat_timeout: float = 2700.0
    workload_check_interval: float = 5.0
    safety_factor: float = 5.0
    min_computed_timeout_s: float = 60.0

    def finalize(self) -> None:
        _check(self.max_restarts >= 0, "ft.max_restarts", "must be >= 0")
        _check(self.simulated_fault_rank is None or self.simulated_fault_rank >= 0,
               "ft.simulated_fault_rank", "must be >= 0")
        _check(self.simulated_fault_base_delay >= 0, "ft.simulated_fault_base_delay", "must be >= 0")
        for key in ("setup_timeout", "step_timeout", "checkpointing_timeout", "rank_out_of_section_timeout",
                    "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "workload_check_interval"):
            _check(getattr(self, key) > 0, f"ft.{key}", "must be > 0 (seconds)")
        _check(self.safety_factor >= 1, "ft.safety_factor", "must be >= 1")
        _check(self.min_computed_timeout_s >= 0, "ft.min_computed_timeout_s", "must be >= 0")


@dataclass
class StragglerDetectionConfig:
    """Megatron's built-in straggler detector (Bridge's field names), which bridge_hpc does not run.

    That detector times CUDA events around each step and serves a control port; this toolkit's
    straggler detection is nvidia-resiliency-ext's (:class:`NVRxStragglerDetectionConfig`, section
    ``[nvrx_straggler]``), which also scores ranks, runs on CPU and can stop the job and exclude the
    slow node on requeue. So ``log_straggler = true`` is refused, naming that section, rather than
    accepted and ignored; the other fields only take effect with it and are kept for Bridge configs.
    """

    log_straggler: bool = False
    enable_straggler_on_startup: bool = True
    straggler_ctrlr_port: int = 65535
    straggler_minmax_count: int = 1

    def finalize(self) -> None:
        _check(not self.log_straggler, "straggler.log_straggler",
               "must be false: bridge_hpc detects stragglers with nvidia-resiliency-ext; set "
               "[nvrx_straggler] enabled = true instead")


@dataclass
class NVRxStragglerDetectionConfig:
    """nvidia-resiliency-ext straggler detection. Bridge's field names and defaults."""

    enabled: bool = False
    report_time_interval: float = 300.0
    calc_relative_gpu_perf: bool = True
    calc_individual_gpu_perf: bool = True
    num_gpu_perf_scores_to_print: int = 5
    gpu_relative_perf_threshold: float = 0.7
    gpu_individual_perf_threshold: float = 0.7
    stop_if_detected: bool = False
    enable_logging: bool = True
    profiling_interval: int = 1
    logger_name: str = "megatron.bridge.NVRxStragglerDetection"

    def finalize(self) -> None:
        _check(self.report_time_interval > 0, "nvrx_straggler.report_time_interval",
               "report_time_interval must be positive.")
        _check(self.profiling_interval > 0, "nvrx_straggler.profiling_interval", "must be > 0")
        if self.enabled:  # Megatron Bridge's rules, in its words after the key
            _check(self.calc_relative_gpu_perf or self.calc_individual_gpu_perf, "nvrx_straggler.calc_relative_gpu_perf",
                   "At least one of calc_relative_gpu_perf or calc_individual_gpu_perf must be True when NVRx "
                   "straggler detection is enabled.")
            for name in ("gpu_relative_perf_threshold", "gpu_individual_perf_threshold"):
                _check(0.0 <= getattr(self, name) <= 1.0, f"nvrx_straggler.{name}", f"{name} must be between 0.0 and 1.0.")


@dataclass
class InProcessRestartConfig:
    """nvidia-resiliency-ext in-process restart. Bridge's field names and defaults."""

    enabled: bool = False
    max_iterations: Optional[int] = None
    monitor_thread_interval: float = 1.0
    monitor_process_interval: float = 1.0
    progress_watchdog_interval: float = 1.0
    heartbeat_interval: float = 30.0
    soft_timeout: float = 60.0
    hard_timeout: float = 90.0
    heartbeat_timeout: float = 60.0
    barrier_timeout: float = 120.0
    completion_timeout: float = 120.0
    last_call_wait: float = 1.0
    termination_grace_time: float = 1.0
    granularity: Literal["node", "rank"] = "node"
    active_world_size: Optional[int] = None
    empty_cuda_cache: bool = True
    max_rank_faults: Optional[int] = None
    monitor_process_logdir: Optional[str] = None

    def finalize(self) -> None:
        # The orderings nvidia-resiliency-ext's Wrapper enforces (0.4-0.7), checked here so a bad
        # config stops at submission instead of on every rank at start-up: (smaller, larger) pairs.
        for small, large in (("soft_timeout", "hard_timeout"), ("hard_timeout", "barrier_timeout"),
                             ("heartbeat_timeout", "barrier_timeout"), ("heartbeat_interval", "heartbeat_timeout"),
                             ("monitor_process_interval", "barrier_timeout"),
                             ("monitor_process_interval", "heartbeat_timeout"),
                             ("monitor_process_interval", "soft_timeout"), ("monitor_thread_interval", "soft_timeout")):
            _check(getattr(self, small) < getattr(self, large), f"inprocess_restart.{large}",
                   f"must be > inprocess_restart.{small} ({getattr(self, small):g})")


@dataclass
class RerunStateMachineConfig:
    """megatron-core's rerun state machine: Megatron Bridge's fields and defaults (``[rerun_state_machine]``).

    ``check_for_nan_in_loss`` rejects a NaN or Inf loss (fatal), ``check_for_spiky_loss`` one at or
    above ``spiky_loss_factor`` x the largest of the first 100 losses (not fatal). With
    ``rerun_mode = "validate_results"`` a rejected step runs again on the same micro-batches and RNG
    state, which tells a deterministic fault from a transient one; ``"disabled"`` (the default) stops
    the rank at a rejected fatal check without a re-run, as megatron-core does;
    ``"report_determinism_stats"`` runs every step twice and logs how far the results differ.
    ``error_injection_rate`` N > 0 injects a rejected result once in about N validations, of
    ``error_injection_type``, to try the machinery. What happens after a verdict:
    :mod:`bridge_hpc.training.resilience.rerun`.
    """

    error_injection_rate: int = 0
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = "transient_error"
    rerun_mode: Literal["disabled", "validate_results", "report_determinism_stats"] = "disabled"
    check_for_nan_in_loss: bool = True
    check_for_spiky_loss: bool = False
    spiky_loss_factor: float = 10.0

    def finalize(self) -> None:
        _check(self.error_injection_rate >= 0, "rerun_state_machine.error_injection_rate",
               "must be >= 0 (0: no injection; N: about once in N result validations)")
        _check(self.error_injection_rate == 0 or self.rerun_mode == "validate_results",
               "rerun_state_machine.error_injection_rate",
               f"injects errors only with rerun_mode = \"validate_results\" (got {self.rerun_mode!r})")
        _check(self.spiky_loss_factor > 1 and self.spiky_loss_factor != float("inf"),
               "rerun_state_machine.spiky_loss_factor",
               f"must be a finite number > 1 (a loss this many times the largest seen is spiky), got "
               f"{self.spiky_loss_factor!r}")
