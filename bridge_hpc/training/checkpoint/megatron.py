"""The model and optimizer back ends of a checkpoint, and every adapter to megatron-core's internals.

On CUDA the model and optimizer go through megatron-core's ``dist_checkpointing`` (its sharded state
dicts, its save and load strategies); without CUDA through ``torch.distributed.checkpoint``. Where this
toolkit reaches into megatron-core (the in-process write results instead of a spawned Manager, the
synchronous save's write done by :mod:`~bridge_hpc.training.checkpoint.streamed_write`, the parallel
reader, the empty distributed-optimizer state, the kept Adam step) it does so here, in one
file, written against megatron-core 0.16-0.19 (the versions the tests run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import inspect
import json
import logging
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.futures import Future

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.peft.utils import is_adapter_key
from bridge_hpc.training.checkpoint.layout import RUN_CONFIG_FILE, _rank, _space_error

logger = logging.getLogger(__name__)
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


def _adapters_only(model_sd: Dict[str, Any]) -> Dict[str, Any]:
    """What a checkpoint holds of a model's state: all of it, or for a model with PEFT adapters
    (:mod:`bridge_hpc.peft`) the adapters only; the frozen base is read from
    ``checkpoint.pretrained_checkpoint`` at every start."""
    if not any(is_adapter_key(key) for key in model_sd):
        return model_sd
    return {key: value for key, value in model_sd.items() if is_adapter_key(key)}


def _load_model_state(chunk, model_sd: Dict[str, Any], may_miss=()) -> None:
    """Load ``model_sd`` into ``chunk``: every key; for a model with adapters its adapter keys only (the
    base stays as read from the pretrained checkpoint), each adapter key present. ``may_miss``: keys
    the checkpoint does not hold and the layers keep as built (:func:`_extra_state_absent_from`)."""
    everything = chunk.state_dict()
    wanted = _adapters_only(everything)
    if len(wanted) == len(everything):
        if not may_miss:
            chunk.load_state_dict(model_sd, strict=True)
            return
        result = chunk.load_state_dict(model_sd, strict=False)
        missing = [key for key in result.missing_keys if key not in may_miss]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"model state mismatch: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
        return
    result = chunk.load_state_dict(model_sd, strict=False)
    missing = [key for key in result.missing_keys if key in wanted and wanted[key] is not None]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"adapter state mismatch: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")


def _extra_state_absent_from(sharded: Dict[str, Any], path: str) -> List[str]:
    """Take out of a model's sharded state dict (in place) the layers' ``_extra_state`` entries that the
    checkpoint at ``path`` does not hold, and return their names.

    Transformer Engine's layers keep per-layer state there (FP8 scales and amax history); megatron-core's
    local layers keep none for their attention. A checkpoint saved by one layer implementation thus
    lacks entries the other asks for, and loading it at the other (a cluster with TE and one without)
    would fail on them: those layers keep their state as built instead (fresh FP8 scaling), and the
    weights, which both name alike, load as saved."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    present = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    absent: List[str] = []
    for chunk in sharded.values():
        for name, value in list(chunk.items()):
            if (isinstance(value, ShardedObject) and name.endswith("_extra_state") and value.unique_key not in present
                    and not any(k.startswith(value.key + "/") for k in present)):
                del chunk[name]
                absent.append(name)
    return absent


def _expert_names(state: Dict[str, Any], model, to_global: bool) -> Dict[str, Any]:
    """A CPU rank's model or optimizer state dict with its experts named by their global index
    (``to_global``) or by this rank's local one again (:func:`bridge_hpc.training.engine.moe.global_expert_name`):
    with expert parallelism each rank holds other experts under the same local names, which DCP would
    take for one replicated tensor. The optimizer's form (``state`` and ``param_groups`` of names) too."""
    from bridge_hpc.training.engine.moe import global_expert_name

    experts = getattr(getattr(_unwrap(model[0]), "config", None), "num_moe_experts", None)
    if experts is None:
        return state

    def rename(key: str) -> str:
        return global_expert_name(key, to_global, experts)

    if "param_groups" in state and "state" in state:
        groups = [dict(group, params=[rename(key) for key in group["params"]]) for group in state["param_groups"]]
        return {"state": {rename(key): value for key, value in state["state"].items()}, "param_groups": groups}
    return {rename(key): value for key, value in state.items()}


