"""A checkpoint worker that dies where the rank waits on it without a time limit.

On a GPU, an async save's request carries a preload function: the worker first copies the tensors
to host memory, and nvidia-resiliency-ext's queue waits, with no time limit, until the worker says
it has. A worker that died before (killed while idle between two saves) or during that copy hung the
rank forever (tests/test_gpu_checkpoint.py's killed-worker test, on an H200). Here the real writer
and worker on CPU, with a request whose preload function kills the worker (``os.abort``) or with the
worker killed while idle: the save fails at once, naming how the worker died, and ``discard`` starts
a new worker that then writes the next request.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from bridge_test_helpers import free_port

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from types import SimpleNamespace

    import torch.distributed as dist

    from bridge_hpc.training.checkpoint.async_writer import AsyncCheckpointWriter, CheckpointWorkerDied, PendingSave

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%(port)d", rank=0, world_size=1)
    writer = AsyncCheckpointWriter(("SIGUSR1",), on_gpu=False).start()
    deadline = time.time() + 120
    while not writer.idle():  # the worker's start-up request is done
        assert time.time() < deadline, "the checkpoint worker did not start"
        time.sleep(0.05)

    def pending(iteration, preload_fn):
        request = writer.request_class(print, ("wrote %%d" %% iteration,), [], preload_fn=preload_fn)
        return PendingSave(save=SimpleNamespace(iteration=iteration), request=request, finalize=lambda: None,
                           results_queue=None)

    def fails(save, how):
        began = time.time()
        writer.submit(save)
        waited = time.time() - began
        assert waited < 30, waited
        assert writer.check(blocking=True)
        assert isinstance(save.error, CheckpointWorkerDied) and how in str(save.error), save.error
        print("failed:", save.error, flush=True)
        old = writer.worker.pid
        writer.discard()  # a new worker replaces the dead one
        assert writer.worker.pid != old and writer.pending is None

    mode = sys.argv[1]
    if mode == "dies-while-staging":
        fails(pending(8, os.abort), "killed by SIGABRT")
    else:  # killed while idle, then a save with a preload function
        os.kill(writer.worker.pid, signal.SIGKILL)
        writer.worker.join(10)
        fails(pending(8, os.getpid), "killed by SIGKILL")
    # the new worker writes the next save
    ok = pending(16, None)
    writer.submit(ok)
    assert writer.check(blocking=True) and ok.error is None, ok.error
    writer.close()
    dist.destroy_process_group()
    print("done", flush=True)
""")


def _run(mode: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT % {"port": free_port()}, mode], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_a_worker_that_dies_while_staging_a_save_fails_it_instead_of_hanging_the_rank():
    out = _run("dies-while-staging")
    assert "died (killed by SIGABRT) before it wrote its shards" in out, out
    assert "wrote 16" in out and out.rstrip().endswith("done"), out


def test_a_worker_killed_between_saves_fails_the_next_save_instead_of_hanging_the_rank():
    out = _run("killed-while-idle")
    assert "died (killed by SIGKILL) before it wrote its shards" in out, out
    assert "wrote 16" in out and out.rstrip().endswith("done"), out
