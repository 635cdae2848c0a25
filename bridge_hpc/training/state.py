"""The mutable state of a run: config, progress counters, timers, loggers and the signal flag.

One :class:`GlobalState` is created by ``pretrain`` and handed (by reference) to every part of the
loop and to forward-step functions that ask for it, as in Megatron Bridge. Only
:class:`TrainState` is checkpointed; everything else is rebuilt on start.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import torch

from bridge_hpc.training.config import ConfigContainer
from bridge_hpc.training.process.signal_recorder import StopSignalRecorder
from bridge_hpc.training.process.startup import StartupPhases


@dataclass
class TrainState:
    """Progress counters: the part of the state that a checkpoint must carry to resume exactly.

    ``consumed_train_samples`` is also the data position: datasets are read in index order from it.
    """

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    do_train: bool = False
    do_valid: bool = False
    do_test: bool = False

    def state_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class _Timer:
    """Wall-clock timer; synchronizes CUDA so GPU work is counted where it ran. With ``nvtx`` its
    interval is also an NVTX range of its name (``profiling.nvtx_ranges``, for nsys)."""

    def __init__(self, name: str, nvtx: bool = False):
        self.name = name
        self._elapsed = 0.0
        self._start: Optional[float] = None
        self._nvtx = nvtx and torch.cuda.is_available()

    def start(self, barrier: bool = False) -> None:
        if barrier and torch.distributed.is_initialized():
            torch.distributed.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self._nvtx:
            torch.cuda.nvtx.range_push(self.name)
        self._start = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if self._start is None:
            return
        if barrier and torch.distributed.is_initialized():
            torch.distributed.barrier()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        self._elapsed += time.perf_counter() - self._start
        self._start = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated (including a running interval); ``reset`` zeroes the total."""
        running = self._start is not None
        if running:
            self.stop()
        value = self._elapsed
        if reset:
            self._elapsed = 0.0
        if running:
            self.start()
        return value


class _NullTimer:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def elapsed(self, reset: bool = True) -> float:
        return 0.0


class _NvtxRange(_NullTimer):
    """A timer that times nothing but marks its interval as an NVTX range (``profiling.nvtx_ranges``
    with timing off: nsys sees the phases, the step pays no synchronization)."""

    def __init__(self, name: str):
        self.name = name
        self._open = False

    def start(self, barrier: bool = False) -> None:
        torch.cuda.nvtx.range_push(self.name)
        self._open = True

    def stop(self, barrier: bool = False) -> None:
        if self._open:
            torch.cuda.nvtx.range_pop()
            self._open = False


class Timers:
    """``timers(name, log_level).start()/.stop()/.elapsed()`` as megatron's Timers.

    megatron-core's own Timers call ``torch.cuda`` unconditionally, hence this small replacement.
    Timers above ``timing_log_level`` are no-ops, so fine-grained timing costs nothing when off (with
    ``nvtx`` they still mark NVTX ranges on GPUs). ``log_option`` is ``logger.timing_log_option``:
    how :func:`bridge_hpc.training.utils.train_utils.training_log` reduces the ranks' times (``max``,
    ``minmax`` or ``all``), as Megatron's Timers(log_level, log_option).
    """

    def __init__(self, log_level: int, log_option: str = "minmax", nvtx: bool = False):
        self.log_level = log_level
        self.log_option = log_option
        self.nvtx = nvtx and torch.cuda.is_available()
        self._timers: Dict[str, _Timer] = {}
        self._null = _NullTimer()
        self._ranges: Dict[str, _NvtxRange] = {}

    def __call__(self, name: str, log_level: int = 0):
        if log_level > self.log_level:
            if self.nvtx:
                return self._ranges.setdefault(name, _NvtxRange(name))
            return self._null
        if name not in self._timers:
            self._timers[name] = _Timer(name, nvtx=self.nvtx)
        return self._timers[name]

    def elapsed_all(self, reset: bool = True) -> Dict[str, float]:
        return {name: timer.elapsed(reset=reset) for name, timer in self._timers.items()}


#: Megatron Bridge's name for the same thing.
DistributedSignalHandler = StopSignalRecorder


