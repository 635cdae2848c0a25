"""Crash-safe checkpoints: a folder per iteration that is either complete or invisible.

Layout under ``checkpoint.save``::

    latest_checkpointed_iteration.txt   # the newest complete iteration, replaced atomically
    iter_0000020/
        .metadata, __0_0.distcp, ...    # model + optimizer (torch.distributed.checkpoint format)
        train_state.pt                  # train_state, scheduler, iteration (rank 0), written last
        rank_00000.pt, rank_00001.pt    # per rank: python/numpy/torch RNG states, data position
        run_config.json                 # the resolved configuration

Write protocol (what makes a SIGKILL at any instant harmless): every rank writes into
``iter_XXXXXXX.tmp``; each rank fsyncs the files it wrote; after a barrier rank 0 writes
``train_state.pt`` (fsynced), fsyncs the folder, renames it to ``iter_XXXXXXX``, fsyncs the parent,
and only then replaces the tracker (write temp, fsync, rename, fsync parent). Loading takes the
newest complete ``iter_*`` folder, which is the tracker's unless the tracker is missing, broken, or
one rename behind. Old checkpoints beyond
``most_recent_k`` are renamed to ``*.del`` before deletion, so a half-deleted folder never looks
complete.

Back ends: without CUDA the model and optimizer go through ``torch.distributed.checkpoint``
(torch-native DDP and optimizer); on CUDA through megatron-core's ``dist_checkpointing`` with
megatron's DDP and optimizer. Everything else is shared.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import re
import shutil
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from bridge_hpc.contracts import run_folder
from bridge_hpc.training.state import GlobalState

logger = logging.getLogger(__name__)

TRACKER = run_folder.TRACKER_FILE
#: Written last into a checkpoint folder; its presence marks the folder complete. (Not ``common.pt``:
#: megatron-core's dist_checkpointing writes a file of that name itself.)
COMMON_FILE = "train_state.pt"
_ITER_RE = re.compile(r"^iter_(\d{7})$")
FORMAT_VERSION = 1


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


# ---------------------------------------------------------------------------------------------
# Filesystem primitives
# ---------------------------------------------------------------------------------------------


def _fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save_durable(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    _fsync_path(root)


def _is_complete(path: str) -> bool:
    return _ITER_RE.match(os.path.basename(path)) is not None and os.path.isfile(os.path.join(path, COMMON_FILE))


def complete_iterations(root: str) -> List[int]:
    """Iterations with a complete checkpoint folder under ``root``, ascending."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _ITER_RE.match(name)
        if match and _is_complete(os.path.join(root, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def _read_tracker(root: str) -> Optional[int]:
    try:
        with open(os.path.join(root, TRACKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def find_latest_checkpoint(root: str) -> Optional[str]:
    """The newest complete checkpoint folder under ``root``, or None.

    Normally the one the tracker names. A folder is complete once renamed from ``.tmp`` (its
    ``train_state.pt`` is written after every rank's files are durable), so a complete folder
    newer than the tracker (a kill between rename and tracker update) is used too, as is the scan
    when the tracker is missing, unreadable or names a folder that is gone.
    """
    iterations = complete_iterations(root)
    if not iterations:
        return None
    newest = iterations[-1]
    tracked = _read_tracker(root)
    if tracked != newest:
        logger.warning("checkpoint tracker in %s says %s; newest complete checkpoint is iteration %d",
                       root, tracked, newest)
    return iteration_dir(root, newest)


def _resolve_checkpoint_dir(path: str) -> Optional[str]:
    """``path`` itself if it is an iteration folder, else its newest complete checkpoint."""
    if _is_complete(path):
        return path
    return find_latest_checkpoint(path)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# Model and optimizer back ends
# ---------------------------------------------------------------------------------------------


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _uses_megatron_dist(model) -> bool:
    return torch.cuda.is_available() and hasattr(_unwrap(model[0]), "sharded_state_dict") and not isinstance(
        model[0], torch.nn.parallel.DistributedDataParallel)


def _without_empty_extra_state(model_sd: Dict[str, Any]) -> Dict[str, Any]:
    """megatron-core's linear layers report ``_extra_state = None`` (a Transformer Engine slot);
    DCP cannot store None, and there is nothing to store."""
    return {key: value for key, value in model_sd.items() if value is not None}


def _save_model_and_optimizer(model, optimizer, path: str, save_optim: bool) -> None:
    if _uses_megatron_dist(model):
        from megatron.core import dist_checkpointing

        sharded = {"model": _unwrap(model[0]).sharded_state_dict()}
        if save_optim:
            sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"])
        dist_checkpointing.save(sharded, path)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model[0], optimizer.optimizer)
    state = {"model": _without_empty_extra_state(model_sd)}
    if save_optim:
        state["optimizer"] = optim_sd
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))


def _load_model_and_optimizer(model, optimizer, path: str, load_optim: bool) -> None:
    if _uses_megatron_dist(model):
        from megatron.core import dist_checkpointing

        inner = _unwrap(model[0])
        sharded = {"model": inner.sharded_state_dict()}
        if load_optim:
            sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"], is_loading=True)
        loaded = dist_checkpointing.load(sharded, path)
        inner.load_state_dict(loaded["model"])
        if load_optim:
            optimizer.load_state_dict(loaded["optimizer"])
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model[0], optimizer.optimizer)
    state = {"model": _without_empty_extra_state(model_sd)}
    if load_optim:
        state["optimizer"] = optim_sd
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    state["model"].update({key: None for key, value in model_sd.items() if value is None})
    _unwrap(model[0]).load_state_dict(state["model"], strict=True)
    if load_optim:
        set_state_dict(model[0], optimizer.optimizer, model_state_dict={}, optim_state_dict=state["optimizer"])


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------


