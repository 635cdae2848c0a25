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
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from bridge_hpc.contracts import signals
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import LAUNCHER_SECTIONS, build_dataclass, did_you_mean

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
    """How torch.distributed is set up. ``distributed_backend = None`` picks nccl on GPU, gloo on CPU."""

    distributed_backend: Optional[Literal["nccl", "gloo"]] = None
    distributed_timeout_minutes: int = 10
    external_gpu_device_mapping: bool = False

    def finalize(self) -> None:
        _check(self.distributed_timeout_minutes > 0, "dist.distributed_timeout_minutes", "must be > 0")


@dataclass
class DistributedDataParallelConfig:
    """Data-parallel wrapper settings; used as megatron-core DDP's config on GPU (ignored by torch DDP)."""

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    average_in_collective: bool = False
    bucket_size: Optional[int] = None

    def finalize(self) -> None:
        _check(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "ddp.overlap_param_gather", "needs ddp.use_distributed_optimizer = true",
        )


@dataclass
class OptimizerConfig:
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

    def finalize(self) -> None:
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
    eval_interval: Optional[int] = 1000
    eval_iters: Optional[int] = 100
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = True
    exit_signal: Optional[Union[str, List[str]]] = None
    manual_gc: bool = False
    manual_gc_interval: int = 0
    skip_train: bool = False

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
    """

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    most_recent_k: int = -1
    async_save: bool = False
    pretrained_checkpoint: Optional[str] = None
    ckpt_format: Literal["torch_dist"] = "torch_dist"
    save_optim: bool = True
    save_rng: bool = True
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    exit_on_missing_checkpoint: bool = False

    def finalize(self) -> None:
        if self.load is None:
            self.load = self.save
        _check(self.save_interval is None or self.save_interval > 0,
               "checkpoint.save_interval", "must be > 0")
        _check(self.most_recent_k == -1 or self.most_recent_k > 0,
               "checkpoint.most_recent_k", "must be -1 (keep all) or > 0")
        # An asynchronous writer needs a background process that survives the step; until it
        # exists, silently saving synchronously would break the time budget users plan around.
        _check(not self.async_save, "checkpoint.async_save", "is not supported yet; use false")


@dataclass
class LoggerConfig:
    """Console, metrics-file and TensorBoard logging.

    ``metrics_file`` is ours (not Bridge's): the JSON-lines file that records every step's loss at
    full precision; ``bridge_hpc.training.run`` points it at ``<run_dir>/metrics.jsonl``. ``log_progress``
    appends Megatron's ``progress.txt`` (plus bridge_hpc's goodput events) in ``checkpoint.save``.
    """

    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    log_progress: bool = False
    timing_log_level: Literal[-1, 0, 1, 2] = 0
    log_timers_to_tensorboard: bool = False
    log_params_norm: bool = False
    metrics_file: Optional[str] = None
    logging_level: int = 20  # Python logging level of bridge_hpc's own messages (20 = INFO)

    def finalize(self) -> None:
        _check(self.log_interval > 0, "logger.log_interval", "must be > 0")
        _check(self.logging_level in (10, 20, 30, 40, 50), "logger.logging_level",
               "must be a Python logging level: 10 (DEBUG), 20 (INFO), 30 (WARNING), 40 or 50")
        _check(self.tensorboard_log_interval > 0, "logger.tensorboard_log_interval", "must be > 0")


@dataclass
class ProfilingConfig:
    """torch.profiler over a window of steps, on chosen ranks; traces go to ``tensorboard_dir``."""

    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: List[int] = field(default_factory=lambda: [0])
    record_shapes: bool = False

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
    """megatron's built-in straggler detector. Bridge's field names."""

    log_straggler: bool = False
    enable_straggler_on_startup: bool = True
    straggler_ctrlr_port: int = 65535
    straggler_minmax_count: int = 1

    def finalize(self) -> None:
        pass


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
class GPTModelConfig:
    """A GPT built from megatron-core's ``GPTModel``; names follow megatron-core's TransformerConfig.

    Only tensor/pipeline/context parallel size 1 is built by this trainer today; the fields exist so
    that Bridge recipes parse, and :meth:`finalize` rejects other values by name.
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
    sequence_parallel: bool = False
    transformer_impl: Literal["local", "transformer_engine"] = "local"

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
            _check(getattr(self, key) == 1, f"model.{key}", "only 1 is supported by this trainer")


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
    at submission, rather than minutes later on every rank. A relative path is made absolute against
    the directory the config is read from.

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


@dataclass
class DataloaderConfig:
    """DataLoader settings shared by every dataset config (Bridge's names)."""

    dataloader_type: Optional[Literal["single", "cyclic", "external"]] = "single"
    num_workers: int = 2
    data_sharding: bool = True
    pin_memory: bool = True
    drop_last: bool = True
    persistent_workers: bool = True

    def finalize(self) -> None:
        _check(self.num_workers >= 0, "dataset.num_workers", "must be >= 0")
        if self.num_workers == 0:
            self.persistent_workers = False