def _dcp_writer(path: str):
    """DCP's file writer, with a full disk reported as an OSError naming the file. DCP gathers a
    rank's write error to every rank by pickling it, which drops the chained OSError that torch's zip
    writer raises its "unexpected pos" RuntimeError from; an OSError's errno and filename survive."""
    import torch.distributed.checkpoint as dcp

    class _Writer(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except Exception as exc:
                raise _naming_file(exc, _newest(glob.glob(os.path.join(path, f"__{_rank()}_*.distcp"))) or path) from exc

        def finish(self, metadata, results):
            try:
                return super().finish(metadata, results)
            except Exception as exc:
                raise _naming_file(exc, os.path.join(path, ".metadata")) from exc

    return _Writer(path, sync_files=True)


def _newest(paths: List[str]) -> Optional[str]:
    existing = [p for p in paths if os.path.exists(p)]
    return max(existing, key=os.path.getmtime) if existing else None


def _naming_file(exc: BaseException, path: str) -> BaseException:
    space = _space_error(exc)
    if space is None:
        return exc
    return OSError(space.errno, os.strerror(space.errno), space.filename or path)


#: Threads that read a checkpoint being loaded (each its share of the items, balanced by bytes):
#: one reader alternates reading, unpickling and copying into the model, leaving the disk idle.
LOAD_READ_THREADS = 4


@contextlib.contextmanager
def _in_process_write_results() -> Iterator[None]:
    """A synchronous megatron-core save collects its write results in-process.

    megatron-core's ``FileSystemWriterAsync`` gathers the results of its write processes in a queue
    of a ``multiprocessing`` Manager started with *spawn* at the first save of the process (its
    ``_get_write_results_queue``): the child re-imports torch and megatron, 8.6-21 s on an H100
    host, all of it inside the first save. A synchronous save runs the write in this process, where
    a plain queue does. Where an asynchronous writer started its Manager queue already (at start-up,
    :mod:`bridge_hpc.training.checkpoint.async_writer`), that one is used; versions without the module
    global are left alone."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        yield
        return
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None


def _parallel_reader(base: type) -> type:
    """``base`` (a DCP ``FileSystemReader``) reading the items of a load in :data:`LOAD_READ_THREADS`
    threads. Each thread runs ``base.read_data`` on its share of the plan (items balanced by bytes,
    in file order), so the reading itself stays torch's. File reads and the copies into the model
    release the GIL; ``torch.load``'s zip parsing and weights-only unpickling of each item do not
    (about 1.4 ms an item in all, 1172 items for the 370 M GPT on an H100 host, 2026-11-27), so 8 or
    16 threads loaded no faster than 4."""

    class _ParallelReader(base):
        def read_data(self, plan, planner):
            items = list(plan.items)
            count = min(LOAD_READ_THREADS, len(items))
            if count <= 1:
                return super().read_data(plan, planner)
            info = self.storage_data
            groups: List[list] = [[] for _ in range(count)]
            sizes = [0] * count
            for item in sorted(items, key=lambda i: -info[i.storage_index].length):
                k = sizes.index(min(sizes))
                groups[k].append(item)
                sizes[k] += info[item.storage_index].length
            read = super().read_data
            with ThreadPoolExecutor(count, thread_name_prefix="ckpt-read") as pool:
                futures = [pool.submit(read, dataclasses.replace(plan, items=sorted(
                    group, key=lambda i: (info[i.storage_index].relative_path, info[i.storage_index].offset))),
                    planner) for group in groups]
                for future in futures:
                    future.result().wait()  # raises the first failed read's error here
            done: Future = Future()
            done.set_result(None)
            return done

    _ParallelReader.__name__ = _ParallelReader.__qualname__ = f"Parallel{base.__name__}"
    return _ParallelReader


def _megatron_load_strategy():
    """megatron-core's torch_dist load, its file reads in :data:`LOAD_READ_THREADS` threads, and
    with several data-parallel ranks fully parallel (``FullyParallelLoadStrategyWrapper``: each rank
    reads a share of the replicated tensors and they exchange them, instead of every rank reading
    everything)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    class _ParallelReadsLoad(mcore_torch.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
            # The strategy builds its reader inside load() through this module function (0.16-0.19);
            # it is swapped for the call only. Without it, torch's one-thread reader is used.
            # (0.19 adds arguments, e.g. async_strategy: passed on as given.)
            make_reader = getattr(mcore_torch, "_get_filesystem_reader", None)
            if make_reader is None:
                return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

            def parallel(checkpoint_dir, *args, **kwargs):
                reader = make_reader(checkpoint_dir, *args, **kwargs)
                reader.__class__ = _parallel_reader(type(reader))
                return reader

            mcore_torch._get_filesystem_reader = parallel
            try:
                return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            finally:
                mcore_torch._get_filesystem_reader = make_reader

    strategy = _ParallelReadsLoad()
    if parallel_state.get_data_parallel_world_size() > 1:
        strategy = FullyParallelLoadStrategyWrapper(strategy, parallel_state.get_data_parallel_group())
    return strategy


#: How megatron-core's distributed optimizer lays out its state in a checkpoint, by
#: ``checkpoint.dist_ckpt_optim_fully_reshardable``. Off: each rank's buffers as they are (parallel
#: save and load without gathers; reshardable across data parallelism only), as Megatron-LM does by
#: default. On: ``fully_reshardable``, loadable at any tensor/pipeline/data-parallel layout.
#: megatron-core's own default, ``fully_sharded_model_space``, is deprecated and fails to save in
#: 0.19 (``ShardedTensor.flattened_range is not supported``).
DISTRIB_OPTIM_SHARDING_TYPES = {False: "dp_reshardable", True: "fully_reshardable"}


def _is_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_sharded_state_dict(optimizer, model_sharded_state_dict, is_loading: bool = False,
                                 fully_reshardable: bool = False):
    """The megatron-core optimizer's sharded state dict, in the layout of
    :data:`DISTRIB_OPTIM_SHARDING_TYPES` where it is the distributed optimizer (the others are keyed
    by parameter and load at any layout)."""
    if _is_distributed_optimizer(optimizer):
        sharding = DISTRIB_OPTIM_SHARDING_TYPES[bool(fully_reshardable)]
        return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                            metadata={"distrib_optim_sharding_type": sharding})
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading)


