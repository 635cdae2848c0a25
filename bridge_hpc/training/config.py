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

This module holds the sections of the training loop itself and the container; the other sections
live beside the components that read them (``[tokenizer]`` in :mod:`bridge_hpc.training.tokenizers.config`,
``[dataset]`` in :mod:`bridge_hpc.training.datasets.config`, ...) and are re-exported here, Bridge's
path for every one of them. So are the helpers that word what a config changes from the defaults
(:mod:`bridge_hpc.training.utils.config_values`, Bridge's ``_get_*`` among them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from bridge_hpc.contracts import run_folder, signals
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.fast_path import FastPath
from bridge_hpc.contracts.schema import (
    LAUNCHER_SECTIONS,
    build_dataclass,
    check_left_at_default,
    did_you_mean,
)
from bridge_hpc.contracts.schema import check as _check
from bridge_hpc.peft.base import PEFT
from bridge_hpc.peft.config import check_peft, peft_from_section, peft_type
from bridge_hpc.peft.lora import LoRA
from bridge_hpc.training.comm_overlap import CommOverlapConfig
from bridge_hpc.training.engine.low_precision import check_container as check_low_precision_container
from bridge_hpc.training.mixed_precision import (
    MixedPrecisionConfig,
    get_mixed_precision_config,
    recipe_fields,  # noqa: F401 - for the login side (jobconfig)
)
from bridge_hpc.training.process import world
from bridge_hpc.training.utils.config_values import (  # noqa: F401 - Bridge's private helpers, re-exported
    LOGGED_VALUE_CHARS,
    REDACTED,
    SECRET_FIELDS,
    _get_key_config_values,
    _get_mcore_transformer_parent,
    _get_non_default_values,
    log_changed_fields,
)

logger = logging.getLogger(__name__)

# The sections that live beside the components that read them, at Megatron Bridge's path too.
from bridge_hpc.training.checkpoint.config import CheckpointConfig  # noqa: E402,F401 - Bridge's name, re-exported
from bridge_hpc.training.datasets import config as _datasets  # noqa: E402 - the torch-free descriptions
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
    IndexedDatasetHeader,
    JsonlProblem,
    Progress,
    absolute_dataset_paths,
    check_jsonl_records,
    dataset_config_class,
    parse_blend,
    parse_jsonl_record,
    parse_split,
    read_index_header,
    reads_indexed_data,
    verify_index,
)
from bridge_hpc.training.engine.config import (  # noqa: E402,F401 - Bridge's names, re-exported
    FUSED_NORM_MAX_WIDTH,
    TENSOR_INSPECT_PACKAGE,
    DistributedDataParallelConfig,
    DistributedInitConfig,
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
from bridge_hpc.training.tokenizers.config import (  # noqa: E402,F401 - Bridge's name, re-exported
    TOKENIZER_TYPES_WITH_MODEL,
    TokenizerConfig,
)
from bridge_hpc.training.utils.config import (  # noqa: E402,F401 - re-exported
    LoggerConfig,
    ProfilingConfig,
    packages_looked_up,
)

# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@dataclass
class RNGConfig:
    """Seeds. The same seed on every data-parallel rank keeps the replicas' initialisation equal."""

    seed: int = 1234
    #: Transformer Engine's CUDA RNG tracker (needed by TE's CUDA graphs): with
    #: ``model.transformer_impl = "transformer_engine"`` it is what megatron-core seeds.
    te_rng_tracker: bool = False
    inference_rng_tracker: bool = False
    data_parallel_random_init: bool = False

    def finalize(self) -> None:
        _check(self.seed >= 0, "rng.seed", "must be >= 0")
        check_left_at_default(self, "rng", {
            "inference_rng_tracker": "bridge_hpc trains; megatron's inference RNG tracker is for its inference engine"})


@dataclass
class TrainingConfig:
    """The training loop: how long, how big a batch, when to evaluate and when to stop.

    ``exit_signal_handler`` defaults to on (Bridge: off) because on a preemptible cluster Slurm's
    SIGTERM (and ``--signal=USR1@...``) is the normal way a job ends: the loop must save and stop.
    ``exit_signal`` (Python names) is filled at submission from ``[slurm] signal`` — the configured
    signal plus SIGTERM, see :mod:`bridge_hpc.contracts.signals`; left unset, :meth:`finalize` takes
    the default signal's list. A list that misses the signal Slurm will send is refused there.
    """

    micro_batch_size: Optional[int] = None
    global_batch_size: Optional[int] = None
    #: Megatron's batch-size ramp-up and its successors: refused when set (a step here always holds
    #: ``global_batch_size`` samples, which exact resume and the scheduler's sample count rely on).
    rampup_batch_size: Optional[List[int]] = None
    step_batch_size_schedule: Optional[str] = None
    decrease_batch_size_if_needed: bool = False
    #: ``torch.cuda.empty_cache()`` after each step (1) or also between forward-backward and the
    #: optimizer step (2), to fight fragmentation at some speed; nothing on CPU.
    empty_unused_memory_level: Literal[0, 1, 2] = 0
    #: Every this many steps, every data-parallel replica's weights are hashed and compared
    #: (megatron-core's ``check_param_hashes_across_dp_replicas``); a mismatch stops the run.
    check_weight_hash_across_dp_replicas_interval: Optional[int] = None
    gpu_sniff_test_interval: Optional[int] = None
    #: Every this many steps the host waits for the GPU (keeps the CPU from running far ahead).
    train_sync_interval: Optional[int] = None
    #: How long to train, in iterations or in samples (exactly one of them). ``train_samples`` makes
    #: ``train_iters = train_samples // global_batch_size`` (finalize) and counts the scheduler in
    #: samples (``scheduler.lr_*_samples``), so a run counted in samples trains exactly like the same
    #: run counted in iterations, and resumes the same way.
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    #: Deprecated spellings of ``[validation]``'s fields (as in Bridge): None unless set; a value set
    #: here moves to ``validation`` (:meth:`ConfigContainer.finalize_sections`), which the loop reads.
    eval_interval: Optional[int] = None
    eval_iters: Optional[int] = None
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = True
    exit_signal: Optional[Union[str, List[str]]] = None
    #: Megatron's: a stop signal also reaches the data loader's worker processes. Here the workers
    #: ignore stop signals and the rank handles them (see process/signal_recorder), so only false.
    exit_signal_handler_for_dataloader: bool = False
    #: Megatron's: SIGINT and SIGTERM end training without a traceback. Here they join the stop signals
    #: (save, then exit) when true.
    exit_signal_handler_for_training: bool = False
    #: Megatron's ``--manual-gc``: Python's automatic garbage collection is off while training, and a
    #: full collection runs every ``manual_gc_interval`` steps (0: only when training starts), at the
    #: same step on every rank, instead of whenever one rank's allocations trigger it.
    manual_gc: bool = False
    manual_gc_interval: int = 0
    #: With ``manual_gc``: a full collection before and after every evaluation.
    manual_gc_eval: bool = True
    #: 1-indexed iterations to skip (Megatron's, e.g. to step over a batch that made the loss spike): the
    #: iteration's global batch is read and dropped, the weights and the scheduler do not move, and the
    #: iteration counts (see ``train.skip_iteration``).
    iterations_to_skip: List[int] = field(default_factory=list)
    skip_train: Optional[bool] = None
    #: With model parallelism (more than one rank per model): agree on whether the optimizer step
    #: succeeded (a logical AND) and on the grad norm (the max) over the model-parallel group, as
    #: Bridge's train_step does. With one rank per model there is nothing to agree on.
    check_optimizer_step_success: bool = True
    skip_sync_grad_norm_across_mp: bool = False

    def finalize(self) -> None:
        _check(self.train_iters is not None or self.train_samples is not None, "train.train_iters",
               "must be set (or train.train_samples)")
        _check(self.micro_batch_size is not None and self.micro_batch_size > 0,
               "train.micro_batch_size", "must be a positive integer")
        _check(self.global_batch_size is not None and self.global_batch_size > 0,
               "train.global_batch_size", "must be a positive integer")
        if self.train_samples is not None:
            _check(self.train_samples >= 0, "train.train_samples", "must be >= 0")
            derived = self.train_samples // self.global_batch_size
            # A second finalize finds the train_iters the first one derived.
            _check(self.train_iters in (None, derived), "train.train_samples",
                   "and train.train_iters are both set: give one of them")
            self.train_iters = derived
        _check(self.train_iters >= 0, "train.train_iters", "must be >= 0")
        check_left_at_default(self, "train", {
            "rampup_batch_size": "every step holds train.global_batch_size samples here (exact resume and the "
                                 "scheduler's sample count rely on it)",
            "step_batch_size_schedule": "every step holds train.global_batch_size samples here",
            "decrease_batch_size_if_needed": "a global batch that the data-parallel size does not divide is refused, "
                                             "not shrunk",
            "gpu_sniff_test_interval": "megatron-core 0.19 has no GPU sniff test",
            "exit_signal_handler_for_dataloader": "data-loader workers ignore stop signals; the rank handles them",
        })
        for key in ("check_weight_hash_across_dp_replicas_interval", "train_sync_interval"):
            value = getattr(self, key)
            _check(value is None or value > 0, f"train.{key}", "must be > 0 (or unset)")
        _check(all(isinstance(i, int) and i >= 1 for i in self.iterations_to_skip), "train.iterations_to_skip",
               f"expected 1-indexed iteration numbers (>= 1), got {self.iterations_to_skip!r}")
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
        if self.exit_signal_handler_for_training:
            self.exit_signal = list(dict.fromkeys([*self.exit_signal, "SIGINT", "SIGTERM"]))
        import signal

        for name in self.exit_signal:
            _check(isinstance(getattr(signal, str(name), None), signal.Signals),
                   "train.exit_signal", f"unknown signal {name!r} (e.g. 'SIGTERM', 'SIGUSR1')")


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
    #: No evaluation before this iteration (the first ``eval_interval`` step at or after it is the first).
    start_eval_at_iter: Optional[int] = None
    #: Evaluation's own batch sizes (unset: the training ones, filled in by ConfigContainer.validate):
    #: each evaluation reads ``eval_iters`` batches of ``eval_global_batch_size`` samples, each rank its
    #: share in micro-batches of ``eval_micro_batch_size`` (a forward needs no optimizer state, so it
    #: can often take larger ones than training).
    eval_global_batch_size: Optional[int] = None
    eval_micro_batch_size: Optional[int] = None
    skip_train: bool = False
    test_mode: bool = False
    full_validation: bool = False
    multiple_validation_sets: bool = False
    validation_set_names: Optional[List[str]] = None

    def finalize(self) -> None:
        for key in ("eval_iters", "eval_interval", "start_eval_at_iter"):
            value = getattr(self, key)
            _check(value is None or value >= 0, f"validation.{key}", "must be >= 0")
        for key in ("eval_global_batch_size", "eval_micro_batch_size"):
            value = getattr(self, key)
            _check(value is None or value > 0, f"validation.{key}", "must be > 0 (or unset: the training one)")
        _check(self.validation_set_names is None, "validation.validation_set_names",
               "must be unset: it names the sets of validation.multiple_validation_sets, which is off")
        for key, why in (("test_mode", "megatron's real-time test runs are not part of this trainer"),
                         ("full_validation", "each evaluation reads validation.eval_iters batches"),
                         ("multiple_validation_sets", "the validation split is one dataset (or one blend)")):
            _check(not getattr(self, key), f"validation.{key}", f"must be false: {why}")


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
    "dataset": _datasets.MockGPTDatasetConfig,
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
    "peft": LoRA,  # or another PEFT_TYPES class, by [peft] type
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
    dataset: Union[_datasets.GPTDatasetConfig, FinetuningDatasetConfig, _datasets.MockGPTDatasetConfig,
                   DatasetProvider]
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
    #: Bridge's parameter-efficient fine-tuning: a :class:`bridge_hpc.peft.base.PEFT` (``LoRA``, ``DoRA``; in
    #: TOML ``[peft] type = "lora"``), applied to the model after the pretrained weights are read.
    peft: Optional[PEFT] = None
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
    #: bridge_hpc's: what the fast path chose for a job on GPUs and why not the rest (resolved.toml's
    #: ``[job] fast_path``; :mod:`bridge_hpc.training.engine.speed_defaults`). None for a config built in Python.
    fast_path: Optional[FastPath] = field(default=None, init=False, repr=False, compare=False)

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
            if name == "peft":  # [peft] type = "lora" | "dora" picks the class
                kwargs[name] = peft_from_section(body, error)
                continue
            section_cls = dataset_config_class(body) if name == "dataset" else SECTIONS[name]
            if section_cls is _datasets.GPTFIMDatasetConfig and not any(body.get(k) is not None
                                                                         for k in GPT_DATASET_PATH_KEYS):
                # (in Python, Bridge's GPTFIMDatasetConfig without data is mock data; a job file's fim_*
                # keys without a data path are a forgotten one)
                raise error("dataset.data_path", "must be set (or train_data_path / valid_data_path / "
                            "test_data_path): the fim_* keys ask for fill-in-the-middle on indexed data")
            if name == "dataset":
                body = _datasets.job_file_body(section_cls, body)
            kwargs[name] = build_dataclass(section_cls, name, body, error)
        for name in ("train", "model", "optimizer", "scheduler", "dataset", "logger", "checkpoint"):
            kwargs.setdefault(name, build_dataclass(SECTIONS[name], name, _datasets.job_file_body(SECTIONS[name], {}),
                                                    error))
        tokenizer = kwargs.get("tokenizer")
        if tokenizer is not None and tokenizer.use_tokenizer_vocab_size is None:
            # The model's vocabulary follows the tokenizer unless [model] says otherwise.
            tokenizer.use_tokenizer_vocab_size = "vocab_size" not in sections.get("model", {})
        cfg = cls(**kwargs)
        try:
            with packages_looked_up():  # the login node imports no logger package
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
        if self.peft is not None:
            check_peft(self.peft, self.model.num_layers, self.model.hidden_size, self.model)
            _check(bool(self.checkpoint.pretrained_checkpoint), "checkpoint.pretrained_checkpoint",
                   "must be set with [peft]: the adapters train on the base model read from it at every start "
                   "(a PEFT checkpoint holds the adapters only)")
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
        if reads_indexed_data(self.dataset):
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
        steps' global batches; ``eval_iters`` evaluation batches (``eval_global_batch_size``) at every
        ``eval_interval`` steps and once after training; ``eval_iters`` of them of test data. What the
        datasets are sized for (:func:`bridge_hpc.training.datasets.builders.build_datasets`); a fine-tuning
        split asked for 0 is not read."""
        t, v = self.train, self.validation
        evals = (t.train_iters // v.eval_interval + 1) if v.eval_interval else 0
        eval_batch = v.eval_global_batch_size or t.global_batch_size
        return (t.train_iters * t.global_batch_size, evals * (v.eval_iters or 0) * eval_batch,
                (v.eval_iters or 0) * eval_batch)

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
        elif reads_indexed_data(d) and full:
            checked = [(prefix + ".idx", verify_index(prefix, key, progress)) for prefix, key in d.prefixes()]
        return checked

    def get_data_parallel_size(self, world_size: int) -> int:
        """``world_size`` over the model-parallel size (tensor x pipeline x context parallel)."""
        model_parallel = self.model.model_parallel_size
        _check(world_size % model_parallel == 0, "model.tensor_model_parallel_size",
               f"world size {world_size} is not divisible by the model-parallel size {model_parallel}")
        if hasattr(self.model, "check_expert_world"):
            self.model.check_expert_world(world_size)
        return world_size // model_parallel

    def set_data_parallel_size(self) -> None:
        """Set ``data_parallel_size`` from the world (torch.distributed's, else ``$WORLD_SIZE``, else 1)
        without the other checks of :meth:`validate`, and copy it to ``comm_overlap`` (whose overlaps
        default to on above 1)."""
        self.data_parallel_size = self.get_data_parallel_size(world.world_size())
        if self.comm_overlap is not None:
            self.comm_overlap.data_parallel_size = self.data_parallel_size

    def validate(self, world_size: Optional[int] = None) -> None:
        """Check that the (finalized) sections agree with each other and with the world; fills the
        fields that depend on it (data-parallel size, decay and warm-up iterations).

        ``world_size`` defaults to torch.distributed's when it is up, else ``$WORLD_SIZE``, else 1.
        """
        m, t = self.model, self.train
        self.data_parallel_size = self.get_data_parallel_size(world_size or world.world_size())
        self._check_batch_sizes(t.global_batch_size, t.micro_batch_size, "train.global_batch_size",
                                "micro_batch_size", "step")
        if reads_indexed_data(self.dataset):
            self._validate_gpt_dataset()
        if isinstance(self.dataset, FinetuningDatasetConfig):
            self.check_data_needs()
            if self.dataset.seq_length is None:
                self.dataset.seq_length = m.seq_length
        if m.context_parallel_size > 1:  # megatron-core splits each sequence into 2 x cp chunks (load balance)
            _check(m.seq_length % (2 * m.context_parallel_size) == 0, "model.seq_length",
                   f"{m.seq_length} is not divisible by 2 x model.context_parallel_size "
                   f"({2 * m.context_parallel_size}), which context parallelism needs")
        if isinstance(self.dataset, _datasets.GPTDatasetConfig) and self.dataset.seq_length is None:
            self.dataset.seq_length = m.seq_length  # mock mode too
        seq_length = getattr(self.dataset, "seq_length", None)
        _check(seq_length is None or seq_length == m.seq_length, "dataset.seq_length",
               f"{seq_length} differs from model.seq_length ({m.seq_length})")
        if isinstance(self.dataset, _datasets.MockGPTDatasetConfig):
            if self.dataset.vocab_size is None:
                self.dataset.vocab_size = m.vocab_size
            _check(self.dataset.vocab_size <= m.vocab_size, "dataset.vocab_size",
                   f"must be <= model.vocab_size ({m.vocab_size})")
        _validate_mixed_precision_consistency(self)
        _validate_and_sync_distributed_optimizer_settings(self)
        check_low_precision_container(self)
        _check(not m.full_iteration_cuda_graph or not self.ddp.overlap_param_gather, "model.cuda_graph_impl",
               "\"full_iteration\" cannot run with ddp.overlap_param_gather = true (its forward pre-hooks wait for "
               "all-gathers started outside the graph)")
        self._validate_training_scheduler_compatibility()
        self._calculate_scheduler_steps()
        s = self.scheduler
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

        if v.eval_micro_batch_size is None:
            v.eval_micro_batch_size = t.micro_batch_size
        if v.eval_global_batch_size is None:
            v.eval_global_batch_size = t.global_batch_size
        self._check_batch_sizes(v.eval_global_batch_size, v.eval_micro_batch_size, "validation.eval_global_batch_size",
                                "validation.eval_micro_batch_size", "evaluation batch")
        _check(v.eval_interval in (None, 0) or (v.eval_iters or 0) > 0, key("eval_iters"),
               f"must be > 0 when {key('eval_interval')} is set")

    def _check_batch_sizes(self, global_batch: int, micro_batch: int, key: str, micro_name: str, what: str) -> None:
        """A global batch (training's or evaluation's) splits into whole micro-batches on every
        data-parallel rank, and with virtual pipeline stages into a multiple of the pipeline size."""
        dp, m = self.data_parallel_size, self.model
        _check(global_batch % (micro_batch * dp) == 0, key,
               f"{global_batch} is not divisible by {micro_name} ({micro_batch}) x data-parallel size ({dp})")
        if (m.virtual_pipeline_model_parallel_size or 1) > 1:
            microbatches = global_batch // (micro_batch * dp)
            _check(microbatches % m.pipeline_model_parallel_size == 0, key,
                   f"gives {microbatches} micro-batches per {what}, which the interleaved pipeline schedule needs "
                   f"to be a multiple of model.pipeline_model_parallel_size ({m.pipeline_model_parallel_size})")

    def _validate_training_scheduler_compatibility(self) -> None:
        """Bridge's check that the scheduler counts in the training's unit (:meth:`SchedulerConfig.check_unit`)."""
        self.scheduler.check_unit(self.train)

    def _calculate_scheduler_steps(self) -> None:
        """Bridge's scheduler steps from the training's length (:meth:`SchedulerConfig.calculate_steps`)."""
        self.scheduler.calculate_steps(self.train)

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
        log_changed_fields(self.sections(), logger)

    def to_dict(self) -> Dict[str, Any]:
        """The resolved configuration as plain data (saved in every checkpoint, written by
        ``logger.save_config_filepath``); secrets (``logger.comet_api_key``) as :data:`REDACTED`."""
        out = {name: dataclasses.asdict(section) for name, section in self.sections()}
        out["dataset"]["_class"] = f"{type(self.dataset).__module__}.{type(self.dataset).__qualname__}"
        if self.peft is not None:  # its TOML form: the type and the fields (not its runtime state)
            out["peft"] = {"type": peft_type(self.peft), **{f.name: getattr(self.peft, f.name)
                                                           for f in dataclasses.fields(self.peft) if f.init}}
        for section, key in SECRET_FIELDS:
            if out.get(section, {}).get(key) is not None:
                out[section][key] = REDACTED
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

    First of all, a GPT dataset config that is the job file's torch-free description becomes the class
    of the same name that is also megatron-core's ``GPTDatasetConfig``, as in Bridge
    (:mod:`bridge_hpc.training.datasets.megatron_configs`).
    """
    if type(cfg.dataset) in (_datasets.GPTDatasetConfig, _datasets.GPTFIMDatasetConfig, _datasets.MockGPTDatasetConfig):
        # the job file's torch-free description becomes Bridge's class, megatron-core's subclass
        from bridge_hpc.training.datasets.megatron_configs import for_ranks

        cfg.dataset = for_ranks(cfg.dataset)
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
        if ddp_setting != optimizer_setting and world.rank() == 0:
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
# Bridge's megatron-core dataset classes, resolved on first use
# ---------------------------------------------------------------------------------------------


#: Bridge's dataset config names that are megatron-core subclasses: resolved on first use
#: (:func:`__getattr__`), so that importing this module stays torch-free for the login node, which reads
#: the torch-free descriptions of :mod:`bridge_hpc.training.datasets.config` instead.
MEGATRON_DATASET_CONFIGS = ("GPTDatasetConfig", "GPTFIMDatasetConfig", "MockGPTDatasetConfig")


def __getattr__(name: str) -> Any:
    """``GPTDatasetConfig``, ``GPTFIMDatasetConfig``, ``MockGPTDatasetConfig``: Megatron Bridge's classes,
    subclasses of megatron-core's ``GPTDatasetConfig`` (:mod:`bridge_hpc.training.datasets.megatron_configs`;
    the first use imports torch and megatron-core)."""
    if name in MEGATRON_DATASET_CONFIGS:
        from bridge_hpc.training.datasets import megatron_configs

        value = getattr(megatron_configs, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
