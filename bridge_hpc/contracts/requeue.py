"""The requeue request: how rank 0 asks the batch script to requeue the job.

The ranks cannot be trusted to requeue the job themselves (``scontrol`` may be missing on compute
nodes or inside a container), and an exit status does not survive every launcher (nvidia-resiliency-
ext's ``ft_launcher`` turns a worker's non-zero status into an in-job restart). So rank 0 writes a
small request file after its last checkpoint is durable, all ranks exit 0, and the batch script —
outside any container — reads it and runs ``scontrol requeue``. The script removes the file before it
starts the ranks, so a request always belongs to the run that wrote it.

This module writes the request (:func:`request_requeue`, rank 0) and reads it
(:func:`read_request`; the batch script runs ``python -m bridge_hpc.contracts.requeue``), so the
format is defined here only: one JSON object. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import List, Mapping, Optional, Sequence

#: Set by the batch script: where rank 0 writes the request (RunFolder.requeue_request(job id)).
REQUEUE_FILE_ENV = "BRIDGE_REQUEUE_FILE"

#: What a Slurm node name may contain; anything else is dropped before it reaches ``scontrol``.
_NODE = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class RequeueRequest:
    """``reason``: the progress log's ``Ending job`` reason; ``exclude_nodes``: Slurm nodes the next
    run should avoid (flagged stragglers; applied when ``[slurm] exclude_straggler_nodes`` is on)."""

    reason: str
    iteration: int
    exclude_nodes: List[str] = field(default_factory=list)

    def describe(self) -> str:
        text = f"reason={self.reason} iteration={self.iteration}"
        return text + (f" exclude={','.join(self.exclude_nodes)}" if self.exclude_nodes else "")


def request_requeue(reason: str, iteration: int, environ: Optional[Mapping[str, str]] = None,
                    exclude_nodes: Sequence[str] = ()) -> Optional[str]:
    """Ask for a requeue (rank 0 only); returns the file written, or None outside a bridge_hpc job."""
    environ = os.environ if environ is None else environ
    path = environ.get(REQUEUE_FILE_ENV)
    if not path:
        return None
    request = RequeueRequest(reason, int(iteration), [n for n in exclude_nodes if _NODE.fullmatch(n)])
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(request), f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_request(path: str) -> Optional[RequeueRequest]:
    """The request in ``path``, or None when there is none or it is unreadable (not a request)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        nodes = [str(n) for n in data.get("exclude_nodes", []) if _NODE.fullmatch(str(n))]
        return RequeueRequest(str(data["reason"]), int(data["iteration"]), nodes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m bridge_hpc.contracts.requeue FILE [--exclude]``: for the batch script. Prints the
    request's description (or, with ``--exclude``, the comma-separated nodes to avoid); exit status 1
    when there is no request."""
    parser = argparse.ArgumentParser(prog="python -m bridge_hpc.contracts.requeue")
    parser.add_argument("file")
    parser.add_argument("--exclude", action="store_true", help="print the nodes to avoid")
    args = parser.parse_args(argv)
    request = read_request(args.file)
    if request is None:
        return 1
    print(",".join(request.exclude_nodes) if args.exclude else request.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
