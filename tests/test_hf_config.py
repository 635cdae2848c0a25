"""``[model] hf_config`` at submission (issue 29): what bridge-submit makes of a job that names a Hugging Face
folder, read from the resolved.toml of a dry run, and what it refuses (one line naming the file and the key,
exit 2, no traceback, nothing written). The folders are small random models made with transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import toml
from hf_models import make_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A Llama (3.1 rope scaling) and a GPT-2 folder, the Llama with a tokenizer saved beside it."""
    base = tmp_path_factory.mktemp("hf-config")
    out = {}
    for family in ("llama", "gpt2"):
        out[family] = base / family
        make_hf_model(family, str(out[family]))
    from transformers import GPT2TokenizerFast

    vocab = {chr(ord("a") + i): i for i in range(26)}  # a tokenizer from files written here: nothing downloaded
    (base / "vocab.json").write_text(json.dumps(vocab))
    (base / "merges.txt").write_text("#version: 0.2\n")
    GPT2TokenizerFast(vocab_file=str(base / "vocab.json"), merges_file=str(base / "merges.txt")).save_pretrained(
        str(out["llama"]))
    return out


def _job(tmp_path, model: str, extra: str = "") -> str:
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nrun_dir = "runs/x"\n[train]\ntrain_iters = 1\nmicro_batch_size = 1\nglobal_batch_size = 1\n'
                   f'[optimizer]\nlr = 1e-4\n[model]\n{model}\n{extra}')
    return str(job)


def _submit(tmp_path, job: str, *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "bridge_hpc.cli.submit", job, "--dry-run"]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def _resolved(tmp_path, job: str) -> dict:
    """What the ranks would read: the resolved.toml bridge-submit writes for ``job``."""
    from bridge_hpc.jobfile.jobconfig import dump_resolved, load_job_config

    return toml.loads(dump_resolved(load_job_config(job, cwd=tmp_path)))


def test_the_model_comes_from_config_json_explicit_training_keys_win_and_the_tokenizer_comes_along(folders, tmp_path):
    job = _job(tmp_path, f'hf_config = "{folders["llama"]}"\nseq_length = 32\nhidden_dropout = 0.0')
    proc = _submit(tmp_path, job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = _resolved(tmp_path, job)
    model = resolved["model"]
    assert (model["num_layers"], model["hidden_size"], model["num_attention_heads"], model["num_query_groups"],
            model["ffn_hidden_size"], model["vocab_size"]) == (2, 64, 4, 2, 96, 100)
    assert model["normalization"] == "RMSNorm" and model["activation_func"] == "swiglu"
    assert model["rope_scaling"] is True and model["rope_scaling_factor"] == 8.0  # Llama 3.1's
    assert model["share_embeddings_and_output_weights"] is False
    assert model["seq_length"] == 32 and model["hidden_dropout"] == 0.0  # the job's own values
    assert resolved["tokenizer"] == {**resolved["tokenizer"], "tokenizer_type": "HuggingFaceTokenizer",
                                     "tokenizer_model": str(folders["llama"])}


def test_gpt2_gets_learned_positions_layernorm_gelu_and_tied_embeddings(folders, tmp_path):
    job = _job(tmp_path, f'hf_config = "{folders["gpt2"]}"\nseq_length = 32')
    proc = _submit(tmp_path, job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = _resolved(tmp_path, job)["model"]
    assert model["position_embedding_type"] == "learned_absolute" and model["normalization"] == "LayerNorm"
    assert model["activation_func"] in ("gelu", "openai_gelu") and model["share_embeddings_and_output_weights"] is True


def _refused(tmp_path, proc, path: str, key: str, words: str) -> None:
    """One line naming ``path`` (the file at fault), ``key`` and ``words``; exit 2; nothing written."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and f"'{key}'" in lines[0] and words in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.parametrize("key, value, words", [
    ("hidden_size", 128, "but the checkpoint in"),
    ("num_layers", 3, "leave it out to take the checkpoint's"),
    ("num_query_groups", 4, "has 2"),
])
def test_a_key_that_contradicts_the_checkpoint_is_refused_by_name(folders, tmp_path, key, value, words):
    job = _job(tmp_path, f'hf_config = "{folders["llama"]}"\nseq_length = 32\n{key} = {value}')
    _refused(tmp_path, _submit(tmp_path, job), job, f"model.{key}", words)


def test_an_unsupported_model_type_and_a_folder_without_config_json_are_refused(folders, tmp_path):
    bert = tmp_path / "bert"
    shutil.copytree(folders["llama"], bert)
    text = (bert / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "bert"')
    (bert / "config.json").write_text(text)
    job = _job(tmp_path, f'hf_config = "{bert}"')
    # the file at fault is the folder's config.json, and its key
    _refused(tmp_path, _submit(tmp_path, job), str(bert / "config.json"), "model_type",
             "supported: llama, mistral, qwen2, qwen3, gpt2")
    (bert / "config.json").unlink()
    _refused(tmp_path, _submit(tmp_path, job), job, "model.hf_config", f"{bert / 'config.json'}: missing")


def test_a_layout_the_model_cannot_take_is_refused_at_submission(folders, tmp_path):
    """4 heads cannot be split over 3 tensor-parallel ranks; 2 layers not over 4 pipeline stages."""
    job = _job(tmp_path, f'hf_config = "{folders["llama"]}"\nseq_length = 32\ntensor_model_parallel_size = 3')
    proc = _submit(tmp_path, job)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert job in proc.stderr and "tensor_model_parallel_size" in proc.stderr, proc.stderr
    job = _job(tmp_path, f'hf_config = "{folders["llama"]}"\nseq_length = 32\npipeline_model_parallel_size = 4')
    proc = _submit(tmp_path, job)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert job in proc.stderr and "pipeline_model_parallel_size" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_damaged_folder_is_named_by_the_jobs_key_that_points_at_it(folders, tmp_path):
    """``model.hf_config`` and ``checkpoint.pretrained_checkpoint`` can name two folders: the one line names
    the key whose folder is damaged, and the damaged file."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("[1, 2]")
    job = _job(tmp_path, f'hf_config = "{broken}"', f'[checkpoint]\npretrained_checkpoint = "{folders["llama"]}"')
    _refused(tmp_path, _submit(tmp_path, job), job, "model.hf_config", f"{broken / 'config.json'}: expected a JSON object")
    truncated = tmp_path / "truncated"
    shutil.copytree(folders["llama"], truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    job = _job(tmp_path, "", f'[checkpoint]\npretrained_checkpoint = "{truncated}"')  # the model from it too
    _refused(tmp_path, _submit(tmp_path, job), job, "checkpoint.pretrained_checkpoint",
             f"{truncated / 'model.safetensors'}: truncated")
