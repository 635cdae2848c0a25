"""Which Hugging Face tensors make each megatron-core parameter, and how (torch-free).

Megatron Bridge's param mappings, for the families here, as data: each :class:`Rule` names one
megatron-core parameter (its name in the local layer spec, layer ``{i}`` counted over the whole model),
the Hugging Face tensors it is made of and its kind:

- ``copy``: the same tensor on every tensor-parallel rank (norms, the row-parallel layers' biases,
  learned positions, Qwen3's per-head q/k norms);
- ``column`` / ``row``: split over the tensor-parallel ranks along the output (dim 0) / input (dim 1)
  dimension of megatron's ``[out, in]`` weight;
- ``vocab``: the embedding or untied output layer, rows padded with zeros to the padded vocabulary and
  split by rows;
- ``qkv``: megatron's fused ``linear_qkv``: per query group, that group's query heads, then its key
  head, then its value head (``[q_g0.., k_g0, v_g0, q_g1.., ...]``); a rank holds whole groups;
- ``gated``: the gated MLP's ``linear_fc1`` = ``[gate; up]``, each rank holding its gate rows and then
  its up rows.

GPT-2's Conv1D weights are stored ``[in, out]`` (``transpose``), and its ``c_attn`` holds q, k and v
side by side along ``out`` (offsets instead of three tensors). Transformer Engine's layers keep the
layer norms inside the next linear layer (``linear_qkv.layer_norm_weight``); megatron-core's sharded
checkpoints use those names for the local layers too: :func:`canonical` maps them to the local names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from bridge_hpc.contracts.errors import ConfigError

#: Transformer Engine's (and megatron-core's sharded checkpoints') names -> the local spec's.
_TE_ALIASES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
#: Tensors a Hugging Face file may hold that are no weights (buffers older transformers saved).
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)")


@dataclass(frozen=True)
class Rule:
    """One megatron parameter (``{i}``: the global layer number) from Hugging Face tensors ``hf`` (each
    with the row offset its part starts at, in megatron's ``[out, in]`` orientation)."""

    megatron: str
    kind: str
    hf: Tuple[Tuple[str, int], ...]
    transpose: bool = False


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


def rules(family: str, model: Dict[str, Any], prefix: str = "") -> List[Rule]:
    """Every parameter of the model (``model``: the ``[model]`` fields, finalized) for ``family``; layer
    rules hold ``{i}``. ``prefix``: GPT-2's (:func:`gpt2_prefix`)."""
    tied = model["share_embeddings_and_output_weights"]
    if family == "gpt2":
        p, h = prefix, model["hidden_size"]
        out = [Rule("embedding.word_embeddings.weight", "vocab", ((f"{p}wte.weight", 0),)),
               Rule("embedding.position_embeddings.weight", "copy", ((f"{p}wpe.weight", 0),)),
               Rule("decoder.final_layernorm.weight", "copy", ((f"{p}ln_f.weight", 0),)),
               Rule("decoder.final_layernorm.bias", "copy", ((f"{p}ln_f.bias", 0),))]
        layer = f"{p}h.{{i}}."
        for norm, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out += [Rule(f"decoder.layers.{{i}}.{norm}.{w}", "copy", ((f"{layer}{theirs}.{w}", 0),))
                    for w in ("weight", "bias")]
        qkv = lambda w: tuple((f"{layer}attn.c_attn.{w}", k * h) for k in range(3))  # noqa: E731
        out += [Rule("decoder.layers.{i}.self_attention.linear_qkv.weight", "qkv", qkv("weight"), transpose=True),
                Rule("decoder.layers.{i}.self_attention.linear_qkv.bias", "qkv", qkv("bias")),
                Rule("decoder.layers.{i}.self_attention.linear_proj.weight", "row",
                     ((f"{layer}attn.c_proj.weight", 0),), transpose=True),
                Rule("decoder.layers.{i}.self_attention.linear_proj.bias", "copy", ((f"{layer}attn.c_proj.bias", 0),)),
                Rule("decoder.layers.{i}.mlp.linear_fc1.weight", "column", ((f"{layer}mlp.c_fc.weight", 0),),
                     transpose=True),
                Rule("decoder.layers.{i}.mlp.linear_fc1.bias", "column", ((f"{layer}mlp.c_fc.bias", 0),)),
                Rule("decoder.layers.{i}.mlp.linear_fc2.weight", "row", ((f"{layer}mlp.c_proj.weight", 0),),
                     transpose=True),
                Rule("decoder.layers.{i}.mlp.linear_fc2.bias", "copy", ((f"{layer}mlp.c_proj.bias", 0),))]
        if not tied:
            out.append(Rule("output_layer.weight", "vocab", (("lm_head.weight", 0),)))
        return out
    layer = "model.layers.{i}."
    out = [Rule("embedding.word_embeddings.weight", "vocab", (("model.embed_tokens.weight", 0),)),
           Rule("decoder.final_layernorm.weight", "copy", (("model.norm.weight", 0),)),
           Rule("decoder.layers.{i}.input_layernorm.weight", "copy", ((f"{layer}input_layernorm.weight", 0),)),
           Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", "copy", ((f"{layer}post_attention_layernorm.weight", 0),)),
           Rule("decoder.layers.{i}.self_attention.linear_qkv.weight", "qkv",
                tuple((f"{layer}self_attn.{x}_proj.weight", 0) for x in "qkv")),
           Rule("decoder.layers.{i}.self_attention.linear_proj.weight", "row", ((f"{layer}self_attn.o_proj.weight", 0),)),
           Rule("decoder.layers.{i}.mlp.linear_fc1.weight", "gated",
                ((f"{layer}mlp.gate_proj.weight", 0), (f"{layer}mlp.up_proj.weight", 0))),
           Rule("decoder.layers.{i}.mlp.linear_fc2.weight", "row", ((f"{layer}mlp.down_proj.weight", 0),))]
    if model.get("add_qkv_bias"):
        out.append(Rule("decoder.layers.{i}.self_attention.linear_qkv.bias", "qkv",
                        tuple((f"{layer}self_attn.{x}_proj.bias", 0) for x in "qkv")))
    if model.get("qk_layernorm"):
        out += [Rule(f"decoder.layers.{{i}}.self_attention.{x}_layernorm.weight", "copy",
                     ((f"{layer}self_attn.{x}_norm.weight", 0),)) for x in "qk"]
    if not tied:
        out.append(Rule("output_layer.weight", "vocab", (("lm_head.weight", 0),)))
    return out


def layer_rules(all_rules: List[Rule]) -> Tuple[Dict[str, Rule], Dict[str, Rule]]:
    """``(rules of the layers by their name after "decoder.layers.{i}.", the other rules by name)``."""
    layers = {r.megatron[len("decoder.layers.{i}."):]: r for r in all_rules if "{i}" in r.megatron}
    others = {r.megatron: r for r in all_rules if "{i}" not in r.megatron}
    return layers, others


def hf_shapes(family: str, model: Dict[str, Any], prefix: str = "") -> Dict[str, Tuple[int, ...]]:
    """The shape of every Hugging Face tensor the model is made of (``model``: finalized fields)."""
    h, heads, d = model["hidden_size"], model["num_attention_heads"], head_dim(model)
    groups, ffn, vocab = model.get("num_query_groups") or heads, model["ffn_hidden_size"], model["vocab_size"]
    shapes: Dict[str, Tuple[int, ...]] = {}

    def out_size(rule: Rule, name: str, part: int) -> int:
        if rule.kind == "qkv":
            if rule.transpose or family == "gpt2":
                return 3 * h
            return (heads if part == 0 else groups) * d
        if rule.kind == "gated" or rule.megatron.endswith("linear_fc1.weight") or rule.megatron.endswith("linear_fc1.bias"):
            return ffn
        if rule.megatron.endswith("linear_proj.weight") or rule.megatron.endswith("linear_fc2.weight"):
            return h
        return h

    for rule in rules(family, model, prefix):
        for i in range(model["num_layers"]) if "{i}" in rule.megatron else [None]:
            for part, (template, _) in enumerate(rule.hf):
                name = template.format(i=i) if i is not None else template
                meg = rule.megatron
                if rule.kind == "vocab":
                    shape: Tuple[int, ...] = (vocab, h)
                elif meg.endswith("position_embeddings.weight"):
                    shape = (model["max_position_embeddings"], h)
                elif meg.endswith("q_layernorm.weight") or meg.endswith("k_layernorm.weight"):
                    shape = (d,)
                elif meg.endswith("linear_proj.weight"):
                    shape = (h, heads * d)
                elif meg.endswith("linear_fc2.weight"):
                    shape = (h, ffn)
                elif meg.endswith(".bias") and rule.kind != "copy":
                    shape = (out_size(rule, name, part),)
                elif meg.endswith(".weight") and rule.kind in ("qkv", "gated", "column"):
                    shape = (out_size(rule, name, part), h)
                else:  # norms and the row-parallel layers' biases
                    shape = (h,)
                if rule.transpose:
                    shape = tuple(reversed(shape))
                shapes[name] = shape
    return shapes


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


def check_folder(folder: str, model: Dict[str, Any]):
    """Everything about the Hugging Face folder ``folder`` that its config and headers tell, for the model
    ``model`` (finalized ``[model]`` fields); returns its :class:`SafetensorsFolder`. ConfigError naming
    the file and tensor otherwise. Torch-free: the login node's check before submission (the ranks
    read the same headers again)."""
    import os

    from bridge_hpc.training.hf import families
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
    from bridge_hpc.training.hf import families

    hf = families.read_config(folder)
    fields = families.model_fields(hf, os.path.join(folder, families.CONFIG_FILE))
    cfg = GPTModelConfig(hf_config=os.path.abspath(folder), **{k: v for k, v in fields.items() if v is not None})
    cfg.finalize()
    check_folder(folder, dataclasses.asdict(cfg))
    return cfg
