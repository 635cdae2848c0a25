"""What bridge_hpc's training loop costs: ``pretrain`` against a bare loop of the same calls.

The loops train the same GPT on the same data with the same seeds; only what is around the calls
differs:

- **bridge**: :func:`bridge_hpc.training.pretrain.pretrain`, the loop every rank runs, with the job's
  defaults: metrics.jsonl on rank 0, TensorBoard on the last rank, the log line every
  ``logger.log_interval`` steps, the loss reduction and the exit checks every step (in one
  all-reduce of their own on GPU; on CPU ranks riding on DDP's gradient all-reduce:
  :mod:`bridge_hpc.training.engine.grad_reduce_rider`), the result validation, the step timers, and the
  start-up heap frozen for the steps (:mod:`bridge_hpc.training.process.heap`; in the bare loops Python's
  automatic full collection walks it, 0.28-0.35 s on a rank about once in 130 steps of the CPU
  model: a cost the fastest tenth of the steps leaves out). Evaluation and checkpoints are off
  (``eval_interval = 0``, no ``checkpoint.save``): no save falls inside the timed steps either way,
  and the exit save after the last step would only lengthen the run.
- **bare**: a plain for-loop a user would write with the same pieces: the toolkit's GPT builder (the
  model is not what is measured), the DDP wrapper and optimizer built directly (torch DDP and
  ``torch.optim.AdamW`` with ``clip_grad_norm_`` on CPU, as the toolkit did there; megatron-core's
  ``Float16Module``, ``DistributedDataParallel`` and ``get_megatron_optimizer`` on GPU),
  megatron-core's ``OptimizerParamScheduler``, ``MockGPTDataset`` batches through a plain
  ``DataLoader``. Per step: zero grads, forward, loss, backward (no gradient sync before the last
  micro-batch), finalize grads, optimizer step, scheduler step; nothing else. Its losses are reduced
  after the loop, with the toolkit's own reduction, so that loss curves compare bit for bit.
- **bare-opt**: the bare loop with the optimizer the toolkit builds (``setup_optimizer``, with
  whatever faster step it installs). Against it only the loop differs: ``loop_overhead`` in the JSON,
  the figure of the CPU target (<= 3 %), and the losses should be bitwise equal
  (``losses_bitwise_equal``). ``against_bare`` compares with the plain bare loop: the GPU target
  (>= 1.15x a bare megatron-core loop).

All are started the same way (``torchrun --standalone``, this file in worker mode) and timed at the
same point: a clock read at the first micro-batch of every step, so a step's interval includes all
the loop does between steps. A run's figure is its steady tokens/s: the steps after ``--warmup``,
tokens over elapsed time (on GPU the device is synchronized at the window's two ends only), so
periodic costs such as the log line count. Also reported: the median step, the fastest tenth of the
steps (what a step costs when nothing else ran: robust to a shared machine's load spikes, and
every-step costs of the loop are in it) and CPU seconds per step (all threads of each rank). Runs
alternate (bare, bare-opt, bridge, bridge, bare-opt, bare, ...) ``--repeat`` times each, so a drift of
the machine hits all; results are ratios of the medians over runs; overhead = reference tokens/s ÷
bridge tokens/s − 1. The i-th runs of two loops are adjacent in time: ``paired`` in the JSON gives the
overhead of each such pair and a 95 % bootstrap interval of their median, and against the CPU target
whether the runs settle it (on a shared 2-core machine runs of the same code swing by 5-30 %).

- CPU (default without CUDA): 2 gloo ranks, ``configs/local-tiny.toml``'s model and batch
  (``OMP_NUM_THREADS=1``).
- GPU (``--device cuda``): one GPU, the 370 M GPT of ``benchmarks/indexed_vs_mock.py`` (24 layers,
  hidden 1024, 16 heads, vocab 32768, seq 2048 × micro-batch 8, bf16, adam, dropout 0, untied
  output layer, ``grad_reduce_in_fp32``), plus MFU: the toolkit's 6·N·tokens + attention FLOPs
  (``num_floating_point_operations``) over the H100's dense bf16 peak.

Run: ``python benchmarks/loop_overhead.py [--device cpu|cuda] [--repeat 3] [--steps N]``; prints a
table and writes ``benchmarks/results/loop_overhead.json`` with every run's figures. ``--profile``
also writes a CPU-time cProfile of rank 0 of each run (``*.prof`` and the top functions as text)
next to it; ``--sections`` times the bridge loop's own pieces (``train.py``'s calls: the loss
reduction, the exit checks, the step log, ...) on every rank and prints what each costs a step;
``--loops bare-opt,bridge`` runs only some of the loops.

Speed settings on GPU: the toolkit's loops run the job as a user gets it. The generated job asks for a
GPU (``slurm.gpus_per_node = 1``), so the job file's loader gives it the fast path
(:mod:`bridge_hpc.training.engine.speed_defaults`: megatron-core's fusions, the toolkit's fused kernels, the
bridge loop's steps as one CUDA graph), which the JSON's ``fast_path`` records; the plain bare loop's
job asks for none, so it keeps megatron-core's defaults (unfused). Each speed flag sets its keys
explicitly for the toolkit's loops, on or (``--no-...``) off: ``--fused`` megatron-core's fusions,
``--fused-kernels`` the toolkit's own (``model.fused_kernels``: Triton cross entropy and norms, biases
inside the matrix multiplies), ``--cuda-graph`` the bridge loop's steps as one CUDA graph
(``model.cuda_graph_impl = "full_iteration"``; its clock is then read as each step starts, since a
replayed step does not call the forward step). ``--no-fused --no-fused-kernels --no-cuda-graph`` is
the job without the fast path. ``--pool A.json B.json ...`` runs nothing and compares
the runs of earlier results together (same device, model, steps and loops), as one result.

``--instructions`` (CPU, needs valgrind) measures work instead of time: each loop runs twice per rank
under valgrind's cachegrind (instruction counting only), ``--steps`` and ``--steps`` + 30 steps long,
and the difference over the 30 steps is the instructions a step costs each rank's process (its
threads included; the DataLoader's worker processes not). Unlike the clock on a shared 2-core machine
it repeats to within a fraction of a percent, so it tells whether the loop does more work than the bare
loop; it does not see what costs time without instructions (cache misses, waits, the kernel). A long
copy counts one instruction per byte (valgrind counts ``rep movsb`` so), which overstates copies.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import pstats
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))  # bridge_test_helpers: how a rank is started directly

from indexed_vs_mock import GPT_370M, job_toml, mock_section  # noqa: E402 - the issue's GPU shape, defined once

TINY_JOB = ROOT / "configs" / "local-tiny.toml"
#: NVIDIA H100 SXM dense bf16 peak, FLOP/s (the MFU denominator).
H100_BF16_PEAK = 989e12
TARGET_CPU_OVERHEAD = 0.03
#: ``--instructions``: steps the two runs of each loop differ by.
INSTRUCTION_STEPS = 30
#: ``--fused`` / ``--no-fused``: megatron-core's torch.compile'd fusions, for the toolkit's loops only.
FUSED = ("model.bias_activation_fusion", "model.bias_dropout_fusion", "model.cross_entropy_loss_fusion")
#: ``--cuda-graph`` / ``--no-cuda-graph``: pretrain's steps replay one CUDA graph of their forward and
#: backward (its value on and off; only the bridge loop runs it).
CUDA_GRAPH = ("model.cuda_graph_impl",)
GRAPH_VALUES = {True: '"full_iteration"', False: '"none"'}
#: ``--fused-kernels`` / ``--no-fused-kernels``: the toolkit's own kernels, for the toolkit's loops only.
FUSED_KERNELS = ("model.fused_kernels",)
#: The toolkit's loops run a job on a GPU, which the loader gives the fast path; the plain bare loop's
#: job asks for none (megatron-core's defaults).
ON_GPU, PLAIN = "slurm.gpus_per_node=1", "slurm.gpus_per_node=0"
#: Resamples behind the 95 % interval of the paired overhead (:func:`paired_overhead`).
BOOTSTRAP_RESAMPLES = 2000
#: Steps in ``--kernels``' profiler window (right after the warm-up).
KERNEL_STEPS = 3
#: The issue's GPU target: tokens/s of the toolkit against a bare megatron-core loop.
TARGET_GPU_SPEEDUP = 1.35
#: ... and its MFU (issue 30, with the job's defaults).
TARGET_GPU_MFU = 0.42
#: The loops: a bare loop with the optimizer a user builds, the same loop with the toolkit's
#: optimizer (only the loop then differs from pretrain), and pretrain.
LOOPS = ("bare", "bare-opt", "bridge")
DEFAULTS = {"cpu": {"ranks": 2, "steps": 150, "warmup": 20, "repeat": 3},
            "cuda": {"ranks": 1, "steps": 40, "warmup": 10, "repeat": 2}}


# ---------------------------------------------------------------------------------------------
# Worker side (one process per rank, under torchrun)
# ---------------------------------------------------------------------------------------------


class StepClock:
    """Reads the clock at the first micro-batch of every step, around whatever produces the batch
    (the toolkit's forward step, or the bare loop's), so both loops are timed at the same point.

    On GPU the device is synchronized only at the steady window's first and last step: the host
    may run ahead in between, and the window's elapsed time is still the device's."""

    def __init__(self, microbatches: int, window: tuple, cuda: bool, inner: Optional[Callable] = None):
        self.microbatches = microbatches
        self.window = window
        self.cuda = cuda
        self.inner = inner
        self.calls = 0
        self.stamps: List[float] = []
        #: This process's CPU seconds (all its threads) at the same points: the work a step costs,
        #: which other load on a shared machine disturbs far less than the wall clock.
        self.cpu_stamps: List[float] = []
        #: ``--kernels``: (first step, step after the last, output file) of a torch.profiler window.
        self.kernels: Optional[tuple] = None
        self._profiler = None

    def _kernel_window(self, step: int) -> None:
        """Start or end ``--kernels``' torch.profiler window at the start of ``step``; at its end the
        top operators and kernels by self time (device time on GPU) go to the output file."""
        import torch

        first, end, path = self.kernels
        if step == first:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
        elif step == end and self._profiler is not None:
            if self.cuda:
                torch.cuda.synchronize()
            self._profiler.__exit__(None, None, None)
            # Device time says which kernels fill the GPU; host time says where a launch-bound step goes.
            sorts = ["self_device_time_total", "self_cpu_time_total"] if self.cuda else ["self_cpu_time_total"]
            averages = self._profiler.key_averages()
            Path(path).write_text("".join(f"{end - first} steps (steps {first}..{end - 1}), sorted by {sort}\n"
                                          f"{averages.table(sort_by=sort, row_limit=50)}\n\n" for sort in sorts))
            self._profiler = None

    def tick(self) -> None:
        if self.calls % self.microbatches == 0:
            if self.cuda and len(self.stamps) in self.window:
                import torch

                torch.cuda.synchronize()
            if self.kernels is not None:
                self._kernel_window(len(self.stamps))
            self.stamps.append(time.perf_counter())
            self.cpu_stamps.append(time.process_time())
        self.calls += 1

    def __call__(self, state, data_iterator, model):
        """Bridge's forward-step signature (``state`` first: the loop injects the GlobalState)."""
        self.tick()
        return self.inner(state, data_iterator, model)