def _rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["rng_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker"])


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def save_checkpoint(state: GlobalState, model, optimizer, scheduler, train_data_iterator=None) -> str:
    """Save iteration ``state.train_state.step`` under ``checkpoint.save``; returns the folder.

    Collective: every rank must call it at the same iteration.
    """
    cfg = state.cfg.checkpoint
    root = cfg.save
    iteration = state.train_state.step
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    rank = _rank()
    start = time.perf_counter()

    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in glob.glob(os.path.join(root, "iter_*.tmp")) + glob.glob(os.path.join(root, "iter_*.del")):
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()

    _save_model_and_optimizer(model, optimizer, tmp, cfg.save_optim)
    per_rank = {"rank": rank, "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    if cfg.save_rng:
        per_rank["rng"] = _rng_state()
    if train_data_iterator is not None and hasattr(train_data_iterator, "state_dict"):
        per_rank["data"] = train_data_iterator.state_dict()
    _torch_save_durable(per_rank, os.path.join(tmp, f"rank_{rank:05d}.pt"))
    if rank == 0:
        common = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "train_state": state.train_state.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        ft = getattr(state, "fault_tolerance", None)
        if ft is not None:  # computed FT timeouts travel with the checkpoint (see fault_tolerance.py)
            common["fault_tolerance"] = ft.state_dict()
        config_path = os.path.join(tmp, "run_config.json")
        with open(config_path, "w") as f:
            json.dump(state.cfg.to_dict(), f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        # Files of the model/optimizer writer that belong to no rank in particular (e.g. .metadata).
        for path in glob.glob(os.path.join(tmp, "*")) + glob.glob(os.path.join(tmp, ".*")):
            if os.path.isfile(path) and not re.match(r"^(__\d+_\d+\.distcp|rank_\d+\.pt)$", os.path.basename(path)):
                _fsync_path(path)
    for path in glob.glob(os.path.join(tmp, f"__{rank}_*.distcp")):
        _fsync_path(path)
    _barrier()
    if rank == 0:
        # train_state.pt is written last, once every rank's files are durable: its presence is what
        # marks a folder as complete (for the scan that backs up the tracker).
        _torch_save_durable(common, os.path.join(tmp, COMMON_FILE))

    if rank == 0:
        _fsync_path(tmp)
        if os.path.isdir(final):  # re-saving an iteration (e.g. after a resume): swap it whole
            os.replace(final, final + ".del")
        os.replace(tmp, final)
        _fsync_path(root)
        _write_tracker(root, iteration)
        shutil.rmtree(final + ".del", ignore_errors=True)
        _remove_old_checkpoints(root, cfg.most_recent_k)
        logger.info("saved checkpoint %s in %.2fs", final, time.perf_counter() - start)
        print(f"saved checkpoint at iteration {iteration} to {final} ({time.perf_counter() - start:.2f}s)", flush=True)
    _barrier()
    return final


def _remove_old_checkpoints(root: str, keep: int) -> None:
    if keep <= 0:
        return
    for iteration in complete_iterations(root)[:-keep]:
        doomed = iteration_dir(root, iteration)
        os.replace(doomed, doomed + ".del")
        shutil.rmtree(doomed + ".del", ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def load_checkpoint(state: GlobalState, model, optimizer, scheduler) -> Optional[Dict[str, Any]]:
    """Restore from the newest complete checkpoint in ``checkpoint.load``; returns this rank's data
    state (``{"consumed_samples": ...}``) or None when nothing was loaded.

    Falls back to ``checkpoint.pretrained_checkpoint`` for model weights only (a fresh run that
    starts from pretrained weights). RNG states are restored last, after everything that might
    draw random numbers, so the next step draws exactly what it drew in the original run.
    """
    cfg = state.cfg.checkpoint
    rank = _rank()
    path = find_latest_checkpoint(cfg.load) if cfg.load else None
    if path is None:
        if cfg.load and cfg.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"no complete checkpoint under {cfg.load}")
        if cfg.pretrained_checkpoint:
            pretrained = _resolve_checkpoint_dir(cfg.pretrained_checkpoint)
            if pretrained is None:
                raise FileNotFoundError(f"no complete checkpoint under {cfg.pretrained_checkpoint}")
            _load_model_and_optimizer(model, optimizer, pretrained, load_optim=False)
            if rank == 0:
                print(f"loaded pretrained weights from {pretrained}", flush=True)
        elif rank == 0:
            print(f"no checkpoint found under {cfg.load!r}: starting from scratch", flush=True)
        return None

    start = time.perf_counter()
    finetune = cfg.finetune
    _load_model_and_optimizer(model, optimizer, path, load_optim=cfg.load_optim and not finetune)
    common = torch.load(os.path.join(path, COMMON_FILE), weights_only=False)
    state.checkpoint_extra = {key: common[key] for key in ("fault_tolerance",) if key in common}
    if not finetune:
        state.train_state.load_state_dict(common["train_state"])
        if scheduler is not None and common.get("scheduler") is not None:
            scheduler.load_state_dict(common["scheduler"])
    rank_file = os.path.join(path, f"rank_{rank:05d}.pt")
    per_rank = torch.load(rank_file, weights_only=False) if os.path.exists(rank_file) else None
    if per_rank is None and rank == 0:
        print(f"warning: {path} has no state for rank {rank} (world size changed?); RNG not restored", flush=True)
    if rank == 0:
        print(f"loaded checkpoint {path} (iteration {common['iteration']}) in {time.perf_counter() - start:.2f}s",
              flush=True)
    if finetune or per_rank is None:
        return None
    if cfg.load_rng and "rng" in per_rank:
        _set_rng_state(per_rank["rng"])
    return per_rank.get("data")
