"""The one place that reads the launcher's environment (Slurm's ``SLURM_*`` or torchrun's variables).

Everything else asks a :class:`JobEnvironment` for rank, world size, job id or the rendezvous address,
so that the same rank code runs under ``srun``, under ``torchrun`` and as a single process.
Light on purpose: no torch import, so the login node can use it too.
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from typing import List, Mapping, Optional


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a Slurm node list (``n[1-3,5],gpu7``) into host names.

    ``scontrol show hostnames`` is the authority when it exists; the pure-Python fallback covers
    containers without Slurm's client tools.
    """
    if not nodelist:
        return []
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        pass
    hosts: List[str] = []
    # split on commas outside brackets
    parts, depth, cur = [], 0, ""
    for ch in nodelist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for part in parts:
        if "[" not in part:
            hosts.append(part)
            continue
        prefix, rest = part.split("[", 1)
        ranges, suffix = rest.split("]", 1)
        for rng in ranges.split(","):
            if "-" in rng:
                lo, hi = rng.split("-")
                for i in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
            else:
                hosts.append(f"{prefix}{rng}{suffix}")
    return hosts


def node_address(node: str) -> str:
    """How to reach a node: Slurm's NodeAddr for it, which is the node name on most clusters but not
    where several slurmd share a host (the local cluster's n1, n2 are 127.0.0.1)."""
    try:
        out = subprocess.run(["scontrol", "show", "node", node, "-o"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return node
    for field in out.stdout.split():
        if field.startswith("NodeAddr=") and field != "NodeAddr=":
            return field.split("=", 1)[1]
    return node


def array_task_index(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This job's index in its Slurm array (``SLURM_ARRAY_TASK_ID``), or None outside an array job.

    A plain accessor rather than :meth:`JobEnvironment.from_env`: an array task of
    ``bridge-prepare-data`` runs one process in the batch step, with no ranks or rendezvous to work out.
    """
    env = os.environ if env is None else env
    value = env.get("SLURM_ARRAY_TASK_ID", "")
    return int(value) if value.isdigit() else None


def unused_local_port() -> int:
    """A TCP port on 127.0.0.1 that the system has free now (a world of one's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The rendezvous variables the ranks read if set (:meth:`JobEnvironment.from_env`), else derive from the
#: job. The batch script unsets them before ``[env]`` (which may set them on purpose): Slurm's
#: ``--export=ALL`` would otherwise carry a submitting shell's ``MASTER_PORT`` into every job it submits,
#: and two of those jobs sharing a node would bind the same port.
INHERITED_RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class JobEnvironment:
    """Where this process sits in the job: launcher, rank, world and the rendezvous point."""

    launcher: str  # "slurm", "torchrun" or "local"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: Optional[str]
    array_job_id: Optional[str]
    array_task_id: Optional[str]
    restart_count: int
    hostname: str

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "JobEnvironment":
        env = os.environ if env is None else env
        hostname = env.get("SLURMD_NODENAME") or os.uname().nodename
        # torchrun sets these itself; it wins over Slurm when both are present (torchrun inside srun).
        if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "SLURM_PROCID" not in env):
            return cls(
                launcher="torchrun",
                rank=int(env.get("RANK", 0)),
                world_size=int(env.get("WORLD_SIZE", 1)),
                local_rank=int(env.get("LOCAL_RANK", 0)),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
                node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
                num_nodes=max(1, int(env.get("WORLD_SIZE", 1)) // max(1, int(env.get("LOCAL_WORLD_SIZE", 1)))),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env.get("MASTER_PORT", 29500)),
                job_id=env.get("SLURM_JOB_ID"),
                array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
                array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
                restart_count=int(env.get("SLURM_RESTART_COUNT", 0) or 0),
                hostname=hostname,
            )
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            job_id = env.get("SLURM_JOB_ID", "0")
            nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
            master = env.get("MASTER_ADDR") or (node_address(nodes[0]) if nodes else "127.0.0.1")
            # A port derived from the job id keeps concurrent jobs on one node apart.
            port = int(env.get("MASTER_PORT") or 20000 + int("".join(c for c in job_id if c.isdigit()) or 0) % 20000)
            return cls(
                launcher="slurm",
                rank=int(env["SLURM_PROCID"]),
                world_size=int(env["SLURM_NTASKS"]),
                local_rank=int(env.get("SLURM_LOCALID", 0)),
                local_world_size=int((env.get("SLURM_TASKS_PER_NODE", "1").split("(")[0]) or 1),
                node_rank=int(env.get("SLURM_NODEID", 0)),
                num_nodes=int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", 1))),
                master_addr=master,
                master_port=port,
                job_id=job_id,
                array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
                array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
                restart_count=int(env.get("SLURM_RESTART_COUNT", 0) or 0),
                hostname=hostname,
            )
        # A world of one agrees with nobody on its port: one the system has free, so that two runs on one
        # machine (two benchmarks, two tools) never meet on a fixed default.
        return cls(
            launcher="local", rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
            num_nodes=1, master_addr="127.0.0.1", master_port=int(env.get("MASTER_PORT") or unused_local_port()),
            job_id=env.get("SLURM_JOB_ID"), array_job_id=None, array_task_id=None,
            restart_count=int(env.get("SLURM_RESTART_COUNT", 0) or 0), hostname=hostname,
        )

    def export_torch_env(self) -> None:
        """Set the variables ``torch.distributed``'s ``env://`` init reads."""
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size), MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )
