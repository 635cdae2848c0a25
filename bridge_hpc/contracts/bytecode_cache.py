"""``[job] bytecode_cache``: its values, checked on the login node (``bridge-submit``) and acted on by
every rank before it imports torch (:mod:`bridge_hpc.training.process.bytecode_cache`)."""

from __future__ import annotations

import os
from typing import Optional

#: The per-user default folder (``$XDG_CACHE_HOME/bridge_hpc/pycache``), and no cache.
AUTO, OFF = "auto", "off"


def problem(setting: str) -> Optional[str]:
    """What is wrong with a ``[job] bytecode_cache`` value, or None: it must be :data:`AUTO`,
    :data:`OFF` or an absolute folder (``~/`` allowed: the compute node's home, expanded there)."""
    if setting in (AUTO, OFF):
        return None
    folder = setting[1:] if setting.startswith("~/") else setting
    if not (setting.startswith("~/") or os.path.isabs(setting)) or "\n" in setting or not folder.strip("/").strip():
        return f'expected "{AUTO}", "{OFF}" or an absolute folder, got {setting!r}'
    return None
