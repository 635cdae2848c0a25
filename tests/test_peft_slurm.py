"""PEFT end to end (issue 28): LoRA on the demo GPT of ``make demo-text`` (configs/local-tiny-text.toml,
briefly pretrained here on the standard library's docstrings), 2 CPU ranks, fine-tuned with
configs/local-tiny-text-lora.toml on the local Slurm cluster and preempted by ``scancel --signal=USR1``
mid-run; LoRA under megatron-core's distributed optimizer, stopped by ``train.exit_interval`` and resumed;
LoRA restarted in the job by nvidia-resiliency-ext's ft_launcher after a rank is killed; DoRA stopped by
``train.exit_interval`` and resumed.

Each run is compared with the same config trained in one go: the losses must be equal bit for bit.
The forward step (tests/data/peft_forward_step.py) records the frozen weights as the ranks hold them
at each process's first step and at the last step: they must be the pretrained checkpoint's, bitwise.
The run's checkpoint holds adapter entries only and is at most 10 % of the pretrained (full) one; the
training loss falls.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from bridge_test_helpers import (
    ROOT,
    drive,
    free_port,
    job_story,
    losses,
    model_params,
    signal_tree,
    submit_cli,
    wait_running_past,
)
from warm_ranks import run_job

from bridge_hpc.contracts.progress_log import parse_progress

TEXT = ROOT / "configs" / "local-tiny-text.toml"
LORA = ROOT / "configs" / "local-tiny-text-lora.toml"
STEP = f"{ROOT / 'tests' / 'data' / 'peft_forward_step.py'}:forward_step"
ITERS = 40


def _torchrun(cwd: Path, config: Path, *sets: str):
    """2 ranks of ``config`` (tests/warm_ranks.py, as torchrun starts them); fails unless both exit 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SLURM_JOB_ID", None)
    return run_job(config, sets, cwd=cwd, env=env, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A scratch repository root: the stdlib corpus prepared in data/stdlib and the demo GPT pretrained
    for 30 steps into runs/base (its checkpoint: the base of the fine-tuning runs)."""
    folder = tmp_path_factory.mktemp("peft")
    for cmd in ([sys.executable, "-m", "bridge_hpc.prepare.stdlib_corpus", "data/stdlib"],
                ["bridge-prepare-data", "--input", "data/stdlib/train.jsonl", "data/stdlib/valid.jsonl",
                 "--output-prefix", "data/stdlib/docs", "--tokenizer-type", "ByteLevelTokenizer", "--append-eod",
                 "--workers", "2"]):
        proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    _torchrun(folder, TEXT, "job.run_dir=runs/base", "train.train_iters=30", "checkpoint.save_interval=30",
              "train.eval_interval=1000")
    return folder


def _sets(run_dir: str, kind: str) -> list:
    return [f"job.run_dir={run_dir}", f"job.forward_step={STEP}", f"train.train_iters={ITERS}",
            "checkpoint.pretrained_checkpoint=runs/base/checkpoints", "checkpoint.save_interval=20",
            "train.eval_interval=1000", "logger.log_interval=1", f"peft.type={kind}"]


def _check_run(workdir: Path, run_dir: Path, reference: Path) -> None:
    base_folder = workdir / "runs" / "base" / "checkpoints" / "iter_0000030"
    # the losses of the interrupted run are the uninterrupted one's, bit for bit, and they fall
    a, b = losses(reference), losses(run_dir)
    assert sorted(a) == sorted(b) == list(range(1, ITERS + 1))
    assert all(a[s] == b[s] for s in a), [(s, a[s], b[s]) for s in a if a[s] != b[s]][:3]
    first, last = sum(a[s] for s in range(1, 6)) / 5, sum(a[s] for s in range(ITERS - 4, ITERS + 1)) / 5
    assert last < first - 0.05, (first, last)
    # the frozen base, as the ranks held it at each start and at the end: the pretrained weights, bitwise
    pretrained = {k: hashlib.sha256(v.float().contiguous().numpy().tobytes()).hexdigest()
                  for k, v in model_params(str(base_folder), str(workdir)).items()}
    records = sorted((run_dir / "base_digests").glob("*.json"))
    assert len(records) >= 2
    for record in records:
        assert json.loads(record.read_text()) == pretrained, record.name
    # the run's checkpoint: adapters only, at most 10 % of a full one, recording its base
    last_ckpt = run_dir / "checkpoints" / f"iter_{ITERS:07d}"
    saved = model_params(str(last_ckpt), str(workdir))
    assert saved and all(".adapter." in k for k in saved)
    size = sum(p.stat().st_size for p in last_ckpt.iterdir())
    full = sum(p.stat().st_size for p in base_folder.iterdir())
    assert size <= 0.10 * full, (size, full)
    record = json.loads((last_ckpt / "peft_base.json").read_text())
    assert record["base"] == str(base_folder)


@pytest.mark.slurm
def test_lora_preempted_by_usr1_resumes_exactly_with_the_base_untouched(slurm_cluster, workdir):
    _torchrun(workdir, LORA, *_sets("runs/lora-ref", "lora"))
    run_dir = workdir / "runs" / "lora-job"
    proc = submit_cli(str(LORA), *[x for s in _sets("runs/lora-job", "lora") + ["env.TEST_STEP_SLEEP=0.2"]
                                   for x in ("--set", s)], cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.split()[2]
    wait_running_past(job_id, run_dir, 12)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    assert drive(job_id) == "COMPLETED", job_story(run_dir, job_id)
    _check_run(workdir, run_dir, workdir / "runs" / "lora-ref")
    runs = parse_progress(str(run_dir / "checkpoints" / "progress.txt"))
    assert len(runs) == 2 and runs[0].last("Ending job").fields["Reason"] == "signal"
    assert runs[1].last("Loaded checkpoint").fields["Iteration"] == runs[0].last("Ending job").fields["Iteration"]
    assert runs[0].last("Ending job").fields["Steps lost"] == "0"


def test_lora_with_the_distributed_optimizer_resumes_exactly_with_adapter_sized_state(workdir):
    """LoRA under megatron-core's distributed optimizer (2 data-parallel ranks, its state sharded between
    them): stopped by ``train.exit_interval`` and resumed, bit for bit the uninterrupted run; the
    checkpoint's optimizer state has the moments of every adapter weight and no entry for a frozen one."""
    dist_opt = ["ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true"]
    _torchrun(workdir, LORA, *_sets("runs/lora-distopt-ref", "lora"), *dist_opt)
    _torchrun(workdir, LORA, *_sets("runs/lora-distopt", "lora"), *dist_opt, "train.exit_interval=15")
    resumed = _torchrun(workdir, LORA, *_sets("runs/lora-distopt", "lora"), *dist_opt)
    assert "loaded checkpoint" in resumed.stdout
    _check_run(workdir, workdir / "runs" / "lora-distopt", workdir / "runs" / "lora-distopt-ref")
    from torch.distributed.checkpoint import FileSystemReader

    last_ckpt = workdir / "runs" / "lora-distopt" / "checkpoints" / f"iter_{ITERS:07d}"
    ran_with = json.loads((last_ckpt / "run_config.json").read_text())
    assert ran_with["ddp"]["use_distributed_optimizer"] and ran_with["optimizer"]["use_distributed_optimizer"]
    keys = list(FileSystemReader(str(last_ckpt)).read_metadata().state_dict_metadata)
    state_keys = [k for k in keys if k.startswith("optimizer.state.")]
    assert state_keys and all(".adapter." in k for k in state_keys), [k for k in state_keys if ".adapter." not in k]
    adapters = {k for k in keys if k.startswith("model.")}
    assert {k.removeprefix("optimizer.state.").rsplit(".", 1)[0] for k in state_keys} == \
        {k.removeprefix("model.") for k in adapters}  # moments for every adapter weight, for nothing else


