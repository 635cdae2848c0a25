"""The optimizer module on CPU: parameter groups from the override provider and [[optimizer.overrides]],
one step against a hand computation, the fused step's exact resume, and bad TOML exiting 2.

A gloo world of one with megatron's model-parallel state (megatron-core's GPT needs it); the model is
the tiny GPT of tests/data/tiny.toml shrunk to one layer, wrapped in torch DDP as pretrain wraps it.
About 10 s in all.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys

import pytest
import toml
import torch
from bridge_test_helpers import TINY, single_rank_world

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.config import (
    ConfigContainer,
    OptimizerConfigOverrideProvider,
    OptimizerConfigOverrideProviderContext,
)
from bridge_hpc.training.engine.optimizer import TorchOptimizer, param_name, setup_optimizer


@pytest.fixture(scope="module")
def single_rank():
    yield from single_rank_world()


def _cfg(overrides=None, **optimizer) -> ConfigContainer:
    data = toml.load(TINY)
    data["model"]["num_layers"] = 1
    del data["checkpoint"]  # no folder: nothing is saved here
    data["optimizer"].update(optimizer)
    if overrides is not None:
        data["optimizer"]["overrides"] = overrides
    cfg = ConfigContainer.from_sections(data, source="job.toml")
    cfg.validate(world_size=1)
    return cfg


def _gpt(cfg):
    from bridge_hpc.training.pretrain import setup_model

    torch.manual_seed(0)
    return setup_model(cfg)  # torch DDP on CPU: names start with "module."


def _names(model, group):
    ids = {id(p) for p in group["params"]}
    return {param_name(n) for n, p in model[0].named_parameters() if id(p) in ids}


# --- the groups the optimizer ends up with --------------------------------------------------------------


def test_default_groups_give_biases_and_norms_no_weight_decay(single_rank):
    cfg = _cfg()
    model = _gpt(cfg)
    opt = setup_optimizer(cfg, model)
    assert isinstance(opt, TorchOptimizer)
    all_names = {param_name(n) for n, _ in model[0].named_parameters()}
    one_d = {param_name(n) for n, p in model[0].named_parameters() if p.ndim == 1 or n.endswith(".bias")}
    assert any("layernorm" in n for n in one_d) and any(n.endswith(".bias") for n in one_d)
    default, no_wd = opt.param_groups
    # The group without overrides comes first (its lr is the one logged), as megatron-core orders them.
    assert default["wd_mult"] == 1.0 and default["default_config"] is True
    assert _names(model, default) == all_names - one_d
    assert no_wd["wd_mult"] == 0.0 and _names(model, no_wd) == one_d
    assert default["fused"] is True  # optimizer.fused_step's default


def test_toml_overrides_set_embedding_lr_and_norm_weight_decay(single_rank):
    from bridge_hpc.training.pretrain import setup_scheduler

    cfg = _cfg(overrides=[{"params": ["embedding.*"], "lr_mult": 0.1},
                          {"params": ["*layernorm.weight"], "wd_mult": 0.5}])  # wins over the default 0
    model = _gpt(cfg)
    opt = setup_optimizer(cfg, model)
    scheduler = setup_scheduler(cfg, opt)
    for _ in range(6):  # past the 4 warm-up steps, into the cosine decay
        scheduler.step(cfg.train.global_batch_size)
    by_name = {}
    for group in opt.param_groups:
        for name in _names(model, group):
            by_name[name] = group
    emb = by_name["embedding.word_embeddings.weight"]
    plain = by_name["decoder.layers.0.mlp.linear_fc1.weight"]
    norm = by_name["decoder.final_layernorm.weight"]
    bias = by_name["decoder.final_layernorm.bias"]
    assert emb["max_lr"] == pytest.approx(3e-4) and emb["min_lr"] == pytest.approx(3e-5)
    assert emb["lr"] == pytest.approx(0.1 * plain["lr"], rel=1e-12)  # the whole schedule scaled
    assert 3e-4 < plain["lr"] < 3e-3
    assert emb["weight_decay"] == plain["weight_decay"] == pytest.approx(0.01)
    assert norm["weight_decay"] == pytest.approx(0.005) and bias["weight_decay"] == 0.0


def test_a_provider_subclass_is_applied_on_cpu(single_rank):
    """A Bridge-style provider returning megatron's ParamKey dict drives the CPU groups too."""
    from megatron.core.optimizer import ParamKey

    class EmbeddingsFrozenLr(OptimizerConfigOverrideProvider):
        def build_config_overrides(self, context: OptimizerConfigOverrideProviderContext):
            base = super().build_config_overrides(context)
            return {**base, ParamKey(name="*embedding*"): {"max_lr": 0.0, "min_lr": 0.0}}

    cfg = _cfg()
    cfg.optimizer_config_override_provider = EmbeddingsFrozenLr()
    model = _gpt(cfg)
    opt = setup_optimizer(cfg, model)
    frozen = [g for g in opt.param_groups if g["max_lr"] == 0.0]
    assert len(frozen) == 1 and _names(model, frozen[0]) == {"embedding.word_embeddings.weight",
                                                             "embedding.position_embeddings.weight"}


def test_a_pattern_that_matches_nothing_is_named(single_rank):
    cfg = _cfg(overrides=[{"params": ["*.bias"], "wd_mult": 0.0}, {"params": ["decoder.layer.*"], "lr_mult": 2.0}])
    with pytest.raises(ConfigError) as err:
        setup_optimizer(cfg, _gpt(cfg))
    assert err.value.key == "optimizer.overrides[1].params"
    assert "match no parameter" in err.value.message and "decoder.layers.0." in err.value.message


