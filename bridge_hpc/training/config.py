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

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from bridge_hpc.contracts import run_folder, signals
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import LAUNCHER_SECTIONS, DeferredPostInit, build_dataclass, did_you_mean
from bridge_hpc.contracts.schema import check as _check
from bridge_hpc.training.comm_overlap import CommOverlapConfig
from bridge_hpc.training.mixed_precision import (
    MixedPrecisionConfig,
    get_mixed_precision_config,
    recipe_fields,  # noqa: F401 - for the login side (jobconfig)
)

logger = logging.getLogger(__name__)

# The sections that live beside the components that read them, at Megatron Bridge's path too.
from bridge_hpc.training.datasets.config import (  # noqa: E402,F401 - Bridge's names, re-exported
    DEFAULT_SPLIT,
    FIM_TOKEN_KEYS,
    FINETUNING_FILES,
    GPT_DATASET_PATH_KEYS,
    Blend,
    DataloaderConfig,
    DatasetBuildContext,
    DatasetProvider,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    GPTFIMDatasetConfig,
    IndexedDatasetHeader,
    JsonlProblem,
    MockGPTDatasetConfig,
    Progress,
    absolute_dataset_paths,
    check_jsonl_records,
    dataset_config_class,
    parse_blend,
    parse_jsonl_record,
    parse_split,
    read_index_header,
    verify_index,
)
from bridge_hpc.training.engine.config import (  # noqa: E402,F401 - Bridge's names, re-exported
    FUSED_NORM_MAX_WIDTH,
    TENSOR_INSPECT_PACKAGE,
    GPTModelConfig,
    OptimizerConfig,
    OptimizerConfigOverrideProvider,
    OptimizerConfigOverrideProviderContext,
    ParamGroupOverrideConfig,
    SchedulerConfig,
    TensorInspectConfig,
)
from bridge_hpc.training.resilience.config import (  # noqa: E402,F401 - Bridge's names, re-exported
    FaultToleranceConfig,
    InProcessRestartConfig,
    NVRxStragglerDetectionConfig,
    RerunStateMachineConfig,
    StragglerDetectionConfig,
)

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
    rank; see ``bridge_hpc.training.checkpoint.async_writer``); exit saves stay synchronous. A failed
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
    """Console, metrics-file, TensorBoard, W&B, MLflow and Comet logging: every field of Megatron
    Bridge's LoggerConfig (megatron's plus Bridge's MLflow/Comet ones) and bridge_hpc's ``metrics_file``.

    ``metrics_file`` is ours (not Bridge's): the JSON-lines file that records every step's loss at
    full precision; ``bridge_hpc.training.run`` points it at ``<run_dir>/metrics.jsonl``. ``log_progress``
    appends Megatron's ``progress.txt`` (plus bridge_hpc's goodput events) in ``checkpoint.save``.

    TensorBoard is on by default for jobs: a job file that leaves ``tensorboard_dir`` unset gets
    ``<run_dir>/tensorboard`` (:data:`bridge_hpc.contracts.run_folder.TENSORBOARD_DIR`), so that
    ``tensorboard --logdir runs/`` shows every run. ``tensorboard_dir = ""`` turns it off; so does None,
    Bridge's default, for a config built in Python. ``finalize`` makes "" None: one spelling of "off".

    W&B is on when ``wandb_project`` is set, MLflow when ``mlflow_experiment`` is, Comet when
    ``comet_project`` is (see :mod:`bridge_hpc.training.utils.log_backends`): each gets every series
    TensorBoard gets, and a requeued or restarted job continues the same run.

    A field this trainer cannot act on (MoE routing traces: it builds dense GPTs; energy counters; a
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
        _check(self.timing_log_level <= 0, "logger.timing_log_level",
               "must be -1 or 0: bridge_hpc times whole steps (iteration time, throughput), it has no per-operation "
               "timers for levels 1 and 2")
        for name, why in (
            ("log_max_attention_logit", "megatron-core records it only for its MoE/MLA QK-clip attention, which "
                                        "bridge_hpc's GPTs do not use"),
            ("log_energy", "there is no energy counter reader in bridge_hpc"),
            ("moe_routing_trace_path", "bridge_hpc builds dense GPTs: there is no MoE router to trace"),
            ("moe_routing_trace_max_training_iters", "bridge_hpc builds dense GPTs: there is no MoE router to trace"),
            ("moe_routing_trace_capture_logits", "bridge_hpc builds dense GPTs: there is no MoE router to trace"),
            ("moe_routing_trace_capture_hidden_states", "bridge_hpc builds dense GPTs: there is no MoE router to trace"),
            ("moe_routing_trace_dump_weights", "bridge_hpc builds dense GPTs: there is no MoE router to trace"),
        ):
            _check(not getattr(self, name), f"logger.{name}", f"must be left at its default: {why}")
        for name in ("wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity", "mlflow_experiment",
                     "mlflow_run_name", "mlflow_tracking_uri", "comet_project", "comet_experiment_name",
                     "comet_workspace", "save_config_filepath"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value.strip() != ""), f"logger.{name}",
                   "must be a non-empty string, or unset")
        for name, backend in (("wandb_exp_name", "wandb_project"), ("wandb_save_dir", "wandb_project"),
                              ("wandb_entity", "wandb_project"), ("mlflow_run_name", "mlflow_experiment"),
                              ("mlflow_tracking_uri", "mlflow_experiment"), ("mlflow_tags", "mlflow_experiment"),
                              ("comet_experiment_name", "comet_project"), ("comet_workspace", "comet_project"),
                              ("comet_tags", "comet_project")):
            _check(getattr(self, name) is None or getattr(self, backend) is not None, f"logger.{name}",
                   f"is set but logger.{backend} is not, so that backend is off")


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
# The launcher's sections ([job], [slurm], ...) are bridge_hpc.jobfile.jobconfig's; the trainer skips them.


@dataclass
class ConfigContainer:
    """Every section of a training run, as Bridge's ``ConfigContainer`` names them."""

    train: TrainingConfig
    model: GPTModelConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    dataset: Union[GPTDatasetConfig, FinetuningDatasetConfig, MockGPTDatasetConfig, DatasetProvider]
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
        (:func:`bridge_hpc.training.datasets.builders.build_datasets`); a fine-tuning split asked for 0 is not read."""
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
