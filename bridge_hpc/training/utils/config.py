"""The ``[logger]`` and ``[profiling]`` sections: Megatron Bridge's LoggerConfig and ProfilingConfig (megatron's
fields and Bridge's), torch-free, re-exported by :mod:`bridge_hpc.training.config` (Bridge's path for them).
Beside the training log (train_utils) that reads them."""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Literal, Optional

from bridge_hpc.contracts.errors import MissingPackageError
from bridge_hpc.contracts.schema import check as _check

#: Why the routing-trace fields are refused: MoE models train here, but their routers' decisions are not
#: recorded (no trace writer yet); a run that asked for a trace would silently have none.
_NO_ROUTING_TRACE = ("bridge_hpc trains MoE models but does not record routing traces yet: a run asking for one "
                     "would end without it")


@dataclass
class LoggerConfig:
    """Console, metrics-file, TensorBoard, W&B, MLflow and Comet logging: every field of Megatron
    Bridge's LoggerConfig (megatron's plus Bridge's MLflow/Comet ones) and bridge_hpc's ``metrics_file``.

    ``metrics_file`` is ours (not Bridge's): the JSON-lines file that records every step's loss at
    full precision; ``bridge_hpc.rank`` points it at ``<run_dir>/metrics.jsonl``. ``log_progress``
    appends Megatron's ``progress.txt`` (plus bridge_hpc's goodput events) in ``checkpoint.save``.

    TensorBoard is on by default for jobs: a job file that leaves ``tensorboard_dir`` unset gets
    ``<run_dir>/tensorboard`` (:data:`bridge_hpc.contracts.run_folder.TENSORBOARD_DIR`), so that
    ``tensorboard --logdir runs/`` shows every run. ``tensorboard_dir = ""`` turns it off; so does None,
    Bridge's default, for a config built in Python. ``finalize`` makes "" None: one spelling of "off".

    W&B is on when ``wandb_project`` is set, MLflow when ``mlflow_experiment`` is, Comet when
    ``comet_project`` is (see :mod:`bridge_hpc.training.utils.log_backends`): each gets every series
    TensorBoard gets, and a requeued or restarted job continues the same run.

    A field this trainer cannot act on (MoE routing traces: not recorded yet; energy counters; a
    timing level above 0, whose timers it has not) accepts only its default and is refused by name
    otherwise.
    """

    log_interval: int = 100
    log_params_norm: bool = False
    # Megatron's step reports (bridge_hpc.training.utils.train_utils.training_log): computed on log steps only
    # (step % log_interval == 0), so they add nothing to the steps in between.
    log_throughput: bool = False
    log_throughput_to_tensorboard: bool = False
    throughput_window_size: int = 100
    log_progress: bool = False
    timing_log_level: Literal[-1, 0, 1, 2] = 0
    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    #: Events TensorBoard's writer holds before it writes them (its ``max_queue``).
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    memory_keys: Optional[Dict[str, str]] = None
    #: Every this many steps, one console line of the accelerator's memory (None: never).
    log_memory_interval: Optional[int] = None
    log_device_memory_used: bool = False
    log_l2_norm_grad_to_tensorboard: bool = False
    log_num_zeros_in_grad: bool = False
    log_max_attention_logit: bool = False
    log_runtime_to_tensorboard: bool = False
    runtime_time_unit: Literal["seconds", "minutes", "hours", "days"] = "hours"
    barrier_with_L1_time: bool = True
    log_world_size_to_tensorboard: bool = False
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    wandb_entity: Optional[str] = None
    #: Python logging level of bridge_hpc's own messages (None: INFO, 20).
    logging_level: Optional[int] = None
    filter_warnings: bool = True
    modules_to_filter: Optional[List[str]] = None
    set_level_for_all_loggers: bool = False
    log_energy: bool = False
    save_config_filepath: Optional[str] = None
    moe_routing_trace_path: Optional[str] = None
    moe_routing_trace_max_training_iters: Optional[int] = None
    moe_routing_trace_capture_logits: bool = False
    moe_routing_trace_capture_hidden_states: bool = False
    moe_routing_trace_dump_weights: bool = False
    #: Bridge's: no step log at all (console, TensorBoard, metrics.jsonl); evaluation, progress.txt
    #: and checkpoints are unchanged.
    skip_train_metrics_log: bool = False
    mlflow_experiment: Optional[str] = None
    mlflow_run_name: Optional[str] = None
    mlflow_tracking_uri: Optional[str] = None
    mlflow_tags: Optional[Dict[str, str]] = None
    #: Bridge's: the run's description (MLflow's Description panel), given to ``mlflow.start_run``.
    mlflow_description: Optional[str] = None
    comet_project: Optional[str] = None
    comet_experiment_name: Optional[str] = None
    comet_workspace: Optional[str] = None
    #: Never set it in a job file: a key in a file ends up in resolved.toml and in checkpoints. Pass
    #: ``COMET_API_KEY`` through ``[env]`` as a ``from_shell`` secret instead (refused here when set in TOML).
    comet_api_key: Optional[str] = None
    comet_tags: Optional[List[str]] = None
    metrics_file: Optional[str] = None

    def finalize(self) -> None:
        _check(self.log_interval > 0, "logger.log_interval", "must be > 0")
        _check(self.throughput_window_size >= 2, "logger.throughput_window_size",
               "must be >= 2 (a rate needs the times of two steps)")
        if self.logging_level is None:
            self.logging_level = logging.INFO
        _check(self.logging_level in (10, 20, 30, 40, 50), "logger.logging_level",
               "must be a Python logging level: 10 (DEBUG), 20 (INFO), 30 (WARNING), 40 or 50")
        _check(self.tensorboard_log_interval > 0, "logger.tensorboard_log_interval", "must be > 0")
        _check(self.tensorboard_queue_size > 0, "logger.tensorboard_queue_size", "must be > 0")
        _check(self.log_memory_interval is None or self.log_memory_interval > 0, "logger.log_memory_interval",
               "must be > 0 (or unset: never)")
        _check(self.tensorboard_dir is None or (isinstance(self.tensorboard_dir, str)
                                                and self.tensorboard_dir == self.tensorboard_dir.strip()),
               "logger.tensorboard_dir", f'expected a folder path, or "" to turn TensorBoard off, got {self.tensorboard_dir!r}')
        if self.tensorboard_dir == "":
            self.tensorboard_dir = None
        for name, why in (
            ("log_max_attention_logit", "megatron-core records it only for its MoE/MLA QK-clip attention, which "
                                        "bridge_hpc's GPTs do not use"),
            ("log_energy", "there is no energy counter reader in bridge_hpc"),
            ("moe_routing_trace_path", _NO_ROUTING_TRACE),
            ("moe_routing_trace_max_training_iters", _NO_ROUTING_TRACE),
            ("moe_routing_trace_capture_logits", _NO_ROUTING_TRACE),
            ("moe_routing_trace_capture_hidden_states", _NO_ROUTING_TRACE),
            ("moe_routing_trace_dump_weights", _NO_ROUTING_TRACE),
        ):
            _check(not getattr(self, name), f"logger.{name}", f"must be left at its default: {why}")
        # (an empty run or experiment name of a backend that is on gets Bridge's words, below)
        names = {"wandb_exp_name": self.wandb_project, "mlflow_run_name": self.mlflow_experiment,
                 "comet_experiment_name": self.comet_project}
        for name in ("wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity", "mlflow_experiment",
                     "mlflow_run_name", "mlflow_tracking_uri", "mlflow_description", "comet_project",
                     "comet_experiment_name", "comet_workspace", "save_config_filepath"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value.strip() != "")
                   or (value == "" and names.get(name)), f"logger.{name}", "must be a non-empty string, or unset")
        if self.save_config_filepath is not None and self.save_config_filepath.endswith((".yaml", ".yml")):
            import importlib.util

            _check(importlib.util.find_spec("yaml") is not None, "logger.save_config_filepath",
                   "names a YAML file, and PyYAML is not installed here: install it, or name a .json file")
        for name in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
            _check(getattr(self, name) is None or self.wandb_project is not None, f"logger.{name}",
                   "is set but logger.wandb_project is not, so W&B is off")
        self._check_bridges_rules()

    def _check_bridges_rules(self) -> None:
        """Megatron Bridge's rules, in its words after the key: a backend that is on needs its run or
        experiment name (ValueError: Bridge's GlobalState says it for W&B, its finalize for MLflow and
        Comet); any MLflow or Comet field set needs that backend's package (ModuleNotFoundError): imported, as
        Bridge does, except in a job file's loader, which looks it up (:func:`packages_looked_up`: the login
        node imports no logger package)."""
        _check(not self.wandb_project or self.wandb_exp_name != "", "logger.wandb_exp_name",
               "Please specify the wandb experiment name!")
        _check(not self.mlflow_experiment or self.mlflow_run_name, "logger.mlflow_run_name",
               "Set logger.mlflow_run_name when enabling MLFlow logging.")
        _check(not self.comet_project or self.comet_experiment_name, "logger.comet_experiment_name",
               "Set logger.comet_experiment_name when enabling Comet ML logging.")
        _require_package(self, "mlflow", ("mlflow_experiment", "mlflow_run_name", "mlflow_tracking_uri",
                                          "mlflow_tags", "mlflow_description"),
                         "MLFlow logging is configured, but the 'mlflow' package is not installed. "
                         "Install it via pip install mlflow or uv add mlflow")
        _require_package(self, "comet_ml", ("comet_project", "comet_experiment_name", "comet_workspace",
                                            "comet_api_key", "comet_tags"),
                         "Comet ML logging is configured, but the 'comet_ml' package is not installed. "
                         "Install it via pip install comet-ml or uv add comet-ml")


