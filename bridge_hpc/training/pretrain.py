"""``pretrain(config, forward_step_func)``: Megatron Bridge's entry point on megatron-core.

Setup reads in order: distributed init, config validation, model-parallel state, seeds, model,
optimizer, scheduler, checkpoint load, data, then the loop. Where CPU and GPU differ (DDP wrapper,
optimizer), a small ``_build_*`` function picks: torch DDP over gloo and a torch optimizer without
CUDA; megatron-core DDP and ``get_megatron_optimizer`` with it.
"""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import logging
import os
import random
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.config import set_experimental_flag
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.progress_log import ProgressLog, longest_recent_save_s
from bridge_hpc.peft.base import apply_peft
from bridge_hpc.slurm.job_environment import JobEnvironment
from bridge_hpc.training.checkpoint import async_writer as async_checkpoint
from bridge_hpc.training.checkpoint import auto_interval, checkpointing, pretrained
from bridge_hpc.training.config import (
    ConfigContainer,
    DistributedDataParallelConfig,
    DistributedInitConfig,
    runtime_config_update,
)
from bridge_hpc.training.datasets.builders import SampleIterator, build_data_iterator, build_datasets
from bridge_hpc.training.engine import collectives, cuda_graphs, fused_kernels, low_precision, parallel
from bridge_hpc.training.engine.grad_reduce_rider import GradReduceRider
from bridge_hpc.training.engine.metrics import RunStart
from bridge_hpc.training.engine.model import gpt_model_provider
from bridge_hpc.training.engine.optimizer import TorchOptimizer, setup_optimizer  # noqa: F401  (TorchOptimizer: old import path)
from bridge_hpc.training.engine.speed_defaults import settle_on_rank
from bridge_hpc.training.process import heap
from bridge_hpc.training.process.startup import StartupPhases
from bridge_hpc.training.resilience import rerun
from bridge_hpc.training.resilience.fault_tolerance import FaultTolerance
from bridge_hpc.training.resilience.straggler import StragglerDetector
from bridge_hpc.training.state import GlobalState, StopSignalRecorder
from bridge_hpc.training.tokenizers import build_tokenizer_for
from bridge_hpc.training.train import evaluate_and_print_results, train
from bridge_hpc.training.utils.train_utils import start_memory_history_recording

logger = logging.getLogger(__name__)


#: True in ``python -m bridge_hpc.rank``, which leaves through ``os._exit`` as soon as the entry point
#: returns (:func:`bridge_hpc.rank._leave`): there the process group pretrain brought up is left to the
#: process's end, since its orderly teardown (a barrier, then every communicator destroyed) would only
#: spend seconds of a preempted job's grace time. Python callers get Bridge's teardown.
PROCESS_ENDS_ON_RETURN = False


def pretrain(config: ConfigContainer, forward_step_func: Callable) -> None:
    """Train the GPT described by ``config`` with ``forward_step_func`` (any Bridge signature).

    The process group is Bridge's to own: one that is up when pretrain starts is the caller's and stays
    up; one that pretrain brings up itself (from the environment) it destroys before returning (a barrier,
    then ``destroy_process_group``) and aborts when the run fails (no barrier: a peer may be stuck in a
    collective), except under the in-process restart wrapper (``[inprocess_restart]``), which keeps the
    clean-up of a failed attempt: it aborts the process group and drops megatron-core's groups itself
    (:mod:`bridge_hpc.training.resilience.inprocess_restart`). See :data:`PROCESS_ENDS_ON_RETURN`.
    """
    setup_logging(config.logger.logging_level if config.logger.logging_level is not None else logging.INFO)
    state = GlobalState()
    state.cfg = config
    if config.inprocess_restart is not None and config.inprocess_restart.enabled:
        # Raises a ConfigError naming inprocess_restart.enabled where the installed
        # nvidia-resiliency-ext cannot do it (e.g. 0.4.1 on CPU: see inprocess_restart.py).
        from bridge_hpc.training.resilience.inprocess_restart import maybe_wrap_for_inprocess_restart

        wrapped, store = maybe_wrap_for_inprocess_restart(_pretrain, config.inprocess_restart)
        wrapped(state, forward_step_func, store=store)
        return
    _pretrain(state, forward_step_func)


