"""The training step's forward and backward as one CUDA graph (``model.cuda_graph_impl = "full_iteration"``).

Why: with megatron-core's fusions the GPU finishes a 370 M GPT's step faster than one Python thread
can launch its thousands of kernels, so the step waits on the host (README > Benchmarks). A CUDA graph
launches all of them, recorded once, in one call.

How: megatron-core's :class:`~megatron.core.full_cuda_graph.FullCudaGraphWrapper`, the one Megatron
uses for ``cuda_graph_impl = "full_iteration"``, around :func:`bridge_hpc.training.train.forward_backward`.
The first ``model.cuda_graph_warmup_steps`` steps run eagerly (they compile the fused kernels and
settle the allocator); the next one is captured and every later one replays the capture. Each step's
micro-batches are read from the data iterator as before and copied into static device buffers that
the graph reads (megatron-core's ``StaticBufferLoader``); the parameters, the gradient buffers of
megatron-core's DDP and the RNG state are the graph's other inputs, so the optimizer step, the
checkpoint loads and the rerun state machine's rewinds, all outside the graph, act on what the next
replay reads. The optimizer step, the loss all-reduce and every exit check stay outside the graph.

What a graph cannot hold moves after it: the loss checks (``[rerun_state_machine]``) read each
micro-batch's loss on the host, a device synchronization, which capture forbids. The step records the
losses the loss function returns and checks them once the graph has run, before the optimizer step, so
a NaN still stops the run before it reaches the weights.

A forward step that cannot be captured (it reads a value on the host, synchronizes, or does what
capture forbids in some other way) makes the capture fail: the run falls back to eager steps, once,
logging why (:meth:`FullIterationCudaGraph.forward_backward`). Its results stay exact: the steps
before were eager anyway, and the failed step runs again eagerly on the same micro-batches from the
same state (gradients zeroed again, the random generators as they were before the capture, which
draws from graph-only offsets).

Limits, each refused with the key: by ``GPTModelConfig.finalize`` at submission, and on the ranks by
``ConfigContainer.validate`` (after ``comm_overlap`` may have turned ``ddp.overlap_param_gather`` on) and
:func:`check_config` (no CUDA). CUDA ranks only; no tensor,
pipeline or context parallelism (their batches arrive by broadcast or per stage, not as one dict per
micro-batch); no ``ddp.overlap_param_gather`` (its forward pre-hooks wait on collectives issued outside
the graph). megatron-core's per-layer graphs (``"local"``, ``"transformer_engine"``) are not offered:
the step's launches are what the full graph removes. Evaluation runs eagerly.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from bridge_hpc.contracts.errors import ConfigError

logger = logging.getLogger(__name__)

def check_config(cfg, on_cuda: bool) -> None:
    """On the ranks, refuse the graph where only a rank can tell: without CUDA, naming the key."""
    if cfg.model.full_iteration_cuda_graph and not on_cuda:
        raise ConfigError("CUDA graphs need GPUs, and this rank has none (set model.cuda_graph_impl = \"none\" "
                          "on CPU)", key="model.cuda_graph_impl")


def run_on_the_capture_stream() -> torch.cuda.Stream:
    """Make megatron-core's capture stream this thread's current stream; returns the one it replaces.

    Called before the model is built. Why: autograd gives each parameter's gradient accumulator the
    stream that was current when the accumulator was created, and megatron-core's DDP creates them (and
    keeps them) when it wraps the model. A backward captured on another stream would make that stream,
    the legacy default one, wait on the capturing stream, which CUDA refuses
    (``cudaErrorStreamCaptureImplicit``, seen on an H100). torch's own fix
    (``torch.autograd.graph.set_override_stale_capture_stream``) is newer than the torch the GPUs run.
    With everything on the capture stream, the eager steps, the capture and the replays share one stream.
    """
    from megatron.core.full_cuda_graph import get_shared_capture_stream

    previous = torch.cuda.current_stream()
    stream = get_shared_capture_stream()
    stream.wait_stream(previous)
    torch.cuda.set_stream(stream)
    return previous


def _cuda_generators() -> Dict[Optional[str], torch.Generator]:
    """The random generators a capture registers, as they are now: this device's default one (key
    None; torch registers it itself) and megatron-core's tracker states by name (the wrapper registers
    them; the tracker replaces its generator objects as it forks, so they are looked up each time)."""
    from megatron.core.tensor_parallel.random import get_all_rng_states

    return {None: torch.cuda.default_generators[torch.cuda.current_device()], **get_all_rng_states()}


class FullIterationCudaGraph:
    """One training step's forward and backward over its micro-batches, replayed as one CUDA graph.

    ``forward_backward`` is :func:`bridge_hpc.training.train.forward_backward` (passed in: that module
    builds this one). Megatron-core's wrapper keeps its graphs on the class, one per process; a new
    instance (a new ``train()``, an in-process restart) drops the old graph and captures again.
    """

    def __init__(self, forward_backward: Callable[..., List[Any]], cfg,
                 zero_grads: Callable[[List[torch.nn.Module], Any], None]) -> None:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        check_config(cfg, torch.cuda.is_available())
        self._forward_backward = forward_backward
        self._zero_grads = zero_grads  # train.zero_grads: what a step starts with, again after a failed capture
        #: Why the capture failed, once it has: every later step of this run is eager.
        self.fell_back: Optional[str] = None
        self._seq_length = cfg.model.seq_length
        self._warmup_steps = cfg.model.cuda_graph_warmup_steps
        self._wrapper = FullCudaGraphWrapper(self._recording_losses, cuda_graph_warmup_steps=self._warmup_steps)
        self._wrapper.reset_cuda_graph()

    def _recording_losses(self, *, forward_step_func: Callable, data_iterator, model: List[torch.nn.Module],
                          num_microbatches: int, optimizer, seq_length: int, forward_only: bool):
        """What the graph holds: the micro-batches' forward and backward; each loss the loss function
        returns is kept (a device tensor the replays overwrite) instead of checked."""
        losses: List[torch.Tensor] = []
        iterator = data_iterator[0]  # the wrapper hands each model chunk an iterator over its static buffers
        reports = self._forward_backward(forward_step_func, iterator, model, num_microbatches, optimizer=optimizer,
                                         validate_loss=lambda loss: losses.append(loss.detach()))
        return reports, losses

    def forward_backward(self, forward_step_func: Callable, data_iterator, model: List[torch.nn.Module],
                         num_microbatches: int, optimizer, validate_loss: Callable[[torch.Tensor], None],
                         before_loss_checks: Optional[Callable[[], None]] = None) -> List[Dict[str, torch.Tensor]]:
        """The step's forward and backward (eager while warming up, then captured and replayed); each
        micro-batch's loss is then checked with ``validate_loss``, after ``before_loss_checks`` has
        queued what may run before them (the optimizer step's gradient norm: the checks wait for the
        device, which then has that work too). Returns the loss functions' reports."""
        step = dict(forward_step_func=forward_step_func, model=model, num_microbatches=num_microbatches,
                    optimizer=optimizer, seq_length=self._seq_length, forward_only=False)
        if self.fell_back is not None:
            reports, losses = self._recording_losses(data_iterator=[data_iterator], **step)
        elif self._wrapper.curr_iter("training") == self._warmup_steps:
            reports, losses = self._capture(data_iterator, step)
        else:
            reports, losses = self._wrapper(data_iterator=data_iterator, **step)
        losses = [loss.clone() for loss in losses]  # copies: the next replay overwrites the graph's own
        if before_loss_checks is not None:
            before_loss_checks()
        for loss in losses:
            validate_loss(loss)
        return reports

    def _capture(self, data_iterator, step: Dict[str, Any]):
        """Capture the step (and replay it), or, where the capture fails, fall back to eager steps:
        this step runs again eagerly on the micro-batches the capture read, from the state before it."""
        batches = [next(data_iterator) for _ in range(step["num_microbatches"])]  # read as the wrapper would
        before = {name: generator.clone_state() for name, generator in _cuda_generators().items()}
        stream = torch.cuda.current_stream()
        # The eager steps' activations go back to the device before the graph takes its own pool.
        torch.cuda.empty_cache()
        started = time.perf_counter()
        try:
            reports, losses = self._wrapper(data_iterator=iter(batches), **step)
        except Exception as err:  # noqa: BLE001 - any failure of the capture: the step runs eagerly instead
            while err.__context__ is not None:  # what failed first (ending the failed capture fails too)
                err = err.__context__
            self.fell_back = f"{type(err).__name__}: {str(err).strip()}".splitlines()[0]
        else:
            logger.info("full-iteration CUDA graph captured after %d eager steps of this run (%.2fs, %.2f GiB "
                        "reserved); later steps replay it", self._warmup_steps, time.perf_counter() - started,
                        torch.cuda.memory_reserved() / 2**30)
            return reports, losses
        # A failed capture may leave the capture stream current and the generators in capture mode;
        # what it recorded (kernels, offsets, gradient-bucket bookkeeping) never ran.
        torch.cuda.set_stream(stream)
        now = _cuda_generators()
        for name, state in before.items():
            now[name].graphsafe_set_state(state)
        self._wrapper.reset_cuda_graph()
        gc.collect()
        torch.cuda.empty_cache()
        self._zero_grads(step["model"], step["optimizer"])
        # One line for the job: every rank runs the same forward step, so every rank fails alike.
        (logger.warning if torch.distributed.get_rank() == 0 else logger.debug)(
            "the step cannot be captured as a CUDA graph (%s): this run's steps stay eager "
            "(model.cuda_graph_impl = \"none\" skips the attempt)", self.fell_back)
        return self._recording_losses(data_iterator=[iter(batches)], **step)

    @property
    def captured(self) -> bool:
        """Whether the step is captured (later steps replay it)."""
        return self._wrapper.cuda_graph["training"] is not None
