"""The ``[optimizer]``, ``[scheduler]``, ``[model]`` and ``[tensor_inspect]`` sections: torch-free dataclasses
with Megatron Bridge's field names, re-exported by :mod:`bridge_hpc.training.config` (Bridge's path for
them). They live beside the engine that reads them; the login node imports them without torch."""

from __future__ import annotations

import fnmatch
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import DeferredPostInit, build_dataclass
from bridge_hpc.contracts.schema import check as _check

logger = logging.getLogger(__name__)


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

    Model parallelism (GPUs only; :mod:`bridge_hpc.training.engine.parallel`): ``tensor_model_parallel_size``
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
    """Megatron Bridge's default rule plus the ``[[optimizer.overrides]]`` tables, resolved per
    parameter name (later tables win) and handed to megatron-core as one ``ParamKey`` of exact names
    per distinct result, so megatron never has to combine overlapping keys (it refuses conflicting
    values). ``lr_mult`` becomes ``max_lr``/``min_lr`` (what megatron's scheduler reads) and stays in
    the group too: the distributed optimizer tells saved groups apart by ``(wd_mult, lr_mult, ...)``.

    Raises ConfigError naming ``optimizer.overrides[i].params`` when a table matches no parameter
    (a typo would otherwise change nothing, silently).
    """
    from megatron.core.optimizer import ParamKey

    o = context.optimizer_config
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
            if name.endswith(".bias") or param.ndim == 1:
                override["wd_mult"] = 0.0
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
