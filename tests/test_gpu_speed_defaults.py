"""The fast path a job on GPUs gets by default (issue 30), on one GPU; skipped without CUDA.

The tiny GPT of tests/data/tiny.toml in bf16 (dropout on), its job asking for a GPU
(``slurm.gpus_per_node = 1``), so that the job file's loader chooses megatron-core's fusions, the
toolkit's fused kernels, the full-iteration CUDA graph and asynchronous interval saves
(bridge_hpc.training.engine.speed_defaults):

* its losses equal those of the plain path (the same job asking for no GPUs: eager, unfused,
  synchronous saves) within bf16's tolerance, and rank 0 logs the fast-path line once;
* a run stopped by SIGUSR1 and resumed on the default path reproduces the uninterrupted default run
  bit for bit;
* SIGUSR1 hundreds of steps in, after this run compiled its own kernels, still stops it;
* a forward step that cannot be captured (it reads a loss on the host) falls back to eager steps
  once, with one log line, and trains bit for bit as the same forward step without the graph.

Run: ``python -m pytest -q tests/test_gpu_speed_defaults.py`` (about 4 minutes on an H100).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import List

import pytest
import toml
import torch
from bridge_test_helpers import TINY, direct_rank_env, run_one_gpu_rank, set_args, signal_tree, tiny_job, tiny_run_dir

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.fast_path import LINE_PREFIX
from bridge_hpc.jobfile.jobconfig import dump_resolved, load_job_config
from bridge_hpc.training.config import GPTModelConfig
from bridge_hpc.training.engine import speed_defaults
from bridge_hpc.training.engine.metrics import read_metrics
from bridge_hpc.training.process.signal_recorder import TAKEN_FROM_PYTHON

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16 = ("model.bf16=true", "optimizer.bf16=true")
GPU = ("slurm.gpus_per_node=1",) + BF16
PLAIN = ("slurm.gpus_per_node=0",) + BF16
CAPTURED = "full-iteration CUDA graph captured after 3 eager steps"
FELL_BACK = "the step cannot be captured as a CUDA graph"
#: The tiny GPT's layers stay local: TE's were not measured faster at its size (speed_defaults).
EVERYTHING = ("chosen model.bias_activation_fusion, model.bias_dropout_fusion, model.cross_entropy_loss_fusion, "
              "model.fused_kernels, model.cuda_graph_impl, optimizer.fused_step, checkpoint.async_save; "
              f"not chosen: model.transformer_impl "
              f"({speed_defaults.layers_measured_faster(GPTModelConfig(**toml.load(TINY)['model']))})")
#: bf16 keeps 8 bits of mantissa; fused and unfused kernels round differently, and 40 steps of
#: training carry the differences on (the model-parallel benchmarks use the same bound).
BF16_RTOL = 2e-2
RUN_TIMEOUT_S = 240
#: A forward step that reads each micro-batch's loss on the host: a capture forbids the device
#: synchronization, so its capture fails.
HOST_READ_STEP = '''
from bridge_hpc.training.gpt_step import forward_step as gpt_forward_step

SEEN = []


def forward_step(state, data_iterator, model):
    output, loss_func = gpt_forward_step(state, data_iterator, model)
    SEEN.append(output.detach().float().mean().item())  # a host read
    return output, loss_func
'''



def _losses(job: str) -> dict:
    records = read_metrics(os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE))
    return {step: r["loss"] for step, r in records.items()}


def _fast_path_lines(out: str) -> List[str]:
    return [line[line.index(LINE_PREFIX):] for line in out.splitlines() if LINE_PREFIX in line]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """40 steps of the tiny GPT on the default path, uninterrupted: (losses, output)."""
    job = tiny_job(tmp_path_factory.mktemp("default"))
    out = run_one_gpu_rank(job, *GPU, timeout_s=RUN_TIMEOUT_S)
    return _losses(job), out


def test_the_default_path_trains_as_the_plain_path_within_bf16(default_run, tmp_path):
    fast, out = default_run
    assert _fast_path_lines(out) == [LINE_PREFIX + EVERYTHING], out[-4000:]
    assert out.count(CAPTURED) == 1 and FELL_BACK not in out, out[-4000:]
    assert out.count("started asynchronous checkpoint save of iteration") >= 3, out[-4000:]
    job = tiny_job(tmp_path / "plain")
    plain_out = run_one_gpu_rank(job, *PLAIN, timeout_s=RUN_TIMEOUT_S)
    assert CAPTURED not in plain_out and "started asynchronous checkpoint save" not in plain_out
    plain = _losses(job)
    assert sorted(fast) == sorted(plain) == list(range(1, 41))
    worst = max(abs(fast[s] - plain[s]) / abs(plain[s]) for s in plain)
    assert worst <= BF16_RTOL, (worst, fast, plain)
    assert fast != plain  # the fused kernels ran: bf16 rounds them differently


def test_a_run_stopped_and_resumed_on_the_default_path_is_bit_exact(default_run, tmp_path):
    fast, _ = default_run
    job = tiny_job(tmp_path / "usr1")
    rank = subprocess.Popen([sys.executable, "-m", "bridge_hpc.rank", *set_args(job, GPU)],
                            cwd=os.path.dirname(job), env={**direct_rank_env(), "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    # The tiny GPT's replayed steps take milliseconds: the metrics file would show step 15 only after
    # the run had ended, so the signal goes out as the capture's line is read, with 37 steps to go.
    # (the watchdog only kills: this thread reads the pipe to its end and reaps the rank)
    watchdog = threading.Timer(RUN_TIMEOUT_S, signal_tree, args=(rank.pid, signal.SIGKILL))
    watchdog.start()
    lines = []
    try:
        for line in rank.stdout:
            lines.append(line)
            if CAPTURED in line:
                os.kill(rank.pid, signal.SIGUSR1)
        rank.wait()
    finally:
        watchdog.cancel()
    out = "".join(lines)
    assert rank.returncode == 0, out[-6000:]
    assert CAPTURED in out and "signal received" in out, out[-4000:]
    stopped = run_folder.tracked_iteration(os.path.join(tiny_run_dir(job), run_folder.CHECKPOINTS_DIR))
    assert 3 < stopped < 40, stopped

    # The requeued run reads the run folder's resolved.toml as a requeued job does: the same choices.
    resolved = os.path.join(tiny_run_dir(job), run_folder.RESOLVED_CONFIG)
    with open(resolved, "w", encoding="utf-8") as f:
        f.write(dump_resolved(load_job_config(job, list(GPU), cwd=os.path.dirname(job))))
    resumed_out = run_one_gpu_rank(resolved, timeout_s=RUN_TIMEOUT_S)
    assert _fast_path_lines(resumed_out) == [LINE_PREFIX + EVERYTHING]
    assert CAPTURED in resumed_out  # eager again for its warm-up, then its own capture
    assert _losses(job) == fast


def test_a_forward_step_that_cannot_be_captured_falls_back_to_eager_once_and_exactly(tmp_path):
    losses = {}
    for name, extra in (("fallback", ()), ("eager", ('model.cuda_graph_impl="none"',))):
        job = tiny_job(tmp_path / name)
        step = os.path.join(os.path.dirname(job), "host_read_step.py")
        with open(step, "w", encoding="utf-8") as f:
            f.write(HOST_READ_STEP)
        out = run_one_gpu_rank(job, *GPU, f'job.forward_step="{step}:forward_step"', *extra, timeout_s=RUN_TIMEOUT_S)
        losses[name] = _losses(job)
        if name == "fallback":
            assert out.count(FELL_BACK) == 1 and CAPTURED not in out, out[-4000:]
            assert "model.cuda_graph_impl" in _fast_path_lines(out)[0].split("; not chosen:")[0]
        else:
            assert FELL_BACK not in out
    assert sorted(losses["fallback"]) == list(range(1, 41))
    assert losses["fallback"] == losses["eager"]


def test_sigusr1_long_after_the_first_compiles_stops_the_default_path(tmp_path):
    """Seen on an H200 (2026-11-29): fast-path ranks trained on through SIGUSR1 sent seconds in, C code
    having replaced the process's handler (tests/test_stop_signal_taken_back.py). Fresh compiler caches
    (Triton's and inductor's), so that this run compiles its kernels itself; SIGUSR1 at step 500 must
    stop it. The rank's warning, if any, names the library that held the signal: printed here."""
    job = tiny_job(tmp_path / "late-usr1")
    env = {**direct_rank_env(), "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    metrics = os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE)
    log = tmp_path / "rank.log"
    with open(log, "w") as sink:  # a file, not a pipe: nothing reads the output while the steps run
        rank = subprocess.Popen([sys.executable, "-m", "bridge_hpc.rank",
                                 *set_args(job, GPU + ("train.train_iters=1000000", "logger.log_interval=1"))],
                                cwd=os.path.dirname(job), env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    watchdog = threading.Timer(RUN_TIMEOUT_S, signal_tree, args=(rank.pid, signal.SIGKILL))
    watchdog.start()
    try:
        while rank.poll() is None and not (os.path.exists(metrics) and len(read_metrics(metrics)) >= 500):
            time.sleep(0.05)
        assert rank.poll() is None, log.read_text()[-4000:]
        os.kill(rank.pid, signal.SIGUSR1)
        rank.wait()
    finally:
        watchdog.cancel()
        if rank.poll() is None:
            signal_tree(rank.pid, signal.SIGKILL)
            rank.wait()
    out = log.read_text()
    print("\n".join(line for line in out.splitlines() if TAKEN_FROM_PYTHON in line))
    assert rank.returncode == 0, out[-6000:]  # killed by the watchdog: it trained on through SIGUSR1
    assert "signal received" in out, out[-4000:]
