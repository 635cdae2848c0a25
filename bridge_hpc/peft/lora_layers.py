"""LoRA's layers on megatron-core's parallel linear layers (Bridge's ``ParallelLinearAdapter`` and
``LoRALinear``, ``megatron.bridge.peft.lora_layers`` / ``utils``).

An adapter is split across tensor-parallel ranks the way its base layer is, so that it needs no
collective of its own beyond those megatron-core's layers already do:

- column-parallel base (``linear_qkv``, ``linear_fc1``: full input, output split): ``A`` replicated,
  ``B`` a megatron-core ``ColumnParallelLinear`` (output split like the base's; its backward all-reduces
  the gradient of ``A x`` over the group, so every rank's ``A`` gets the same, complete gradient);
- row-parallel base (``linear_proj``, ``linear_fc2``: input split, output all-reduced): ``A`` a megatron-core
  ``RowParallelLinear`` (input split like the base's, output all-reduced), ``B`` replicated.

The adapters' initial values do not depend on the layout: each full ``A`` and ``B`` is drawn from a
generator seeded by the module's full name (layers counted over the whole model) and the torch seed
in force, and each rank keeps its part, so TP1, TP2 and PP2 runs start from the same adapters.
Checkpoint keys are the layout-free ones of megatron-core (``sharded_state_dict``): the base's keys stay
what they were (the wrapper is transparent), the adapter's are ``<layer>.adapter.linear_in.weight`` and
``<layer>.adapter.linear_out.weight``, with the split axis and, for a gated ``linear_fc1`` (swiglu), its
two halves as megatron-core's MLP lays them out, so a TP2 checkpoint loads at TP1.

Without tensor or sequence parallelism a wrapped layer runs base and adapter as one
:class:`FusedLoRALinear` (issue 35, docs/peft.md): no full-width scale or add, forward or backward.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.peft.adapter_wrapper import AdapterWrapper
from bridge_hpc.peft.utils import LINEAR_NAMES


def _init_full(shape, method: str, generator: torch.Generator) -> torch.Tensor:
    """A full-size fp32 matrix initialized as Bridge's ``ParallelLinearAdapter`` does by name."""
    t = torch.empty(shape, dtype=torch.float32)
    if method == "xavier":
        return torch.nn.init.xavier_normal_(t, generator=generator)
    if method == "normal":
        return t.normal_(0.0, 0.2, generator=generator)
    if method == "kaiming":
        return torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=generator)
    return t.zero_()


def _rows_of_rank(full: torch.Tensor, rank: int, size: int, gated: bool) -> torch.Tensor:
    """This rank's rows of ``full`` (a column-parallel layer's output dimension); for a gated
    ``linear_fc1`` each of its two halves (gate, up) is split, as megatron-core's MLP lays them out."""
    if gated:
        return torch.cat([_rows_of_rank(half, rank, size, False) for half in full.chunk(2, dim=0)], dim=0)
    part = full.shape[0] // size
    return full[rank * part:(rank + 1) * part]


def _no_init(weight: torch.Tensor) -> None:
    """The megatron-core layers' init: their weights are set from the full matrices right after."""


def _is_gated_fc1(base, name: str) -> bool:
    return name == "linear_fc1" and bool(getattr(base.config, "gated_linear_unit", False))


def is_te_linear(module) -> bool:
    """Whether ``module`` is one of megatron-core's Transformer Engine linear layers (checked by class
    path, so that this module imports without Transformer Engine)."""
    return any(c.__module__.startswith("megatron.core.extensions.transformer_engine") for c in type(module).__mro__) \
        and getattr(module, "parallel_mode", None) in ("row", "column", None)


def base_sizes(base) -> tuple:
    """``(full input features, full output features, input split over tensor-parallel ranks)`` of a
    megatron-core linear layer, local or Transformer Engine's (whose ``in_features`` / ``out_features``
    are already this rank's share on the split side)."""
    if isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        return base.input_size, base.output_size, isinstance(base, RowParallelLinear)
    tp = getattr(base, "tp_size", 1) or 1
    if base.parallel_mode == "row":
        return base.in_features * tp, base.out_features, True
    if base.parallel_mode == "column":
        return base.in_features, base.out_features * tp, False
    return base.in_features, base.out_features, False


