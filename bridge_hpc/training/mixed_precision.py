"""Megatron Bridge's ``MixedPrecisionConfig`` and its named recipes, mapped onto this toolkit's precision settings.

This toolkit sets precision with ``model.bf16`` / ``model.fp16`` (megatron-core's Float16Module wraps
the model), ``optimizer.bf16`` / ``optimizer.fp16`` (megatron-core's mixed-precision optimizer keeps
fp32 main parameters) and ``ddp.grad_reduce_in_fp32``; there is no ``[mixed_precision]`` section.
A Bridge user's ``MixedPrecisionConfig`` (or a recipe name such as ``"bf16_mixed"``) is turned into
those settings by :meth:`MixedPrecisionConfig.setup`, Bridge's method: it writes every field that the
target section has, which here is ``bf16``, ``fp16`` and ``grad_reduce_in_fp32``.

FP8 and FP4 (``fp8``, ``fp8_recipe``, ``fp8_margin``, ``fp8_amax_*``, ``fp8_param``,
``first_last_layers_bf16``, ``num_layers_at_start_in_bf16`` ...) are written into ``[model]``'s fields of
the same names (:mod:`bridge_hpc.training.engine.low_precision`), ``fp8_param_gather`` into ``[ddp]``; they
run on Transformer Engine's layers only, on a card that has the recipe (MXFP8 and NVFP4: Blackwell), and
:meth:`MixedPrecisionConfig.setup` says so naming the ``mixed_precision`` key. Bridge's FP8 recipes
(``bf16_with_fp8_delayed_scaling_mixed`` ...) are here with Bridge's values.

What is accepted but can only have its default: autocast, a pipeline dtype other than the parameters',
a ``params_dtype`` other than the one ``bf16``/``fp16`` imply, fixed or tuned loss scaling
(megatron-core's dynamic scaler runs with its defaults) and FP4 weights. :meth:`finalize` names the
first such field that is set, as a ConfigError, rather than training at a precision the user did not
ask for. dtypes are written as strings (``"bfloat16"``, ``"float16"``, ``"float32"``) or torch dtypes,
so this module imports without torch.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Union

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.engine.low_precision import check_values

logger = logging.getLogger(__name__)

#: dtype spellings -> canonical name (torch dtypes are compared by their ``str()``: "torch.bfloat16").
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16",
           "float32": "float32", "fp32": "float32", "float": "float32", "torch.float32": "float32"}

#: Fields with no effect here, and the value each must keep (Bridge's default).
_UNSUPPORTED_DEFAULTS: Dict[str, Any] = {
    "autocast_dtype": None, "autocast_enabled": False, "fp4_param": None, "fp4_param_gather": False,
    "loss_scale": None, "initial_loss_scale": 4294967296, "min_loss_scale": 1.0, "loss_scale_window": 1000,
    "hysteresis": 2,
}
_LOSS_SCALER = "megatron-core's dynamic loss scaler runs with its defaults (fp16)"
_WHY_UNSUPPORTED = {
    "autocast_dtype": "the model runs in its parameter dtype (no torch autocast)",
    "autocast_enabled": "the model runs in its parameter dtype (no torch autocast)",
    "fp4_param": "FP4 weights are not supported for now (as in Bridge)",
    "fp4_param_gather": "FP4 weights are not supported for now (as in Bridge)",
    **{name: _LOSS_SCALER for name in ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                                       "hysteresis")},
}


def _dtype_name(value: Any, key: str = "mixed_precision.params_dtype") -> Optional[str]:
    if value is None:
        return None
    name = _DTYPES.get(str(value))
    if name is None:
        raise ConfigError(f"unknown dtype {value!r}; expected bfloat16, float16 or float32", key=key)
    return name


@dataclass(kw_only=True)
class MixedPrecisionConfig:
    """Bridge's fields and defaults; only ``fp32``/``fp16``/``bf16``, ``params_dtype`` (consistent with
    them) and ``grad_reduce_in_fp32`` may differ from the defaults here (see the module docstring)."""

    fp32: bool = False
    fp16: bool = False
    bf16: bool = False
    params_dtype: Optional[Any] = None
    pipeline_dtype: Optional[Any] = None
    autocast_dtype: Optional[Any] = None
    autocast_enabled: bool = False
    grad_reduce_in_fp32: bool = True
    fp8: Optional[str] = None
    fp8_recipe: str = "tensorwise"
    first_last_layers_bf16: bool = False
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    fp8_dot_product_attention: bool = False
    fp8_multi_head_attention: bool = False
    fp8_param: Optional[bool] = None
    fp8_param_gather: bool = False
    fp4: Optional[str] = None
    fp4_recipe: str = "nvfp4"
    fp4_param: Optional[bool] = None
    fp4_param_gather: bool = False
    loss_scale: Optional[float] = None
    initial_loss_scale: Optional[float] = 4294967296
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    num_layers_at_start_in_bf16: int = 0
    num_layers_at_end_in_bf16: int = 0
    reuse_grad_buf_for_mxfp8_param_ag: bool = False

    def __setattr__(self, name: str, value: Any) -> None:
        # Bridge's: fp8_param and fp8_param_gather are one setting under two names, kept equal.
        object.__setattr__(self, name, value)
        twin = {"fp8_param_gather": "fp8_param", "fp8_param": "fp8_param_gather"}.get(name)
        if twin is not None and hasattr(self, twin) and getattr(self, twin) != value:
            object.__setattr__(self, twin, value)

    def finalize(self) -> None:
        """Check that the settings are ones this toolkit can run; raises ConfigError naming the key."""
        if self.fp8_param is None:
            self.fp8_param = self.fp8_param_gather
        for name, default in _UNSUPPORTED_DEFAULTS.items():
            if getattr(self, name) != default:
                raise ConfigError(f"{getattr(self, name)!r} is not supported by bridge_hpc ({_WHY_UNSUPPORTED[name]}); "
                                  f"leave it at {default!r}", key=f"mixed_precision.{name}")
        check_values(self, "mixed_precision")
        if self.fp4 and self.fp8:
            raise ConfigError("fp4 and fp8 cannot be used simultaneously: choose one", key="mixed_precision.fp4")
        if self.fp8_param_gather and self.fp8_recipe == "mxfp8" and not self.reuse_grad_buf_for_mxfp8_param_ag:
            raise ConfigError("must be true when fp8_param_gather = true and fp8_recipe = \"mxfp8\" (as in Bridge)",
                              key="mixed_precision.reuse_grad_buf_for_mxfp8_param_ag")
        if sum((self.fp32, self.fp16, self.bf16)) > 1:
            raise ConfigError("fp32, fp16 and bf16 are exclusive", key="mixed_precision.bf16")
        implied = "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"
        for name in ("params_dtype", "pipeline_dtype"):
            given = _dtype_name(getattr(self, name), f"mixed_precision.{name}")
            if given is not None and given != implied:
                raise ConfigError(f"{getattr(self, name)!r} disagrees with bf16={self.bf16}, fp16={self.fp16} (which "
                                  f"mean {implied}); parameters are kept, and sent between pipeline stages, in the "
                                  "dtype those select", key=f"mixed_precision.{name}")

    def setup(self, model_config: Any, optimizer_config: Optional[Any] = None, ddp_config: Optional[Any] = None) -> None:
        """Write the precision into the model, optimizer and DDP sections (Bridge's method): every
        field of this config that the section also has: ``bf16``, ``fp16`` and the FP8/FP4 fields
        (model), ``bf16``, ``fp16``, ``fp8_recipe`` (optimizer), ``grad_reduce_in_fp32`` and
        ``fp8_param_gather`` (ddp). Finalizes first; then checks the FP8/FP4 settings against the
        model's layers, naming the ``mixed_precision`` key."""
        self.finalize()
        if hasattr(model_config, "check_low_precision"):  # on a copy first: nothing is half-applied
            update_config_with_precision_overrides(self, copy.copy(model_config)).check_low_precision("mixed_precision")
        for section in (model_config, optimizer_config, ddp_config):
            if section is not None:
                update_config_with_precision_overrides(self, section)


def update_config_with_precision_overrides(mixed_precision_config: MixedPrecisionConfig, config: Any) -> Any:
    """Copy every field of ``mixed_precision_config`` that ``config`` has into it (Bridge's function);
    returns ``config``. Fields the section lacks are skipped, as in Bridge."""
    names = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set(vars(config))
    for f in dataclasses.fields(mixed_precision_config):
        if f.name not in names:
            continue
        old, new = getattr(config, f.name), getattr(mixed_precision_config, f.name)
        if old != new:
            setattr(config, f.name, new)
            logger.debug("overwrote %s.%s: %r -> %r", type(config).__name__, f.name, old, new)
    return config


def bf16_mixed() -> MixedPrecisionConfig:
    """BF16 parameters and activations, fp32 main parameters and gradient reduction (Bridge's recipe)."""
    return MixedPrecisionConfig(bf16=True, params_dtype="bfloat16", pipeline_dtype="bfloat16",
                                autocast_enabled=False, grad_reduce_in_fp32=True)


def fp16_mixed() -> MixedPrecisionConfig:
    """FP16 with dynamic loss scaling, gradients reduced in fp16 (Bridge's recipe)."""
    return MixedPrecisionConfig(fp16=True, params_dtype="float16", pipeline_dtype="float16",
                                autocast_enabled=False, grad_reduce_in_fp32=False)


def _with_fp8(base: Callable[[], MixedPrecisionConfig], **fields: Any) -> MixedPrecisionConfig:
    cfg = base()
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


#: Bridge's FP8 recipes: (delayed scaling, current per-tensor scaling, MXFP8, 128x128 blocks), each on BF16 or FP16.
_DELAYED = dict(fp8="hybrid", fp8_recipe="delayed", fp8_margin=0, fp8_amax_history_len=1024,
                fp8_amax_compute_algo="max", fp8_param_gather=True)
_CURRENT = dict(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                num_layers_at_end_in_bf16=1, fp8_param_gather=True)
_MXFP8 = dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True)
_SUBCHANNEL = dict(fp8="hybrid", fp8_recipe="blockwise", fp8_param_gather=False)


