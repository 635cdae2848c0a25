"""The param mappings (bridge_hpc.training.hf.param_mapping) on CPU tensors: each class's two
directions are each other's inverse, the tensor-parallel slices put together give the whole
parameter, and a family's registry finds each parameter by name (and only the layers it covers)."""

from __future__ import annotations

import pytest
import torch

from bridge_hpc.training.hf.mapping_registry import MegatronMappingRegistry
from bridge_hpc.training.hf.param_mapping import (
    AutoMapping,
    ColumnParallelMapping,
    ConcatenatedQKVMapping,
    DirectMapping,
    ExpertMapping,
    GatedMLPMapping,
    QKVMapping,
    RowParallelMapping,
    Shard,
    VocabMapping,
)


def _random(shapes):
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _weights(m, hf):
    return hf[m.hf_param] if isinstance(m.hf_param, str) else {role: hf[name] for role, name in m.hf_param.items()}


def _round_trip(m, tp: int, dim: int, padded_rows: int = 0):
    """HF -> megatron at TP ``tp`` (the slices joined along ``dim``) -> HF, bitwise."""
    hf = _random(m.hf_shapes())
    shape = list(m.shape)
    shape[0] += padded_rows
    local = list(shape)
    local[dim] //= tp
    parts = [m.hf_to_megatron(_weights(m, hf), Shard(r, tp, tuple(local))) for r in range(tp)]
    full = torch.cat(parts, dim=dim)
    assert tuple(full.shape) == tuple(shape)
    back = m.megatron_to_hf(full)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], v) for k, v in hf.items())
    return hf, full