def _load_training_config(job: str, overrides: List[str]):
    """The run's ConfigContainer as the ranks build it, evaluation and checkpoints off."""
    from bridge_hpc.jobfile.jobconfig import load_job_config

    cfg = load_job_config(job, overrides).training
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.checkpoint.save_interval = None
    cfg.validation.eval_interval = 0
    return cfg


def _world() -> tuple:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


#: What the toolkit's loop does around the calls a bare loop makes too, by the names ``train.py``
#: calls them (those it has): each is timed when ``--sections`` is given.
#: The rider's methods (bridge_hpc.training.engine.grad_reduce_rider), timed as ``GradReduceRider.<name>``.
RIDER_SECTIONS = ("load", "take")
LOOP_SECTIONS = ("train_step", "start_reduce_loss_dicts_and_flags", "validate_loss", "checkpoint_and_decide_exit", "training_log",
                 "_count_step", "post_training_step_callbacks", "zero_grads", "finalize_grads")


def time_sections(module, names, totals: Dict[str, List[float]]) -> None:
    """Wrap ``module``'s functions ``names`` (those it has; ``module`` may be a class, whose methods are
    then timed as ``Class.name``) to add their wall and CPU seconds to ``totals[name]``
    (``[calls, wall_s, cpu_s]``). Benchmark instrumentation: a few µs a call."""
    import functools

    for name in names:
        if name not in vars(module):
            continue
        inner = vars(module)[name]
        key = f"{module.__name__}.{name}" if isinstance(module, type) else name
        totals[key] = [0, 0.0, 0.0]

        def timed(*args, __inner=inner, __total=totals[key], **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return __inner(*args, **kwargs)
            finally:
                __total[0] += 1
                __total[1] += time.perf_counter() - wall
                __total[2] += time.process_time() - cpu

        setattr(module, name, functools.wraps(inner)(timed))


def bridge_worker(cfg, clock: StepClock, sections: Optional[Dict[str, List[float]]] = None) -> List[float]:
    """``pretrain`` with the toolkit's GPT step behind ``clock``; returns the losses of metrics.jsonl.
    ``sections``: time the loop's own pieces (:data:`LOOP_SECTIONS`) into it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bridge_hpc.training.gpt_step import forward_step
    from bridge_hpc.training.pretrain import pretrain

    if sections is not None:
        from bridge_hpc.training import train as train_module

        time_sections(train_module, LOOP_SECTIONS, sections)
        if importlib.util.find_spec("bridge_hpc.training.resilience.rerun") is not None:  # the result validation, where present
            from bridge_hpc.training.resilience import rerun

            time_sections(rerun, ("validate_loss",), sections)
        from bridge_hpc.training.engine.grad_reduce_rider import GradReduceRider

        time_sections(GradReduceRider, RIDER_SECTIONS, sections)
    if cfg.model.cuda_graph_impl != "none":
        # A replayed step does not call the forward step (the graph repeats its kernels), so the clock
        # is read as each step starts instead, before its gradients are zeroed: the same point a step
        # later, so the steady window's length is unchanged.
        from bridge_hpc.training import train as train_module

        step = train_module.train_step
        clock.microbatches = 1

        def clocked_train_step(*args, **kwargs):
            clock.tick()
            return step(*args, **kwargs)

        train_module.train_step = clocked_train_step
        pretrain(cfg, forward_step)
    else:
        clock.inner = forward_step
        pretrain(cfg, clock)
    if dist.is_initialized():  # pretrain ends the process group it brought up itself (Bridge's rule)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    if _world()[0] != 0:
        return []
    with open(cfg.logger.metrics_file, encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def bare_worker(cfg, clock: StepClock, cuda: bool, toolkit_optimizer: bool) -> List[float]:
    """The same model, data and megatron-core calls in a plain loop; returns the losses.

    ``toolkit_optimizer``: the optimizer the toolkit builds (``setup_optimizer``, whatever faster
    step it installs), so that only the loop differs from ``pretrain``; else the optimizer a user
    builds from megatron-core (GPU) or torch (CPU) directly."""
    import inspect
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from torch.utils.data import DataLoader

    from bridge_hpc.training.datasets.builders import MockGPTDataset
    from bridge_hpc.training.engine.collectives import reduce_loss_dicts
    from bridge_hpc.training.engine.model import gpt_model_provider
    from bridge_hpc.training.losses import masked_token_loss
    from bridge_hpc.training.pretrain import megatron_ddp_config

    rank, world, local_rank = _world()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    cfg.validate(world)
    parallel_state.initialize_model_parallel(1, 1)
    seed = cfg.rng.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    m, o, t, s = cfg.model, cfg.optimizer, cfg.train, cfg.scheduler
    model = gpt_model_provider(m)
    if cuda:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        if m.bf16 or m.fp16:
            model = Float16Module(model.config, model)
        model = DistributedDataParallel(config=model.config, module=model, ddp_config=megatron_ddp_config(cfg.ddp))
        if not toolkit_optimizer:
            dtype = torch.bfloat16 if o.bf16 else torch.float16 if o.fp16 else torch.float32
            optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, sgd_momentum=o.sgd_momentum,
                clip_grad=o.clip_grad, bf16=o.bf16, fp16=o.fp16, params_dtype=dtype,
                use_distributed_optimizer=o.use_distributed_optimizer), [model])
    else:
        # As the toolkit on CPU: no buffer sync in forward (torch 2.13 renamed the option).
        names = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}
        model = torch.nn.parallel.DistributedDataParallel(model, **no_sync)
    if toolkit_optimizer:
        from bridge_hpc.training.pretrain import setup_optimizer

        optimizer = setup_optimizer(cfg, [model])
    elif not cuda:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.ndim > 1], "wd_mult": 1.0, "lr_mult": 1.0},
                  {"params": [p for p in params if p.ndim <= 1], "wd_mult": 0.0, "lr_mult": 1.0}]
        if o.optimizer == "adam":
            torch_optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                                weight_decay=o.weight_decay)
        else:
            torch_optimizer = torch.optim.SGD(groups, lr=o.lr, momentum=o.sgd_momentum, weight_decay=o.weight_decay)
        optimizer = _PlainStep(torch_optimizer, params, o.clip_grad)
    gbs = t.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=s.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=s.lr_warmup_iters * gbs,
        lr_decay_steps=max(s.lr_decay_iters, 1) * gbs, lr_decay_style=s.lr_decay_style, start_wd=s.start_weight_decay,
        end_wd=s.end_weight_decay, wd_incr_steps=max(t.train_iters, 1) * gbs, wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
        wsd_decay_steps=s.lr_wsd_decay_iters * gbs if s.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=s.lr_wsd_decay_style)

    # This rank's samples of every micro-batch, in the order the toolkit's sampler reads them.
    mbs, steps, dp = t.micro_batch_size, t.train_iters, world
    microbatches = gbs // (mbs * dp)
    dataset = MockGPTDataset(steps * gbs, m.seq_length, cfg.dataset.vocab_size, cfg.dataset.random_seed, "train")
    batches = [[i * mbs * dp + rank * mbs + j for j in range(mbs)] for i in range(steps * microbatches)]
    workers = cfg.dataset.num_workers
    # A private generator, as the toolkit's: drawing the loader's seed from the global RNG would
    # shift the dropout stream and the losses with it.
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=workers, pin_memory=cuda and cfg.dataset.pin_memory,
                        persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    data = iter(loader)
    reports: List[List[Any]] = []
    model.train()
    for _ in range(steps):
        if cuda:
            model.zero_grad_buffer()
        optimizer.zero_grad()
        step_reports = []
        for k in range(microbatches):
            clock.tick()
            batch = {key: value.to(device, non_blocking=True) for key, value in next(data).items()}
            sync = model.no_sync() if k < microbatches - 1 else _nothing()
            with sync:
                output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                loss, num_tokens, report = masked_token_loss(batch["loss_mask"], output)
                (loss / torch.clamp(num_tokens, min=1) / microbatches).backward()
            step_reports.append(report)
        if cuda:
            finalize_model_grads([model])
        update_successful = optimizer.step()[0]
        if update_successful:
            scheduler.step(increment=gbs)
        reports.append(step_reports)
    # After the timed loop: the losses, reduced as the toolkit's loop reduces them every step.
    group = parallel_state.get_data_parallel_group()
    losses = [float(reduce_loss_dicts(r, group)["lm loss"]) for r in reports]
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return losses


class _PlainStep:
    """A torch optimizer with clipping, as a user writes it; ``step()`` answers as megatron's does."""

    def __init__(self, optimizer, params, clip_grad: float):
        self.optimizer, self.params, self.clip_grad = optimizer, params, clip_grad
        self.param_groups = optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> tuple:
        import torch

        if self.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad)
        self.optimizer.step()
        return True, None, None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def worker_main(args: argparse.Namespace) -> int:
    import torch

    rank, world, _ = _world()
    cuda = args.device == "cuda"
    cfg = _load_training_config(args.job, args.set)
    t = cfg.train
    microbatches = t.global_batch_size // (t.micro_batch_size * world)
    clock = StepClock(microbatches, (args.warmup, t.train_iters - 1), cuda)
    if args.kernels and rank == 0:
        clock.kernels = (args.warmup, args.warmup + KERNEL_STEPS, args.out + ".kernels.txt")
    # The heavy imports first, so that a profile shows the run rather than the imports.
    import megatron.core.optimizer  # noqa: F401

    import bridge_hpc.training.pretrain  # noqa: F401

    # CPU time, not wall time: waits (collectives, the loader) then count as nothing, and other
    # load on the machine does not land on whatever function happened to be running.
    profiler = cProfile.Profile(time.process_time) if args.profile and rank == 0 else None
    if profiler is not None:
        profiler.enable()
    sections: Optional[Dict[str, List[float]]] = {} if args.sections else None
    if args.worker == "bridge":
        losses = bridge_worker(cfg, clock, sections)
    else:
        losses = bare_worker(cfg, clock, cuda, toolkit_optimizer=args.worker == "bare-opt")
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.out + ".prof")
        with open(args.out + ".prof.txt", "w") as f:
            stats = pstats.Stats(profiler, stream=f).sort_stats("tottime")
            stats.print_stats(40)
    Path(f"{args.out}.rank{rank}").write_text(json.dumps({"stamps": clock.stamps, "cpu_stamps": clock.cpu_stamps,
                                                          "sections": sections}))
    if rank == 0:
        from bridge_hpc.training.utils.train_utils import num_floating_point_operations

        result = {"kind": args.worker, "world_size": world, "optimizer_config": cfg.to_dict()["optimizer"],
                  "microbatches": microbatches, "stamps": clock.stamps,
                  "losses": losses, "tokens_per_step": t.global_batch_size * cfg.model.seq_length,
                  "flops_per_step": num_floating_point_operations(cfg, t.global_batch_size),
                  "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
        Path(args.out).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------


def run_one(kind: str, device: str, ranks: int, job: Path, overrides: List[str], warmup: int, out: Path,
            profile: bool, sections: bool, kernels: bool = False) -> Dict[str, Any]:
    """One torchrun of ``kind`` (one of :data:`LOOPS`); returns the run's figures."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           str(Path(__file__).resolve()), "--worker", kind, "--device", device, "--job", str(job),
           "--warmup", str(warmup), "--out", str(out)] + [f"--set={item}" for item in overrides]
    if profile:
        cmd.append("--profile")
    if sections:
        cmd.append("--sections")
    if kernels:
        cmd.append("--kernels")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-6000:]}")
    return run_figures(kind, device, out, warmup, wall, sections)


def run_figures(kind: str, device: str, out: Path, warmup: int, wall: float, sections: bool = False) -> Dict[str, Any]:
    """The figures of a finished run of ``kind`` from the files its ranks wrote at ``out``
    (``wall``: the run's seconds, launch included)."""
    raw = json.loads(out.read_text())
    stamps = raw["stamps"]
    intervals = [b - a for a, b in zip(stamps, stamps[1:])]
    steady = intervals[warmup:]
    window_s = stamps[-1] - stamps[warmup]
    tokens = raw["tokens_per_step"]
    # CPU seconds per steady step, each rank's, and their mean.
    cpu, by_rank_sections = [], []
    for rank in range(raw["world_size"]):
        ranked = json.loads(Path(f"{out}.rank{rank}").read_text())
        c = ranked["cpu_stamps"]
        cpu.append((c[-1] - c[warmup]) / (len(c) - 1 - warmup))
        by_rank_sections.append(ranked["sections"])
    result = {
        "kind": kind, "wall_s": wall, "steps_timed": len(steady), "window_s": window_s,
        "tokens_per_s": tokens * len(steady) / window_s,
        "median_step_s": statistics.median(steady),
        "median_step_tokens_per_s": tokens / statistics.median(steady),
        "p10_step_tokens_per_s": tokens / statistics.quantiles(steady, n=10)[0],
        "cpu_s_per_step": statistics.mean(cpu), "cpu_s_per_step_by_rank": cpu,
        "step_s": intervals, "losses": raw["losses"], "tokens_per_step": tokens,
        "flops_per_step": raw["flops_per_step"], "peak_allocated_gib": raw["peak_allocated_gib"],
        "world_size": raw["world_size"], "microbatches": raw["microbatches"],
        "optimizer_config": raw["optimizer_config"],
        # Whole run (warm-up included), per rank: {section: [calls, wall s, CPU s]}.
        "sections_by_rank": by_rank_sections if sections and kind == "bridge" else None,
    }
    if device == "cuda":
        result["tflops_per_s"] = raw["flops_per_step"] * len(steady) / window_s / 1e12
        result["mfu"] = result["tflops_per_s"] * 1e12 / H100_BF16_PEAK
    return result


def speed_overrides(fused: Optional[bool], cuda_graph: Optional[bool], fused_kernels: Optional[bool]) -> List[str]:
    """The ``--set`` items of the speed flags: each flag given sets its keys on or off; a flag left out
    leaves them to the job's fast path."""
    out = []
    for keys, on in ((FUSED, fused), (FUSED_KERNELS, fused_kernels)):
        if on is not None:
            out += [f"{key}={'true' if on else 'false'}" for key in keys]
    if cuda_graph is not None:
        out += [f"{CUDA_GRAPH[0]}={GRAPH_VALUES[cuda_graph]}"]
    return out


def benchmark(device: str, ranks: int, steps: int, warmup: int, repeat: int, tmp: Path,
              profile_dir: Optional[Path], kinds: tuple = LOOPS, sections: bool = False,
              profile: bool = False, kernels: bool = False, fused: Optional[bool] = None,
              cuda_graph: Optional[bool] = None, fused_kernels: Optional[bool] = None) -> Dict[str, Any]:
    if steps < warmup + max(3, KERNEL_STEPS + 1 if kernels else 0):
        raise SystemExit(f"--steps ({steps}) must exceed --warmup ({warmup}) by at least "
                         f"{max(3, KERNEL_STEPS + 1 if kernels else 0)}")
    common = [f"train.train_iters={steps}", "train.eval_interval=0"]
    if device == "cpu":
        job = TINY_JOB
        shape = "configs/local-tiny.toml's model and batch"
    else:
        job = tmp / "gpt370m.toml"
        job.write_text(job_toml(GPT_370M, steps, tmp / "unused", mock_section(GPT_370M), gpu=True))
        shape = "370M GPT, seq 2048 x micro-batch 8, bf16, adam"
    speed = speed_overrides(fused, cuda_graph, fused_kernels)
    toolkit = ([ON_GPU] if device == "cuda" else []) + speed
    fast_path = None
    if device == "cuda":
        from bridge_hpc.jobfile.jobconfig import load_job_config

        fast_path = load_job_config(job, common + toolkit, cwd=tmp).training.fast_path.line()
    runs: List[Dict[str, Any]] = []
    for i in range(repeat):
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):
            name = f"{kind}{i}"
            overrides = (common + [f'job.run_dir="{tmp / name}"']
                         + (toolkit if kind != "bare" else [PLAIN] if device == "cuda" else []))
            out = (profile_dir / f"loop_overhead_{name}.json") if profile_dir else tmp / f"{name}.json"
            run = run_one(kind, device, ranks, job, overrides, warmup, out, profile, sections, kernels)
            run["run"] = len(runs)
            runs.append(run)
            print(f"[loop-overhead] {kind} run {i + 1}/{repeat}: {run['tokens_per_s']:,.0f} tokens/s "
                  f"(median step {run['median_step_s'] * 1e3:.1f} ms, CPU {run['cpu_s_per_step'] * 1e3:.1f} ms/step, "
                  f"{run['wall_s']:.0f} s wall)", file=sys.stderr, flush=True)
    meta = {"device": _device_name(device), "shape": shape, "ranks": ranks, "steps": steps, "warmup": warmup,
            "repeat": repeat, "speed_flags": speed, "fast_path": fast_path}
    return summarize(runs, kinds, meta, sections)


def summarize(runs: List[Dict[str, Any]], kinds: tuple, meta: Dict[str, Any], sections: bool = False) -> Dict[str, Any]:
    """The result of ``runs`` (each loop's medians over its runs, the comparisons, the runs themselves)
    under ``meta`` (what was run: device, shape, ranks, steps, ...)."""
    gpu = not meta["device"].startswith("cpu")
    by = {kind: [r for r in runs if r["kind"] == kind] for kind in kinds}
    loops = {}
    for kind, rs in by.items():
        loops[kind] = {key: statistics.median(r[key] for r in rs)
                       for key in ("tokens_per_s", "median_step_tokens_per_s", "p10_step_tokens_per_s",
                                   "cpu_s_per_step")}
        loops[kind]["losses_repeatable"] = all(r["losses"] == rs[0]["losses"] for r in rs)
        loops[kind]["optimizer_config"] = rs[0]["optimizer_config"]
        if gpu:
            loops[kind]["tflops_per_s"] = statistics.median(r["tflops_per_s"] for r in rs)
            loops[kind]["mfu"] = statistics.median(r["mfu"] for r in rs)
            loops[kind]["peak_allocated_gib"] = max(r["peak_allocated_gib"] for r in rs)
    result: Dict[str, Any] = {**meta, "order": [r["kind"] for r in runs], "loops": loops}
    if "bridge" in by and "bare-opt" in by:
        # Only the loop differs: the figure the CPU target (<= 3 %) is about; losses should be bitwise equal.
        result["loop_overhead"] = compare(by["bare-opt"], by["bridge"], loops["bare-opt"], loops["bridge"])
        if not gpu:
            result["loop_overhead"]["target"] = TARGET_CPU_OVERHEAD
        result["loop_overhead"]["paired"] = paired_overhead(by["bare-opt"], by["bridge"],
                                                            None if gpu else TARGET_CPU_OVERHEAD)
    if "bridge" in by and "bare" in by:
        # Against the loop a user writes with megatron-core's (GPU) or torch's (CPU) optimizer: the GPU target.
        result["against_bare"] = compare(by["bare"], by["bridge"], loops["bare"], loops["bridge"])
        if gpu:
            result["against_bare"]["target_speedup"] = TARGET_GPU_SPEEDUP
            result["against_bare"]["target_mfu"] = TARGET_GPU_MFU
    if gpu:
        result["peak_flops"] = H100_BF16_PEAK
    if sections and "bridge" in by:
        result["bridge_sections"] = summarize_sections(by["bridge"], meta["steps"])
    result["runs"] = runs
    return result


#: What runs pooled by ``--pool`` must share (their ``repeat`` adds up).
POOLED_ALIKE = ("device", "shape", "ranks", "steps", "warmup", "speed_flags", "fast_path")


def pool(files: List[Path], parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """The runs of earlier result ``files`` as one result. Each file's runs keep their order, so the
    i-th runs of two loops within a file stay paired (:func:`paired_overhead`)."""
    results = []
    for path in files:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            parser.error(f"--pool: {path}: not a loop_overhead.py result ({err})")
        if "runs" not in results[-1] or "loops" not in results[-1]:
            parser.error(f"--pool: {path}: not a loop_overhead.py result (no runs; --instructions results cannot be pooled)")
    first = results[0]
    for path, r in zip(files[1:], results[1:]):
        differ = [key for key in POOLED_ALIKE if r.get(key) != first.get(key)]
        if differ or list(r["loops"]) != list(first["loops"]):
            parser.error(f"--pool: {path} differs from {files[0]} in {', '.join(differ or ['loops'])}: "
                         "only runs of the same benchmark can be pooled")
    runs = [run for r in results for run in r["runs"]]
    meta = {key: first.get(key) for key in POOLED_ALIKE}
    meta["repeat"] = sum(r["repeat"] for r in results)
    meta["pooled_from"] = [str(path) for path in files]
    return summarize(runs, tuple(first["loops"]), meta)


def count_instructions(kind: str, ranks: int, steps: int, tmp: Path) -> List[int]:
    """Instructions each rank's process executed in a ``steps``-step run of ``kind`` on CPU, under
    valgrind's cachegrind without cache simulation; the ranks are started directly (no launcher)."""
    from bridge_test_helpers import direct_rank_env, free_port

    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(direct_rank_env(rank, ranks, port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
               f"--log-file={tmp}/{kind}{steps}.rank{rank}.%p.valgrind", sys.executable, str(Path(__file__).resolve()),
               "--worker", kind, "--device", "cpu", "--job", str(TINY_JOB), "--warmup", "1",
               "--out", str(tmp / f"{kind}{steps}.json"), f"--set=train.train_iters={steps}", "--set=train.eval_interval=0",
               f'--set=job.run_dir="{tmp / f"{kind}{steps}"}"']
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    counts = []
    for rank, proc in enumerate(procs):
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{kind} rank {rank} under valgrind failed ({proc.returncode}):\n{err[-3000:]}")
        log = (tmp / f"{kind}{steps}.rank{rank}.{proc.pid}.valgrind").read_text()
        match = re.search(r"I\s+refs:\s+([\d,]+)", log)
        if match is None:
            raise SystemExit(f"no instruction count in valgrind's log of {kind} rank {rank}:\n{log[-2000:]}")
        counts.append(int(match.group(1).replace(",", "")))
    return counts


def instructions(kinds: tuple, ranks: int, steps: int, tmp: Path) -> Dict[str, Any]:
    """Per loop and rank, instructions a step (:func:`count_instructions` of ``steps`` and
    ``steps`` + :data:`INSTRUCTION_STEPS` steps); overhead against bare-opt per rank and of the rank
    that does most (every step waits for the slowest rank in the gradient all-reduce)."""
    per_step: Dict[str, List[float]] = {}
    for kind in kinds:
        print(f"[loop-overhead] {kind}: counting instructions of {steps} and {steps + INSTRUCTION_STEPS} steps "
              f"under valgrind (minutes)", file=sys.stderr, flush=True)
        short = count_instructions(kind, ranks, steps, tmp)
        long = count_instructions(kind, ranks, steps + INSTRUCTION_STEPS, tmp)
        per_step[kind] = [(b - a) / INSTRUCTION_STEPS for a, b in zip(short, long)]
    out: Dict[str, Any] = {"steps": [steps, steps + INSTRUCTION_STEPS], "per_step_by_rank": per_step}
    if "bridge" in per_step and "bare-opt" in per_step:
        ref, loop = per_step["bare-opt"], per_step["bridge"]
        out["overhead_by_rank"] = [b / a - 1 for a, b in zip(ref, loop)]
        out["overhead_slowest_rank"] = max(loop) / max(ref) - 1
    return out


def print_instructions(r: Dict[str, Any]) -> None:
    print(f"\ninstructions a step, each rank's process (valgrind, runs of {r['steps'][0]} and {r['steps'][1]} steps):\n")
    ranks = len(next(iter(r["per_step_by_rank"].values())))
    print("| loop | " + " | ".join(f"rank {i}" for i in range(ranks)) + " |\n|" + " --- |" * (ranks + 1))
    for kind, values in r["per_step_by_rank"].items():
        print(f"| {kind} | " + " | ".join(f"{v / 1e6:.2f} M" for v in values) + " |")
    if "overhead_by_rank" in r:
        by_rank = ", ".join(f"rank {i} {x:+.1%}" for i, x in enumerate(r["overhead_by_rank"]))
        print(f"\nbridge against bare-opt, in instructions: {by_rank}; the rank doing most {r['overhead_slowest_rank']:+.1%}")

#: Sections a bare loop has no counterpart of (zero_grads and finalize_grads it does too). On CPU
#: ranks the losses and flags are packed for the gradient all-reduce (GradReduceRider.load) instead
#: of reduced on their own (start_reduce_loss_dicts_and_flags).
OWN_SECTIONS = ("start_reduce_loss_dicts_and_flags", "GradReduceRider.load", "GradReduceRider.take", "validate_loss",
                "checkpoint_and_decide_exit", "training_log", "_count_step", "post_training_step_callbacks")


def summarize_sections(runs: List[Dict[str, Any]], steps: int) -> Dict[str, Any]:
    """Per section: calls, wall and CPU milliseconds per step, the mean over runs and ranks; and
    ``own``, the sum of :data:`OWN_SECTIONS` (what the bare loop does not do at all)."""
    samples = [ranked for r in runs for ranked in r["sections_by_rank"]]
    out: Dict[str, Any] = {}
    for name in samples[0]:
        out[name] = {"calls_per_step": statistics.mean(x[name][0] for x in samples) / steps,
                     "wall_ms_per_step": statistics.mean(x[name][1] for x in samples) / steps * 1e3,
                     "cpu_ms_per_step": statistics.mean(x[name][2] for x in samples) / steps * 1e3}
    own = [name for name in OWN_SECTIONS if name in out]
    out["own"] = {"sections": own, "wall_ms_per_step": sum(out[n]["wall_ms_per_step"] for n in own),
                  "cpu_ms_per_step": sum(out[n]["cpu_ms_per_step"] for n in own)}
    return out


def compare(ref_runs: List[Dict[str, Any]], runs: List[Dict[str, Any]], ref: Dict[str, Any],
            loop: Dict[str, Any]) -> Dict[str, Any]:
    """``loop`` against ``ref``: speed-up (tokens/s ratio) and overhead (ref ÷ loop − 1) by each
    measure, and whether their losses (first runs) agree bit for bit."""
    a, b = ref_runs[0]["losses"], runs[0]["losses"]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    out: Dict[str, Any] = {}
    for key, name in (("tokens_per_s", "window"), ("median_step_tokens_per_s", "median_step"),
                      ("p10_step_tokens_per_s", "p10_step")):
        out[name] = {"speedup": loop[key] / ref[key], "overhead": ref[key] / loop[key] - 1}
    out["cpu_per_step"] = {"overhead": loop["cpu_s_per_step"] / ref["cpu_s_per_step"] - 1}
    out["speedup"], out["overhead"] = out["window"]["speedup"], out["window"]["overhead"]
    out["losses_bitwise_equal"] = len(a) == len(b) and not any(diffs)
    out["losses_max_abs_diff"] = max(diffs) if diffs else None
    out["losses_first_differing_step"] = next((i + 1 for i, d in enumerate(diffs) if d), None)
    return out


def paired_overhead(ref_runs: List[Dict[str, Any]], runs: List[Dict[str, Any]],
                    target: Optional[float] = None) -> Dict[str, Any]:
    """The overhead of each pair of runs (the i-th run of each loop, adjacent in time: runs alternate)
    and a 95 % bootstrap interval of their median.

    On a shared 2-core machine one run against the next swings by several percent either way (the
    same code measured +0.9 % and +4.4 % in runs of 6 pairs), more than the 3 % target: a figure
    without its interval cannot tell the loop from the machine. The interval narrows with
    ``--repeat``; against ``target`` the verdict is "met" (all of it at or below), "missed" (all
    above) or "not settled" (more pairs needed). The resampling is seeded: the same runs give the
    same interval."""
    overheads = [r["tokens_per_s"] / b["tokens_per_s"] - 1 for r, b in zip(ref_runs, runs)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(overheads, k=len(overheads))) for _ in range(BOOTSTRAP_RESAMPLES))
    low, high = medians[int(0.025 * BOOTSTRAP_RESAMPLES)], medians[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]
    out: Dict[str, Any] = {"pairs": len(overheads), "overheads": overheads, "median": statistics.median(overheads),
                           "interval_95": [low, high]}
    if target is not None:
        out["verdict"] = "met" if high <= target else "missed" if low > target else "not settled"
    return out


def _device_name(device: str) -> str:
    if device == "cpu":
        return f"cpu ({os.cpu_count()} cores)"
    import torch

    return torch.cuda.get_device_name()


def print_table(r: Dict[str, Any]) -> None:
    gpu = "peak_flops" in r
    print(f"\nloop overhead on {r['device']}, {r['ranks']} rank(s), {r['shape']}: {r['steps']} steps per run, "
          f"first {r['warmup']} left out, {r['repeat']} runs of each ("
          + (f"pooled from {len(r['pooled_from'])} results" if r.get("pooled_from") else ", ".join(r["order"])) + ")"
          + (f"; the toolkit's loops with {', '.join(r['speed_flags'])}" if r.get("speed_flags") else "")
          + (f"\nthe toolkit's loops' {r['fast_path']}" if r.get("fast_path") else "") + "\n")
    head = ("| loop | tokens/s | median-step tokens/s | fastest-tenth tokens/s | CPU ms/step/rank |"
            + (" TFLOP/s | MFU | peak GiB |" if gpu else ""))
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for kind, x in r["loops"].items():
        row = (f"| {kind} | {x['tokens_per_s']:,.0f} | {x['median_step_tokens_per_s']:,.0f} | "
               f"{x['p10_step_tokens_per_s']:,.0f} | {x['cpu_s_per_step'] * 1e3:.1f} |")
        if gpu:
            row += f" {x['tflops_per_s']:.0f} | {x['mfu']:.1%} | {x['peak_allocated_gib']:.2f} |"
        print(row)
    print()
    for name, title in (("loop_overhead", "bridge against bare-opt (only the loop differs)"),
                        ("against_bare", "bridge against bare")):
        if name not in r:
            continue
        c = r[name]
        target = (f" (target <= {c['target']:.0%})" if "target" in c else
                  f" (target >= {c['target_speedup']:.2f}x)" if "target_speedup" in c else "")
        equal = "bitwise equal" if c["losses_bitwise_equal"] else (
            f"differ from step {c['losses_first_differing_step']} (max |diff| {c['losses_max_abs_diff']:.3g})")
        print(f"{title}: {c['speedup']:.3f}x, overhead {c['overhead']:+.1%}{target}; by median step "
              f"{c['median_step']['overhead']:+.1%}, by fastest tenth {c['p10_step']['overhead']:+.1%}, "
              f"by CPU time {c['cpu_per_step']['overhead']:+.1%}; losses {equal}")
        if "paired" in c:
            p = c["paired"]
            low, high = p["interval_95"]
            verdict = f"; target: {p['verdict']}" if "verdict" in p else ""
            print(f"  by pairs of runs (the i-th of each loop, {p['pairs']} pairs): median {p['median']:+.1%}, "
                  f"95 % interval {low:+.1%} .. {high:+.1%}{verdict}")


def print_sections(r: Dict[str, Any]) -> None:
    sections = r.get("bridge_sections")
    if not sections:
        return
    step_ms = 1e3 * r["loops"]["bridge"]["tokens_per_s"] ** -1 * r["runs"][0]["tokens_per_step"]
    print(f"\nbridge loop's own pieces (mean of runs and ranks, warm-up included; a step is {step_ms:.1f} ms):\n")
    print("| section | calls/step | wall ms/step | CPU ms/step | share of a step (wall) |\n| --- | --- | --- | --- | --- |")
    for name, x in sections.items():
        if name != "own":
            print(f"| {name} | {x['calls_per_step']:.2f} | {x['wall_ms_per_step']:.3f} | {x['cpu_ms_per_step']:.3f} | "
                  f"{x['wall_ms_per_step'] / step_ms:.1%} |")
    own = sections["own"]
    print(f"| own ({' + '.join(own['sections'])}) | | {own['wall_ms_per_step']:.3f} | {own['cpu_ms_per_step']:.3f} | "
          f"{own['wall_ms_per_step'] / step_ms:.1%} |")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available, else cpu")
    p.add_argument("--repeat", type=int, help="runs of each loop, alternating (default: 3 on CPU, 2 on GPU)")
    p.add_argument("--steps", type=int, help="steps per run (default: 150 on CPU, 40 on GPU)")
    p.add_argument("--warmup", type=int, help="steps left out at the start of each run (default: 20 CPU, 10 GPU)")
    p.add_argument("--ranks", type=int, help="processes (default: 2 on CPU, 1 on GPU)")
    p.add_argument("--sections", action="store_true",
                   help="time the bridge loop's own pieces (train.py's calls) on every rank and print them")
    p.add_argument("--loops", default=",".join(LOOPS),
                   help=f"which loops to run, comma-separated (default: {','.join(LOOPS)})")
    p.add_argument("--profile", action="store_true", help="cProfile rank 0 of every run (files next to the JSON)")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                   help="the toolkit's loops (bare-opt, bridge) build the GPT with (--no-fused: without) "
                        f"megatron-core's fused kernels ({', '.join(FUSED)}); default: the job's fast path on GPU; "
                        "the plain bare loop keeps megatron-core's defaults (unfused)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU: the bridge loop runs with (--no-cuda-graph: without) model.cuda_graph_impl = "
                        "\"full_iteration\" (each step's forward and backward replay one CUDA graph, captured after "
                        "3 eager steps); default: the job's fast path")
    p.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU: the toolkit's loops (bare-opt, bridge) run with (--no-fused-kernels: without) "
                        "model.fused_kernels (the toolkit's Triton cross entropy and norms, biases inside the matrix "
                        "multiplies); default: the job's fast path")
    p.add_argument("--kernels", action="store_true",
                   help=f"torch.profiler over {KERNEL_STEPS} steady steps of rank 0 of every run: the top operators "
                        "and kernels by self time, device time on GPU (*.kernels.txt next to the JSON); the profiler "
                        "slows those steps, so the run's speed figures are not comparable")
    p.add_argument("--instructions", action="store_true",
                   help="CPU: count each loop's instructions a step per rank under valgrind instead of timing it "
                        "(deterministic; minutes); writes loop_overhead_instructions.json by default")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "loop_overhead.json")
    p.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                   help="run nothing: compare the runs of earlier result files together (the same device, model, "
                        "steps and loops), so that runs of several invocations settle what one cannot on a noisy machine")
    # Worker mode (internal: one rank, started by torchrun from run_one).
    p.add_argument("--worker", choices=LOOPS, help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        return worker_main(args)
    if args.pool:
        if args.json.resolve() in {path.resolve() for path in args.pool}:
            p.error(f"--json {args.json} is one of the results to pool: name another file to write")
        result = pool(args.pool, p)
        print_table(result)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.json}")
        return 0
    kinds = tuple(k for k in LOOPS if k in args.loops.split(","))
    unknown = set(args.loops.split(",")) - set(LOOPS)
    if unknown or not kinds:
        p.error(f"--loops: expected some of {', '.join(LOOPS)}, got {args.loops!r}")
    d = DEFAULTS[args.device]
    steps, warmup = args.steps or d["steps"], d["warmup"] if args.warmup is None else args.warmup
    if args.steps and args.warmup is None:
        warmup = min(warmup, max(1, steps // 5))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    if args.instructions:
        if args.device != "cpu" or shutil.which("valgrind") is None:
            p.error("--instructions: CPU only, and needs valgrind (apt install valgrind)")
        if args.json == p.get_default("json"):
            args.json = args.json.with_name("loop_overhead_instructions.json")
        with tempfile.TemporaryDirectory(prefix="loop-overhead-", dir=os.environ.get("BENCH_TMP")) as tmp:
            result = instructions(kinds, args.ranks or d["ranks"], args.steps or 20, Path(tmp))
        print_instructions(result)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.json}")
        return 0
    profile_dir = args.json.parent if args.profile or args.kernels else None
    with tempfile.TemporaryDirectory(prefix="loop-overhead-", dir=os.environ.get("BENCH_TMP")) as tmp:
        result = benchmark(args.device, args.ranks or d["ranks"], steps, warmup, args.repeat or d["repeat"],
                           Path(tmp), profile_dir, kinds, args.sections, args.profile, args.kernels, args.fused,
                           args.cuda_graph, args.fused_kernels)
    print_table(result)
    print_sections(result)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
