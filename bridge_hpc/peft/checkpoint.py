"""What a PEFT run's checkpoint records about the base model its adapters apply to (torch-free).

A PEFT checkpoint holds the adapters and their optimizer state only; the base weights come from
``checkpoint.pretrained_checkpoint`` at every start. So each checkpoint folder has
:data:`BASE_RECORD_FILE`: the PEFT type, the base folder read and a digest of it, cheap to take (the
base checkpoint's ``manifest.json``, which lists every file with its size; for a folder without one,
such as a Hugging Face model folder, the names and sizes of its files). Resuming compares the
digest and refuses another base by name (:func:`check_resume`), before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Optional

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError

#: The base record in a PEFT checkpoint's folder (listed in its manifest like every file).
BASE_RECORD_FILE = "peft_base.json"


def base_digest(folder: str) -> str:
    """sha256 of ``folder``'s manifest, or of the sorted names and sizes of its files where it has none."""
    manifest = os.path.join(folder, run_folder.CHECKPOINT_MANIFEST_FILE)
    digest = hashlib.sha256()
    if os.path.isfile(manifest):
        with open(manifest, "rb") as f:
            digest.update(f.read())
        return digest.hexdigest()
    for directory, _, names in sorted(os.walk(folder)):
        for name in sorted(names):
            path = os.path.join(directory, name)
            digest.update(f"{os.path.relpath(path, folder)}\t{os.path.getsize(path)}\n".encode())
    return digest.hexdigest()


#: The PEFT fields that decide which adapters exist and their shapes: a checkpoint resumes only with the
#: same values (alpha, dropout and the initializations may change).
SHAPE_FIELDS = ("target_modules", "exclude_modules", "dim")


def base_record(peft_type: str, base_folder: str, peft: Any) -> Dict[str, Any]:
    """The record a PEFT checkpoint keeps of its base (``base_folder``: the pretrained folder read) and of
    the fields that shape its adapters (:data:`SHAPE_FIELDS`)."""
    return {"peft": peft_type, "base": os.path.abspath(base_folder), "base_digest": base_digest(base_folder),
            **{name: getattr(peft, name) for name in SHAPE_FIELDS}}


def read_record(checkpoint_folder: str) -> Optional[Dict[str, Any]]:
    """The base record of a checkpoint folder; None where it has none (a full checkpoint)."""
    path = os.path.join(checkpoint_folder, BASE_RECORD_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_resume(checkpoint_folder: str, peft_type: Optional[str], base_folder: Optional[str], peft: Any) -> None:
    """Refuse to resume from ``checkpoint_folder`` where it does not fit this run: adapters of another base
    (``checkpoint.pretrained_checkpoint``) or of other shapes (``peft.<field>``), a full checkpoint under a
    PEFT run or an adapter checkpoint without one (``peft``). ``peft_type`` and ``peft`` are this run's
    (None: no PEFT); ``base_folder`` the base it read."""
    record = read_record(checkpoint_folder)
    if peft_type is None:
        if record is not None:
            raise ConfigError(f"{checkpoint_folder} holds {record['peft']} adapters of {record['base']}, not a full model: "
                              f"resume it with the same [peft] section", key="peft")
        return
    if record is None:
        raise ConfigError(f"{checkpoint_folder} holds a full model, not {peft_type} adapters: a PEFT run resumes only its "
                          "own adapter checkpoints (give it another checkpoint.save folder)", key="peft")
    if record["peft"] != peft_type:
        raise ConfigError(f"{checkpoint_folder} holds {record['peft']} adapters; this run's [peft] type is {peft_type!r}",
                          key="peft.type")
    for name in SHAPE_FIELDS:
        if name in record and record[name] != getattr(peft, name):
            raise ConfigError(f"{checkpoint_folder} holds adapters with {name} = {record[name]!r}; this run has "
                              f"{getattr(peft, name)!r}: resume with the same value", key=f"peft.{name}")
    digest = base_digest(base_folder) if base_folder else None
    if digest != record["base_digest"]:
        raise ConfigError(f"{checkpoint_folder} holds adapters trained on {record['base']} (digest "
                          f"{record['base_digest'][:12]}); this run's base {base_folder} differs"
                          f"{f' (digest {digest[:12]})' if digest else ''}: resume on the same base",
                          key="checkpoint.pretrained_checkpoint")
