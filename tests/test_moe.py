"""Mixture-of-Experts on one CPU rank: the fields' checks, the layers megatron-core builds, the router
freeze, the auxiliary losses' tracking.

Expert parallelism end to end (EP2 over gloo, a SIGUSR1 requeue, EP2 -> EP1, the losses in every log) is
tests/test_moe_slurm.py's, on the local cluster.
"""

from __future__ import annotations

import pytest
import torch
from bridge_test_helpers import ROOT, single_rank_world, submit_cli

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.engine.config import GPTModelConfig

MOE_JOB = ROOT / "configs" / "local-tiny-moe.toml"
ITERS = 16
TINY_MOE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                add_bias_linear=False, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, hidden_dropout=0.0,
                attention_dropout=0.0)


# ---------------------------------------------------------------------------------------------
# The fields
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, key", [
    ({"num_moe_experts": 0}, "model.num_moe_experts"),
    ({"moe_router_topk": 9}, "model.moe_router_topk"),
    ({"expert_model_parallel_size": 3}, "model.expert_model_parallel_size"),
    ({"expert_model_parallel_size": 0}, "model.expert_model_parallel_size"),
    ({"moe_layer_freq": [1, 0, 1]}, "model.moe_layer_freq"),
    ({"moe_layer_freq": [0, 0]}, "model.moe_layer_freq"),
    ({"moe_layer_freq": 3}, "model.moe_layer_freq"),
    ({"moe_aux_loss_coeff": -0.1}, "model.moe_aux_loss_coeff"),
    ({"moe_expert_capacity_factor": 0.0}, "model.moe_expert_capacity_factor"),
    ({"moe_pad_expert_input_to_capacity": True}, "model.moe_pad_expert_input_to_capacity"),
    ({"moe_router_num_groups": 4}, "model.moe_router_group_topk"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "model.moe_router_num_groups"),
    ({"moe_router_enable_expert_bias": True}, "model.moe_router_enable_expert_bias"),
    ({"moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": True}, "model.moe_shared_expert_gate"),
    ({"add_bias_linear": True}, "model.moe_shared_expert_intermediate_size"),
    ({"add_bias_linear": True, "moe_shared_expert_intermediate_size": None}, "model.add_bias_linear"),
    # the local layers' grouped experts (torch's grouped GEMM): no biases, each expert whole on its rank
    ({"moe_grouped_gemm": True, "add_bias_linear": True, "moe_shared_expert_intermediate_size": None},
     "model.moe_grouped_gemm"),
    ({"moe_grouped_gemm": True, "expert_tensor_parallel_size": 2}, "model.moe_grouped_gemm"),
    ({"moe_permute_fusion": True}, "model.moe_permute_fusion"),
    ({"moe_shared_expert_overlap": True}, "model.moe_shared_expert_overlap"),
    ({"moe_ffn_hidden_size": 18, "expert_tensor_parallel_size": 4}, "model.expert_tensor_parallel_size"),
])
def test_a_field_that_cannot_hold_is_refused_naming_its_key(changes, key):
    cfg = GPTModelConfig(**dict(TINY_MOE, **changes))
    with pytest.raises(ConfigError) as err:
        cfg.finalize()
    assert err.value.key == key


def test_moe_fields_on_a_dense_model_are_refused():
    with pytest.raises(ConfigError) as err:
        GPTModelConfig(moe_router_topk=4).finalize()
    assert err.value.key == "model.moe_router_topk" and "no experts" in err.value.message
    with pytest.raises(ConfigError) as err:
        GPTModelConfig(expert_model_parallel_size=2).finalize()
    assert err.value.key == "model.expert_model_parallel_size"


def test_active_widths_count_the_routed_and_shared_experts():
    cfg = GPTModelConfig(**TINY_MOE)
    cfg.finalize()
    assert cfg.active_ffn_widths() == [16, 16, 16]
    assert cfg.moe_layer_pattern() == [1, 1]
    assert GPTModelConfig(**dict(TINY_MOE, num_layers=4, moe_layer_freq=2)).moe_layer_pattern() == [1, 0, 1, 0]


