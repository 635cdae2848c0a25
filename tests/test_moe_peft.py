"""LoRA on a Mixture-of-Experts model (issue 47): a tiny Qwen2-MoE made by transformers (4 experts, top-2,
a gated shared expert) fine-tuned with ``[peft]`` LoRA on its default targets, which include every
expert's ``linear_fc1`` and ``linear_fc2`` and the shared expert's, as Megatron Bridge targets them.

One rank: the run stopped by ``train.exit_interval`` and resumed equals the run in one go bit for bit;
its checkpoint holds adapters only, the experts' among them; ``bridge-hf export`` merges them into the
base, and the exported tensors are the toolkit's merged weights (``LoRAMerge``), transformers' logits the
merged model's. Expert parallelism (2 ranks) comes with the same adapters: an adapter is seeded by its
expert's global number, and its gradients are reduced over the ranks that hold that expert.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from bridge_test_helpers import direct_rank_env, single_rank_world
from hf_models import FINETUNE_JOB, SEQ, batch, make_hf_model, model_config, safetensors_in
from warm_ranks import run_module

from bridge_hpc.training.engine.metrics import read_metrics

ITERS = 6
LORA_JOB = FINETUNE_JOB.replace("train_iters = 3", f"train_iters = {ITERS}") + """[peft]
type = "lora"
dim = 4
alpha = 8
"""


@pytest.fixture(scope="module")
def world():
    yield from single_rank_world()


def _rank(cwd, *sets: str) -> str:
    args = ["job.toml"]
    for item in sets:
        args += ["--set", item]
    proc = run_module("bridge_hpc.rank", args, cwd=cwd, env=direct_rank_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-lora")
    hf = str(root / "qwen2moe")
    make_hf_model("qwen2_moe", hf)
    (root / "job.toml").write_text(LORA_JOB.format(seq=SEQ, hf=hf))
    straight = _rank(root, "job.run_dir='runs/straight'", "checkpoint.save_interval=3")
    assert "loaded checkpoint" not in straight
    assert "exiting at iteration 3" in _rank(root, "job.run_dir='runs/resumed'", "checkpoint.save_interval=3",
                                              "train.exit_interval=3")
    assert "loaded checkpoint" in _rank(root, "job.run_dir='runs/resumed'", "checkpoint.save_interval=3")
    return root, hf


def test_lora_on_the_experts_resumes_bit_exactly(runs):
    root, _ = runs
    got, want = read_metrics(str(root / "runs/resumed/metrics.jsonl")), read_metrics(str(root / "runs/straight/metrics.jsonl"))
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1))
    for step in want:
        for key in ("loss", "load_balancing_loss", "grad_norm"):
            assert got[step][key] == want[step][key], (step, key)


def test_the_checkpoint_holds_adapters_only_with_the_experts(runs):
    from torch.distributed.checkpoint import FileSystemReader

    root, _ = runs
    keys = [k for k in FileSystemReader(str(root / f"runs/straight/checkpoints/iter_{ITERS:07d}")).read_metadata()
            .state_dict_metadata if k.startswith("model.")]
    assert keys and all(".adapter." in k for k in keys), [k for k in keys if ".adapter." not in k]
    for layer in ("linear_fc1", "linear_fc2"):
        assert any(".experts." in k and f"{layer}.adapter." in k and "shared" not in k for k in keys), keys
        assert any(".shared_experts." in k and f"{layer}.adapter." in k for k in keys), keys


def test_export_merges_the_expert_adapters_into_the_base(runs, world, tmp_path):
    from hf_models import hf_logits

    from bridge_hpc.models.hf.export import to_hf
    from bridge_hpc.peft.lora import LoRA, LoRAMerge
    from bridge_hpc.training.checkpoint.megatron import _load_model_and_optimizer
    from bridge_hpc.training.engine.model import gpt_model_provider
    from bridge_hpc.training.hf import mapping
    from bridge_hpc.training.hf.load import load_hf_weights

    root, hf = runs
    checkpoints = root / "runs" / "straight" / "checkpoints"
    done = run_module("bridge_hpc.cli.hf", ["export", str(checkpoints), str(tmp_path / "out")], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = safetensors_in(str(tmp_path / "out"))

    ours = gpt_model_provider(model_config(hf))
    load_hf_weights(hf, [ours])
    LoRA(dim=4, alpha=8)(ours, training=False)
    _load_model_and_optimizer([ours], None, str(checkpoints / f"iter_{ITERS:07d}"), load_optim=False)
    b = batch(seed=7)
    with torch.no_grad():
        adapted = ours(b["tokens"], b["position_ids"], None)
    plain = LoRAMerge()(ours, training=False)
    merged = {mapping.canonical(k): v.detach() for k, v in plain.state_dict().items()
              if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    run_model = json.loads((checkpoints / f"iter_{ITERS:07d}" / "run_config.json").read_text())["model"]
    want = to_hf(merged, run_model, "qwen2_moe")
    assert sorted(exported) == sorted(want)
    base = safetensors_in(hf)
    moved = [k for k in want if not torch.equal(base[k], want[k])]
    # the adapters changed the experts' and the shared expert's weights
    assert any(".mlp.experts." in k for k in moved) and any(".mlp.shared_expert." in k for k in moved), moved
    for key in want:  # the export is the merged model, tensor by tensor
        torch.testing.assert_close(exported[key], want[key].to(exported[key].dtype), rtol=0, atol=1e-6, msg=key)
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.testing.assert_close(hf_logits(str(tmp_path / "out"), b["tokens"]), adapted, rtol=1e-4, atol=1e-4)


TINY_MOE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, num_moe_experts=8,
                moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, add_bias_linear=False)


def _adapters(ep: int, rank: int = 0) -> dict:
    """This rank's expert adapters of the tiny MoE GPT at expert parallelism ``ep``: full name (global expert
    numbers) -> (A, B, the DDP ``allreduce`` flag of each), and their checkpoint entries' global offsets."""
    from bridge_hpc.peft.base import apply_peft
    from bridge_hpc.peft.lora import LoRA
    from bridge_hpc.training.engine.config import GPTModelConfig
    from bridge_hpc.training.engine.model import gpt_model_provider

    cfg = GPTModelConfig(**TINY_MOE, expert_model_parallel_size=ep)
    cfg.finalize()
    torch.manual_seed(0)
    model = gpt_model_provider(cfg)
    apply_peft(LoRA(dim=4, alpha=8, lora_B_init_method="normal"), [model], seed=5, base_folder=None)
    out = {}
    for name, module in model.named_modules():
        if name.endswith(".adapter") and ".local_experts." in name:
            local = int(name.split(".local_experts.")[1].split(".")[0])
            full = name.replace(f".local_experts.{local}.", f".local_experts.{local + rank * (8 // ep)}.")
            out[full] = [(p.detach().clone(), getattr(p, "allreduce", True)) for p in module.parameters()]
    from bridge_hpc.training.checkpoint.megatron import _expert_names

    # the names a CPU rank's checkpoint gives them (the global expert numbers: loadable at any EP size)
    saved = sorted(k for k in _expert_names(model.state_dict(), [model], to_global=True) if ".adapter." in k
                   and ".local_experts." in k and k.endswith(".weight"))
    return {"adapters": out, "saved": saved}


