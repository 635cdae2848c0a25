"""Training steps replayed as one CUDA graph (``model.cuda_graph_impl = "full_iteration"``) on one GPU;
skipped without CUDA.

* The tiny GPT of tests/data/tiny.toml (dropout on) trains to the same losses and gradient norms
  with the graph as without it, bit for bit: the graph is captured after the eager warm-up steps
  and replays the same kernels on the same static inputs, with the dropout generator registered.
* SIGUSR1 in a run with the graph: it saves, exits, and the resumed run (eager again for its
  warm-up steps, then a new capture) reproduces the uninterrupted graph run bit for bit.
* Asynchronous saves while the graph replays leave the losses unchanged.
* On 2 GPUs (skipped with fewer), data-parallel training with the overlapped gradient reduce, with
  and without the distributed optimizer, replays to bitwise the same losses as eager steps.
* A replayed step's loss is checked after the replay: the loss the check sees is the replay's own
  value, so a NaN in a replayed step is caught before the optimizer step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from bridge_test_helpers import direct_rank_env, free_port, kill_tree, run_one_gpu_rank, set_args, tiny_job, tiny_run_dir

from bridge_hpc.contracts import run_folder
from bridge_hpc.training.engine.metrics import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GRAPH = ('model.cuda_graph_impl="full_iteration"',)
CAPTURED = "full-iteration CUDA graph captured after 3 eager steps"
RUN_TIMEOUT_S = 240



def _trained(job: str) -> dict:
    records = read_metrics(os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE))
    return {step: (r["loss"], r["grad_norm"]) for step, r in records.items()}


@pytest.fixture(scope="module")
def graph_run(tmp_path_factory):
    """40 steps of the tiny GPT with the graph, uninterrupted: (losses, output)."""
    job = tiny_job(tmp_path_factory.mktemp("graph"))
    out = run_one_gpu_rank(job, *GRAPH, timeout_s=RUN_TIMEOUT_S)
    return _trained(job), out


def test_graph_steps_train_bit_for_bit_as_eager_steps(graph_run, tmp_path):
    graphed, out = graph_run
    assert out.count(CAPTURED) == 1, out[-4000:]
    job = tiny_job(tmp_path / "eager")
    eager_out = run_one_gpu_rank(job, timeout_s=RUN_TIMEOUT_S)
    assert CAPTURED not in eager_out
    eager = _trained(job)
    assert sorted(eager) == list(range(1, 41))
    assert graphed == eager


def test_usr1_with_the_graph_saves_exits_and_resumes_bit_for_bit(graph_run, tmp_path):
    graphed, _ = graph_run
    job = tiny_job(tmp_path / "usr1")
    every_step = ("checkpoint.save_interval=1000",)  # only the exit save
    rank = subprocess.Popen([sys.executable, "-m", "bridge_hpc.rank", *set_args(job, GRAPH + every_step)],
                            cwd=os.path.dirname(job), env=direct_rank_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = os.path.join(tiny_run_dir(job), run_folder.METRICS_FILE)
    deadline = time.time() + RUN_TIMEOUT_S
    while time.time() < deadline and rank.poll() is None:
        if os.path.exists(metrics) and max(read_metrics(metrics), default=0) >= 15:
            break
        time.sleep(0.01)
    assert rank.poll() is None, "the run ended before the signal"
    os.kill(rank.pid, signal.SIGUSR1)
    try:
        out, _ = rank.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(rank)
        pytest.fail("the signalled run did not end")
    assert rank.returncode == 0, out[-6000:]
    assert CAPTURED in out and "signal received" in out, out[-4000:]
    # a synchronous save stages through small pageable buffers (checkpoint/streamed_write.py): no host
    # memory is pinned for it ahead
    assert "of host memory for synchronous saves" not in out, out[-4000:]
    stopped = run_folder.tracked_iteration(os.path.join(tiny_run_dir(job), run_folder.CHECKPOINTS_DIR))
    assert 15 <= stopped < 40

    # the requeued run: eager warm-up, then its own capture
    resumed_out = run_one_gpu_rank(job, *GRAPH, *every_step, timeout_s=RUN_TIMEOUT_S)
    assert CAPTURED in resumed_out
    assert _trained(job) == graphed


def test_background_saves_during_graph_replays_change_nothing(graph_run, tmp_path):
    """Asynchronous saves every 5 steps snapshot what the replays wrote (the parameters, the optimizer
    state, the RNG state of the generators the graph registered) and leave the losses bit for bit."""
    graphed, _ = graph_run
    job = tiny_job(tmp_path / "async")
    out = run_one_gpu_rank(job, *GRAPH, "checkpoint.async_save=true", "checkpoint.save_interval=5", timeout_s=RUN_TIMEOUT_S)
    assert out.count("started asynchronous checkpoint save of iteration") >= 6, out[-4000:]
    assert _trained(job) == graphed
    assert run_folder.tracked_iteration(os.path.join(tiny_run_dir(job), run_folder.CHECKPOINTS_DIR)) == 40


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("optimizer", ["ddp.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=true"])
def test_two_data_parallel_gpus_train_bit_for_bit_as_eager_steps(optimizer, tmp_path):
    """DP2 with megatron-core's overlapped gradient reduce (and the distributed optimizer's
    reduce-scatter): the collectives are captured in the graph and replayed."""
    losses = {}
    for name, extra in (("eager", ()), ("graph", GRAPH)):
        job = tiny_job(tmp_path / name)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "-m", "bridge_hpc.rank", *set_args(job, ("ddp.overlap_grad_reduce=true", optimizer) + extra)]
        proc = subprocess.run(cmd, cwd=os.path.dirname(job), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-6000:]
        assert (CAPTURED in proc.stdout) == (name == "graph")
        losses[name] = _trained(job)
    assert sorted(losses["graph"]) == list(range(1, 41))
    assert losses["graph"] == losses["eager"]


def test_a_replayed_steps_loss_is_checked_after_the_replay(one_rank):
    """The check sees each replay's own loss: a NaN batch in a replayed step reaches it."""
    import torch.distributed as dist

    from bridge_hpc.training.config import ConfigContainer
    from bridge_hpc.training.engine.cuda_graphs import FullIterationCudaGraph, run_on_the_capture_stream

    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1, use_cudagraphable_rng=True, tp_rank=0, ep_rank=0, etp_rank=0)
    cfg = ConfigContainer.from_sections({"train": {"train_iters": 10, "micro_batch_size": 1, "global_batch_size": 1},
                                          "optimizer": {"lr": 1e-3}, "model": {"cuda_graph_impl": "full_iteration"}})
    previous_stream = run_on_the_capture_stream()  # as pretrain does before it builds the model
    weight = torch.nn.Parameter(torch.ones(4, device="cuda"))

    def forward_backward(forward_step_func, data_iterator, model, num_microbatches, optimizer=None, validate_loss=None):
        batch = next(data_iterator)
        loss = (batch["x"].cuda(non_blocking=True) * weight).sum()
        validate_loss(loss)
        loss.backward()
        return [{"lm loss": loss.detach().view(1)}]

    graph = FullIterationCudaGraph(forward_backward, cfg, zero_grads=lambda model, optimizer: None)  # captures
    seen = []
    for step in range(8):
        x = torch.full((4,), float("nan") if step == 6 else float(step))
        reports = graph.forward_backward(None, iter([{"x": x}]), [torch.nn.Identity()], 1, None,
                                         lambda loss: seen.append(loss.item()))
        assert reports[0]["lm loss"].item() == seen[-1] or step == 6
        weight.grad = None
    torch.cuda.set_stream(previous_stream)
    assert graph.captured
    assert seen[:6] == [4.0 * s for s in range(6)]
    assert seen[6] != seen[6]  # NaN: the replay's own value reached the check
    assert seen[7] == 28.0
