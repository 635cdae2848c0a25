"""Exact resume, crash safety of checkpoint saves, and a signal stopping all ranks together.

Every run here is 2 CPU ranks over gloo on the tiny GPT of tests/data/tiny.toml (dropout on, so
RNG restore is exercised). One straight 40-step run is shared by the tests that compare to it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from bridge_test_helpers import assert_bitwise_equal, free_port, model_params, tiny_job, tiny_run_dir
from warm_ranks import run_job, start_ranks

from bridge_hpc.contracts.progress_log import FIRST_STEP, STARTUP_PHASES, parse_events
from bridge_hpc.training.checkpoint.checkpointing import TRACKER, find_latest_checkpoint
from bridge_hpc.training.engine.metrics import read_metrics
from bridge_hpc.training.process.startup import parse_phases


def _run(job: str, *overrides: str) -> str:
    return run_job(job, overrides, cwd=os.path.dirname(str(job))).stdout


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """40 steps in one go, with TensorBoard on."""
    job = tiny_job(tmp_path_factory.mktemp("straight"))
    _run(job, 'logger.tensorboard_dir="tb"', "logger.log_progress=true")
    return job


def test_straight_run_outputs(straight):
    run_dir = tiny_run_dir(straight)
    metrics = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert sorted(metrics) == list(range(1, 41))
    first = metrics[1]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(first)
    assert metrics[40]["loss"] < metrics[1]["loss"]  # it learns
    ckpts = os.path.join(run_dir, "checkpoints")
    assert sorted(os.listdir(ckpts)) == [".lock", "iter_0000030", "iter_0000040", TRACKER, "progress.txt"]  # k=2
    events = [(e.name, e.fields.get("Iteration"), e.fields.get("Reason")) for e in parse_events(
        os.path.join(ckpts, "progress.txt"))]
    assert events == [("Starting job", None, None), ("First step", "1", None)] + [
        ("Saved checkpoint", str(i), None) for i in (10, 20, 30, 40)] + [("Ending job", "40", "done")]
    assert open(os.path.join(ckpts, TRACKER)).read().strip() == "40"
    assert sorted(os.listdir(os.path.join(ckpts, "iter_0000040"))) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "rank_00000.pt", "rank_00001.pt",
        "run_config.json", "train_state.pt"]
    tb = os.path.join(run_dir, "tb")  # relative training paths live in the run folder
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))


def test_exact_resume(straight, tmp_path):
    job = tiny_job(tmp_path / "resumed")
    out = _run(job, "train.exit_interval=20", "logger.log_progress=true")
    assert "exiting at iteration 20: exit_interval" in out
    run_dir = tiny_run_dir(job)
    assert sorted(read_metrics(os.path.join(run_dir, "metrics.jsonl"))) == list(range(1, 21))
    out = _run(job, "logger.log_progress=true")
    assert "loaded checkpoint" in out and "iter_0000020" in out
    events = [(e.name, e.fields.get("Iteration"), e.fields.get("Reason"))
              for e in parse_events(os.path.join(run_dir, "checkpoints", "progress.txt"))]
    assert ("Ending job", "20", "interval") in events and ("Loaded checkpoint", "20", None) in events
    assert events[-1] == ("Ending job", "40", "done") and ("First step", "21", None) in events
    # The resumed run's start-up, phase by phase: every phase in the order it ran, adding up to the total
    first = [e for e in parse_events(os.path.join(run_dir, "checkpoints", "progress.txt"))
             if e.name == FIRST_STEP and e.fields["Iteration"] == "21"][0]
    phases = parse_phases(first.fields[STARTUP_PHASES])
    assert list(phases) == ["launch and imports", "process group", "set-up", "model", "optimizer", "checkpoint load",
                            "data", "first step"]
    # > 0, not a floor in seconds: these ranks are forks of tests/warm_ranks.py's server, which imported torch
    # and megatron-core before the process began (0.4 s was seen on a busy 2-core machine, 2026-12-03)
    assert phases["launch and imports"] > 0 and all(v >= 0 for v in phases.values())
    assert abs(sum(phases.values()) - first.number("Start-up seconds")) <= 0.1 + 0.005 * len(phases)

    a = read_metrics(os.path.join(tiny_run_dir(straight), "metrics.jsonl"))
    b = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert sorted(b) == list(range(1, 41))
    for step in range(21, 41):
        assert b[step]["loss"] == a[step]["loss"], step  # exact, not approximate
        assert b[step]["grad_norm"] == a[step]["grad_norm"], step
        assert b[step]["lr"] == a[step]["lr"], step
    assert_bitwise_equal(
        model_params(os.path.join(tiny_run_dir(straight), "checkpoints", "iter_0000040"), str(tmp_path)),
        model_params(os.path.join(run_dir, "checkpoints", "iter_0000040"), str(tmp_path)))


def test_deterministic_mode_trains_the_same_on_cpu(straight, tmp_path):
    """``model.deterministic_mode`` (megatron's switch for deterministic GPU kernels) changes nothing
    that CPU training computes: the same losses bit for bit; the ranks report it in their config log."""
    job = tiny_job(tmp_path / "deterministic")
    out = _run(job, "model.deterministic_mode=true")
    a = read_metrics(os.path.join(tiny_run_dir(straight), "metrics.jsonl"))
    b = read_metrics(os.path.join(tiny_run_dir(job), "metrics.jsonl"))
    assert sorted(b) == list(range(1, 41))
    assert [b[s]["loss"] for s in range(1, 41)] == [a[s]["loss"] for s in range(1, 41)]
    assert "exiting at iteration 40" in out


def test_deterministic_mode_sets_what_the_user_left_unset(monkeypatch):
    """The variables deterministic kernels read (cuBLAS, NCCL, Transformer Engine's attention, which
    megatron-core refuses to build in deterministic mode without ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``),
    set where unset; a value the user chose is kept."""
    import torch

    from bridge_hpc.training.pretrain import enable_deterministic_mode

    for name in ("CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    was = torch.are_deterministic_algorithms_enabled()
    try:
        enable_deterministic_mode()
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
    assert (os.environ["CUBLAS_WORKSPACE_CONFIG"], os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"],
            os.environ["NCCL_ALGO"]) == (":4096:8", "0", "Tree")


#: The rank entry point, then the stop signals of the job arriving just after it returns: Slurm's
#: time-limit warning can land while a rank that has finished tears down.
LATE_SIGNAL_RANK = """
import json, os, signal, sys
from bridge_hpc import rank
status = rank.main(sys.argv[1:])
names = ("SIGUSR1", "SIGTERM")
ignored = {n: signal.getsignal(getattr(signal, n)) == signal.SIG_IGN for n in names}
sys.stdout.flush()
# One write(2) of a short line: the two ranks share the pipe, and print() writes its parts one by one.
os.write(1, ("ignored after main: " + json.dumps(ignored) + "\\n").encode())
for name in names:
    os.kill(os.getpid(), getattr(signal, name))
sys.exit(status)
"""


def test_a_run_that_resumes_at_train_iters_ends_done_and_ignores_a_late_stop_signal(straight, tmp_path):
    """A job whose last run stopped after the final step but was requeued anyway (its rank killed by a
    late signal, before the fix) must end again as ``done``; and a stop signal after training ended
    is ignored, not left to Python's finalization, which resets handlers to the default action."""
    job_dir = tmp_path / "finished"
    shutil.copytree(os.path.dirname(straight), job_dir)
    job = str(job_dir / "job.toml")
    script = tmp_path / "late_signal_rank.py"
    script.write_text(LATE_SIGNAL_RANK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(script), job, "--set", "logger.log_progress=true"]
    proc = subprocess.run(cmd, cwd=str(job_dir), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count('ignored after main: {"SIGUSR1": true, "SIGTERM": true}') == 2, proc.stdout[-3000:]
    assert "exiting at iteration 40: train_iters reached (recorded as done)" in proc.stdout
    run_dir = tiny_run_dir(job)
    events = [(e.name, e.fields.get("Iteration"), e.fields.get("Reason"))
              for e in parse_events(os.path.join(run_dir, "checkpoints", "progress.txt"))]
    assert events[-3:] == [("Starting job", None, None), ("Loaded checkpoint", "40", None), ("Ending job", "40", "done")]
    assert sorted(read_metrics(os.path.join(run_dir, "metrics.jsonl"))) == list(range(1, 41))  # no step redone
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints")))[:3] == [".lock", "iter_0000030", "iter_0000040"]


def test_sigkill_during_saves_leaves_a_loadable_checkpoint(straight, tmp_path):
    """Saving every step, SIGKILL the whole job at random moments; the newest complete checkpoint
    must always load, and finishing from it must reproduce the straight run exactly."""
    job = tiny_job(tmp_path / "killed")
    ckpts = os.path.join(tiny_run_dir(job), "checkpoints")
    rng = random.Random(7)
    last = 0
    for _attempt in range(4):
        ranks = start_ranks([str(job), "--set", "checkpoint.save_interval=1"], cwd=os.path.dirname(str(job)))
        deadline = time.time() + 120
        while time.time() < deadline:  # wait for this attempt's first own checkpoint
            try:
                if int(open(os.path.join(ckpts, TRACKER)).read()) > last:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        else:
            ranks.kill()
            pytest.fail("no checkpoint appeared:\n" + ranks.wait().output[-4000:])
        time.sleep(rng.uniform(0.0, 0.5))
        ranks.kill()  # both ranks and what they started, at once
        ranks.wait()

        latest = find_latest_checkpoint(ckpts)
        assert latest is not None
        iteration = int(latest[-7:])
        assert iteration >= last
        last = iteration
        common = torch.load(os.path.join(latest, "train_state.pt"), weights_only=False)
        assert common["iteration"] == iteration == common["train_state"]["step"]
        for rank in (0, 1):
            per_rank = torch.load(os.path.join(latest, f"rank_{rank:05d}.pt"), weights_only=False)
            assert per_rank["data"]["consumed_samples"] == 8 * iteration
        assert model_params(latest, str(tmp_path))
        if iteration == 40:
            break

    _run(job, "checkpoint.save_interval=1")
    a = read_metrics(os.path.join(tiny_run_dir(straight), "metrics.jsonl"))
    b = read_metrics(os.path.join(tiny_run_dir(job), "metrics.jsonl"))
    assert sorted(b) == list(range(1, 41))
    assert [b[s]["loss"] for s in range(1, 41)] == [a[s]["loss"] for s in range(1, 41)]
    assert_bitwise_equal(
        model_params(os.path.join(tiny_run_dir(straight), "checkpoints", "iter_0000040"), str(tmp_path)),
        model_params(os.path.join(ckpts, "iter_0000040"), str(tmp_path)))
    assert not [n for n in os.listdir(ckpts) if n.endswith((".tmp", ".del"))]


def test_sigterm_to_one_rank_stops_all_at_the_same_step(tmp_path):
    """Launched the way srun does (SLURM_* variables, no torchrun): SIGTERM reaches rank 1 only;
    both ranks stop after the same step, a checkpoint of that step is saved, exit status 0."""
    job = tiny_job(tmp_path / "signal")
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                   SLURM_NNODES="1", SLURM_TASKS_PER_NODE="2", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "bridge_hpc.rank", job, "--set", "train.train_iters=100000",
             "--set", "checkpoint.save_interval=100000", "--set", "logger.log_progress=true"],
            cwd=os.path.dirname(str(job)), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    metrics_file = os.path.join(tiny_run_dir(job), "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline:
        if os.path.exists(metrics_file) and len(open(metrics_file).readlines()) >= 5:
            break
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    stopped = int(open(os.path.join(tiny_run_dir(job), "checkpoints", TRACKER)).read())
    assert f"exiting at iteration {stopped}: signal received" in outputs[0][0]
    assert max(read_metrics(metrics_file)) == stopped
    assert os.path.isfile(os.path.join(tiny_run_dir(job), "checkpoints", f"iter_{stopped:07d}", "rank_00001.pt"))
    end = parse_events(os.path.join(tiny_run_dir(job), "checkpoints", "progress.txt"))[-1]
    assert (end.name, end.fields["Reason"], end.fields["Steps lost"], end.job_id) == ("Ending job", "signal", "0", "4242")


def test_latest_checkpoint_ignores_incomplete_folders(tmp_path):
    """The tracker's checkpoint when it names a complete one (also an older one: Megatron's
    rollback), else the newest complete ``iter_*`` folder; half-written (``.tmp``), half-deleted
    (``.del``) or unmarked folders never. Complete here: format 1, ``train_state.pt`` without a
    manifest."""
    root = tmp_path / "ckpt"
    for name, complete in (("iter_0000005", True), ("iter_0000006", True), ("iter_0000007", False),
                           ("iter_0000008.tmp", True), ("iter_0000009.del", True)):
        (root / name).mkdir(parents=True)
        if complete:
            torch.save({"format_version": 1, "iteration": int(name[5:12])}, str(root / name / "train_state.pt"))
            torch.save({"world_size": 1}, str(root / name / "rank_00000.pt"))
            (root / name / ".metadata").write_bytes(b"x")
    assert find_latest_checkpoint(str(root)) == str(root / "iter_0000006")  # no tracker: scan
    (root / TRACKER).write_text("6\n")
    assert find_latest_checkpoint(str(root)) == str(root / "iter_0000006")
    (root / TRACKER).write_text("5\n")  # a rollback, or killed between the rename of iter_6 and the tracker update
    assert find_latest_checkpoint(str(root)) == str(root / "iter_0000005")
    (root / TRACKER).write_text("7\n")
    assert find_latest_checkpoint(str(root)) == str(root / "iter_0000006")  # tracker names an incomplete one
    (root / TRACKER).write_text("garbage")
    assert find_latest_checkpoint(str(root)) == str(root / "iter_0000006")
    assert find_latest_checkpoint(str(tmp_path / "missing")) is None