def _ep2_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    torch.save(_adapters(2, rank), os.path.join(out, f"{rank}.pt"))
    parallel_state.destroy_model_parallel()


def test_expert_adapters_are_the_same_at_ep1_and_ep2_and_reduced_over_their_experts_ranks(world, tmp_path):
    from bridge_test_helpers import free_port, run_gloo_ranks

    run_gloo_ranks(_ep2_rank, free_port(), str(tmp_path))
    ep1 = _adapters(1)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    ep2 = {**ranks[0]["adapters"], **ranks[1]["adapters"]}
    assert sorted(ep2) == sorted(ep1["adapters"]) and len(ep1["adapters"]) == 2 * 8 * 2  # layers x experts x fc1/fc2
    for name, params in ep1["adapters"].items():
        for (want, _), (got, allreduce) in zip(params, ep2[name]):
            assert torch.equal(got, want), name  # seeded by the global expert, not the rank's local one
            assert allreduce is False, name  # reduced over the expert-data-parallel group, not all ranks
    # each rank's checkpoint entries are its own experts' under their global numbers: together, EP1's
    assert sorted(ranks[0]["saved"] + ranks[1]["saved"]) == ep1["saved"] == sorted(
        f"{name}.{half}.weight" for name in ep1["adapters"] for half in ("linear_in", "linear_out"))
    assert all(".local_experts.4." not in k for k in ranks[0]["saved"])


def test_expert_layers_are_targets_by_name_and_grouped_experts_with_adapters_are_refused():
    from bridge_hpc.contracts.errors import ConfigError
    from bridge_hpc.peft.config import check_peft
    from bridge_hpc.peft.lora import LoRA
    from bridge_hpc.training.engine.config import GPTModelConfig

    cfg = GPTModelConfig(**TINY_MOE)
    cfg.finalize()
    for targets in (["*.local_experts.7.linear_fc2"], ["*.shared_experts.*"], ["linear_fc1"]):
        check_peft(LoRA(target_modules=targets), 2, 32, cfg)
    with pytest.raises(ConfigError, match="matches '\\*.local_experts.8.\\*'") as err:  # 8 experts: 0 .. 7
        check_peft(LoRA(target_modules=["*.local_experts.8.*"]), 2, 32, cfg)
    assert err.value.key == "peft.target_modules"
    with pytest.raises(ConfigError, match="grouped GEMM") as err:
        check_peft(LoRA(), 2, 32, GPTModelConfig(**TINY_MOE, moe_grouped_gemm=True))
    assert err.value.key == "model.moe_grouped_gemm"
    check_peft(LoRA(target_modules=["linear_qkv", "*.shared_experts.*"]), 2, 32,
               GPTModelConfig(**TINY_MOE, moe_grouped_gemm=True))  # no expert's own layer: allowed
