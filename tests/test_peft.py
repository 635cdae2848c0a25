"""PEFT (issue 28): LoRA and DoRA at Megatron Bridge's paths, their ``[peft]`` section, the adapters on
megatron-core's layers, merging, and tensor and pipeline parallelism on 2 gloo ranks.

The parallel test builds one base GPT and trains its adapters for a few steps at TP1, at TP2 and at PP2
(a hand-driven two-stage pipeline: the stages' activations and gradients sent between the ranks), from
the same base weights (copied in, split as each layout splits them) and the same batches; the losses
must agree. The TP2 adapters' layout-free checkpoint entries (megatron-core's sharded tensors: global
shape and offset of each rank's part), assembled, must be the TP1 run's adapters, and loaded into a TP1
model they must go on training as the TP2 run does: what megatron-core's checkpoints do across layouts.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from bridge_test_helpers import free_port, run_gloo_ranks, single_rank_world

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.peft.base import adapter_candidates
from bridge_hpc.peft.utils import is_adapter_key, wildcard_match
from bridge_hpc.training.config import ConfigContainer, GPTModelConfig

STEPS = 4


def _sections(peft: dict, **checkpoint) -> dict:
    return {"train": {"train_iters": 2, "micro_batch_size": 1, "global_batch_size": 1}, "optimizer": {"lr": 1e-3},
            "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16},
            "checkpoint": {"pretrained_checkpoint": "base", **checkpoint}, "peft": peft}


# ---------------------------------------------------------------------------------------------
# The configs: Bridge's classes, fields and defaults, the [peft] section, bad values by name
# ---------------------------------------------------------------------------------------------


def test_bridge_names_fields_and_defaults():
    from bridge_hpc.peft.base import PEFT
    from bridge_hpc.peft.dora import DoRA
    from bridge_hpc.peft.lora import LoRA, LoRAMerge

    lora, dora = LoRA(), DoRA()
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert (lora.target_modules, lora.dim, lora.alpha, lora.dropout, lora.dropout_position, lora.lora_A_init_method,
            lora.lora_B_init_method, lora.exclude_modules) == (targets, 32, 32, 0.0, "pre", "xavier", "zero", [])
    assert (dora.target_modules, dora.dim, dora.alpha, dora.dropout_position) == (targets, 32, 64, "pre")
    assert all(isinstance(p, PEFT) for p in (lora, dora, LoRAMerge()))
    for method in ("transform", "__call__", "freeze_model", "set_params_to_save", "adapter_key_filter"):
        assert callable(getattr(lora, method))
    assert lora.adapter_key_filter("decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight")
    assert not lora.adapter_key_filter("decoder.layers.0.mlp.linear_fc1.weight")
    # the layers at Bridge's module paths
    from bridge_hpc.peft.adapter_wrapper import AdapterWrapper
    from bridge_hpc.peft.dora_layers import DoRALinear, ParallelLinearDoRAAdapter
    from bridge_hpc.peft.lora_layers import LoRALinear, ParallelLinearAdapter
    from bridge_hpc.peft.utils import wildcard_match

    assert issubclass(LoRALinear, AdapterWrapper) and issubclass(DoRALinear, AdapterWrapper)
    assert issubclass(ParallelLinearDoRAAdapter, ParallelLinearAdapter)
    assert wildcard_match("*.linear_qkv", "decoder.layers.3.self_attention.linear_qkv")


def test_toml_section_selects_the_class_and_python_configs_are_checked_alike():
    from bridge_hpc.peft.dora import DoRA
    from bridge_hpc.peft.lora import LoRA

    cfg = ConfigContainer.from_sections(_sections({"type": "dora", "dim": 4, "target_modules": ["*.linear_qkv"]}))
    assert type(cfg.peft) is DoRA and cfg.peft.dim == 4 and cfg.peft.alpha == 64
    assert cfg.to_dict()["peft"]["type"] == "dora"
    cfg = ConfigContainer.from_sections(_sections({"type": "lora"}))
    cfg.peft = LoRA(dim=-1)  # a Python config: Bridge's `cfg.peft = LoRA(...)`
    cfg.sections_finalized = False
    with pytest.raises(ConfigError) as err:
        cfg.finalize_sections()
    assert err.value.key == "peft.dim"


@pytest.mark.parametrize("peft, key, words", [
    ({"type": "lorra"}, "peft.type", "did you mean 'lora'"),
    ({"dim": 8}, "peft.type", "expected one of 'lora', 'dora'"),
    ({"type": "lora", "rank": 8}, "peft.rank", "unknown key"),
    ({"type": "lora", "dim": 0}, "peft.dim", "integer >= 1"),
    ({"type": "lora", "dim": 100000}, "peft.dim", "is 100000, above the bound model.hidden_size = 64"),
    ({"type": "lora", "alpha": "big"}, "peft.alpha", "expected an integer"),
    ({"type": "lora", "dropout": 1.0}, "peft.dropout", "probability in [0, 1)"),
    ({"type": "lora", "dropout_position": "mid"}, "peft.dropout_position", "expected"),
    ({"type": "dora", "dropout_position": "post"}, "peft.dropout_position", "before the adapter"),
    ({"type": "lora", "lora_A_init_method": "he"}, "peft.lora_A_init_method", "'xavier', 'normal', 'kaiming', 'zero'"),
    ({"type": "lora", "lora_B_init_method": "ones"}, "peft.lora_B_init_method", "'zero'"),
    ({"type": "lora", "target_modules": ["linear_qvk"]}, "peft.target_modules", "neither one of linear_qkv"),
    ({"type": "lora", "target_modules": ["*.layers.7.*"]}, "peft.target_modules", "no linear layer of the 4-layer"),
    ({"type": "lora", "exclude_modules": ["linear_qkv"]}, "peft.exclude_modules", "target_modules = []"),
    ({"type": "lora", "target_modules": [], "exclude_modules": ["*"]}, "peft.exclude_modules", "excludes every"),
    ({"type": "lora", "normalize_moe_lora": True}, "peft.normalize_moe_lora", "not built"),
    ({"type": "lora", "lora_dtype": "bf16"}, "peft.lora_dtype", "base layer's parameter dtype"),
])
def test_bad_peft_values_are_refused_by_name(peft, key, words):
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_sections(peft), source="job.toml")
    assert err.value.key == key and words in err.value.message and err.value.path == "job.toml"


def test_peft_needs_the_base_it_trains_on():
    sections = _sections({"type": "lora"})
    del sections["checkpoint"]
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(sections)
    assert err.value.key == "checkpoint.pretrained_checkpoint"


@pytest.mark.parametrize("value, words", [("0", "integer >= 1"),
                                          ("100000", "is 100000, above the bound model.hidden_size = 128")])
def test_bridge_submit_refuses_a_bad_peft_key_with_exit_2(tmp_path, value, words):
    """The shipped LoRA config with one bad value, in a folder that has what the config reads (its
    datasets, written by megatron-core's builder, and the pretrained run's checkpoint folder), so that the
    PEFT key is the one thing wrong, whether or not ``make demo-text`` ran here."""
    import numpy as np
    from bridge_test_helpers import ROOT, submit_cli
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    (tmp_path / "data" / "stdlib").mkdir(parents=True)
    for split in ("train", "valid"):
        prefix = tmp_path / "data" / "stdlib" / f"docs_{split}_text_document"
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
        for doc in ([72, 105, 33] * 50, [10, 20, 30] * 50):
            builder.add_document(np.array(doc, dtype=np.uint16), [len(doc)])
        builder.finalize(f"{prefix}.idx")
    (tmp_path / "runs" / "local-tiny-text" / "checkpoints").mkdir(parents=True)
    proc = submit_cli("configs/local-tiny-text-lora.toml", "--dry-run", "--set", f"peft.dim={value}", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "local-tiny-text-lora.toml" in proc.stderr and "'peft.dim'" in proc.stderr and words in proc.stderr
    assert not (tmp_path / "runs" / "local-tiny-text-lora").exists()  # nothing written


def test_wildcards_match_as_bridge_and_count_layers_over_the_model():
    assert wildcard_match("*.linear_qkv", "decoder.layers.3.self_attention.linear_qkv")
    assert wildcard_match("decoder.layers.0.*", "decoder.layers.0.mlp.linear_fc2")
    assert not wildcard_match("decoder.layers.0.*", "decoder.layers.10.mlp.linear_fc2")
    assert not wildcard_match("*.linear_fc1", "decoder.layers.0.mlp.linear_fc1x")
    assert wildcard_match("*.layers.1.*.linear_fc2", "decoder.layers.1.mlp.linear_fc2")
    names = adapter_candidates(2)
    assert len(names) == 8 and names[0] == ("linear_qkv", "decoder.layers.0.self_attention.linear_qkv")
    assert is_adapter_key("decoder.layers.0.mlp.linear_fc1.adapter.weight_magnitude")
    assert not is_adapter_key("decoder.layers.0.mlp.linear_fc1.weight")


def test_the_base_digest_tells_apart_same_sized_bases_and_reads_old_records(tmp_path):
    """Two bases with the same files of the same sizes (two trainings of one model) have different digests;
    a download tool's hidden files do not count; a record written before the method was recorded (the
    names-and-sizes digest) is still checked by its own method."""
    import hashlib
    import os

    from bridge_hpc.peft import checkpoint as peft_checkpoint

    def hf_folder(name: str, seed: int) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "llama"}')
        # 3 MiB whose every block depends on the seed: same size, other content
        (folder / "model.safetensors").write_bytes(hashlib.sha256(str(seed).encode()).digest() * (3 * 2 ** 20 // 32))
        return str(folder)

    a, b, a_again = hf_folder("a", 1), hf_folder("b", 2), hf_folder("a2", 1)
    assert os.path.getsize(f"{a}/model.safetensors") == os.path.getsize(f"{b}/model.safetensors") > 2 ** 20
    assert peft_checkpoint.base_digest(a) != peft_checkpoint.base_digest(b)
    assert peft_checkpoint.base_digest(a) == peft_checkpoint.base_digest(a_again)
    (tmp_path / "a" / ".cache").mkdir()
    (tmp_path / "a" / ".cache" / "download.lock").write_text("etag")
    assert peft_checkpoint.base_digest(a) == peft_checkpoint.base_digest(a_again)
    # the names-and-sizes digest cannot tell a from b: a record of it is checked by it, as it was written
    legacy = {"base_digest": peft_checkpoint.base_digest(b, peft_checkpoint.NAMES_AND_SIZES)}
    assert peft_checkpoint.matches_record(legacy, b) and peft_checkpoint.matches_record(legacy, a_again)
    record = {"base_digest": peft_checkpoint.base_digest(b), "base_digest_method": peft_checkpoint.DIGEST_METHOD}
    assert peft_checkpoint.matches_record(record, b) and not peft_checkpoint.matches_record(record, a)
    assert not peft_checkpoint.matches_record(dict(record, base_digest_method="from the future"), b)
    # a toolkit checkpoint: the files its manifest lists; one of them gone is another base, not a crash
    ckpt = tmp_path / "iter_0000010"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"weights")
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"__0_0.distcp": 7}}))
    whole = peft_checkpoint.base_digest(str(ckpt))
    (ckpt / "__0_0.distcp").unlink()
    assert peft_checkpoint.base_digest(str(ckpt)) != whole


# ---------------------------------------------------------------------------------------------
# The adapters on one rank: frozen base, transparent start, training, merging
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def world():
    yield from single_rank_world()


def _model_cfg(**kw) -> GPTModelConfig:
    cfg = GPTModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=128,
                         make_vocab_size_divisible_by=64, hidden_dropout=0.0, attention_dropout=0.0,
                         share_embeddings_and_output_weights=False, **kw)
    cfg.finalize()
    return cfg


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (2, 17), generator=g)
    return tokens[:, :-1], torch.arange(16).expand(2, 16), tokens[:, 1:]


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_only_adapters_train_the_start_is_the_base_and_the_merge_computes_the_same(world, kind):
    from bridge_hpc.peft.base import apply_peft
    from bridge_hpc.peft.config import PEFT_TYPES
    from bridge_hpc.peft.merge import merge_adapters, merge_state_dicts, merged_state_dict
    from bridge_hpc.training.engine.model import gpt_model_provider

    torch.manual_seed(0)
    model = gpt_model_provider(_model_cfg(activation_func="swiglu"))
    model.eval()
    tokens, positions, labels = _batch(1)
    base_loss = model(tokens, positions, None, labels=labels)
    base = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
    peft = PEFT_TYPES[kind](dim=4, dropout=0.1)
    apply_peft(peft, [model], seed=7, base_folder=None)
    assert torch.equal(model(tokens, positions, None, labels=labels), base_loss) if kind == "lora" else \
        torch.allclose(model(tokens, positions, None, labels=labels), base_loss, atol=1e-5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    per_layer = 3 if kind == "dora" else 2
    assert trainable == peft.params_to_save and len(trainable) == 2 * 4 * per_layer
    assert all(is_adapter_key(n) for n in trainable)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(3):
        optimizer.zero_grad()
        model(*_batch(step)[:2], None, labels=_batch(step)[2]).mean().backward()
        optimizer.step()
    frozen = {k.replace(".to_wrap.", "."): v for k, v in model.state_dict().items() if v is not None and not is_adapter_key(k)}
    assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base)
    assert all(optimizer.state[p] for p in optimizer.param_groups[0]["params"]) and len(optimizer.state) == len(trainable)
    model.eval()
    adapted = model(tokens, positions, None, labels=labels)
    assert not torch.allclose(adapted, base_loss)  # the adapters learnt something
    merged = merged_state_dict(model)
    adapters = {k: v for k, v in model.state_dict().items() if is_adapter_key(k) and v is not None}
    from_checkpoints = merge_state_dicts(base, adapters, peft.alpha, peft.dim)
    assert merged.keys() == from_checkpoints.keys() == base.keys()
    assert all(torch.allclose(merged[k], from_checkpoints[k], atol=1e-6) for k in merged)
    torch.manual_seed(0)
    plain = gpt_model_provider(_model_cfg(activation_func="swiglu"))
    plain.load_state_dict(merged, strict=False)
    plain.eval()
    assert torch.allclose(plain(tokens, positions, None, labels=labels), adapted, atol=1e-5)
    merge_adapters(model)  # Bridge's LoRAMerge: the plain model back, computing the same
    assert not any(".adapter." in n for n, _ in model.named_parameters())
    assert torch.allclose(model(tokens, positions, None, labels=labels), adapted, atol=1e-5)


def _adapted(model) -> dict:
    """Full name -> the adapter of every wrapped layer of ``model``."""
    from bridge_hpc.peft.adapter_wrapper import AdapterWrapper

    return {name: module.adapter for name, module in model.named_modules() if isinstance(module, AdapterWrapper)}


def test_the_lora_fields_act_targets_exclusions_initializations_and_dropout_position(world):
    """Which layers a pattern or an exclusion adapts; A drawn by its named initialization and B at zero (the
    start is the base); dropout before the adapter leaves its output dense, after it zeroes whole entries."""
    from bridge_hpc.peft.base import apply_peft
    from bridge_hpc.peft.lora import LoRA
    from bridge_hpc.training.engine.model import gpt_model_provider

    def adapted(peft):
        torch.manual_seed(0)
        model = gpt_model_provider(_model_cfg())
        apply_peft(peft, [model], seed=7, base_folder=None)
        return model, _adapted(model)

    _, only = adapted(LoRA(target_modules=["*.layers.1.*.linear_fc2", "linear_qkv"], dim=4))
    assert sorted(only) == ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc2",
                            "decoder.layers.1.self_attention.linear_qkv"]
    _, all_but = adapted(LoRA(target_modules=[], exclude_modules=["linear_proj", "decoder.layers.0.mlp.*"], dim=4))
    assert sorted(all_but) == ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc1",
                               "decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.self_attention.linear_qkv"]

    stds = {}
    for method in ("xavier", "normal", "kaiming", "zero"):
        _, layers = adapted(LoRA(target_modules=["linear_fc1"], dim=8, lora_A_init_method=method))
        a = layers["decoder.layers.0.mlp.linear_fc1"].linear_in.weight  # (dim, hidden) = (8, 64)
        assert not layers["decoder.layers.0.mlp.linear_fc1"].linear_out.weight.any()  # B: zero
        stds[method] = float(a.std())
    assert stds["zero"] == 0.0
    assert stds["normal"] == pytest.approx(0.2, rel=0.15)  # Bridge's normal: std 0.2
    assert stds["xavier"] == pytest.approx((2 / (8 + 64)) ** 0.5, rel=0.15)  # xavier normal
    # kaiming uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in)), whose std is that bound / sqrt(3)
    assert stds["kaiming"] == pytest.approx((1 / 64) ** 0.5 / 3 ** 0.5, rel=0.15)

    zeros = {}
    for position in ("pre", "post"):
        model, layers = adapted(LoRA(target_modules=["linear_fc2"], dim=4, dropout=0.5, dropout_position=position,
                                     lora_B_init_method="normal"))
        model.train()
        adapter = layers["decoder.layers.0.mlp.linear_fc2"]
        torch.manual_seed(3)
        out = adapter(torch.randn(16, 2, 256))
        zeros[position] = float((out == 0).float().mean())
    assert zeros["pre"] == 0.0 and 0.35 < zeros["post"] < 0.65, zeros


# ---------------------------------------------------------------------------------------------
# Tensor and pipeline parallelism: 2 gloo ranks
# ---------------------------------------------------------------------------------------------


def _global_name(chunk, key: str) -> str:
    """``key`` of a (stage's) state dict as in the whole model: layers counted over the model."""
    parts = key.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts).replace(".to_wrap.", ".")