#: True while a job file's sections are finalized (:func:`packages_looked_up`): the logger packages are then
#: looked up, not imported, so that the login node imports none of them (they take seconds; the ranks import
#: the ones that are on when their backends start).
_LOOK_UP_ONLY: contextvars.ContextVar = contextvars.ContextVar("logger_packages_looked_up_only", default=False)


@contextlib.contextmanager
def packages_looked_up() -> Iterator[None]:
    """Within it, :meth:`LoggerConfig.finalize` finds the MLflow / Comet packages without importing them
    (``ConfigContainer.from_sections``, the job file's loader); elsewhere it imports them, as Bridge's does."""
    token = _LOOK_UP_ONLY.set(True)
    try:
        yield
    finally:
        _LOOK_UP_ONLY.reset(token)


def _require_package(section: "LoggerConfig", package: str, names: tuple, message: str) -> None:
    """Raise MissingPackageError naming the first of ``names`` that is set when ``package`` cannot be imported:
    Bridge's ``importlib.import_module`` check (a package whose own import lacks a module fails it too), or
    within :func:`packages_looked_up` its lookup only."""
    used = [name for name in names if getattr(section, name)]
    if not used:
        return
    import importlib
    import importlib.util

    if not _LOOK_UP_ONLY.get():
        try:
            importlib.import_module(package)
        except ModuleNotFoundError as exc:
            raise MissingPackageError(message, package=package, key=f"logger.{used[0]}") from exc
        return
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a package whose import is blocked, or a module without a spec
        found = False
    if not found:
        raise MissingPackageError(message, package=package, key=f"logger.{used[0]}")


