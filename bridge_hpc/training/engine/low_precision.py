"""FP8 and FP4 on Transformer Engine's layers: the ``[model]`` fields and what each card can run.

megatron-core reads FP8/FP4 from its ``TransformerConfig`` (``fp8``, ``fp8_recipe``, ``fp8_margin``,
``fp8_amax_history_len`` ...) and runs it only inside Transformer Engine's layers, which quantize their
matrix multiplies and keep the scales and amax history in each module's ``_extra_state`` (so they are in
every checkpoint). :class:`LowPrecisionFields` holds those fields with megatron-core's names and
defaults; :class:`~bridge_hpc.training.engine.config.GPTModelConfig` inherits them, so they reach
megatron-core by name like every other model field. Bridge's ``[mixed_precision]`` writes them
(:meth:`bridge_hpc.training.mixed_precision.MixedPrecisionConfig.setup`).

Which card runs which recipe is defined once here (:data:`RECIPE_MIN_CAPABILITY`) and asked twice:
on the login node from the cluster profile's ``cluster.gpu_model`` (:data:`GPU_CAPABILITY`), and on
each rank from the card itself (``torch.cuda.get_device_capability``). Torch-free.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal, Optional, Tuple

from bridge_hpc.contracts.errors import ConfigError

#: The layer implementation that runs FP8/FP4, sequence and context parallelism.
TE = "transformer_engine"

#: FP8 recipe -> the lowest compute capability that runs it (Transformer Engine 2.x): per-tensor
#: delayed and current scaling from Ada/Hopper (8.9), 128x128 / 1x128 blocks (``blockwise``) from Hopper
#: (9.0), MXFP8 and NVFP4 only from Blackwell (10.0).
RECIPE_MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
FP4_MIN_CAPABILITY = {"nvfp4": (10, 0)}

#: ``cluster.gpu_model`` -> compute capability, so that bridge-submit can refuse what the card cannot run.
GPU_CAPABILITY = {"V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "A40": (8, 6), "A10": (8, 6), "L4": (8, 9),
                  "L40": (8, 9), "L40S": (8, 9), "H100": (9, 0), "H200": (9, 0), "H20": (9, 0), "GH200": (9, 0),
                  "B200": (10, 0), "B300": (10, 3), "GB200": (10, 0), "GB300": (10, 3)}

_FAMILY = {(7, 0): "Volta", (7, 5): "Turing", (8, 0): "Ampere", (8, 6): "Ampere", (8, 9): "Ada",
           (9, 0): "Hopper", (10, 0): "Blackwell", (10, 3): "Blackwell"}


#: The values a field may take (megatron-core's), checked where a Python config or Bridge's
#: ``[mixed_precision]`` sets them (a job file's ``[model]`` is type-checked by its Literal types too).
ALLOWED = {"fp8": (None, "e4m3", "hybrid"), "fp8_recipe": tuple(RECIPE_MIN_CAPABILITY),
           "fp8_amax_compute_algo": ("most_recent", "max"), "fp4": (None, "e2m1"), "fp4_recipe": tuple(FP4_MIN_CAPABILITY)}


def check_values(section: Any, prefix: str) -> None:
    """Each of :data:`ALLOWED`'s fields of ``section`` has one of its values; ConfigError naming
    ``prefix.<field>`` otherwise."""
    for name, allowed in ALLOWED.items():
        value = getattr(section, name, None)
        if value not in allowed:
            raise ConfigError(f"expected one of {', '.join(repr(a) for a in allowed)}, got {value!r}",
                              key=f"{prefix}.{name}")


@dataclass
class LowPrecisionFields:
    """megatron-core's FP8/FP4 fields of ``TransformerConfig``, its names and defaults.

    ``fp8``: ``"e4m3"`` everywhere or ``"hybrid"`` (e4m3 forward, e5m2 gradients); ``fp8_recipe``: how
    scales are found: ``"delayed"`` (from an amax history of ``fp8_amax_history_len`` steps, reduced by
    ``fp8_amax_compute_algo``), ``"tensorwise"`` (current scaling), ``"blockwise"``, ``"mxfp8"``.
    ``fp8_param``: keep the weights themselves in FP8 (with ``ddp.fp8_param_gather``).
    ``first_last_layers_bf16`` keeps ``num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16`` layers
    out of FP8. ``fp4`` with ``fp4_recipe = "nvfp4"``: Blackwell only.
    """

    fp8: Optional[Literal["e4m3", "hybrid"]] = None
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    fp8_param: bool = False
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    fp8_wgrad: bool = True
    fp8_dot_product_attention: bool = False
    fp8_multi_head_attention: bool = False
    tp_only_amax_red: bool = False
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    fp4: Optional[Literal["e2m1"]] = None
    fp4_recipe: Literal["nvfp4"] = "nvfp4"
    fp4_param: bool = False

    @property
    def low_precision(self) -> Optional[str]:
        """``"fp8"`` or ``"fp4"`` when the model runs in one, else None."""
        return "fp8" if self.fp8 else "fp4" if self.fp4 else None

    def check_low_precision(self, prefix: str = "model") -> None:
        """The fields on their own and against the layers: raises ConfigError naming ``prefix.<field>``
        (``mixed_precision`` when Bridge's section wrote them)."""
        check_values(self, prefix)
        if not self.low_precision:
            return
        if self.fp8 and self.fp4:
            raise ConfigError("fp8 and fp4 are exclusive: choose one", key=f"{prefix}.fp4")
        if self.fp4_param:
            raise ConfigError("FP4 weights are not supported by megatron-core's optimizer; leave it false",
                              key=f"{prefix}.fp4_param")
        layers = getattr(self, "transformer_impl", TE)
        if layers != TE:
            raise ConfigError(f"{self.low_precision.upper()} runs in Transformer Engine's layers only: set "
                              f"model.transformer_impl = \"{TE}\" (it is \"{layers}\")", key=f"{prefix}.{self.low_precision}")
        for name in ("fp8_margin",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"must be an integer >= 0, got {getattr(self, name)!r}", key=f"{prefix}.{name}")
        if not isinstance(self.fp8_amax_history_len, int) or self.fp8_amax_history_len < 1:
            raise ConfigError(f"must be an integer >= 1, got {self.fp8_amax_history_len!r}",
                              key=f"{prefix}.fp8_amax_history_len")
        if self.first_last_layers_bf16:
            layers_n = getattr(self, "num_layers", None)
            for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 0:
                    raise ConfigError(f"must be an integer >= 0, got {value!r}", key=f"{prefix}.{name}")
            both = self.num_layers_at_start_in_bf16 + self.num_layers_at_end_in_bf16
            if layers_n is not None and both >= layers_n:
                raise ConfigError(f"num_layers_at_start_in_bf16 + num_layers_at_end_in_bf16 ({both}) leaves none of "
                                  f"model.num_layers ({layers_n}) in {self.low_precision.upper()}",
                                  key=f"{prefix}.num_layers_at_end_in_bf16")

    def card_refusal(self, capability: Tuple[int, int], card: str, prefix: str = "model") -> Optional[ConfigError]:
        """What a card of ``capability`` (named ``card``) cannot run of these settings, or None."""
        if self.fp8:
            key, need = f"{prefix}.fp8_recipe", RECIPE_MIN_CAPABILITY[self.fp8_recipe]
            if need <= (8, 9):
                key = f"{prefix}.fp8"
            what = f"FP8 recipe \"{self.fp8_recipe}\""
        elif self.fp4:
            key, need, what = f"{prefix}.fp4_recipe", FP4_MIN_CAPABILITY[self.fp4_recipe], f"FP4 recipe \"{self.fp4_recipe}\""
        else:
            return None
        if tuple(capability) >= need:
            return None
        have = f"{card} ({_family(capability)}, compute capability {capability[0]}.{capability[1]})"
        return ConfigError(f"{what} needs a GPU of the {_family(need)} generation or newer (compute capability "
                           f"{need[0]}.{need[1]}); the job's GPUs are {have}", key=key)


def _family(capability: Tuple[int, int]) -> str:
    return _FAMILY.get(tuple(capability), f"sm_{capability[0]}{capability[1]}")


def gpu_model_capability(name: Any) -> Tuple[int, int]:
    """The compute capability of a ``cluster.gpu_model``; ConfigError naming the key for an unknown name."""
    if not isinstance(name, str) or name.upper() not in GPU_CAPABILITY:
        raise ConfigError(f"unknown GPU model {name!r}; expected one of {', '.join(GPU_CAPABILITY)} (or leave it "
                          "out: the ranks then check their own card)", key="cluster.gpu_model")
    return GPU_CAPABILITY[name.upper()]


def key_of(cfg: Any, name: str) -> str:
    """The dotted key a user wrote an FP8/FP4 field under: ``mixed_precision.<name>`` when Bridge's
    section set it, else ``model.<name>``."""
    mp = getattr(cfg, "mixed_precision", None)
    if mp is not None and not isinstance(mp, str) and getattr(mp, name, None):
        return f"mixed_precision.{name}"
    return f"model.{name}"


def check_container(cfg: Any, gpus: Optional[bool] = None) -> None:
    """Cross-section checks of a finalized ConfigContainer: FP8 weights (``ddp.fp8_param_gather``) need
    FP8 and megatron-core's distributed optimizer, whose shards they are gathered from; the MXFP8 buffer
    reuse needs MXFP8; with ``gpus`` False (a job that asks for no GPUs) FP8/FP4 are refused outright."""
    m, ddp = cfg.model, cfg.ddp
    if gpus is False and m.low_precision:
        raise ConfigError(f"is 0, and {key_of(cfg, m.low_precision)} asks for {m.low_precision.upper()}, which runs on "
                          "GPUs with Transformer Engine: ask for GPUs, or leave FP8 out", key="slurm.gpus_per_node")
    gather = "mixed_precision.fp8_param_gather" if key_of(cfg, "fp8_param_gather").startswith("mixed") \
        else "ddp.fp8_param_gather"
    if ddp.fp8_param_gather or m.fp8_param:
        if not m.fp8:
            raise ConfigError("keeps FP8 weights, which needs FP8 (mixed_precision.fp8 or model.fp8)", key=gather)
        if not ddp.use_distributed_optimizer:
            raise ConfigError("FP8 weights are gathered from megatron-core's distributed optimizer: set "
                              "ddp.use_distributed_optimizer = true, or fp8_param_gather = false", key=gather)
    if ddp.reuse_grad_buf_for_mxfp8_param_ag and m.fp8_recipe != "mxfp8":
        raise ConfigError(f"reuses the gradient buffer for MXFP8 weights: needs fp8_recipe = \"mxfp8\" (it is "
                          f"\"{m.fp8_recipe}\")", key="ddp.reuse_grad_buf_for_mxfp8_param_ag")
    if ddp.keep_fp8_transpose_cache and not (ddp.fp8_param_gather or m.fp8_param):
        raise ConfigError("caches the transposes of FP8 weights: needs fp8_param_gather = true",
                          key="ddp.keep_fp8_transpose_cache")


def precision_overridden(cfg: Any) -> Optional[str]:
    """The precision a ``[mixed_precision]`` table takes away, said before the queue, or None.

    Bridge's rule: the section writes *every* precision field it shares with the model
    (:meth:`~bridge_hpc.training.mixed_precision.MixedPrecisionConfig.setup`), its ``bf16`` and ``fp16``
    included, which default to false. So a table that sets FP8 alone (``fp8 = "hybrid"``) turns a
    ``model.bf16 = true`` job to fp32, where FP8 runs beside fp32 attention (found so on an H200: the
    FP8 steps took 8x the bf16 ones). A recipe name or a table that says ``bf16`` keeps what it says."""
    mp, m = getattr(cfg, "mixed_precision", None), cfg.model
    if mp is None or isinstance(mp, str) or not (m.bf16 or m.fp16) or mp.bf16 or mp.fp16:
        return None
    was = "model.bf16" if m.bf16 else "model.fp16"
    with_fp8 = " with FP8 matrix multiplies" if getattr(mp, "fp8", None) else ""
    return (f"[mixed_precision] sets bf16 and fp16 false (their defaults there), over {was} = true: the model "
            f"trains in fp32{with_fp8}; set mixed_precision.bf16 = true, or name Bridge's recipe "
            "(mixed_precision = \"bf16_with_fp8_delayed_scaling_mixed\", ...)")


def check_before_queue(cfg: Any, gpus: bool, gpu_model: Optional[str]) -> None:
    """bridge-submit's checks of FP8/FP4, before anything is queued: Bridge's ``[mixed_precision]``
    written into a copy of the sections as the ranks will write it, then :func:`check_container`, then
    the card of the cluster profile's ``cluster.gpu_model`` (when it names one) against the recipe.
    Raises ConfigError naming the key; ``cfg`` is left as it was."""
    capability = gpu_model_capability(gpu_model) if gpu_model is not None else None
    probe = copy.deepcopy(cfg)
    if probe.mixed_precision is not None:
        probe.mixed_precision.setup(probe.model, probe.optimizer, probe.ddp)
    if probe.ddp.use_distributed_optimizer or probe.optimizer.use_distributed_optimizer:  # as validate() syncs them
        probe.ddp.use_distributed_optimizer = probe.optimizer.use_distributed_optimizer = True
    check_container(probe, gpus)
    if capability is not None and gpus:
        prefix = key_of(probe, probe.model.low_precision or "fp8").split(".")[0]
        refused = probe.model.card_refusal(capability, gpu_model.upper(), prefix)
        if refused is not None:
            raise refused


def check_on_rank(cfg: Any, on_cuda: bool, has_te: bool, capability: Optional[Tuple[int, int]] = None,
                  card: str = "") -> None:
    """A rank's own check, after ``[mixed_precision]`` is applied and before the model is built: FP8/FP4
    need CUDA, the transformer_engine package and a card with the recipe. ConfigError naming the key
    (the rank exits with status 2 and the job is not requeued)."""
    m = cfg.model
    if not m.low_precision:
        return
    key = key_of(cfg, m.low_precision)
    what = m.low_precision.upper()
    if not on_cuda:
        raise ConfigError(f"{what} runs on GPUs with Transformer Engine; this rank has no CUDA", key=key)
    if not has_te:
        raise ConfigError(f"{what} needs Transformer Engine on the ranks (pip install '.[gpu]'); this rank has no "
                          "transformer_engine package", key=key)
    refused = m.card_refusal(capability, card, key.split(".")[0]) if capability is not None else None
    if refused is not None:
        raise refused
