"""Which Hugging Face tensors make each megatron-core parameter: each family's mappings (torch-free).

As Megatron Bridge writes each model's bridge, a family here is a list of mappings
(:mod:`.param_mapping`: one class per kind, each holding both directions) in one
:class:`~bridge_hpc.training.hf.mapping_registry.MegatronMappingRegistry` (:func:`registry`), built from
the ``[model]`` fields: the sizes fix the shapes the login node checks a folder's headers against
(:func:`check_tensors`), the ranks' loader looks each of its parameters up in it, and the export
inverts it.

Transformer Engine's layers keep the layer norms inside the next linear layer
(``linear_qkv.layer_norm_weight``); megatron-core's sharded checkpoints use those names for the local
layers too: :func:`canonical` maps them to the local names the mappings use.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.hf import families
from bridge_hpc.training.hf.mapping_registry import MegatronMappingRegistry
from bridge_hpc.training.hf.param_mapping import (
    AutoMapping,
    ConcatenatedQKVMapping,
    ExpertMapping,
    GatedMLPMapping,
    QKVMapping,
)

#: Transformer Engine's (and megatron-core's sharded checkpoints') names -> the local spec's.
_TE_ALIASES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
#: The local spec's MoE experts (megatron-core's SequentialMLP): ``<EXPERTS><e>.linear_fc1.weight``.
EXPERTS = "mlp.experts.local_experts."
_EXPERT = re.compile(re.escape(EXPERTS) + r"(\d+)\.(.+)")
#: Tensors a Hugging Face file may hold that are no weights (buffers older transformers saved).
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)")


def canonical(name: str) -> str:
    """The local spec's name for a parameter named the Transformer Engine way (else ``name``)."""
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in _TE_ALIASES:
        return f"decoder.layers.{match.group(1)}.{_TE_ALIASES[match.group(2)]}"
    return name


def head_dim(model: Dict[str, Any]) -> int:
    return model.get("kv_channels") or model["hidden_size"] // model["num_attention_heads"]


def gpt2_prefix(names) -> str:
    """GPT-2 files saved from ``GPT2LMHeadModel`` prefix ``transformer.``; the Hub's original does not."""
    return "transformer." if any(n.startswith("transformer.") for n in names) else ""


def registry(family: str, model: Dict[str, Any], prefix: str = "") -> MegatronMappingRegistry:
    """Every parameter of the model (``model``: the ``[model]`` fields, finalized) for ``family``, as
    its registry. ``prefix``: GPT-2's (:func:`gpt2_prefix`)."""
    mappings = _gpt2(model, prefix) if family == "gpt2" else _llama(family, model)
    if not model["share_embeddings_and_output_weights"]:
        mappings.append(AutoMapping("output_layer.weight", "lm_head.weight", (model["vocab_size"], model["hidden_size"])))
    return MegatronMappingRegistry(*mappings, num_layers=model["num_layers"])


