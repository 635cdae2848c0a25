"""Checkpoint saves written in the background (``checkpoint.async_save = true``).

A save runs the protocol of :mod:`bridge_hpc.training.checkpoint.checkpointing` in three parts:

1. **Start** (blocks training briefly; collective). Plan the model and optimizer write (the plan is
   cached while the state's structure stays the same), take a snapshot of the tensors, and write the
   small per-rank files (RNG states, data position) into ``iter_N.tmp``. The shard write goes to this
   rank's checkpoint worker: a persistent process fed by nvidia-resiliency-ext's ``AsyncCallsQueue``
   (megatron-core's where nvidia-resiliency-ext is missing, on GPU only), started at start-up so that
   the first save does not pay for creating it. On GPU the worker copies the tensors to host memory
   before the start returns (megatron-core's ``dist_checkpointing.save(..., async_sharded_save=True)``,
   torch_dist strategy); on CPU they are cloned, since training changes them in place.
2. **Write** (background). The worker writes and fsyncs this rank's shards; training goes on.
3. **Finalize** (collective). Once every rank's worker reports its write done, the ranks agree on
   the outcome. On success the DCP ``.metadata`` is written and the save is committed exactly as a
   synchronous one (:func:`~bridge_hpc.training.checkpoint.checkpointing.commit_save`: ``train_state.pt`` and the
   manifest last, rename, tracker; old checkpoints removed only then). Until then the tracker names
   the previous checkpoint, so a kill at any instant leaves the last finalized checkpoint loadable.

At most one save is in flight. The loop checks after every step whether it is done, without waiting
(one small all-reduce while a save is in flight); before a new save, and before any exit, it waits
for it (:mod:`bridge_hpc.training.resilience.exit_policy`).

Failures: a worker that died or a write that failed (a full disk, an I/O error) on any rank fails the
save on every rank together: :class:`~bridge_hpc.training.checkpoint.checkpointing.CheckpointSaveError` naming
the rank and the cause, the ``.tmp`` folder removed, the tracker untouched. A dead worker is replaced
for the next save. What the loop does then is the exit policy's rule.

The worker leaves the stop signals (``train.exit_signal``) to its rank, as the loader workers do:
Slurm signals every process of a step, and a worker dying of SIGUSR1 would fail the save that the
exit is waiting for. It dies with its rank (``PR_SET_PDEATHSIG``) and shows as ``bridge-ckpt`` in
``ps`` (:mod:`bridge_hpc.training.checkpoint.worker`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.managers import SyncManager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.checkpoint import checkpointing
from bridge_hpc.training.checkpoint.checkpointing import CheckpointSaveError, SaveInProgress
from bridge_hpc.training.checkpoint.worker import end_with_parent, prepare_worker, stage_once, stop_signals_blocked
from bridge_hpc.training.engine.collectives import comm_device
from bridge_hpc.training.state import GlobalState

logger = logging.getLogger(__name__)

#: The ``checkpointing_context`` key of this rank's :class:`AsyncCheckpointWriter` (pretrain starts it).
ASYNC_WRITER_KEY = "async_checkpoint_writer"
#: While a rank waits for its worker, it logs that it still does this often (seconds).
WAIT_REPORT_S = 60.0
#: While a save's tensors are being staged by the worker, the rank checks this often that it lives.
WORKER_WATCH_S = 0.05


class CheckpointWorkerDied(RuntimeError):
    """This rank's checkpoint worker process is gone (killed, out of memory) with a save unwritten."""


# ---------------------------------------------------------------------------------------------
# What the installed packages offer
# ---------------------------------------------------------------------------------------------


def _has_persistent_worker(queue_class: type) -> bool:
    return "persistent" in inspect.signature(queue_class.__init__).parameters


