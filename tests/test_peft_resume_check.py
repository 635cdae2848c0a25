"""Resuming a PEFT run on another base, type or adapter shape is refused by bridge-submit and its
``--dry-run`` (issue 36, item 6): one line naming the job file, the key, the checkpoint's peft_base.json
and both values, exit 2, nothing queued, nothing in the run folder changed. Before, the job passed
submission and the ranks refused it after the queue.

The run folder is real: a LoRA fine-tune of a small Hugging Face model, run by one rank started directly
(as srun starts it), leaves its adapter checkpoint and its record of the base.
"""

from __future__ import annotations

import os
import shutil

import pytest
from bridge_test_helpers import direct_rank_env, submit_cli
from hf_models import FINETUNE_JOB, SEQ, make_hf_model
from test_dry_run_checks import calls, folder_state, slurm_shims
from warm_ranks import run_module

pytest.importorskip("transformers")

LORA_JOB = FINETUNE_JOB + '[peft]\ntype = "lora"\ndim = 4\nalpha = 8\n'


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(folder, its base, another model)``: a LoRA run's folder (job.toml, runs/job) trained on ``base``."""
    root = tmp_path_factory.mktemp("lora")
    base, other = root / "base", root / "other"
    make_hf_model("llama", str(base))
    make_hf_model("llama", str(other), seed=1)  # the same architecture and file sizes, other weights
    (root / "job.toml").write_text(LORA_JOB.format(seq=SEQ, hf=base))
    proc = run_module("bridge_hpc.rank", ["job.toml"], cwd=root, env=direct_rank_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root / "runs" / "job" / "checkpoints" / "iter_0000003" / "peft_base.json").is_file()
    return root, base, other


def _refused(proc, *words):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert str(word) in lines[0], lines[0]
    return lines[0]


def test_adapters_of_another_base_type_or_shape_are_refused_at_submission(trained, tmp_path):
    root, base, other = trained
    run_dir = root / "runs" / "job"
    record = run_dir / "checkpoints" / "iter_0000003" / "peft_base.json"
    shims = slurm_shims(tmp_path / "shims")
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")
    before = folder_state(run_dir)
    job = "job.toml"  # (the file, as given; a --set names itself after it)

    ok = submit_cli("job.toml", "--dry-run", cwd=root, env=env)  # the same job, the same base: it resumes
    assert ok.returncode == 0, ok.stderr[-3000:]

    moved = submit_cli("job.toml", "--set", f"checkpoint.pretrained_checkpoint={other}", "--dry-run", cwd=root, env=env)
    _refused(moved, job, "key 'checkpoint.pretrained_checkpoint'", record, f"trained on {base}", f"base is {other}")
    for kind, value in (("dim", 8), ("type", "dora")):
        proc = submit_cli("job.toml", "--set", f"peft.{kind}={value}", "--dry-run", cwd=root, env=env)
        _refused(proc, f"key 'peft.{kind}'", record, repr(value))

    # The base replaced in place (the same path, the same job file): the same job, another model under it.
    saved = tmp_path / "saved-base"
    shutil.copytree(base, saved)
    try:
        shutil.copy2(other / "model.safetensors", base / "model.safetensors")
        for flags in (["--dry-run"], []):
            proc = submit_cli("job.toml", *flags, cwd=root, env=env)
            _refused(proc, job, "key 'checkpoint.pretrained_checkpoint'", record, "resume on the same base")
    finally:
        shutil.copy2(saved / "model.safetensors", base / "model.safetensors")
    assert calls(shims, "sbatch") == [] and folder_state(run_dir) == before  # nothing queued, nothing written


def test_a_full_model_job_on_a_run_folder_of_adapters_is_refused_at_submission(trained, tmp_path):
    root, base, _ = trained
    job = tmp_path / "full.toml"
    load = root / "runs" / "job" / "checkpoints"
    job.write_text(FINETUNE_JOB.format(seq=SEQ, hf=base).replace("[checkpoint]\n", f'[checkpoint]\nload = "{load}"\n'))
    proc = submit_cli(str(job), "--dry-run", cwd=tmp_path)
    _refused(proc, job, "key 'peft'", "lora adapters", "not a full model")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("damage", ["{not json", '{"peft": "lora"}'])
def test_a_damaged_base_record_in_the_run_folder_is_one_line_at_submission(trained, tmp_path, damage):
    """The record itself damaged (at its size, so that the checkpoint still verifies): named, exit 2."""
    root, base, _ = trained
    load = tmp_path / "checkpoints"
    shutil.copytree(root / "runs" / "job" / "checkpoints", load)
    record = load / "iter_0000003" / "peft_base.json"
    record.write_text(damage.ljust(len(record.read_bytes())))
    job = tmp_path / "job.toml"
    job.write_text(LORA_JOB.format(seq=SEQ, hf=base).replace("[checkpoint]\n", f'[checkpoint]\nload = "{load}"\n'))
    proc = submit_cli(str(job), "--dry-run", cwd=tmp_path)
    _refused(proc, job, "key 'checkpoint.load'", record)
    assert not (tmp_path / "runs").exists()