@dataclass
class DatasetProvider(DataloaderConfig, abc.ABC):
    """Hook for custom data: subclass, implement :meth:`build_datasets`, put it in ``cfg.dataset``.

    Datasets must be map-style (``__len__`` and ``__getitem__``) and deterministic in the index:
    the trainer samples them in order from the number of consumed samples, which is what makes the
    data position part of every checkpoint and resume exact. Samples are dicts of tensors, the
    shape the forward-step function expects (for :func:`bridge_hpc.training.gpt.forward_step`:
    ``tokens``, ``labels``, ``loss_mask``, ``position_ids``).
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
    "inprocess_restart": InProcessRestartConfig,
    "tokenizer": TokenizerConfig,
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
    inprocess_restart: Optional[InProcessRestartConfig] = None
    tokenizer: Optional[TokenizerConfig] = None
    data_parallel_size: int = field(default=1, init=False)

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
            if not isinstance(body, dict):
                raise ConfigError(f"expected a table [{name}], got {type(body).__name__}", path=source, key=name)
            kwargs[name] = build_dataclass(SECTIONS[name], name, body, error)
        for name in ("train", "model", "optimizer", "scheduler", "dataset", "logger", "checkpoint"):
            kwargs.setdefault(name, build_dataclass(SECTIONS[name], name, {}, error))
        tokenizer = kwargs.get("tokenizer")
        if tokenizer is not None and tokenizer.use_tokenizer_vocab_size is None:
            # The model's vocabulary follows the tokenizer unless [model] says otherwise.
            tokenizer.use_tokenizer_vocab_size = "vocab_size" not in sections.get("model", {})
        cfg = cls(**kwargs)
        try:
            cfg.finalize_sections()
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
        """Run every section's deferred ``finalize()``; :meth:`from_sections` does it once."""
        for _, section in self.sections():
            section.finalize()

    # -- cross-section checks -----------------------------------------------------------------
    def validate(self, world_size: Optional[int] = None) -> None:
        """Check that the (finalized) sections agree with each other and with the world; fills the
        fields that depend on it (data-parallel size, decay and warm-up iterations).

        ``world_size`` defaults to torch.distributed's when it is up, else ``$WORLD_SIZE``, else 1.
        """
        world_size = world_size or _world_size()
        m, t = self.model, self.train
        model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        _check(world_size % model_parallel == 0, "model.tensor_model_parallel_size",
               f"world size {world_size} is not divisible by the model-parallel size {model_parallel}")
        self.data_parallel_size = world_size // model_parallel
        _check(t.global_batch_size % (t.micro_batch_size * self.data_parallel_size) == 0, "train.global_batch_size",
               f"{t.global_batch_size} is not divisible by micro_batch_size ({t.micro_batch_size}) "
               f"x data-parallel size ({self.data_parallel_size})")
        seq_length = getattr(self.dataset, "seq_length", None)
        _check(seq_length is None or seq_length == m.seq_length, "dataset.seq_length",
               f"{seq_length} differs from model.seq_length ({m.seq_length})")
        if isinstance(self.dataset, MockGPTDatasetConfig):
            if self.dataset.vocab_size is None:
                self.dataset.vocab_size = m.vocab_size
            _check(self.dataset.vocab_size <= m.vocab_size, "dataset.vocab_size",
                   f"must be <= model.vocab_size ({m.vocab_size})")
        if self.optimizer.bf16 != m.bf16 or self.optimizer.fp16 != m.fp16:
            raise ConfigError("model and optimizer precision must agree (bf16/fp16)", key="optimizer.bf16")
        _check(not self.ddp.use_distributed_optimizer or self.optimizer.use_distributed_optimizer,
               "optimizer.use_distributed_optimizer", "must match ddp.use_distributed_optimizer")
        s = self.scheduler
        if s.lr_decay_iters is None:
            s.lr_decay_iters = t.train_iters
        if s.lr_warmup_fraction is not None:
            s.lr_warmup_iters = int(s.lr_warmup_fraction * s.lr_decay_iters)
        _check(s.lr_warmup_iters <= max(s.lr_decay_iters, 0) or s.lr_decay_style == "constant",
               "scheduler.lr_warmup_iters", f"must be <= lr_decay_iters ({s.lr_decay_iters})")
        if s.start_weight_decay is None:
            s.start_weight_decay = self.optimizer.weight_decay
        if s.end_weight_decay is None:
            s.end_weight_decay = self.optimizer.weight_decay
        c = self.checkpoint
        _check(c.save_interval is None or c.save is not None, "checkpoint.save_interval",
               "is set but checkpoint.save (the folder) is not")
        _check(t.eval_interval in (None, 0) or (t.eval_iters or 0) > 0, "train.eval_iters",
               "must be > 0 when train.eval_interval is set")

    def to_dict(self) -> Dict[str, Any]:
        """The resolved configuration as plain data (saved in every checkpoint)."""
        out = {name: dataclasses.asdict(section) for name, section in self.sections()}
        out["dataset"]["_class"] = f"{type(self.dataset).__module__}.{type(self.dataset).__qualname__}"
        return out


# ---------------------------------------------------------------------------------------------
# Helpers: checking keys and types
# ---------------------------------------------------------------------------------------------


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