def queue_api(on_gpu: bool) -> Tuple[type, type, str]:
    """``(AsyncCallsQueue, AsyncRequest, package)``: nvidia-resiliency-ext's where it offers a
    persistent worker, else (GPU only) megatron-core's, whose worker selects a CUDA device and so
    cannot run on CPU. The CPU path also needs nvidia-resiliency-ext's async DCP writer. Neither: a
    ConfigError on ``checkpoint.async_save``."""
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest

        if _has_persistent_worker(AsyncCallsQueue):
            return AsyncCallsQueue, AsyncRequest, "nvidia-resiliency-ext"
        problem = "its AsyncCallsQueue has no persistent worker"
    except ImportError as err:
        problem = str(err)
    if on_gpu:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

        if _has_persistent_worker(AsyncCallsQueue):
            return AsyncCallsQueue, AsyncRequest, "megatron-core"
    raise ConfigError(f"needs nvidia-resiliency-ext's async checkpointing with a persistent worker "
                      f"({problem}); install nvidia-resiliency-ext >= 0.4 or set false", key="checkpoint.async_save")


#: The module of nvidia-resiliency-ext's async DCP writer (``FileSystemWriterAsync``).
NVRX_WRITER_MODULE = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"


def _writer_module(on_gpu: bool) -> str:
    """The module of the async writer whose function the worker runs, and whose module-global
    write-results queue an async save's planning takes (created at start-up in
    :meth:`AsyncCheckpointWriter.start`). It must be the writer the save really uses: with another
    module's queue made ready, the first save started a *spawn* Manager itself (10 s of imports
    inside its blocking part on an H200 host), and that Manager, never shut down, outlived the rank
    and held the job's output open (a torchrun job under ``subprocess.run`` never ended)."""
    if on_gpu and not checkpointing.megatron_save_takes_async_strategy():
        return "megatron.core.dist_checkpointing.strategies.filesystem_async"
    return NVRX_WRITER_MODULE