def test_auto_mapping_splits_by_the_layer_it_belongs_to():
    assert isinstance(AutoMapping("decoder.layers.{i}.mlp.linear_fc2.weight", "x", (4, 6)).inner, RowParallelMapping)
    assert isinstance(AutoMapping("decoder.layers.{i}.mlp.linear_fc1.bias", "x", (6,)).inner, ColumnParallelMapping)
    assert isinstance(AutoMapping("output_layer.weight", "x", (10, 4)).inner, VocabMapping)
    assert isinstance(AutoMapping("decoder.layers.{i}.self_attention.linear_proj.bias", "x", (4,)).inner, DirectMapping)
    with pytest.raises(ValueError):
        AutoMapping("decoder.final_layernorm.weight", "x", (4,), transpose=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_column_row_and_direct_round_trip(tp):
    _round_trip(AutoMapping("decoder.layers.0.mlp.linear_fc1.weight", "fc", (8, 4)), tp, 0)
    _round_trip(AutoMapping("decoder.layers.0.mlp.linear_fc1.weight", "conv", (8, 4), transpose=True), tp, 0)
    _round_trip(AutoMapping("decoder.layers.0.mlp.linear_fc2.weight", "down", (4, 8)), tp, 1)
    _round_trip(AutoMapping("decoder.layers.0.mlp.linear_fc2.weight", "conv", (4, 8), transpose=True), tp, 1)
    m = AutoMapping("decoder.final_layernorm.weight", "norm", (4,))
    hf = _random(m.hf_shapes())
    assert all(torch.equal(m.hf_to_megatron(hf["norm"], Shard(r, tp, (4,))), hf["norm"]) for r in range(tp))


def test_the_vocabulary_is_padded_with_zero_rows_and_unpadded_again():
    m = AutoMapping("embedding.word_embeddings.weight", "embed", (10, 4))
    hf, full = _round_trip(m, 2, 0, padded_rows=6)  # 16 rows over two ranks: the second holds 2 real rows
    assert torch.equal(full[:10], hf["embed"]) and not full[10:].any()
    only_padding = m.hf_to_megatron(hf["embed"], Shard(3, 4, (4, 4)))  # 16 rows over 4: rank 3 all padding
    assert only_padding.shape == (4, 4) and not only_padding.any()


@pytest.mark.parametrize("tp", [1, 2])
def test_gated_fc1_is_gate_then_up_on_each_rank(tp):
    """Whole, ``[gate; up]`` (megatron-core's checkpoints hold it so at any TP); each rank: its gate rows,
    then its up rows."""
    m = GatedMLPMapping("decoder.layers.0.mlp.linear_fc1.weight", "gate", "up", (12, 4))
    hf, full = _round_trip(m, 1, 0)
    assert torch.equal(full, torch.cat([hf["gate"], hf["up"]]))
    n = 6 // tp
    for r in range(tp):
        part = m.hf_to_megatron(hf, Shard(r, tp, (2 * n, 4)))
        assert torch.equal(part[:n], hf["gate"][r * n:(r + 1) * n]) and torch.equal(part[n:], hf["up"][r * n:(r + 1) * n])


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_is_interleaved_by_query_group(tp):
    m = QKVMapping("decoder.layers.0.self_attention.linear_qkv.weight", "q", "k", "v", heads=4, groups=2, head_dim=3,
                   hidden=5)
    assert m.hf_shapes() == {"q": (12, 5), "k": (6, 5), "v": (6, 5)}
    hf, full = _round_trip(m, tp, 0)
    group0 = full[:12]  # two query heads of group 0, then its key head, then its value head
    assert torch.equal(group0[:6], hf["q"][:6]) and torch.equal(group0[6:9], hf["k"][:3])
    assert torch.equal(group0[9:], hf["v"][:3])
    bias = QKVMapping("decoder.layers.0.self_attention.linear_qkv.bias", "qb", "kb", "vb", heads=4, groups=2,
                      head_dim=3)
    _round_trip(bias, tp, 0)


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt2_c_attn_is_one_transposed_tensor_of_q_k_v(tp):
    m = ConcatenatedQKVMapping("decoder.layers.0.self_attention.linear_qkv.weight", "c_attn", heads=2, groups=2,
                               head_dim=4, hidden=8, transpose=True)
    assert m.hf_shapes() == {"c_attn": (8, 24)}
    hf, full = _round_trip(m, tp, 0)
    q, k, v = hf["c_attn"].t().split(8)
    assert torch.equal(full[:12], torch.cat([q[:4], k[:4], v[:4]]))
    _round_trip(ConcatenatedQKVMapping("decoder.layers.0.self_attention.linear_qkv.bias", "c_attn_b", heads=2,
                                       groups=2, head_dim=4), tp, 0)


def test_the_registry_resolves_layers_and_experts_and_finds_each_by_name():
    dense = GatedMLPMapping("decoder.layers.{i}.mlp.linear_fc1.weight", "model.layers.{i}.mlp.gate_proj.weight",
                            "model.layers.{i}.mlp.up_proj.weight", (8, 4), layers=(0,))
    experts = ExpertMapping(GatedMLPMapping(
        "decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight",
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        (4, 4), layers=(1, 2), num_experts=3))
    norm = AutoMapping("decoder.layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight", (4,))
    registry = MegatronMappingRegistry(dense, experts, norm, AutoMapping("decoder.final_layernorm.weight",
                                                                         "model.norm.weight", (4,)), num_layers=3)
    resolved = registry.resolved()
    assert len(resolved) == 1 + 2 * 3 + 3 + 1
    found = registry.megatron_to_hf_lookup("decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight")
    assert found.is_expert and found.hf_param == {"gate": "model.layers.2.mlp.experts.1.gate_proj.weight",
                                                  "up": "model.layers.2.mlp.experts.1.up_proj.weight"}
    assert registry.megatron_to_hf_lookup("decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight") is None
    assert registry.megatron_to_hf_lookup("decoder.layers.1.mlp.linear_fc1.weight") is None  # an expert layer
    assert registry.megatron_to_hf_lookup("decoder.layers.0.mlp.linear_fc1.weight").hf_param["gate"] == \
        "model.layers.0.mlp.gate_proj.weight"
    assert registry.megatron_to_hf_lookup("decoder.final_layernorm.weight").hf_param == "model.norm.weight"
    _round_trip(found, 1, 0)
    with pytest.raises(ValueError, match="more than one mapping"):
        MegatronMappingRegistry(norm, norm, num_layers=1)


def test_an_expert_parallel_ranks_local_experts_are_consecutive_global_ones():
    assert [ExpertMapping.global_expert(k, 1, 4, 8) for k in range(2)] == [2, 3]
    assert ExpertMapping.global_expert(0, 0, 1, 8) == 0
    with pytest.raises(ValueError):
        ExpertMapping.global_expert(0, 0, 3, 8)
    with pytest.raises(ValueError):
        ExpertMapping(RowParallelMapping("decoder.layers.{i}.mlp.linear_fc2.weight", "x", (4, 4)))

