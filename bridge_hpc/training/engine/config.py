"""The ``[optimizer]``, ``[scheduler]``, ``[model]``, ``[tensor_inspect]``, ``[dist]`` and ``[ddp]`` sections:
torch-free dataclasses with Megatron Bridge's field names, re-exported by :mod:`bridge_hpc.training.config` (Bridge's path for
them). They live beside the engine that reads them; the login node imports them without torch."""

from __future__ import annotations

import fnmatch
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import DeferredPostInit, build_dataclass, check_left_at_default, did_you_mean
from bridge_hpc.contracts.schema import check as _check
from bridge_hpc.training.engine.low_precision import LowPrecisionFields
from bridge_hpc.training.engine.moe_config import MoEFields

logger = logging.getLogger(__name__)


#: dtype spellings a job file may use for the optimizer's dtype fields (Python configs pass torch dtypes).
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "torch.float32": "float32",
               "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
               "float16": "float16", "fp16": "float16", "torch.float16": "float16",
               "uint8": "uint8", "torch.uint8": "uint8"}


def dtype_name(value: Any, key: str) -> str:
    """The canonical name (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"uint8"``) of a dtype given as
    a string or a torch dtype; ConfigError naming ``key`` for anything else."""
    name = DTYPE_NAMES.get(str(value))
    if name is None:
        raise ConfigError(f"unknown dtype {value!r}; expected one of float32, bfloat16, float16, uint8", key=key)
    return name


#: The optimizer-state dtype fields megatron-core's precision-aware optimizer reads.
STATE_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