# --- one step against a hand computation ------------------------------------------------------------------


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Linear(2, 1, bias=False)  # a "different lr for embeddings" target
        self.proj = torch.nn.Linear(2, 1)  # weight: full decay; bias: none (the default rule)


@pytest.mark.parametrize("fused", [True, False])
def test_one_adamw_step_matches_a_hand_computation(fused):
    """AdamW's first step: p <- p·(1 - lr·wd) - lr·m̂/(√v̂ + eps), with m̂ = g and v̂ = g², lr and wd
    per group: embedding lr x0.5 and full decay, proj.weight full decay, proj.bias no decay."""
    cfg = _cfg(overrides=[{"params": ["embedding.*"], "lr_mult": 0.5}], fused_step=fused, clip_grad=0.0,
               weight_decay=0.1, lr=0.01, min_lr=0.001)
    toy = _Toy()
    with torch.no_grad():
        toy.embedding.weight.copy_(torch.tensor([[1.0, -2.0]]))
        toy.proj.weight.copy_(torch.tensor([[0.5, 0.25]]))
        toy.proj.bias.copy_(torch.tensor([3.0]))
    opt = setup_optimizer(cfg, [toy])
    for group in opt.param_groups:  # what the scheduler sets at a constant schedule
        group["lr"], group["weight_decay"] = group["max_lr"], 0.1 * group["wd_mult"]
    grads = {"embedding.weight": [[0.2, -4.0]], "proj.weight": [[-1e-3, 2.0]], "proj.bias": [0.5]}
    for name, p in toy.named_parameters():
        p.grad = torch.tensor(grads[name])
    ok, norm, _ = opt.step()
    assert ok and norm == pytest.approx((0.2**2 + 4**2 + 1e-6 + 2**2 + 0.5**2) ** 0.5, rel=1e-6)

    def expected(p0, g, lr, wd):
        return p0 * (1 - lr * wd) - lr * g / (abs(g) + 1e-8)

    want = {
        "embedding.weight": [expected(1.0, 0.2, 0.005, 0.1), expected(-2.0, -4.0, 0.005, 0.1)],
        "proj.weight": [expected(0.5, -1e-3, 0.01, 0.1), expected(0.25, 2.0, 0.01, 0.1)],
        "proj.bias": [expected(3.0, 0.5, 0.01, 0.0)],
    }
    for name, p in toy.named_parameters():
        assert p.detach().flatten().tolist() == pytest.approx(want[name], rel=1e-6, abs=1e-7), name


# --- the fused step's exact resume (and a checkpoint of the other path keeps this one's kernels) -----------


def _train(opt, model, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad()


def test_fused_step_resumes_bitwise_from_a_saved_state():
    cfg = _cfg(fused_step=True)
    torch.manual_seed(1)
    straight_model = _Toy()
    start = {k: v.clone() for k, v in straight_model.state_dict().items()}
    straight = setup_optimizer(cfg, [straight_model])
    _train(straight, straight_model, 3, seed=7)
    saved_model = {k: v.clone() for k, v in straight_model.state_dict().items()}
    saved_opt = copy.deepcopy(straight.state_dict())  # the live state keeps changing
    _train(straight, straight_model, 4, seed=8)

    resumed_model = _Toy()
    resumed_model.load_state_dict(saved_model)
    resumed = setup_optimizer(cfg, [resumed_model])
    resumed.load_state_dict(saved_opt)
    _train(resumed, resumed_model, 4, seed=8)
    for (name, a), b in zip(straight_model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(start["proj.weight"], resumed_model.proj.weight)


def test_a_checkpoint_from_the_default_path_keeps_the_fused_kernels():
    toy = _Toy()
    default = setup_optimizer(_cfg(fused_step=False), [toy])
    _train(default, toy, 2, seed=3)
    assert default.param_groups[0]["fused"] is None  # torch's own choice
    fused = setup_optimizer(_cfg(fused_step=True), [toy])
    fused.load_state_dict(default.state_dict())
    assert all(g["fused"] is True and g["foreach"] is False for g in fused.param_groups)
    _train(fused, toy, 1, seed=4)  # runs, with the loaded counters
    assert {float(s["step"]) for s in fused.optimizer.state.values()} == {3.0}


# --- bad TOML: one message naming file, key and what was expected; exit status 2 --------------------------


@pytest.mark.parametrize("table, key, expect", [
    ('params = ["*.bias"]\nwd_mult = "none"', "optimizer.overrides[0].wd_mult", "expected a number"),
    ('params = ["*.bias"]\nweight_decay = 0.0', "optimizer.overrides[0].weight_decay", "unknown key"),
    ('params = []\nwd_mult = 0.0', "optimizer.overrides[0].params", "at least one parameter-name pattern"),
    ('params = ["embedding.*"]', "optimizer.overrides[0]", "sets nothing"),
    ('params = ["embedding.*"]\nlr_mult = 0.1\nmax_lr = 1e-3', "optimizer.overrides[0].lr_mult", "cannot be combined"),
])
def test_bad_override_tables_exit_2_naming_file_and_key(tmp_path, table, key, expect):
    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    with open(job, "a") as f:
        f.write(f"\n[[optimizer.overrides]]\n{table}\n")
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert str(job) in proc.stderr and f"key '{key}'" in proc.stderr and expect in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