def bf16_with_fp8_delayed_scaling_mixed() -> MixedPrecisionConfig:
    """BF16 with FP8, delayed scaling from a 1024-step amax history (Bridge's recipe)."""
    return _with_fp8(bf16_mixed, **_DELAYED)


def fp16_with_fp8_delayed_scaling_mixed() -> MixedPrecisionConfig:
    """FP16 with FP8, delayed scaling (Bridge's recipe)."""
    return _with_fp8(fp16_mixed, **_DELAYED)


def bf16_with_mxfp8_mixed() -> MixedPrecisionConfig:
    """BF16 with MXFP8, Blackwell only (Bridge's recipe)."""
    return _with_fp8(bf16_mixed, **_MXFP8)


def fp16_with_mxfp8_mixed() -> MixedPrecisionConfig:
    """FP16 with MXFP8, Blackwell only (Bridge's recipe)."""
    return _with_fp8(fp16_mixed, **_MXFP8)


def bf16_with_fp8_current_scaling_mixed() -> MixedPrecisionConfig:
    """BF16 with FP8 per-tensor current scaling, first and last layer in BF16 (Bridge's recipe)."""
    return _with_fp8(bf16_mixed, **_CURRENT)


def nemotron_h_bf16_with_fp8_current_scaling_mixed() -> MixedPrecisionConfig:
    """BF16 with FP8 current scaling, two layers at each end in BF16 (Bridge's recipe)."""
    return _with_fp8(bf16_mixed, **dict(_CURRENT, num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=2))


