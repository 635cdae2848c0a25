"""Where this process stands in the world: its rank and the world size, with or without torch.distributed.

Why not torch.distributed alone: :mod:`bridge_hpc.training.config` asks for them in
``ConfigContainer.validate`` and ``runtime_config_update``, which also run where no process group is
up (a config checked in Python or in a test, a rank before it joins), and then the launcher's
``$RANK`` / ``$WORLD_SIZE`` answer, else one process. Torch-free at module level, like the config
that imports it on the login node: torch is imported only when asked."""

from __future__ import annotations

import os


def world_size() -> int:
    """The world size: torch.distributed's once it is up, else ``$WORLD_SIZE`` (1 without it)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except ImportError:
        pass
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank, as :func:`world_size` finds the world (torch.distributed, else ``$RANK``)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))
