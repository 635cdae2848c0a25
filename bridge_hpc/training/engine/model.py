"""The GPT model (megatron-core ``GPTModel``) and its SDPA core attention.

megatron-core's local ``DotProductAttention`` asks ``torch.cuda`` for a buffer and cannot run on
CPU; :class:`SDPACoreAttention` replaces it in the layer spec with
``torch.nn.functional.scaled_dot_product_attention``, which runs everywhere and on an H100 is faster
and leaner than the unfused local kernel (see the project notes). Transformer Engine's spec is used
only when asked for (``model.transformer_impl``), importable, and on CUDA; otherwise the local spec
with SDPA. The forward step lives in :mod:`bridge_hpc.training.gpt_step` (re-exported here).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.config import GPTModelConfig
from bridge_hpc.training.gpt_step import forward_step, get_batch
from bridge_hpc.training.losses import masked_next_token_loss, masked_token_loss

logger = logging.getLogger(__name__)


class SDPACoreAttention(MegatronModule):
    """Core attention via ``scaled_dot_product_attention``: [s, b, heads, dim] in, [s, b, heads·dim] out.

    Constructor and forward take megatron-core's core-attention arguments, so it drops into
    ``self_attention.submodules.core_attention``. Without a mask, causal masking uses SDPA's
    ``is_causal``; an explicit megatron mask (True = masked out) is inverted for SDPA and used whatever
    the mask type, because a given mask can say more than "causal" (indexed data with
    ``reset_attention_mask`` masks across document boundaries). Grouped-query attention uses SDPA's
    ``enable_gqa``.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention does not support packed sequences")
        s, b, heads, dim = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # -> [b, heads, s, dim]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask.bool()
        if attention_bias is not None:
            bias = attention_bias.to(q.dtype)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=mask is None and mask_type == AttnMaskType.causal,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * dim)


#: GPTModelConfig fields that share a TransformerConfig field's name but not its meaning, so are not
#: passed through: the activation is named here and a function there; ``transformer_impl`` picks the
#: layer spec (:func:`_layer_spec`), ``cuda_graph_*`` the toolkit's whole-step graph
#: (:mod:`bridge_hpc.training.engine.cuda_graphs`), not megatron-core's per-layer graphs.
_NOT_PASSED_THROUGH = frozenset({"activation_func", "transformer_impl", "cuda_graph_impl", "cuda_graph_warmup_steps"})

#: ``model.activation_func`` -> (megatron-core's activation function, gated linear unit).
_ACTIVATIONS = {"gelu": (F.gelu, False), "openai_gelu": (functools.partial(F.gelu, approximate="tanh"), False),
                "silu": (F.silu, False), "swiglu": (F.silu, True)}


def transformer_config(cfg: GPTModelConfig) -> TransformerConfig:
    """megatron-core's TransformerConfig for ``cfg``; CPU initialization when there is no GPU.

    Every ``[model]`` field that is also a TransformerConfig field is passed by name (so a field added
    to both needs no line here), except :data:`_NOT_PASSED_THROUGH`; the rest is derived."""
    activation, gated = _ACTIVATIONS[cfg.activation_func]
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32
    names = {f.name for f in dataclasses.fields(TransformerConfig)} - _NOT_PASSED_THROUGH
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in names}
    return TransformerConfig(
        **shared, activation_func=activation, gated_linear_unit=gated,
        params_dtype=dtype, pipeline_dtype=dtype, cross_entropy_fusion_impl="native",
        use_cpu_initialization=not torch.cuda.is_available(),
    )


def _te_layers(cfg: GPTModelConfig) -> bool:
    """Whether the model is built of Transformer Engine's layers: asked for, on CUDA, with the package."""
    return (cfg.transformer_impl == "transformer_engine" and torch.cuda.is_available()
            and importlib.util.find_spec("transformer_engine") is not None)


