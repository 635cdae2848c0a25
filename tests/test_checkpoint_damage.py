"""A damaged newest checkpoint, a full disk during a save, and the checkpoint folder's lock.

Every run is a real 2-rank job over gloo on the tiny GPT of tests/data/tiny.toml (its ranks started as
torchrun starts them, from a warm interpreter: tests/warm_ranks.py), with real checkpoints. A straight
6-step run gives the reference losses; a "base" run stops at iteration 4 with checkpoints at 2 and 4.
Each damage case copies the base checkpoints, damages them, resumes once to iteration 6, and checks that
it resumed from the right checkpoint, that its losses from there equal the straight run's bit for bit,
that nothing was deleted (a damaged folder is set aside as ``*.damaged``), and that no run hangs (each
has a timeout).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
from typing import Callable, Optional

import pytest
from bridge_test_helpers import tiny_checkpoints, tiny_job, tiny_run_dir
from warm_ranks import run_ranks

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.progress_log import parse_events
from bridge_hpc.training.checkpoint import checkpointing
from bridge_hpc.training.checkpoint.checkpointing import MANIFEST_FILE, TRACKER, iteration_dir, verify_checkpoint
from bridge_hpc.training.engine.metrics import read_metrics

#: Checkpoints at 2, 4 and 6, all kept.
SETTINGS = ("train.train_iters=6", "checkpoint.save_interval=2", "checkpoint.most_recent_k=-1",
            "logger.log_progress=true")
#: A run takes about 8 s here; a run still going after this is hanging.
RUN_TIMEOUT_S = 120


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str, seconds: float):
        self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _run(job: str, *overrides: str, timeout: float = RUN_TIMEOUT_S) -> Result:
    """2 ranks of ``job`` on this machine (:func:`warm_ranks.run_ranks`, as torchrun starts them); a run
    still going after ``timeout`` is killed and fails the test."""
    args = [job]
    for item in overrides:
        args += ["--set", item]
    done = run_ranks(args, cwd=os.path.dirname(job), timeout=timeout)
    if -9 in done.returncodes:
        pytest.fail(f"the run hung (killed after {timeout} s):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return Result(done.returncode, done.stdout, done.stderr, done.seconds)


def _ok(result: Result) -> Result:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Losses of 6 steps in one go."""
    job = tiny_job(tmp_path_factory.mktemp("straight"))
    _ok(_run(job, *SETTINGS))
    return read_metrics(os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The checkpoint folder of a run that stopped at iteration 4: iter_2 and iter_4, tracker 4."""
    job = tiny_job(tmp_path_factory.mktemp("base"))
    _ok(_run(job, *SETTINGS, "train.exit_interval=4"))
    ckpts = tiny_checkpoints(job)
    assert checkpointing.complete_iterations(ckpts) == [2, 4]
    return ckpts


def _file(name: str) -> Callable[[str], str]:
    return lambda ckpts: os.path.join(iteration_dir(ckpts, 4), name)


def truncate(name: str, size: Optional[int] = None):
    def damage(ckpts: str) -> None:
        path = _file(name)(ckpts)
        os.truncate(path, os.path.getsize(path) // 2 if size is None else size)
    return damage


def delete(name: str):
    return lambda ckpts: os.remove(_file(name)(ckpts))


def garble(name: str):
    """Same size, other bytes: passes the size check, fails in the load."""
    def damage(ckpts: str) -> None:
        path = _file(name)(ckpts)
        with open(path, "r+b") as f:
            f.write(bytes(range(256)) * (os.path.getsize(path) // 256) + b"\0" * (os.path.getsize(path) % 256))
    return damage


def tracker(text: str):
    def damage(ckpts: str) -> None:
        with open(os.path.join(ckpts, TRACKER), "w") as f:
            f.write(text)
    return damage


#: (case, damage, iteration resumed from, file whose damage is reported (None: nothing damaged)): a real
#: 2-rank run each, one per way the newest checkpoint is found wanting (the manifest's sizes, a missing
#: manifest, a load that fails on every rank or on one, the tracker file's own damage).
CASES = [
    ("truncated-shard", truncate("__1_0.distcp", 12), 2, "__1_0.distcp"),
    ("deleted-manifest", delete(MANIFEST_FILE), 2, MANIFEST_FILE),
    ("garbled-shard", garble("__1_0.distcp"), 2, "load failed"),
    ("garbled-rank-file-of-rank-1", garble("rank_00001.pt"), 2, "load failed on rank 1"),
    ("garbage-tracker", tracker("\x00\x07 not a number"), 4, None),
    ("tracker-names-a-missing-iteration", tracker("8\n"), 4, None),
    ("tracker-names-an-older-complete-one", tracker("2\n"), 2, None),
]
#: The other files of a checkpoint, damaged the same ways: the manifest check that the runs above go
#: through names each, and the newest complete checkpoint is then the older one (checked without a run:
#: what a run does with the verdict is the first case's).
VERIFIED_CASES = [
    ("deleted-shard", delete("__0_0.distcp"), "__0_0.distcp"),
    ("deleted-metadata", delete(".metadata"), ".metadata"),
    ("truncated-train-state", truncate("train_state.pt"), "train_state.pt"),
    ("deleted-train-state", delete("train_state.pt"), "train_state.pt"),
    ("deleted-rank-file", delete("rank_00001.pt"), "rank_00001.pt"),
    ("truncated-rank-file", truncate("rank_00000.pt"), "rank_00000.pt"),
]


@pytest.mark.parametrize("damage,reported", [case[1:] for case in VERIFIED_CASES], ids=[c[0] for c in VERIFIED_CASES])
def test_each_damaged_file_is_named_and_the_older_checkpoint_is_the_latest(base, tmp_path, damage, reported):
    ckpts = str(tmp_path / "ckpts")
    shutil.copytree(base, ckpts)
    damage(ckpts)
    verdict = verify_checkpoint(iteration_dir(ckpts, 4), world_size=2)
    assert verdict is not None and verdict.startswith(f"iter_0000004/{reported}"), verdict
    assert checkpointing.find_latest_checkpoint(ckpts, world_size=2) == iteration_dir(ckpts, 2)


@pytest.mark.parametrize("damage,resumed_at,reported", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_resume_from_a_damaged_checkpoint_folder(straight, base, tmp_path, damage, resumed_at, reported):
    job = tiny_job(tmp_path / "job")
    ckpts = tiny_checkpoints(job)
    shutil.copytree(base, ckpts)
    damage(ckpts)
    damaged_before = {name: sorted(os.listdir(os.path.join(ckpts, name))) for name in os.listdir(ckpts)
                      if os.path.isdir(os.path.join(ckpts, name))}

    result = _ok(_run(job, *SETTINGS))

    assert f"loaded checkpoint {iteration_dir(ckpts, resumed_at)} (iteration {resumed_at})" in result.stdout, \
        result.stdout[-3000:] + result.stderr[-3000:]
    metrics = read_metrics(os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE))
    assert sorted(metrics) == list(range(resumed_at + 1, 7))
    for step in metrics:  # exact, not approximate
        assert (metrics[step]["loss"], metrics[step]["grad_norm"]) == (straight[step]["loss"], straight[step]["grad_norm"])

    # Nothing older is lost; the run went on to save 6.
    assert checkpointing.complete_iterations(ckpts)[-1] == 6 and 2 in checkpointing.complete_iterations(ckpts)
    for iteration in checkpointing.complete_iterations(ckpts):
        assert verify_checkpoint(iteration_dir(ckpts, iteration), world_size=2) is None
    assert open(os.path.join(ckpts, TRACKER)).read().strip() == "6"
    fallbacks = [e for e in parse_events(os.path.join(ckpts, run_folder.PROGRESS_FILE)) if e.name == "Checkpoint fallback"]
    if reported is None:
        assert not fallbacks and not [n for n in os.listdir(ckpts) if checkpointing.DAMAGED_SUFFIX in n]
        return
    # The damaged folder is set aside whole, never deleted, and the fallback is recorded.
    aside = iteration_dir(ckpts, 4) + checkpointing.DAMAGED_SUFFIX
    assert sorted(os.listdir(aside)) == damaged_before["iter_0000004"]
    assert [(e.fields["Damaged"], e.fields["Moved to"], e.fields["Using"]) for e in fallbacks] == [
        ("iter_0000004", "iter_0000004.damaged", "iter_0000002")]
    assert reported in fallbacks[0].fields["Reason"], fallbacks[0].fields
    assert "iter_0000004" in result.stderr and "damaged" in result.stderr


def test_only_damaged_checkpoints_fail_clearly_and_keep_them(base, tmp_path):
    """Nothing loadable left: every rank exits 1 within seconds with one message naming the damaged
    folders (not a torch traceback from inside the load), and none is deleted; the next run says the
    same instead of starting from scratch over them."""
    job = tiny_job(tmp_path / "job")
    ckpts = tiny_checkpoints(job)
    shutil.copytree(base, ckpts)
    truncate("__1_0.distcp", 12)(ckpts)
    os.remove(os.path.join(iteration_dir(ckpts, 2), ".metadata"))
    for _ in range(2):
        result = _run(job, *SETTINGS)
        assert result.returncode == 1, result.output[-3000:]
        assert "no loadable checkpoint" in result.stderr and "iter_0000002.damaged" in result.stderr, result.stderr[-3000:]
        assert "iter_0000004.damaged" in result.stderr
        assert result.seconds < 60
        assert sorted(n for n in os.listdir(ckpts) if n.startswith("iter_")) == ["iter_0000002.damaged",
                                                                                 "iter_0000004.damaged"]



def test_a_full_disk_during_a_save_ends_all_ranks_with_the_cause(straight, small_disk, tmp_path):
    job = tiny_job(tmp_path / "job")
    ckpts = os.path.join(small_disk, "checkpoints")
    result = _run(job, *SETTINGS, f'checkpoint.save="{ckpts}"', timeout=90)
    assert result.returncode != 0, result.output[-3000:]
    assert result.seconds < 60, f"took {result.seconds:.0f} s"
    # One line says it all: the cause and the file (not "unexpected pos 704 vs 598").
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert any("no space left on device" in line and iteration_dir(ckpts, 4) + ".tmp" in line
               for line in error_lines[:1]), result.stderr[-4000:]

    # The checkpoint before the failed save is intact, tracked, verifies; the failed one left nothing.
    assert open(os.path.join(ckpts, TRACKER)).read().strip() == "2"
    assert verify_checkpoint(iteration_dir(ckpts, 2), world_size=2) is None
    assert sorted(n for n in os.listdir(ckpts) if n.startswith("iter_")) == ["iter_0000002"]

    # With space again, the run resumes from it and continues exactly.
    subprocess.run(["mount", "-o", "remount,size=20m", str(small_disk)], check=True)
    result = _ok(_run(job, *SETTINGS, f'checkpoint.save="{ckpts}"'))
    assert f"loaded checkpoint {iteration_dir(ckpts, 2)} (iteration 2)" in result.stdout
    metrics = read_metrics(os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE))
    assert [metrics[s]["loss"] for s in range(1, 7)] == [straight[s]["loss"] for s in range(1, 7)]


def test_a_full_disk_is_reported_as_such_for_the_small_files_too(small_disk):
    """torch.save straight into a file on a full disk raises "unexpected pos ..."; the rank and shared
    state files are written so that the OSError, naming the file, comes through."""
    import torch

    path = os.path.join(small_disk, "rank_00000.pt")
    with pytest.raises(OSError) as caught:
        checkpointing._torch_save_durable({"x": torch.zeros(1 << 20)}, path)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == path


def test_a_second_job_on_the_same_checkpoint_folder_fails_fast(tmp_path):
    job = tiny_job(tmp_path / "job")
    ckpts = tiny_checkpoints(job)
    os.makedirs(ckpts)
    lock_path = os.path.join(ckpts, run_folder.CHECKPOINT_LOCK)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"pid 4321 on elsewhere, Slurm job 777\n")
        result = _run(job, *SETTINGS, timeout=90)
        assert result.returncode == 1, result.output[-3000:]
        assert result.seconds < 60
        assert "is in use by another job" in result.stderr and "Slurm job 777" in result.stderr, result.stderr[-3000:]
        assert sorted(os.listdir(ckpts)) == [run_folder.CHECKPOINT_LOCK]  # it wrote nothing there
    finally:
        os.close(fd)

    _ok(_run(job, *SETTINGS))
    assert checkpointing.complete_iterations(ckpts) == [2, 4, 6]
    with open(lock_path) as f:
        assert f"Slurm job {os.environ.get('SLURM_JOB_ID', 'none')}" in f.read()  # the holder wrote itself in
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the job ended
    finally:
        os.close(fd)


def test_the_lock_is_reentrant_within_a_process(tmp_path):
    """An in-process restart runs pretrain again in the same process: taking the lock again there
    must succeed, while another open file description (another job) is refused."""
    root = str(tmp_path / "ckpt")
    checkpointing.lock_checkpoint_folder(root)
    try:
        checkpointing.lock_checkpoint_folder(root)
        fd = os.open(os.path.join(root, run_folder.CHECKPOINT_LOCK), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        checkpointing.release_checkpoint_folder(root)
    fd = os.open(os.path.join(root, run_folder.CHECKPOINT_LOCK), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_verify_checkpoint_names_the_damaged_file(base, tmp_path):
    ckpts = str(tmp_path / "ckpts")
    shutil.copytree(base, ckpts)
    folder = iteration_dir(ckpts, 4)
    assert verify_checkpoint(folder, world_size=2) is None
    with open(os.path.join(folder, MANIFEST_FILE)) as f:
        size = json.load(f)["files"]["__1_0.distcp"]
    os.truncate(os.path.join(folder, "__1_0.distcp"), 12)
    assert verify_checkpoint(folder, world_size=2) == f"iter_0000004/__1_0.distcp: 12 bytes, manifest says {size}"
    os.remove(os.path.join(folder, "rank_00001.pt"))
    os.truncate(os.path.join(folder, "__1_0.distcp"), size)
    assert verify_checkpoint(folder, world_size=2) == "iter_0000004/rank_00001.pt missing"
    assert checkpointing.find_latest_checkpoint(ckpts, world_size=2) == iteration_dir(ckpts, 2)  # read-only
    assert os.path.isdir(folder)


def test_keep_last_k_keeps_the_last_loadable_checkpoint_and_damaged_ones(base, tmp_path):
    """``most_recent_k`` deletes only complete checkpoints up to the one just saved, never a
    ``*.damaged`` folder, and never the newest one that verifies, even if the newer ones do not."""
    ckpts = str(tmp_path / "ckpts")
    shutil.copytree(base, ckpts)
    shutil.copytree(iteration_dir(ckpts, 2), iteration_dir(ckpts, 1) + checkpointing.DAMAGED_SUFFIX)
    shutil.copytree(iteration_dir(ckpts, 4), iteration_dir(ckpts, 8))  # newer, left from before a rollback
    os.remove(os.path.join(iteration_dir(ckpts, 4), ".metadata"))
    checkpointing._remove_old_checkpoints(ckpts, 1, 4, world_size=2)
    assert sorted(n for n in os.listdir(ckpts) if n.startswith("iter_")) == [
        "iter_0000001.damaged", "iter_0000002", "iter_0000004", "iter_0000008"]
    shutil.copy(os.path.join(iteration_dir(ckpts, 8), ".metadata"), iteration_dir(ckpts, 4))  # repaired
    checkpointing._remove_old_checkpoints(ckpts, 1, 4, world_size=2)
    assert sorted(n for n in os.listdir(ckpts) if n.startswith("iter_")) == [
        "iter_0000001.damaged", "iter_0000004", "iter_0000008"]
