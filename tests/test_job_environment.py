"""The rendezvous of a job with no launcher (``launcher="local"``, a world of one): a port the system has
free, never a fixed default, so that two runs on one machine (two benchmarks side by side, a tool beside a
training run, the suite's two workers) never meet on one port and wait for each other."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from bridge_hpc.slurm.job_environment import JobEnvironment

#: torch.distributed's usual default, which the local launcher took before
OLD_DEFAULT_PORT = 29500

WORLD_OF_ONE = """
import torch.distributed as dist
from bridge_hpc.slurm.job_environment import JobEnvironment
env = JobEnvironment.from_env()
env.export_torch_env()
dist.init_process_group("gloo", rank=0, world_size=1)
dist.destroy_process_group()
print("port", env.master_port)
"""


def _local_env() -> dict:
    return {"PATH": "/usr/bin:/bin"}


def test_a_set_master_port_is_kept():
    env = JobEnvironment.from_env({**_local_env(), "MASTER_PORT": "23456"})
    assert env.launcher == "local" and env.master_port == 23456


def test_a_world_of_one_starts_while_the_old_default_port_is_taken():
    """A listener holds 29500 (as another run's store would); a world of one still comes up."""
    holder = socket.socket()
    try:
        try:
            holder.bind(("127.0.0.1", OLD_DEFAULT_PORT))
            holder.listen()
        except OSError:
            pass  # something on this machine holds it already: the case under test all the same
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                            "SLURM_NTASKS", "TORCHELASTIC_RUN_ID")}
        done = subprocess.run([sys.executable, "-c", WORLD_OF_ONE], env=env, capture_output=True, text=True,
                              timeout=600)
    finally:
        holder.close()
    assert done.returncode == 0, done.stderr[-2000:]
    port = int(done.stdout.split()[-1])
    assert port != OLD_DEFAULT_PORT