def test_lora_restarted_in_the_job_after_a_killed_rank_resumes_exactly(workdir):
    """An in-job restart: nvidia-resiliency-ext's ft_launcher runs the 2 ranks, rank 1 kills itself (the
    simulated ``rank_killed`` fault) mid-run, the launcher restarts both in place, and they read the base
    again and resume the adapters from the last checkpoint: every loss equals the uninterrupted LoRA run's
    bit for bit, the base is untouched, and progress.txt tells the restart."""
    pytest.importorskip("nvidia_resiliency_ext.fault_tolerance")
    from bridge_hpc.launch.ft_launch import FTLaunchTimeouts, ft_launcher_argv

    ft = ["ft.enable_ft_package=true", "ft.simulate_fault=true", "ft.simulated_fault_type='rank_killed'",
          # 8 s after set-up: past the first checkpoint (4 steps of >= 0.3 s) and before the end (40 steps)
          "ft.simulated_fault_rank=1", "ft.simulated_fault_base_delay=8", "checkpoint.save_interval=4",
          "checkpoint.most_recent_k=2"]
    _torchrun(workdir, LORA, *_sets("runs/lora-ft-ref", "lora"), "checkpoint.save_interval=4")  # FT inactive
    entry = ["-m", "bridge_hpc.rank", str(LORA)]
    for item in _sets("runs/lora-ft", "lora") + ft:
        entry += ["--set", item]
    argv = ft_launcher_argv(entry, python=sys.executable, nnodes=1, nproc_per_node=2,
                            rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id=f"peft{os.getpid()}", max_restarts=2,
                            timeouts=FTLaunchTimeouts(setup=120, step=30, checkpointing=120, out_of_section=60,
                                                      initial_heartbeat=120, heartbeat=30, workload_check_interval=1),
                            workers_stop_timeout=5, monitor_interval=0.5)
    env = dict(os.environ, OMP_NUM_THREADS="1", TEST_STEP_SLEEP="0.3")  # 40 steps outlast the fault's delay
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started, by PID
            proc.wait()
    assert proc.returncode == 0, log[-5000:]
    assert "SIMULATED FAULT rank_killed rank 1" in log, log[-5000:]
    run_dir = workdir / "runs" / "lora-ft"
    _check_run(workdir, run_dir, workdir / "runs" / "lora-ft-ref")
    runs = parse_progress(str(run_dir / "checkpoints" / "progress.txt"))
    assert [r.restart_count for r in runs] == [0, 1], [r.restart_count for r in runs]
    assert runs[0].last("Ending job").fields["Reason"] == "fault"
    saved = [int(e.fields["Iteration"]) for e in runs[0].of("Saved checkpoint")]
    loaded = runs[1].last("Loaded checkpoint")  # the adapters of the last checkpoint before the fault
    assert saved and loaded is not None and int(loaded.fields["Iteration"]) == saved[-1], (saved, loaded)
    assert runs[1].last("Ending job").fields["Reason"] == "done"


