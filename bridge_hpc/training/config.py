"""Training configuration: plain dataclasses with Megatron Bridge's section and field names.

Why dataclasses of our own rather than Megatron Bridge's: Bridge's configs inherit from
``megatron.training`` classes that are not installable here, and we want this module to import
without torch so the login-node launcher can check a job file in milliseconds. Field names follow
Bridge (``train.train_iters``, ``checkpoint.save_interval``, ...) so Bridge users' recipes and
forward-step functions read ``state.cfg`` the way they expect.

Construction is deferred the way Bridge does it: building a dataclass only stores values; each
section's ``finalize()`` fills derived fields and checks the section on its own;
:meth:`ConfigContainer.validate` finalizes everything and checks the sections against each other
(which needs the world size, so it runs once torch.distributed is up). Every bad value raises
:class:`~bridge_hpc.contracts.errors.ConfigError` naming the dotted key.
"""

from __future__ import annotations

import abc
import array
import dataclasses
import json
import logging
import math
import os
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Literal, NamedTuple, Optional, Tuple, Union

from bridge_hpc.contracts import run_folder, signals
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import LAUNCHER_SECTIONS, build_dataclass, did_you_mean
from bridge_hpc.training.comm_overlap import CommOverlapConfig
from bridge_hpc.training.mixed_precision import (
    MixedPrecisionConfig,
    get_mixed_precision_config,
    recipe_fields,  # noqa: F401 - for the login side (jobconfig)
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@dataclass
class RNGConfig:
    """Seeds. The same seed on every data-parallel rank keeps the replicas' initialisation equal."""

    seed: int = 1234
    data_parallel_random_init: bool = False

    def finalize(self) -> None:
        _check(self.seed >= 0, "rng.seed", "must be >= 0")


class DeferredPostInit:
    """Bridge's configs that derive from megatron-core's (DDP, optimizer, GPT dataset) skip its
    ``__post_init__`` at construction, so fields can still be changed; ``finalize()`` fills the
    derived fields and checks them. The same holds here."""

    def __post_init__(self) -> None:
        """Computes nothing: see :meth:`finalize`."""


@dataclass
class DistributedInitConfig:
    """How torch.distributed is set up (Bridge's names). ``distributed_backend = None`` picks nccl on
    GPU, gloo on CPU.

    ``external_gpu_device_mapping``: the launcher already narrowed each rank's GPUs
    (``CUDA_VISIBLE_DEVICES``), so every rank uses device 0 instead of its local rank.
    ``enable_megatron_core_experimental``: megatron-core's experimental switch
    (``megatron.core.config.set_experimental_flag``), set on every rank before the model is built.
    ``use_decentralized_pg`` (process groups passed to each component instead of megatron-core's
    global parallel state) and ``lazy_mpu_init`` (Megatron's hand-over of model-parallel set-up to
    an external manager; Bridge's ``lazy_init`` property reads and writes it) must stay off: this
    trainer sets up megatron-core's global parallel state itself, and a job asking for either would
    otherwise silently get the other behaviour.
    """

    distributed_backend: Optional[Literal["nccl", "gloo"]] = None
    distributed_timeout_minutes: int = 10
    external_gpu_device_mapping: bool = False
    enable_megatron_core_experimental: bool = False
    use_decentralized_pg: bool = False
    lazy_mpu_init: Optional[bool] = None

    @property
    def lazy_init(self) -> bool:
        """Bridge's name for ``lazy_mpu_init``."""
        return bool(self.lazy_mpu_init)

    @lazy_init.setter
    def lazy_init(self, value: bool) -> None:
        self.lazy_mpu_init = value

    def finalize(self) -> None:
        _check(self.distributed_timeout_minutes > 0, "dist.distributed_timeout_minutes", "must be > 0")
        _check(not self.use_decentralized_pg, "dist.use_decentralized_pg",
               "must be false: bridge_hpc passes megatron-core's global parallel state, not a ProcessGroupCollection")
        _check(not self.lazy_mpu_init, "dist.lazy_mpu_init",
               "must be false: bridge_hpc sets up model parallelism itself (no external manager)")


@dataclass
class DistributedDataParallelConfig(DeferredPostInit):
    """Data-parallel wrapper settings; used as megatron-core DDP's config on GPU (ignored by torch DDP)."""

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    average_in_collective: bool = False
    bucket_size: Optional[int] = None
    #: megatron-core's: pad each bucket to a size at which NCCL's bus bandwidth is high (a multiple of
    #: a large power of 2), for a faster overlapped reduce-scatter and param all-gather.
    pad_buckets_for_high_nccl_busbw: bool = False
    #: megatron-core's: with pipeline parallelism and overlapped param gather, start every virtual
    #: stage's param all-gather together (at the first stage's forward) instead of one stage at a time.
    align_param_gather: bool = False
    #: Bridge's (synced from a later megatron-core): fnmatch patterns of parameters whose gradients
    #: accumulate locally in FP32. megatron-core 0.19.2's DDP has no such option, so only the empty
    #: default is accepted; ``grad_reduce_in_fp32 = true`` keeps every gradient in FP32.
    param_name_patterns_for_fp32_local_accumulation: Tuple[str, ...] = ()

    def finalize(self) -> None:
        _check(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "ddp.overlap_param_gather", "needs ddp.use_distributed_optimizer = true",
        )
        _check(not self.param_name_patterns_for_fp32_local_accumulation,
               "ddp.param_name_patterns_for_fp32_local_accumulation",
               "must be empty: megatron-core 0.19.2's DDP cannot accumulate chosen gradients in FP32 "
               "(ddp.grad_reduce_in_fp32 = true does it for all)")


@dataclass
class OptimizerConfig(DeferredPostInit):
    """Optimizer settings (megatron-core OptimizerConfig names). ``clip_grad = 0`` disables clipping."""

    optimizer: Literal["adam", "sgd"] = "adam"
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    use_distributed_optimizer: bool = False
    #: The optimizer step's kernels (see bridge_hpc.training.optimizer): torch's fused AdamW on the fp32
    #: main params and foreach gradient norm, clipping and copy-back, on GPU and CPU alike (2.6x faster
    #: than megatron-core's torch-only fallbacks on an H100 without Apex or Transformer Engine; 3x on
    #: CPU). Same Adam math, not bitwise the same sums: false gives megatron-core's own step (GPU) or
    #: torch's default AdamW (CPU) when a run must match those bit for bit.
    fused_step: bool = True
    #: Per-parameter settings, ``[[optimizer.overrides]]`` tables (see ParamGroupOverrideConfig);
    #: finalize() turns each table into a ParamGroupOverrideConfig.
    overrides: List[Union["ParamGroupOverrideConfig", Dict[str, Any]]] = field(default_factory=list)

    def finalize(self) -> None:
        self.overrides = [ParamGroupOverrideConfig.from_table(entry, f"optimizer.overrides[{i}]")
                          for i, entry in enumerate(self.overrides)]
        _check(self.lr is not None, "optimizer.lr", "must be set")
        _check(self.lr > 0, "optimizer.lr", "must be > 0")
        if self.min_lr is None:
            self.min_lr = 0.0
        _check(0 <= self.min_lr <= self.lr, "optimizer.min_lr", "must be between 0 and optimizer.lr")
        _check(self.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
        _check(0 <= self.adam_beta1 < 1, "optimizer.adam_beta1", "must be in [0, 1)")
        _check(0 <= self.adam_beta2 < 1, "optimizer.adam_beta2", "must be in [0, 1)")
        _check(self.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0")
        _check(not (self.bf16 and self.fp16), "optimizer.fp16", "bf16 and fp16 are exclusive")


@dataclass
class ParamGroupOverrideConfig:
    """One ``[[optimizer.overrides]]`` table: optimizer settings for the parameters it names.

    ``params``: shell-style patterns (``fnmatch``) on parameter names as the model names them, the
    data-parallel wrappers' ``module.`` prefixes removed: ``"*.bias"``, ``"*layernorm*"``,
    ``"embedding.*"``, ``"output_layer.weight"``. ``wd_mult`` scales the weight decay; ``lr_mult``
    scales the whole learning-rate schedule (its peak ``optimizer.lr`` and floor ``optimizer.min_lr``);
    ``max_lr`` / ``min_lr`` set the peak and floor directly (megatron-core's ParamGroupOverride keys).
    A parameter takes the default first (no weight decay for biases and 1-D parameters, as in Megatron
    Bridge), then every matching table in file order, later ones winning. The same resolved settings
    become megatron-core's ``config_overrides`` on GPU and the torch optimizer's parameter groups on CPU.
    """

    params: List[str] = field(default_factory=list)
    lr_mult: Optional[float] = None
    max_lr: Optional[float] = None
    min_lr: Optional[float] = None
    wd_mult: Optional[float] = None

    @classmethod
    def from_table(cls, entry: Union["ParamGroupOverrideConfig", Dict[str, Any]], key: str) -> "ParamGroupOverrideConfig":
        """A checked override from a TOML table (or an instance built in Python); errors name ``key``."""
        if not isinstance(entry, cls):
            entry = build_dataclass(cls, key, entry, lambda k, message: ConfigError(message, key=k))
        entry.check(key)
        return entry

    def settings(self) -> Dict[str, float]:
        """The keys this table sets, as megatron-core's ParamGroupOverride names them (``lr_mult``
        stays a multiplier here: :mod:`bridge_hpc.training.optimizer` resolves it against the lr)."""
        names = ("lr_mult", "max_lr", "min_lr", "wd_mult")
        return {name: float(getattr(self, name)) for name in names if getattr(self, name) is not None}

    def check(self, key: str) -> None:
        _check(bool(self.params) and all(isinstance(p, str) and p for p in self.params), f"{key}.params",
               'must list at least one parameter-name pattern, e.g. params = ["*.bias"]')
        _check(bool(self.settings()), key, "sets nothing: give at least one of lr_mult, max_lr, min_lr, wd_mult")
        _check(self.lr_mult is None or (self.max_lr is None and self.min_lr is None), f"{key}.lr_mult",
               "cannot be combined with max_lr or min_lr (lr_mult scales both)")
        _check(self.lr_mult is None or self.lr_mult >= 0, f"{key}.lr_mult", "must be >= 0")
        _check(self.max_lr is None or self.max_lr >= 0, f"{key}.max_lr", "must be >= 0")
        _check(self.min_lr is None or self.min_lr >= 0, f"{key}.min_lr", "must be >= 0")
        _check(self.min_lr is None or self.max_lr is None or self.min_lr <= self.max_lr, f"{key}.min_lr",
               f"must be <= max_lr ({self.max_lr})")
        _check(self.wd_mult is None or self.wd_mult >= 0, f"{key}.wd_mult", "must be >= 0")


@dataclass(frozen=True)
class OptimizerConfigOverrideProviderContext:
    """What an :class:`OptimizerConfigOverrideProvider` sees (Megatron Bridge's names): the scheduler
    and optimizer sections and the model chunks, as the optimizer will get them (wrapped for data
    parallelism). ``model`` is a module or a list of them; typed loosely so this module needs no torch."""

    scheduler_config: SchedulerConfig
    optimizer_config: OptimizerConfig
    model: Any


@dataclass
class OptimizerConfigOverrideProvider:
    """Per-parameter optimizer settings (Megatron Bridge's class; ``ConfigContainer.
    optimizer_config_override_provider``). Subclass and override :meth:`build_config_overrides` for
    rules that TOML patterns cannot say; its result is megatron-core's
    ``dict[ParamKey, ParamGroupOverride]``, used as is on GPU and applied the same way on CPU."""

    def build_config_overrides(self, context: OptimizerConfigOverrideProviderContext) -> Optional[Dict[Any, Any]]:
        """The default: no weight decay for biases and 1-D parameters (norms), then the
        ``[[optimizer.overrides]]`` tables; ``None`` when no parameter gets any override (megatron-core
        then applies its own standard rule, which is the same)."""
        from bridge_hpc.training.optimizer import default_config_overrides

        return default_config_overrides(context)

    def finalize(self) -> None:
        """Nothing to check (``ConfigContainer.finalize_sections`` calls it on every section)."""


@dataclass
class SchedulerConfig:
    """Learning-rate and weight-decay schedule (drives megatron-core's OptimizerParamScheduler).

    Steps are counted in iterations here; ``finalize`` leaves ``lr_decay_iters = None`` for
    :meth:`ConfigContainer.validate` to default to ``train.train_iters``.
    """

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    lr_decay_iters: Optional[int] = None
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    lr_wsd_decay_iters: Optional[int] = None
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    use_checkpoint_opt_param_scheduler: bool = True
    override_opt_param_scheduler: bool = False

    def finalize(self) -> None:
        _check(self.lr_warmup_iters >= 0, "scheduler.lr_warmup_iters", "must be >= 0")
        _check(
            self.lr_warmup_fraction is None or 0 <= self.lr_warmup_fraction <= 1,
            "scheduler.lr_warmup_fraction", "must be in [0, 1]",
        )
        _check(
            not (self.lr_warmup_fraction is not None and self.lr_warmup_iters),
            "scheduler.lr_warmup_fraction", "set either lr_warmup_fraction or lr_warmup_iters, not both",
        )
        _check(
            not (self.use_checkpoint_opt_param_scheduler and self.override_opt_param_scheduler),
            "scheduler.override_opt_param_scheduler",
            "conflicts with scheduler.use_checkpoint_opt_param_scheduler = true",
        )


@dataclass
class TrainingConfig:
    """The training loop: how long, how big a batch, when to evaluate and when to stop.

    ``exit_signal_handler`` defaults to on (Bridge: off) because on a preemptible cluster Slurm's
    SIGTERM (and ``--signal=USR1@...``) is the normal way a job ends: the loop must save and stop.
    ``exit_signal`` (Python names) is filled at submission from ``[slurm] signal`` — the configured
    signal plus SIGTERM, see :mod:`bridge_hpc.contracts.signals`; left unset, :meth:`finalize` takes
    the default signal's list. A list that misses the signal Slurm will send is refused there.
    """

    train_iters: Optional[int] = None
    micro_batch_size: Optional[int] = None
    global_batch_size: Optional[int] = None
    #: Deprecated spellings of ``[validation]``'s fields (as in Bridge): None unless set; a value set
    #: here moves to ``validation`` (:meth:`ConfigContainer.finalize_sections`), which the loop reads.
    eval_interval: Optional[int] = None
    eval_iters: Optional[int] = None
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = True
    exit_signal: Optional[Union[str, List[str]]] = None
    #: Megatron's ``--manual-gc``: Python's automatic garbage collection is off while training, and a
    #: full collection runs every ``manual_gc_interval`` steps (0: only when training starts), at the
    #: same step on every rank, instead of whenever one rank's allocations trigger it.
    manual_gc: bool = False
    manual_gc_interval: int = 0
    skip_train: Optional[bool] = None
    #: With model parallelism (more than one rank per model): agree on whether the optimizer step
    #: succeeded (a logical AND) and on the grad norm (the max) over the model-parallel group, as
    #: Bridge's train_step does. With one rank per model there is nothing to agree on.
    check_optimizer_step_success: bool = True
    skip_sync_grad_norm_across_mp: bool = False

    def finalize(self) -> None:
        _check(self.train_iters is not None, "train.train_iters", "must be set")
        _check(self.train_iters >= 0, "train.train_iters", "must be >= 0")
        _check(self.micro_batch_size is not None and self.micro_batch_size > 0,
               "train.micro_batch_size", "must be a positive integer")
        _check(self.global_batch_size is not None and self.global_batch_size > 0,
               "train.global_batch_size", "must be a positive integer")
        for key in ("eval_interval", "eval_iters", "exit_interval"):
            value = getattr(self, key)
            _check(value is None or value >= 0, f"train.{key}", "must be >= 0")
        _check(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
               "train.exit_duration_in_mins", "must be > 0")
        _check(self.manual_gc_interval >= 0, "train.manual_gc_interval", "must be >= 0 (0: never collect during training)")
        if self.exit_signal is None:
            self.exit_signal = list(signals.default_rank_signals())
        if isinstance(self.exit_signal, str):
            self.exit_signal = [self.exit_signal]
        import signal

        for name in self.exit_signal:
            _check(isinstance(getattr(signal, str(name), None), signal.Signals),
                   "train.exit_signal", f"unknown signal {name!r} (e.g. 'SIGTERM', 'SIGUSR1')")


@dataclass
class CheckpointConfig:
    """Saving and loading. ``load`` falls back to ``save`` in :meth:`finalize` so that a requeued
    job resumes from its own checkpoints without any extra setting.

    ``most_recent_k = -1`` keeps every checkpoint; ``save_interval = None`` saves only on exit.

    ``async_save`` writes the interval saves in the background (a persistent worker process per
    rank; see ``bridge_hpc.training.async_checkpoint``); exit saves stay synchronous. A failed
    background save is reported and training goes on; ``async_save_max_failures`` failures in a row
    (bridge_hpc's key) stop the run with an error.
    """

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    most_recent_k: int = -1
    async_save: bool = False
    async_save_max_failures: int = 3
    pretrained_checkpoint: Optional[str] = None
    ckpt_format: Literal["torch_dist"] = "torch_dist"
    save_optim: bool = True
    save_rng: bool = True
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    exit_on_missing_checkpoint: bool = False
    #: torch_dist files each rank writes, in parallel (Bridge's name; Bridge's default is 1: here 4, which
    #: wrote the H100 figures in the README's performance section).
    storage_writers_per_rank: int = 4
    #: Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``: the distributed optimizer's state is
    #: saved in megatron-core's ``fully_reshardable`` layout, which loads at any tensor/pipeline/data-
    #: parallel layout (each data-parallel group gathers its state to one rank while saving). Off
    #: (Megatron's default, ``dp_reshardable``): each rank writes its own shard, fast, and the state
    #: loads at another data-parallel size only; a model-parallel change then needs this on when
    #: saving, or ``load_optim = false``. Weights load at any layout either way.
    dist_ckpt_optim_fully_reshardable: bool = False
    #: Bridge's async-save options, with the only values this trainer has: one persistent worker
    #: process (a worker per save would pay its start-up in every save), nvidia-resiliency-ext's
    #: strategy, write results collected in the worker itself (no multiprocessing queue, so "fork"
    #: describes it), no FSDP DTensor checkpoints and no custom checkpoint manager.
    use_persistent_ckpt_worker: bool = True
    async_strategy: Literal["nvrx"] = "nvrx"
    async_write_results_mp_mode: Literal["fork"] = "fork"
    strict_fsdp_dtensor_load: bool = False
    custom_manager_class: Optional[str] = None

    def finalize(self) -> None:
        if self.load is None:
            self.load = self.save
        _check(self.save_interval is None or self.save_interval > 0,
               "checkpoint.save_interval", "must be > 0")
        _check(self.storage_writers_per_rank > 0, "checkpoint.storage_writers_per_rank", "must be > 0")
        _check(self.use_persistent_ckpt_worker, "checkpoint.use_persistent_ckpt_worker",
               "must be true: async saves go through one persistent worker process (a worker per save "
               "would pay its start-up in every save)")
        _check(self.async_strategy == "nvrx", "checkpoint.async_strategy",
               "must be \"nvrx\": async saves use nvidia-resiliency-ext's queue and worker")
        _check(self.async_write_results_mp_mode == "fork", "checkpoint.async_write_results_mp_mode",
               "must be \"fork\": write results are collected in the worker process, not through a queue")
        _check(not self.strict_fsdp_dtensor_load, "checkpoint.strict_fsdp_dtensor_load",
               "must be false: there are no FSDP DTensor checkpoints here")
        _check(self.custom_manager_class is None, "checkpoint.custom_manager_class",
               "must be unset: bridge_hpc's checkpointing (atomic folders, manifest, async worker) has no "
               "pluggable manager")
        _check(self.most_recent_k == -1 or self.most_recent_k > 0,
               "checkpoint.most_recent_k", "must be -1 (keep all) or > 0")
        _check(self.async_save_max_failures >= 1, "checkpoint.async_save_max_failures",
               "must be >= 1 (failed background saves in a row before the run stops)")


@dataclass
class LoggerConfig:
    """Console, metrics-file and TensorBoard logging.

    ``metrics_file`` is ours (not Bridge's): the JSON-lines file that records every step's loss at
    full precision; ``bridge_hpc.training.run`` points it at ``<run_dir>/metrics.jsonl``. ``log_progress``
    appends Megatron's ``progress.txt`` (plus bridge_hpc's goodput events) in ``checkpoint.save``.

    TensorBoard is on by default for jobs: a job file that leaves ``tensorboard_dir`` unset gets
    ``<run_dir>/tensorboard`` (:data:`bridge_hpc.contracts.run_folder.TENSORBOARD_DIR`), so that
    ``tensorboard --logdir runs/`` shows every run. ``tensorboard_dir = ""`` turns it off; so does None,
    Bridge's default, for a config built in Python. ``finalize`` makes "" None: one spelling of "off".
    """

    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    log_progress: bool = False
    timing_log_level: Literal[-1, 0, 1, 2] = 0
    log_timers_to_tensorboard: bool = False
    log_params_norm: bool = False
    # Megatron's step reports (bridge_hpc.training.utils.train_utils.training_log): computed on log steps only
    # (step % log_interval == 0), so they add nothing to the steps in between.
    log_throughput: bool = False
    log_throughput_to_tensorboard: bool = False
    throughput_window_size: int = 100
    log_memory_to_tensorboard: bool = False
    memory_keys: Optional[Dict[str, str]] = None
    log_l2_norm_grad_to_tensorboard: bool = False
    log_runtime_to_tensorboard: bool = False
    runtime_time_unit: Literal["seconds", "minutes", "hours", "days"] = "hours"
    metrics_file: Optional[str] = None
    logging_level: int = 20  # Python logging level of bridge_hpc's own messages (20 = INFO)
    #: Bridge's: no step log at all (console, TensorBoard, metrics.jsonl); evaluation, progress.txt
    #: and checkpoints are unchanged.
    skip_train_metrics_log: bool = False
    #: Bridge's MLflow and Comet backends. Neither package is a dependency of this toolkit (TensorBoard
    #: and metrics.jsonl are its backends), so setting any of these is refused rather than ignored.
    mlflow_experiment: Optional[str] = None
    mlflow_run_name: Optional[str] = None
    mlflow_tracking_uri: Optional[str] = None
    mlflow_tags: Optional[Dict[str, str]] = None
    comet_project: Optional[str] = None
    comet_experiment_name: Optional[str] = None
    comet_workspace: Optional[str] = None
    comet_api_key: Optional[str] = None
    comet_tags: Optional[List[str]] = None

    def finalize(self) -> None:
        for name in ("mlflow_experiment", "mlflow_run_name", "mlflow_tracking_uri", "mlflow_tags", "comet_project",
                     "comet_experiment_name", "comet_workspace", "comet_api_key", "comet_tags"):
            _check(getattr(self, name) is None, f"logger.{name}",  # never the value: an API key is a secret
                   "must be unset: bridge_hpc logs to TensorBoard and metrics.jsonl (MLflow and Comet are not "
                   "among its dependencies)")
        _check(self.log_interval > 0, "logger.log_interval", "must be > 0")
        _check(self.throughput_window_size >= 2, "logger.throughput_window_size",
               "must be >= 2 (a rate needs the times of two steps)")
        _check(self.logging_level in (10, 20, 30, 40, 50), "logger.logging_level",
               "must be a Python logging level: 10 (DEBUG), 20 (INFO), 30 (WARNING), 40 or 50")
        _check(self.tensorboard_log_interval > 0, "logger.tensorboard_log_interval", "must be > 0")
        _check(self.tensorboard_dir is None or (isinstance(self.tensorboard_dir, str)
                                                and self.tensorboard_dir == self.tensorboard_dir.strip()),
               "logger.tensorboard_dir", f'expected a folder path, or "" to turn TensorBoard off, got {self.tensorboard_dir!r}')
        if self.tensorboard_dir == "":
            self.tensorboard_dir = None


@dataclass
class ValidationConfig:
    """Evaluation during and after training: megatron's ``ValidationConfig`` (its fields and defaults),
    where Bridge moved ``train.eval_iters``, ``train.eval_interval`` and ``train.skip_train``.

    ``eval_iters`` global batches of the validation split every ``eval_interval`` steps (None: no
    evaluation while training); ``skip_train``: evaluate and exit without training. The train
    section's old spellings are still read (:meth:`ConfigContainer.finalize_sections` moves them
    here). ``test_mode``, ``full_validation`` and ``multiple_validation_sets`` are megatron's too and
    are refused when set: this trainer evaluates ``eval_iters`` batches of one validation split.
    """

    eval_iters: Optional[int] = 100
    eval_interval: Optional[int] = None
    skip_train: bool = False
    test_mode: bool = False
    full_validation: bool = False
    multiple_validation_sets: bool = False

    def finalize(self) -> None:
        for key in ("eval_iters", "eval_interval"):
            value = getattr(self, key)
            _check(value is None or value >= 0, f"validation.{key}", "must be >= 0")
        for key, why in (("test_mode", "megatron's real-time test runs are not part of this trainer"),
                         ("full_validation", "each evaluation reads validation.eval_iters batches"),
                         ("multiple_validation_sets", "the validation split is one dataset (or one blend)")):
            _check(not getattr(self, key), f"validation.{key}", f"must be false: {why}")


@dataclass
class ProfilingConfig:
    """torch.profiler over a window of steps, on chosen ranks; traces go to ``tensorboard_dir``."""

    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: List[int] = field(default_factory=lambda: [0])
    record_shapes: bool = False
    # CUDA allocator history from the start (train_utils.start_memory_history_recording), dumped at
    # profile_step_end to <memory_snapshot_path stem>_<rank><ext> for pytorch.org/memory_viz.
    record_memory_history: bool = False
    memory_snapshot_path: str = "snapshot.pickle"

    def finalize(self) -> None:
        _check(self.profile_step_end > self.profile_step_start, "profiling.profile_step_end",
               "must be > profiling.profile_step_start")


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
        _check(self.report_time_interval > 0, "nvrx_straggler.report_time_interval", "must be > 0")
        _check(self.profiling_interval > 0, "nvrx_straggler.profiling_interval", "must be > 0")


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
    :mod:`bridge_hpc.training.rerun`.
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


#: What tensor inspection needs and bridge_hpc lacks; :meth:`TensorInspectConfig.finalize` names it.
TENSOR_INSPECT_PACKAGE = "nvdlfw_inspect"


@dataclass
class TensorInspectConfig:
    """Nvidia-DL-Framework-Inspect (``nvdlfw_inspect``) tensor statistics: Megatron Bridge's fields.

    Accepted and checked so that Bridge recipes with a ``[tensor_inspect]`` section (or
    ``tensor_inspect = TensorInspectConfig(enabled=False)``) run unchanged. Inspection itself is not
    available: it hooks Transformer Engine layers through TE's debug features
    (``transformer_engine.debug``) and the ``nvdlfw_inspect`` package, and bridge_hpc neither installs
    them nor calls the inspector from its loop. So ``enabled = true`` is refused at submission with
    a ConfigError that says which of the two is missing here, rather than training silently without
    the statistics the job asked for. ``features`` is a table of feature settings or the path of
    their YAML file; ``feature_dirs`` the folders searched for feature code; ``log_dir`` the folder of
    the statistics (Bridge: the checkpoint folder when unset); ``init_training_step`` the step the
    inspector starts counting from on a resume.
    """

    enabled: bool = False
    features: Optional[Union[Dict[str, Any], str, os.PathLike]] = None
    feature_dirs: Optional[List[str]] = None
    log_dir: Optional[str] = None
    init_training_step: int = 0

    def finalize(self) -> None:
        if isinstance(self.features, os.PathLike):
            self.features = os.fspath(self.features)
        _check(not isinstance(self.features, str) or self.features.strip() != "", "tensor_inspect.features",
               "expected a table of feature settings or the path of a YAML file, got an empty string")
        for i, folder in enumerate(self.feature_dirs or []):
            _check(isinstance(folder, str) and folder.strip() != "", "tensor_inspect.feature_dirs",
                   f"entry {i} must be a folder path, got {folder!r}")
        _check(self.log_dir is None or self.log_dir.strip() != "", "tensor_inspect.log_dir",
               "expected a folder path, got an empty string")
        _check(self.init_training_step >= 0, "tensor_inspect.init_training_step", "must be >= 0")
        if self.enabled:
            import importlib.util

            missing = [name for name in (TENSOR_INSPECT_PACKAGE, "transformer_engine")
                       if importlib.util.find_spec(name) is None]
            why = (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed here, and "
                   if missing else "")
            raise ConfigError(f"tensor inspection is not available in bridge_hpc: {why}its training loop does "
                              "not call the inspector. Set tensor_inspect.enabled = false (or remove the "
                              "[tensor_inspect] section)", key="tensor_inspect.enabled")


#: The widest row (``model.hidden_size``) the Triton norm kernel holds in registers (``model.fused_kernels``).
FUSED_NORM_MAX_WIDTH = 16384


@dataclass
class GPTModelConfig:
    """A GPT built from megatron-core's ``GPTModel``; names follow megatron-core's TransformerConfig.

    Model parallelism (GPUs only; :mod:`bridge_hpc.training.parallel`): ``tensor_model_parallel_size``
    splits each layer's matrices, ``sequence_parallel`` (with TP > 1) also splits the activations
    between them, ``pipeline_model_parallel_size`` splits the layers into stages (megatron-core's
    pipeline schedules), ``virtual_pipeline_model_parallel_size`` gives each stage that many
    interleaved chunks, and ``context_parallel_size`` splits the sequence (its attention needs
    Transformer Engine). The data-parallel size is what is left of the world.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    vocab_size: int = 128
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 32
    max_position_embeddings: Optional[int] = None
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    activation_func: Literal["gelu", "silu", "swiglu"] = "gelu"
    add_bias_linear: bool = True
    share_embeddings_and_output_weights: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    bf16: bool = False
    fp16: bool = False
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    #: megatron-core's ``deterministic_mode``: deterministic kernels only, so that two runs (and a
    #: resumed run) compute bit for bit the same on GPUs, whose fastest attention backward and some
    #: reductions accumulate in varying order. Slower. On the ranks: torch's deterministic algorithms,
    #: cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG``) and one NCCL algorithm (``NCCL_ALGO``,
    #: Ring unless set), as Megatron requires. CPU training is deterministic without it.
    deterministic_mode: bool = False
    #: megatron-core's fused kernels, built with ``torch.compile`` (its ``jit_fuser``) at their first
    #: call, i.e. during the first step; Inductor caches the compiled kernels on the node's disk, so a
    #: requeued run on the same node compiles faster. Each fuses memory-bound work into one kernel:
    #: the MLP's bias and activation (gelu with ``add_bias_linear``, or swiglu), the bias, dropout and
    #: residual add after attention and MLP, and the output layer's cross entropy (the logits of a
    #: large vocabulary are the step's biggest tensor; ``"native"``: megatron-core's own, not TE's).
    #: Off by default as in megatron-core; meant for GPUs (compiling on a CPU rank costs seconds for a
    #: small gain).
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    cross_entropy_loss_fusion: bool = False
    #: megatron-core's ``cuda_graph_impl``: ``"full_iteration"`` replays each training step's forward
    #: and backward as one CUDA graph (:mod:`bridge_hpc.training.cuda_graphs`), captured after
    #: ``cuda_graph_warmup_steps`` eager steps, so the step no longer waits for one Python thread to
    #: launch its kernels. GPUs only; data parallelism only (no tensor, pipeline or context
    #: parallelism) and no ``ddp.overlap_param_gather``. ``"none"``: eager steps.
    cuda_graph_impl: Literal["none", "full_iteration"] = "none"
    cuda_graph_warmup_steps: int = 3
    #: The toolkit's kernels (:mod:`bridge_hpc.training.fused_kernels`) for what Transformer Engine
    #: would fuse in the local layers: the output layer's cross entropy in Triton (one pass over the
    #: logits, no fp32 copy of them kept; it replaces megatron-core's, fused or not), every
    #: LayerNorm/RMSNorm in Triton, and the biases of the linear layers that add their own (the QKV
    #: projection's) inside the matrix multiply. Same parameters and checkpoints as without. GPUs only
    #: (CUDA builds of torch ship triton); hidden sizes up to ``FUSED_NORM_MAX_WIDTH``; not with
    #: Transformer Engine's layers, which fuse these themselves.
    fused_kernels: bool = False

    def finalize(self) -> None:
        for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            _check(getattr(self, key) > 0, f"model.{key}", "must be > 0")
        _check(self.hidden_size % self.num_attention_heads == 0 or self.kv_channels is not None,
               "model.num_attention_heads", "must divide model.hidden_size (or set model.kv_channels)")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        _check(self.num_attention_heads % self.num_query_groups == 0, "model.num_query_groups",
               "must divide model.num_attention_heads")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        _check(self.max_position_embeddings >= self.seq_length, "model.max_position_embeddings",
               "must be >= model.seq_length")
        _check(0 <= self.hidden_dropout < 1, "model.hidden_dropout", "must be in [0, 1)")
        _check(0 <= self.attention_dropout < 1, "model.attention_dropout", "must be in [0, 1)")
        _check(not (self.bf16 and self.fp16), "model.fp16", "bf16 and fp16 are exclusive")
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            _check(isinstance(getattr(self, key), int) and getattr(self, key) >= 1, f"model.{key}", "must be an integer >= 1")
        if self.bias_activation_fusion:
            _check(self.activation_func != "silu", "model.bias_activation_fusion",
                   "fuses gelu or swiglu only (model.activation_func = \"silu\" has no fused kernel)")
            _check(self.activation_func != "gelu" or self.add_bias_linear, "model.bias_activation_fusion",
                   "with model.activation_func = \"gelu\" needs model.add_bias_linear = true (it fuses the bias)")
        if self.fused_kernels:
            _check(self.transformer_impl == "local", "model.fused_kernels",
                   "stands in for Transformer Engine's kernels in the local layers: with model.transformer_impl = "
                   "\"transformer_engine\" its own norms and cross entropy run; set one or the other")
            _check(self.hidden_size <= FUSED_NORM_MAX_WIDTH, "model.fused_kernels",
                   f"normalizes rows of up to {FUSED_NORM_MAX_WIDTH} values, and model.hidden_size is {self.hidden_size}")
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        if self.full_iteration_cuda_graph:
            _check(isinstance(self.cuda_graph_warmup_steps, int) and self.cuda_graph_warmup_steps >= 1,
                   "model.cuda_graph_warmup_steps", "must be an integer >= 1: the eager steps before the capture "
                   f"compile the fused kernels, which a capture cannot do; got {self.cuda_graph_warmup_steps!r}")
            _check(tp == pp == cp == 1, "model.cuda_graph_impl",
                   "\"full_iteration\" runs with data parallelism only: model.tensor_model_parallel_size, "
                   f"pipeline_model_parallel_size and context_parallel_size must be 1, got {tp}, {pp} and {cp}")
        _check(self.num_attention_heads % tp == 0, "model.tensor_model_parallel_size",
               f"must divide model.num_attention_heads ({self.num_attention_heads}), got {tp}")
        _check(self.num_query_groups % tp == 0, "model.tensor_model_parallel_size",
               f"must divide model.num_query_groups ({self.num_query_groups}), got {tp}")
        _check(self.ffn_hidden_size % tp == 0, "model.tensor_model_parallel_size",
               f"must divide model.ffn_hidden_size ({self.ffn_hidden_size}), got {tp}")
        _check(not self.sequence_parallel or tp > 1, "model.sequence_parallel",
               "needs model.tensor_model_parallel_size > 1 (it splits activations across the tensor-parallel ranks)")
        _check(not self.sequence_parallel or self.transformer_impl == "transformer_engine", "model.sequence_parallel",
               "needs model.transformer_impl = \"transformer_engine\": megatron-core's local layers normalize with "
               "torch's LayerNorm, which cannot work on a split sequence")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            _check(isinstance(vpp, int) and vpp >= 1, "model.virtual_pipeline_model_parallel_size",
                   f"must be an integer >= 1, got {vpp!r}")
            _check(vpp == 1 or pp > 1, "model.virtual_pipeline_model_parallel_size",
                   "needs model.pipeline_model_parallel_size > 1 (the chunks interleave pipeline stages)")
        chunks = pp * (vpp or 1)
        _check(self.num_layers % chunks == 0, "model.pipeline_model_parallel_size",
               f"pipeline stages x virtual chunks ({chunks}) must divide model.num_layers ({self.num_layers})")
        if cp > 1:
            _check(self.seq_length % (2 * cp) == 0, "model.context_parallel_size",
                   f"2 x context_parallel_size ({2 * cp}) must divide model.seq_length ({self.seq_length}): "
                   "each rank holds two balanced chunks of the sequence")
            _check(self.transformer_impl == "transformer_engine", "model.context_parallel_size",
                   "needs model.transformer_impl = \"transformer_engine\": context-parallel attention is "
                   "Transformer Engine's (the local attention sees the whole sequence)")

    @property
    def full_iteration_cuda_graph(self) -> bool:
        """Whether training steps replay one CUDA graph (``cuda_graph_impl = "full_iteration"``)."""
        return self.cuda_graph_impl == "full_iteration"

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold parts of one model replica (tensor x pipeline x context parallel)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

#: Tokenizer types that read a file or folder named by ``tokenizer.tokenizer_model``.
TOKENIZER_TYPES_WITH_MODEL = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                              "TikTokenizer")


@dataclass
class TokenizerConfig:
    """Which tokenizer turns text into token ids: Megatron Bridge's ``TokenizerConfig`` names.

    Built on the ranks (and by ``bridge-prepare-data``) with megatron-core's own tokenizer library,
    see :mod:`bridge_hpc.training.tokenizers`. Types: ``HuggingFaceTokenizer`` (a local folder or
    ``tokenizer.json``), ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` (a local ``.model``),
    ``TikTokenizer`` (a local tiktoken vocabulary file), ``NullTokenizer`` (text is space-separated
    ids; needs ``vocab_size``) and ``ByteLevelTokenizer`` (ours, not Bridge's: UTF-8 bytes 0-255 plus
    special tokens from id 256 on, no file at all).

    Nothing is ever downloaded, so ``tokenizer_model`` must be an existing local path: checked here,
    at submission, rather than minutes later on every rank. A relative path means the folder
    bridge-submit runs in (as for ``job.run_dir``); resolved.toml records it absolute.

    ``vocab_size`` is the tokenizer's (Bridge: "size of vocab before EOD or padding"; NullTokenizer
    and TikTokenizer read it). ``use_tokenizer_vocab_size`` says whether the model's vocabulary comes
    from the tokenizer: left unset, :meth:`ConfigContainer.from_sections` makes it true exactly when
    ``[model]`` does not set ``vocab_size``. The tokenizer's size is then padded up to a multiple of
    ``make_vocab_size_divisible_by`` (Megatron's default 128) x the tensor-parallel size.
    ``vocab_extra_ids`` adds ``<extra_id_0>``... special tokens (HuggingFace, SentencePiece, byte-level).
    """

    tokenizer_type: Optional[Literal["HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                                     "TikTokenizer", "NullTokenizer", "ByteLevelTokenizer"]] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_extra_ids: int = 0
    special_tokens: Optional[List[str]] = None
    tiktoken_pattern: Optional[Literal["v1", "v2"]] = None
    tiktoken_num_special_tokens: int = 1000
    hf_tokenizer_kwargs: Dict[str, Any] = field(default_factory=dict)
    sp_tokenizer_kwargs: Dict[str, Any] = field(default_factory=dict)
    make_vocab_size_divisible_by: int = 128
    use_tokenizer_vocab_size: Optional[bool] = None

    def finalize(self) -> None:
        _check(self.tokenizer_type is not None, "tokenizer.tokenizer_type",
               "must be set: HuggingFaceTokenizer, SentencePieceTokenizer, TikTokenizer, NullTokenizer "
               "or ByteLevelTokenizer")
        if self.tokenizer_type in TOKENIZER_TYPES_WITH_MODEL:
            _check(self.tokenizer_model is not None, "tokenizer.tokenizer_model",
                   f"must be set for {self.tokenizer_type}: a local file or folder (nothing is downloaded)")
        else:
            _check(self.tokenizer_model is None, "tokenizer.tokenizer_model",
                   f"is not used by {self.tokenizer_type}; remove it")
        for key in ("tokenizer_model", "vocab_file", "merge_file"):
            value = getattr(self, key)
            if value is None:
                continue
            path = os.path.abspath(os.path.expanduser(value))
            _check(os.path.exists(path), f"tokenizer.{key}",
                   f"{value!r} is not an existing local file or folder (nothing is downloaded: a hub name does not work)")
            setattr(self, key, path)
        _check(self.tokenizer_type != "NullTokenizer" or self.vocab_size is not None, "tokenizer.vocab_size",
               "must be set for NullTokenizer")
        _check(self.vocab_size is None or self.vocab_size > 0, "tokenizer.vocab_size", "must be > 0")
        _check(self.vocab_extra_ids >= 0, "tokenizer.vocab_extra_ids", "must be >= 0")
        _check(self.vocab_extra_ids == 0 or self.tokenizer_type not in ("TikTokenizer", "NullTokenizer"),
               "tokenizer.vocab_extra_ids", f"is not supported by {self.tokenizer_type}")
        _check(self.make_vocab_size_divisible_by > 0, "tokenizer.make_vocab_size_divisible_by", "must be > 0")
        _check(self.tiktoken_num_special_tokens >= 0, "tokenizer.tiktoken_num_special_tokens", "must be >= 0")


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@dataclass
class DatasetBuildContext:
    """What the trainer tells a :class:`DatasetProvider`: how many samples each split must supply."""

    train_samples: int
    valid_samples: int
    test_samples: int
    tokenizer: Optional[Any] = None
    pg_collection: Optional[Any] = None
    #: The model's vocabulary size: token ids in the data must be below it.
    vocab_size: Optional[int] = None


@dataclass
class DataloaderConfig:
    """DataLoader settings shared by every dataset config (Bridge's names).

    ``dataloader_type``: ``"single"`` loads one micro-batch at a time; ``"batch"`` loads each rank's
    share of a whole global batch at once and splits it into micro-batches, so that a dataset with
    its own ``collate_fn`` (fine-tuning: :class:`FinetuningDatasetConfig`) pads every micro-batch of a
    step to one length. Both read the same samples in the same order.
    """

    dataloader_type: Optional[Literal["single", "cyclic", "batch", "external"]] = "single"
    num_workers: int = 2
    data_sharding: bool = True
    pin_memory: bool = True
    drop_last: bool = True
    persistent_workers: bool = True
    #: Bridge's, for Hugging Face dataset paths. Data here comes from local files only, which run no
    #: code, so there is nothing to trust: ``true`` is refused rather than ignored.
    trust_remote_code: Optional[bool] = None

    def finalize(self) -> None:
        _check(self.num_workers >= 0, "dataset.num_workers", "must be >= 0")
        _check(not self.trust_remote_code, "dataset.trust_remote_code",
               "must not be true: data is read from local files only (no Hugging Face paths), which run no code")
        if self.num_workers == 0:
            self.persistent_workers = False


@dataclass
class DatasetProvider(DataloaderConfig, abc.ABC):
    """Hook for custom data: subclass, implement :meth:`build_datasets`, put it in ``cfg.dataset``.

    Datasets must be map-style (``__len__`` and ``__getitem__``) and deterministic in the index:
    the trainer samples them in order from the number of consumed samples, which is what makes the
    data position part of every checkpoint and resume exact. Samples are dicts of tensors, the
    shape the forward-step function expects (for :func:`bridge_hpc.training.gpt_step.forward_step`:
    ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, optionally ``attention_mask``).
    """

    @abc.abstractmethod
    def build_datasets(self, context: DatasetBuildContext) -> Tuple[Optional[Any], Optional[Any], Optional[Any]]:
        """Return ``(train, valid, test)``; any may be None."""


@dataclass
class MockGPTDatasetConfig(DatasetProvider):
    """Synthetic, learnable token sequences: each sample is fully determined by ``(random_seed, split, index)``.

    ``vocab_size = None`` takes the model's vocabulary size.
    """

    seq_length: int = 32
    random_seed: int = 1234
    vocab_size: Optional[int] = None

    def finalize(self) -> None:
        super().finalize()
        _check(self.seq_length > 0, "dataset.seq_length", "must be > 0")

    def build_datasets(self, context: DatasetBuildContext):
        from bridge_hpc.training.data import MockGPTDataset

        def split(name: str, n: int):
            if n <= 0:
                return None
            return MockGPTDataset(n, self.seq_length, self.vocab_size, self.random_seed, name)

        return split("train", context.train_samples), split("valid", context.valid_samples), split(
            "test", context.test_samples)


#: The ``[dataset]`` keys that name indexed datasets; any of them selects :class:`GPTDatasetConfig`.
GPT_DATASET_PATH_KEYS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")

#: Megatron-LM's ``--split`` default, used when ``data_path`` is given without ``split``.
DEFAULT_SPLIT = "969,30,1"

#: A blend as megatron-core takes it: dataset prefixes and their weights (None: by size).
Blend = Tuple[List[str], Optional[List[float]]]

#: megatron-core's indexed-dataset ``DType`` codes -> (name, bytes per token); floats are not token ids.
_INDEX_DTYPES = {1: ("uint8", 1), 2: ("int8", 1), 3: ("int16", 2), 4: ("int32", 4), 5: ("int64", 8),
                 8: ("uint16", 2)}
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
#: magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_INDEX_HEADER_BYTES = 34


@dataclass(frozen=True)
class IndexedDatasetHeader:
    """What an ``.idx`` file says about its ``.bin``: read with ``struct``, no numpy or torch."""

    prefix: str
    dtype: str
    itemsize: int
    sequence_count: int
    document_count: int
    bin_bytes: int


def _blend_items(value: Union[str, List[Union[str, float]]]) -> List[Union[str, float]]:
    """A ``data_path`` value as a list: a string is split on whitespace (Megatron-LM's form)."""
    return value.split() if isinstance(value, str) else list(value)


def _as_weight(item: Union[str, float]) -> Optional[float]:
    """``item`` as a number, or None when it is not one (a prefix). An integer too large for a float
    (a config built in Python) is infinite, which :func:`parse_blend` then refuses as a weight."""
    try:
        return float(item)
    except OverflowError:
        return float("inf")
    except (TypeError, ValueError):
        return None


def parse_blend(value: Union[str, List[Union[str, float]]], key: str) -> Blend:
    """``data_path`` (or a per-split path) -> ``(prefixes, weights)``, Megatron-LM's ``--data-path`` rules.

    ``["a", "b"]`` is two datasets weighted by their size (weights None); ``["0.7", "a", "0.3", "b"]``
    (or ``"0.7 a 0.3 b"``) weights them explicitly: when the first item is a number, every other item
    is a weight, and each must be a finite positive number. megatron-core divides the weights by their
    float64 sum on every rank (``normalize``): a sum that overflows to inf makes every share 0, which
    fails its assertion that the shares add up to 1 (a bare AssertionError after the queue), and a
    weight tiny next to the others gets a share of 0, a dataset asked for nothing. So the sum must stay
    at most half the float64 range (no order of adding can then overflow) and every share must be a
    normal positive float64 (a margin over 0 for rounding differences between this sum and numpy's).
    Prefixes are returned as given (made absolute by
    :meth:`GPTDatasetConfig.finalize`). A malformed list raises ConfigError naming ``key``.
    """
    items = _blend_items(value)
    _check(len(items) > 0, key, "is empty: give one or more dataset prefixes")
    if _as_weight(items[0]) is None:
        bad = [item for item in items if not isinstance(item, str) or not item]
        _check(not bad, key, f"expected dataset prefixes, got {bad[0]!r} (weights go before every prefix: "
                              "['0.7', 'a', '0.3', 'b'])" if bad else "")
        return [str(item) for item in items], None
    _check(len(items) % 2 == 0, key, f"a weighted blend alternates weight and prefix, got {len(items)} items: "
                                     f"{items!r}")
    prefixes, weights = [], []
    for weight, prefix in zip(items[0::2], items[1::2]):
        number = _as_weight(weight)
        _check(number is not None, key, f"blend weight {weight!r} is not a number (expected weight, prefix, "
                                        "weight, prefix, ...)")
        _check(math.isfinite(number) and number > 0, key,
               f"blend weight {weight!r} must be a positive number (finite, above 0)")
        _check(isinstance(prefix, str) and prefix != "" and _as_weight(prefix) is None, key,
               f"expected a dataset prefix after weight {weight!r}, got {prefix!r}")
        prefixes.append(prefix)
        weights.append(number)
    total = sum(weights)
    _check(total <= sys.float_info.max / 2, key,
           ("the blend weights add up to more than a float64 holds" if math.isinf(total) else
            f"the blend weights add up to {total:g}, too close to the float64 limit ({sys.float_info.max:g})")
           + ": megatron-core divides them by their sum; scale them down (only their ratios matter)")
    for weight, number in zip(items[0::2], weights):
        _check(number / total >= sys.float_info.min, key,
               f"blend weight {weight!r} is too small next to their sum {total:g}: its share {number / total:g} "
               "is not a normal positive float64; raise it or drop its dataset")
    return prefixes, weights


def parse_split(split: str, key: str = "dataset.split") -> List[float]:
    """``"969,30,1"`` -> the train/valid/test fractions; up to three non-negative numbers with a positive sum.

    Stricter than megatron-core's own parser, which picks numbers out of any text and would turn
    ``"90;x"`` or ``"0,0,0"`` into an assertion or a division by zero on every rank.
    """
    parts = [p.strip() for p in str(split).split(",")]
    _check(1 <= len(parts) <= 3, key, f"expected up to three comma-separated weights (train,valid,test) like "
                                      f"'{DEFAULT_SPLIT}', got {split!r}")
    numbers = []
    for part in parts:
        number = _as_weight(part) if part else None
        _check(number is not None and number >= 0 and number != float("inf"), key,
               f"{part!r} is not a non-negative number (expected weights like '{DEFAULT_SPLIT}', got {split!r})")
        numbers.append(number)
    total = sum(numbers)
    _check(total > 0, key, f"the weights add up to 0; expected e.g. '{DEFAULT_SPLIT}', got {split!r}")
    return [n / total for n in numbers] + [0.0] * (3 - len(numbers))


def read_index_header(prefix: str, key: str) -> IndexedDatasetHeader:
    """Check ``prefix.idx`` / ``prefix.bin`` in O(1) reads; raise ConfigError naming the file and ``key``.

    The ``.idx`` header gives the token dtype and the sequence and document counts, which fix the
    ``.idx`` size (lengths int32, pointers int64 per sequence, int64 per document boundary). The
    pointers are the running sum of the sequence lengths times the item size, so the last pointer plus
    the last length times the item size is what the ``.bin`` size must be: a truncated file, or an
    ``.idx`` paired with a ``.bin`` of another dtype or dataset, fails here instead of as a numpy error
    (or silently wrong tokens) on every rank. So does a dataset of empty documents only (an empty
    ``.bin``, which megatron-core's memory map cannot open: "cannot mmap an empty file").
    """
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        _check(os.path.isfile(path), key, f"{path} is missing (expected {prefix}.bin and .idx, as written by "
                                          "bridge-prepare-data)")
    idx_bytes, bin_bytes = os.path.getsize(idx), os.path.getsize(bin_)
    with open(idx, "rb") as f:
        head = f.read(_INDEX_HEADER_BYTES)
        _check(len(head) == _INDEX_HEADER_BYTES, key, f"{idx} is truncated ({idx_bytes} bytes, shorter than the "
                                                     "index header)")
        magic, version, code, n, d = struct.unpack("<9sQBQQ", head)
        _check(magic == _INDEX_MAGIC, key, f"{idx} is not a megatron-core index file (bad magic bytes)")
        _check(version == 1, key, f"{idx} has index version {version}; this reader knows version 1")
        _check(code in _INDEX_DTYPES, key, f"{idx} has dtype code {code}, which is not an integer token dtype")
        dtype, itemsize = _INDEX_DTYPES[code]
        _check(n > 0 and d >= 2, key, f"{idx} holds no documents")
        expected = _INDEX_HEADER_BYTES + 12 * n + 8 * d
        # A multimodal index has one more byte per sequence (its modes), which a GPT dataset ignores.
        _check(idx_bytes >= expected, key, f"{idx} is truncated: {idx_bytes} bytes, its header "
                                           f"({n} sequences, {d - 1} documents) needs {expected}")
        _check(idx_bytes in (expected, expected + n), key,
               f"{idx} has {idx_bytes} bytes, its header ({n} sequences, {d - 1} documents) says {expected}")
        f.seek(_INDEX_HEADER_BYTES + 4 * (n - 1))
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(_INDEX_HEADER_BYTES + 4 * n + 8 * (n - 1))
        (last_pointer,) = struct.unpack("<q", f.read(8))
        f.seek(_INDEX_HEADER_BYTES + 12 * n + 8 * (d - 1))
        (last_boundary,) = struct.unpack("<q", f.read(8))
    _check(last_boundary == n, key, f"{idx} is inconsistent: its last document ends at sequence {last_boundary}, "
                                    f"not at its sequence count {n}")
    want = last_pointer + last_length * itemsize
    _check(bin_bytes == want, key,
           f"{bin_} has {bin_bytes} bytes but {idx} describes {want} ({n} sequences of {dtype}): "
           + ("the .bin is truncated, or " if bin_bytes < want else "")
           + "the .idx and .bin disagree (dtype or dataset)")
    # megatron-core memory-maps the .bin on every rank, and an empty file cannot be mapped.
    _check(bin_bytes > 0, key, f"{bin_} holds no tokens (every document is empty): prepare the data again from "
                               "a corpus with text in it")
    return IndexedDatasetHeader(prefix, dtype, itemsize, n, d - 1, bin_bytes)


def _bin_offset(header: IndexedDatasetHeader, sequence: int) -> int:
    """Where sequence ``sequence`` of ``header``'s dataset starts in its ``.bin`` (its size for the
    sequence count): one read of the ``.idx``'s pointers (all of which ``bridge-submit --verify-data``
    checks: :func:`verify_index`)."""
    if sequence >= header.sequence_count:
        return header.bin_bytes
    with open(header.prefix + ".idx", "rb") as f:
        f.seek(_INDEX_HEADER_BYTES + 4 * header.sequence_count + 8 * sequence)
        return struct.unpack("<q", f.read(8))[0]


#: ``progress(file, bytes done, bytes in all)``: how the checks of every record (``bridge-submit
#: --verify-data``) report on long files.
Progress = Callable[[str, int, int], None]
#: Entries per read when :func:`verify_index` walks an ``.idx``: 12 MiB of lengths and pointers at a time.
_VERIFY_CHUNK = 1 << 20


def _int_array(code: str, data: bytes) -> array.array:
    """Little-endian integers (megatron-core's ``.idx`` on x86 and ARM) as an ``array`` of ``code``."""
    out = array.array(code)
    out.frombytes(data)
    if sys.byteorder == "big":
        out.byteswap()
    return out


def verify_index(prefix: str, key: str, progress: Optional[Progress] = None) -> int:
    """Check every entry of ``prefix.idx``, not only the last ones that :func:`read_index_header` reads.

    For ``bridge-submit --verify-data``: each sequence's length must be >= 0 and its pointer where the
    sequence before it ends, and the document boundaries must run from 0 up to the sequence count
    without going back. A damaged entry in the middle of an ``.idx`` would otherwise make megatron-core
    read the wrong tokens, or past the end of the ``.bin``, on the ranks, without an error. One pass
    over the ``.idx`` in chunks, with ``array`` (no numpy on the login node); the ``.bin`` is not read.
    Returns the sequence count; raises ConfigError naming the file, the entry and ``key``.
    """
    header = read_index_header(prefix, key)
    n, d = header.sequence_count, header.document_count + 1
    idx, total = prefix + ".idx", _INDEX_HEADER_BYTES + 12 * n + 8 * d
    expected = 0
    try:
        with open(idx, "rb") as f:
            for first in range(0, n, _VERIFY_CHUNK):
                count = min(_VERIFY_CHUNK, n - first)
                f.seek(_INDEX_HEADER_BYTES + 4 * first)
                lengths = _int_array("i", f.read(4 * count))
                f.seek(_INDEX_HEADER_BYTES + 4 * n + 8 * first)
                pointers = _int_array("q", f.read(8 * count))
                for i, (length, pointer) in enumerate(zip(lengths, pointers), first):
                    if length < 0 or pointer != expected:  # (no message built per entry: this loop is the cost)
                        raise ConfigError(f"{idx} is damaged: sequence {i} " + (
                            f"has length {length}" if length < 0 else
                            f"starts at byte {pointer} of the .bin, but the sequences before it end at byte {expected}"),
                            key=key)
                    expected = pointer + length * header.itemsize
                if progress is not None:
                    progress(idx, _INDEX_HEADER_BYTES + 12 * (first + count), total)
            previous = 0
            for first in range(0, d, _VERIFY_CHUNK):
                count = min(_VERIFY_CHUNK, d - first)
                f.seek(_INDEX_HEADER_BYTES + 12 * n + 8 * first)
                for j, boundary in enumerate(_int_array("q", f.read(8 * count)), first):
                    if not (boundary == 0 if j == 0 else previous <= boundary <= n):
                        raise ConfigError(f"{idx} is damaged: document {j} starts at sequence {boundary}, expected "
                                          + ("0" if j == 0 else f"{previous} to {n} (where document {j - 1} starts, "
                                                                "up to the sequence count)"), key=key)
                    previous = boundary
                if progress is not None:
                    progress(idx, _INDEX_HEADER_BYTES + 12 * n + 8 * (first + count), total)
    except OSError as err:
        raise ConfigError(f"{idx} cannot be read: {err.strerror or err}", key=key) from None
    return n


def dataset_config_class(body: Dict[str, Any]) -> type:
    """The dataset config a ``[dataset]`` table selects: fine-tuning data when it names a ``dataset_root``
    (indexed-data keys beside it are then unknown keys), indexed data when it names any prefixes, else
    mock data. Indexed data with any ``fim_*`` key is fill-in-the-middle data (:class:`GPTFIMDatasetConfig`);
    a ``fim_*`` key without prefixes selects it too, so that the missing ``data_path`` is what is reported."""
    if body.get("dataset_root") is not None:
        return FinetuningDatasetConfig
    if any(str(k).startswith("fim_") for k in body):
        return GPTFIMDatasetConfig
    return GPTDatasetConfig if any(body.get(k) is not None for k in GPT_DATASET_PATH_KEYS) else MockGPTDatasetConfig


def absolute_dataset_paths(body: Dict[str, Any], base: str) -> Dict[str, Any]:
    """A copy of a ``[dataset]`` table with every dataset prefix made absolute against ``base``.

    For the launcher: relative prefixes mean the folder bridge-submit runs in, and resolved.toml must hold
    them absolute. Weights stay as they are; a value that does not parse is left for
    :meth:`GPTDatasetConfig.finalize` to report. (``path_to_cache`` is a run-folder path: the launcher
    resolves it against the run folder, like ``checkpoint.save``.)
    """
    out = dict(body)
    for key in GPT_DATASET_PATH_KEYS:
        value = body.get(key)
        if not isinstance(value, (str, list)):
            continue
        items = _blend_items(value)
        weighted = bool(items) and _as_weight(items[0]) is not None
        out[key] = [os.path.join(base, os.path.expanduser(item))
                    if isinstance(item, str) and (not weighted or i % 2 == 1) and _as_weight(item) is None
                    else item for i, item in enumerate(items)]
    return out


@dataclass
class GPTDatasetConfig(DatasetProvider, DeferredPostInit):
    """Megatron indexed datasets (``.bin``/``.idx``) read by megatron-core's ``GPTDataset``, blended and
    split by its ``BlendedMegatronDatasetBuilder``: Megatron Bridge's ``GPTDatasetConfig``.

    Bridge's class inherits megatron-core's ``GPTDatasetConfig``, whose module imports torch; this one
    has the same field names (``seq_length`` is Bridge's alias of ``sequence_length``) so the login
    node can check a job without torch, and :func:`bridge_hpc.training.data.build_gpt_datasets` builds
    megatron-core's config from it on the ranks. As in Bridge, ``finalize()`` is deferred and turns the
    CLI-friendly ``data_path`` into megatron-core's ``blend``:

    - ``data_path``: prefixes (``["a", "b"]``, weighted by size) or a weighted blend
      (``["0.7", "a", "0.3", "b"]``), split into train/valid/test by ``split`` (default
      ``"969,30,1"``, Megatron-LM's);
    - or ``train_data_path`` / ``valid_data_path`` / ``test_data_path``, each its own blend
      (megatron-core's ``blend_per_split``), without ``split``.

    ``path_to_cache`` holds megatron-core's index cache (document, sample and shuffle indices, blend
    indices), built by rank 0 and then read by the other ranks; ``bridge-submit`` puts it in the run
    folder. ``seq_length = None`` takes ``model.seq_length``. ``skip_getting_attention_mask_from_dataset``
    (Bridge's, default true) leaves the causal mask to the attention kernel; ``reset_attention_mask``
    needs the dataset's per-document mask and so always gets it.
    """

    random_seed: int = 1234
    seq_length: Optional[int] = None
    data_path: Optional[Union[str, List[Union[str, float]]]] = None
    train_data_path: Optional[Union[str, List[Union[str, float]]]] = None
    valid_data_path: Optional[Union[str, List[Union[str, float]]]] = None
    test_data_path: Optional[Union[str, List[Union[str, float]]]] = None
    split: Optional[str] = None
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    skip_getting_attention_mask_from_dataset: bool = True
    num_dataset_builder_threads: int = 1
    mid_level_dataset_surplus: float = 0.005
    blend: Optional[Blend] = field(default=None, init=False)
    blend_per_split: Optional[List[Optional[Blend]]] = field(default=None, init=False)

    def finalize(self) -> None:
        super().finalize()
        per_split = {k: getattr(self, k) for k in GPT_DATASET_PATH_KEYS[1:] if getattr(self, k) is not None}
        _check(self.data_path is not None or per_split, "dataset.data_path",
               "must be set (or train_data_path / valid_data_path / test_data_path)")
        _check(self.data_path is None or not per_split, f"dataset.{next(iter(per_split), 'train_data_path')}",
               "use either dataset.data_path (with dataset.split) or per-split paths, not both")
        if self.data_path is not None:
            if self.split is None:
                self.split = DEFAULT_SPLIT
            self.blend = self._checked_blend(self.data_path, "dataset.data_path")
            self._check_split_documents()
        else:
            _check(self.split is None, "dataset.split",
                   "is for dataset.data_path; per-split paths are not split again (remove it)")
            self.blend_per_split = [
                self._checked_blend(value, f"dataset.{key}") if value is not None else None
                for key, value in ((k, getattr(self, k)) for k in GPT_DATASET_PATH_KEYS[1:])
            ]
        if self.path_to_cache is not None:
            self.path_to_cache = os.path.abspath(os.path.expanduser(self.path_to_cache))
        _check(self.seq_length is None or self.seq_length > 0, "dataset.seq_length", "must be > 0")
        _check(self.num_dataset_builder_threads >= 1, "dataset.num_dataset_builder_threads", "must be >= 1")
        _check(self.mid_level_dataset_surplus >= 0, "dataset.mid_level_dataset_surplus", "must be >= 0")

    @staticmethod
    def _checked_blend(value: Union[str, List[Union[str, float]]], key: str) -> Blend:
        prefixes, weights = parse_blend(value, key)
        prefixes = [os.path.abspath(os.path.expanduser(p)) for p in prefixes]
        for prefix in prefixes:
            read_index_header(prefix, key)
        return prefixes, weights

    def _check_split_documents(self) -> None:
        """Every split that ``split`` gives a share must get at least one document of every dataset.

        megatron-core splits each dataset by document with ``round(fraction * documents)``; a split
        left with no document, or with empty documents only (no tokens), makes its GPTDataset loop
        forever looking for tokens, on every rank. So a dataset of few documents with a small valid or
        test share is refused here, naming both; the token count of a split takes two reads of the
        ``.idx`` (where its first and its last document start in the ``.bin``).
        """
        fractions = parse_split(self.split)
        bounds, start = [], 0.0
        for fraction in fractions:
            bounds.append((start, start + fraction) if fraction > 0 else None)
            start += fraction
        for prefix in self.blend[0]:
            header = read_index_header(prefix, "dataset.data_path")
            documents = header.sequence_count
            for name, bound in zip(("train", "valid", "test"), bounds):
                if bound is not None:
                    first, end = round(bound[0] * documents), round(bound[1] * documents)
                    _check(end > first, "dataset.split",
                           f"{self.split!r} gives the {name} split none of the {documents} documents of {prefix} "
                           f"(megatron-core splits by document); give it more documents or set its share to 0")
                    _check(_bin_offset(header, end) > _bin_offset(header, first), "dataset.split",
                           f"{self.split!r} gives the {name} split documents {first} to {end - 1} of {prefix}, "
                           "and every one of them is empty (no tokens); give it other documents or set its "
                           "share to 0")

    @property
    def create_attention_mask(self) -> bool:
        """Whether samples carry megatron's attention mask: only when it says more than "causal"."""
        return self.reset_attention_mask or not self.skip_getting_attention_mask_from_dataset

    def prefixes(self) -> List[Tuple[str, str]]:
        """``(prefix, key)`` of every dataset the config reads, in order, each once."""
        out: List[Tuple[str, str]] = []
        named = [("dataset.data_path", self.blend)] if self.blend else [
            (f"dataset.{k}", b) for k, b in zip(GPT_DATASET_PATH_KEYS[1:], self.blend_per_split or []) if b]
        for key, (paths, _) in named:
            out.extend((p, key) for p in paths if p not in [q for q, _ in out])
        return out

    def build_datasets(self, context: DatasetBuildContext):
        from bridge_hpc.training.data import build_gpt_datasets

        return build_gpt_datasets(self, context)


#: ``fim_extra_tokens`` keys (Bridge's): the three sentinels, padding and end of document.
FIM_TOKEN_KEYS = ("prefix", "middle", "suffix", "pad", "eod")
#: Megatron-LM's FIM sentinel names, used for the keys ``fim_extra_tokens`` leaves out; ``eod`` left
#: out means the tokenizer's own end-of-document token.
DEFAULT_FIM_TOKENS = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>"}


@dataclass(init=False)
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """Fill-in-the-middle on indexed data: Megatron Bridge's ``GPTFIMDatasetConfig`` (Megatron-LM's FIM).

    Any ``fim_*`` key in ``[dataset]`` selects it (see :func:`dataset_config_class`); the rest of the
    table is :class:`GPTDatasetConfig`'s. megatron-core has no FIM dataset, so
    :class:`bridge_hpc.training.fim.GPTFIMDataset` adds it to megatron-core's ``GPTDataset``: every
    end-of-document-separated segment of a sample is, with probability ``fim_rate``, cut at two
    random points into prefix, middle and suffix and rewritten as PSM
    ``<prefix> prefix <suffix> suffix <middle> middle`` or, with probability ``fim_spm_rate``, SPM
    ``<prefix> <suffix> suffix <middle> prefix middle``; the sample is then cut back to its length.
    With ``fim_split_sample`` (a token, e.g. a file separator) a segment that contains it is, with
    probability ``fim_rate``, split there and each fragment gets FIM with ``fim_fragment_rate``;
    fragments whose text starts with ``fim_no_prefix`` are left as they are.

    ``fim_extra_tokens`` names the sentinel tokens (keys ``prefix``, ``middle``, ``suffix``, ``pad``,
    ``eod``); keys left out take Megatron-LM's ``<fim_prefix>``, ``<fim_middle>``, ``<fim_suffix>``,
    ``<fim_pad>`` and the tokenizer's end-of-document token. Each must be one token of the run's
    tokenizer (for the byte-level one: list them in ``[tokenizer] special_tokens``); that is checked
    when the datasets are built, a ConfigError naming ``dataset.fim_extra_tokens.<key>``. Unset
    rates take Megatron-LM's defaults: ``fim_rate`` 0.5, ``fim_spm_rate`` 0.5.

    What differs from Megatron-LM, and why: the cut points fall between tokens, not characters, so
    no text is re-tokenized and a FIM segment holds exactly the segment's tokens plus the three
    sentinels (no tokenizer drift, and never shorter, so the ``pad`` token is accepted for Bridge
    recipes but never needed); and the random draws come from ``(random_seed, split, sample
    index)``, not from one generator shared by every read, so a sample's FIM form does not depend on
    which samples were read before it, which exact resume and loader workers need.
    """

    fim_rate: Optional[float] = None
    fim_spm_rate: Optional[float] = None
    fim_extra_tokens: Optional[Dict[str, str]] = None
    fim_split_sample: Optional[str] = None
    fim_fragment_rate: Optional[float] = None
    fim_no_prefix: Optional[str] = None

    def __init__(self, fim_rate: Optional[float] = None, fim_spm_rate: Optional[float] = None,
                 fim_extra_tokens: Optional[Dict[str, str]] = None, fim_split_sample: Optional[str] = None,
                 fim_fragment_rate: Optional[float] = None, fim_no_prefix: Optional[str] = None, **kwargs: Any):
        self.fim_rate = fim_rate
        self.fim_spm_rate = fim_spm_rate
        self.fim_extra_tokens = fim_extra_tokens
        self.fim_split_sample = fim_split_sample
        self.fim_fragment_rate = fim_fragment_rate
        self.fim_no_prefix = fim_no_prefix
        super().__init__(**kwargs)

    def finalize(self) -> None:
        super().finalize()
        if self.fim_rate is None:
            self.fim_rate = 0.5
        if self.fim_spm_rate is None:
            self.fim_spm_rate = 0.5
        for key in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            value = getattr(self, key)
            _check(value is None or 0 <= value <= 1, f"dataset.{key}", f"must be a probability in [0, 1], got {value!r}")
        tokens = dict(self.fim_extra_tokens or {})
        for name, token in tokens.items():
            _check(name in FIM_TOKEN_KEYS, f"dataset.fim_extra_tokens.{name}",
                   f"unknown key{did_you_mean(name, FIM_TOKEN_KEYS)}; known keys: {', '.join(FIM_TOKEN_KEYS)}")
            _check(isinstance(token, str) and token != "", f"dataset.fim_extra_tokens.{name}",
                   f"expected a token (a non-empty string), got {token!r}")
        self.fim_extra_tokens = {**DEFAULT_FIM_TOKENS, **tokens}
        sentinels = [self.fim_extra_tokens[k] for k in ("prefix", "middle", "suffix")]
        _check(len(set(sentinels)) == 3, "dataset.fim_extra_tokens",
               f"prefix, middle and suffix must be three different tokens, got {sentinels}")
        _check(self.fim_split_sample is None or self.fim_split_sample != "", "dataset.fim_split_sample",
               "expected a token to split samples at, got an empty string")
        if self.fim_split_sample is not None:
            _check(self.fim_fragment_rate is not None, "dataset.fim_fragment_rate",
                   "must be set with dataset.fim_split_sample (the FIM rate of each fragment)")
        else:
            _check(self.fim_fragment_rate is None, "dataset.fim_fragment_rate",
                   "is only used with dataset.fim_split_sample; remove it or set fim_split_sample")
        _check(self.fim_no_prefix is None or self.fim_no_prefix != "", "dataset.fim_no_prefix",
               "expected the text that exempts a fragment from FIM, got an empty string")


#: Records of each fine-tuning file a run reads that are checked when it is submitted (all of them with
#: ``bridge-submit --verify-data``, and by every rank at start-up): the first ones, and the first one
#: after each of as many points spread evenly over the rest of the file.
SAMPLED_HEAD_RECORDS = 64
SAMPLED_SPREAD_RECORDS = 64
#: The most bytes of one file that the sample reads, half for its first records and half for the
#: spread; a line the budget cuts is not checked. So the check at submission costs the same on a file
#: of any size, with any line lengths (milliseconds for records of usual sizes).
SAMPLED_BYTES = 1 << 23


class JsonlProblem(NamedTuple):
    """What is wrong with a line of a fine-tuning jsonl file: the config key to name, and the problem,
    worded to read after where the line is (``line 7 has no 'output' field``)."""

    key: str
    problem: str


def parse_jsonl_record(line: bytes, prompt_key: str, answer_key: str) -> Union[Dict[str, Any], JsonlProblem]:
    """One non-blank line of a fine-tuning jsonl file as its record, or what is wrong with it.

    A good line is a JSON object whose ``prompt_key`` and ``answer_key`` fields are strings of text:
    ``"\\ud800"`` is valid JSON but a lone surrogate, which the tokenizer cannot encode as UTF-8
    (``str.encode`` raises), so the rank reading that sample would die of a bare UnicodeEncodeError.
    The login node (:func:`check_jsonl_records`) and the ranks (``bridge_hpc.training.data``) both use
    it, so the two refuse the same records.
    """
    try:
        record = json.loads(line)
    except UnicodeDecodeError as err:
        return JsonlProblem("dataset.dataset_root", f"is not UTF-8 text ({err.reason} at byte {err.start + 1} of "
                                                    "the line)")
    except RecursionError:
        return JsonlProblem("dataset.dataset_root", "is not a record: its JSON nests too deeply to read")
    except ValueError as err:
        return JsonlProblem("dataset.dataset_root", f"is not JSON ({err})")
    if not isinstance(record, dict):
        return JsonlProblem("dataset.dataset_root", f"is a JSON {type(record).__name__}, expected an object with "
                                                    f"{prompt_key!r} and {answer_key!r} fields")
    for name, key in ((prompt_key, "dataset.prompt_key"), (answer_key, "dataset.answer_key")):
        if name not in record:
            fields = sorted(record)
            shown = repr(fields) if len(fields) <= 8 else repr(fields[:8])[:-1] + f", ... ({len(fields)} fields)]"
            return JsonlProblem(key, f"has no {name!r} field (it has {shown})")
        value = record[name]
        if not isinstance(value, str):
            return JsonlProblem(key, f"has field {name!r} of type {type(value).__name__}, expected a string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return JsonlProblem(key, f"has field {name!r} with a lone surrogate {value[err.start]!r} at character "
                                     f"{err.start + 1}: not text, so the tokenizer cannot encode it as UTF-8")
    return record


def _jsonl_sample(f: Any, size: int) -> Tuple[List[Tuple[int, Optional[int], bytes]], bool]:
    """The lines of an open jsonl file that a sample checks, as ``(offset, line number, line)``, and
    whether they were the whole file. The first :data:`SAMPLED_HEAD_RECORDS` records are read with
    their line numbers; then, past them, the first record after each of :data:`SAMPLED_SPREAD_RECORDS`
    evenly spread points (seeking there costs nothing on a file of any size), whose line number is
    None (counted only for an error: :func:`_line_number`). At most :data:`SAMPLED_BYTES` are read."""
    lines: List[Tuple[int, Optional[int], bytes]] = []
    budget, number, records = SAMPLED_BYTES // 2, 0, 0
    while records < SAMPLED_HEAD_RECORDS and budget > 0:
        offset = f.tell()
        line = f.readline(budget)
        if not line:
            return lines, True
        if not line.endswith(b"\n") and f.tell() < size:
            break  # cut by the budget
        budget, number = budget - len(line), number + 1
        if line.strip():
            lines.append((offset, number, line))
            records += 1
    position = f.tell()
    if position >= size:
        return lines, True
    budget += SAMPLED_BYTES // 2
    frontier = position
    for k in range(1, SAMPLED_SPREAD_RECORDS + 1):
        point = frontier + (size - frontier) * k // (SAMPLED_SPREAD_RECORDS + 1)
        if point < position or point < 1:
            continue  # inside a line read already
        f.seek(point - 1)
        rest = f.readline(budget)  # from the byte before the point to the end of its line
        budget -= len(rest)
        if not rest.endswith(b"\n") or budget <= 0:
            break  # the end of the file, or of the budget
        while budget > 0:
            offset = f.tell()
            line = f.readline(budget)
            if not line or (not line.endswith(b"\n") and f.tell() < size):
                budget = 0  # the end of the file, or a line cut by the budget
                break
            budget -= len(line)
            if line.strip():
                lines.append((offset, None, line))
                break
        position = f.tell()
        if budget <= 0:
            break
    return lines, False


def _line_number(f: Any, offset: int) -> int:
    """The number of the line that starts at byte ``offset`` of the open file ``f`` (one pass up to it)."""
    f.seek(0)
    newlines, left = 0, offset
    while left > 0:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            break
        newlines += chunk.count(b"\n")
        left -= len(chunk)
    return newlines + 1


def check_jsonl_records(path: str, prompt_key: str, answer_key: str, full: bool = False,
                        progress: Optional[Progress] = None) -> int:
    """Check the records of a fine-tuning jsonl file at submission: a sample (:func:`_jsonl_sample`), or
    every line with ``full`` (``bridge-submit --verify-data``; ``progress`` then hears how far it is).

    Raises ConfigError whose message starts with ``FILE:LINE`` and whose key is the config key of the
    problem (:func:`parse_jsonl_record`), or names the file when it holds no record at all or cannot be
    read; so a bad record is found on the login node, not on the ranks after the queue. Returns the
    number of records checked.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if full:
                lines: Any = _every_line(f, path, size, progress)
                whole = True
            else:
                lines, whole = _jsonl_sample(f, size)
            checked = 0
            for offset, number, line in lines:
                record = parse_jsonl_record(line, prompt_key, answer_key)
                if isinstance(record, JsonlProblem):
                    number = number if number is not None else _line_number(f, offset)
                    raise ConfigError(f"{path}:{number} {record.problem}", key=record.key)
                checked += 1
    except OSError as err:
        raise ConfigError(f"{path} cannot be read: {err.strerror or err}", key="dataset.dataset_root") from None
    _check(checked > 0 or not whole, "dataset.dataset_root",
           f"{path} holds no records: expected one JSON object per line with {prompt_key!r} and {answer_key!r} "
           "fields")
    return checked


def _every_line(f: Any, path: str, size: int, progress: Optional[Progress]) -> Iterator[Tuple[int, int, bytes]]:
    """``(offset, line number, line)`` of every non-blank line of the open file ``f``, telling ``progress``
    how far it is every 16 MiB and at the end."""
    done = reported = 0
    for number, line in enumerate(f, 1):
        if line.strip():
            yield done, number, line
        done += len(line)
        if progress is not None and done - reported >= 1 << 24:
            progress(path, done, size)
            reported = done
    if progress is not None:
        progress(path, done, size)


#: The jsonl files of a fine-tuning ``dataset_root`` (Megatron Bridge's names), per split.
FINETUNING_FILES = {"train": "training.jsonl", "valid": "validation.jsonl", "test": "test.jsonl"}


@dataclass
class FinetuningDatasetConfig(DatasetProvider):
    """Prompt/answer pairs in jsonl files, tokenized on the fly: Megatron Bridge's ``FinetuningDatasetConfig``.

    ``dataset_root`` holds ``training.jsonl`` and optionally ``validation.jsonl`` and ``test.jsonl``
    (Bridge's names; a missing validation or test file means no such split, as in Bridge, and
    ``do_validation`` / ``do_test = false`` skip one that exists). Each line is a JSON object whose
    ``prompt_key`` and ``answer_key`` fields are strings; the defaults are the fields of Bridge's
    default SFT template (``"{input} {output}"``). A sample is the prompt's tokens followed directly by
    the answer's and the tokenizer's end-of-document token (put any separator into the data), cut to
    ``seq_length`` + 1 tokens by dropping prompt tokens from its start first (the end of a prompt,
    next to the answer, is what the answer depends on), then answer tokens from its end. Only the
    answer and its end-of-document token count in the loss: prompt and padding positions have
    ``loss_mask = 0``.

    ``dataloader_type = "batch"`` (Bridge's default here) pads all micro-batches of one step on a rank
    to one length, the longest sample of that rank's share of the global batch rounded up to a
    multiple of 8 (at most ``seq_length``); ``"single"`` pads each micro-batch on its own.

    The training split is read in a fresh order every pass over the file, shuffled by ``seed``;
    validation and test in file order. ``max_train_samples`` (Bridge's) sets how many training
    samples the run draws before it starts again from the first one; unset, the run's own
    ``train_iters`` x ``global_batch_size``. ``seq_length = None`` takes ``model.seq_length``. Bridge's
    ``memmap_workers``, ``packed_sequence_specs`` and free-form ``dataset_kwargs`` are accepted at
    their defaults only (anything else is a ConfigError): the files are indexed in one pass, sequences
    are not packed, and the options are the typed fields here.
    """

    dataloader_type: Optional[Literal["single", "cyclic", "batch", "external"]] = "batch"
    dataset_root: Optional[str] = None
    seq_length: Optional[int] = None
    seed: int = 1234
    memmap_workers: int = 1
    max_train_samples: Optional[int] = None
    packed_sequence_specs: Optional[Any] = None
    dataset_kwargs: Optional[Dict[str, Any]] = None
    do_validation: bool = True
    do_test: bool = True
    prompt_key: str = "input"
    answer_key: str = "output"

    def finalize(self) -> None:
        super().finalize()
        _check(self.memmap_workers == 1, "dataset.memmap_workers",
               "must be 1: the jsonl files are indexed in one pass, with no memory-map workers")
        _check(self.packed_sequence_specs is None, "dataset.packed_sequence_specs",
               "must be unset: fine-tuning samples are padded, not packed")
        _check(self.dataset_kwargs is None, "dataset.dataset_kwargs",
               "must be unset: the fine-tuning options are this section's own fields (prompt_key, answer_key, ...)")
        _check(self.dataset_root is not None, "dataset.dataset_root",
               f"must be set: the folder with {FINETUNING_FILES['train']} (and optionally "
               f"{FINETUNING_FILES['valid']}, {FINETUNING_FILES['test']})")
        root = os.path.abspath(os.path.expanduser(self.dataset_root))
        _check(os.path.isdir(root), "dataset.dataset_root", f"{self.dataset_root!r} is not an existing folder")
        self.dataset_root = root
        _check(self.dataloader_type in ("single", "batch"), "dataset.dataloader_type",
               f"must be \"batch\" (pad per global batch) or \"single\" for fine-tuning data, got "
               f"{self.dataloader_type!r}")
        _check(self.seq_length is None or self.seq_length > 0, "dataset.seq_length", "must be > 0")
        _check(self.seed >= 0, "dataset.seed", "must be >= 0")
        _check(self.max_train_samples is None or self.max_train_samples > 0, "dataset.max_train_samples",
               "must be > 0")
        for key in ("prompt_key", "answer_key"):
            _check(getattr(self, key) != "", f"dataset.{key}", "must name a jsonl field")
        _check(self.prompt_key != self.answer_key, "dataset.answer_key",
               f"must differ from dataset.prompt_key ({self.prompt_key!r})")

    def split_path(self, split: str) -> Optional[str]:
        """The jsonl file of ``split`` ("train", "valid", "test") when the run reads it, else None."""
        if (split == "valid" and not self.do_validation) or (split == "test" and not self.do_test):
            return None
        path = os.path.join(self.dataset_root, FINETUNING_FILES[split])
        return path if os.path.isfile(path) else None

    def build_datasets(self, context: DatasetBuildContext):
        from bridge_hpc.training.data import build_finetuning_datasets

        return build_finetuning_datasets(self, context)


# ---------------------------------------------------------------------------------------------
# The container
# ---------------------------------------------------------------------------------------------

#: TOML section name -> (ConfigContainer field, dataclass built from it).
SECTIONS: Dict[str, type] = {
    "rng": RNGConfig,
    "train": TrainingConfig,
    "model": GPTModelConfig,
    "optimizer": OptimizerConfig,
    "ddp": DistributedDataParallelConfig,
    "scheduler": SchedulerConfig,
    "dataset": MockGPTDatasetConfig,
    "logger": LoggerConfig,
    "checkpoint": CheckpointConfig,
    "dist": DistributedInitConfig,
    "ft": FaultToleranceConfig,
    "straggler": StragglerDetectionConfig,
    "nvrx_straggler": NVRxStragglerDetectionConfig,
    "profiling": ProfilingConfig,
    "validation": ValidationConfig,
    "inprocess_restart": InProcessRestartConfig,
    "rerun_state_machine": RerunStateMachineConfig,
    "tokenizer": TokenizerConfig,
    "tensor_inspect": TensorInspectConfig,
    "comm_overlap": CommOverlapConfig,
    "mixed_precision": MixedPrecisionConfig,
}

#: Top-level sections of a job file that belong to the launcher, not to training.
# The launcher's sections ([job], [slurm], ...) are bridge_hpc.launch.jobconfig's; the trainer skips them.


@dataclass
class ConfigContainer:
    """Every section of a training run, as Bridge's ``ConfigContainer`` names them."""

    train: TrainingConfig
    model: GPTModelConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    dataset: DatasetProvider
    logger: LoggerConfig
    checkpoint: CheckpointConfig
    rng: RNGConfig = field(default_factory=RNGConfig)
    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    ft: Optional[FaultToleranceConfig] = None
    straggler: Optional[StragglerDetectionConfig] = None
    nvrx_straggler: Optional[NVRxStragglerDetectionConfig] = None
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    #: Bridge's parameter-efficient fine-tuning (a Python object, no TOML section). Not available:
    #: anything but None is refused by :meth:`finalize_sections`.
    peft: Optional[Any] = None
    inprocess_restart: Optional[InProcessRestartConfig] = None
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    tokenizer: Optional[TokenizerConfig] = None
    tensor_inspect: Optional[TensorInspectConfig] = None
    #: Bridge's: applied to ``ddp`` by :func:`runtime_config_update` (data-parallel overlaps only).
    comm_overlap: Optional[CommOverlapConfig] = None
    #: Bridge's: a MixedPrecisionConfig or a recipe name (``"bf16_mixed"``, ``"fp16_mixed"``), written into
    #: ``model``, ``optimizer`` and ``ddp`` by :func:`runtime_config_update` (in TOML, a
    #: ``[mixed_precision]`` table or ``mixed_precision = "bf16_mixed"``).
    mixed_precision: Optional[Union[MixedPrecisionConfig, str]] = None
    #: Python-level hook (not a TOML section): TOML users write [[optimizer.overrides]] instead.
    optimizer_config_override_provider: OptimizerConfigOverrideProvider = field(
        default_factory=OptimizerConfigOverrideProvider)
    data_parallel_size: int = field(default=1, init=False)
    #: Which of validation's fields a config spelled the deprecated way (``train.<name>``), so that an
    #: error about one names the key the user wrote.
    validation_keys_in_train: Tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    #: Whether every section's deferred finalize() has run (:meth:`finalize_sections`).
    sections_finalized: bool = field(default=False, init=False, repr=False, compare=False)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_sections(cls, sections: Dict[str, Any], source: str = "<config>") -> "ConfigContainer":
        """Build from a job file's parsed TOML sections; the launcher's sections are skipped.

        Each section is type-checked and finalized here, once, so a typo fails on the login node;
        cross-section checks that need the world size wait for :meth:`validate`.
        """
        def error(key: str, message: str) -> ConfigError:
            return ConfigError(message, path=source, key=key)

        kwargs: Dict[str, Any] = {}
        for name, body in sections.items():
            if name in LAUNCHER_SECTIONS or name == "extends":
                continue
            if name not in SECTIONS:
                raise ConfigError(f"unknown section [{name}]{did_you_mean(name, list(SECTIONS) + list(LAUNCHER_SECTIONS))}",
                                  path=source, key=name)
            if name == "mixed_precision" and isinstance(body, str):  # a recipe name, as Bridge accepts
                try:
                    kwargs[name] = get_mixed_precision_config(body)
                except ConfigError as err:
                    raise ConfigError(err.message, path=source, key=err.key) from None
                continue
            if not isinstance(body, dict):
                raise ConfigError(f"expected a table [{name}], got {type(body).__name__}", path=source, key=name)
            section_cls = dataset_config_class(body) if name == "dataset" else SECTIONS[name]
            kwargs[name] = build_dataclass(section_cls, name, body, error)
        for name in ("train", "model", "optimizer", "scheduler", "dataset", "logger", "checkpoint"):
            kwargs.setdefault(name, build_dataclass(SECTIONS[name], name, {}, error))
        tokenizer = kwargs.get("tokenizer")
        if tokenizer is not None and tokenizer.use_tokenizer_vocab_size is None:
            # The model's vocabulary follows the tokenizer unless [model] says otherwise.
            tokenizer.use_tokenizer_vocab_size = "vocab_size" not in sections.get("model", {})
        cfg = cls(**kwargs)
        try:
            cfg.finalize_sections()
            cfg.check_data_needs()
            cfg.check_data_records()
        except ConfigError as err:
            raise ConfigError(err.message, path=source, key=err.key) from None
        return cfg

    def sections(self):
        """``(name, section)`` for every section that is set."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                yield f.name, value

    def finalize_sections(self) -> None:
        """Run every section's deferred ``finalize()``, once: :meth:`from_sections` does it for a job
        file, :func:`runtime_config_update` for a container built in Python; later calls do nothing."""
        if self.sections_finalized:
            return
        for _, section in self.sections():
            section.finalize()
        self._move_deprecated_validation_fields()
        _check(self.peft is None, "peft", "PEFT (LoRA and the like) is not available here: finetune() trains every "
               "weight of the pretrained model")
        self.sections_finalized = True

    def _move_deprecated_validation_fields(self) -> None:
        """``train.eval_iters`` / ``eval_interval`` / ``skip_train`` are Bridge's deprecated spellings of
        ``validation``'s: one set there moves here (both set to different values is an error), and the
        train section then shows the value in force, so either spelling reads the same."""
        default = ValidationConfig()
        for name in ("eval_iters", "eval_interval", "skip_train"):
            old, new = getattr(self.train, name), getattr(self.validation, name)
            if old is not None:
                _check(new == getattr(default, name) or new == old, f"validation.{name}",
                       f"{new!r} contradicts train.{name} = {old!r} (its deprecated spelling): set one of them")
                setattr(self.validation, name, old)
                self.validation_keys_in_train += (name,)
            setattr(self.train, name, getattr(self.validation, name))

    # -- cross-section checks -----------------------------------------------------------------
    def check_data_needs(self) -> None:
        """Indexed data needs a tokenizer (megatron-core's GPTDataset takes its end-of-document and pad
        ids from it, and it sizes the vocabulary), and so does fine-tuning data, which is tokenized on
        the fly; fine-tuning also needs its training file when it trains. Checked at submission, not
        minutes later on the ranks."""
        if isinstance(self.dataset, GPTDatasetConfig):
            _check(self.tokenizer is not None, "tokenizer.tokenizer_type",
                   "dataset.data_path needs a [tokenizer] section: the one the data was prepared with "
                   "(e.g. tokenizer_type = \"ByteLevelTokenizer\")")
        if isinstance(self.dataset, FinetuningDatasetConfig):
            _check(self.tokenizer is not None, "tokenizer.tokenizer_type",
                   "dataset.dataset_root needs a [tokenizer] section: fine-tuning data is tokenized on the fly "
                   "(e.g. tokenizer_type = \"ByteLevelTokenizer\")")
            if self.train.train_iters > 0 and not self.validation.skip_train:
                _check(self.dataset.split_path("train") is not None, "dataset.dataset_root",
                       f"{self.dataset.dataset_root} has no {FINETUNING_FILES['train']}, and train.train_iters is "
                       f"{self.train.train_iters}")

    def split_samples(self) -> Tuple[int, int, int]:
        """How many samples the run reads from its train, validation and test data: all training
        steps' global batches; ``eval_iters`` global batches at every ``eval_interval`` steps and once
        after training; ``eval_iters`` global batches of test data. What the datasets are sized for
        (:func:`bridge_hpc.training.data.build_datasets`); a fine-tuning split asked for 0 is not read."""
        t, v = self.train, self.validation
        evals = (t.train_iters // v.eval_interval + 1) if v.eval_interval else 0
        return (t.train_iters * t.global_batch_size, evals * (v.eval_iters or 0) * t.global_batch_size,
                (v.eval_iters or 0) * t.global_batch_size)

    def check_data_records(self, full: bool = False, progress: Optional[Progress] = None) -> List[Tuple[str, int]]:
        """Check the data's records on the login node, before the queue: ``[(file, records or sequences
        checked)]``.

        Fine-tuning data: a sample of the records of every jsonl file the run reads (a split asked for
        samples, :meth:`split_samples`), or with ``full`` all of them (:func:`check_jsonl_records`); the
        ranks check every record again when they index the files, in case the files change after
        submission. Indexed data: nothing more than :meth:`GPTDatasetConfig.finalize` reads (the
        ``.idx`` headers), or with ``full`` every entry of every ``.idx`` (:func:`verify_index`).
        ``full`` is ``bridge-submit --verify-data``; ``progress`` hears how far it is on long files.
        Raises ConfigError naming the file (and line) and the key.
        """
        d = self.dataset
        checked: List[Tuple[str, int]] = []
        if isinstance(d, FinetuningDatasetConfig):
            for split, wanted in zip(FINETUNING_FILES, self.split_samples()):
                path = d.split_path(split)
                if path is not None and wanted > 0:
                    checked.append((path, check_jsonl_records(path, d.prompt_key, d.answer_key, full, progress)))
        elif isinstance(d, GPTDatasetConfig) and full:
            checked = [(prefix + ".idx", verify_index(prefix, key, progress)) for prefix, key in d.prefixes()]
        return checked

    def get_data_parallel_size(self, world_size: int) -> int:
        """``world_size`` over the model-parallel size (tensor x pipeline x context parallel)."""
        model_parallel = self.model.model_parallel_size
        _check(world_size % model_parallel == 0, "model.tensor_model_parallel_size",
               f"world size {world_size} is not divisible by the model-parallel size {model_parallel}")
        return world_size // model_parallel

    def set_data_parallel_size(self) -> None:
        """Set ``data_parallel_size`` from the world (torch.distributed's, else ``$WORLD_SIZE``, else 1)
        without the other checks of :meth:`validate`, and copy it to ``comm_overlap`` (whose overlaps
        default to on above 1)."""
        self.data_parallel_size = self.get_data_parallel_size(_world_size())
        if self.comm_overlap is not None:
            self.comm_overlap.data_parallel_size = self.data_parallel_size

    def validate(self, world_size: Optional[int] = None) -> None:
        """Check that the (finalized) sections agree with each other and with the world; fills the
        fields that depend on it (data-parallel size, decay and warm-up iterations).

        ``world_size`` defaults to torch.distributed's when it is up, else ``$WORLD_SIZE``, else 1.
        """
        m, t = self.model, self.train
        self.data_parallel_size = self.get_data_parallel_size(world_size or _world_size())
        _check(t.global_batch_size % (t.micro_batch_size * self.data_parallel_size) == 0, "train.global_batch_size",
               f"{t.global_batch_size} is not divisible by micro_batch_size ({t.micro_batch_size}) "
               f"x data-parallel size ({self.data_parallel_size})")
        if (m.virtual_pipeline_model_parallel_size or 1) > 1:
            microbatches = t.global_batch_size // (t.micro_batch_size * self.data_parallel_size)
            _check(microbatches % m.pipeline_model_parallel_size == 0, "train.global_batch_size",
                   f"gives {microbatches} micro-batches per step, which the interleaved pipeline schedule needs "
                   f"to be a multiple of model.pipeline_model_parallel_size ({m.pipeline_model_parallel_size})")
        if isinstance(self.dataset, GPTDatasetConfig):
            self._validate_gpt_dataset()
        if isinstance(self.dataset, FinetuningDatasetConfig):
            self.check_data_needs()
            if self.dataset.seq_length is None:
                self.dataset.seq_length = m.seq_length
        seq_length = getattr(self.dataset, "seq_length", None)
        _check(seq_length is None or seq_length == m.seq_length, "dataset.seq_length",
               f"{seq_length} differs from model.seq_length ({m.seq_length})")
        if isinstance(self.dataset, MockGPTDatasetConfig):
            if self.dataset.vocab_size is None:
                self.dataset.vocab_size = m.vocab_size
            _check(self.dataset.vocab_size <= m.vocab_size, "dataset.vocab_size",
                   f"must be <= model.vocab_size ({m.vocab_size})")
        _validate_mixed_precision_consistency(self)
        _validate_and_sync_distributed_optimizer_settings(self)
        _check(not m.full_iteration_cuda_graph or not self.ddp.overlap_param_gather, "model.cuda_graph_impl",
               "\"full_iteration\" cannot run with ddp.overlap_param_gather = true (its forward pre-hooks wait for "
               "all-gathers started outside the graph)")
        s = self.scheduler
        if s.lr_decay_iters is None:
            s.lr_decay_iters = t.train_iters
        if s.lr_warmup_fraction is not None:
            s.lr_warmup_iters = int(s.lr_warmup_fraction * s.lr_decay_iters)
        # megatron-core's scheduler asserts warm-up steps < decay steps, whatever the decay style.
        _check(s.lr_warmup_iters < max(s.lr_decay_iters, 1), "scheduler.lr_warmup_iters",
               f"must be < lr_decay_iters ({s.lr_decay_iters}; by default train.train_iters)")
        if s.start_weight_decay is None:
            s.start_weight_decay = self.optimizer.weight_decay
        if s.end_weight_decay is None:
            s.end_weight_decay = self.optimizer.weight_decay
        c = self.checkpoint
        _check(c.save_interval is None or c.save is not None, "checkpoint.save_interval",
               "is set but checkpoint.save (the folder) is not")
        v = self.validation

        def key(name: str) -> str:
            return f"{'train' if name in self.validation_keys_in_train else 'validation'}.{name}"

        _check(v.eval_interval in (None, 0) or (v.eval_iters or 0) > 0, key("eval_iters"),
               f"must be > 0 when {key('eval_interval')} is set")

    def _validate_gpt_dataset(self) -> None:
        """Fill the indexed-data fields that come from other sections and check them against those."""
        d = self.dataset
        self.check_data_needs()
        if d.seq_length is None:
            d.seq_length = self.model.seq_length
        if d.path_to_cache is None and self.checkpoint.save:
            # bridge-submit sets path_to_cache (RUN/dataset_cache). A config built in Python gets the
            # same place when its checkpoints are in the run folder's default spot; the cache's file
            # names are hashes of what they index, so a folder shared by runs is safe.
            d.path_to_cache = os.path.join(os.path.dirname(os.path.abspath(self.checkpoint.save)),
                                           run_folder.DATASET_CACHE_DIR)
        if self.train.train_iters > 0 and not self.validation.skip_train:
            if d.blend is not None:
                _check(parse_split(d.split)[0] > 0, "dataset.split",
                       f"{d.split!r} gives the train split no data, and train.train_iters is {self.train.train_iters}")
            else:
                _check(bool(d.blend_per_split and d.blend_per_split[0]), "dataset.train_data_path",
                       f"must be set: train.train_iters is {self.train.train_iters}")
        # Transformer Engine's causal attention ignores an explicit mask, so per-document masks would
        # silently not apply.
        _check(not d.reset_attention_mask or self.model.transformer_impl == "local", "dataset.reset_attention_mask",
               "needs model.transformer_impl = \"local\" (Transformer Engine's causal attention ignores the mask)")

    def log_non_default_values(self) -> None:
        """Log each section's fields that differ from their defaults, one line per section (Bridge's
        method; INFO on the ``bridge_hpc.training.config`` logger): what makes this run differ from
        the baseline, easy to spot in a log. Bridge compares its megatron-core-derived sections with
        megatron-core's defaults; here every section is this toolkit's dataclass, so the baseline is
        its own defaults. A field without a default shows its value."""
        def shown(value: Any) -> str:  # a blend of a thousand shards must not make a line of megabytes
            text = repr(value)
            return text if len(text) <= LOGGED_VALUE_CHARS else text[:LOGGED_VALUE_CHARS] + f"... ({len(text)} chars)"

        for name, section in self.sections():
            changed = _non_default_values(section)
            if changed:
                logger.info("config [%s] differs from the defaults: %s", name, ", ".join(
                    f"{key} = {shown(value)}" if default is _REQUIRED else f"{key} = {shown(value)} (default {shown(default)})"
                    for key, (value, default) in changed.items()))

    def to_dict(self) -> Dict[str, Any]:
        """The resolved configuration as plain data (saved in every checkpoint)."""
        out = {name: dataclasses.asdict(section) for name, section in self.sections()}
        out["dataset"]["_class"] = f"{type(self.dataset).__module__}.{type(self.dataset).__qualname__}"
        return out


# ---------------------------------------------------------------------------------------------
# Runtime update: Megatron Bridge's last step before the ranks build anything
# ---------------------------------------------------------------------------------------------


def runtime_config_update(cfg: ConfigContainer) -> None:
    """Finalize and cross-check ``cfg`` on the ranks, before the model is built: Bridge's function.

    ``pretrain`` calls it once torch.distributed is up (and after the tokenizer has set
    ``model.vocab_size``). In order:

    1. the sections' deferred ``finalize()``, if they have not run (a container built in Python;
       :meth:`ConfigContainer.from_sections` has already run them for a job file);
    2. the data-parallel size from the world size (:meth:`ConfigContainer.set_data_parallel_size`);
    3. :meth:`ConfigContainer.validate`: batch sizes against the data-parallel size, dataset against
       model, mixed precision (model and optimizer must agree), the distributed-optimizer setting
       made the same in ``ddp`` and ``optimizer`` when either turns it on, scheduler iterations.

    Between 1 and 2, as in Bridge: ``mixed_precision`` (a recipe name resolved first) is written into
    ``model``, ``optimizer`` and ``ddp`` (:meth:`MixedPrecisionConfig.setup`); after 2,
    ``comm_overlap`` sets the data-parallel overlaps and bucket size in ``ddp``
    (:meth:`CommOverlapConfig.setup`). Raises ConfigError naming the key.
    """
    cfg.finalize_sections()
    if cfg.mixed_precision is not None:
        cfg.mixed_precision = get_mixed_precision_config(cfg.mixed_precision)
        cfg.mixed_precision.setup(cfg.model, cfg.optimizer, cfg.ddp)
    cfg.set_data_parallel_size()
    if cfg.comm_overlap is not None:
        # Its overlaps apply with the distributed optimizer, which either section may turn on.
        _validate_and_sync_distributed_optimizer_settings(cfg)
        cfg.comm_overlap.setup(cfg.model, cfg.optimizer, cfg.ddp)
    cfg.validate()


def mimo_runtime_config_update(cfg: ConfigContainer) -> None:
    """Bridge's :func:`runtime_config_update` for MIMO (multi-module) models: always a ConfigError here.

    In Bridge it exists because a ``MimoModelProvider`` lacks the model fields the standard update
    reads; it keeps the model-agnostic steps (section finalize, distributed-optimizer sync,
    deterministic-mode checks), hard-codes a data-parallel size of 1 and skips mixed precision,
    communication overlap and model checks. bridge_hpc builds one kind of model, a megatron-core GPT
    (:class:`GPTModelConfig`), and has no MIMO model, so no config here is one it applies to: for a
    GPT the kept steps are all in :func:`runtime_config_update`, and the skipped ones, and a
    data-parallel size taken from the world, are needed. Raises a ConfigError naming ``model`` and
    changes nothing, so that calling the wrong one is not silently half-done.
    """
    if isinstance(cfg.model, GPTModelConfig):
        raise ConfigError("is a GPT model (GPTModelConfig), not a MIMO model: use runtime_config_update(cfg). "
                          "mimo_runtime_config_update is Megatron Bridge's variant for MimoModelProvider models, "
                          "which bridge_hpc does not have", key="model")
    raise ConfigError(f"is a {type(cfg.model).__name__}: bridge_hpc has no MIMO models (Megatron Bridge's "
                      "MimoModelProvider) and builds only GPT models (GPTModelConfig), which runtime_config_update "
                      "finalizes", key="model")


def _validate_and_sync_distributed_optimizer_settings(config: ConfigContainer) -> None:
    """Turn the distributed optimizer on in both ``ddp`` and ``optimizer`` when either has it (Bridge's rule).

    megatron-core needs both: DDP lays out its gradient buffers for the optimizer to shard, and the
    optimizer shards its state over them; one without the other fails or trains wrong. A mismatch
    is a warning (rank 0), not an error, as in Bridge.
    """
    ddp_setting = config.ddp.use_distributed_optimizer
    optimizer_setting = config.optimizer.use_distributed_optimizer
    if ddp_setting or optimizer_setting:
        if ddp_setting != optimizer_setting and _rank() == 0:
            import logging

            logging.getLogger(__name__).warning(
                "distributed optimizer settings were not in sync: ddp.use_distributed_optimizer=%s, "
                "optimizer.use_distributed_optimizer=%s; enabling the distributed optimizer in both",
                ddp_setting, optimizer_setting)
        config.ddp.use_distributed_optimizer = True
        config.optimizer.use_distributed_optimizer = True


def _validate_mixed_precision_consistency(config: ConfigContainer) -> None:
    """Model and optimizer must name the same precision (bf16, fp16 or neither).

    Stricter than Bridge, which only requires it with a precision-aware optimizer: here
    ``model.bf16`` / ``fp16`` wraps the model in megatron-core's Float16Module and ``optimizer.bf16`` /
    ``fp16`` picks its mixed-precision optimizer, and each needs the other.
    """
    m, o = config.model, config.optimizer
    _check(not (m.bf16 and m.fp16), "model.fp16", "bf16 and fp16 are exclusive")
    _check(not (o.bf16 and o.fp16), "optimizer.fp16", "bf16 and fp16 are exclusive")
    _check(o.bf16 == m.bf16 and o.fp16 == m.fp16, "optimizer.bf16",
           f"model and optimizer precision must agree (model: bf16={m.bf16}, fp16={m.fp16}; optimizer: "
           f"bf16={o.bf16}, fp16={o.fp16})")


# ---------------------------------------------------------------------------------------------
# Helpers: checking keys and types
# ---------------------------------------------------------------------------------------------


#: The longest value :meth:`ConfigContainer.log_non_default_values` writes whole.
LOGGED_VALUE_CHARS = 200
#: Stands for "no default" in :func:`_non_default_values`.
_REQUIRED = object()


def _non_default_values(section: Any) -> Dict[str, Tuple[Any, Any]]:
    """``{field: (value, default)}`` for the init fields of a dataclass ``section`` whose value is not
    the default (``default`` is :data:`_REQUIRED` for a field without one)."""
    out: Dict[str, Tuple[Any, Any]] = {}
    for f in dataclasses.fields(section):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = _REQUIRED
        value = getattr(section, f.name)
        if default is _REQUIRED or value != default:
            out[f.name] = (value, default)
    return out


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(message, key=key)


def _world_size() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except ImportError:
        pass
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    """This process's rank, as :func:`_world_size` finds the world (torch.distributed, else ``$RANK``)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))