def test_flops_count_active_parameters_only():
    """TFLOP/s and MFU count what a token passes through: top-k of the experts, not all of them."""
    from types import SimpleNamespace

    from bridge_hpc.training.utils.train_utils import num_floating_point_operations

    def flops(**fields):
        model = GPTModelConfig(**fields)
        model.finalize()
        return num_floating_point_operations(SimpleNamespace(model=model), 8)

    dense = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, ffn_hidden_size=16,
                 add_bias_linear=False)
    one_expert = dict(dense, num_moe_experts=8, moe_router_topk=1)
    two_experts = dict(dense, num_moe_experts=8, moe_router_topk=2)
    router = 6 * 8 * 16 * 2 * 32 * 8  # 6 x tokens x layers x hidden x experts
    assert flops(**one_expert) == flops(**dense) + router
    mlp = 6 * 8 * 16 * 2 * (2 * 32 * 16)  # one more expert of width 16 in each layer
    assert flops(**two_experts) == flops(**one_expert) + mlp
    # 64 experts instead of 8 add router work only
    assert flops(**dict(two_experts, num_moe_experts=64)) - flops(**two_experts) == router * 7


def test_bad_moe_values_through_bridge_submit_exit_2_and_write_nothing(tmp_path):
    run_dir = tmp_path / "run"
    for item, key in (("model.moe_router_topk=9", "model.moe_router_topk"),
                      ("model.expert_model_parallel_size=4", "model.expert_model_parallel_size"),
                      ("model.moe_token_dispatcher_type=\"alltoall\"", "model.moe_token_dispatcher_type")):
        proc = submit_cli(str(MOE_JOB), "--set", f"job.run_dir={run_dir}", "--set", item, cwd=ROOT)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and key in lines[0] and "Traceback" not in proc.stderr, proc.stderr
        assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------
# The layers, on one rank
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_rank():
    yield from single_rank_world()


def _built(single_rank, **changes):
    from bridge_hpc.training.engine.model import gpt_model_provider

    cfg = GPTModelConfig(**dict(TINY_MOE, **changes))
    cfg.finalize()
    torch.manual_seed(0)
    return cfg, gpt_model_provider(cfg)


def test_moe_layers_where_moe_layer_freq_says_with_host_router(single_rank):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from bridge_hpc.training.engine.moe import HostAllGatherDispatcher, HostTopKRouter

    _, model = _built(single_rank, moe_layer_freq=[0, 1])
    dense, sparse = model.decoder.layers
    assert not isinstance(dense.mlp, MoELayer) and isinstance(sparse.mlp, MoELayer)
    assert type(sparse.mlp.router) is HostTopKRouter
    assert type(sparse.mlp.token_dispatcher) is HostAllGatherDispatcher
    names = {name for name, _ in model.named_parameters()}
    assert "decoder.layers.1.mlp.router.weight" in names
    assert {f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(8)} <= names
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names


def test_freeze_moe_router_keeps_routers_while_experts_train(single_rank):
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    from bridge_hpc.training.utils.train_utils import freeze_moe_router

    _, model = _built(single_rank)
    freeze_moe_router(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        optimizer.zero_grad()
        model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).mean().backward()
        optimizer.step()
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    routers = {name for name in before if ".mlp.router." in name}
    assert routers and not routers & moved
    assert any(".local_experts." in name for name in moved) and any("shared_experts" in name for name in moved)


