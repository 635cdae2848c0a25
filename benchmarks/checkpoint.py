"""Checkpoint save and load through the toolkit's own functions, against the disk's physical limit.

What it measures, per rank count, each mode in a fresh process (torchrun), so that the first save is
the first of a process as after a requeue:

- sync: :func:`bridge_hpc.training.checkpoint.checkpointing.save_checkpoint` (what every exit save runs), the
  first save of the process and later ones: blocking = total;
- async: :func:`~bridge_hpc.training.checkpoint.async_writer.start_async_save` (blocking part) and
  :func:`~bridge_hpc.training.checkpoint.async_writer.finalize_async_save` (total until committed), the
  worker started before the model is built, as ``pretrain`` does;
- load: :func:`~bridge_hpc.training.checkpoint.checkpointing.load_checkpoint`, with the files in the page cache
  (warm) and evicted from it (cold, ``posix_fadvise(DONTNEED)`` after fsync; no root needed), with
  the parallel reads (``LOAD_READ_THREADS``) and with one reader thread;
- the physical limit, in the same folder: a plain sequential write + fsync of the same number of
  bytes per rank (all ranks at once, as a save), and a plain sequential cold read of the checkpoint's
  files. Results are ratios within one run (the machine is noisy).

Each save is split into phases (functions of the toolkit and of megatron-core / DCP wrapped with
timers here): plan, snapshot (GPU->host copy or CPU clone), handoff to the worker, write (+fsync),
fsync of the toolkit's files, finalize (metadata, train_state, manifest, rename, tracker), and, on
GPU, megatron-core's write-results Manager. The table prints them for rank 0.

Run:
  python benchmarks/checkpoint.py                       # CPU: 1 and 2 gloo ranks, ~430 MB of state
  python benchmarks/checkpoint.py --device cuda         # 1 GPU: the 370 M GPT, adam, bf16 (5.2 GB)
Writes benchmarks/results/checkpoint.json (``--out``); ``--dir`` picks the disk (default: a
temporary folder under the current directory, removed afterwards).

Notes (where the first save's time goes on the toolkit's path)
--------------------------------------------------------------
- GPU, before this benchmark existed (issue 11, 370 M GPT on one H100, 5.2 GB): the first save of a
  process blocked 16-20 s, later ones 9 s. megatron-core's ``FileSystemWriterAsync`` creates a
  ``multiprocessing`` Manager with the *spawn* method for its write results inside the first save
  (``filesystem_async._get_write_results_queue``, the same in 0.16.1 and 0.19.x): the child
  re-imports torch and megatron (8.6-21 s). The synchronous save now passes an in-process queue
  (``checkpointing._in_process_write_results``: the write runs in the rank, no Manager at all); the
  asynchronous writer starts its Manager at start-up, overlapped with model building. The phase
  ``results_manager`` shows what is left of it (expected: 0 s).
- GPU: the first GPU->host copy cost 2.9 s, later ones 0.1 s: megatron-core copies with
  ``tensor.to("cpu", non_blocking=True)``, which allocates pinned host memory through torch's caching
  host allocator; the blocks are cached and reused by later saves of the same process (the async
  save in the persistent worker). A synchronous save pins nothing: its files are written straight
  from GPU memory through small pageable buffers (``checkpoint/streamed_write.py``, 2026-11-27;
  before, training runs pinned the rank's blocks after their first step). The worker creates its CUDA context
  at start-up, and after the first training step it stages the whole state once in the background
  (``checkpoint_worker.stage_once``: CUDA memory opened in the worker, pinned blocks allocated), so
  the first save's ``handoff`` costs what a later one does. Measured with 13.0 s of the first async
  save's blocking time in ``handoff`` before that (12.8 s of it waiting for the worker). The
  benchmark trains until the worker is idle before its first async save, as a run does until its
  first interval save; the JSON gives those steps and seconds.
- GPU: the write was one process at 0.63-0.74 GB/s against 1.1-1.48 GB/s for the disk; saves now
  write ``checkpoint.storage_writers_per_rank`` (default 4) files per rank in parallel processes (sync and async).
- CPU (this repository's machine, 2 cores; see the JSON for the run's figures): the first save of a
  process costs about the same as later ones; the phases are dominated by the write + fsync. DCP
  keeps one file per rank on CPU (the file names are part of the tests' expectations).
- Load: torch's FileSystemReader reads, unpickles and copies item after item in one thread; loads now
  read with ``LOAD_READ_THREADS = 4`` (CPU and GPU), and with several data-parallel GPU ranks
  fully parallel (megatron-core's ``FullyParallelLoadStrategyWrapper``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "checkpoint.json"
sys.path.insert(0, str(ROOT / "tests"))

from bridge_test_helpers import evict_from_page_cache  # noqa: E402

#: [model] of each device: CPU a GPT with ~36 M parameters (fp32 + adam: ~430 MB of state); GPU the
#: 370 M GPT of issue 11 (bf16 + fp32 main params + adam: 5.2 GB).
MODELS = {
    "cpu": dict(num_layers=6, hidden_size=512, num_attention_heads=8, vocab_size=16384, seq_length=64),
    "cuda": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=32768, seq_length=256,
                 bf16=True, share_embeddings_and_output_weights=False),
}
SAVES = 3  # the first of the process and two later ones
#: async: at most this many training steps before the first save while the worker is not yet idle
#: (its start-up and staging warm-up); the first save then waits for the rest.
MAX_STEPS_BEFORE_FIRST_SAVE = 200


def _toml(value: Any) -> str:
    return "true" if value is True else "false" if value is False else json.dumps(value)


def write_job(folder: Path, device: str, ranks: int, async_save: bool) -> Path:
    model = MODELS[device]
    lines = ["[job]", 'name = "ckpt-bench"', f'run_dir = "{folder / "run"}"', "",
             "[train]", "train_iters = 1000", "micro_batch_size = 1", f"global_batch_size = {ranks}", "",
             "[model]"] + [f"{k} = {_toml(v)}" for k, v in model.items()] + [
             "hidden_dropout = 0.0", "attention_dropout = 0.0", "",
             "[optimizer]", 'optimizer = "adam"', "lr = 1e-4"] + (["bf16 = true"] if device == "cuda" else []) + [
             "", "[dataset]", f"seq_length = {model['seq_length']}", "num_workers = 0", "",
             "[logger]", "log_interval = 1000", 'tensorboard_dir = ""', "",
             "[checkpoint]", f'save = "{folder / "ckpts"}"', f"async_save = {_toml(async_save)}"]
    path = folder / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Phase timers (benchmark-side wrappers around the toolkit's and the libraries' functions)
# ---------------------------------------------------------------------------------------------

PHASES: Dict[str, float] = defaultdict(float)


_ACTIVE: set = set()


def _timed(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if name in _ACTIVE:  # a recursive call (the snapshot): counted by the outermost one
            return fn(*args, **kwargs)
        _ACTIVE.add(name)
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _ACTIVE.discard(name)
            PHASES[name] += time.perf_counter() - began
    return wrapper


def _wrap(owner: Any, attr: str, name: str) -> None:
    original = getattr(owner, attr, None)
    if original is None:
        return
    if isinstance(owner, type) and isinstance(owner.__dict__.get(attr), staticmethod):
        setattr(owner, attr, staticmethod(_timed(name, original)))
    else:
        setattr(owner, attr, _timed(name, original))


def instrument(on_gpu: bool) -> None:
    from bridge_hpc.training.checkpoint import async_writer as async_checkpoint
    from bridge_hpc.training.checkpoint import checkpointing

    _wrap(checkpointing, "begin_save", "prepare_folder")
    _wrap(checkpointing, "_save_model_and_optimizer", "model_optimizer_save")
    _wrap(checkpointing, "write_rank_state", "rank_files")
    _wrap(checkpointing, "_fsync_written_files", "fsync_toolkit_files")
    _wrap(checkpointing, "commit_save", "finalize_commit")
    _wrap(async_checkpoint, "_dcp_request", "plan_and_snapshot")
    _wrap(async_checkpoint, "_megatron_request", "plan_and_snapshot")
    _wrap(async_checkpoint, "_snapshot", "snapshot_clone")
    _wrap(async_checkpoint.AsyncCheckpointWriter, "submit", "handoff")
    _wrap(async_checkpoint.AsyncCheckpointWriter, "wait_until_started", "wait_worker_started")
    if on_gpu:
        from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver
        from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

        _wrap(filesystem_async, "_get_write_results_queue", "results_manager")
        _wrap(filesystem_async.FileSystemWriterAsync, "preload_tensors", "snapshot_d2h")
        _wrap(filesystem_async.FileSystemWriterAsync, "write_preloaded_data_multiproc", "write_fsync")
        _wrap(mcore_torch.TorchDistSaveShardedStrategy, "async_save", "plan")
        _wrap(mcore_torch, "save_state_dict_async_finalize", "finalize_metadata")
        _wrap(state_dict_saver, "save_state_dict_async_finalize", "finalize_metadata")
    else:
        import torch.distributed.checkpoint as dcp

        _wrap(dcp.FileSystemWriter, "write_data", "write_fsync")
        _wrap(dcp.FileSystemWriter, "finish", "finalize_metadata")


# ---------------------------------------------------------------------------------------------
# The physical limit
# ---------------------------------------------------------------------------------------------


def plain_write(folder: str, nbytes: int, rank: int) -> float:
    """Seconds to write ``nbytes`` sequentially (16 MiB blocks) and fsync them."""
    block = os.urandom(16 << 20)
    path = os.path.join(folder, f"plain_{rank}.bin")
    began = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[:min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - began
    os.remove(path)
    return elapsed


def plain_read(paths: List[str]) -> float:
    began = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - began


def folder_files(folder: str) -> List[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names]


# ---------------------------------------------------------------------------------------------
# One process (a torchrun rank)
# ---------------------------------------------------------------------------------------------


def rank_main(job: str, mode: str, result_path: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bridge_hpc.rank import build_config
    from bridge_hpc.training import pretrain
    from bridge_hpc.training.checkpoint import async_writer as async_checkpoint
    from bridge_hpc.training.checkpoint import checkpointing
    from bridge_hpc.training.gpt_step import forward_step
    from bridge_hpc.training.state import GlobalState
    from bridge_hpc.training.tokenizers import build_tokenizer_for
    from bridge_hpc.training.train import train_step
    from bridge_hpc.training.utils.train_utils import prepare_forward_step_func

    t_process = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    instrument(on_gpu)
    state = GlobalState()
    state.cfg = cfg = build_config(job)
    pretrain.initialize_distributed(cfg.dist)
    rank, world = dist.get_rank(), dist.get_world_size()
    state.rank, state.world_size = rank, world
    state.tokenizer = build_tokenizer_for(cfg)
    cfg.validate(world)
    writer = None
    if mode == "async":  # as pretrain: started before the model is built
        writer = async_checkpoint.AsyncCheckpointWriter(cfg.train.exit_signal, on_gpu=on_gpu).start()
    parallel_state.initialize_model_parallel(1, 1)
    pretrain.set_random_seed(cfg.rng.seed)
    model = pretrain.setup_model(cfg)
    optimizer = pretrain.setup_optimizer(cfg, model)
    scheduler = pretrain.setup_scheduler(cfg, optimizer)
    build_s = time.perf_counter() - t_process

    # One real step, so that the optimizer has its state (adam's moments) to save.
    seq, vocab = cfg.model.seq_length, cfg.model.vocab_size
    generator = torch.Generator().manual_seed(rank)

    def batches():
        while True:
            tokens = torch.randint(0, vocab, (1, seq + 1), generator=generator)
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, seq),
                   "position_ids": torch.arange(seq).unsqueeze(0)}

    step = prepare_forward_step_func(forward_step, state)
    train_step(step, batches(), model, optimizer, scheduler, state)
    if on_gpu:
        torch.cuda.synchronize()
    # async: as the training loop after its first step, the worker stages the state once in the
    # background (GPU); training steps go on until the worker is idle, as they would until the first
    # interval save (the steps and seconds that took are in the JSON: a save asked for sooner waits).
    steps_before_first_save, ready_wait_s = 1, 0.0
    if writer is not None:
        if on_gpu:
            writer.warm_up_staging(checkpointing.megatron_save_tensors(model, optimizer, cfg.checkpoint.save_optim))
        began = time.perf_counter()
        data = batches()
        while True:
            idle = torch.tensor([0 if writer.idle() else 1], device="cuda" if on_gpu else "cpu")
            dist.all_reduce(idle)
            if idle.item() == 0 or steps_before_first_save >= MAX_STEPS_BEFORE_FIRST_SAVE:
                break
            train_step(step, data, model, optimizer, scheduler, state)
            steps_before_first_save += 1
        ready_wait_s = time.perf_counter() - began

    saves = []
    for index in range(SAVES):
        state.train_state.step = index + 1
        PHASES.clear()
        dist.barrier()
        began = time.perf_counter()
        if mode == "sync":
            checkpointing.save_checkpoint(state, model, optimizer, scheduler)
            blocking = total = time.perf_counter() - began
        else:
            async_checkpoint.start_async_save(state, model, optimizer, scheduler, writer)
            blocking = time.perf_counter() - began
            finished = async_checkpoint.finalize_async_save(writer, blocking=True)
            total = finished.total_s
            PHASES["background_write_and_wait"] = total - blocking - PHASES.get("finalize_commit", 0.0)
        saves.append({"save": index + 1, "blocking_s": blocking, "total_s": total,
                      "phases_s": {k: round(v, 4) for k, v in sorted(PHASES.items())}})
    folder = checkpointing.iteration_dir(cfg.checkpoint.save, SAVES)
    files = folder_files(folder)
    total_bytes = sum(os.path.getsize(p) for p in files)

    # The limit: every rank writes its share sequentially + fsync, all at once.
    dist.barrier()
    began = time.perf_counter()
    plain_write(cfg.checkpoint.save, total_bytes // world, rank)
    dist.barrier()
    plain_write_s = time.perf_counter() - began

    loads = {}
    for label, threads, cold in (("warm", checkpointing.LOAD_READ_THREADS, False),
                                 ("cold", checkpointing.LOAD_READ_THREADS, True),
                                 ("cold_one_thread", 1, True)):
        default_threads, checkpointing.LOAD_READ_THREADS = checkpointing.LOAD_READ_THREADS, threads
        if cold:
            evict_from_page_cache(files)
        dist.barrier()
        state.train_state.step = 0
        began = time.perf_counter()
        checkpointing.load_checkpoint(state, model, optimizer, scheduler)
        if on_gpu:
            torch.cuda.synchronize()
        dist.barrier()
        loads[label] = time.perf_counter() - began
        checkpointing.LOAD_READ_THREADS = default_threads
    evict_from_page_cache(files)
    dist.barrier()
    began = time.perf_counter()
    if rank == 0:  # the whole checkpoint, one reader: what a cold load must read at least
        plain_read(files)
    dist.barrier()
    plain_read_s = time.perf_counter() - began

    if writer is not None:
        writer.close()
    if rank == 0:
        result = {"mode": mode, "ranks": world, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                  "bytes": total_bytes, "files": len(files), "build_s": build_s, "saves": saves,
                  "steps_before_first_save": steps_before_first_save, "worker_ready_wait_s": ready_wait_s,
                  "load_s": loads, "plain_write_s": plain_write_s, "plain_read_s": plain_read_s,
                  "save_write_threads": cfg.checkpoint.storage_writers_per_rank if on_gpu else 1,
                  "load_read_threads": checkpointing.LOAD_READ_THREADS}
        Path(result_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def run_case(folder: Path, device: str, ranks: int, mode: str, port: int, timeout: float) -> Dict[str, Any]:
    case = folder / f"{mode}-{ranks}"
    case.mkdir(parents=True)
    job = write_job(case, device, ranks, async_save=mode == "async")
    result = case / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={port}",
           str(Path(__file__).resolve()), "--rank-main", str(job), mode, str(result)]
    proc = subprocess.run(cmd, cwd=case, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(f"{mode} with {ranks} rank(s) failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(result.read_text())


def table(results: List[Dict[str, Any]]) -> str:
    gb = 1e9
    rows = [("mode", "ranks", "GB", "save", "blocking s", "total s", "GB/s", "÷ plain write")]
    for r in results:
        limit = r["bytes"] / r["plain_write_s"]
        for s in r["saves"]:
            rows.append((r["mode"], str(r["ranks"]), f"{r['bytes'] / gb:.2f}", "first" if s["save"] == 1 else "later",
                         f"{s['blocking_s']:.2f}", f"{s['total_s']:.2f}", f"{r['bytes'] / s['total_s'] / gb:.2f}",
                         f"{r['bytes'] / s['total_s'] / limit:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append("")
    lines.append("plain write + fsync of the same bytes: " + ", ".join(
        f"{r['mode']}/{r['ranks']}: {r['plain_write_s']:.2f} s ({r['bytes'] / r['plain_write_s'] / gb:.2f} GB/s)"
        for r in results))
    for r in results:
        loads = ", ".join(f"{k} {v:.2f} s" for k, v in r["load_s"].items())
        lines.append(f"load ({r['mode']} run, {r['ranks']} rank(s)): {loads}; plain cold read "
                     f"{r['plain_read_s']:.2f} s (cold load ÷ plain read: {r['load_s']['cold'] / r['plain_read_s']:.2f}×)")
    for r in results:
        if r["mode"] == "async":
            lines.append(f"async/{r['ranks']}: first save after {r['steps_before_first_save']} training step(s), "
                         f"{r['worker_ready_wait_s']:.1f} s after the first (the worker's start-up and staging "
                         f"warm-up; at most {MAX_STEPS_BEFORE_FIRST_SAVE} steps)")
    lines.append("")
    for r in results:
        for s in r["saves"]:
            phases = ", ".join(f"{k} {v:.3f}" for k, v in s["phases_s"].items())
            lines.append(f"phases, {r['mode']}/{r['ranks']} save {s['save']} (rank 0, s): {phases}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, nargs="+", help="rank counts (default: cpu 1 2, cuda 1)")
    parser.add_argument("--modes", nargs="+", choices=("sync", "async"), default=["sync", "async"])
    parser.add_argument("--dir", default=".", help="where the checkpoints are written (a temporary folder inside)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    parser.add_argument("--rank-main", nargs=3, metavar=("JOB", "MODE", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(*args.rank_main)
        return 0
    from bridge_test_helpers import free_port

    ranks = args.ranks or ([1, 2] if args.device == "cpu" else [1])
    folder = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)).resolve()
    results = []
    try:
        for count in ranks:
            for mode in args.modes:
                results.append(run_case(folder, args.device, count, mode, free_port(), args.timeout))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device, "when": time.strftime("%Y-%m-%d %H:%M"), "results": results},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