def _pretrain(state: GlobalState, forward_step_func: Callable, store=None, inprocess_call_wrapper=None) -> None:
    """Megatron Bridge's signature: ``store`` and ``inprocess_call_wrapper`` come from the in-process
    restart wrapper (each attempt gets its own prefix of the coordination store)."""
    cfg = state.cfg
    # Bridge's rule: a process group that is not up yet is this run's to tear down (see pretrain).
    owns_process_group = not dist.is_initialized()
    if inprocess_call_wrapper is not None:
        # An in-process restart calls this again in the same process with the same ``state``: start
        # each attempt from a fresh one (the step, counters and loggers come back from the checkpoint).
        # The aborted attempt's process groups are gone already: the wrapper's abort destroyed them and
        # its finalize dropped megatron-core's (inprocess_restart.py).
        if inprocess_call_wrapper.iteration > 0:
            last_step_time = state.last_step_time
            state.__init__()
            state.cfg = cfg
            state.inprocess_restart = (inprocess_call_wrapper.iteration, last_step_time)
        if store is not None:
            store = dist.PrefixStore(str(inprocess_call_wrapper.iteration), store)
    state.restart_store = store
    # First of all: a preemption notice during setup must be recorded, not kill the process.
    if cfg.train.exit_signal_handler:
        state.signal_handler = StopSignalRecorder(cfg.train.exit_signal).__enter__()
    checkpointing_context: dict = {}
    failed = True
    try:
        # Out of the cycle collector's walks (bridge_hpc.training.process.heap): the imports now, what set-up
        # makes when the steps start.
        with heap.run_frozen():
            _setup_and_train(state, forward_step_func, checkpointing_context)
        failed = False
    except BaseException:
        _stop_async_writer(checkpointing_context, abandon=True)  # a save in flight is not waited for
        if state.progress is not None:
            last_saved = checkpointing_context.get("last_saved_step", 0)
            # Under ft_launcher a failure (a peer hung or died, or this rank failed) is followed by an
            # in-job restart, whose Restart line gives the cause and the lost time: record "fault".
            ft = state.fault_tolerance
            reason = "fault" if ft is not None and ft.active else "error"
            try:  # best effort: the failure may be a full disk, and it is the error worth reporting
                state.progress.ending_job(reason, state.train_state.step, state.train_state.step - last_saved)
            except OSError as err:
                logger.warning("could not record the failure in the progress log: %s", err)
        raise
    finally:
        try:
            _shut_down(state, checkpointing_context)
        finally:
            # Last: the checkpoint worker is stopped and the logs are closed by now (Bridge's order).
            if owns_process_group and not PROCESS_ENDS_ON_RETURN and not (failed and inprocess_call_wrapper is not None):
                _end_process_group(abort=failed)


def _end_process_group(abort: bool) -> None:
    """Bridge's ``_maybe_destroy_process_group`` for a process group this run brought up: after a normal
    end a barrier, then ``destroy_process_group``; after a failure an abort of every group, without a
    barrier or waiting for their outstanding work (a peer may be blocked in a collective), which must not
    hide the failure (logged, not raised). megatron-core's groups are dropped first, so that a later run in
    the process sets up its own."""
    if not dist.is_initialized():
        return
    parallel_state.destroy_model_parallel()
    if not abort:
        dist.barrier()
        dist.destroy_process_group()
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as err:  # noqa: BLE001 - the run's own failure is the one to report
        logger.warning("could not abort the process group after the failure: %s: %s", type(err).__name__, err)


