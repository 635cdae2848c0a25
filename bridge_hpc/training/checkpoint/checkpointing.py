"""Crash-safe checkpoints: a folder per iteration that is either complete or invisible, verified before
it is loaded.

Layout under ``checkpoint.save``::

    latest_checkpointed_iteration.txt   # the iteration to resume from (Megatron's tracker), replaced atomically
    .lock                               # flock'ed by rank 0 of the job training into this folder
    iter_0000020/
        .metadata, __0_0.distcp, ...    # model + optimizer (torch.distributed.checkpoint format)
        rank_00000.pt, rank_00001.pt    # per rank: python/numpy/torch RNG states, data position
        run_config.json                 # the resolved configuration
        train_state.pt                  # train_state, scheduler, iteration (rank 0)
        manifest.json                   # every other file with its size in bytes; written last
    iter_0000010.damaged/               # a checkpoint that failed verification or loading, set aside

Write protocol (what makes a SIGKILL at any instant harmless): every rank writes into
``iter_XXXXXXX.tmp`` and fsyncs the files it wrote; after the ranks agree that all writes succeeded,
rank 0 writes ``train_state.pt``, then ``manifest.json`` (both fsynced), fsyncs the folder, renames it
to ``iter_XXXXXXX``, fsyncs the parent, and only then replaces the tracker (write temp, fsync, rename,
fsync parent). A ``.tmp`` folder is never loaded; old checkpoints beyond ``most_recent_k`` are renamed
to ``*.del`` before deletion, so a half-deleted folder never looks complete either. With
``checkpoint.async_save`` the same protocol runs with the shard write in a background process per rank
(:mod:`bridge_hpc.training.checkpoint.async_writer`): :func:`begin_save` and :func:`write_rank_state` at the
save's iteration, :func:`commit_save` steps later, once every rank's shards are durable.

A failed write on any rank (a full disk, a quota, an I/O error) is agreed on by all ranks at the end
of each phase of the save, so every rank raises :class:`CheckpointSaveError` with the cause within
seconds instead of the healthy ranks waiting forever in the next collective for the failed one.

Load: rank 0 picks the checkpoint and every other rank follows it (one broadcast), so all ranks enter
the collective load of the same folder. The tracker is obeyed when it names a complete checkpoint,
also an older one than the newest (a user rolling back after a loss spike, as in Megatron); when it
is missing, unreadable or names no complete checkpoint, the newest complete one is used. Before
loading, rank 0 checks the folder against its manifest (:func:`verify_checkpoint`: sizes only,
cheap); a damaged one, or one whose load fails on any rank, is renamed to ``*.damaged`` (never
deleted), reported on stderr and in progress.txt (``Checkpoint fallback``), and the next older
complete checkpoint is tried. Folders of format 1 (no manifest) are still read; for them only the
presence and non-emptiness of the files can be checked.

Back ends: without CUDA the model and optimizer go through ``torch.distributed.checkpoint``
(torch-native DDP and optimizer); on CUDA through megatron-core's ``dist_checkpointing`` with
megatron's DDP and optimizer. Everything else is shared.
"""

from __future__ import annotations

import copy
import glob
import json
import logging
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from bridge_hpc.peft import checkpoint as peft_checkpoint
from bridge_hpc.peft.config import peft_type
from bridge_hpc.training.checkpoint.layout import (  # noqa: F401 - also re-exported: callers name them here
    _NEARLY_FULL_BYTES,
    COMMON_FILE,
    DAMAGED_SUFFIX,
    FORMAT_VERSION,
    MANIFEST_FILE,
    RUN_CONFIG_FILE,
    TRACKER,
    CheckpointLoadError,
    CheckpointSaveError,
    _barrier,
    _from_rank0,
    _fsync_path,
    _gather_errors,
    _load_order,
    _one_line,
    _rank,
    _resolve_checkpoint_dir,
    _set_aside,
    _space_error,
    _torch_save_durable,
    _world_size,
    _write_durable,
    _write_tracker,
    complete_iterations,
    find_latest_checkpoint,
    iteration_dir,
    lock_checkpoint_folder,
    release_checkpoint_folder,
    verify_checkpoint,
)
from bridge_hpc.training.checkpoint.megatron import (  # noqa: F401 - also re-exported: callers name them here
    LOAD_READ_THREADS,
    _adapters_only,
    _in_process_write_results,
    _load_model_and_optimizer,
    _save_model_and_optimizer,
    _uses_megatron_dist,
    _without_empty_extra_state,
    check_optimizer_layout,
    megatron_save_takes_async_strategy,
    megatron_save_tensors,
    megatron_sharded_state,
    saved_parallelism,
)
from bridge_hpc.training.engine import parallel
from bridge_hpc.training.state import GlobalState

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------