def _init_empty_distributed_optimizer_state(optimizer) -> list:
    """Give a fresh distributed optimizer's inner torch Adam placeholder state while the state dict
    to load into is built: megatron-core's ``DistributedOptimizer.state_dict`` reads every parameter's
    ``step`` without Apex or Transformer Engine and asserts they agree, and a fresh optimizer has
    none. Zeros, as torch's Adam makes them at its first step. Returns the state dicts it filled,
    which the caller empties again before ``load_state_dict``: megatron allocates an empty
    optimizer's state there itself (and does not expect it filled).

    Only torch's own Adam gets them. Where Transformer Engine is installed megatron-core's Adam is
    TE's ``FusedAdam``, which keeps ``step`` in the parameter groups and whose ``state_dict`` takes
    every state key for one of its moments (a placeholder ``step`` there failed every resume of a
    distributed optimizer with ``KeyError: 'step'``, on either layer implementation: one H200,
    2026-12-03); it needs none."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    filled = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if (not isinstance(inner, DistributedOptimizer) or not isinstance(inner.optimizer, torch.optim.Adam)
                or len(inner.optimizer.state) > 0):
            continue
        torch_opt = inner.optimizer
        filled.append(torch_opt.state)
        for group in torch_opt.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = torch_opt.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return filled


@contextlib.contextmanager
def _torch_adam_step_kept(optimizer) -> Iterator[None]:
    """While a distributed optimizer loads its parameter state: megatron-core's
    ``_set_main_param_and_optimizer_states`` copies into every tensor of a parameter's torch Adam
    state, ``step`` included, from the loaded tensors. Those hold no real ``step``: it comes from the
    parameter groups, set just before. In the ``dp_reshardable`` layout the loaded ``step`` is a
    ``LocalNonpersistentObject``, i.e. whatever the state held when the sharded state dict was built
    (the placeholder zero of :func:`_init_empty_distributed_optimizer_state`), and elsewhere it is
    missing (KeyError 'step' without Apex/TE). Either way ``step`` is taken from the current state,
    copied onto itself, so it keeps the groups' value. (Seen on a GPU: a resumed LoRA run's Adam
    counted from step 1 again, so its updates differed from the uninterrupted run's from the first.)
    Transformer Engine's ``FusedAdam`` keeps ``step`` in its parameter groups: it is left to megatron."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = [inner for inner in getattr(optimizer, "chained_optimizers", [optimizer])
               if isinstance(inner, DistributedOptimizer) and isinstance(inner.optimizer, torch.optim.Adam)
               and not inner.config.use_precision_aware_optimizer]
    for inner in patched:
        def set_states(model_param, tensors, __inner=inner, __set=inner._set_main_param_and_optimizer_states):
            group_index, group_order = __inner.model_param_group_index_map[model_param]
            main_param = __inner.optimizer.param_groups[group_index]["params"][group_order]
            current = __inner.optimizer.state[main_param]
            kept = {k: v for k, v in current.items() if isinstance(v, torch.Tensor)}
            return __set(model_param, {**kept, **{k: v for k, v in tensors.items() if k != "step"}})

        inner._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states  # the class's method again