def _shut_down(state: GlobalState, checkpointing_context: dict) -> None:
    """What a run does after its loop, each part timed: a preempted job pays it inside Slurm's grace
    time, after its exit save is durable, so rank 0 logs where it went."""
    save = state.cfg.checkpoint.save
    parts = (("checkpoint worker", lambda: _stop_async_writer(checkpointing_context, abandon=False)),
             ("result validation", rerun.destroy_rerun_state),
             ("logs", state.close),
             ("checkpoint folder lock", lambda: checkpointing.release_checkpoint_folder(save) if save else None))
    spent = []
    for name, part in parts:
        began = time.perf_counter()
        part()
        spent.append((name, time.perf_counter() - began))
    if state.rank == 0:
        logger.info("shut down in %.2fs (%s)", sum(s for _, s in spent),
                    ", ".join(f"{name} {s:.2f}s" for name, s in spent))


def _stop_async_writer(checkpointing_context: dict, abandon: bool) -> None:
    """Stop this rank's checkpoint worker (``checkpoint.async_save``): a live child process would keep
    the interpreter from exiting. After the loop's exit the save in flight is finalized already."""
    writer = checkpointing_context.pop(async_checkpoint.ASYNC_WRITER_KEY, None)
    if writer is not None:
        writer.close(abandon=abandon)


def _setup_and_train(state: GlobalState, forward_step_func: Callable, checkpointing_context: dict) -> None:
    cfg = state.cfg
    in_process, last_step_time = state.inprocess_restart or (0, None)
    # An in-process re-run's start-up counts from its own start, not from the process start.
    process_age_s = None if in_process else _process_age_s()
    startup = state.startup = StartupPhases(time.time() - (process_age_s or 0.0))
    startup.mark("launch and imports")
    if cfg.model.deterministic_mode:
        enable_deterministic_mode()  # before CUDA's and NCCL's set-up read their variables
    env = initialize_distributed(cfg.dist, store=state.restart_store)
    startup.mark("process group")
    state.rank, state.world_size = dist.get_rank(), dist.get_world_size()
    # The tokenizer sets the model's vocabulary size (when [model] leaves it to the tokenizer), so it is
    # built before the runtime update's validation (mock data copies model.vocab_size there) and before
    # the model. (A config built in Python gets its sections finalized first, as the tokenizer needs;
    # runtime_config_update does not finalize them twice.)
    cfg.finalize_sections()
    # The fast path's choices that only a rank can check (a CPU rank turns them back off and trains as
    # before); rank 0 logs what runs and what does not, and why (bridge_hpc.training.engine.speed_defaults).
    has_te = importlib.util.find_spec("transformer_engine") is not None
    fast_path = settle_on_rank(cfg, torch.cuda.is_available(), importlib.util.find_spec("triton") is not None,
                               state.world_size, has_te=has_te)
    if fast_path is not None:
        logger.info(fast_path)
    parallel.check_supported(cfg)
    state.tokenizer = build_tokenizer_for(cfg)
    runtime_config_update(cfg)
    low_precision.check_on_rank(cfg, torch.cuda.is_available(), has_te,
                                *((torch.cuda.get_device_capability(), torch.cuda.get_device_name())
                                  if torch.cuda.is_available() else ()))
    cuda_graphs.check_config(cfg, torch.cuda.is_available())  # before minutes of model building
    fused_kernels.check_config(cfg, torch.cuda.is_available())
    configure_other_loggers(cfg.logger)
    cfg.log_non_default_values()  # rank 0's log: how this run differs from the defaults
    if cfg.logger.save_config_filepath and state.rank == 0:
        save_config_file(cfg, cfg.logger.save_config_filepath)
    if cfg.checkpoint.save:
        # Before anything writes into the folder (FT state, progress log, checkpoints): a second job
        # training into the same folder fails here, on every rank, naming the job that holds it.
        checkpointing.lock_checkpoint_folder(cfg.checkpoint.save)
        if cfg.checkpoint.async_save:
            # Started now, so that its process start (seconds of imports) overlaps model building
            # and checkpoint loading instead of stalling the first save.
            checkpointing_context[async_checkpoint.ASYNC_WRITER_KEY] = async_checkpoint.AsyncCheckpointWriter(
                cfg.train.exit_signal, on_gpu=torch.cuda.is_available()).start()
    # Fault tolerance reports "setup" from here (before the model build and checkpoint load, which
    # its setup timeout must cover); straggler detection agrees on its node map (collective).
    ft = state.fault_tolerance = FaultTolerance(cfg.ft, checkpoint_dir=cfg.checkpoint.save)
    ft.setup()
    # The step brackets the gradient all-reduce; torch DDP (CPU) runs it inside backward, so a rank
    # waiting for a straggler would look as slow by the wall clock: time process CPU there instead.
    state.straggler_detector = StragglerDetector(cfg.nvrx_straggler,
                                                 clock="wall" if torch.cuda.is_available() else "process")
    state.straggler_detector.setup()
    started_at = startup.origin
    restart_count = env.restart_count + ft.restart_count + in_process
    # save_interval = "auto": chosen from the history before this run's own lines (collective)
    auto = checkpointing_context[auto_interval.CONTEXT_KEY] = auto_interval.start(cfg, state.rank)
    if cfg.logger.log_progress and cfg.checkpoint.save and state.rank == 0:
        path = run_folder.checkpoint_file(cfg.checkpoint.save, run_folder.PROGRESS_FILE)
        state.logged_save_s = longest_recent_save_s(path)
        state.progress = ProgressLog(path, env.job_id or "none", state.world_size)
        # A restart inside the allocation (ft_launcher's new workers, or the in-process wrapper's next
        # attempt): charge the time since the failed run's last step to that run, cause "fault".
        if ft.restart_count > 0:
            lost_s = ft.seconds_lost_before_restart()
            state.progress.restart("fault", lost_s if lost_s is not None else 0.0)
        elif in_process > 0:
            state.progress.restart("fault", time.time() - last_step_time if last_step_time else 0.0)
        restart_count = run_restart_count(path, env.job_id, env.restart_count, ft.restart_count + in_process)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        # The process's age now, not when it was read above: the first step's start-up seconds count
        # from the process start, and the set-up in between (rendezvous, locks, workers) must count too.
        age_s = None if process_age_s is None else time.time() - started_at
        state.progress.starting_job(restart_count=restart_count, startup_s=age_s, device=device)
    state.restart_count = restart_count
    ft.mark_progress()  # after the restart's lost time was read: this run's own time counts from here
    if not parallel_state.model_parallel_is_initialized():
        parallel.initialize(cfg)
    # Megatron's seeds: each pipeline stage its own stream (its layers differ), the same on the
    # data-parallel replicas unless asked otherwise; tensor-parallel ranks get theirs from
    # megatron-core's RNG tracker (model_parallel_cuda_manual_seed).
    set_random_seed(cfg.rng.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
                    + (10 * parallel_state.get_data_parallel_rank() if cfg.rng.data_parallel_random_init else 0),
                    use_cudagraphable_rng=cfg.model.full_iteration_cuda_graph, te_rng_tracker=cfg.rng.te_rng_tracker)
    rerun.init_rerun_state(cfg.rerun_state_machine)  # megatron-core's rerun state machine (train_step uses it)
    startup.mark("set-up")

    if cfg.model.full_iteration_cuda_graph:
        cuda_graphs.run_on_the_capture_stream()  # before the model: its gradient accumulators keep the stream
    start_memory_history_recording(cfg.profiling)  # before the model: its allocations are in the history
    model = setup_model(cfg)
    startup.mark("model")
    optimizer = setup_optimizer(cfg, model)
    if parallel.pipeline_size() > 1:
        parallel.install_schedule_hooks(model, optimizer, cfg)
    scheduler = setup_scheduler(cfg, optimizer)
    startup.mark("optimizer")
    load_start = time.perf_counter()
    data_state = checkpointing.load_checkpoint(state, model, optimizer, scheduler)
    load_s = collectives.slowest_rank(time.perf_counter() - load_start)  # one figure for every record of it
    startup.mark("checkpoint load")
    ts = state.train_state
    if ts.step > 0:  # a checkpoint was loaded: reuse the timeouts computed before
        ft.load_state_dict(state.checkpoint_extra.get("fault_tolerance", {}))
        ft.on_checkpoint_loaded()
    if data_state is not None:
        checkpointing_context["last_saved_step"] = ts.step
        if state.progress is not None:
            state.progress.loaded_checkpoint(ts.step, load_s, ts.floating_point_operations_so_far)
    if auto is not None and not auto.pending:
        auto.record(state.progress, ts.step)
        if "consumed_samples" in data_state and data_state["consumed_samples"] != ts.consumed_train_samples:
            raise RuntimeError(f"checkpoint data position {data_state} disagrees with train_state "
                               f"consumed_train_samples={ts.consumed_train_samples}")

    train_ds, valid_ds, _ = build_datasets(cfg.dataset, cfg, state.tokenizer)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mbs, gbs = cfg.train.micro_batch_size, cfg.train.global_batch_size
    stop, reads = cfg.train.exit_signal, parallel.reads_data()
    # A loader worker may take as long for a batch as a collective may wait at start-up (a shorter
    # dist.distributed_timeout_seconds_after_init ends the peers' wait sooner: the job fails then).
    wait_s = cfg.dist.distributed_timeout_minutes * 60.0
    train_it = build_data_iterator(train_ds, ts.consumed_train_samples, mbs, dp_rank, dp_size, cfg.dataset,
                                   cfg.rng.seed, stop, gbs, reads=reads, wait_s=wait_s)
    v = cfg.validation  # evaluation reads batches of its own sizes
    valid_it = build_data_iterator(valid_ds, ts.consumed_valid_samples, v.eval_micro_batch_size, dp_rank, dp_size,
                                   cfg.dataset, cfg.rng.seed, stop, v.eval_global_batch_size, reads=reads,
                                   wait_s=wait_s)
    for iterator in (train_it, valid_it):
        if isinstance(iterator, SampleIterator):
            # before the log backends' and the saves' threads; torch.distributed's already run, hence
            # the start check (SampleIterator.start)
            iterator.start()
    ts.do_train, ts.do_valid = train_it is not None, valid_it is not None
    startup.mark("data")

    state.metrics.open(ts.step, RunStart(restart_count=restart_count, load_s=load_s if data_state is not None else None,
                                         started_at=started_at))
    # A run that resumes at train_iters (its predecessor stopped after the last step, before its
    # process ended) still goes through the loop's exit decision: "Ending job  done", no requeue.
    if ts.do_train and not cfg.validation.skip_train:
        train(forward_step_func, model, optimizer, scheduler, train_it, valid_it, state, checkpointing_context)
    elif cfg.validation.skip_train and ts.do_valid:
        evaluate_and_print_results(state, f"iteration {ts.step}", forward_step_func, valid_it, model)
    # Normal end only (an exception skips this: the monitor sees the rank end).
    state.straggler_detector.shutdown()
    ft.shutdown()