@dataclass
class OptimizerConfig(DeferredPostInit):
    """megatron-core's ``OptimizerConfig``: every field, its name and default (Megatron Bridge's class,
    with ``finalize()`` deferred), plus bridge_hpc's ``fused_step`` and ``overrides``.

    On GPU the section becomes megatron-core's own config field for field
    (:func:`bridge_hpc.training.engine.optimizer.megatron_optimizer_config`), so megatron-core acts on
    each: fp16 dynamic loss scaling (``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window``,
    ``hysteresis``; ``loss_scale`` fixes it), ``decoupled_lr`` / ``decoupled_min_lr`` for the embedding
    and output layer, ``decoupled_weight_decay`` (AdamW, or Adam with L2), the precision-aware
    optimizer's state dtypes (``main_grads_dtype``, ``main_params_dtype``, ``exp_avg_dtype``,
    ``exp_avg_sq_dtype``: it needs Transformer Engine's FusedAdam and the distributed optimizer),
    ``log_num_zeros_in_grad``. On CPU, torch's AdamW/Adam/SGD does the same for the fields that make
    sense there; the ones that cannot (loss scaling: no fp16 on CPU; the precision-aware optimizer)
    are refused when set. dtypes are torch dtypes in Python and their names in a job file
    (``"bfloat16"``), kept as given; defaults are the names, so the module needs no torch.

    Left at their defaults (refused otherwise, naming the field): Muon (``muon_*``), CPU offload of
    the optimizer, and megatron's timers (``timers``, ``config_logger_dir``) that this trainer does
    not create. ``clip_grad = 0`` disables clipping.
    """

    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    apply_wd_to_qk_layernorm: bool = False
    fp8_recipe: Optional[str] = None
    fp16: bool = False
    bf16: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    params_dtype: Any = "float32"
    use_precision_aware_optimizer: bool = False
    store_param_remainders: bool = True
    main_grads_dtype: Any = "float32"
    main_params_dtype: Any = "float32"
    exp_avg_dtype: Any = "float32"
    exp_avg_sq_dtype: Any = "float32"
    optimizer: Literal["adam", "sgd"] = "adam"
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 4294967296
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    decoupled_weight_decay: bool = True
    sgd_momentum: float = 0.9
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_extra_scale_factor: float = 1.0
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    overlap_param_gather_with_optimizer_step: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[Any] = None
    config_logger_dir: str = ""
    #: The optimizer step's kernels (see bridge_hpc.training.engine.optimizer): torch's fused AdamW on the fp32
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
        _check(self.decoupled_lr is None or self.decoupled_lr > 0, "optimizer.decoupled_lr", "must be > 0")
        _check(self.decoupled_min_lr is None or self.decoupled_lr is not None, "optimizer.decoupled_min_lr",
               "needs optimizer.decoupled_lr (the peak it decays from)")
        _check(self.decoupled_min_lr is None or 0 <= self.decoupled_min_lr <= self.decoupled_lr,
               "optimizer.decoupled_min_lr", "must be between 0 and optimizer.decoupled_lr")
        _check(self.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
        _check(0 <= self.adam_beta1 < 1, "optimizer.adam_beta1", "must be in [0, 1)")
        _check(0 <= self.adam_beta2 < 1, "optimizer.adam_beta2", "must be in [0, 1)")
        _check(self.adam_eps > 0, "optimizer.adam_eps", "must be > 0")
        _check(self.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0")
        _check(not (self.bf16 and self.fp16), "optimizer.fp16", "bf16 and fp16 are exclusive")
        _check(self.loss_scale is None or self.loss_scale > 0, "optimizer.loss_scale", "must be > 0 (or unset: dynamic)")
        _check(self.initial_loss_scale > 0, "optimizer.initial_loss_scale", "must be > 0")
        _check(0 < self.min_loss_scale <= self.initial_loss_scale, "optimizer.min_loss_scale",
               "must be > 0 and <= optimizer.initial_loss_scale")
        _check(self.loss_scale_window >= 1, "optimizer.loss_scale_window", "must be >= 1")
        _check(self.hysteresis >= 1, "optimizer.hysteresis", "must be >= 1")
        if self.params_dtype is not None:
            dtype_name(self.params_dtype, "optimizer.params_dtype")
        for key in STATE_DTYPE_FIELDS:
            dtype_name(getattr(self, key), f"optimizer.{key}")
        if not self.use_precision_aware_optimizer:
            for key in STATE_DTYPE_FIELDS:
                _check(dtype_name(getattr(self, key), key) == "float32", f"optimizer.{key}",
                       "needs optimizer.use_precision_aware_optimizer = true (megatron-core keeps optimizer state "
                       "in float32 otherwise)")
        else:
            _check(self.optimizer == "adam", "optimizer.use_precision_aware_optimizer", "needs optimizer = \"adam\"")
            _check(self.use_distributed_optimizer, "optimizer.use_precision_aware_optimizer",
                   "needs the distributed optimizer (optimizer.use_distributed_optimizer or "
                   "ddp.use_distributed_optimizer = true)")
        muon = "bridge_hpc offers adam and sgd (optimizer.optimizer); megatron-core's Muon is not among them"
        offload = "bridge_hpc keeps the optimizer on the accelerator (no CPU offload)"
        check_left_at_default(self, "optimizer", {
            **{name: muon for name in ("muon_momentum", "muon_split_qkv", "muon_use_nesterov", "muon_scale_mode",
                                       "muon_fp32_matmul_prec", "muon_num_ns_steps", "muon_tp_mode",
                                       "muon_extra_scale_factor")},
            **{name: offload for name in ("optimizer_cpu_offload", "optimizer_offload_fraction",
                                          "use_torch_optimizer_for_cpu_offload", "overlap_cpu_optimizer_d2h_h2d")},
            "timers": "bridge_hpc times whole steps; it hands megatron-core no timers",
            "config_logger_dir": "megatron-core's config logger is not wired in bridge_hpc",
        })


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
        stays a multiplier here: :mod:`bridge_hpc.training.engine.optimizer` resolves it against the lr)."""
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
        return default_config_overrides(context)

    def finalize(self) -> None:
        """Nothing to check (``ConfigContainer.finalize_sections`` calls it on every section)."""


@dataclass
class SchedulerConfig:
    """Learning-rate and weight-decay schedule (drives megatron-core's OptimizerParamScheduler).

    Counted in iterations (``lr_decay_iters``, ``lr_warmup_iters``, ``lr_wsd_decay_iters``) when
    ``train.train_iters`` is set, in samples (``lr_decay_samples``, ``lr_warmup_samples``,
    ``lr_wsd_decay_samples``) when ``train.train_samples`` is; the other unit's fields must stay unset
    (:meth:`ConfigContainer.validate`). The scheduler itself counts samples: ``lr_decay_steps``,
    ``lr_warmup_steps``, ``wd_incr_steps`` and ``wsd_decay_steps`` are computed there, as in Bridge
    (iterations x global batch size, or the sample counts), so a run counted in samples and the same
    run counted in iterations get the same schedule. ``lr_decay_iters`` / ``lr_decay_samples`` unset:
    the whole run (``max_steps``, when set: the full run this shorter one is the start of); ``lr_warmup_fraction``:
    that share of the decay steps.
    ``no_weight_decay_cond_type = "qwen3_next"`` also decays the q/k layernorm weights.
    """

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    lr_decay_iters: Optional[int] = None
    lr_decay_samples: Optional[int] = None
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = True
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    no_weight_decay_cond_type: Optional[Literal["qwen3_next"]] = None
    #: Bridge's: the length (iterations) of the full run whose schedule this shorter one follows, for a test
    #: run of its first ``train.train_iters`` steps; must be >= them (iteration-based training only).
    max_steps: Optional[int] = None
    lr_decay_steps: Optional[int] = field(default=None, init=False)
    lr_warmup_steps: Optional[int] = field(default=None, init=False)
    wd_incr_steps: Optional[int] = field(default=None, init=False)
    wsd_decay_steps: Optional[int] = field(default=None, init=False)

    def finalize(self) -> None:
        _check(self.max_steps is None or self.max_steps > 0, "scheduler.max_steps",
               f"scheduler.max_steps must be positive, got {self.max_steps}.")
        for key in ("lr_warmup_iters", "lr_warmup_samples"):
            _check(getattr(self, key) >= 0, f"scheduler.{key}", "must be >= 0")
        for key in ("lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters", "lr_wsd_decay_samples"):
            _check(getattr(self, key) is None or getattr(self, key) >= 0, f"scheduler.{key}", "must be >= 0")
        _check(
            self.lr_warmup_fraction is None or 0 <= self.lr_warmup_fraction <= 1,
            "scheduler.lr_warmup_fraction", "must be in [0, 1]",
        )
        # Megatron Bridge's rules, in its words after the key
        iter_fields = (self.lr_decay_iters is not None or self.lr_warmup_iters != 0
                       or self.lr_wsd_decay_iters is not None)
        sample_fields = (self.lr_decay_samples is not None or self.lr_warmup_samples != 0
                         or self.lr_wsd_decay_samples is not None)
        _check(not (iter_fields and sample_fields), "scheduler." + next(
            (k for k in ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")
             if getattr(self, k) not in (None, 0)), "lr_decay_samples"),
            "Cannot mix iteration-based and sample-based scheduler fields. Found iteration fields: "
            f"lr_decay_iters={self.lr_decay_iters}, lr_warmup_iters={self.lr_warmup_iters}, "
            f"lr_wsd_decay_iters={self.lr_wsd_decay_iters}. Found sample fields: "
            f"lr_decay_samples={self.lr_decay_samples}, lr_warmup_samples={self.lr_warmup_samples}, "
            f"lr_wsd_decay_samples={self.lr_wsd_decay_samples}. Use either iteration fields OR sample fields, "
            "not both.")
        _check(
            self.lr_warmup_fraction is None or (self.lr_warmup_iters == 0 and self.lr_warmup_samples == 0),
            "scheduler.lr_warmup_fraction",
            f"Cannot specify lr_warmup_fraction={self.lr_warmup_fraction} with lr_warmup_iters={self.lr_warmup_iters} "
            f"or lr_warmup_samples={self.lr_warmup_samples}. "
            "Use either lr_warmup_fraction OR lr_warmup_iters OR lr_warmup_samples.",
        )
        _check(
            not (self.use_checkpoint_opt_param_scheduler and self.override_opt_param_scheduler),
            "scheduler.override_opt_param_scheduler", "both override and use-checkpoint are set.",
        )
        for key in ("start_weight_decay", "end_weight_decay"):
            value = getattr(self, key)
            _check(value is None or value >= 0, f"scheduler.{key}", "must be >= 0")
        _check(self.lr_warmup_init >= 0, "scheduler.lr_warmup_init", "must be >= 0")

    def check_unit(self, train: Any) -> None:
        """Training counted in iterations takes the scheduler's ``*_iters`` fields, in samples its
        ``*_samples`` fields; the other unit's must stay unset (Bridge's rules and words, after the key;
        the WSD decay fields are checked too, which Bridge leaves to megatron-core)."""
        s = self
        if train.train_samples is not None:
            rules = (("lr_decay_iters", s.lr_decay_iters is None,
                      "Use lr_decay_samples for sample-based training, not lr_decay_iters"),
                     ("lr_warmup_iters", s.lr_warmup_iters == 0,
                      "Use lr_warmup_samples for sample-based training, not lr_warmup_iters"),
                     ("lr_wsd_decay_iters", s.lr_wsd_decay_iters is None,
                      "Use lr_wsd_decay_samples for sample-based training, not lr_wsd_decay_iters"),
                     ("lr_warmup_samples", s.lr_warmup_fraction is None or s.lr_warmup_samples == 0,
                      "Can only specify one of lr_warmup_fraction or lr_warmup_samples"))
        else:
            rules = (("lr_decay_samples", s.lr_decay_samples is None,
                      "Use lr_decay_iters for iteration-based training, not lr_decay_samples"),
                     ("lr_warmup_samples", s.lr_warmup_samples == 0,
                      "Use lr_warmup_iters for iteration-based training, not lr_warmup_samples"),
                     ("lr_wsd_decay_samples", s.lr_wsd_decay_samples is None,
                      "Use lr_wsd_decay_iters for iteration-based training, not lr_wsd_decay_samples"),
                     ("lr_warmup_iters", s.lr_warmup_fraction is None or s.lr_warmup_iters == 0,
                      "Can only specify one of lr_warmup_fraction or lr_warmup_iters"))
        if train.train_samples is not None:
            rules += (("max_steps", s.max_steps is None, "scheduler.max_steps is only supported for iteration-based "
                                                         "training; use sample-based scheduler fields with train_samples"),)
        for name, holds, message in rules:
            _check(holds, f"scheduler.{name}", message)

    def calculate_steps(self, train: Any) -> None:
        """The scheduler's steps, in samples, from the iteration or the sample counts (Bridge's and
        Megatron's arithmetic): ``lr_decay_steps``, ``lr_warmup_steps``, ``wd_incr_steps``,
        ``wsd_decay_steps``. A run counted in samples and the same run counted in iterations
        (``train_samples = train_iters x global_batch_size``) get equal steps. ``max_steps`` (Bridge's, iterations
        only) stands for the full run's length: the schedule is that run's, of which this one trains the first
        ``train.train_iters`` steps."""
        s, t = self, train
        gbs = t.global_batch_size
        if t.train_samples is None:
            _check(s.max_steps is None or s.max_steps >= t.train_iters, "scheduler.max_steps",
                   f"scheduler.max_steps ({s.max_steps}) must be greater than or equal to train.train_iters "
                   f"({t.train_iters}).")
            full_run = s.max_steps if s.max_steps is not None else t.train_iters
            if s.lr_decay_iters is None:
                s.lr_decay_iters = full_run
            s.lr_decay_steps = s.lr_decay_iters * gbs
            s.wd_incr_steps = full_run * gbs
            s.wsd_decay_steps = s.lr_wsd_decay_iters * gbs if s.lr_wsd_decay_iters else None
            warmup = s.lr_warmup_iters * gbs
            key = "scheduler.lr_warmup_iters"
            decay_key = "lr_decay_iters (by default scheduler.max_steps, else train.train_iters)"
        else:
            if s.lr_decay_samples is None:
                s.lr_decay_samples = t.train_samples
            s.lr_decay_steps = s.lr_decay_samples
            s.wd_incr_steps = t.train_samples
            s.wsd_decay_steps = s.lr_wsd_decay_samples or None
            warmup = s.lr_warmup_samples
            key, decay_key = "scheduler.lr_warmup_samples", "lr_decay_samples (by default train.train_samples)"
        _check(s.lr_decay_steps > 0 or t.train_iters == 0,
               "scheduler.lr_decay_iters" if t.train_samples is None else "scheduler.lr_decay_samples",
               "must be > 0: the learning rate decays over it (lr_decay_steps must be > 0)")
        s.lr_warmup_steps = int(s.lr_warmup_fraction * s.lr_decay_steps) if s.lr_warmup_fraction is not None else warmup
        # megatron-core's scheduler asserts warm-up steps < decay steps, whatever the decay style.
        _check(s.lr_warmup_steps < max(s.lr_decay_steps, 1),
               "scheduler.lr_warmup_fraction" if s.lr_warmup_fraction is not None else key,
               f"gives {s.lr_warmup_steps} warm-up samples, which must be fewer than the "
               f"{max(s.lr_decay_steps, 1)} of {decay_key}")


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


#: The smallest hidden size at which the whole-step CUDA graph has run over Transformer Engine's layers
#: (benchmarks/te.py, one H200, 2026-12-02); the tiny GPT's (64) crashed there.
TE_GRAPH_MIN_HIDDEN = 1024


@dataclass
class GPTModelConfig(LowPrecisionFields, MoEFields):
    """A GPT built from megatron-core's ``GPTModel``; names follow megatron-core's TransformerConfig.

    Model parallelism (GPUs only; :mod:`bridge_hpc.training.engine.parallel`): ``tensor_model_parallel_size``
    splits each layer's matrices, ``sequence_parallel`` (with TP > 1) also splits the activations
    between them, ``pipeline_model_parallel_size`` splits the layers into stages (megatron-core's
    pipeline schedules), ``virtual_pipeline_model_parallel_size`` gives each stage that many
    interleaved chunks, and ``context_parallel_size`` splits the sequence (its attention needs
    Transformer Engine). The data-parallel size is what is left of the world.

    The architecture fields Hugging Face families need carry megatron-core's (and Megatron Bridge's
    providers') names: ``add_qkv_bias`` (Qwen2), ``qk_layernorm`` (Qwen3), ``rope_scaling`` with
    ``rope_scaling_factor`` (Llama 3.1's frequency scaling, megatron-core's RotaryEmbedding),
    ``activation_func = "openai_gelu"`` (GPT-2's tanh-approximated gelu, Megatron-LM's name).
    ``hf_config`` names the Hugging Face folder whose ``config.json`` filled this section on the login
    node (:mod:`bridge_hpc.training.hf.families`); the ranks read nothing from it but its weights, when
    ``checkpoint.pretrained_checkpoint`` names it too. Mixture-of-Experts (``num_moe_experts`` ...,
    ``expert_model_parallel_size``) and FP8/FP4 fields come from
    :class:`~bridge_hpc.training.engine.moe_config.MoEFields` and
    :class:`~bridge_hpc.training.engine.low_precision.LowPrecisionFields`.
    """

    hf_config: Optional[str] = None
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
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    activation_func: Literal["gelu", "openai_gelu", "silu", "swiglu"] = "gelu"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
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
    #: and backward as one CUDA graph (:mod:`bridge_hpc.training.engine.cuda_graphs`), captured after
    #: ``cuda_graph_warmup_steps`` eager steps, so the step no longer waits for one Python thread to
    #: launch its kernels. GPUs only; data parallelism only (no tensor, pipeline or context
    #: parallelism) and no ``ddp.overlap_param_gather``. ``"none"``: eager steps.
    cuda_graph_impl: Literal["none", "full_iteration"] = "none"
    cuda_graph_warmup_steps: int = 3
    #: The toolkit's kernels (:mod:`bridge_hpc.training.engine.fused_kernels`) for what Transformer Engine
    #: would fuse in the local layers: the output layer's cross entropy in Triton (one pass over the
    #: logits, no fp32 copy of them kept; it replaces megatron-core's, fused or not), every
    #: LayerNorm/RMSNorm in Triton, and the biases of the linear layers that add their own (the QKV
    #: projection's) inside the matrix multiply. Same parameters and checkpoints as without. GPUs only
    #: (CUDA builds of torch ship triton); hidden sizes up to ``FUSED_NORM_MAX_WIDTH``. On Transformer
    #: Engine's layers, which fuse their norms and biases themselves, the cross entropy only.
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
        _check(not self.rope_scaling or self.position_embedding_type == "rope", "model.rope_scaling",
               "scales rotary frequencies: needs model.position_embedding_type = \"rope\"")
        _check(self.max_position_embeddings >= self.seq_length, "model.max_position_embeddings",
               "must be >= model.seq_length")
        _check(0 <= self.hidden_dropout < 1, "model.hidden_dropout", "must be in [0, 1)")
        _check(0 <= self.attention_dropout < 1, "model.attention_dropout", "must be in [0, 1)")
        _check(not (self.bf16 and self.fp16), "model.fp16", "bf16 and fp16 are exclusive")
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            _check(isinstance(getattr(self, key), int) and getattr(self, key) >= 1, f"model.{key}", "must be an integer >= 1")
        if self.bias_activation_fusion:
            _check(self.activation_func not in ("silu", "openai_gelu"), "model.bias_activation_fusion",
                   f"fuses gelu or swiglu only (model.activation_func = \"{self.activation_func}\" has no fused kernel)")
            _check(self.activation_func != "gelu" or self.add_bias_linear, "model.bias_activation_fusion",
                   "with model.activation_func = \"gelu\" needs model.add_bias_linear = true (it fuses the bias)")
        if self.fused_kernels and self.transformer_impl == "local":  # (on TE's layers: the cross entropy only)
            _check(self.hidden_size <= FUSED_NORM_MAX_WIDTH, "model.fused_kernels",
                   f"normalizes rows of up to {FUSED_NORM_MAX_WIDTH} values, and model.hidden_size is {self.hidden_size}")
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        if self.full_iteration_cuda_graph:
            _check(isinstance(self.cuda_graph_warmup_steps, int) and self.cuda_graph_warmup_steps >= 1,
                   "model.cuda_graph_warmup_steps", "must be an integer >= 1: the eager steps before the capture "
                   f"compile the fused kernels, which a capture cannot do; got {self.cuda_graph_warmup_steps!r}")
            _check(self.transformer_impl == "local" or self.hidden_size >= TE_GRAPH_MIN_HIDDEN, "model.cuda_graph_impl",
                   f"\"full_iteration\" over Transformer Engine's layers runs from model.hidden_size "
                   f"{TE_GRAPH_MIN_HIDDEN} up (it ran at 1024-4096 and crashed with an illegal memory access at "
                   f"hidden size 64 on an H200); this model's is {self.hidden_size}")
            _check(not self.is_moe, "model.cuda_graph_impl",
                   "\"full_iteration\" cannot capture an MoE model's step: its dropless dispatch sizes the "
                   "experts' work on the host from each step's routing")
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
        self.check_low_precision()
        self.check_moe()
        self.check_moe_kernels(gpus=None)
        if self.is_moe:
            etp = self.expert_tensor_parallel_size or tp
            width = self.moe_ffn_hidden_size or self.ffn_hidden_size
            _check(width % etp == 0, "model.expert_tensor_parallel_size",
                   f"must divide the experts' width ({width}), got {etp}")

    @property
    def full_iteration_cuda_graph(self) -> bool:
        """Whether training steps replay one CUDA graph (``cuda_graph_impl = "full_iteration"``)."""
        return self.cuda_graph_impl == "full_iteration"

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold parts of one model replica (tensor x pipeline x context parallel)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


# ---------------------------------------------------------------------------------------------
# The default per-parameter rule (torch-free: it only walks the model's named parameters)
# ---------------------------------------------------------------------------------------------


def param_name(name: str) -> str:
    """A parameter's name as the model names it: without the data-parallel wrappers' ``module.``
    prefixes (torch DDP adds one, megatron's DDP around ``Float16Module`` two), so one TOML pattern
    means the same parameter on CPU and GPU."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def default_config_overrides(context: OptimizerConfigOverrideProviderContext) -> Optional[Dict[Any, Any]]:
    """Megatron Bridge's default rule (no weight decay for biases and 1-D parameters, except the q/k
    layernorms with ``optimizer.apply_wd_to_qk_layernorm`` or ``scheduler.no_weight_decay_cond_type =
    "qwen3_next"``; ``optimizer.decoupled_lr`` / ``decoupled_min_lr`` for the embedding and output layer,
    the parameters megatron-core marks ``is_embedding_or_output_parameter``) plus the
    ``[[optimizer.overrides]]`` tables, resolved per
    parameter name (later tables win) and handed to megatron-core as one ``ParamKey`` of exact names
    per distinct result, so megatron never has to combine overlapping keys (it refuses conflicting
    values). ``lr_mult`` becomes ``max_lr``/``min_lr`` (what megatron's scheduler reads) and stays in
    the group too: the distributed optimizer tells saved groups apart by ``(wd_mult, lr_mult, ...)``.

    Raises ConfigError naming ``optimizer.overrides[i].params`` when a table matches no parameter
    (a typo would otherwise change nothing, silently).
    """
    from megatron.core.optimizer import ParamKey

    o = context.optimizer_config
    # Bridge's scheduler switch and megatron-core's optimizer field say the same: q/k layernorms decay.
    decay_qk_norm = o.apply_wd_to_qk_layernorm or context.scheduler_config.no_weight_decay_cond_type == "qwen3_next"
    chunks = context.model if isinstance(context.model, (list, tuple)) else [context.model]
    names_by_override: Dict[tuple, List[str]] = {}
    matched = [False] * len(o.overrides)
    seen: List[str] = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            short = param_name(name)
            seen.append(short)
            override: Dict[str, float] = {}
            qk_norm = "q_layernorm." in short or "k_layernorm." in short
            if (name.endswith(".bias") or param.ndim == 1) and not (decay_qk_norm and qk_norm):
                override["wd_mult"] = 0.0
            if o.decoupled_lr is not None and getattr(param, "is_embedding_or_output_parameter", False):
                decoupled = {"max_lr": o.decoupled_lr}
                if o.decoupled_min_lr is not None:
                    decoupled["min_lr"] = o.decoupled_min_lr
                override.update(_resolved_settings(decoupled, o))
            for i, table in enumerate(o.overrides):
                if any(fnmatch.fnmatchcase(short, pattern) for pattern in table.params):
                    matched[i] = True
                    override.update(_resolved_settings(table.settings(), o))
            if override:
                names_by_override.setdefault(tuple(sorted(override.items())), []).append(name)
    for i, hit in enumerate(matched):
        if not hit:
            examples = ", ".join(seen[:3] + (["..."] if len(seen) > 3 else []))
            raise ConfigError(f"{o.overrides[i].params} match no parameter of the model (names look like: {examples})",
                              key=f"optimizer.overrides[{i}].params")
    return {ParamKey(name=tuple(names)): dict(items) for items, names in names_by_override.items()} or None


def _resolved_settings(settings: Dict[str, float], o: OptimizerConfig) -> Dict[str, float]:
    out = dict(settings)
    if "lr_mult" in out:
        out["max_lr"] = o.lr * out["lr_mult"]
        out["min_lr"] = o.min_lr * out["lr_mult"]
    elif "max_lr" in out:
        out["lr_mult"] = out["max_lr"] / o.lr
    return out


# ---------------------------------------------------------------------------------------------
# Distributed set-up and data-parallel wrapper
# ---------------------------------------------------------------------------------------------


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
    #: megatron-core DDP's ``align_grad_reduce`` (with pipeline parallelism: each stage launches its
    #: gradient reduce as it finishes, false: all stages at once).
    align_grad_reduce: bool = True
    #: The launcher's local rank (``$LOCAL_RANK``); the ranks take it from Slurm's variables.
    local_rank: int = field(default_factory=lambda: int(os.getenv("LOCAL_RANK", "0")))
    lazy_mpu_init: Optional[bool] = None
    use_megatron_fsdp: bool = False
    use_torch_fsdp2: bool = False
    #: megatron-core's NCCL communicator settings file (per-group CTAs), passed to initialize_model_parallel.
    nccl_communicator_config_path: Optional[str] = None
    #: Rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp.
    use_tp_pp_dp_mapping: bool = False
    #: megatron-core's gloo (CPU) copies of the data-parallel groups, which its distributed optimizer
    #: uses to gather state on save; false saves host memory and sockets.
    use_gloo_process_groups: bool = True
    use_sharp: bool = False
    sharp_enabled_group: Optional[Literal["dp", "dp_replica"]] = None
    high_priority_stream_groups: Optional[List[str]] = field(default_factory=list)
    #: After the first step, every process group's timeout becomes this many seconds (start-up, with
    #: its compilation and checkpoint load, keeps ``distributed_timeout_minutes``).
    distributed_timeout_seconds_after_init: Optional[int] = None
    #: torch's NCCL flight recorder: set, its trace of the last collectives is dumped here when a
    #: collective times out (TORCH_FR_DUMP_TEMP_FILE and friends, set before torch.distributed starts).
    flight_recorder_dump_path: Optional[str] = None
    flight_recorder_trace_buffer_size: int = 2000
    flight_recorder_dump_on_timeout: bool = True
    flight_recorder_include_stack_trace: bool = False
    flight_recorder_include_only_active: bool = True
    flight_recorder_extra_dump_on_exec: bool = True
    #: Turns off TorchScript's fuser (megatron's ``--disable-jit-fuser``).
    disable_jit_fuser: bool = False
    external_gpu_device_mapping: bool = False
    enable_megatron_core_experimental: bool = False
    use_decentralized_pg: bool = False

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
        check_left_at_default(self, "dist", {
            "use_megatron_fsdp": "bridge_hpc shards with megatron-core's distributed optimizer (ddp.use_distributed_optimizer), "
                                 "not FSDP",
            "use_torch_fsdp2": "bridge_hpc shards with megatron-core's distributed optimizer (ddp.use_distributed_optimizer), "
                               "not FSDP",
        })
        _check(self.local_rank >= 0, "dist.local_rank", "must be >= 0")
        _check(self.sharp_enabled_group is None or self.use_sharp, "dist.sharp_enabled_group", "needs dist.use_sharp = true")
        _check(self.distributed_timeout_seconds_after_init is None or self.distributed_timeout_seconds_after_init > 0,
               "dist.distributed_timeout_seconds_after_init", "must be > 0 (or unset)")
        _check(self.flight_recorder_trace_buffer_size >= 0, "dist.flight_recorder_trace_buffer_size", "must be >= 0")
        groups = ("dp", "dp_cp", "tp", "pp", "cp", "ep", "tp_cp", "mp", "embd", "pos_embd")
        for name in self.high_priority_stream_groups or []:
            _check(name in groups, "dist.high_priority_stream_groups",
                   f"unknown group {name!r}{did_you_mean(str(name), groups)}; known: {', '.join(groups)}")


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
    # megatron-core's remaining DDP fields, with its defaults; megatron-core's DDP acts on them on GPU
    # (like the fields above, torch DDP on CPU ignores them).
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: Optional[int] = None
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    delay_wgrad_compute: bool = False

    def finalize(self) -> None:
        fsdp = "bridge_hpc shards with megatron-core's distributed optimizer (ddp.use_distributed_optimizer), not FSDP"
        check_left_at_default(self, "ddp", {
            **{name: fsdp for name in ("use_megatron_fsdp", "use_custom_fsdp", "data_parallel_sharding_strategy",
                                       "suggested_communication_unit_size", "preserve_fp32_weights",
                                       "fsdp_double_buffer", "outer_dp_sharding_strategy",
                                       "fsdp_manual_registration", "nccl_ub", "disable_symmetric_registration")},
            "num_distributed_optimizer_instances": "one distributed-optimizer instance spans the data-parallel group "
                                                   "(megatron-core's partial distributed optimizer is not set up)",
            "delay_wgrad_compute": "needs Transformer Engine's split weight-gradient kernels",
        })
        _check(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "ddp.overlap_param_gather", "needs ddp.use_distributed_optimizer = true",
        )
        _check(not self.param_name_patterns_for_fp32_local_accumulation,
               "ddp.param_name_patterns_for_fp32_local_accumulation",
               "must be empty: megatron-core 0.19.2's DDP cannot accumulate chosen gradients in FP32 "
               "(ddp.grad_reduce_in_fp32 = true does it for all)")