def _copy_base(chunk, full: dict) -> None:
    """Copy the full base weights ``full`` into ``chunk``, each parameter split as its layer splits it."""
    from megatron.core import parallel_state

    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for key, param in chunk.named_parameters():
            value = full[_global_name(chunk, key)]
            if getattr(param, "tensor_model_parallel", False) and size > 1:
                value = value.chunk(size, dim=param.partition_dim)[rank]
            param.copy_(value)


def _train(chunks, steps, first_step, pipeline=False):
    """Adam on the adapters for ``steps`` steps; every rank returns the losses (TP: each rank has them;
    PP: the last stage sends them back)."""
    import torch.distributed as dist

    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for step in range(first_step, first_step + steps):
        tokens, positions, labels = _batch(step)
        optimizer.zero_grad()
        if not pipeline:
            loss = chunks[0](tokens, positions, None, labels=labels).mean()
            loss.backward()
        else:  # stage 0 -> stage 1, then the gradient of stage 0's output back
            if dist.get_rank() == 0:
                hidden = chunks[0](tokens, positions, None)
                dist.send(hidden.detach(), 1)
                grad = torch.empty_like(hidden)
                dist.recv(grad, 1)
                hidden.backward(grad)
                loss = torch.empty(())
                dist.recv(loss, 1)
            else:
                hidden = torch.empty(16, 2, 64)
                dist.recv(hidden, 0)
                hidden.requires_grad_()
                chunks[0].set_input_tensor(hidden)
                loss = chunks[0](None, positions, None, labels=labels).mean()
                loss.backward()
                dist.send(hidden.grad, 0)
                dist.send(loss.detach(), 0)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _eval(chunk) -> float:
    """The loss of a held-out batch (no dropout, no training)."""
    chunk.eval()
    tokens, positions, labels = _batch(99)
    with torch.no_grad():
        loss = float(chunk(tokens, positions, None, labels=labels).mean())
    chunk.train()
    return loss