def _layer_spec(cfg: GPTModelConfig):
    if _te_layers(cfg):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
    if cfg.transformer_impl == "transformer_engine":
        logger.warning("model.transformer_impl = \"transformer_engine\", but this rank has %s: the local layers run "
                       "(the same parameters and checkpoints)",
                       "no CUDA" if not torch.cuda.is_available() else "no transformer_engine package")
    # The local layers stand in for Transformer Engine's where it is missing, except for what only
    # its layers do (megatron-core's own assertion would end the rank with a traceback).
    for key, needed in (("model.sequence_parallel", cfg.sequence_parallel),
                        ("model.context_parallel_size", cfg.context_parallel_size > 1)):
        if needed:
            raise ConfigError(f"needs Transformer Engine on the ranks' GPUs (pip install '.[gpu]'); this rank has "
                              f"{'no CUDA' if not torch.cuda.is_available() else 'no transformer_engine package'}",
                              key=key)
    if cfg.low_precision:  # (pretrain's check names the key a job set; a model built directly lands here)
        raise ConfigError(f"{cfg.low_precision.upper()} needs Transformer Engine's layers on a GPU; this rank has "
                          f"{'no CUDA' if not torch.cuda.is_available() else 'no transformer_engine package'}",
                          key=f"model.{cfg.low_precision}")
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm))
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def _block_spec(cfg: GPTModelConfig, config: TransformerConfig, vp_stage: Optional[int]):
    """The decoder's spec: the layer spec, or with ``model.fused_kernels`` the block's submodules with
    every norm (the layers' two and the final one, which a layer spec cannot name) the Triton one and
    the column-parallel linear layers adding their bias in the matrix multiply; with experts, the
    block's submodules with the MoE layers where ``model.moe_layer_freq`` puts them."""
    layer = _layer_spec(cfg)
    fused = cfg.fused_kernels and cfg.transformer_impl == "local"
    if fused:
        _fuse_dense_layer(layer)
    if cfg.is_moe:
        from bridge_hpc.training.engine import moe

        block = moe.decoder_block_spec(cfg, config, vp_stage, layer, te=_te_layers(cfg))
        if fused:
            from bridge_hpc.training.engine.fused_kernels import TritonNorm

            block.layer_norm = TritonNorm
            for spec in block.layer_specs:
                spec.submodules.pre_mlp_layernorm = TritonNorm
        return block
    if not fused:
        return layer  # (Transformer Engine's layers fuse their norms and biases themselves: the loss only)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from bridge_hpc.training.engine.fused_kernels import TritonNorm

    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=TritonNorm)


def _fuse_dense_layer(layer) -> None:
    """``model.fused_kernels`` on a local layer spec: the Triton norms, and the QKV and first MLP
    projections adding their bias in the matrix multiply."""
    from bridge_hpc.training.engine.fused_kernels import BiasInGemmColumnParallelLinear, TritonNorm

    layer.submodules.input_layernorm = TritonNorm
    layer.submodules.pre_mlp_layernorm = TritonNorm
    layer.submodules.self_attention.submodules.linear_qkv = BiasInGemmColumnParallelLinear
    mlp = layer.submodules.mlp  # megatron-core 0.19 spells the MLP's spec as a partial of MLP.as_mlp_submodule
    (mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules).linear_fc1 = \
        BiasInGemmColumnParallelLinear


class TritonLossGPTModel(GPTModel):
    """megatron-core's GPT whose language-model loss is the Triton cross entropy (``model.fused_kernels``):
    the one method megatron-core gives for the loss, with its shapes ([b, s] labels, [s, b, vocab slice]
    logits in, [b, s] losses out)."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        from bridge_hpc.training.engine.fused_kernels import vocab_parallel_cross_entropy

        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()


class HostRotaryEmbedding(RotaryEmbedding):
    """megatron-core's rotary embedding where there is no CUDA: its ``get_emb`` moves the frequencies to
    ``torch.cuda.current_device()`` at the first forward, which fails on a CPU rank; this one computes the
    same embedding ([seq, 1, 1, dim], halves not interleaved unless ``rotary_interleaved``) where the
    frequencies are."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


def padded_vocab_size(cfg: GPTModelConfig) -> int:
    """Vocabulary rounded up to ``make_vocab_size_divisible_by`` (megatron's convention)."""
    multiple = cfg.make_vocab_size_divisible_by * cfg.tensor_model_parallel_size
    return ((cfg.vocab_size + multiple - 1) // multiple) * multiple


def gpt_model_provider(cfg: GPTModelConfig, pre_process: bool = True, post_process: bool = True,
                       vp_stage: Optional[int] = None) -> GPTModel:
    """Build the (unwrapped) GPT on the current device: the whole model, or with pipeline
    parallelism the layers of this stage (``pre_process``: it holds the embedding; ``post_process``:
    the output layer and loss; ``vp_stage``: which interleaved chunk of the stage)."""
    extra = {"vp_stage": vp_stage} if vp_stage is not None else {}
    config = transformer_config(cfg)
    model = (TritonLossGPTModel if cfg.fused_kernels else GPTModel)(
        config=config, transformer_layer_spec=_block_spec(cfg, config, vp_stage),
        vocab_size=padded_vocab_size(cfg), max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type, rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base, rope_scaling=cfg.rope_scaling, rope_scaling_factor=cfg.rope_scaling_factor,
        **extra,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
        return model
    if isinstance(getattr(model, "rotary_pos_emb", None), RotaryEmbedding):
        model.rotary_pos_emb.__class__ = HostRotaryEmbedding
    if cfg.is_moe:
        from bridge_hpc.training.engine import moe

        moe.to_host(model)
    return model


# The forward step and its loss moved to gpt_step and losses (Bridge's modules); these names stay
# importable from here, where job files and forward steps written before found them.
__all__ = ["SDPACoreAttention", "TritonLossGPTModel", "HostRotaryEmbedding", "transformer_config", "gpt_model_provider",
           "padded_vocab_size", "forward_step", "get_batch", "masked_next_token_loss", "masked_token_loss"]