def nanov2_bf16_with_fp8_current_scaling_mixed() -> MixedPrecisionConfig:
    """BF16 with FP8 blockwise scaling, two layers at each end in BF16 (Bridge's recipe, named so there)."""
    return _with_fp8(bf16_mixed, **dict(_CURRENT, fp8_recipe="blockwise", num_layers_at_start_in_bf16=2,
                                        num_layers_at_end_in_bf16=2))


def fp16_with_fp8_current_scaling_mixed() -> MixedPrecisionConfig:
    """FP16 with FP8 per-tensor current scaling (Bridge's recipe)."""
    return _with_fp8(fp16_mixed, **_CURRENT)


def bf16_with_fp8_subchannel_scaling_mixed() -> MixedPrecisionConfig:
    """BF16 with FP8 in 128x128 weight and 1x128 activation blocks (Bridge's recipe)."""
    return _with_fp8(bf16_mixed, **_SUBCHANNEL)


def fp16_with_fp8_subchannel_scaling_mixed() -> MixedPrecisionConfig:
    """FP16 with FP8 in 128x128 weight and 1x128 activation blocks (Bridge's recipe)."""
    return _with_fp8(fp16_mixed, **_SUBCHANNEL)


#: Recipe name -> factory, Bridge's set; both the underscore and the hyphen spelling are accepted, as in Bridge.
MIXED_PRECISION_RECIPES: Dict[str, Callable[[], MixedPrecisionConfig]] = {}
for _factory in (bf16_mixed, fp16_mixed, bf16_with_fp8_delayed_scaling_mixed, fp16_with_fp8_delayed_scaling_mixed,
                 bf16_with_mxfp8_mixed, fp16_with_mxfp8_mixed, bf16_with_fp8_current_scaling_mixed,
                 nemotron_h_bf16_with_fp8_current_scaling_mixed, nanov2_bf16_with_fp8_current_scaling_mixed,
                 fp16_with_fp8_current_scaling_mixed, bf16_with_fp8_subchannel_scaling_mixed,
                 fp16_with_fp8_subchannel_scaling_mixed):
    MIXED_PRECISION_RECIPES[_factory.__name__] = MIXED_PRECISION_RECIPES[_factory.__name__.replace("_", "-")] = _factory


