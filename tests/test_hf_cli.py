"""``bridge-hf`` and ``bridge-submit`` on bad Hugging Face input: one line naming the file (and tensor),
exit status 2, no traceback, nothing written under OUT; and a good import from the command line."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
from hf_models import make_hf_model

HF = [sys.executable, "-m", "bridge_hpc.cli.hf"]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good") / "qwen2"
    make_hf_model("qwen2", str(folder))
    return folder


def _variant(good, tmp_path, name):
    folder = tmp_path / name
    shutil.copytree(good, folder)
    return folder


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _rename_tensor(folder, old, new):
    """Rewrite the safetensors header with one tensor renamed (``new`` no longer: the data stays put)."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length].decode().replace(f'"{old}"', f'"{new}"')
    header += " " * (length - len(header))  # safetensors pads its header with spaces
    assert len(header) == length
    path.write_bytes(data[:8] + header.encode() + data[8 + length:])


BAD = {
    "missing folder": (lambda good, tmp: tmp / "nope", "no such file or folder"),
    "no config.json": (lambda good, tmp: (lambda f: (os.remove(f / "config.json"), f)[1])(_variant(good, tmp, "x")),
                       "config.json: missing"),
    "unsupported model_type": (lambda good, tmp: (lambda f: (_edit_config(f, model_type="bert"), f)[1])(
        _variant(good, tmp, "x")), "supported: llama, mistral, qwen2, qwen3, gpt2"),
    "truncated shard": (lambda good, tmp: (lambda f: (os.truncate(f / "model.safetensors", 5000), f)[1])(
        _variant(good, tmp, "x")), "model.safetensors: truncated"),
    "wrong shape": (lambda good, tmp: (lambda f: (_edit_config(f, intermediate_size=128), f)[1])(
        _variant(good, tmp, "x")), "key 'model.layers.0.mlp.gate_proj.weight': has shape [96, 64], expected [128, 64]"),
    "wrong name": (lambda good, tmp: (lambda f: (_rename_tensor(f, "model.norm.weight", "model.nrm.weight"), f)[1])(
        _variant(good, tmp, "x")), "key 'model.norm.weight': missing"),
    "newline in path": (lambda good, tmp: tmp / "a\nb", "control characters"),
    "command in path": (lambda good, tmp: tmp / "$(touch pwned)", "no such file or folder"),
    "missing index shard": (lambda good, tmp: (lambda f: ((f / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})), f)[1])(_variant(good, tmp, "x")),
        "model-00002-of-00002.safetensors: missing"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_import_input_is_one_line_and_exit_2_with_nothing_written(good, tmp_path, case):
    make, words = BAD[case]
    source = make(good, tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(HF + ["import", str(source), str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not (tmp_path / "out.tmp").exists() and not (tmp_path / "pwned").exists()


def test_export_refuses_what_is_no_checkpoint_and_an_existing_out(good, tmp_path):
    for args, words in (([str(good), str(tmp_path / "o")], "holds no complete checkpoint"),
                        ([str(tmp_path), str(good)], "exists already")):
        proc = subprocess.run(HF + ["export"] + args, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert words in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "o").exists()


def test_import_writes_a_checkpoint_that_submission_takes_and_a_bad_folder_is_refused_at_submission(good, tmp_path):
    proc = subprocess.run(HF + ["import", str(good), str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[bridge-hf" in proc.stderr and (tmp_path / "ckpt" / "iter_0000000" / "manifest.json").is_file()
    bad = _variant(good, tmp_path, "bad")
    _edit_config(bad, num_hidden_layers=3)
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nentry = "finetune"\n[optimizer]\nlr = 1e-4\n[checkpoint]\npretrained_checkpoint = "{bad}"\n')
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "key 'model.layers.2.input_layernorm.weight': missing" in proc.stderr