def get_rank_safe() -> int:
    """This process's rank: torch.distributed's once it is up, else ``$RANK`` (0 without it): Bridge's helper."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def get_world_size_safe() -> int:
    """The world size: torch.distributed's once it is up, else ``$WORLD_SIZE`` (1 without it): Bridge's helper."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


#: backend -> (the [logger] field that turns it on, the one that names its run, Bridge's words when that is empty)
_RUN_NAMES = {"wandb": ("wandb_project", "wandb_exp_name", "Please specify the wandb experiment name!"),
              "mlflow": ("mlflow_experiment", "mlflow_run_name", "Please specify the mlflow_run_name for MLFlow logging!"),
              "comet": ("comet_project", "comet_experiment_name",
                        "Please specify the comet_experiment_name for Comet ML logging!")}


class GlobalState:
    """Everything the loop shares: ``cfg``, ``train_state``, ``timers``, loggers, signal handler.

    The TensorBoard writer and the W&B, MLflow and Comet loggers exist only on the last rank (as in
    Bridge), so ranks that never log never import their packages, and only from ``metrics.open()`` on: they
    must know the step the run resumes at (see :mod:`bridge_hpc.training.engine.metrics`).

    Setting ``cfg`` takes ``logger.comet_api_key`` out of the config (the Comet logger still gets it): no
    log line and no checkpoint's saved config holds the key (:func:`~bridge_hpc.training.utils.log_backends.take_secret`).
    """

    def __init__(self) -> None:
        self._cfg: Optional[ConfigContainer] = None
        self.train_state = TrainState()
        self._timers: Optional[Timers] = None
        self._metrics = None
        self.signal_handler: Optional[StopSignalRecorder] = None
        self.exit_reasons: List[str] = []
        #: ``bridge_hpc.contracts.progress_log.ProgressLog`` on rank 0 when ``logger.log_progress`` is on, else None.
        self.progress = None
        self.start_time = time.time()
        self.rank = 0
        self.world_size = 1
        #: The run's tokenizer (megatron-core's, built from ``[tokenizer]``), None without one; as Bridge's
        #: ``state.tokenizer``, for forward steps that decode or need special ids.
        self.tokenizer = None
        #: This run's start, end and time limit as Slurm reports them (``slurm_query.JobTimes``; rank 0
        #: only, None when unknown). See ``bridge_hpc.training.train.time_limit_reached``.
        self.job_times = None
        self.job_times_checked: float = 0.0
        #: The slowest step and the last checkpoint save of this run, to know what still fits.
        self.slowest_step_s: float = 0.0
        #: How many runs of this job came before this one (requeues and in-job restarts; rank 0 also counts
        #: from the progress log): ``checkpoint.ckpt_step`` applies in the first run only.
        self.restart_count: int = 0
        #: The step this run resumed at: exit_interval counts steps trained, not steps loaded.
        self.run_start_step: int = 0
        self.last_save_s: Optional[float] = None
        #: Rank 0: the longest save of recent runs, from the progress log (None: none recorded); what
        #: the time-limit rule expects of this run's first save.
        self.logged_save_s: Optional[float] = None
        #: ``fault_tolerance.FaultTolerance`` / ``straggler.StragglerDetector`` of this run (set by
        #: ``_pretrain``; None in loops built without it). ``straggler_stop``: the detector asked to stop.
        self.fault_tolerance = None
        self.straggler_detector = None
        self.straggler_stop: bool = False
        #: The ranks' stop observations (signal, duration, time limit) of the last training step,
        #: agreed on inside its loss all-reduce (``train_step``); read once by the exit decision that
        #: follows (``exit_policy.exit_reasons``), which otherwise agrees on them itself.
        self.agreed_observations: Optional[Dict[str, bool]] = None
        #: Wall-clock time of this run's last finished step (what a restart charges lost time from).
        self.last_step_time: Optional[float] = None
        #: Where this run's start-up went (``pretrain`` marks the phases, the first step the last one).
        self.startup: Optional[StartupPhases] = None
        #: In a re-run by the in-process restart wrapper: (its iteration, the failed attempt's
        #: ``last_step_time``); None otherwise.
        self.inprocess_restart = None
        #: The in-process restart wrapper's coordination store for this attempt (None without it).
        self.restart_store = None
        #: ``cuda_graphs.FullIterationCudaGraph`` while ``train()`` runs with ``model.cuda_graph_impl =
        #: "full_iteration"``: ``train_step`` runs its forward and backward through it. None otherwise.
        self.full_iteration_graph = None
        #: Extra state read from the loaded checkpoint (e.g. ``{"fault_tolerance": {...}}``).
        self.checkpoint_extra: Dict[str, Any] = {}

    @property
    def cfg(self) -> Optional[ConfigContainer]:
        """The run's configuration container."""
        return self._cfg

    @cfg.setter
    def cfg(self, value: Optional[ConfigContainer]) -> None:
        if value is not None and getattr(getattr(value, "logger", None), "comet_api_key", None):
            from bridge_hpc.training.utils.log_backends import take_secret

            take_secret(value)
        self._cfg = value

    @property
    def timers(self) -> Timers:
        if self._timers is None:
            if self.cfg is not None:
                log = self.cfg.logger
                self._timers = Timers(log.timing_log_level, log.timing_log_option, self.cfg.profiling.nvtx_ranges)
            else:
                self._timers = Timers(0)
        return self._timers

    @property
    def tensorboard_logger(self):
        """Bridge's name for the SummaryWriter: on the last rank while TensorBoard is on
        (``logger.tensorboard_dir``) and the run's metrics are open, else None."""
        return self._metrics.writer if self._metrics is not None else None

    def _backend_logger(self, name: str):
        """Bridge's rules: None without a config, with the backend off or on any rank but the last
        (:func:`get_rank_safe`); the backend on with an empty run name is Bridge's ValueError. Then the
        backend's handle once the run's metrics are open (None before)."""
        cfg = self.cfg
        switch, run_name, message = _RUN_NAMES[name]
        if cfg is None or not getattr(cfg.logger, switch) or get_rank_safe() != get_world_size_safe() - 1:
            return None
        if not getattr(cfg.logger, run_name) and (name == "comet" or getattr(cfg.logger, run_name) == ""):
            raise ValueError(message)
        backends = self._metrics.backends if self._metrics is not None else None
        return backends.handle(name) if backends is not None else None

    @property
    def wandb_logger(self):
        """Bridge's W&B logger: on the last rank while ``logger.wandb_project`` is set and the run's metrics
        are open, the ``wandb`` module (its run started or resumed), else None. Its ``log(dict, step)`` joins
        the step's record, which goes to W&B once the step's checkpoint is saved (each step once, see
        :mod:`bridge_hpc.training.utils.log_backends`); anything else is the module's."""
        return self._backend_logger("wandb")

    @property
    def mlflow_logger(self):
        """Bridge's MLflow logger: the ``mlflow`` module with the job's run (last rank, ``logger.mlflow_experiment``
        set), else None; ``log_metrics`` / ``log_metric`` join the step's record, as for :attr:`wandb_logger`."""
        return self._backend_logger("mlflow")

    @property
    def comet_logger(self):
        """Bridge's Comet logger: the job's ``comet_ml`` Experiment (last rank, ``logger.comet_project`` set),
        else None; ``log_metrics`` / ``log_metric`` join the step's record, as for :attr:`wandb_logger`."""
        return self._backend_logger("comet")

    @property
    def metrics(self):
        """The run's :class:`~bridge_hpc.training.engine.metrics.MetricsLogger` (JSON lines, TensorBoard, and
        W&B / MLflow / Comet when ``[logger]`` turns them on)."""
        if self._metrics is None:
            from bridge_hpc.training.engine.metrics import MetricsLogger

            log = self.cfg.logger
            backends = None
            if log.wandb_project or log.mlflow_experiment or log.comet_project:
                from bridge_hpc.training.utils.log_backends import LogBackends

                backends = LogBackends(self.cfg)
            self._metrics = MetricsLogger(log.metrics_file, self.rank, self.world_size, log.tensorboard_dir,
                                          log.tensorboard_log_interval, backends=backends,
                                          tensorboard_queue_size=log.tensorboard_queue_size)
        return self._metrics

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.signal_handler is not None:
            self.signal_handler.release()