def _gpt2(model: Dict[str, Any], p: str) -> list:
    """GPT-2: LayerNorms with biases, learned positions, biased linear layers; its Conv1D weights are
    stored ``[in, out]`` (transposed), and ``c_attn`` holds q, k and v one after the other."""
    h, ffn, heads = model["hidden_size"], model["ffn_hidden_size"], model["num_attention_heads"]
    layer, meg = f"{p}h.{{i}}.", "decoder.layers.{i}."
    out = [AutoMapping("embedding.word_embeddings.weight", f"{p}wte.weight", (model["vocab_size"], h)),
           AutoMapping("embedding.position_embeddings.weight", f"{p}wpe.weight", (model["max_position_embeddings"], h)),
           AutoMapping("decoder.final_layernorm.weight", f"{p}ln_f.weight", (h,)),
           AutoMapping("decoder.final_layernorm.bias", f"{p}ln_f.bias", (h,))]
    for norm, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
        out += [AutoMapping(f"{meg}{norm}.{w}", f"{layer}{theirs}.{w}", (h,)) for w in ("weight", "bias")]
    return out + [
        ConcatenatedQKVMapping(f"{meg}self_attention.linear_qkv.weight", f"{layer}attn.c_attn.weight", heads, heads,
                               h // heads, hidden=h, transpose=True),
        ConcatenatedQKVMapping(f"{meg}self_attention.linear_qkv.bias", f"{layer}attn.c_attn.bias", heads, heads,
                               h // heads),
        AutoMapping(f"{meg}self_attention.linear_proj.weight", f"{layer}attn.c_proj.weight", (h, h), transpose=True),
        AutoMapping(f"{meg}self_attention.linear_proj.bias", f"{layer}attn.c_proj.bias", (h,)),
        AutoMapping(f"{meg}mlp.linear_fc1.weight", f"{layer}mlp.c_fc.weight", (ffn, h), transpose=True),
        AutoMapping(f"{meg}mlp.linear_fc1.bias", f"{layer}mlp.c_fc.bias", (ffn,)),
        AutoMapping(f"{meg}mlp.linear_fc2.weight", f"{layer}mlp.c_proj.weight", (h, ffn), transpose=True),
        AutoMapping(f"{meg}mlp.linear_fc2.bias", f"{layer}mlp.c_proj.bias", (h,))]


#: Where an MoE family keeps a layer's router and experts: ``(block, gate, up, down)`` names.
_MOE_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
              "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def _llama(family: str, model: Dict[str, Any]) -> list:
    """The rotary families (Llama, Mistral, Qwen2, Qwen3 and their MoE kin): RMSNorm, separate q/k/v
    (biased in Qwen2, per-head q/k norms in Qwen3), SwiGLU from ``gate_proj`` and ``up_proj``; in an
    MoE model's expert layers (:func:`_experts`) a router and experts instead of that MLP."""
    h, ffn, d = model["hidden_size"], model["ffn_hidden_size"], head_dim(model)
    heads = model["num_attention_heads"]
    groups = model.get("num_query_groups") or heads
    layer, meg = "model.layers.{i}.", "decoder.layers.{i}."
    attn = {x: f"{layer}self_attn.{x}_proj.weight" for x in "qkv"}
    out = [AutoMapping("embedding.word_embeddings.weight", "model.embed_tokens.weight", (model["vocab_size"], h)),
           AutoMapping("decoder.final_layernorm.weight", "model.norm.weight", (h,)),
           AutoMapping(f"{meg}input_layernorm.weight", f"{layer}input_layernorm.weight", (h,)),
           AutoMapping(f"{meg}pre_mlp_layernorm.weight", f"{layer}post_attention_layernorm.weight", (h,)),
           QKVMapping(f"{meg}self_attention.linear_qkv.weight", **attn, heads=heads, groups=groups, head_dim=d, hidden=h),
           AutoMapping(f"{meg}self_attention.linear_proj.weight", f"{layer}self_attn.o_proj.weight", (h, heads * d))]
    with_experts = families.moe_layers(model)
    # the layers with the dense MLP: None for every layer (a dense model), () for none (Mixtral)
    dense = tuple(i for i in range(model["num_layers"]) if i not in with_experts) if with_experts else None
    if dense != ():
        out += [GatedMLPMapping(f"{meg}mlp.linear_fc1.weight", f"{layer}mlp.gate_proj.weight",
                                f"{layer}mlp.up_proj.weight", (2 * ffn, h), layers=dense),
                AutoMapping(f"{meg}mlp.linear_fc2.weight", f"{layer}mlp.down_proj.weight", (h, ffn), layers=dense)]
    if with_experts:
        out += _experts(family, model, tuple(with_experts))
    if model.get("add_qkv_bias"):
        out.append(QKVMapping(f"{meg}self_attention.linear_qkv.bias", heads=heads, groups=groups, head_dim=d,
                              **{x: f"{layer}self_attn.{x}_proj.bias" for x in "qkv"}))
    if model.get("qk_layernorm"):
        out += [AutoMapping(f"{meg}self_attention.{x}_layernorm.weight", f"{layer}self_attn.{x}_norm.weight", (d,))
                for x in "qk"]
    return out


def _experts(family: str, model: Dict[str, Any], layers: Tuple[int, ...]) -> list:
    """An MoE layer's router (``[experts, hidden]``, whole on every rank), each expert's gated fc1 and
    fc2 (:class:`ExpertMapping`, the expert counted over the layer) and, in Qwen2-MoE, the shared expert
    and its sigmoid gate (``shared_expert_gate``, ``[1, hidden]``; megatron-core's
    ``moe_shared_expert_gate``)."""
    h, n, ffn = model["hidden_size"], model["num_moe_experts"], model["moe_ffn_hidden_size"]
    block, gate, up, down = _MOE_NAMES[family]
    layer, meg = f"model.layers.{{i}}.{block}.", "decoder.layers.{i}.mlp."
    expert = f"{layer}experts.{{e}}."
    out = [AutoMapping(f"{meg}router.weight", f"{layer}gate.weight", (n, h), layers=layers),
           ExpertMapping(GatedMLPMapping(f"{meg}experts.local_experts.{{e}}.linear_fc1.weight", f"{expert}{gate}.weight",
                                         f"{expert}{up}.weight", (2 * ffn, h), layers=layers, num_experts=n)),
           ExpertMapping(AutoMapping(f"{meg}experts.local_experts.{{e}}.linear_fc2.weight", f"{expert}{down}.weight",
                                     (h, ffn), layers=layers, num_experts=n))]
    shared = model.get("moe_shared_expert_intermediate_size")
    if shared:
        out += [GatedMLPMapping(f"{meg}shared_experts.linear_fc1.weight", f"{layer}shared_expert.gate_proj.weight",
                                f"{layer}shared_expert.up_proj.weight", (2 * shared, h), layers=layers),
                AutoMapping(f"{meg}shared_experts.linear_fc2.weight", f"{layer}shared_expert.down_proj.weight",
                            (h, shared), layers=layers)]
    if model.get("moe_shared_expert_gate"):
        out.append(AutoMapping(f"{meg}shared_experts.gate_weight", f"{layer}shared_expert_gate.weight", (1, h),
                               layers=layers))
    return out


def hf_shapes(family: str, model: Dict[str, Any], prefix: str = "") -> Dict[str, Tuple[int, ...]]:
    """The shape of every Hugging Face tensor the model is made of (``model``: finalized fields)."""
    return {name: shape for m in registry(family, model, prefix).resolved() for name, shape in m.hf_shapes().items()}


def check_tensors(tensors: Dict[str, Any], family: str, model: Dict[str, Any], folder: str) -> None:
    """Refuse, naming the file and tensor, a folder whose tensors (``name -> TensorInfo``, from the
    headers) do not make the model: one missing, of another shape, not a float dtype, or unknown."""
    from bridge_hpc.training.hf.safetensors_files import FLOAT_DTYPES

    prefix = gpt2_prefix(tensors) if family == "gpt2" else ""
    expected = hf_shapes(family, model, prefix)
    for name, shape in expected.items():
        info = tensors.get(name)
        if info is None:
            raise ConfigError(f"missing from the checkpoint's *.safetensors files (a {family} model with these "
                              f"[model] sizes has it, shape {list(shape)})", path=folder, key=name)
        if tuple(info.shape) != tuple(shape):
            raise ConfigError(f"has shape {list(info.shape)}, expected {list(shape)} from config.json", path=info.file,
                              key=name)
        if info.dtype not in FLOAT_DTYPES:
            raise ConfigError(f"has dtype {info.dtype}, expected one of {', '.join(FLOAT_DTYPES)}", path=info.file,
                              key=name)
    tied_head = {"lm_head.weight"} if model["share_embeddings_and_output_weights"] else set()
    for name, info in tensors.items():
        if name not in expected and name not in tied_head and not _IGNORED.fullmatch(name):
            raise ConfigError(f"unexpected tensor for a {family} model (no parameter is made of it)", path=info.file,
                              key=name)


def layer_number(name: str) -> Optional[Tuple[int, str]]:
    """``(local layer index, rest of the name)`` for ``decoder.layers.<j>.<rest>``, else None."""
    match = _LAYER.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def local_expert(rest: str) -> Optional[Tuple[int, str]]:
    """``(expert index, rest of the name)`` for a layer's ``mlp.experts.local_experts.<k>.<rest>``, else None."""
    match = _EXPERT.fullmatch(rest)
    return (int(match.group(1)), match.group(2)) if match else None


def check_folder(folder: str, model: Dict[str, Any]):
    """Everything about the Hugging Face folder ``folder`` that its config and headers tell, for the model
    ``model`` (finalized ``[model]`` fields); returns its :class:`SafetensorsFolder`. ConfigError naming
    the file and tensor otherwise. Torch-free: the login node's check before submission (the ranks
    read the same headers again)."""
    import os

    from bridge_hpc.training.hf.safetensors_files import SafetensorsFolder

    hf = families.read_config(folder)
    files = SafetensorsFolder(folder)
    check_tensors(files.tensors, hf["model_type"], model, os.path.abspath(folder))
    return files


def checked_model_config(folder: str):
    """The finalized GPTModelConfig of the Hugging Face folder ``folder`` alone (its config.json's fields,
    the toolkit's defaults for the rest), after :func:`check_folder`. Torch-free: ``bridge-hf import``
    refuses a bad folder with it before torch is imported."""
    import dataclasses
    import os

    from bridge_hpc.training.config import GPTModelConfig

    hf = families.read_config(folder)
    fields = families.model_fields(hf, os.path.join(folder, families.CONFIG_FILE))
    cfg = GPTModelConfig(hf_config=os.path.abspath(folder), **{k: v for k, v in fields.items() if v is not None})
    cfg.finalize()
    check_folder(folder, dataclasses.asdict(cfg))
    return cfg
