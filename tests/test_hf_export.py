"""Toolkit checkpoints out to Hugging Face: import -> export is bitwise the original for every family
and loads in transformers with the same logits; megatron-core's sharded (GPU) layout is read too; a
fine-tuned run's export gives transformers the toolkit's loss."""

from __future__ import annotations

import json
import os

import pytest
import torch
from bridge_test_helpers import direct_rank_env, single_rank_world
from hf_models import FAMILIES, FINETUNE_JOB, SEQ, VOCAB, batch, hf_logits, make_hf_model, model_config
from safetensors.torch import load_file
from warm_ranks import run_module


@pytest.fixture
def world():
    yield from single_rank_world()


def _tensors(folder) -> dict:
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def test_import_then_export_gives_the_original_tensors_bitwise(tmp_path, world):
    from bridge_hpc.models.hf.convert import import_folder
    from bridge_hpc.models.hf.export import export

    for family in FAMILIES:
        original = str(tmp_path / family)
        make_hf_model(family, original)
        imported, exported = str(tmp_path / f"{family}-ckpt"), str(tmp_path / f"{family}-hf")
        import_folder(original, imported)
        export(imported, exported)
        before, after = _tensors(original), _tensors(exported)
        assert sorted(before) == sorted(after), family
        for name, tensor in before.items():
            assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), (family, name)
        tokens = batch()["tokens"]
        assert torch.equal(hf_logits(exported, tokens), hf_logits(original, tokens)), family
        config = json.loads((tmp_path / f"{family}-hf" / "config.json").read_text())
        assert config["model_type"] == family


def test_megatron_core_sharded_checkpoints_are_read_at_their_global_shapes(tmp_path, world, monkeypatch):
    """The GPU back end's layout (megatron-core dist_checkpointing: layers stacked, layer norms under
    Transformer Engine's names, the padded vocabulary), written by megatron-core itself; its save
    synchronizes CUDA, which is made a no-op here for want of a GPU."""
    from megatron.core import dist_checkpointing

    from bridge_hpc.models.hf.export import export
    from bridge_hpc.training.checkpoint import layout
    from bridge_hpc.training.checkpoint.checkpointing import _write_manifest
    from bridge_hpc.training.engine.model import gpt_model_provider
    from bridge_hpc.training.hf import load

    original = str(tmp_path / "llama")
    make_hf_model("llama", original)
    cfg = model_config(original, make_vocab_size_divisible_by=128)  # padded: 100 -> 128 rows
    model = gpt_model_provider(cfg)
    load.load_hf_weights(original, [model])
    folder = layout.iteration_dir(str(tmp_path / "checkpoints"), 3)
    os.makedirs(folder)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    dist_checkpointing.save({"model": model.sharded_state_dict()}, folder)
    import dataclasses

    (tmp_path / "checkpoints" / "iter_0000003" / "run_config.json").write_text(
        json.dumps({"model": dataclasses.asdict(cfg)}))
    layout._torch_save_durable({"rank": 0, "world_size": 1}, os.path.join(folder, "rank_00000.pt"))
    _write_manifest(folder, 3, 1)
    export(str(tmp_path / "checkpoints"), str(tmp_path / "out"))
    before, after = _tensors(original), _tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_pretrain_starts_from_a_hugging_face_folder_too(tmp_path, world):
    """Continued pretraining (the default entry, no ``[job] entry = "finetune"``) from a Hugging Face
    folder: with a learning rate far below a float32 weight's resolution, the run's checkpoint holds exactly
    the folder's weights (its export is bitwise the original)."""
    from bridge_hpc.models.hf.export import export

    hf = str(tmp_path / "qwen2")
    make_hf_model("qwen2", hf)
    job = FINETUNE_JOB.format(seq=SEQ, hf=hf).replace('entry = "finetune"\n', "").replace("lr = 0.01", "lr = 1e-30")
    assert "entry" not in job and "lr = 1e-30" in job
    (tmp_path / "job.toml").write_text(job)
    proc = run_module("bridge_hpc.rank", ["job.toml"], cwd=tmp_path, env=direct_rank_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"loaded pretrained weights from Hugging Face folder {hf}" in proc.stdout
    export(str(tmp_path / "runs" / "job" / "checkpoints"), str(tmp_path / "exported"))
    before, after = _tensors(hf), _tensors(tmp_path / "exported")
    assert sorted(before) == sorted(after) and all(torch.equal(after[k], v) for k, v in before.items())


def test_fine_tuned_export_gives_transformers_the_toolkits_loss(tmp_path, world):
    from bridge_hpc.models.hf.export import export
    from bridge_hpc.training.checkpoint.megatron import _load_model_and_optimizer
    from bridge_hpc.training.engine.model import gpt_model_provider

    hf = str(tmp_path / "llama")
    original = make_hf_model("llama", hf)
    (tmp_path / "job.toml").write_text(FINETUNE_JOB.format(seq=SEQ, hf=hf))
    proc = run_module("bridge_hpc.rank", ["job.toml"], cwd=tmp_path, env=direct_rank_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"loaded pretrained weights from Hugging Face folder {hf}" in proc.stdout
    checkpoints = tmp_path / "runs" / "job" / "checkpoints"
    export(str(checkpoints), str(tmp_path / "exported"))

    b = batch(seed=7)
    labels = torch.roll(b["tokens"], -1, dims=1)
    cfg = model_config(hf)
    ours = gpt_model_provider(cfg).eval()
    _load_model_and_optimizer([ours], None, str(checkpoints / "iter_0000003"), load_optim=False)
    with torch.no_grad():
        toolkit_loss = ours(b["tokens"], b["position_ids"], None, labels=labels)[:, :-1].mean().item()
    import transformers as T

    exported = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = exported(b["tokens"]).logits[:, :-1]
        hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, :-1].reshape(-1)).item()
        before = torch.nn.functional.cross_entropy(original(b["tokens"]).logits[:, :-1].reshape(-1, VOCAB),
                                                   labels[:, :-1].reshape(-1)).item()
    assert abs(hf_loss - toolkit_loss) <= 1e-4, (hf_loss, toolkit_loss)
    assert abs(hf_loss - before) > 1e-3  # the export holds the fine-tuned weights, not the original ones


def test_the_folders_tokenizer_comes_along_into_the_job_and_out_with_the_export(tmp_path, world):
    from hf_models import add_tokenizer
    from transformers import AutoTokenizer

    from bridge_hpc.jobfile.jobconfig import load_job_config
    from bridge_hpc.models.hf.convert import import_folder
    from bridge_hpc.models.hf.export import export
    from bridge_hpc.training.tokenizers import build_tokenizer

    hf = tmp_path / "gpt2"
    make_hf_model("gpt2", str(hf))
    add_tokenizer(str(hf))
    job = tmp_path / "job.toml"
    job.write_text(f"[train]\ntrain_iters = 1\nglobal_batch_size = 2\nmicro_batch_size = 2\n[optimizer]\nlr = 1e-4\n"
                   f"[model]\nhf_config = \"{hf}\"\nseq_length = {SEQ}\n"
                   f"[dataset]\nseq_length = {SEQ}\n")
    cfg = load_job_config(job, cwd=tmp_path).training
    assert (cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model) == ("HuggingFaceTokenizer", str(hf))
    text = "the lazy fox"
    assert build_tokenizer(cfg.tokenizer).tokenize(text) == AutoTokenizer.from_pretrained(str(hf))(text)["input_ids"]
    import_folder(str(hf), str(tmp_path / "ckpt"))
    export(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out"))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(hf))(text)["input_ids"]
