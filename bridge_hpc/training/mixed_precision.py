"""Megatron Bridge's ``MixedPrecisionConfig`` and its named recipes, mapped onto this toolkit's precision settings.

This toolkit sets precision with ``model.bf16`` / ``model.fp16`` (megatron-core's Float16Module wraps
the model), ``optimizer.bf16`` / ``optimizer.fp16`` (megatron-core's mixed-precision optimizer keeps
fp32 main parameters) and ``ddp.grad_reduce_in_fp32``; there is no ``[mixed_precision]`` section.
A Bridge user's ``MixedPrecisionConfig`` (or a recipe name such as ``"bf16_mixed"``) is turned into
those settings by :meth:`MixedPrecisionConfig.setup`, Bridge's method: it writes every field that the
target section has, which here is ``bf16``, ``fp16`` and ``grad_reduce_in_fp32``.

What is accepted but can only have its default: FP8/FP4 (they need Transformer Engine's FP8 kernels,
which this trainer does not build with), autocast, a pipeline dtype (pipeline size is 1), a
``params_dtype`` other than the one ``bf16``/``fp16`` imply, fixed or tuned loss scaling (megatron-core's
dynamic scaler runs with its defaults), and BF16 first/last layers. :meth:`finalize` names the first
such field that is set, as a ConfigError, rather than training at a precision the user did not ask
for. dtypes are written as strings (``"bfloat16"``, ``"float16"``, ``"float32"``) or torch dtypes, so
this module imports without torch.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Union

from bridge_hpc.contracts.errors import ConfigError

logger = logging.getLogger(__name__)

#: dtype spellings -> canonical name (torch dtypes are compared by their ``str()``: "torch.bfloat16").
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16",
           "float32": "float32", "fp32": "float32", "float": "float32", "torch.float32": "float32"}

#: Fields with no effect here, and the value each must keep (Bridge's default).
_UNSUPPORTED_DEFAULTS: Dict[str, Any] = {
    "pipeline_dtype": None, "autocast_dtype": None, "autocast_enabled": False,
    "fp8": None, "fp8_param": None, "fp8_param_gather": False, "fp4": None, "fp4_param": None,
    "fp4_param_gather": False, "first_last_layers_bf16": False, "num_layers_at_start_in_bf16": 0,
    "num_layers_at_end_in_bf16": 0, "reuse_grad_buf_for_mxfp8_param_ag": False, "loss_scale": None,
    "initial_loss_scale": 4294967296, "min_loss_scale": 1.0, "loss_scale_window": 1000, "hysteresis": 2,
}
_WHY_UNSUPPORTED = {
    "pipeline_dtype": "the pipeline-parallel size is 1 (nothing is sent between stages)",
    "autocast_dtype": "the model runs in its parameter dtype (no torch autocast)",
    "autocast_enabled": "the model runs in its parameter dtype (no torch autocast)",
    "loss_scale": "megatron-core's dynamic loss scaler runs with its defaults (fp16)",
    "initial_loss_scale": "megatron-core's dynamic loss scaler runs with its defaults (fp16)",
    "min_loss_scale": "megatron-core's dynamic loss scaler runs with its defaults (fp16)",
    "loss_scale_window": "megatron-core's dynamic loss scaler runs with its defaults (fp16)",
    "hysteresis": "megatron-core's dynamic loss scaler runs with its defaults (fp16)",
}


def _dtype_name(value: Any) -> Optional[str]:
    if value is None:
        return None
    name = _DTYPES.get(str(value))
    if name is None:
        raise ConfigError(f"unknown dtype {value!r}; expected bfloat16, float16 or float32",
                          key="mixed_precision.params_dtype")
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

    def finalize(self) -> None:
        """Check that the settings are ones this toolkit can run; raises ConfigError naming the key."""
        for name, default in _UNSUPPORTED_DEFAULTS.items():
            if getattr(self, name) != default:
                why = _WHY_UNSUPPORTED.get(name, "FP8/FP4 need Transformer Engine's low-precision kernels, which "
                                                 "this trainer does not use")
                raise ConfigError(f"{getattr(self, name)!r} is not supported by bridge_hpc ({why}); leave it at "
                                  f"{default!r}", key=f"mixed_precision.{name}")
        if sum((self.fp32, self.fp16, self.bf16)) > 1:
            raise ConfigError("fp32, fp16 and bf16 are exclusive", key="mixed_precision.bf16")
        implied = "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"
        given = _dtype_name(self.params_dtype)
        if given is not None and given != implied:
            raise ConfigError(f"{self.params_dtype!r} disagrees with bf16={self.bf16}, fp16={self.fp16} (which "
                              f"mean {implied}); parameters are kept in the dtype those select",
                              key="mixed_precision.params_dtype")

    def setup(self, model_config: Any, optimizer_config: Optional[Any] = None, ddp_config: Optional[Any] = None) -> None:
        """Write the precision into the model, optimizer and DDP sections (Bridge's method): every
        field of this config that the section also has. Here that is ``bf16`` and ``fp16`` (model,
        optimizer) and ``grad_reduce_in_fp32`` (ddp). Finalizes first."""
        self.finalize()
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
    return MixedPrecisionConfig(bf16=True, params_dtype="bfloat16", grad_reduce_in_fp32=True)


def fp16_mixed() -> MixedPrecisionConfig:
    """FP16 with dynamic loss scaling, gradients reduced in fp16 (Bridge's recipe)."""
    return MixedPrecisionConfig(fp16=True, params_dtype="float16", grad_reduce_in_fp32=False)


#: Recipe name -> factory. Bridge's FP8/FP4 recipes are not here (see the module docstring); both the
#: underscore and the hyphen spelling are accepted, as in Bridge.
MIXED_PRECISION_RECIPES: Dict[str, Callable[[], MixedPrecisionConfig]] = {"bf16_mixed": bf16_mixed,
                                                                          "fp16_mixed": fp16_mixed}


def get_mixed_precision_config(name: Union[str, MixedPrecisionConfig]) -> MixedPrecisionConfig:
    """The config for a recipe name (``"bf16_mixed"``, ``"bf16-mixed"``, ``"fp16_mixed"``), or ``name``
    itself when it is a config already. ConfigError naming the known recipes otherwise."""
    if isinstance(name, MixedPrecisionConfig):
        return name
    key = name.replace("-", "_")
    if key not in MIXED_PRECISION_RECIPES:
        raise ConfigError(f"unknown mixed-precision recipe {name!r}; bridge_hpc has {', '.join(MIXED_PRECISION_RECIPES)}"
                          " (Bridge's FP8/FP4 recipes need Transformer Engine's low-precision kernels)",
                          key="mixed_precision")
    return MIXED_PRECISION_RECIPES[key]()


def recipe_fields(name: str) -> Dict[str, Any]:
    """The fields a recipe sets that differ from the defaults, as a ``[mixed_precision]`` table (what
    a job file's ``mixed_precision = "bf16_mixed"`` becomes in resolved.toml)."""
    config, default = get_mixed_precision_config(name), MixedPrecisionConfig()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(default, f.name)}
