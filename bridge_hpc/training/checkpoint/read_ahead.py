"""Read the checkpoint a run will load into the page cache while its ranks import torch.

A requeued job often starts on other nodes, where its checkpoint is not in memory. On an H100 host
a load of the 370 M GPT's 5.2 GB took 3.59 s from disk and 1.66 s from the page cache
(``benchmarks/checkpoint.py``, 2026-11-25). The seconds before the load (imports, process group,
model and optimizer set-up) use CPUs and no disk. So at launch, before torch is imported, one
process per node asks the kernel to read ahead the files of the checkpoint that the tracker names
(``posix_fadvise(WILLNEED)``, from a thread), and the load then reads memory.

This is a hint, not a promise. The tracked checkpoint is the one that a load picks unless it turns
out damaged (then the load falls back as usual and the read-ahead was wasted reads). A checkpoint
larger than a quarter of the node's available memory is not read ahead, since the page cache could
not keep it until the load. Nothing is read on a first run (no tracker).
"""

from __future__ import annotations

import os
import threading
from typing import List, Optional

from bridge_hpc.contracts import run_folder

#: The share of the node's available memory a read-ahead may take.
MEMORY_SHARE = 0.25


def tracked_checkpoint(load_dir: Optional[str]) -> Optional[str]:
    """The complete checkpoint folder the tracker of ``load_dir`` names, or None (no load folder,
    no tracker, an unreadable one, or its folder missing). An iteration folder itself is returned
    as it is."""
    if not load_dir or not os.path.isdir(load_dir):
        return None
    if run_folder.ITERATION_DIR_RE.match(os.path.basename(os.path.normpath(load_dir))):
        return load_dir
    iteration = run_folder.tracked_iteration(load_dir)
    if iteration is None:
        return None
    folder = run_folder.iteration_dir(load_dir, iteration)
    return folder if os.path.isdir(folder) else None


def checkpoint_files(folder: str) -> List[str]:
    """Every file under ``folder``."""
    return [os.path.join(root, name) for root, _, names in os.walk(folder) for name in sorted(names)]


def available_memory_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo``, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_ahead(files: List[str]) -> None:
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def start_read_ahead(load_dir: Optional[str], first_on_node: bool) -> Optional[threading.Thread]:
    """Read the tracked checkpoint of ``load_dir`` ahead, in a daemon thread, if this process is
    the node's first (``first_on_node``: local rank 0) and the files fit :data:`MEMORY_SHARE` of the
    available memory. Returns the thread, or None when nothing is read."""
    folder = tracked_checkpoint(load_dir) if first_on_node else None
    if folder is None or not hasattr(os, "posix_fadvise"):
        return None
    files = checkpoint_files(folder)
    size = sum(os.path.getsize(path) for path in files if os.path.isfile(path))
    available = available_memory_bytes()
    if not files or (available is not None and size > MEMORY_SHARE * available):
        return None
    thread = threading.Thread(target=_read_ahead, args=(files,), name="ckpt-read-ahead", daemon=True)
    thread.start()
    return thread
