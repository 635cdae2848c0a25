"""How the ranks ask the batch script to requeue the job.

The ranks cannot be trusted to requeue the job themselves (``scontrol`` may be missing on compute
nodes or inside a container), and an exit status does not survive every launcher (nvidia-resiliency-
ext's ``ft_launcher`` turns a worker's non-zero status into an in-job restart). So rank 0 writes a
small request file after its last checkpoint is durable, all ranks exit 0, and the batch script —
outside any container — reads the file and runs ``scontrol requeue``. The script removes the file
before it starts the ranks, so a request always belongs to the run that wrote it.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

#: Set by the batch script: where rank 0 writes the request.
REQUEUE_FILE_ENV = "BRIDGE_REQUEUE_FILE"


def request_requeue(reason: str, iteration: int, environ: Optional[dict] = None,
                    exclude_nodes: Sequence[str] = ()) -> Optional[str]:
    """Ask for a requeue (rank 0 only); returns the file written, or None outside a bridge_hpc job.

    ``exclude_nodes``: Slurm node names the next run should avoid (the nodes of flagged stragglers);
    the batch script adds them to the job's ``ExcNodeList`` when ``[slurm] exclude_straggler_nodes``
    is on and enough nodes are left for the job."""
    environ = os.environ if environ is None else environ
    path = environ.get(REQUEUE_FILE_ENV)
    if not path:
        return None
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"reason={reason}\niteration={iteration}\n")
        if exclude_nodes:
            f.write(f"exclude={','.join(exclude_nodes)}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