# ---------------------------------------------------------------------------------------------
# Setup pieces
# ---------------------------------------------------------------------------------------------


def setup_logging(level: int) -> None:
    """Send bridge_hpc's log records (fault tolerance, straggler reports, checkpoints) to stderr with
    a time stamp and this process's rank: under ft_launcher all ranks of a node share one Slurm task,
    so Slurm's ``--label`` cannot tell them apart. INFO comes from rank 0 only (a thousand ranks
    saying the same thing helps nobody); warnings and errors from every rank; ``logging_level`` 10
    (DEBUG) opens every rank. Once per process. A script that configured logging itself (the root
    logger has handlers) keeps its own handlers and format."""
    rank = JobEnvironment.from_env().rank
    package = logging.getLogger("bridge_hpc")
    package.setLevel(level if rank == 0 or level <= logging.DEBUG else max(level, logging.WARNING))
    if logging.getLogger().handlers or any(getattr(h, "_bridge_hpc", False) for h in package.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[%(asctime)s] [%(levelname)s] [rank {rank}] %(name)s: %(message)s"))
    handler._bridge_hpc = True  # type: ignore[attr-defined]
    package.addHandler(handler)
    package.propagate = False


def configure_other_loggers(log) -> None:
    """Bridge's switches for the log records of other packages (megatron-core, torch, ...):
    ``set_level_for_all_loggers`` gives every logger ``logging_level``; ``filter_warnings`` drops their
    WARNING records (Bridge's default: megatron-core warns about every missing optional kernel);
    ``modules_to_filter`` drops every record of the loggers under those names. bridge_hpc's own warnings
    are never dropped: they are how a run says what it could not do. Applied to every logger that
    exists now (pretrain runs after megatron-core and torch are imported) and to the root handlers,
    for loggers made later."""
    mine = ("bridge_hpc",)
    modules = tuple(log.modules_to_filter or ())

    def keep(record: logging.LogRecord) -> bool:
        if record.name.startswith(mine):
            return True
        if log.filter_warnings and record.levelno == logging.WARNING:
            return False
        return not (modules and record.name.startswith(modules))

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if not name.startswith(mine)] + [logging.getLogger()]
    for logger_ in loggers:
        if isinstance(logger_, logging.Logger):
            if log.set_level_for_all_loggers:
                logger_.setLevel(log.logging_level)
            if log.filter_warnings or modules:
                logger_.addFilter(keep)
    for handler in logging.getLogger().handlers:
        if log.filter_warnings or modules:
            handler.addFilter(keep)


