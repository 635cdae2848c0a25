"""The checkpoint read ahead at launch (bridge_hpc.training.checkpoint.read_ahead).

A real checkpoint of the tiny GPT (one rank, started as srun starts a task) is evicted from the page
cache (``POSIX_FADV_DONTNEED``, the state a requeued job finds on a new node); the read-ahead then
brings every one of its files back into memory, as the kernel reports it (``mincore``). Also: which
folder is read (the tracker's), and when nothing is read (not the node's first process, no tracker,
more than the memory share).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess
import sys
import time

import pytest
from bridge_test_helpers import TINY, direct_rank_env, evict_from_page_cache

from bridge_hpc.contracts import run_folder
from bridge_hpc.training.checkpoint import read_ahead as checkpoint_read_ahead
from bridge_hpc.training.checkpoint.read_ahead import checkpoint_files, start_read_ahead, tracked_checkpoint


def _resident_fraction(path: str) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` on a private mapping: mapping
    reads nothing)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    page = os.sysconf("SC_PAGE_SIZE")
    pages = (size + page - 1) // page
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        start = ctypes.c_char.from_buffer(mapping)
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del start
        return sum(v & 1 for v in vec) / pages
    finally:
        mapping.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    """The checkpoint folder of a 4-step run of the tiny GPT that saved at steps 2 and 4."""
    folder = tmp_path_factory.mktemp("run")
    job = folder / "job.toml"
    shutil.copy(TINY, job)
    env = direct_rank_env()
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.rank", str(job), "--set", "train.train_iters=4",
                           "--set", "scheduler.lr_warmup_iters=1", "--set", "checkpoint.save_interval=2",
                           "--set", "checkpoint.most_recent_k=-1"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return str(folder / "runs" / "tiny" / run_folder.CHECKPOINTS_DIR)


def test_the_tracked_checkpoint_is_read_back_into_memory(checkpoints):
    folder = tracked_checkpoint(checkpoints)
    assert folder == run_folder.iteration_dir(checkpoints, 4)
    files = checkpoint_files(folder)
    assert files and sum(os.path.getsize(p) for p in files) > 0
    evict_from_page_cache(files)
    if max(_resident_fraction(p) for p in files) > 0.5:
        pytest.skip("this file system keeps the files in memory (nothing to read ahead)")

    thread = start_read_ahead(checkpoints, first_on_node=True)
    assert thread is not None
    thread.join(timeout=60)
    deadline = time.time() + 30  # the kernel's reads complete in the background
    while min(_resident_fraction(p) for p in files) < 1.0 and time.time() < deadline:
        time.sleep(0.05)
    assert {p: _resident_fraction(p) for p in files} == {p: 1.0 for p in files}


def test_which_folder_and_when_nothing_is_read(checkpoints, tmp_path, monkeypatch):
    older = run_folder.iteration_dir(checkpoints, 2)
    assert tracked_checkpoint(older) == older  # an iteration folder given as the load path
    assert start_read_ahead(checkpoints, first_on_node=False) is None  # another process of the node reads
    assert tracked_checkpoint(str(tmp_path)) is None and start_read_ahead(str(tmp_path), True) is None  # a first run
    assert tracked_checkpoint(None) is None and tracked_checkpoint(str(tmp_path / "missing")) is None

    copy = tmp_path / "copy"
    shutil.copytree(checkpoints, copy)
    tracker = copy / run_folder.TRACKER_FILE
    tracker.write_text("not an iteration\n")
    assert tracked_checkpoint(str(copy)) is None
    tracker.write_text("6\n")  # names a checkpoint that is not there
    assert tracked_checkpoint(str(copy)) is None

    size = sum(os.path.getsize(p) for p in checkpoint_files(tracked_checkpoint(checkpoints)))
    monkeypatch.setattr(checkpoint_read_ahead, "available_memory_bytes", lambda: int(size / 0.25) - 1)
    assert start_read_ahead(checkpoints, first_on_node=True) is None  # more than the memory share