def runs_in_bf16(model: Any, mixed_precision: Optional[Union[str, MixedPrecisionConfig]]) -> bool:
    """Whether the ranks will run ``model`` in bf16: ``[mixed_precision]``'s ``bf16`` where the section is
    set (the ranks write all its precision fields into the model before the build), else the model's own;
    read before that is applied (the login node's checks)."""
    if mixed_precision is not None:  # its setup writes every precision field into the model, bf16 = false too
        return bool(get_mixed_precision_config(mixed_precision).bf16)
    return bool(getattr(model, "bf16", False))


def get_mixed_precision_config(name: Union[str, MixedPrecisionConfig]) -> MixedPrecisionConfig:
    """The config for a recipe name (``"bf16_mixed"``, ``"bf16-mixed"``, ``"fp16_mixed"``), or ``name``
    itself when it is a config already. ConfigError naming the known recipes otherwise."""
    if isinstance(name, MixedPrecisionConfig):
        return name
    key = name.replace("-", "_")
    if key not in MIXED_PRECISION_RECIPES:
        known = ", ".join(n for n in MIXED_PRECISION_RECIPES if "-" not in n)
        raise ConfigError(f"unknown mixed-precision recipe {name!r}; expected one of {known}", key="mixed_precision")
    return MIXED_PRECISION_RECIPES[key]()


def recipe_fields(name: str) -> Dict[str, Any]:
    """The fields a recipe sets that differ from the defaults, as a ``[mixed_precision]`` table (what
    a job file's ``mixed_precision = "bf16_mixed"`` becomes in resolved.toml)."""
    config, default = get_mixed_precision_config(name), MixedPrecisionConfig()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(default, f.name)}