def save_config_file(cfg: ConfigContainer, path: str) -> None:
    """``logger.save_config_filepath``: the resolved configuration (every section, as the checkpoints
    record it) written to ``path`` at start, as YAML for a ``.yaml``/``.yml`` name, else JSON. Written to
    a temporary name and renamed, so a reader never sees half a file."""
    import json

    data = cfg.to_dict()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        if path.endswith((".yaml", ".yml")):
            import yaml

            yaml.safe_dump(json.loads(json.dumps(data, default=str)), f, sort_keys=False)
        else:
            json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


def _process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux ``/proc``), so start-up cost includes imports and
    rendezvous; None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def run_restart_count(progress_path: str, job_id: Optional[str], slurm_restarts: int, in_job_restarts: int) -> int:
    """The progress log's ``Restart count`` of this run: how many runs of this job came before it.

    A run is one start of the ranks: a Slurm (re)start (``SLURM_RESTART_COUNT``) or an in-job restart
    by ft_launcher (``TORCHELASTIC_RESTART_COUNT``, which starts from 0 in every allocation). Their sum
    is right until a requeued allocation follows one with in-job restarts; so the log itself decides
    where it knows more: the number of earlier ``Starting job`` lines of this job id. Thus the count
    goes 0, 1, 2, ... over every run of a job however it was restarted."""
    count = int(slurm_restarts) + int(in_job_restarts)
    if job_id and os.path.exists(progress_path):
        from bridge_hpc.contracts.progress_log import STARTING_JOB, parse_events

        earlier = sum(1 for e in parse_events(progress_path) if e.name == STARTING_JOB and e.job_id == str(job_id))
        count = max(count, earlier)
    return count


