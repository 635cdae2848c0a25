"""Hugging Face ``config.json`` <-> the ``[model]`` section, per supported family. Torch-free: the login
node reads a folder's config here before anything is submitted, and ``bridge-hf export`` writes one.

A checkpoint fixes its architecture (:data:`ARCHITECTURE_KEYS`: shapes, norms, activation, biases,
positions, tied output): a ``[model]`` key that contradicts it is refused by name, since its weights
could not be loaded into that model. The other keys it fills (:data:`TRAINING_KEYS`: dropout, norm
epsilon, rotary base and scaling, initialization, context length) are the checkpoint's values unless
``[model]`` sets them: explicit keys win there.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

from bridge_hpc.contracts.errors import ConfigError

CONFIG_FILE = "config.json"
#: ``model_type`` values this toolkit converts (Megatron Bridge's names for the same families).
#: The Mixture-of-Experts families (Megatron Bridge's names): :func:`moe_fields` translates their
#: routing into megatron-core's MoE fields on ``[model]``, :func:`bridge_hpc.training.hf.mapping.registry`
#: maps their experts' tensors.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gpt2") + MOE_FAMILIES
#: The rotary families (Llama-shaped: RMSNorm, SwiGLU, rotary positions, no linear biases).
ROTARY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3") + MOE_FAMILIES
#: The MoE fields a checkpoint's weights (or its router's arithmetic) fix; absent: a dense model.
MOE_ARCHITECTURE_KEYS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                         "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_pre_softmax",
                         "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_layer_freq")
#: Fields a checkpoint's weights fix; a ``[model]`` value that differs is refused.
ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "kv_channels", "vocab_size", "normalization", "activation_func", "add_bias_linear",
                     "add_qkv_bias", "qk_layernorm", "position_embedding_type",
                     "share_embeddings_and_output_weights") + MOE_ARCHITECTURE_KEYS
#: Fields a checkpoint suggests; a ``[model]`` value wins.
TRAINING_KEYS = ("layernorm_epsilon", "rotary_base", "rope_scaling", "rope_scaling_factor", "hidden_dropout",
                 "attention_dropout", "init_method_std", "max_position_embeddings", "make_vocab_size_divisible_by",
                 "moe_aux_loss_coeff", "moe_input_jitter_eps")
#: Llama 3.1's frequency scaling as megatron-core implements it (``RotaryEmbedding._apply_scaling``:
#: only the factor is a parameter; these are fixed).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: Files a Hugging Face folder keeps its tokenizer in (``bridge-hf export`` copies those present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def read_config(folder: str) -> Dict[str, Any]:
    """The folder's ``config.json`` as a dict; ConfigError naming the file when it is missing or not a
    JSON object, or its ``model_type`` is not one of :data:`SUPPORTED`."""
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isdir(folder):
        raise ConfigError("expected a Hugging Face model folder (with config.json); there is no such folder", path=folder)
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ConfigError("missing: a Hugging Face model folder has its config.json (nothing is downloaded)",
                          path=path) from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"not readable as JSON ({type(err).__name__}: {err})", path=path) from None
    if not isinstance(hf, dict):
        raise ConfigError("expected a JSON object", path=path)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}",
                          path=path, key="model_type")
    return hf


def is_hf_folder(path: str) -> bool:
    """Whether ``path`` is a Hugging Face model folder (it has a ``config.json``; the toolkit's
    checkpoint folders never do)."""
    return bool(path) and os.path.isfile(os.path.join(path, CONFIG_FILE))


def _get(hf: Dict[str, Any], key: str, kind: type, path: str, default: Any = ...) -> Any:
    value = hf.get(key, default)
    if value is ...:
        raise ConfigError(f"missing (a {hf['model_type']} config has it)", path=path, key=key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if value is not None and not (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        raise ConfigError(f"expected {kind.__name__}, got {value!r}", path=path, key=key)
    return value


def _positive(hf: Dict[str, Any], key: str, path: str, default: Any = ...) -> int:
    value = _get(hf, key, int, path, default)
    if value is None or value <= 0:
        raise ConfigError(f"expected an integer > 0, got {value!r}", path=path, key=key)
    return value


def _rope(hf: Dict[str, Any], path: str) -> Dict[str, Any]:
    """The rotary fields from transformers 5's ``rope_parameters`` or 4's ``rope_theta`` + ``rope_scaling``."""
    params = hf.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        key = "rope_scaling"
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ConfigError(f"expected an object, got {params!r}", path=path, key=key)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0 or float(theta) != int(theta):
        raise ConfigError(f"rope_theta must be a positive whole number (megatron-core's rotary_base), got {theta!r}",
                          path=path, key=key)
    out: Dict[str, Any] = {"rotary_base": int(theta), "rope_scaling": False}
    if rope_type == "llama3":
        for name, fixed in LLAMA3_FIXED.items():
            if float(params.get(name, fixed)) != fixed:
                raise ConfigError(f"{name} = {params.get(name)!r}: megatron-core's llama3 rope scaling fixes it at "
                                  f"{fixed:g}", path=path, key=f"{key}.{name}")
        factor = params.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise ConfigError(f"expected a factor > 0, got {factor!r}", path=path, key=f"{key}.factor")
        out.update(rope_scaling=True, rope_scaling_factor=float(factor))
    elif rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported (supported: default, llama3)", path=path,
                          key=f"{key}.rope_type")
    return out


def model_fields(hf: Dict[str, Any], path: str) -> Dict[str, Any]:
    """The ``[model]`` fields (:data:`ARCHITECTURE_KEYS` and :data:`TRAINING_KEYS`) of a checkpoint
    whose ``config.json`` (at ``path``) is ``hf``; ConfigError naming the config key it cannot follow."""
    family = hf["model_type"]
    if family == "gpt2":
        return _gpt2_fields(hf, path)
    hidden = _positive(hf, "hidden_size", path)
    heads = _positive(hf, "num_attention_heads", path)
    groups = _positive(hf, "num_key_value_heads", path, heads) if hf.get("num_key_value_heads") is not None else heads
    head_dim = hf.get("head_dim")
    head_dim = _positive(hf, "head_dim", path) if head_dim is not None else hidden // heads
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf.get('hidden_act')!r}: the {family} family here is SwiGLU (silu)",
                          path=path, key="hidden_act")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{flag} = true is not supported (megatron-core biases either every linear layer "
                              "or only the QKV projection)", path=path, key=flag)
    fields: Dict[str, Any] = {
        "num_layers": _positive(hf, "num_hidden_layers", path), "hidden_size": hidden,
        "num_attention_heads": heads, "num_query_groups": groups,
        "ffn_hidden_size": _positive(hf, "intermediate_size", path),
        "kv_channels": head_dim, "vocab_size": _positive(hf, "vocab_size", path),
        "normalization": "RMSNorm", "activation_func": "swiglu", "add_bias_linear": False,
        "add_qkv_bias": family == "qwen2" or (family == "qwen2_moe" and _get(hf, "qkv_bias", bool, path, True)),
        "qk_layernorm": family in ("qwen3", "qwen3_moe"),
        "position_embedding_type": "rope",
        "share_embeddings_and_output_weights": bool(_get(hf, "tie_word_embeddings", bool, path, False)),
        "layernorm_epsilon": _get(hf, "rms_norm_eps", float, path, 1e-6),
        "hidden_dropout": 0.0, "attention_dropout": _get(hf, "attention_dropout", float, path, 0.0),
        "init_method_std": _get(hf, "initializer_range", float, path, 0.02),
        "max_position_embeddings": _positive(hf, "max_position_embeddings", path),
        "make_vocab_size_divisible_by": 1,
    }
    fields.update(_rope(hf, path))
    if family in MOE_FAMILIES:
        fields.update(moe_fields(hf, path, fields["num_layers"]))
    return fields


def _experts_key(hf: Dict[str, Any]) -> str:
    """The key a config.json counts the experts with: ``num_experts`` (Qwen's), ``num_local_experts``
    (Mixtral's, and transformers 5's name for Qwen3-MoE's)."""
    return "num_experts" if hf.get("num_experts") is not None else "num_local_experts"


def moe_fields(hf: Dict[str, Any], path: str, num_layers: int) -> Dict[str, Any]:
    """The ``[model]`` MoE fields (megatron-core's names) of a Qwen3-MoE, Mixtral or Qwen2-MoE
    ``config.json``, set so that megatron-core's router computes what transformers' does.

    transformers routes by ``softmax`` over all experts, then the top ``num_experts_per_tok``; with
    ``norm_topk_prob`` (always in Mixtral) the chosen probabilities are divided by their sum, which is
    the softmax over the chosen logits alone: megatron-core's ``moe_router_pre_softmax = false``
    (top-k of the logits, then softmax). Without it they stay the full softmax's:
    ``moe_router_pre_softmax = true``. No scaling factor either way. A layer is an expert layer where
    ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers`` (Qwen; every layer
    in Mixtral): ``moe_layer_freq`` is that pattern (megatron-core's list form; 1 when every layer is)."""
    family = hf["model_type"]
    experts = _positive(hf, _experts_key(hf), path)
    topk = _positive(hf, "num_experts_per_tok", path)
    if topk > experts:
        raise ConfigError(f"is {topk}, more than the {experts} experts", path=path, key="num_experts_per_tok")
    if family == "mixtral":
        ffn, renormalized, pattern = _positive(hf, "intermediate_size", path), True, [1] * num_layers
    else:
        ffn = _positive(hf, "moe_intermediate_size", path)
        renormalized = _get(hf, "norm_topk_prob", bool, path, False)
        step = _positive(hf, "decoder_sparse_step", path, 1)
        dense = _get(hf, "mlp_only_layers", list, path, [])
        for i in dense:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers:
                raise ConfigError(f"expected layer numbers 0 to {num_layers - 1}, got {i!r}", path=path,
                                  key="mlp_only_layers")
        pattern = [0 if i in dense or (i + 1) % step else 1 for i in range(num_layers)]
    if not any(pattern):
        raise ConfigError("no layer has experts (decoder_sparse_step and mlp_only_layers leave none)", path=path,
                          key="mlp_only_layers")
    shared = _positive(hf, "shared_expert_intermediate_size", path) if family == "qwen2_moe" else None
    return {"num_moe_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": ffn,
            "moe_shared_expert_intermediate_size": shared, "moe_shared_expert_gate": shared is not None,
            "moe_router_pre_softmax": not renormalized, "moe_router_score_function": "softmax",
            "moe_router_topk_scaling_factor": None, "moe_layer_freq": 1 if all(pattern) else pattern,
            "moe_aux_loss_coeff": _get(hf, "router_aux_loss_coef", float, path, 0.001),
            "moe_input_jitter_eps": _get(hf, "router_jitter_noise", float, path, 0.0) or None}


def moe_layers(model: Dict[str, Any]) -> List[int]:
    """The layers (0-based) with experts of a ``[model]`` section: every layer, or those its
    ``moe_layer_freq`` marks (an int ``n``: layers 0, n, 2n, ... as megatron-core reads it; a list: 1s);
    none without ``num_moe_experts``."""
    if not model.get("num_moe_experts"):
        return []
    freq, layers = model.get("moe_layer_freq", 1), model["num_layers"]
    if isinstance(freq, int):
        return [i for i in range(layers) if i % freq == 0]
    return [i for i, flag in enumerate(freq) if flag]


def _gpt2_fields(hf: Dict[str, Any], path: str) -> Dict[str, Any]:
    hidden = _positive(hf, "n_embd", path)
    activation = {"gelu_new": "openai_gelu", "gelu_pytorch_tanh": "openai_gelu", "gelu": "gelu"}.get(
        hf.get("activation_function", "gelu_new"))
    if activation is None:
        raise ConfigError(f"activation_function {hf.get('activation_function')!r} is not supported (gelu_new, "
                          "gelu_pytorch_tanh, gelu)", path=path, key="activation_function")
    for flag, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                         ("add_cross_attention", False)):
        if hf.get(flag, wanted) != wanted:
            raise ConfigError(f"{flag} = {hf.get(flag)!r} is not supported (megatron-core's attention: "
                              f"{flag} = {wanted})", path=path, key=flag)
    n_inner = hf.get("n_inner")
    return {
        "num_layers": _positive(hf, "n_layer", path), "hidden_size": hidden,
        "num_attention_heads": _positive(hf, "n_head", path), "num_query_groups": None,
        "ffn_hidden_size": _positive(hf, "n_inner", path) if n_inner is not None else 4 * hidden,
        "kv_channels": None, "vocab_size": _positive(hf, "vocab_size", path),
        "normalization": "LayerNorm", "activation_func": activation, "add_bias_linear": True,
        "add_qkv_bias": False, "qk_layernorm": False, "position_embedding_type": "learned_absolute",
        "share_embeddings_and_output_weights": bool(_get(hf, "tie_word_embeddings", bool, path, True)),
        "layernorm_epsilon": _get(hf, "layer_norm_epsilon", float, path, 1e-5),
        "hidden_dropout": _get(hf, "resid_pdrop", float, path, 0.1),
        "attention_dropout": _get(hf, "attn_pdrop", float, path, 0.1),
        "init_method_std": _get(hf, "initializer_range", float, path, 0.02),
        "max_position_embeddings": _positive(hf, "n_positions", path),
        "make_vocab_size_divisible_by": 1,
    }


def fill_model_section(section: Dict[str, Any], folder: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``[model]`` filled from the Hugging Face folder ``folder``: the checkpoint's fields, with the
    section's own values where it sets them. Returns ``(filled section, config.json as a dict)``.

    Explicit :data:`TRAINING_KEYS` win; an explicit :data:`ARCHITECTURE_KEYS` value that differs from
    the checkpoint's raises ConfigError naming ``model.<key>`` (``num_query_groups`` and ``kv_channels``
    compare after their defaults are applied: the head count, and hidden size / heads)."""
    hf = read_config(folder)
    path = os.path.join(folder, CONFIG_FILE)
    fields = model_fields(hf, path)
    for key in ARCHITECTURE_KEYS:
        if key not in section:
            continue
        mine, theirs = section[key], fields.get(key)  # a dense checkpoint has no MoE fields
        if key == "num_query_groups" and theirs is None:
            theirs = fields["num_attention_heads"]
        if key == "kv_channels" and theirs is None:
            theirs = fields["hidden_size"] // fields["num_attention_heads"]
        if mine is None and key in ("num_query_groups", "kv_channels"):
            continue  # "the default": filled from the checkpoint
        if mine != theirs:
            raise ConfigError(f"is {mine!r}, but the checkpoint in {folder} has {theirs!r} ({hf['model_type']} "
                              f"{CONFIG_FILE}); leave it out to take the checkpoint's", key=f"model.{key}")
    filled = {k: v for k, v in fields.items() if v is not None}
    filled.update(section)
    seq_length = filled.get("seq_length")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", hf["model_type"] in ("mistral", "mixtral")) else None
    if isinstance(window, int) and isinstance(seq_length, int) and seq_length > window:
        raise ConfigError(f"{seq_length} exceeds the checkpoint's sliding_window ({window}, {path}): attention over "
                          "a sliding window is not implemented here, so sequences must fit in it", key="model.seq_length")
    return filled, hf


def family_of(model: Dict[str, Any]) -> Optional[str]:
    """The family a ``[model]`` section (as ``run_config.json`` records it) exports as, or None when no
    supported family has its architecture (the caller names what does not fit: :func:`misfit`)."""
    return None if misfit(model) else _family_guess(model)


def _family_guess(model: Dict[str, Any]) -> str:
    if model.get("position_embedding_type") == "learned_absolute":
        return "gpt2"
    if model.get("num_moe_experts"):
        if model.get("moe_shared_expert_intermediate_size"):
            return "qwen2_moe"
        return "qwen3_moe" if model.get("qk_layernorm") else "mixtral"
    if model.get("qk_layernorm"):
        return "qwen3"
    return "qwen2" if model.get("add_qkv_bias") else "llama"


def misfit(model: Dict[str, Any]) -> Optional[Tuple[str, str]]:
    """``(model.<key>, what the family needs)`` for the first field that no supported family has, or None."""
    family = _family_guess(model)
    if family == "gpt2":
        wanted = {"normalization": "LayerNorm", "add_bias_linear": True, "add_qkv_bias": False,
                  "qk_layernorm": False, "rope_scaling": False}
        if model.get("activation_func") not in ("gelu", "openai_gelu"):
            return "model.activation_func", "gelu or openai_gelu (GPT-2)"
        if model.get("num_query_groups") not in (None, model.get("num_attention_heads")):
            return "model.num_query_groups", "the number of heads (GPT-2 has no grouped-query attention)"
    else:
        wanted = {"normalization": "RMSNorm", "activation_func": "swiglu", "add_bias_linear": False,
                  "position_embedding_type": "rope"}
        if model.get("rotary_percent", 1.0) != 1.0:
            return "model.rotary_percent", "1.0 (Llama-family rotary embeddings cover the whole head)"
    if family in MOE_FAMILIES:
        wanted.update(moe_router_score_function="softmax", moe_router_topk_scaling_factor=None,
                      moe_shared_expert_gate=family == "qwen2_moe")
        if family == "mixtral":  # every layer's experts, of the dense size, renormalized top-k
            wanted.update(moe_router_pre_softmax=False, moe_ffn_hidden_size=model.get("ffn_hidden_size"))
            if len(moe_layers(model)) != model.get("num_layers"):
                return "model.moe_layer_freq", "1: experts in every layer (the mixtral family)"
    for key, value in wanted.items():
        if model.get(key) != value:
            return f"model.{key}", f"{value!r} (the {family} family)"
    return None


def _moe_config(model: Dict[str, Any], family: str, config: Dict[str, Any]) -> Dict[str, Any]:
    """The MoE keys of an exported ``config.json`` (:func:`moe_fields` the other way); ``config``: what
    it holds so far (the expert count keeps the key the starting folder used, else ``num_experts``,
    which transformers 4 and 5 both read for Qwen)."""
    out: Dict[str, Any] = {"num_experts_per_tok": model["moe_router_topk"],
                           "router_aux_loss_coef": model.get("moe_aux_loss_coeff", 0.0)}
    if family == "mixtral":
        out.update(num_local_experts=model["num_moe_experts"], router_jitter_noise=model.get("moe_input_jitter_eps") or 0.0)
        return out
    with_experts = set(moe_layers(model))
    out.update({"num_local_experts" if "num_local_experts" in config else "num_experts": model["num_moe_experts"]})
    out.update(moe_intermediate_size=model["moe_ffn_hidden_size"],
               norm_topk_prob=not model["moe_router_pre_softmax"], decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(model["num_layers"]) if i not in with_experts])
    if family == "qwen2_moe":
        out.update(shared_expert_intermediate_size=model["moe_shared_expert_intermediate_size"],
                   qkv_bias=bool(model.get("add_qkv_bias")))
    return out


def hf_config(model: Dict[str, Any], base: Optional[Dict[str, Any]], dtype: str,
              special_tokens: Optional[Dict[str, Optional[int]]] = None) -> Dict[str, Any]:
    """The ``config.json`` of an exported model: ``base`` (the ``config.json`` the run started from, when
    it had one) with the model's fields written over it, or a fresh one for the model's family.
    ``dtype``: the dtype name the tensors are saved in. ``special_tokens``: the run's tokenizer's
    ``bos``/``eos``/``pad`` ids, written into a fresh config (each of them, None where the tokenizer has
    none): without them transformers fills in its class's defaults (GPT-2's 50256, Llama's 1 and 2),
    which are not this model's tokens and may lie outside its vocabulary. Any ``*_token_id`` outside
    the vocabulary is written as None (it names no token)."""
    family = base["model_type"] if base else _family_guess(model)
    out: Dict[str, Any] = dict(base or {})
    out["model_type"] = family
    vocab = model["vocab_size"]
    if family == "gpt2":
        out.update(architectures=["GPT2LMHeadModel"], n_embd=model["hidden_size"], n_layer=model["num_layers"],
                   n_head=model["num_attention_heads"], n_inner=model["ffn_hidden_size"],
                   n_positions=model["max_position_embeddings"], vocab_size=vocab,
                   activation_function="gelu_new" if model["activation_func"] == "openai_gelu" else "gelu",
                   layer_norm_epsilon=model["layernorm_epsilon"],
                   tie_word_embeddings=model["share_embeddings_and_output_weights"],
                   resid_pdrop=model["hidden_dropout"], embd_pdrop=model["hidden_dropout"],
                   attn_pdrop=model["attention_dropout"], initializer_range=model["init_method_std"])
        out.setdefault("n_ctx", model["max_position_embeddings"])
    else:
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM"}[family]
        head_dim = model.get("kv_channels") or model["hidden_size"] // model["num_attention_heads"]
        rope: Dict[str, Any] = {"rope_theta": float(model["rotary_base"]), "rope_type": "default"}
        if model.get("rope_scaling"):
            rope.update(rope_type="llama3", factor=float(model["rope_scaling_factor"]), **LLAMA3_FIXED)
        out.pop("rope_scaling", None)
        out.pop("rope_theta", None)
        out.update(architectures=[arch], hidden_size=model["hidden_size"], num_hidden_layers=model["num_layers"],
                   num_attention_heads=model["num_attention_heads"],
                   num_key_value_heads=model.get("num_query_groups") or model["num_attention_heads"],
                   head_dim=head_dim, intermediate_size=model["ffn_hidden_size"], vocab_size=vocab,
                   hidden_act="silu", rms_norm_eps=model["layernorm_epsilon"],
                   max_position_embeddings=model["max_position_embeddings"],
                   tie_word_embeddings=model["share_embeddings_and_output_weights"],
                   attention_dropout=model["attention_dropout"], initializer_range=model["init_method_std"],
                   rope_parameters=rope)
        if family in ("llama", "qwen3", "qwen3_moe"):
            out.update(attention_bias=False)
        if family == "llama":
            out.update(mlp_bias=False)
        if family in MOE_FAMILIES:
            out.update(_moe_config(model, family, out))
    if base is None:
        out.update({f"{name}_token_id": (special_tokens or {}).get(name) for name in ("bos", "eos", "pad")})
    for key, value in list(out.items()):
        if key.endswith("_token_id") and isinstance(value, int) and not 0 <= value < vocab:
            out[key] = None
    out["dtype"] = dtype
    out.pop("torch_dtype", None)
    return out
