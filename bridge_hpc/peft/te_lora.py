"""LoRA fused into Transformer Engine's linear layer (Bridge's ``TEFusedLoRALinear``).

On Transformer Engine's layers the adapter runs inside TE's operation fuser (``te.ops``): a main branch
``[norm ->] fork -> W`` whose fork hands the (normalized) input to a LoRA branch ``A -> B -> scale ->
add``, the add done by the B GEMM itself (beta = 1) into the base's output, and in the backward the
adapter's input gradient accumulated by its GEMM into the base's. The ops reuse the wrapper's own
parameters (the base's ``weight``/``bias``/``layer_norm_*``, the adapter's ``linear_in``/``linear_out``), so
checkpoints, merging and export are those of :class:`~bridge_hpc.peft.lora_layers.LoRALinear`. Under
FP8 the main branch is quantized as the base would be; the adapter runs in the parameters' dtype.

Used without tensor or sequence parallelism (one rank's whole layer), as in Bridge; otherwise the
unfused ``LoRALinear`` (base output plus adapter output) runs. Imported only where Transformer Engine is.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import transformer_engine.pytorch as te

from bridge_hpc.peft.lora_layers import LoRALinear, base_sizes

#: The operation-fuser ops this needs (Transformer Engine 2.x).
_OPS = ("Sequential", "Linear", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput", "AddExtraInput",
        "ConstantScale", "Dropout")


def te_fuser_available() -> bool:
    """Whether this Transformer Engine has every op the fused LoRA is built of."""
    ops = getattr(te, "ops", None)
    return ops is not None and all(hasattr(ops, name) for name in _OPS)


def fusable(base, adapter) -> bool:
    """Whether ``base`` (a Transformer Engine linear) and its adapter can run as one fused module here:
    one tensor-parallel rank (no split, no sequence parallelism), a plain adapter, and the fuser's ops."""
    return (te_fuser_available() and (getattr(base, "tp_size", 1) or 1) == 1
            and not base.config.sequence_parallel and isinstance(base, (te.Linear, te.LayerNormLinear))
            and getattr(base, "normalization", "LayerNorm") in ("LayerNorm", "RMSNorm"))


class TEFusedLoRALinear(LoRALinear):
    """``LoRALinear`` whose base and adapter run in Transformer Engine's operation fuser (see the module).
    The fused branches are built at the first forward (after the weights are read) and hold the
    wrapper's parameters, not copies."""

    def __init__(self, to_wrap, adapter):
        super().__init__(to_wrap, adapter)
        self._branches: Optional[Tuple[torch.nn.Module, torch.nn.Module]] = None  # a tuple: not submodules

    def _main_branch(self, in_features: int, out_features: int, into_main_grad: bool):
        base, branch = self.to_wrap, te.ops.Sequential()
        if isinstance(base, te.LayerNormLinear):
            kind = te.ops.LayerNorm if base.normalization == "LayerNorm" else te.ops.RMSNorm
            norm = kind(in_features, eps=base.eps, device="meta", dtype=base.layer_norm_weight.dtype,
                        zero_centered_gamma=base.zero_centered_gamma)
            norm.weight = base.layer_norm_weight
            if base.normalization == "LayerNorm":
                norm.bias = base.layer_norm_bias
            branch.append(norm)
            branch.append(te.ops.Quantize(forward=True, backward=False))
        branch.append(te.ops.MakeExtraOutput(in_place=True))  # the fork: the adapter's input
        bias = None if _returns_bias(base) else _bias(base)  # (a bias the layer returns is added by its caller)
        linear = te.ops.Linear(in_features, out_features, bias=bias is not None, device="meta",
                               dtype=base.weight.dtype, accumulate_into_main_grad=into_main_grad)
        linear.weight = base.weight
        if bias is not None:
            linear.bias = bias
        branch.append(linear)
        return branch

    def _lora_branch(self, in_features: int, out_features: int, into_main_grad: bool):
        adapter, branch = self.adapter, te.ops.Sequential()
        a, b = adapter.linear_in.weight, adapter.linear_out.weight
        dropout = adapter.dropout.p if adapter.dropout is not None else 0.0
        if dropout and adapter.dropout_position == "pre":
            branch.append(te.ops.Dropout(dropout))
        for weight, (n_in, n_out) in ((a, (in_features, adapter.dim)), (b, (adapter.dim, out_features))):
            op = te.ops.Linear(n_in, n_out, bias=False, device="meta", dtype=weight.dtype,
                               accumulate_into_main_grad=into_main_grad)
            op.weight = weight
            branch.append(op)
        if adapter.alpha != adapter.dim:
            branch.append(te.ops.ConstantScale(adapter.alpha / adapter.dim))
        if dropout and adapter.dropout_position == "post":
            branch.append(te.ops.Dropout(dropout))
        branch.append(te.ops.AddExtraInput(in_place=True))  # out += the adapter's, by B's GEMM
        return branch

    def _build(self):
        in_features, out_features, _ = base_sizes(self.to_wrap)
        # Gradients into .grad: megatron-core's DDP adds them into its buffers (the base is frozen)
        into_main_grad = False
        return (self._main_branch(in_features, out_features, into_main_grad),
                self._lora_branch(in_features, out_features, into_main_grad))

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if args or kwargs:  # a call the fuser cannot take: the unfused path
            return super().forward(x, *args, **kwargs)
        if self._branches is None:
            self._branches = self._build()
        main, lora = self._branches
        output, adapter_x = main(x)
        with te.fp8_autocast(enabled=False):
            output = lora(adapter_x, output)
        return output, _bias(self.to_wrap) if _returns_bias(self.to_wrap) else None


def _bias(base) -> Optional[torch.Tensor]:
    return base.bias if isinstance(base.bias, torch.Tensor) and base.bias.numel() else None


def _returns_bias(base) -> bool:
    """megatron-core's TE linears built with ``skip_bias_add`` return their bias beside the output (the
    MLP's fused bias-activation and the bias-dropout-add take it): the fused module does the same."""
    return bool(getattr(base, "te_return_bias", False))