def initialize_distributed(dist_cfg: Optional[DistributedInitConfig] = None, store=None) -> JobEnvironment:
    """Bring up torch.distributed from Slurm or torchrun variables (idempotent).

    nccl with a GPU per local rank when CUDA is there, gloo otherwise; megatron-core's experimental
    switch as ``dist.enable_megatron_core_experimental`` says. ``store``: the in-process restart
    wrapper's coordination store (rendezvous through it instead of MASTER_ADDR/PORT).
    """
    env = JobEnvironment.from_env()
    dist_cfg = dist_cfg or DistributedInitConfig()
    set_experimental_flag(dist_cfg.enable_megatron_core_experimental)
    if torch.cuda.is_available():
        device = 0 if dist_cfg.external_gpu_device_mapping else env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
    if dist_cfg.disable_jit_fuser:
        disable_jit_fuser()
    if not dist.is_initialized():
        env.export_torch_env()
        os.environ.update({k: v for k, v in flight_recorder_env(dist_cfg).items() if k not in os.environ})
        backend = dist_cfg.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, store=store,
                                timeout=datetime.timedelta(minutes=dist_cfg.distributed_timeout_minutes))
    return env


def flight_recorder_env(dist_cfg: DistributedInitConfig) -> Dict[str, str]:
    """torch's NCCL flight-recorder variables for ``dist.flight_recorder_*`` (none unless
    ``flight_recorder_dump_path`` is set, as in Megatron-LM). torch reads them when the NCCL process
    group is created, so they are set before torch.distributed starts; a variable already in the
    environment wins."""
    path = dist_cfg.flight_recorder_dump_path
    if not path:
        return {}
    flag = {True: "1", False: "0"}
    return {
        "TORCH_FR_DUMP_TEMP_FILE": path,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": path,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(dist_cfg.flight_recorder_trace_buffer_size),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": flag[dist_cfg.flight_recorder_dump_on_timeout],
        "TORCH_INCLUDE_STACK_TRACE": flag[dist_cfg.flight_recorder_include_stack_trace],
        "TORCH_INCLUDE_ONLY_ACTIVE": flag[dist_cfg.flight_recorder_include_only_active],
        "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": flag[dist_cfg.flight_recorder_extra_dump_on_exec],
    }


def disable_jit_fuser() -> None:
    """``dist.disable_jit_fuser``: TorchScript compiles megatron-core's jit-scripted fusions (bias-GeLU,
    bias-dropout-add) without fusing them (Megatron-LM's switch, for debugging a fuser fault)."""
    torch._C._jit_override_can_fuse_on_cpu(False)
    torch._C._jit_override_can_fuse_on_gpu(False)
    torch._C._jit_set_texpr_fuser_enabled(False)


#: What ``model.deterministic_mode`` sets where the environment does not already say: cuBLAS's
#: fixed workspace (its reductions in one order), one NCCL algorithm (Megatron requires one) and
#: Transformer Engine's deterministic attention (megatron-core refuses to build TE's attention in
#: deterministic mode without ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``; seen on an H200, 2026-12-03).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def enable_deterministic_mode() -> None:
    """Deterministic kernels for this process (``model.deterministic_mode``): torch's deterministic
    algorithms (SDPA's flash backward then accumulates in a fixed order; an operation without a
    deterministic kernel raises, naming itself) and :data:`DETERMINISTIC_ENV`."""
    for name, value in DETERMINISTIC_ENV.items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)