def model_sharded_state_dict(model) -> dict:
    """The model's sharded state dict: ``{"model": ...}``, or with virtual pipeline stages
    ``{"model0": ..., "model1": ...}``, one per chunk (Megatron-LM's keys). Tensor keys are global
    (layer numbers counted over the whole model), so the state loads at another layout. With PEFT
    adapters, the adapters' entries only (:func:`_adapters_only`)."""
    if len(model) == 1:
        return {"model": _adapters_only(_unwrap(model[0]).sharded_state_dict())}
    return {f"model{i}": _adapters_only(_unwrap(chunk).sharded_state_dict()) for i, chunk in enumerate(model)}


def megatron_sharded_state(model, optimizer, save_optim: bool, fully_reshardable: bool = False) -> dict:
    """What a megatron-core (GPU) save writes: the model's sharded state dict, and the optimizer's."""
    sharded = model_sharded_state_dict(model)
    if save_optim:
        sharded["optimizer"] = optimizer_sharded_state_dict(optimizer, dict(sharded),
                                                            fully_reshardable=fully_reshardable)
    return sharded


def megatron_save_tensors(model, optimizer, save_optim: bool, fully_reshardable: bool = False) -> List[torch.Tensor]:
    """Every GPU tensor a megatron-core save writes, i.e. copies to host memory first."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sharded = megatron_sharded_state(model, optimizer, save_optim, fully_reshardable)
    return [v.data.detach() for v in nested_values(sharded)
            if isinstance(v, ShardedTensor) and isinstance(v.data, torch.Tensor) and v.data.is_cuda]


def megatron_save_takes_async_strategy() -> bool:
    """megatron-core >= 0.19: ``dist_checkpointing.save`` takes ``async_strategy`` and, by default
    ("nvrx"), writes an async save through nvidia-resiliency-ext's writer; older versions always
    through their own."""
    from megatron.core import dist_checkpointing

    return "async_strategy" in inspect.signature(dist_checkpointing.save).parameters


#: megatron-core's write functions (``FileSystemWriterAsync``, 0.16-0.19) whose requests
#: :func:`_execute_streamed` knows how to run itself: called with ``(rank, write_buckets,
#: results_queue)`` after the ``functools.partial`` arguments ``(transform_list, use_msc)``.
_MEGATRON_WRITE_FUNCTIONS = ("write_preloaded_data_multithread", "write_preloaded_data_multiproc")


def _execute_streamed(request) -> None:
    """Run megatron-core's synchronous save request as its ``execute_sync`` does (write, barrier,
    finalize: ``.metadata`` and ``metadata.json``), with the write done by
    :func:`streamed_write.write_buckets` instead of its staging to pinned host memory and its own
    writer (see that module for why). A request of another shape (another writer, a
    multi-storage-client path) is run by ``execute_sync`` itself."""
    fn, args = request.async_fn, list(request.async_fn_args)
    known = (isinstance(fn, functools.partial) and getattr(fn.func, "__name__", "") in _MEGATRON_WRITE_FUNCTIONS
             and len(fn.args) == 2 and not fn.args[1] and not fn.keywords and not request.async_fn_kwargs
             and request.preload_fn is not None and len(args) == 3 and isinstance(args[1], list))
    if not known:
        request.execute_sync()
        return
    from torch.distributed.checkpoint.filesystem import _write_item

    from bridge_hpc.training.checkpoint import streamed_write

    transform_list = list(fn.args[0])
    extra = {}
    if "serialization_format" in inspect.signature(_write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        extra["serialization_format"] = SerializationFormat.TORCH_SAVE

    def write_one(stream, data, item, storage_key):  # as megatron-core's writer calls it
        return _write_item(*transform_list, stream, data, item, storage_key, **extra)

    torch.cuda.synchronize()  # the copies run on streams of their own: the steps' kernels are done
    # The outcome goes where megatron-core's writer puts it; its finalization reads it, gathers every
    # rank's and raises on all ranks if any failed (a CheckpointException naming the rank).
    args[2].put(streamed_write.write_buckets(args[1], write_one))
    torch.distributed.barrier()
    for finalize in request.finalize_fns:
        finalize()


@dataclasses.dataclass(frozen=True)
class SavedParallelism:
    """How a checkpoint was laid out, from its ``run_config.json``: the model-parallel sizes
    (:func:`bridge_hpc.training.engine.parallel.model_parallel_sizes`'s keys) and whether the distributed
    optimizer's state was saved ``fully_reshardable``."""

    sizes: Dict[str, int]
    fully_reshardable: bool


def saved_parallelism(path: str) -> Optional[SavedParallelism]:
    """:class:`SavedParallelism` of the checkpoint at ``path``; None where its config cannot be read."""
    try:
        with open(os.path.join(path, RUN_CONFIG_FILE)) as f:
            saved = json.load(f)
        m, c = saved.get("model", {}), saved.get("checkpoint", {})
    except (OSError, ValueError, AttributeError):
        return None
    return SavedParallelism(
        sizes={"tp": m.get("tensor_model_parallel_size", 1), "pp": m.get("pipeline_model_parallel_size", 1),
               "cp": m.get("context_parallel_size", 1)},
        fully_reshardable=bool(c.get("dist_ckpt_optim_fully_reshardable", False)))


def check_optimizer_layout(path: str, saved: Optional[SavedParallelism], now: Dict[str, int], optimizer,
                           load_optim: bool) -> None:
    """Raises ConfigError, before anything is loaded, where the distributed optimizer's state in the
    checkpoint at ``path`` cannot load at this run's model-parallel sizes ``now``: saved per rank
    (``dp_reshardable``) at other tensor/pipeline/context-parallel sizes."""
    if (load_optim and saved is not None and not saved.fully_reshardable and saved.sizes != now
            and _is_distributed_optimizer(optimizer)):
        raise ConfigError(
            f"{path} holds the distributed optimizer's state per rank (dp_reshardable), saved at tensor/pipeline/"
            f"context-parallel sizes {saved.sizes['tp']}/{saved.sizes['pp']}/{saved.sizes['cp']}; this run is "
            f"{now['tp']}/{now['pp']}/{now['cp']}. Resume at the saved sizes, load the weights only "
            "(checkpoint.load_optim = false), or save with checkpoint.dist_ckpt_optim_fully_reshardable = true",
            key="checkpoint.load_optim")


def _save_model_and_optimizer(model, optimizer, path: str, save_optim: bool, writers: int,
                              fully_reshardable: bool = False) -> None:
    if _uses_megatron_dist(model):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        sharded = megatron_sharded_state(model, optimizer, save_optim, fully_reshardable)
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=writers)
        # Planned as megatron-core plans its own synchronous save (its torch_dist strategy, its own
        # writer: "mcore"), and written by streamed_write instead of that writer's staging and threads.
        own_writer = {"async_strategy": "mcore"} if megatron_save_takes_async_strategy() else {}
        with _in_process_write_results():
            request = dist_checkpointing.save(sharded, path, sharded_strategy=strategy, async_sharded_save=True,
                                              **own_writer)
            _execute_streamed(request)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model[0], optimizer.optimizer)
    state = {"model": _expert_names(_adapters_only(_without_empty_extra_state(model_sd)), model, to_global=True)}
    if save_optim:
        state["optimizer"] = _expert_names(optim_sd, model, to_global=True)
    dcp.save(state, storage_writer=_dcp_writer(path))