def _build(tp: int, pp: int, full_base: dict, kind: str):
    from megatron.core import parallel_state

    from bridge_hpc.peft.base import apply_peft
    from bridge_hpc.peft.config import PEFT_TYPES
    from bridge_hpc.training.engine.model import gpt_model_provider

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    chunk = gpt_model_provider(_model_cfg(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                               pre_process=first, post_process=last)
    if full_base is not None:
        _copy_base(chunk, full_base)
    apply_peft(PEFT_TYPES[kind](dim=4, target_modules=["*.linear_qkv", "*.linear_proj", "linear_fc1", "linear_fc2"]),
               [chunk], seed=5, base_folder=None)
    return chunk


def _entries(chunk) -> list:
    """The adapters' entries of ``chunk``'s megatron-core sharded state dict (ShardedTensors; the layers of a
    kind share one key, each layer at its offset on the prepended layer axis)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for k, v in chunk.sharded_state_dict().items() if is_adapter_key(k) and isinstance(v, ShardedTensor)]


def _index(entry) -> tuple:
    """Where a rank's part lies in the whole tensor (the layer axis megatron-core prepends included)."""
    n = entry.prepend_axis_num
    return tuple(entry.global_offset[:n]) + tuple(slice(o, o + s) for o, s in zip(entry.global_offset[n:],
                                                                                  entry.data.shape))


def _assembled_adapters(chunk) -> dict:
    """Every adapter tensor as a whole, as a checkpoint holds it: each rank's main-replica parts put at their
    global offsets (what megatron-core's save writes), summed over the ranks."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    out = {}
    for entry in sorted(_entries(chunk), key=lambda e: (e.key, e.global_offset)):
        full = out.setdefault(entry.key, torch.zeros(entry.global_shape))
        if is_main_replica(entry.replica_id):
            full[_index(entry)] = entry.data.detach()
    for full in out.values():
        dist.all_reduce(full)
    return out


def _load_assembled(chunk, saved: dict) -> None:
    """Load whole adapter tensors into ``chunk``, each rank its parts (what megatron-core's load reads)."""
    entries = _entries(chunk)
    assert sorted({e.key for e in entries}) == sorted(saved)
    with torch.no_grad():
        for entry in entries:
            entry.data.copy_(saved[entry.key][_index(entry)])


def _fused(chunk) -> int:
    """How many of ``chunk``'s LoRA layers run fused (issue 35: only without tensor or sequence parallelism)."""
    from bridge_hpc.peft.lora_layers import LoRALinear

    return sum(module.fusable_layout for module in chunk.modules() if isinstance(module, LoRALinear))


def _layouts(rank: int, port: int, out: str, kind: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = {}
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    from bridge_hpc.training.engine.model import gpt_model_provider

    full_base = {k: v.clone() for k, v in gpt_model_provider(_model_cfg()).state_dict().items() if v is not None}
    tp1 = _build(1, 1, full_base, kind)
    result["base_eval"] = _eval(tp1)
    result["tp1"] = _train([tp1], STEPS, 0)
    tp1_adapters = _assembled_adapters(tp1)
    result["tp1_eval"] = _eval(tp1)
    tp2 = _build(2, 1, full_base, kind)
    result["tp2"] = _train([tp2], STEPS, 0)
    saved = _assembled_adapters(tp2)  # what a TP2 checkpoint holds, as whole tensors
    result["assembled_max_diff"] = max(float((saved[k] - tp1_adapters[k]).abs().max()) for k in tp1_adapters)
    result["assembled_keys_equal"] = sorted(saved) == sorted(tp1_adapters)
    result["tp2_eval"] = _eval(tp2)
    resumed = _build(1, 1, full_base, kind)  # the TP2 checkpoint loaded at TP1
    _load_assembled(resumed, saved)
    result["tp1_resumed_eval"] = _eval(resumed)
    pp2 = _build(1, 2, full_base, kind)
    result["pp2_layers"] = sorted({k.split(".")[2] for k in pp2.state_dict() if k.startswith("decoder.layers.")})
    result["pp2_adapter_names"] = sorted(_global_name(pp2, k) for k, p in pp2.named_parameters() if p.requires_grad)
    result["pp2"] = _train([pp2], STEPS, 0, pipeline=True)
    result["fused"] = [_fused(tp1), _fused(tp2), _fused(pp2)]
    parallel_state.destroy_model_parallel()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_tp2_and_pp2_train_as_tp1_and_a_tp2_checkpoint_resumes_at_tp1(tmp_path, kind):
    run_gloo_ranks(_layouts, free_port(), str(tmp_path), kind)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    assert r0["tp1"] == r1["tp1"] and r0["tp2"] == r1["tp2"] and r0["pp2"] == r1["pp2"]
    assert r0["tp1"][-1] < r0["tp1"][0]  # it trains
    # LoRA's fused layers at TP1 (every stage's too), the unfused ones at TP2, against which they are checked
    assert r0["fused"] == ([8, 0, 4] if kind == "lora" else [0, 0, 0]) and r1["fused"] == r0["fused"]
    for layout in ("tp2", "pp2"):
        assert r0[layout] == pytest.approx(r0["tp1"], rel=1e-4, abs=1e-5), layout
    assert r0["assembled_keys_equal"] and r0["assembled_max_diff"] < 1e-5
    # the TP2 adapters loaded at TP1 compute what they computed at TP2 (and what TP1's own computed)
    assert r0["tp1_resumed_eval"] == pytest.approx(r0["tp2_eval"], rel=1e-5)
    assert r0["tp1_resumed_eval"] == pytest.approx(r0["tp1_eval"], rel=1e-4)
    assert r0["tp1_resumed_eval"] != pytest.approx(r0["base_eval"], rel=1e-3)  # they are trained ones
    # each stage holds one layer (its local name 0) and adapts it as the model's layer 0 or 1
    assert r0["pp2_layers"] == r1["pp2_layers"] == ["0"]
    assert {n.split(".")[2] for n in r0["pp2_adapter_names"]} == {"0"}
    assert {n.split(".")[2] for n in r1["pp2_adapter_names"]} == {"1"}