def _rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        # With CUDA graphs the tracker's states are graph-safe generators (pretrain.set_random_seed):
        # saved as their state tensors, so that a run with and a run without graphs load each other's.
        state["rng_tracker"] = {name: s.get_state() if isinstance(s, torch.Generator) else s
                                for name, s in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tracker = tensor_parallel.get_cuda_rng_tracker()
        current = tracker.get_states()
        for name, saved in state["rng_tracker"].items():
            if isinstance(current.get(name), torch.Generator):
                current[name].set_state(saved)  # the generator a captured graph reads stays the same object
            else:
                current[name] = saved
        tracker.set_states(current)


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def _free_bytes(path: str) -> Optional[int]:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _describe_save_error(exc: BaseException, folder: str) -> str:
    """One line: the cause of a failed save, naming the file where known."""
    space = _space_error(exc)
    if space is not None:
        return f"{os.strerror(space.errno).lower()} writing {space.filename or folder}"
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, failure = next(iter(exc.failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        what = f"{type(inner).__name__} on rank {rank}: {inner}"
    else:
        what = f"{type(exc).__name__}: {exc}"
    free = _free_bytes(folder)
    if free is not None and free < _NEARLY_FULL_BYTES:
        return f"no space left on device writing {folder} ({free} bytes free; {_one_line(what, 200)})"
    return _one_line(what)


def save_checkpoint(state: GlobalState, model, optimizer, scheduler, train_data_iterator=None) -> str:
    """Save iteration ``state.train_state.step`` under ``checkpoint.save``; returns the folder.

    Collective: every rank must call it at the same iteration. A failure on any rank raises
    :class:`CheckpointSaveError` on every rank; the previous checkpoints are untouched then.
    (``checkpoint.async_save`` runs the same protocol with the write in the background:
    :mod:`bridge_hpc.training.checkpoint.async_writer`.)
    """
    save = begin_save(state, scheduler)

    def write() -> None:
        ckpt = state.cfg.checkpoint
        _save_model_and_optimizer(model, optimizer, save.tmp, ckpt.save_optim, ckpt.storage_writers_per_rank,
                                  ckpt.dist_ckpt_optim_fully_reshardable)  # collective
        write_rank_state(save, state, train_data_iterator)
        _fsync_written_files(save.tmp)

    _save_phase(write, save.iteration, save.tmp)
    return commit_save(save)


@dataclass
class SaveInProgress:
    """One save between its start and its commit: where it writes and what rank 0 commits.

    ``common`` (the content of ``train_state.pt``) is taken when the save starts, so that a save
    committed steps later (``checkpoint.async_save``) records the iteration it holds.
    """

    iteration: int
    root: str
    final: str
    tmp: str
    world_size: int
    most_recent_k: int
    save_retain_interval: Optional[int]
    common: Dict[str, Any]
    started: float  # time.perf_counter() when the save began


def begin_save(state: GlobalState, scheduler) -> SaveInProgress:
    """Start a save of the current iteration: rank 0 removes stale ``iter_*.tmp``/``*.del`` folders
    and creates ``iter_N.tmp``. Collective; a failure raises :class:`CheckpointSaveError` on every rank."""
    cfg = state.cfg.checkpoint
    iteration = state.train_state.step
    final = iteration_dir(cfg.save, iteration)
    common = {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "train_state": state.train_state.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
    }
    ft = state.fault_tolerance
    if ft is not None:  # computed FT timeouts travel with the checkpoint (see fault_tolerance.py)
        common["fault_tolerance"] = ft.state_dict()
    save = SaveInProgress(iteration=iteration, root=cfg.save, final=final, tmp=final + ".tmp",
                          world_size=_world_size(), most_recent_k=cfg.most_recent_k,
                          save_retain_interval=cfg.save_retain_interval, common=copy.deepcopy(common),
                          started=time.perf_counter())

    def prepare() -> None:
        os.makedirs(save.root, exist_ok=True)
        for stale in glob.glob(os.path.join(save.root, "iter_*.tmp")) + glob.glob(os.path.join(save.root, "iter_*.del")):
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(save.tmp)

    _save_phase(prepare if _rank() == 0 else None, iteration, save.tmp)
    return save


def write_rank_state(save: SaveInProgress, state: GlobalState, train_data_iterator=None) -> None:
    """This rank's ``rank_NNNNN.pt`` (RNG states, data position) and, on rank 0, ``run_config.json``,
    both durable. Taken at the save's iteration: the next step draws random numbers and reads data."""
    cfg = state.cfg.checkpoint
    rank = _rank()
    per_rank = {"rank": rank, "world_size": save.world_size}
    if cfg.save_rng:
        per_rank["rng"] = _rng_state()
    if train_data_iterator is not None and hasattr(train_data_iterator, "state_dict"):
        per_rank["data"] = train_data_iterator.state_dict()
    _torch_save_durable(per_rank, os.path.join(save.tmp, f"rank_{rank:05d}.pt"))
    if rank == 0:
        config = json.dumps(state.cfg.to_dict(), indent=2, default=str)
        _write_durable(os.path.join(save.tmp, RUN_CONFIG_FILE), config.encode())
        peft = state.cfg.peft
        if peft is not None:  # the adapters' base: checked when the run resumes (peft_checkpoint.check_resume)
            record = peft_checkpoint.base_record(peft_type(peft), peft)
            _write_durable(os.path.join(save.tmp, peft_checkpoint.BASE_RECORD_FILE), json.dumps(record, indent=1).encode())


def _fsync_written_files(tmp: str) -> None:
    """fsync this rank's shards and, on rank 0, the model/optimizer writer's files that belong to no
    rank in particular (e.g. ``.metadata``)."""
    rank = _rank()
    if rank == 0:
        for path in glob.glob(os.path.join(tmp, "*")) + glob.glob(os.path.join(tmp, ".*")):
            if os.path.isfile(path) and not re.match(r"^(__\d+_\d+\.distcp|rank_\d+\.pt)$", os.path.basename(path)):
                _fsync_path(path)
    for path in glob.glob(os.path.join(tmp, f"__{rank}_*.distcp")):
        _fsync_path(path)


def commit_save(save: SaveInProgress) -> str:
    """Make ``save`` the checkpoint to resume from; returns its folder. Collective, and only once every
    rank's files are durable: rank 0 writes ``train_state.pt`` and the manifest, renames the folder,
    replaces the tracker, then removes checkpoints beyond ``most_recent_k``."""
    rank = _rank()

    def commit() -> None:
        tmp, final = save.tmp, save.final
        _torch_save_durable(save.common, os.path.join(tmp, COMMON_FILE))
        _write_manifest(tmp, save.iteration, save.world_size)
        _fsync_path(tmp)
        if os.path.isdir(final):  # re-saving an iteration (after a rollback or a resume): swap it whole
            problem = verify_checkpoint(final, save.world_size)
            if problem is None:
                os.replace(final, final + ".del")
            else:  # never delete a damaged checkpoint: someone may want to look at it
                logger.warning("%s is damaged (%s): set aside as %s", final, problem, _set_aside(final))
        os.replace(tmp, final)
        _fsync_path(save.root)
        _write_tracker(save.root, save.iteration)

    _save_phase(commit if rank == 0 else None, save.iteration, save.tmp)
    if rank == 0:
        shutil.rmtree(save.final + ".del", ignore_errors=True)
        try:
            _remove_old_checkpoints(save.root, save.most_recent_k, save.iteration, save.world_size,
                                    save.save_retain_interval)
        except OSError as err:  # the new checkpoint is complete; an old one left behind harms nothing
            logger.warning("could not remove old checkpoints in %s: %s", save.root, err)
        elapsed = time.perf_counter() - save.started
        logger.info("saved checkpoint %s in %.2fs", save.final, elapsed)
        print(f"saved checkpoint at iteration {save.iteration} to {save.final} ({elapsed:.2f}s)", flush=True)
    # The ranks leave the save together: a rank that went on to the next step would wait for rank 0's
    # clean-up inside that step's gradient all-reduce, where gloo polls, and its step would look slow
    # to the straggler detector (which times steps by CPU time).
    _barrier()
    return save.final


def _save_phase(step, iteration: int, tmp: str) -> None:
    """Run this rank's part of a save phase (``step`` None: nothing to do here), then agree with all
    ranks on whether every part succeeded (collective). On a failure anywhere, every rank raises
    :class:`CheckpointSaveError` with the first failure's cause, after rank 0 removed the ``.tmp``
    folder; a rank that raised alone would leave the others waiting in the next collective."""
    error, local = None, None
    if step is not None:
        try:
            step()
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            local = exc
            error = _describe_save_error(exc, tmp)
    failures = _gather_errors(error)
    if not failures:
        return
    failed_rank, cause = failures[0]
    message = (f"checkpoint save of iteration {iteration} failed on rank {failed_rank}: {cause}; "
               f"{os.path.basename(tmp)} removed, earlier checkpoints in {os.path.dirname(tmp)} are kept")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"error: {message}", file=sys.stderr, flush=True)
    _barrier()  # the cause in one line, before any rank's traceback
    raise CheckpointSaveError(message) from local


def _write_manifest(folder: str, iteration: int, world_size: int) -> None:
    files = {}
    for directory, _, names in os.walk(folder):
        for file_name in names:
            rel = os.path.relpath(os.path.join(directory, file_name), folder)
            if rel != MANIFEST_FILE:
                files[rel] = os.stat(os.path.join(directory, file_name)).st_size
    manifest = {"format_version": FORMAT_VERSION, "iteration": iteration, "world_size": world_size,
                "files": dict(sorted(files.items()))}
    _write_durable(os.path.join(folder, MANIFEST_FILE), json.dumps(manifest, indent=1).encode())


def _remove_old_checkpoints(root: str, keep: int, newest: int, world_size: int,
                            retain_interval: Optional[int] = None) -> None:
    """Delete complete checkpoints beyond the ``keep`` newest up to iteration ``newest`` (the one just
    saved). With ``retain_interval`` (``checkpoint.save_retain_interval``, Megatron's) the iterations
    that are multiples of it are kept as well, and ``keep = -1`` then means the newest one only (as in
    Megatron: retained ones plus the last). Newer ones (left from before a rollback) are not counted
    and not deleted, ``*.damaged`` folders never; and if none of the kept ones verifies, the newest
    older one that does is kept."""
    if retain_interval is not None and keep <= 0:
        keep = 1
    if keep <= 0:
        return
    candidates = [i for i in complete_iterations(root) if i <= newest]
    doomed, kept = candidates[:-keep], candidates[-keep:]
    if retain_interval is not None:
        doomed = [i for i in doomed if i % retain_interval != 0]
    if doomed and all(verify_checkpoint(iteration_dir(root, i), world_size) is not None for i in kept):
        for i in reversed(doomed):
            if verify_checkpoint(iteration_dir(root, i), world_size) is None:
                doomed.remove(i)
                break
    for i in doomed:
        path = iteration_dir(root, i)
        os.replace(path, path + ".del")
        shutil.rmtree(path + ".del", ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


class _Chooser:
    """Rank 0's choice of the checkpoint to load, and the setting aside of damaged ones.

    ``progress``: the run's progress log (``state.progress``) or None; each damaged folder becomes a
    ``Checkpoint fallback`` event once the folder used instead (or none) is known.
    """

    def __init__(self, root: str, world_size: int, progress, step: Optional[int] = None):
        self.root, self.world_size, self.progress = root, world_size, progress
        #: ``checkpoint.ckpt_step`` where it applies (see :func:`load_checkpoint`): that iteration or a failure.
        self.step = step
        self.pending: List[Tuple[str, str, str]] = []  # (folder, set aside as, reason)
        self.skipped: set = set()  # folders that could not be renamed: not tried again
        self.set_aside: set = set()  # folders found damaged, by their original path

    def damaged(self, path: str, reason: str) -> None:
        reason = _one_line(reason)
        self.set_aside.add(path)
        try:
            aside = os.path.basename(_set_aside(path))
        except OSError as err:
            aside = f"not moved: {err}"
            self.skipped.add(path)
        name = os.path.basename(path)
        logger.warning("checkpoint %s is damaged (%s); set aside as %s", path, reason, aside)
        print(f"warning: checkpoint {path} is damaged: {reason}; set aside as {aside}", file=sys.stderr, flush=True)
        self.pending.append((name, aside, reason))

    def decide(self) -> Tuple[str, Optional[str]]:
        """:meth:`next`, with an unexpected error turned into ``("fail", message)``: rank 0 must reach
        the broadcast of its decision, or the other ranks would wait in it."""
        try:
            return self.next()
        except Exception as exc:  # noqa: BLE001 - reported to every rank, which all raise it
            return "fail", f"cannot choose a checkpoint under {self.root}: {type(exc).__name__}: {exc}"

    def next(self) -> Tuple[str, Optional[str]]:
        """``("load", path)``, ``("none", None)`` (nothing here: start fresh) or ``("fail", message)``."""
        if self.step is not None:  # the iteration asked for, or nothing: no fallback to another one
            path = iteration_dir(self.root, self.step)
            reason = verify_checkpoint(path, self.world_size) if os.path.isdir(path) else "there is no such folder"
            if reason is None:
                return "load", path
            return "fail", f"checkpoint.ckpt_step = {self.step} asks for {path}, which cannot be loaded: {reason}"
        order, tracked, warning = _load_order(self.root)
        if warning and (tracked is None or iteration_dir(self.root, tracked) not in self.set_aside):
            logger.warning(warning)  # (not when the tracker names a folder this chooser set aside)
        for path in order:
            if path in self.skipped:
                continue
            reason = verify_checkpoint(path, self.world_size)
            if reason is None:
                self._report(os.path.basename(path))
                if self.pending:  # the tracker named a folder set aside: name the one used instead
                    try:
                        _write_tracker(self.root, int(os.path.basename(path)[len("iter_"):]))
                    except OSError as err:
                        logger.warning("could not update %s: %s", TRACKER, err)
                return "load", path
            self.damaged(path, reason)
        self._report("none")
        damaged = sorted(glob.glob(os.path.join(glob.escape(self.root), f"iter_*{DAMAGED_SUFFIX}*")))
        if not damaged and not self.skipped:
            return "none", None
        names = ", ".join(os.path.basename(p) for p in damaged + sorted(self.skipped))
        return "fail", (f"no loadable checkpoint under {self.root}: every one is damaged ({names}); "
                        f"not starting from scratch over them: move them out of the folder to do so")

    def _report(self, used: str) -> None:
        for name, aside, reason in self.pending:
            if self.progress is not None:
                try:
                    self.progress.checkpoint_fallback(name, aside, reason, used)
                except OSError as err:
                    logger.warning("could not record the checkpoint fallback in the progress log: %s", err)
        self.pending = []


def load_checkpoint(state: GlobalState, model, optimizer, scheduler) -> Optional[Dict[str, Any]]:
    """Restore from the checkpoint in ``checkpoint.load`` that the tracker names, else the newest
    complete one; returns this rank's data state (``{"consumed_samples": ...}``) or None when
    nothing was loaded. Collective.

    A checkpoint that fails verification or loading is set aside and the next older one tried; if
    only damaged ones exist, :class:`CheckpointLoadError`. ``checkpoint.ckpt_step`` (Megatron's and Bridge's)
    loads that iteration of ``checkpoint.load`` instead, and nothing else (:class:`CheckpointLoadError` when
    it cannot), in the job's first run only: a requeued or restarted run (``state.restart_count``) resumes
    from the newest checkpoint, as the tracker names it, so that it keeps what the job trained since.
    A run without a checkpoint of its own
    started from ``checkpoint.pretrained_checkpoint``, whose weights were read before the model was
    wrapped (:mod:`bridge_hpc.training.checkpoint.pretrained`); so does a PEFT run at every start, whose own
    checkpoints hold its adapters only, with a record of their base that is checked first
    (:func:`bridge_hpc.peft.checkpoint.check_resume`). RNG states are restored last, after everything that
    might draw random numbers, so the next step draws exactly what it drew in the original run.
    """
    cfg = state.cfg.checkpoint
    rank = _rank()
    path, saved = None, None
    loaded: Optional[Tuple[Dict[str, Any], Optional[Dict[str, Any]]]] = None
    start = time.perf_counter()
    now = parallel.model_parallel_sizes()
    if cfg.load:
        step = cfg.ckpt_step if state.restart_count == 0 else None
        chooser = _Chooser(cfg.load, _world_size(), state.progress, step) if rank == 0 else None
        while True:
            decision, value = _from_rank0(chooser.decide() if chooser is not None else None)
            if decision == "fail":
                raise CheckpointLoadError(value)
            if decision == "none":
                break
            path = value
            start = time.perf_counter()
            error = None
            load_optim = cfg.load_optim and not cfg.finetune
            saved = saved_parallelism(path)
            peft = state.cfg.peft  # adapters of another base, or of no PEFT run: one error, the folder left alone
            peft_checkpoint.check_resume(path, peft_type(peft) if peft is not None else None,
                                         peft.base_folder if peft is not None else None, peft)
            if _uses_megatron_dist(model):
                check_optimizer_layout(path, saved, now, optimizer, load_optim)
            fully = saved is not None and saved.fully_reshardable
            try:
                loaded = _read_checkpoint(model, optimizer, path, load_optim, rank, fully)
            except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
                error = _describe_load_error(exc)
                logger.warning("loading %s failed on rank %d", path, rank, exc_info=True)
            failures = _gather_errors(error)  # every rank learns of a failure on any rank
            if not failures:
                break
            if saved is not None and saved.sizes != now:
                # Not damage: the checkpoint loads at the layout it was saved at. It stays in place.
                failed_rank, cause = failures[0]
                sizes = saved.sizes
                raise CheckpointLoadError(
                    f"{path}, saved at tensor/pipeline/context-parallel sizes {sizes['tp']}/{sizes['pp']}/{sizes['cp']}, "
                    f"failed to load at {now['tp']}/{now['pp']}/{now['cp']} (rank {failed_rank}: {cause}); it is left "
                    "in place: resume at the saved sizes, or load the weights only (checkpoint.load_optim = false)")
            if chooser is not None:
                failed_rank, cause = failures[0]
                chooser.damaged(path, f"load failed on rank {failed_rank}: {cause}")
            path, loaded = None, None

    if path is None or loaded is None:
        if cfg.load and cfg.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"no complete checkpoint under {cfg.load}")
        # (with checkpoint.pretrained_checkpoint, its weights were read into the bare model already)
        if rank == 0 and not cfg.pretrained_checkpoint:
            print(f"no checkpoint found under {cfg.load!r}: starting from scratch", flush=True)
        return None

    common, per_rank = loaded
    finetune = cfg.finetune
    state.checkpoint_extra = {key: common[key] for key in ("fault_tolerance",) if key in common}
    if not finetune:
        state.train_state.load_state_dict(common["train_state"])
        if scheduler is not None and common.get("scheduler") is not None:
            scheduler.load_state_dict(common["scheduler"])
    # Random-number states belong to ranks' roles: restored only at the layout they were saved at (a
    # checkpoint whose config cannot be read counts as saved at this one, as before configs recorded it).
    same_layout = (per_rank is not None and per_rank.get("world_size") == _world_size()
                   and (saved is None or saved.sizes == now))
    if rank == 0:
        print(f"loaded checkpoint {path} (iteration {common['iteration']}) in {time.perf_counter() - start:.2f}s",
              flush=True)
        if per_rank is None:
            print(f"warning: {path} has no state for rank {rank} (world size changed?); RNG not restored", flush=True)
        elif not same_layout:
            print(f"note: {path} was saved at model-parallel sizes {saved.sizes if saved else '?'} on "
                  f"{per_rank.get('world_size')} ranks, this run is {now} on {_world_size()}: "
                  "weights and optimizer resharded, random-number states not restored (they belong to other "
                  "ranks' roles)", flush=True)
    if finetune:
        return None
    # Every rank returns a dict once a checkpoint was loaded (the caller counts the step as saved on
    # all ranks alike); the data position where this rank's state has one.
    if per_rank is None:
        return {}
    if cfg.load_rng and "rng" in per_rank and same_layout:
        _set_rng_state(per_rank["rng"])
    return per_rank.get("data", {})


def _read_checkpoint(model, optimizer, path: str, load_optim: bool, rank: int,
                     fully_reshardable: bool = False) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Load model and optimizer in place (collective) and read the shared and this rank's state."""
    _load_model_and_optimizer(model, optimizer, path, load_optim=load_optim, fully_reshardable=fully_reshardable)
    common = torch.load(os.path.join(path, COMMON_FILE), weights_only=False)
    rank_file = os.path.join(path, f"rank_{rank:05d}.pt")
    per_rank = torch.load(rank_file, weights_only=False) if os.path.exists(rank_file) else None
    return common, per_rank


def _describe_load_error(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, failure = next(iter(exc.failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return _one_line(f"{type(inner).__name__} (rank {rank} of the reader): {inner}")
    return _one_line(f"{type(exc).__name__}: {exc}")