def _load_model_and_optimizer(model, optimizer, path: str, load_optim: bool, fully_reshardable: bool = False) -> None:
    if _uses_megatron_dist(model):
        from megatron.core import dist_checkpointing

        sharded = model_sharded_state_dict(model)
        absent = _extra_state_absent_from(sharded, path)
        if absent and _rank() == 0:
            logger.warning("%s holds no per-layer state for %d layer modules (saved with the other layer "
                           "implementation, local or Transformer Engine's): their weights load as saved, their "
                           "FP8 scaling state starts fresh", path, len(absent))
        if load_optim:
            placeholders = _init_empty_distributed_optimizer_state(optimizer)
            sharded["optimizer"] = optimizer_sharded_state_dict(optimizer, dict(sharded), is_loading=True,
                                                                fully_reshardable=fully_reshardable)
            for state in placeholders:  # megatron's load_state_dict allocates the state of an empty optimizer
                state.clear()
        loaded = dist_checkpointing.load(sharded, path, sharded_strategy=_megatron_load_strategy())
        if len(model) == 1:
            _load_model_state(_unwrap(model[0]), loaded["model"], set(absent))
        else:
            for i, chunk in enumerate(model):
                _load_model_state(_unwrap(chunk), loaded[f"model{i}"], set(absent))
        if load_optim:
            with _torch_adam_step_kept(optimizer):
                optimizer.load_state_dict(loaded["optimizer"])
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

    if load_optim:
        model_sd, optim_sd = get_state_dict(model[0], optimizer.optimizer)
    else:
        # Not get_state_dict: it initializes an empty optimizer state by running a step with zero
        # gradients, after which Adam's first real update of a fresh optimizer is scaled as its second.
        model_sd, optim_sd = get_model_state_dict(model[0]), None
    state = {"model": _expert_names(_adapters_only(_without_empty_extra_state(model_sd)), model, to_global=True)}
    if load_optim:
        state["optimizer"] = _expert_names(optim_sd, model, to_global=True)
    dcp.load(state, storage_reader=_parallel_reader(dcp.FileSystemReader)(path))
    state = {part: _expert_names(value, model, to_global=False) for part, value in state.items()}
    state["model"].update({key: None for key, value in _adapters_only(model_sd).items() if value is None})
    _load_model_state(_unwrap(model[0]), state["model"])
    if load_optim:
        set_state_dict(model[0], optimizer.optimizer, model_state_dict={}, optim_state_dict=state["optimizer"])