def _how_it_died(process) -> str:
    code = process.exitcode
    if code is None:
        return "no longer running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def interval_save_ahead(cfg, step: int) -> bool:
    """Whether a run at ``step`` will reach another ``checkpoint.save_interval`` save before
    ``train.train_iters``: the only saves that run in the background (any save at an exit, the end
    of training included, is synchronous), and so the only reason to warm the worker's staging up
    (:meth:`AsyncCheckpointWriter.warm_up_staging`)."""
    interval = cfg.checkpoint.save_interval
    return bool(interval) and (step // interval + 1) * interval < cfg.train.train_iters


# ---------------------------------------------------------------------------------------------
# One save in flight
# ---------------------------------------------------------------------------------------------


@dataclass
class PendingSave:
    """A started save: what the worker runs, and what finalization does once every write is done."""

    save: SaveInProgress
    request: Any  # the AsyncRequest given to the worker; its async_fn is None where this rank writes nothing
    finalize: Callable[[], None]  # collective: the back end's metadata, after every rank's write is complete
    results_queue: Any  # where the worker puts this rank's write results (or the exception of a failed write)
    blocking_s: float = 0.0  # how long the start held up training
    done: bool = False  # this rank's write is over (successfully or not)
    error: Optional[BaseException] = None


@dataclass
class FinishedSave:
    """A save that finalized: the loop records it (progress log, ``last_saved_step``)."""

    iteration: int
    folder: str
    common: Dict[str, Any]  # train_state.pt's content: the counters at the saved iteration
    blocking_s: float  # time training was held up by its start and its finalization
    total_s: float  # from its start until it was committed


class AsyncCheckpointWriter:
    """This rank's background checkpoint writer: a persistent worker process behind an
    ``AsyncCallsQueue``, and the one save in flight (:attr:`pending`)."""

    def __init__(self, stop_signals: Sequence[str], on_gpu: bool):
        self.stop_signals = tuple(stop_signals)
        self.on_gpu = on_gpu
        self._queue_class, self.request_class, self.package = queue_api(on_gpu)
        self.queue = None
        self.pending: Optional[PendingSave] = None
        self.plans = _PlanCache()
        self._results_queue_thread: Optional[threading.Thread] = None
        self._results_manager: Optional[Tuple[Any, SyncManager]] = None
        self._staging_warmed = False

    def start(self) -> "AsyncCheckpointWriter":
        """Start the worker and the write-results queue now, overlapped with model building and
        checkpoint loading, instead of in the first save."""
        if self.package != "nvidia-resiliency-ext":
            logger.warning("nvidia-resiliency-ext offers no persistent AsyncCallsQueue here: asynchronous "
                           "checkpoints use megatron-core's")
        self._start_worker()
        module = importlib.import_module(_writer_module(self.on_gpu))
        # The writer module's shared write-results queue lives in a spawned Manager process (seconds
        # of imports): created here, in the background, instead of inside the first save's planning.
        # Where the installed version keeps it elsewhere, the first save creates it as usual.
        if getattr(module, "_results_queue", False) is None:
            self._results_queue_thread = threading.Thread(target=self._start_results_queue, args=(module,),
                                                          name="ckpt-results-queue", daemon=True)
            self._results_queue_thread.start()
        return self

    def _start_results_queue(self, module) -> None:
        # Forked, not spawned as megatron-core does: a spawned server re-imports torch and megatron
        # before it serves (16 s of the first save's blocking time on an H100, measured). The server
        # only relays pickled write results; it never touches CUDA, so forking a CUDA process is safe.
        with stop_signals_blocked(self.stop_signals):
            manager = SyncManager(ctx=torch.multiprocessing.get_context("fork"))
            manager.start(initializer=end_with_parent, initargs=(os.getpid(),))
        results = manager.Queue()
        # The Manager unpickles what is put into its queue: the first write results (DCP's
        # WriteResult) made it import torch, seconds inside the first save's background write
        # (8 s of a 10 s first save on CPU, benchmarks/checkpoint.py). Their classes, put once now,
        # make it import those modules at start-up instead.
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.storage import WriteResult

        results.put([WriteResult, _StorageInfo])
        results.get()
        module._results_queue = results
        self._results_manager = (module, manager)

    def _start_worker(self) -> None:
        self._staging_warmed = False  # a new worker's host memory is cold
        self.queue = self._queue_class(persistent=True)
        device = torch.cuda.current_device() if self.on_gpu else None
        began = time.time() if checkpointing._rank() == 0 else None
        warm_up = self.request_class(prepare_worker, (os.getpid(), self.stop_signals, _writer_module(self.on_gpu),
                                                      device, began), [])
        with stop_signals_blocked(self.stop_signals):
            self.queue.schedule_async_request(warm_up)  # spawns the worker; does not wait for it

    def warm_up_staging(self, tensors: List[torch.Tensor]) -> None:
        """GPU runs, once, after the first step (when the optimizer's state exists): have the worker
        stage ``tensors``, every tensor a save writes (:func:`checkpointing.megatron_save_tensors`), in
        the background (:func:`~bridge_hpc.training.checkpoint.worker.stage_once`), so that the first
        save's blocking part costs what a later one does. Returns at once; a save asked for before it
        is over waits for it (the worker takes requests in order). Later calls do nothing."""
        if self._staging_warmed or not self.on_gpu:
            return  # CPU: saves clone in the rank, there is nothing to warm
        self._staging_warmed = True
        request = self.request_class(stage_once, (tensors, time.time(), checkpointing._rank() == 0), [])
        with stop_signals_blocked(self.stop_signals):
            self.queue.schedule_async_request(request)

    @property
    def worker(self):
        """The worker's ``multiprocessing.Process`` (None before it started or after :meth:`close`)."""
        caller = self.queue.persistent_caller if self.queue is not None else None
        return caller.process if caller is not None else None

    def wait_until_started(self) -> None:
        """Before a save is planned: the planning creates the write-results queue if start-up has not."""
        if self._results_queue_thread is not None:
            self._results_queue_thread.join()
            self._results_queue_thread = None

    def submit(self, pending: PendingSave) -> None:
        """Give ``pending``'s write to the worker (this rank only; all ranks call it together). A
        worker found dead, before or while it stages the tensors, fails this save (reported as its
        write's failure is, by :func:`finalize_async_save`) instead of hanging the rank."""
        self.pending = pending
        if pending.request.async_fn is None:
            pending.done = True  # nothing to write on this rank
            return
        worker = self.worker
        if worker is not None and not worker.is_alive():  # died since the last save
            self._fail_dead_worker(pending, worker)
            return
        if pending.request.preload_fn is None:
            self.queue.schedule_async_request(pending.request)
            return
        # With a preload function (GPU: the worker copies the tensors to host memory first) the queue
        # waits, without a time limit, for the worker to say it has staged them: a worker that dies
        # first would hang the rank. A watcher ends that wait when the worker is gone.
        caller, stop = self.queue.persistent_caller, threading.Event()

        def release_if_dead() -> None:
            while not stop.wait(WORKER_WATCH_S):
                process = caller.process
                if process is not None and not process.is_alive():
                    with contextlib.suppress(ValueError):  # it had said so just before it died
                        caller.preload_q.task_done()
                    return

        watcher = threading.Thread(target=release_if_dead, name="ckpt-worker-watch", daemon=True)
        watcher.start()
        try:
            self.queue.schedule_async_request(pending.request)
        finally:
            stop.set()
            watcher.join()
        worker = self.worker
        if worker is not None and not worker.is_alive() and not self._written():
            self._fail_dead_worker(pending, worker)

    @staticmethod
    def _fail_dead_worker(pending: PendingSave, worker) -> None:
        pending.done = True
        pending.error = CheckpointWorkerDied(f"the checkpoint worker of rank {checkpointing._rank()} "
                                             f"(pid {worker.pid}) died ({_how_it_died(worker)}) before it "
                                             f"wrote its shards")

    def check(self, blocking: bool) -> bool:
        """Whether this rank's write of the pending save is over (``pending.error`` says how);
        ``blocking``: wait until it is. Local, no communication."""
        pending = self.pending
        started, reported = time.monotonic(), time.monotonic()
        while not pending.done:
            self._poll(pending)
            if pending.done or not blocking:
                break
            if time.monotonic() - reported >= WAIT_REPORT_S:
                reported = time.monotonic()
                logger.warning("rank %d still waits for its checkpoint worker to write iteration %d (%.0f s)",
                               checkpointing._rank(), pending.save.iteration, reported - started)
            time.sleep(0.01)
        return pending.done

    def idle(self) -> bool:
        """Whether the worker has done everything asked of it (its start-up, the staging warm-up, the
        last save's write). Local, non-blocking."""
        return self._written()

    def _written(self) -> bool:
        """Whether the worker has done every request given to it (the warm-up, then at most one save).
        Non-blocking and without collectives (no_dist): the ranks agree in finalize_async_save."""
        self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        return self.queue.get_num_unfinalized_calls() == 0

    def _poll(self, pending: PendingSave) -> None:
        if self._written():
            pending.done, pending.error = True, self._write_error(pending)
            return
        worker = self.worker
        if worker is None or not worker.is_alive():
            if self._written():  # it finished just before it died
                pending.done, pending.error = True, self._write_error(pending)
                return
            if worker is None:
                pending.done = True
                pending.error = CheckpointWorkerDied(f"the checkpoint worker of rank {checkpointing._rank()} "
                                                     f"was not started")
            else:
                self._fail_dead_worker(pending, worker)

    @staticmethod
    def _write_error(pending: PendingSave) -> Optional[BaseException]:
        """The failure the worker reported for this write, or None. The result stays in the queue for
        the back end's finalization, which reads it."""
        results = pending.results_queue
        if results is None:
            return None
        try:
            item = results.get_nowait()
        except queue.Empty:
            return RuntimeError("the checkpoint worker reported no write results")
        results.put(item)
        if isinstance(item, BaseException):
            return item
        buckets = pending.request.async_fn_args[1]  # None where the worker stages them (preload_fn)
        expected = len(buckets) if buckets is not None else len(item)  # one result list per file written
        if len(item) != expected:
            return RuntimeError(f"the checkpoint worker wrote {len(item)} of {expected} files")
        return None

    def discard(self) -> None:
        """Forget the pending save after it failed: empty the write-results queue (the next save
        reads it) and replace a dead worker. Its write must be over (:meth:`check`)."""
        pending, self.pending = self.pending, None
        if pending is not None and pending.results_queue is not None:
            with contextlib.suppress(queue.Empty):
                while True:
                    pending.results_queue.get_nowait()
        worker = self.worker
        if worker is not None and not worker.is_alive():
            self._forget_dead_worker()
            self._start_worker()
            logger.warning("rank %d started a new checkpoint worker", checkpointing._rank())

    def _forget_dead_worker(self) -> None:
        caller = self.queue.persistent_caller
        # Its close() (also run by __del__) would wait forever for the dead worker to drain the queue,
        # and at exit the queue's feeder thread would wait to flush into a pipe nobody reads.
        caller.process = None
        for name in ("queue", "preload_q", "comp_q"):
            channel = getattr(caller, name, None)
            if channel is not None:
                channel.cancel_join_thread()
        self.queue = None

    def stop_processes(self) -> None:
        """Kill the worker and the write-results Manager now, without waiting for them to end
        (:meth:`close` waits). The loop calls it when it has decided to exit, once the save in flight
        is finalized: the exit save is synchronous and needs neither, and the kernel's teardown of
        the worker (its CUDA context and, after a background save, gigabytes of pinned host memory:
        about a second on an H100 host) then overlaps that save instead of following it."""
        self.wait_until_started()
        worker = self.worker
        # Both killed before either is waited for: each exit (a CUDA context, a forked copy of the
        # rank's address space) takes the kernel a while, and they overlap.
        if worker is not None and worker.is_alive():
            worker.kill()
        if self._results_manager is not None and self._results_manager[1]._process.is_alive():
            # Idle as the worker: killed rather than asked, which costs up to a second (its server
            # polls for the stop request once a second).
            self._results_manager[1]._process.kill()

    def close(self, abandon: bool = False) -> None:
        """Stop the worker and the write-results Manager. After the loop's exit every save is
        finalized and the worker idle: nothing it holds needs an orderly shutdown, and SIGKILL ends
        it (its own shutdown takes a second of interpreter teardown, at every requeue). ``abandon``: the rank
        is failing with a save perhaps in flight; its ``.tmp`` folder is removed by the next save."""
        if self.pending is not None and not abandon:
            logger.warning("rank %d stops its checkpoint worker with the save of iteration %d unfinished",
                           checkpointing._rank(), self.pending.save.iteration)
        self.stop_processes()
        worker = self.worker
        if worker is not None:
            worker.join(timeout=10)
            self._forget_dead_worker()
        self.queue = None
        self.pending = None
        if self._results_manager is not None:
            module, manager = self._results_manager
            module._results_queue = None  # an in-process restart starts a new one
            manager.shutdown()
            self._results_manager = None


# ---------------------------------------------------------------------------------------------
# The write request, per back end
# ---------------------------------------------------------------------------------------------


class _PlanCache:
    """The save plan of the previous save, reused while the state has the same structure (keys,
    shapes, dtypes): planning then needs no communication (megatron's
    ``ckpt_assume_constant_structure``, made safe by checking the structure every time)."""

    def __init__(self):
        self.structure: Optional[Tuple] = None
        self.value: Any = None

    def get(self, structure: Tuple, make: Callable[[], Any]) -> Any:
        if structure != self.structure:
            if self.structure is not None:
                logger.info("checkpoint structure changed: planning the save anew")
            self.structure, self.value = structure, make()
        return self.value


def _structure(tree: Any, path: str = "") -> Iterator[Tuple]:
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from _structure(tree[key], f"{path}/{key}")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _structure(value, f"{path}/{index}")
    elif isinstance(tree, torch.Tensor):
        yield path, tuple(tree.shape), str(tree.dtype)
    else:
        yield path, type(tree).__name__


def _snapshot(tree: Any) -> Any:
    """``tree`` with every tensor cloned: the worker writes what the tensors held at the save's
    iteration while the next steps change them in place."""
    if isinstance(tree, dict):
        return {key: _snapshot(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_snapshot(value) for value in tree]
    if isinstance(tree, tuple):
        return tuple(_snapshot(value) for value in tree)
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    return tree


def _dcp_request(writer: AsyncCheckpointWriter, model, optimizer, tmp: str, save_optim: bool,
                 writers: int) -> Tuple[Any, Callable[[], None], Any]:
    """CPU (torch DDP, torch optimizer): the same DCP files as ``dcp.save``, written by
    nvidia-resiliency-ext's async writer, one file per rank (``writers``, the torch_dist files per rank
    on GPU, does not apply). Returns (request, finalize, write-results queue)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
        CheckpointMetadataCache,
        save_state_dict_async_plan,
    )
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model[0], optimizer.optimizer)
    state = {"model": checkpointing._adapters_only(checkpointing._without_empty_extra_state(model_sd))}
    if save_optim:
        state["optimizer"] = optim_sd
    state = _snapshot(state)
    cache = writer.plans.get(tuple(_structure(state)), CheckpointMetadataCache)
    storage, metadata, dist_wrapper = save_state_dict_async_plan(
        state, FileSystemWriterAsync(tmp, thread_count=1), None, 0, planner=DefaultSavePlanner(),
        enable_cache=True, metadata_cache=cache)
    save_fn, _, save_args = storage.get_save_function_and_args()
    # No preload function: the tensors are host copies already (nvidia-resiliency-ext's would
    # synchronize CUDA).
    request = writer.request_class(save_fn, tuple(save_args), [])

    def finalize() -> None:  # collective: gather every rank's write results, rank 0 writes .metadata
        results = dist_wrapper.gather_object(storage.retrieve_write_results())
        if dist_wrapper.is_coordinator:
            storage.finish(metadata, results)

    return request, finalize, save_args[2] if save_fn is not None else None


def _megatron_request(writer: AsyncCheckpointWriter, model, optimizer, tmp: str, save_optim: bool,
                      writers: int, fully_reshardable: bool = False) -> Tuple[Any, Callable[[], None], Any]:
    """GPU (megatron-core DDP and optimizer): ``dist_checkpointing.save(..., async_sharded_save=True)``
    with the torch_dist strategy, kept across saves for its cached plan and metadata."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    sharded = checkpointing.megatron_sharded_state(model, optimizer, save_optim, fully_reshardable)
    structure = tuple(
        (v.key, tuple(v.global_shape), tuple(v.global_offset), str(v.dtype)) if isinstance(v, ShardedTensor)
        else (v.key, type(v).__name__) if isinstance(v, ShardedBase) else (type(v).__name__,)
        for v in nested_values(sharded))
    strategy = writer.plans.get(structure, lambda: TorchDistSaveShardedStrategy(
        "torch_dist", 1, thread_count=writers, cached_metadata=True))
    # Through nvidia-resiliency-ext's writer where megatron-core offers the choice (the module of
    # _writer_module), spelled out rather than left to megatron-core's default.
    through = {"async_strategy": "nvrx"} if checkpointing.megatron_save_takes_async_strategy() else {}
    megatron_request = dist_checkpointing.save(sharded, tmp, sharded_strategy=strategy, async_sharded_save=True,
                                               **through)
    fields = megatron_request._asdict()
    request = writer.request_class(fields["async_fn"], tuple(fields["async_fn_args"]), [],
                                   fields["async_fn_kwargs"], preload_fn=fields["preload_fn"])
    finalize_fns = list(megatron_request.finalize_fns)

    def finalize() -> None:
        # megatron-core's own: gather the write results, write .metadata and metadata.json (collective).
        for fn in finalize_fns:
            fn()

    return request, finalize, request.async_fn_args[2] if request.async_fn is not None else None


# ---------------------------------------------------------------------------------------------
# Start and finalize (collective)
# ---------------------------------------------------------------------------------------------


def start_async_save(state: GlobalState, model, optimizer, scheduler, writer: AsyncCheckpointWriter,
                     train_data_iterator=None) -> None:
    """Start a save of the current iteration; its write goes on in the background. Collective; the
    previous save must be finalized. A failure of this part raises :class:`CheckpointSaveError` on
    every rank, as a synchronous save does."""
    assert writer.pending is None, "finalize the save in flight first"
    began = time.perf_counter()
    writer.wait_until_started()
    save = checkpointing.begin_save(state, scheduler)
    ckpt = state.cfg.checkpoint
    build = (functools.partial(_megatron_request, fully_reshardable=ckpt.dist_ckpt_optim_fully_reshardable)
             if checkpointing._uses_megatron_dist(model) else _dcp_request)
    parts: Dict[str, Any] = {}

    def prepare() -> None:
        parts["request"], parts["finalize"], parts["results"] = build(
            writer, model, optimizer, save.tmp, ckpt.save_optim, ckpt.storage_writers_per_rank)  # collective planning
        checkpointing.write_rank_state(save, state, train_data_iterator)

    checkpointing._save_phase(prepare, save.iteration, save.tmp)
    pending = PendingSave(save=save, request=parts["request"], finalize=parts["finalize"],
                          results_queue=parts["results"])

    def submit() -> None:
        writer.submit(pending)

    try:
        checkpointing._save_phase(submit, save.iteration, save.tmp)
    except CheckpointSaveError:
        if writer.pending is not None:  # submitted here, failed elsewhere: let the write end, drop it
            writer.check(blocking=True)
            writer.discard()
        raise
    pending.blocking_s = time.perf_counter() - began
    if state.rank == 0:
        print(f"started asynchronous checkpoint save of iteration {save.iteration} "
              f"({pending.blocking_s:.2f}s blocking)", flush=True)


def _agree(done: bool, failed: bool) -> Tuple[bool, bool]:
    """(every rank's write is over, some rank's failed): one all-reduce."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return done, failed
    flags = torch.tensor([0 if done else 1, 1 if failed else 0], dtype=torch.int32, device=comm_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags[0].item() == 0, flags[1].item() == 1


def finalize_async_save(writer: AsyncCheckpointWriter, blocking: bool) -> Optional[FinishedSave]:
    """Finalize the save in flight if every rank's write is over; ``blocking``: wait until it is.
    Collective (all ranks call it at the same step). Returns the finished save, or None when none is
    in flight or it is still being written; raises :class:`CheckpointSaveError` on every rank if it
    failed anywhere (the tracker still names the previous checkpoint)."""
    pending = writer.pending
    if pending is None:
        return None
    began = time.perf_counter()
    done, failed = _agree(writer.check(blocking), pending.error is not None)
    if not done:
        return None
    save = pending.save
    if failed:
        try:
            checkpointing._save_phase(_raiser(pending.error), save.iteration, save.tmp)
        finally:
            writer.discard()
    try:
        # After the error exchange above no rank raises before the back end's collectives (its write
        # results are known good everywhere); a failure inside them (e.g. .metadata on a full disk)
        # is agreed on here as in a synchronous save.
        checkpointing._save_phase(pending.finalize, save.iteration, save.tmp)
    except CheckpointSaveError:
        writer.discard()
        raise
    writer.pending = None
    folder = checkpointing.commit_save(save)
    now = time.perf_counter()
    return FinishedSave(iteration=save.iteration, folder=folder, common=save.common,
                        blocking_s=pending.blocking_s + (now - began), total_s=now - save.started)


def _raiser(error: Optional[BaseException]) -> Optional[Callable[[], None]]:
    if error is None:
        return None

    def fail() -> None:
        raise error

    return fail


def in_flight_iteration(writer: Optional[AsyncCheckpointWriter]) -> Optional[int]:
    """The iteration of the save being written in the background, or None."""
    return writer.pending.save.iteration if writer is not None and writer.pending is not None else None