def test_aux_losses_are_tracked_and_reset_each_step(single_rank):
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    from bridge_hpc.training.engine import moe

    cfg, model = _built(single_rank)
    moe.clear_aux_losses()  # (what the tests before added)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).mean().backward()
    losses = moe.aux_losses(cfg, num_microbatches=1)
    assert set(losses) == {"load_balancing_loss", "z_loss"}
    # balanced routing of 8 experts gives a load-balancing loss near 1; the z-loss is a mean of squares
    assert 0.5 < float(losses["load_balancing_loss"]) < 2.0 and float(losses["z_loss"]) > 0
    assert all(float(v) == 0.0 for v in moe.aux_losses(cfg, num_microbatches=1).values())


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_local_grouped_experts_give_the_sequential_experts_loss_and_gradients(single_rank, activation):
    """``model.moe_grouped_gemm`` on the local layers: the same parameters (SequentialMLP's names), one
    torch grouped GEMM per linear; in fp32 on CPU the loss and every gradient equal the sequential
    experts' bit for bit."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    from bridge_hpc.training.engine.grouped_experts import GroupedSequentialMLP

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    results = {}
    for grouped in (False, True):
        _, model = _built(single_rank, moe_grouped_gemm=grouped, activation_func=activation)
        assert (type(model.decoder.layers[0].mlp.experts) is GroupedSequentialMLP) is grouped
        loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).mean()
        loss.backward()
        results[grouped] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (loss_seq, grads_seq), (loss_grp, grads_grp) = results[False], results[True]
    assert torch.equal(loss_seq, loss_grp)
    assert grads_seq.keys() == grads_grp.keys() and any(".local_experts." in n for n in grads_grp)
    assert all(torch.equal(grads_seq[n], grads_grp[n]) for n in grads_seq)


def _count_grouped_mm(monkeypatch) -> list:
    calls = []
    real = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    return calls


def test_frozen_grouped_experts_compute_no_weight_gradients(monkeypatch):
    """The grouped linear's backward skips the weights' gradient GEMM when the experts are frozen (a
    PEFT run adapting the attention only): one grouped GEMM forward, one backward (the input's)."""
    from bridge_hpc.training.engine.grouped_experts import _GroupedLinearFunction

    x = torch.randn(12, 16, requires_grad=True)
    weights = [torch.randn(8, 16) for _ in range(3)]
    offsets = torch.tensor([4, 4, 12], dtype=torch.int32)
    calls = _count_grouped_mm(monkeypatch)
    _GroupedLinearFunction.apply(x, offsets, *weights).sum().backward()
    assert len(calls) == 2  # the forward and the input gradient, no weight gradient
    expected = torch.cat([torch.ones(4, 8) @ weights[0], torch.ones(8, 8) @ weights[2]])
    assert torch.allclose(x.grad, expected) and all(w.grad is None for w in weights)


def test_grouped_experts_weight_gradients_with_an_expert_without_tokens(monkeypatch):
    """Trainable experts: each weight's gradient is dy_e^T x_e over its own tokens, and the expert that got
    none has a zero gradient (two grouped GEMMs: the forward and the weights'; the input needs none)."""
    from bridge_hpc.training.engine.grouped_experts import _GroupedLinearFunction

    x = torch.randn(12, 16)
    weights = [torch.randn(8, 16, requires_grad=True) for _ in range(3)]
    offsets = torch.tensor([4, 4, 12], dtype=torch.int32)
    dy = torch.randn(12, 8)
    calls = _count_grouped_mm(monkeypatch)
    (_GroupedLinearFunction.apply(x, offsets, *weights) * dy).sum().backward()
    assert len(calls) == 2
    assert torch.allclose(weights[0].grad, dy[:4].t() @ x[:4], atol=1e-6)
    assert torch.equal(weights[1].grad, torch.zeros(8, 16))
    assert torch.allclose(weights[2].grad, dy[4:].t() @ x[4:], atol=1e-6)


@pytest.mark.parametrize("changes, says", [
    ({"add_bias_linear": True, "moe_shared_expert_intermediate_size": None}, "without biases"),
    ({"expert_tensor_parallel_size": 2}, "expert tensor-parallel size is 2"),
    ({"moe_ffn_hidden_size": 20}, "multiples of 8"),
])
def test_local_grouped_experts_refusals_say_why(changes, says):
    cfg = GPTModelConfig(**dict(TINY_MOE, moe_grouped_gemm=True, **changes))
    with pytest.raises(ConfigError) as err:
        cfg.finalize()
    assert err.value.key == "model.moe_grouped_gemm" and "on the local layers" in err.value.message
    assert says in err.value.message
