"""The checkpoint worker around a run's exit (``checkpoint.async_save``): its staging is warmed up
only where a background save will come, and at the exit decision it is killed without waiting, so
that its teardown overlaps the synchronous exit save; ``close`` then finds it gone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from bridge_test_helpers import free_port

from bridge_hpc.training.checkpoint.async_writer import interval_save_ahead


def _cfg(save_interval, train_iters):
    return SimpleNamespace(checkpoint=SimpleNamespace(save_interval=save_interval),
                           train=SimpleNamespace(train_iters=train_iters))


@pytest.mark.parametrize("save_interval, train_iters, step, ahead", [
    (100, 1000, 1, True),
    (100, 1000, 899, True),
    (100, 1000, 900, False),  # the save at 1000 is the end of training's: synchronous
    (100, 1001, 900, True),
    (1000000, 100000, 5, False),
    (None, 1000, 5, False),
    (0, 1000, 5, False),
])
def test_an_interval_save_is_ahead_only_before_train_iters(save_interval, train_iters, step, ahead):
    assert interval_save_ahead(_cfg(save_interval, train_iters), step) is ahead


SCRIPT = textwrap.dedent("""
    import time
    import torch.distributed as dist
    from bridge_hpc.training.checkpoint.async_writer import AsyncCheckpointWriter

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%(port)d", rank=0, world_size=1)
    writer = AsyncCheckpointWriter(("SIGUSR1",), on_gpu=False).start()
    deadline = time.time() + 120
    while not writer.idle():
        assert time.time() < deadline, "the checkpoint worker did not start"
        time.sleep(0.05)
    writer.wait_until_started()
    worker, manager = writer.worker, writer._results_manager[1]._process
    began = time.time()
    writer.stop_processes()
    assert time.time() - began < 0.5, "stop_processes waited"
    deadline = time.time() + 10
    while (worker.is_alive() or manager.is_alive()) and time.time() < deadline:
        time.sleep(0.01)
    assert not worker.is_alive() and not manager.is_alive()
    writer.stop_processes()  # again: nothing left to kill
    writer.close()
    assert writer.worker is None
    dist.destroy_process_group()
    print("done", flush=True)
""")


def test_stop_processes_kills_the_worker_and_manager_without_waiting_and_close_follows():
    proc = subprocess.run([sys.executable, "-c", SCRIPT % {"port": free_port()}], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("done"), proc.stdout[-3000:] + proc.stderr[-6000:]
