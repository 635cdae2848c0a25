"""Mixture-of-Experts: the ``[model]`` fields, megatron-core's names and defaults, and what can hold.

megatron-core builds an MoE layer (a router, ``num_moe_experts`` expert MLPs of which each token takes
``moe_router_topk``, optionally a shared expert every token takes) wherever ``moe_layer_freq`` says, from
its ``TransformerConfig``. :class:`MoEFields` holds those fields with megatron-core's names and defaults
(Megatron Bridge's model providers are TransformerConfigs, so they are Bridge's defaults too);
:class:`~bridge_hpc.training.engine.config.GPTModelConfig` inherits them, so they reach megatron-core by
name like every other model field.

What cannot hold is refused here, one line naming the key, on the login node (``bridge-submit``) and
again on the ranks: the fields on their own and against each other (:meth:`MoEFields.check_moe`), the
kernels a job's layers and nodes have (:meth:`MoEFields.check_moe_kernels`), and the parallel sizes
against the world (:meth:`MoEFields.check_expert_world`). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, List, Literal, Optional, Union

from bridge_hpc.contracts.errors import ConfigError

TE = "transformer_engine"

#: Dispatchers that move tokens with all-to-all collectives and CUDA streams; "allgather" runs anywhere.
CUDA_ONLY_DISPATCHERS = ("alltoall", "flex")
#: Fields that need Transformer Engine's kernels (fused permutation, fused router). ``moe_grouped_gemm``
#: runs on either layers: TE's grouped linear, or on the local layers torch's grouped GEMM
#: (:mod:`bridge_hpc.training.engine.grouped_experts`).
TE_KERNEL_FIELDS = ("moe_permute_fusion", "moe_router_fusion")
#: torch's grouped GEMM needs every stride in multiples of 16 bytes: rows of 8 bf16 (or 4 fp32) elements.
GROUPED_MM_ALIGN = 8


@dataclass
class MoEFields:
    """megatron-core's Mixture-of-Experts fields of ``TransformerConfig``, its names and defaults.

    ``num_moe_experts`` (None: a dense model) experts per MoE layer, each an MLP of
    ``moe_ffn_hidden_size`` (default ``ffn_hidden_size``); the router (``moe_router_score_function``
    softmax or sigmoid, before or after the top-k: ``moe_router_pre_softmax``) sends each token to
    ``moe_router_topk`` of them. ``moe_shared_expert_intermediate_size``: a shared expert every token
    takes (DeepSeek, Qwen2-MoE), gated per token with ``moe_shared_expert_gate``. ``moe_layer_freq``: 1
    (every layer MoE), N (every N-th) or a 0/1 list per layer. Load balancing:
    ``moe_router_load_balancing_type`` with ``moe_aux_loss_coeff``, and the router z-loss
    ``moe_z_loss_coeff``; both are logged per step. ``expert_model_parallel_size`` spreads the experts
    over that many ranks (each holds ``num_moe_experts / EP``), ``expert_tensor_parallel_size`` splits each
    expert (default: the tensor-parallel size). ``moe_grouped_gemm`` runs a rank's experts as grouped
    matrix multiplies: Transformer Engine's grouped linear on its layers; on the local layers torch's
    grouped GEMM over the sequential experts' own parameters (no biases, no expert tensor parallelism;
    bf16 on GPUs).
    """

    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    moe_shared_expert_overlap: bool = False
    moe_layer_freq: Union[int, List[int]] = 1
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"] = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = None
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_fusion: bool = False
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    moe_grouped_gemm: bool = False
    moe_permute_fusion: bool = False
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_input_jitter_eps: Optional[float] = None
    moe_per_layer_logging: bool = False
    moe_layer_recompute: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    def moe_layer_pattern(self) -> List[int]:
        """1 for each MoE layer, 0 for each dense one (``moe_layer_freq`` read as megatron-core reads it)."""
        n = getattr(self, "num_layers", 1)
        if not self.is_moe:
            return [0] * n
        if isinstance(self.moe_layer_freq, int):
            return [1 if i % self.moe_layer_freq == 0 else 0 for i in range(n)]
        return list(self.moe_layer_freq)

    def active_ffn_widths(self) -> List[int]:
        """The MLP widths one token passes through in an MoE layer: ``moe_router_topk`` experts of
        ``moe_ffn_hidden_size`` and the shared expert (for FLOPs counted over the *active* parameters)."""
        width = self.moe_ffn_hidden_size or getattr(self, "ffn_hidden_size", None) or 0
        widths = [width] * self.moe_router_topk
        if self.moe_shared_expert_intermediate_size:
            widths.append(self.moe_shared_expert_intermediate_size)
        return widths

    def check_moe(self, prefix: str = "model") -> None:
        """The fields on their own and against each other; ConfigError naming ``prefix.<field>``."""
        def refuse(name: str, message: str) -> None:
            raise ConfigError(message, key=f"{prefix}.{name}")

        def positive_int(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                refuse(name, f"must be an integer >= 1, got {value!r}")

        positive_int("expert_model_parallel_size")
        positive_int("expert_tensor_parallel_size", allow_none=True)
        if not self.is_moe:
            defaults = MoEFields()
            for f in fields(MoEFields):
                if f.name != "num_moe_experts" and getattr(self, f.name) != getattr(defaults, f.name):
                    refuse(f.name, "is an MoE setting, and this model has no experts: set model.num_moe_experts "
                                   f"(or leave {f.name} out)")
            return
        positive_int("num_moe_experts")
        experts = self.num_moe_experts
        positive_int("moe_router_topk")
        if self.moe_router_topk > experts:
            refuse("moe_router_topk", f"each token takes {self.moe_router_topk} experts, and there are only "
                                      f"{experts} (model.num_moe_experts)")
        positive_int("moe_ffn_hidden_size", allow_none=True)
        positive_int("moe_shared_expert_intermediate_size", allow_none=True)
        if self.moe_shared_expert_intermediate_size and getattr(self, "add_bias_linear", False):
            refuse("moe_shared_expert_intermediate_size", "megatron-core's shared expert has no biases: set "
                                                          "model.add_bias_linear = false")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            refuse("moe_shared_expert_gate", "gates the shared expert: needs model.moe_shared_expert_intermediate_size")
        if self.moe_shared_expert_overlap and self.moe_token_dispatcher_type not in CUDA_ONLY_DISPATCHERS:
            refuse("moe_shared_expert_overlap", "overlaps the shared expert with the all-to-all: needs "
                                                "model.moe_token_dispatcher_type = \"alltoall\" or \"flex\"")
        self._check_layer_freq(refuse)
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
                refuse(name, f"must be a number >= 0, got {value!r}")
        for name in ("moe_expert_capacity_factor", "moe_router_topk_scaling_factor", "moe_router_bias_update_rate"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                refuse(name, f"must be a number > 0, got {value!r}")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            refuse("moe_pad_expert_input_to_capacity", "pads to the experts' capacity: needs "
                                                       "model.moe_expert_capacity_factor")
        if self.moe_expert_capacity_factor is not None and self.moe_router_load_balancing_type not in (
                "aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
            refuse("moe_expert_capacity_factor", "drops tokens over capacity, which megatron-core does with the "
                                                 "aux-loss or no load balancing only (not \"sinkhorn\")")
        if (self.moe_router_num_groups is None) != (self.moe_router_group_topk is None):
            refuse("moe_router_group_topk" if self.moe_router_group_topk is None else "moe_router_num_groups",
                   "group-limited routing needs both model.moe_router_num_groups and model.moe_router_group_topk")
        if self.moe_router_num_groups is not None:
            positive_int("moe_router_num_groups")
            positive_int("moe_router_group_topk")
            if experts % self.moe_router_num_groups:
                refuse("moe_router_num_groups", f"must divide model.num_moe_experts ({experts}), "
                                                f"got {self.moe_router_num_groups}")
            if self.moe_router_group_topk > self.moe_router_num_groups:
                refuse("moe_router_group_topk", f"must be <= model.moe_router_num_groups ({self.moe_router_num_groups})")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            refuse("moe_router_enable_expert_bias", "aux-loss-free balancing biases sigmoid scores: needs "
                                                    "model.moe_router_score_function = \"sigmoid\"")
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            refuse("moe_router_pre_softmax", "orders softmax before the top-k: needs "
                                             "model.moe_router_score_function = \"softmax\"")
        ep = self.expert_model_parallel_size
        etp = self.expert_tensor_parallel_size or getattr(self, "tensor_model_parallel_size", 1)
        if getattr(self, "add_bias_linear", False) and not self.moe_grouped_gemm and ep == 1 and etp == 1:
            # Seen with megatron-core 0.16: "Output 0 of _ReduceFromModelParallelRegion is a view and is being
            # modified inplace" at the first step (mlp.py adds the bias in place to the reduce's identity).
            refuse("add_bias_linear", "is true, and megatron-core's local experts (SequentialMLP) at expert-parallel "
                                      "and expert tensor-parallel size 1 add their bias in place to a tensor autograd "
                                      "forbids changing: set it false, as Bridge's MoE models do (or "
                                      "expert_model_parallel_size above 1)")
        if experts % ep:
            refuse("expert_model_parallel_size", f"must divide model.num_moe_experts ({experts}): each of the {ep} "
                                                 "ranks holds the same number of experts")

    def _check_layer_freq(self, refuse) -> None:
        freq, n = self.moe_layer_freq, getattr(self, "num_layers", None)
        if isinstance(freq, bool) or not isinstance(freq, (int, list)):
            refuse("moe_layer_freq", f"must be an integer >= 1 or a list of 0/1 per layer, got {freq!r}")
        if isinstance(freq, int):
            if freq < 1 or (n is not None and freq > n):
                refuse("moe_layer_freq", f"must be between 1 and model.num_layers ({n}), got {freq}")
            return
        if any(v not in (0, 1) or isinstance(v, bool) for v in freq):
            refuse("moe_layer_freq", f"a list holds 0 (dense) or 1 (MoE) per layer, got {freq!r}")
        if n is not None and len(freq) != n:
            refuse("moe_layer_freq", f"has {len(freq)} entries for model.num_layers = {n}")
        if not any(freq):
            refuse("moe_layer_freq", "makes no layer an MoE layer: leave model.num_moe_experts out for a dense model")

    def check_moe_kernels(self, gpus: Optional[bool], prefix: str = "model", bf16: Optional[bool] = None) -> None:
        """What the job's layers and nodes can run: Transformer Engine's MoE kernels need its layers (and
        GPUs); the all-to-all dispatchers need GPUs; the local grouped experts their conditions
        (:meth:`local_grouped_experts_refusal`). ``gpus`` False: a job that asks for none; None: not
        known (a Python config). ``bf16``: whether the ranks will run the model in bf16 (``[mixed_precision]``
        applied; None: this config's ``bf16``)."""
        if not self.is_moe:
            return
        layers = getattr(self, "transformer_impl", "local")
        for name in TE_KERNEL_FIELDS:
            if getattr(self, name) and layers != TE:
                raise ConfigError(f"is a Transformer Engine kernel: needs model.transformer_impl = \"{TE}\" (it is "
                                  f"\"{layers}\")", key=f"{prefix}.{name}")
            if getattr(self, name) and gpus is False:
                raise ConfigError("is a Transformer Engine kernel, which runs on GPUs, and the job asks for none",
                                  key=f"{prefix}.{name}")
        if self.moe_grouped_gemm and layers == TE and gpus is False:
            raise ConfigError("on Transformer Engine's layers is TE's grouped linear, which runs on GPUs, and the job "
                              "asks for none", key=f"{prefix}.moe_grouped_gemm")
        if self.moe_grouped_gemm and layers != TE:
            why = self.local_grouped_experts_refusal(gpus, bf16)
            if why is not None:
                raise ConfigError(f"on the local layers {why}", key=f"{prefix}.moe_grouped_gemm")
        if self.moe_token_dispatcher_type in CUDA_ONLY_DISPATCHERS and gpus is False:
            raise ConfigError(f"\"{self.moe_token_dispatcher_type}\" dispatches with CUDA streams and all-to-all "
                              "collectives; a job without GPUs takes \"allgather\"", key=f"{prefix}.moe_token_dispatcher_type")

    def local_grouped_experts_refusal(self, gpus: Optional[bool], bf16: Optional[bool] = None) -> Optional[str]:
        """Why ``moe_grouped_gemm`` cannot run on the local layers (torch's grouped GEMM over the sequential
        experts' parameters, ``engine/grouped_experts.py``), or None; torch-free (the login node asks).
        ``bf16``: as :meth:`check_moe_kernels` takes it."""
        if not torch_has_grouped_mm():
            return ("needs torch's grouped GEMM (torch._grouped_mm, on CPU and GPU from torch 2.9), which the "
                    "installed torch lacks")
        ffn = self.moe_ffn_hidden_size or getattr(self, "ffn_hidden_size", None) or 4 * getattr(self, "hidden_size", 0)
        widths = {"model.hidden_size": getattr(self, "hidden_size", 0), "the experts' width": ffn}
        unaligned = [f"{name} {width}" for name, width in widths.items() if width % GROUPED_MM_ALIGN]
        if unaligned:
            return (f"needs the experts' row widths in multiples of {GROUPED_MM_ALIGN} (its strides in multiples of 16 "
                    f"bytes): {', '.join(unaligned)}")
        if getattr(self, "add_bias_linear", False):
            return "runs the experts without biases, and model.add_bias_linear is true"
        etp = self.expert_tensor_parallel_size or getattr(self, "tensor_model_parallel_size", 1)
        if etp > 1:
            return f"runs each expert whole on its rank, and the expert tensor-parallel size is {etp}"
        if gpus and not (getattr(self, "bf16", False) if bf16 is None else bf16):
            return ("multiplies bf16 on GPUs (torch's grouped GEMM on CUDA), and the model is not bf16: set "
                    "[mixed_precision] to bf16, or model.moe_grouped_gemm = false")
        return None

    def check_expert_world(self, world_size: int, prefix: str = "model") -> None:
        """megatron-core's expert groups tile the world: expert x expert-tensor x pipeline parallel must
        divide it (the dense layers' tensor x pipeline x context parallel is checked beside)."""
        if not self.is_moe:
            return
        ep = self.expert_model_parallel_size
        etp = self.expert_tensor_parallel_size or getattr(self, "tensor_model_parallel_size", 1)
        pp = getattr(self, "pipeline_model_parallel_size", 1)
        if world_size % (ep * etp * pp):
            raise ConfigError(f"expert x expert-tensor x pipeline parallel ({ep} x {etp} x {pp} = {ep * etp * pp}) "
                              f"must divide the world size {world_size}", key=f"{prefix}.expert_model_parallel_size")


def torch_has_grouped_mm() -> bool:
    """Whether the installed torch has ``torch._grouped_mm`` on CPU and GPU (2.9 on; 2.8 has it on Hopper
    only), read from its version without importing it (the login node's checks stay torch-free; the
    ranks' torch is taken to be the login node's, as the job's environment is)."""
    from importlib import metadata

    try:
        major, minor = (int(part) for part in metadata.version("torch").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (2, 9)


def is_moe(cfg: Any) -> bool:
    """Whether a model config (ours or megatron-core's) has experts."""
    return getattr(cfg, "num_moe_experts", None) is not None
