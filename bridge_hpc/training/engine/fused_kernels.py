"""The toolkit's kernels for what Transformer Engine fuses in its layers (``model.fused_kernels``).

Why: without Transformer Engine or Apex, megatron-core's local layers fall back to torch, and profiles
of the 370 M GPT's step on an H100 (README > Benchmarks) showed three of the fallbacks among the largest
costs after the matrix multiplies and attention: megatron-core's fused cross entropy makes five passes
over fp32 logits (8.1 ms a step) and keeps a fp32 softmax for the backward (4 GiB more at the peak, at a
32 k vocabulary); torch's LayerNorm backward (its gamma/beta reduction especially) takes about 6 ms; and
the QKV projection adds its bias in a separate broadcasting kernel (24 × 134 µs). ``model.fused_kernels``
swaps in what is below; the parameters, their names and the checkpoints stay the same.

- :func:`vocab_parallel_cross_entropy`: one pass over the logits computes each row's running maximum
  and sum of exponentials (an online softmax) and the target's logit; the backward recomputes the
  softmax from the logits and the two row statistics and writes the gradient in the logits' dtype.
  Nothing of the vocabulary's size is saved but the logits themselves, which the output layer made
  anyway. With tensor parallelism each rank holds a slice of the vocabulary, as megatron-core's; the
  row statistics are combined with two all-reduces, as megatron-core's are.
- :class:`TritonNorm`: LayerNorm or RMSNorm over the last dimension, fp32 statistics. Its backward
  sums the weight and bias gradients over fixed blocks of rows and then over the blocks, in an order
  that does not depend on timing, so runs are reproducible (``model.deterministic_mode``) and resumes
  exact.
- :class:`BiasInGemmColumnParallelLinear`: megatron-core's ``ColumnParallelLinear`` whose bias, where
  it adds one itself, is added by the matrix multiply (``torch.addmm``: cuBLAS's bias epilogue). Only
  without tensor parallelism; with it, or with megatron-core's gradient-accumulation fusion or deferred
  weight gradients, megatron-core's own path runs.

The Triton kernels need CUDA and triton (which CUDA builds of torch ship); the module imports triton
only when they are built, so CPU ranks never import it.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from bridge_hpc.contracts.errors import ConfigError

#: Columns of the logits each cross-entropy program reads at a time.
CE_BLOCK = 4096
#: Columns of the weight and bias gradients each program of the norm backward's final sum adds up.
SUM_COLUMNS = 32


def check_config(cfg, on_cuda: bool) -> None:
    """On the ranks, refuse ``model.fused_kernels`` where only a rank can tell: no CUDA, or no triton."""
    if not cfg.model.fused_kernels:
        return
    if not on_cuda:
        raise ConfigError("the fused kernels run on GPUs, and this rank has none (set model.fused_kernels = "
                          "false on CPU)", key="model.fused_kernels")
    if importlib.util.find_spec("triton") is None:
        raise ConfigError("needs the triton package, which CUDA builds of torch ship; this rank's torch "
                          f"{torch.__version__} has none", key="model.fused_kernels")


@functools.lru_cache(maxsize=None)
def _kernels():
    """Compile-on-first-use Triton kernels (imported here: triton exists only where CUDA does)."""
    import triton
    import triton.language as tl

    @triton.jit
    def ce_forward(logits, row_stride, target, vocab_start, n_cols, row_max, row_sumexp, predicted,
                   BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        local = tl.load(target + row) - vocab_start
        inside = (local >= 0) & (local < n_cols)
        picked = tl.load(base + local, mask=inside, other=0.0).to(tl.float32)
        tl.store(row_max + row, m)
        tl.store(row_sumexp + row, s)
        tl.store(predicted + row, tl.where(inside, picked, 0.0))

    @triton.jit
    def ce_backward(logits, row_stride, grad, target, vocab_start, n_cols, row_max, row_sumexp, grad_loss,
                    BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        out = grad + row * row_stride
        m = tl.load(row_max + row)
        g = tl.load(grad_loss + row)
        scale = g / tl.load(row_sumexp + row)
        local = tl.load(target + row) - vocab_start
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            d = tl.exp(x - m) * scale - tl.where(cols == local, g, 0.0)
            tl.store(out + cols, d.to(out.dtype.element_ty), mask=cols < n_cols)

    @triton.jit
    def norm_forward(x, y, weight, bias, mean_out, rstd_out, n_cols, eps,
                     RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        v = tl.load(x + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        if RMS:
            mean = 0.0
            centered = v
        else:
            mean = tl.sum(v, 0) / n_cols
            centered = tl.where(inside, v - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 0) / n_cols + eps)
        out = centered * rstd * tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += tl.load(bias + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(y + row * n_cols + cols, out.to(y.dtype.element_ty), mask=inside)
        tl.store(mean_out + row, mean)
        tl.store(rstd_out + row, rstd)

    @triton.jit
    def norm_backward(x, dy, dx, weight, mean_in, rstd_in, partial_dw, partial_db, n_rows, n_cols,
                      rows_per_program, RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), tl.float32)
        db = tl.zeros((BLOCK,), tl.float32)
        first = program * rows_per_program
        for i in range(0, rows_per_program):
            row = (first + i).to(tl.int64)
            if row < n_rows:
                v = tl.load(x + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
                g = tl.load(dy + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
                rstd = tl.load(rstd_in + row)
                if RMS:
                    xhat = v * rstd
                else:
                    xhat = tl.where(inside, (v - tl.load(mean_in + row)) * rstd, 0.0)
                wg = w * g
                c1 = tl.sum(xhat * wg, 0) / n_cols
                if RMS:
                    d = (wg - xhat * c1) * rstd
                else:
                    c2 = tl.sum(wg, 0) / n_cols
                    d = (wg - (xhat * c1 + c2)) * rstd
                tl.store(dx + row * n_cols + cols, d.to(dx.dtype.element_ty), mask=inside)
                dw += g * xhat
                if HAS_BIAS:
                    db += g
        tl.store(partial_dw + program * n_cols + cols, dw, mask=inside)
        if HAS_BIAS:
            tl.store(partial_db + program * n_cols + cols, db, mask=inside)

    @triton.jit
    def column_sums(partial_dw, partial_db, dw, db, n_partials, n_cols, HAS_BIAS: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc_w = tl.zeros((BLOCK_N,), tl.float32)
        acc_b = tl.zeros((BLOCK_N,), tl.float32)
        for start in range(0, n_partials, BLOCK_P):
            rows = start + tl.arange(0, BLOCK_P)
            inside = (rows[:, None] < n_partials) & (cols[None, :] < n_cols)
            offsets = rows[:, None] * n_cols + cols[None, :]
            acc_w += tl.sum(tl.load(partial_dw + offsets, mask=inside, other=0.0), 0)
            if HAS_BIAS:
                acc_b += tl.sum(tl.load(partial_db + offsets, mask=inside, other=0.0), 0)
        tl.store(dw + cols, acc_w.to(dw.dtype.element_ty), mask=cols < n_cols)
        if HAS_BIAS:
            tl.store(db + cols, acc_b.to(db.dtype.element_ty), mask=cols < n_cols)

    return triton, ce_forward, ce_backward, norm_forward, (norm_backward, column_sums)


# ---------------------------------------------------------------------------------------------
# Cross entropy
# ---------------------------------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
        _, ce_forward, _, _, _ = _kernels()
        shape = target.shape
        logits2d = logits.reshape(-1, logits.shape[-1])
        if logits2d.stride(-1) != 1:
            logits2d = logits2d.contiguous()
        target1d = target.reshape(-1).contiguous()
        rows, cols = logits2d.shape
        tp_size = tp_group.size() if tp_group is not None else 1
        vocab_start = (tp_group.rank() if tp_group is not None else 0) * cols
        row_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
        row_sumexp = torch.empty_like(row_max)
        predicted = torch.empty_like(row_max)
        ce_forward[(rows,)](logits2d, logits2d.stride(0), target1d, vocab_start, cols, row_max, row_sumexp,
                            predicted, BLOCK=min(CE_BLOCK, _next_power_of_2(cols)), num_warps=8)
        if tp_size > 1:
            local_max = row_max.clone()
            torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
            row_sumexp *= torch.exp(local_max - row_max)
            both = torch.stack((predicted, row_sumexp))
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.SUM, group=tp_group)
            predicted, row_sumexp = both[0], both[1].contiguous()
        loss = torch.log(row_sumexp) + row_max - predicted
        ctx.save_for_backward(logits2d, target1d, row_max, row_sumexp)
        ctx.vocab_start = vocab_start
        ctx.logits_shape = logits.shape
        return loss.view(shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        _, _, ce_backward, _, _ = _kernels()
        logits2d, target1d, row_max, row_sumexp = ctx.saved_tensors
        rows, cols = logits2d.shape
        grad = torch.empty_like(logits2d)
        ce_backward[(rows,)](logits2d, logits2d.stride(0), grad, target1d, ctx.vocab_start, cols, row_max,
                             row_sumexp, grad_loss.reshape(-1).float().contiguous(),
                             BLOCK=min(CE_BLOCK, _next_power_of_2(cols)), num_warps=8)
        return grad.view(ctx.logits_shape), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token cross entropy of ``logits`` [..., vocab slice] against ``target`` [...] (global ids).

    The same contract as megatron-core's ``fused_vocab_parallel_cross_entropy``: with tensor
    parallelism ``logits`` is this rank's slice of the vocabulary and ``tp_group`` its group.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)


# ---------------------------------------------------------------------------------------------
# LayerNorm / RMSNorm
# ---------------------------------------------------------------------------------------------


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                rms: bool) -> torch.Tensor:
        _, _, _, norm_forward, _ = _kernels()
        n_cols = x.shape[-1]
        x2d = x.reshape(-1, n_cols).contiguous()
        rows = x2d.shape[0]
        y = torch.empty_like(x2d)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        block = _next_power_of_2(n_cols)
        norm_forward[(rows,)](x2d, y, weight, bias if bias is not None else weight, mean, rstd, n_cols, eps,
                              RMS=rms, HAS_BIAS=bias is not None, BLOCK=block, num_warps=_norm_warps(block))
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.has_bias, ctx.rms, ctx.shape = bias is not None, rms, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        _, _, _, _, (norm_backward, column_sums) = _kernels()
        x2d, weight, mean, rstd = ctx.saved_tensors
        rows, n_cols = x2d.shape
        dy2d = dy.reshape(-1, n_cols).contiguous()
        dx = torch.empty_like(x2d)
        programs = min(rows, 4 * _multiprocessors(x2d.device))
        rows_per_program = -(-rows // programs)
        programs = -(-rows // rows_per_program)
        partial_dw = torch.empty(programs, n_cols, dtype=torch.float32, device=x2d.device)
        partial_db = torch.empty_like(partial_dw) if ctx.has_bias else partial_dw
        block = _next_power_of_2(n_cols)
        norm_backward[(programs,)](x2d, dy2d, dx, weight, mean, rstd, partial_dw, partial_db, rows, n_cols,
                                   rows_per_program, RMS=ctx.rms, HAS_BIAS=ctx.has_bias, BLOCK=block,
                                   num_warps=_norm_warps(block))
        dw = torch.empty_like(weight)
        db = torch.empty_like(weight) if ctx.has_bias else None
        column_sums[(_cdiv(n_cols, SUM_COLUMNS),)](partial_dw, partial_db, dw, db if db is not None else dw, programs,
                                                          n_cols, HAS_BIAS=ctx.has_bias, BLOCK_P=64, BLOCK_N=SUM_COLUMNS)
        return dx.view(ctx.shape), dw, db, None, None


class TritonNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) with Triton kernels; a drop-in for megatron-core's
    ``WrappedTorchNorm`` in a layer spec: same constructor, and ``weight``/``bias`` parameters named and
    shaped as torch's, so checkpoints load either way."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> None:
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        factory = {"dtype": config.params_dtype, "device": torch.cuda.current_device()}
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, **factory))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Norm.apply(x, self.weight, self.bias, self.eps, self.rms)

    def extra_repr(self) -> str:
        return f"{'RMSNorm' if self.rms else 'LayerNorm'}({self.normalized_shape[0]}, eps={self.eps})"


# ---------------------------------------------------------------------------------------------
# Linear layers with the bias in the matrix multiply
# ---------------------------------------------------------------------------------------------


class _LinearWithBias(torch.autograd.Function):
    """``input @ weight.T + bias`` as one ``addmm``; the backward is megatron-core's (its data and weight
    gradients as two matrix multiplies, the bias gradient as a sum over the tokens)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        out = torch.addmm(bias, input.reshape(-1, input.shape[-1]), weight.t())
        return out.view(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, weight = ctx.saved_tensors
        grad2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad_output.matmul(weight)
        grad_weight = grad2d.t().matmul(input.reshape(-1, input.shape[-1]))
        return grad_input, grad_weight, grad2d.sum(dim=0)


class BiasInGemmColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` whose own bias addition happens in the matrix multiply (see the module)."""

    #: For a frozen weight its forward is ColumnParallelLinear's (read by LoRA's fusion check,
    #: ``bridge_hpc.peft.lora_layers.FROZEN_FORWARD_IS_PLAIN``).
    frozen_forward_is_plain = True

    def _forward_impl(self, input, weight, *args, **kwargs):
        bias = kwargs.get("bias")
        plain = (bias is not None and weight.requires_grad and self.tp_group.size() == 1 and not args
                 and not kwargs.get("gradient_accumulation_fusion") and not kwargs.get("sequence_parallel")
                 and kwargs.get("grad_output_buffer") is None and kwargs.get("gtp_remat_size", 1) == 1)
        if not plain:
            return super()._forward_impl(input, weight, *args, **kwargs)
        return _LinearWithBias.apply(input, weight, bias)


def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the norm backward runs 4 programs on each); 1 off a GPU,
    where triton's interpreter runs the kernels."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 256))