def set_random_seed(seed: int, use_cudagraphable_rng: bool = False, te_rng_tracker: bool = False) -> None:
    """Seed python, numpy and torch; on GPU also megatron's model-parallel CUDA RNG tracker
    (``model_parallel_cuda_manual_seed`` needs CUDA, so it is skipped on CPU). With
    ``use_cudagraphable_rng`` (CUDA graphs) the tracker's states are generators a graph can register,
    as megatron-core's full-iteration graph needs; ``te_rng_tracker`` (``rng.te_rng_tracker``) makes the
    tracker Transformer Engine's."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=te_rng_tracker,
                                                        use_cudagraphable_rng=use_cudagraphable_rng)


def setup_model(cfg: ConfigContainer,
                pre_wrap_hook: Optional[Callable[[List[torch.nn.Module]], List[torch.nn.Module]]] = None
                ) -> List[torch.nn.Module]:
    """The GPT, wrapped for data parallelism; a list of chunks as Bridge passes it around (one, or
    with virtual pipeline stages one per stage this rank holds: :func:`parallel.build_model_chunks`).

    Between building and wrapping, as in Megatron Bridge: the pretrained weights are read into the
    bare chunks (:func:`pretrained.load_pretrained_weights`, when the run starts from them), then
    ``cfg.peft`` freezes them and adds its adapters (Bridge's PEFT pre-wrap hook, so that the wrapper and
    the optimizer hold the adapters only), then ``pre_wrap_hook`` (Bridge's name) may transform the
    chunks and returns the ones to wrap."""
    chunks = parallel.build_model_chunks(cfg.model, gpt_model_provider)
    base = pretrained.load_pretrained_weights(cfg.checkpoint, chunks, with_adapters=cfg.peft is not None)
    if cfg.peft is not None:
        chunks = apply_peft(cfg.peft, chunks, cfg.rng.seed, base)
    if pre_wrap_hook is not None:
        chunks = pre_wrap_hook(chunks)
    return [_wrap_ddp(cfg, chunk, first_chunk=i == 0) for i, chunk in enumerate(chunks)]


def _wrap_ddp(cfg: ConfigContainer, model: torch.nn.Module, first_chunk: bool = True) -> torch.nn.Module:
    if not torch.cuda.is_available():
        # No buffer sync in forward: forward then issues no collectives, so a forward on one rank
        # alone (non-loss-data evaluation on the last rank) cannot hang. torch 2.13 renamed the
        # option (forward_sync_buffers; it still syncs once at init, where the buffers are equal).
        params = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        if cfg.model.expert_model_parallel_size > 1:  # (reduced over their own group: train.finalize_grads)
            from bridge_hpc.training.engine import moe

            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, moe.expert_param_names(model))
        ddp = torch.nn.parallel.DistributedDataParallel(model, **no_sync)
        GradReduceRider.install(ddp)  # the step's losses and stop flags ride on its gradient all-reduce
        return ddp
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    if cfg.model.bf16 or cfg.model.fp16:
        model = Float16Module(model.config, model)
    ddp_config = megatron_ddp_config(cfg.ddp)
    # As Megatron-LM: only the first chunk's gradients are bucketed for overlapped reduce; the other
    # virtual stages' finish at different times in the interleaved schedule.
    return DistributedDataParallel(config=model.config if hasattr(model, "config") else model.module.config,
                                   ddp_config=ddp_config, module=model, disable_bucketing=not first_chunk)


def megatron_ddp_config(d: DistributedDataParallelConfig):
    """megatron-core's DistributedDataParallelConfig from the ``[ddp]`` section: every field of megatron-core's
    class, which the section declares (the toolkit's loop and benchmarks/loop_overhead.py's bare loop build
    the same one)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig as MegatronDDPConfig

    return MegatronDDPConfig(**{f.name: getattr(d, f.name) for f in dataclasses.fields(MegatronDDPConfig)
                                if f.init and hasattr(d, f.name)})


def setup_scheduler(cfg: ConfigContainer, optimizer) -> OptimizerParamScheduler:
    """megatron-core's scheduler, counted in samples as in Bridge: the steps
    :meth:`ConfigContainer.validate` computed (``scheduler.lr_decay_steps`` ...) from the iteration or
    the sample counts; each training step advances it by the global batch size."""
    s = cfg.scheduler
    return OptimizerParamScheduler(
        optimizer, init_lr=s.lr_warmup_init, max_lr=cfg.optimizer.lr, min_lr=cfg.optimizer.min_lr,
        lr_warmup_steps=s.lr_warmup_steps, lr_decay_steps=max(s.lr_decay_steps, 1),
        lr_decay_style=s.lr_decay_style, start_wd=s.start_weight_decay, end_wd=s.end_weight_decay,
        wd_incr_steps=max(s.wd_incr_steps, 1), wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
        wsd_decay_steps=s.wsd_decay_steps, lr_wsd_decay_style=s.lr_wsd_decay_style,
    )