class ReplicatedLinear(torch.nn.Module):
    """A bias-free linear layer whose weight is the same on every tensor-parallel rank (one half of an
    adapter); returns ``(output, None)`` as megatron-core's layers do."""

    def __init__(self, weight: torch.Tensor, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        # Under sequence parallelism each rank sees part of the sequence: megatron-core's gradient
        # finalization all-reduces the gradients of parameters marked so over the tensor-parallel group.
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint({"weight": self.weight}, prefix, {}, sharded_offsets)


class ParallelLinearAdapter(MegatronModule):
    """``(alpha / dim) B A x`` for one base layer, split as its base is (see the module)."""

    def __init__(self, base, full_name: str, dim: int, alpha: float, dropout: float, dropout_position: str,
                 lora_A_init_method: str, lora_B_init_method: str, seed: int):
        super().__init__(config=base.config)
        self.base_linear_name = full_name
        self.dim, self.alpha, self.dropout_position = dim, alpha, dropout_position
        in_features, out_features, self.input_is_parallel = base_sizes(base)
        self.gated = _is_gated_fc1(base, full_name.rsplit(".", 1)[-1])
        # An expert's layers are split over the expert tensor-parallel group (``expert_tensor_parallel_size``),
        # which the base layer holds as its ``tp_group``; the adapter is split over the same.
        group = getattr(base, "tp_group", None)
        tp_size = group.size() if group is not None else parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = group.rank() if group is not None else parallel_state.get_tensor_model_parallel_rank()
        is_expert = bool(getattr(base, "is_expert", False))
        generator = torch.Generator().manual_seed((seed + zlib.crc32(full_name.encode())) % (2 ** 63))
        a_full = _init_full((dim, in_features), lora_A_init_method, generator)
        b_full = _init_full((out_features, dim), lora_B_init_method, generator)
        device, dtype = base.weight.device, base.weight.dtype
        tp_group = {"tp_group": base.tp_group} if getattr(base, "tp_group", None) is not None else {}
        sequence_parallel = bool(base.config.sequence_parallel)
        if self.input_is_parallel:
            self.linear_in = RowParallelLinear(in_features, dim, config=base.config, init_method=_no_init, bias=False,
                                               input_is_parallel=True, skip_bias_add=True, is_expert=is_expert,
                                               **tp_group)
            part = in_features // tp_size
            a_local = a_full[:, tp_rank * part:(tp_rank + 1) * part]
            self.linear_out = ReplicatedLinear(b_full.to(device=device, dtype=dtype), sequence_parallel)
            with torch.no_grad():
                self.linear_in.weight.copy_(a_local)
        else:
            self.linear_in = ReplicatedLinear(a_full.to(device=device, dtype=dtype), sequence_parallel)
            self.linear_out = ColumnParallelLinear(dim, out_features, config=base.config, init_method=_no_init,
                                                   bias=False, gather_output=False, skip_bias_add=True,
                                                   is_expert=is_expert, **tp_group)
            with torch.no_grad():
                self.linear_out.weight.copy_(_rows_of_rank(b_full, tp_rank, tp_size, self.gated))
        if hasattr(base.weight, "allreduce"):
            # megatron-core's DDP reduces the gradients of a parameter marked ``allreduce = False`` (an expert's,
            # under expert parallelism) over the expert-data-parallel group only: the ranks that hold the same
            # expert. The adapter of an expert is that expert's too.
            for param in self.parameters():
                param.allreduce = base.weight.allreduce
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is not None and self.dropout_position == "pre":
            x = self.dropout(x)
        h, _ = self.linear_in(x)
        y, _ = self.linear_out(h)
        if self.dropout is not None and self.dropout_position == "post":
            y = self.dropout(y)
        return y * (self.alpha / self.dim)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        out = {}
        for name in ("linear_in", "linear_out"):
            out.update(getattr(self, name).sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        if self.gated:
            _swiglu_layout(out, f"{prefix}linear_out.weight", sharded_offsets)
        return {key: value for key, value in out.items() if not key.endswith("_extra_state")}


def _swiglu_layout(sharded: dict, key: str, sharded_offsets: tuple) -> None:
    """A gated ``linear_fc1``'s output rows as megatron-core's MLP saves its weight: two halves, each split."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets)


def adapter_for(peft, module, name: Optional[str], prefix: Optional[str],
                adapter_class: type = ParallelLinearAdapter) -> Optional[ParallelLinearAdapter]:
    """The adapter (an ``adapter_class``) that ``peft`` (LoRA's or DoRA's fields) puts on ``module``, or None
    where ``module`` is not one of the GPT layer's linear layers that ``peft.target_modules`` names."""
    if name not in LINEAR_NAMES:
        return None
    full_name = f"{prefix}.{name}" if prefix else name
    if peft.match(name, full_name) is None:
        return None
    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not is_te_linear(module):
        raise ConfigError(f"{full_name} is a {type(module).__name__}: adapters wrap megatron-core's linear layers, "
                          "local or Transformer Engine's", key="peft.target_modules")
    return adapter_class(module, full_name, peft.dim, peft.alpha, peft.dropout, peft.dropout_position,
                                 peft.lora_A_init_method, peft.lora_B_init_method, seed=torch.initial_seed())


class FusedLoRALinear(torch.autograd.Function):
    """``x W^T (+ b) + (s x_a A^T) B^T`` with a frozen ``W`` as four matrix multiplies and no full-width
    elementwise pass (Megatron Bridge's fused LoRA, without Transformer Engine).

    Forward: ``h = s (x_a A^T)`` (the scale on the rank-wide ``[tokens, dim]``), ``out = h B^T (+ b)``
    (the bias in that GEMM's epilogue), then ``out += x W^T`` accumulated by the base's GEMM itself
    (``addmm_``, beta = 1). Backward: ``g_h = s (g B)`` (rank-wide), ``grad B = g^T h``, ``grad A =
    g_h^T x_a``, and ``grad x = g_h A + g W``, the base's GEMM accumulating onto the adapter's; ``W`` gets
    no gradient. The order is for memory traffic: the adapter's full-width GEMM (K = dim) is bound by
    its output's bytes, and written first it only writes them; the base's GEMM, bound by its arithmetic,
    then reads them in its epilogue. The other way round the adapter's GEMM read and wrote the whole
    output again (a 1.3 B GPT's LoRA step on one H200: 37 ms of its 385 ms of kernels per profiler step,
    ``device-2026-12-03c/peft_prof.kernels.txt``, its ``badd`` kernels).
    ``x_a`` (``adapter_x``) is the adapter's input where it is not ``x``
    (dropout before the adapter, training): its gradient is then returned apart, and autograd adds it to
    ``x``'s through the dropout, as on the unfused path. Saved: ``x`` (and ``x_a``), ``h`` and the
    weights. Every tensor is in its own dtype (the module's: no autocast in this trainer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, adapter_x: Optional[torch.Tensor], weight: torch.Tensor,
                bias: Optional[torch.Tensor], lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        a2d = x2d if adapter_x is None else adapter_x.reshape(-1, adapter_x.shape[-1])
        h = torch.mm(a2d, lora_a.t()).mul_(scale)
        out = torch.mm(h, lora_b.t()) if bias is None else torch.addmm(bias, h, lora_b.t())
        out.addmm_(x2d, weight.t())
        ctx.save_for_backward(x2d, None if adapter_x is None else a2d, weight, lora_a, lora_b, h)
        ctx.scale, ctx.x_shape = scale, x.shape
        ctx.adapter_x_shape = None if adapter_x is None else adapter_x.shape
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x2d, a2d, weight, lora_a, lora_b, h = ctx.saved_tensors
        need_x, need_adapter_x, _, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        separate = a2d is not None
        a2d = x2d if a2d is None else a2d
        g = grad_output.reshape(-1, grad_output.shape[-1])
        grad_h = torch.mm(g, lora_b).mul_(ctx.scale) if (need_x or need_adapter_x or need_a) else None
        grad_b = torch.mm(g.t(), h) if need_b else None
        grad_a = torch.mm(grad_h.t(), a2d) if need_a else None
        grad_x = grad_adapter_x = None
        if need_x:
            if separate:
                grad_x = torch.mm(g, weight)
            else:
                grad_x = torch.mm(grad_h, lora_a).addmm_(g, weight)
            grad_x = grad_x.view(ctx.x_shape)
        if separate and need_adapter_x:
            grad_adapter_x = torch.mm(grad_h, lora_a).view(ctx.adapter_x_shape)
        grad_bias = g.sum(dim=0) if need_bias else None
        return grad_x, grad_adapter_x, None, grad_bias, grad_a, grad_b, None


#: A class attribute a megatron-core linear subclass sets to True when its ``_forward_impl``, for a
#: frozen weight, is its parent's plain ``x W^T (+ b)`` (the fast path's bias-in-GEMM layer does: its own
#: path needs a weight that wants its gradient). Read here, so that no arrow runs up to ``training``.
FROZEN_FORWARD_IS_PLAIN = "frozen_forward_is_plain"


def _forward_is_plain(base) -> bool:
    """Whether ``base``'s ``_forward_impl``, for a frozen weight, runs megatron-core's ``x W^T (+ b)``."""
    impl = type(base)._forward_impl
    return (impl in (ColumnParallelLinear._forward_impl, RowParallelLinear._forward_impl)
            or bool(getattr(type(base), FROZEN_FORWARD_IS_PLAIN, False)))


def _tp_size(base) -> int:
    group = getattr(base, "tp_group", None)
    return group.size() if group is not None else parallel_state.get_tensor_model_parallel_world_size()


def _plain_on_this_rank(layer) -> bool:
    """Whether a megatron-core linear layer (or a :class:`ReplicatedLinear`) multiplies by its own weight
    with no collective: no tensor or sequence parallelism, expert communication, gathered output or
    weight gathered at run time (megatron-core's ``gtp_remat``)."""
    if isinstance(layer, ReplicatedLinear):
        return True
    return (_tp_size(layer) == 1 and not getattr(layer, "sequence_parallel", False)
            and not getattr(layer, "explicit_expert_comm", False) and not getattr(layer, "gather_output", False)
            and getattr(layer, "gtp_remat_size", 1) == 1)


def layout_allows_fusion(base, adapter) -> bool:
    """Whether ``base``'s forward on this rank is a plain ``x W^T (+ b)`` and ``adapter``'s a plain ``s B A x``
    (before dropout): megatron-core's own column- or row-parallel layer and the toolkit's adapter, each
    :func:`_plain_on_this_rank`, no deferred weight gradients. Fixed when the wrapper is built;
    :meth:`LoRALinear.forward` checks the rest (frozen base, dropout, CPU offloading, extra arguments) at
    every call."""
    halves = (adapter.linear_in, adapter.linear_out)
    return (isinstance(base, (ColumnParallelLinear, RowParallelLinear))
            and type(base).forward in (ColumnParallelLinear.forward, RowParallelLinear.forward)
            and _forward_is_plain(base) and _plain_on_this_rank(base)
            and not base.config.sequence_parallel and not base.config.defer_embedding_wgrad_compute
            and type(adapter).forward is ParallelLinearAdapter.forward
            and all(type(half) in (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)
                    and getattr(half, "bias", None) is None and _plain_on_this_rank(half) for half in halves))


class LoRALinear(AdapterWrapper):
    """``W x + (alpha / dim) B A x``: the base layer's output plus its adapter's (Bridge's ``LoRALinear``).

    Where the base's forward is a plain matrix multiply on this rank (:func:`layout_allows_fusion`: no
    tensor or sequence parallelism) and its weight is frozen, the two run as one :class:`FusedLoRALinear`:
    the adapter's scale on the rank-wide intermediate, its output and its input gradient accumulated by
    the matrix multiplies into the base's. Otherwise (tensor or sequence parallelism, dropout after the
    adapter while training, a base of another kind) the base's forward plus the adapter's, as before.
    The parameters are the same either way (``to_wrap.weight``, ``adapter.linear_in.weight``,
    ``adapter.linear_out.weight``), so are checkpoints, merging and export."""

    def __init__(self, to_wrap, adapter: ParallelLinearAdapter):
        super().__init__(to_wrap, adapter)
        self.fusable_layout = layout_allows_fusion(to_wrap, adapter)
        if hasattr(to_wrap, "return_layernorm_output"):
            # Transformer Engine's layer-norm linear: the adapter multiplies the normalized input too
            to_wrap.return_layernorm_output = True
            to_wrap.return_layernorm_output_gathered = bool(to_wrap.config.sequence_parallel)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        base, adapter = self.to_wrap, self.adapter
        dropout = adapter.dropout if adapter.dropout is not None and adapter.dropout.training else None
        if (self.fusable_layout and not args and not kwargs and not base.weight.requires_grad
                and (base.bias is None or not base.bias.requires_grad)
                and (dropout is None or adapter.dropout_position == "pre")
                and getattr(base.config, "_cpu_offloading_context", None) is None):
            adapter_x = None if dropout is None else dropout(x)
            skip_bias = base.skip_bias_add
            output = FusedLoRALinear.apply(x, adapter_x, base.weight, None if skip_bias else base.bias,
                                           adapter.linear_in.weight, adapter.linear_out.weight,
                                           adapter.alpha / adapter.dim)
            return output, (base.bias if skip_bias else None)
        output, bias, adapter_x = self.base_linear_forward(x, *args, **kwargs)
        return output + self.adapter(adapter_x.contiguous()).reshape(output.shape), bias