@dataclass
class ProfilingConfig:
    """torch.profiler over a window of steps, on chosen ranks; traces go to ``tensorboard_dir``."""

    #: nsys: ``torch.cuda.profiler.start()`` at ``profile_step_start`` and ``stop()`` at
    #: ``profile_step_end`` on ``profile_ranks``, for ``nsys profile --capture-range=cudaProfilerApi``
    #: (put it in ``[slurm]``'s launcher command), with NVTX ranges per step.
    use_nsys_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    use_pytorch_profiler: bool = False
    pytorch_profiler_collect_shapes: bool = False
    pytorch_profiler_collect_callstack: bool = False
    pytorch_profiler_collect_chakra: bool = False
    profile_ranks: List[int] = field(default_factory=lambda: [0])
    record_shapes: bool = False
    #: NVTX ranges around each step's phases (forward-backward, optimizer step) for nsys.
    nvtx_ranges: bool = False
    # CUDA allocator history from the start (train_utils.start_memory_history_recording), dumped at
    # profile_step_end to <memory_snapshot_path stem>_<rank><ext> for pytorch.org/memory_viz.
    record_memory_history: bool = False
    memory_snapshot_path: str = "snapshot.pickle"

    def finalize(self) -> None:
        # Megatron Bridge's rules, in its words after the key
        _check(not (self.use_nsys_profiler and self.use_pytorch_profiler), "profiling.use_nsys_profiler",
               "Exactly one of pytorch or nsys profiler should be enabled, not both, when ProfilingConfig is active.")
        _check(self.profile_step_start >= 0, "profiling.profile_step_start",
               f"profile_step_start must be >= 0, got {self.profile_step_start}")
        _check(self.profile_step_end >= 0, "profiling.profile_step_end",
               f"profile_step_end must be >= 0, got {self.profile_step_end}")
        _check(self.profile_step_end >= self.profile_step_start, "profiling.profile_step_end",
               f"profile_step_end ({self.profile_step_end}) must be >= profile_step_start ({self.profile_step_start})")
        _check(not self.pytorch_profiler_collect_chakra, "profiling.pytorch_profiler_collect_chakra",
               "must be false: Chakra execution traces are not collected by bridge_hpc's profiler")