def test_dora_stopped_and_resumed_exactly_and_another_base_is_refused(workdir):
    _torchrun(workdir, LORA, *_sets("runs/dora-ref", "dora"))
    _torchrun(workdir, LORA, *_sets("runs/dora", "dora"), "train.exit_interval=15")
    resumed = _torchrun(workdir, LORA, *_sets("runs/dora", "dora"))
    assert "loaded checkpoint" in resumed.stdout and "loaded pretrained weights" in resumed.stdout
    _check_run(workdir, workdir / "runs" / "dora", workdir / "runs" / "dora-ref")
    # resuming these adapters on another base: one error naming the key, nothing loaded
    manifest = workdir / "runs" / "base" / "checkpoints" / "iter_0000030" / "manifest.json"
    original = manifest.read_text()
    manifest.write_text(original + " ")  # another base's digest
    cmd = [sys.executable, "-m", "bridge_hpc.rank", str(LORA)]  # one rank, started directly
    for item in _sets("runs/dora", "dora") + [f"train.train_iters={ITERS + 5}"]:
        cmd += ["--set", item]
    try:
        proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300)
    finally:
        manifest.write_text(original)  # the module's base again, for any test after this one
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "key 'checkpoint.pretrained_checkpoint'" in last and "resume on the same base" in last, last
    assert "Traceback" not in proc.stderr
