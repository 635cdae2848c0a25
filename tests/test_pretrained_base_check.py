"""A toolkit checkpoint as ``checkpoint.pretrained_checkpoint`` whose model contradicts ``[model]`` is
refused by bridge-submit (issue 36, item 1): one line naming the file, the key, both values and the
checkpoint, exit 2, no traceback, nothing written. Before, it passed submission and ``--dry-run`` and
failed on every rank with a size mismatch after the queue, once per requeue.

The bases are real: Hugging Face folders made with transformers and turned into toolkit checkpoints by
``bridge-hf import`` (CPU), whose run_config.json records the model, as every run's checkpoint does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hf_models import make_hf_model
from warm_ranks import run_module

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """``{family: (Hugging Face folder, toolkit checkpoints folder)}`` for a Llama and a GPT-2."""
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for family in ("llama", "gpt2"):
        hf, ckpt = root / f"{family}-hf", root / f"{family}-ckpt"
        make_hf_model(family, str(hf))
        done = run_module("bridge_hpc.cli.hf", ["import", str(hf), str(ckpt)], timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out[family] = (hf, ckpt)
    return out


def _submit(tmp_path, model: str, pretrained, *flags: str) -> subprocess.CompletedProcess:
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nrun_dir = "runs/x"\nentry = "finetune"\n[train]\ntrain_iters = 1\nmicro_batch_size = 1\n'
                   f'global_batch_size = 1\n[optimizer]\nlr = 1e-4\n[model]\n{model}\n'
                   f'[checkpoint]\npretrained_checkpoint = "{pretrained}"\n')
    return subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), *flags], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("peft", [False, True])
def test_a_gpt2_base_under_a_llama_shaped_job_is_refused_at_submission(bases, tmp_path, peft):
    llama_hf, _ = bases["llama"]
    _, gpt2_ckpt = bases["gpt2"]
    model = f'hf_config = "{llama_hf}"\nseq_length = 32' + ('\n[peft]\ntype = "lora"' if peft else "")
    proc = _submit(tmp_path, model, gpt2_ckpt, "--dry-run")
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert str(tmp_path / "job.toml") in last and "model." in last and str(gpt2_ckpt) in last, last
    assert not (tmp_path / "runs").exists()  # nothing written


def test_each_shape_field_names_itself_with_both_values(bases, tmp_path):
    _, llama_ckpt = bases["llama"]
    saved = json.loads((llama_ckpt / "iter_0000000" / "run_config.json").read_text())["model"]
    explicit = "\n".join(f"{k} = {json.dumps(saved[k])}" for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
        "position_embedding_type", "normalization", "activation_func", "add_bias_linear",
        "add_qkv_bias", "qk_layernorm", "share_embeddings_and_output_weights") if saved.get(k) is not None)
    ok = _submit(tmp_path, explicit + "\nseq_length = 32", llama_ckpt, "--dry-run")
    assert ok.returncode == 0, ok.stderr[-3000:]  # the base's own architecture, spelled out: accepted
    wrong = explicit.replace(f"hidden_size = {saved['hidden_size']}", f"hidden_size = {2 * saved['hidden_size']}")
    proc = _submit(tmp_path, wrong + "\nseq_length = 32", llama_ckpt, "--dry-run")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "model.hidden_size" in last, proc.stderr[-3000:]
    assert f"is {2 * saved['hidden_size']}" in last and f"hidden_size = {saved['hidden_size']}" in last, last


def test_the_matching_hugging_face_shaped_job_from_its_imported_base_is_accepted(bases, tmp_path):
    llama_hf, llama_ckpt = bases["llama"]
    proc = _submit(tmp_path, f'hf_config = "{llama_hf}"\nseq_length = 32', llama_ckpt, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_an_unreadable_run_config_names_the_file_and_the_key(bases, tmp_path):
    import shutil

    llama_hf, llama_ckpt = bases["llama"]
    copy = tmp_path / "copy"
    shutil.copytree(llama_ckpt, copy)
    (copy / "iter_0000000" / "run_config.json").write_text("{not json")
    proc = _submit(tmp_path, f'hf_config = "{llama_hf}"\nseq_length = 32', copy, "--dry-run")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "checkpoint.pretrained_checkpoint" in last and "run_config.json" in last, last
    assert "Traceback" not in proc.stderr


def test_a_base_damaged_at_its_full_size_is_one_line_naming_the_key_on_the_ranks(bases, tmp_path):
    """Issue 36, item 10 (a message that named the wrong thing): a toolkit base whose bytes were overwritten
    in place passes every size check and fails in torch.distributed.checkpoint's read, whose wrapper the
    rank's summary named: ``rank failed: CheckpointException: CheckpointException ranks:dict_keys([0])``,
    exit 1 (requeued, to read the same bytes). Now one line naming the job file,
    checkpoint.pretrained_checkpoint, the folder and the reader's error; exit 2."""
    import shutil

    from bridge_test_helpers import direct_rank_env

    llama_hf, llama_ckpt = bases["llama"]
    copy = tmp_path / "base"
    shutil.copytree(llama_ckpt, copy)
    shard = max((copy / "iter_0000000").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.write(b"\xff" * 4096)
    (tmp_path / "job.toml").write_text(
        f'[job]\nentry = "finetune"\n[train]\ntrain_iters = 1\nmicro_batch_size = 1\nglobal_batch_size = 1\n'
        f'[optimizer]\nlr = 1e-4\n[model]\nhf_config = "{llama_hf}"\nseq_length = 16\n[dataset]\nseq_length = 16\n'
        f'[checkpoint]\npretrained_checkpoint = "{copy}"\n')
    proc = run_module("bridge_hpc.rank", ["job.toml"], cwd=tmp_path, env=direct_rank_env(), timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith("error: job.toml: key 'checkpoint.pretrained_checkpoint': ") and str(copy) in last, last
    assert "contents are damaged" in last and "CheckpointException" not in last, last
