"""The Mixture-of-Experts families' mappings and config translation (Qwen3-MoE, Mixtral, Qwen2-MoE), on
CPU, against tiny random folders saved by transformers and the toolkit's MoE GPT of the translated fields
(``bridge-hf`` itself on these families: tests/test_hf_cli.py).

The folder's headers fit the family's registry exactly; HF -> megatron -> HF is bitwise; the registry's
megatron names and shapes are those of megatron-core's local layer spec; megatron-core's router with
the translated fields gives transformers' logits; an expert-parallel rank's local experts are the right
global ones; a folder whose expert count or tensors do not fit is refused naming the file and the key."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from bridge_test_helpers import single_rank_world
from hf_models import MOE_FAMILIES, VOCAB, batch, hf_logits, make_hf_folders, model_config, safetensors_in

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.hf import families, mapping
from bridge_hpc.training.hf.param_mapping import Shard
from bridge_hpc.training.hf.safetensors_files import SafetensorsFolder

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return make_hf_folders(tmp_path_factory.mktemp("hf-moe"), MOE_FAMILIES)


@pytest.fixture
def world():
    yield from single_rank_world()


def _fields(folder: str) -> dict:
    path = os.path.join(folder, families.CONFIG_FILE)
    with open(path) as f:
        return families.model_fields(json.load(f), path)


def test_config_json_gives_megatron_cores_moe_fields(folders):
    qwen3, mixtral, qwen2 = (_fields(folders[f]) for f in MOE_FAMILIES)
    assert (qwen3["num_moe_experts"], qwen3["moe_router_topk"], qwen3["moe_ffn_hidden_size"]) == (4, 2, 32)
    assert qwen3["moe_layer_freq"] == [1, 0, 1] and qwen3["ffn_hidden_size"] == 96  # layer 1: the dense MLP
    assert qwen3["moe_router_pre_softmax"] is False and qwen3["qk_layernorm"] and not qwen3["add_qkv_bias"]
    assert mixtral["moe_layer_freq"] == 1 and mixtral["moe_ffn_hidden_size"] == mixtral["ffn_hidden_size"] == 32
    assert mixtral["moe_router_pre_softmax"] is False and mixtral["moe_shared_expert_intermediate_size"] is None
    assert qwen2["moe_router_pre_softmax"] is True  # norm_topk_prob = false: the full softmax's top k
    assert (qwen2["moe_shared_expert_intermediate_size"], qwen2["moe_shared_expert_gate"]) == (48, True)
    assert qwen2["add_qkv_bias"] and all(f["moe_router_score_function"] == "softmax" and
                                         f["moe_router_topk_scaling_factor"] is None for f in (qwen3, mixtral, qwen2))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_an_exported_config_reads_back_as_the_same_fields(folders, family):
    fields = _fields(folders[family])
    assert families.family_of(fields) == family
    fresh = families.hf_config(fields, None, "float32")
    assert families.model_fields(fresh, "config.json") == fields
    with open(os.path.join(folders[family], families.CONFIG_FILE)) as f:
        base = json.load(f)
    assert families.model_fields(families.hf_config(fields, base, "float32"), "config.json") == fields


def test_the_sparse_step_and_dense_layers_make_the_layer_pattern():
    hf = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert families.moe_fields(hf, "c.json", 6)["moe_layer_freq"] == [0, 1, 0, 0, 0, 1]
    assert families.moe_layers({"num_moe_experts": 8, "num_layers": 6, "moe_layer_freq": 2}) == [0, 2, 4]
    for key, value, words in (("num_experts_per_tok", 9, "more than the 8 experts"),
                              ("mlp_only_layers", [6], "expected layer numbers 0 to 5"),
                              ("mlp_only_layers", [1, 3, 5], "no layer has experts")):
        with pytest.raises(ConfigError, match=words) as err:
            families.moe_fields({**hf, key: value}, "c.json", 6)
        assert err.value.key == key


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_folders_headers_fit_the_registry_and_hf_megatron_hf_is_bitwise(folders, family):
    folder, fields = folders[family], _fields(folders[family])
    files = SafetensorsFolder(folder)
    mapping.check_tensors(files.tensors, family, fields, folder)
    hf = safetensors_in(folder)
    back = {}
    for m in mapping.registry(family, fields).resolved():
        weights = hf[m.hf_param] if isinstance(m.hf_param, str) else {r: hf[n] for r, n in m.hf_param.items()}
        back.update(m.megatron_to_hf(m.hf_to_megatron(weights, Shard(0, 1, m.shape))))
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], v) for k, v in hf.items())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_folder_that_does_not_fit_is_refused_naming_the_file_and_the_key(folders, family, tmp_path):
    from safetensors.torch import save_file

    folder = folders[family]
    files = SafetensorsFolder(folder)
    path = os.path.join(folder, families.CONFIG_FILE)
    with open(path) as f:
        config = json.load(f)
    fields = families.model_fields(config, path)
    for count in (3, 5):  # config.json counts other experts than the tensors hold: the router's shape tells
        config[families._experts_key(config)] = count
        with pytest.raises(ConfigError, match=rf"has shape \[4, 64\], expected \[{count}, 64\]") as err:
            mapping.check_tensors(files.tensors, family, families.model_fields(config, path), folder)
        assert err.value.path == os.path.join(folder, "model.safetensors") and err.value.key.endswith(".gate.weight")
    hf = safetensors_in(folder)
    gone = next(k for k in hf if ".experts.2." in k and k.startswith("model.layers.2."))
    damaged = tmp_path / family
    damaged.mkdir()
    save_file({k: v for k, v in hf.items() if k != gone}, str(damaged / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing from the checkpoint's") as err:
        mapping.check_tensors(SafetensorsFolder(str(damaged)).tensors, family, fields, str(damaged))
    assert (err.value.path, err.value.key) == (str(damaged), gone)


def _megatron_moe_model(folder: str, **changes):
    """The toolkit's model of ``[model] hf_config = folder`` (``changes`` set over the finalized config,
    past the checkpoint's own refusal of them), as ``gpt_model_provider`` builds it: megatron-core's MoE
    layers where ``moe_layer_freq`` says, with its CPU router and dispatcher."""
    from bridge_hpc.training.engine.model import gpt_model_provider

    cfg = model_config(folder)
    for key, value in changes.items():
        setattr(cfg, key, value)
    return gpt_model_provider(cfg).eval()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_megatron_cores_moe_model_has_the_registrys_parameters_and_transformers_logits(folders, family, world):
    from bridge_hpc.training.hf.load import copy_weights

    folder, fields = folders[family], _fields(folders[family])
    model = _megatron_moe_model(folder)
    params = {k: tuple(v.shape) for k, v in model.state_dict().items() if "_extra_state" not in k}
    resolved = mapping.registry(family, fields).resolved()
    assert params == {m.megatron_param: m.shape for m in resolved}
    copy_weights(SafetensorsFolder(folder), family, fields, [model])
    b = batch()
    with torch.no_grad():
        ours = model(b["tokens"], b["position_ids"], None)[..., :VOCAB]
    theirs = hf_logits(folder, b["tokens"])
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    if family == "qwen2_moe":  # the routing semantics matter: the other pre-softmax misses by far
        model = _megatron_moe_model(folder, moe_router_pre_softmax=False)
        copy_weights(SafetensorsFolder(folder), family, fields, [model])
        with torch.no_grad():
            wrong = model(b["tokens"], b["position_ids"], None)[..., :VOCAB]
        assert (wrong - theirs).abs().max().item() > 100 * TOLERANCE


def test_an_expert_parallel_ranks_local_experts_are_read_as_their_global_ones():
    from bridge_hpc.training.hf.load import _global_name

    layers = [SimpleNamespace(layer_number=3)]  # a pipeline stage whose first layer is the model's third
    ranks = {"ep_rank": 1, "ep": 2}
    assert _global_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", layers, ranks, 8) == \
        "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"
    assert _global_name("decoder.layers.0.mlp.router.weight", layers, ranks, 8) == "decoder.layers.2.mlp.router.weight"


def test_each_expert_is_split_over_the_expert_tensor_parallel_ranks(folders):
    fields, hf = _fields(folders["mixtral"]), safetensors_in(folders["mixtral"])
    registry = mapping.registry("mixtral", fields)
    fc1 = registry.megatron_to_hf_lookup("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
    fc2 = registry.megatron_to_hf_lookup("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight")
    assert fc1.is_expert and fc2.is_expert
    gate, up, down = (hf[f"model.layers.1.block_sparse_moe.experts.3.{w}.weight"] for w in ("w1", "w3", "w2"))
    part = fc1.hf_to_megatron({"gate": gate, "up": up}, Shard(1, 2, (32, 64)))
    assert torch.equal(part, torch.cat([gate[16:], up[16:]]))
    assert torch.equal(fc2.hf_to_megatron(down, Shard(1, 2, (64, 16))), down[:, 16:])
