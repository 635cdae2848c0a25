"""What a PEFT run's checkpoint records about the base model its adapters apply to (torch-free).

A PEFT checkpoint holds the adapters and their optimizer state only; the base weights come from
``checkpoint.pretrained_checkpoint`` at every start. So each checkpoint folder has
:data:`BASE_RECORD_FILE`: the PEFT type, the base folder read and a digest of it taken when the run
read it. Resuming compares the digest and refuses another base by name (:func:`check_resume`), before
anything is loaded; ``bridge-hf export`` refuses to merge into a changed base alike.

The digest must tell two bases apart that have the same files of the same sizes (two trainings of one
model, a fine-tune copied over the original) without reading gigabytes at every start: it covers the
name and size of each file of the model and its content, whole for small files and, for large ones,
:data:`DIGEST_SAMPLES` evenly spaced blocks (two trainings' weights differ nearly everywhere, so their
sampled blocks do too).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError

#: The base record in a PEFT checkpoint's folder (listed in its manifest like every file).
BASE_RECORD_FILE = "peft_base.json"


#: The digest's method, recorded beside it (``base_digest_method``): names, sizes and sampled content.
DIGEST_METHOD = "sampled-content-v1"
#: The method of records written before the method was recorded: the base checkpoint's manifest (or,
#: for a folder without one, the names and sizes of its files).
NAMES_AND_SIZES = "names-and-sizes"
#: Files up to this size are digested whole; larger ones by DIGEST_SAMPLES blocks of DIGEST_BLOCK_BYTES.
WHOLE_FILE_BYTES = 1 << 20
DIGEST_SAMPLES, DIGEST_BLOCK_BYTES = 64, 4096


def _model_files(folder: str) -> List[str]:
    """The files a base model consists of, relative to ``folder``, sorted: those its manifest lists (a
    toolkit checkpoint) and the manifest, else every file not under a hidden name (a Hugging Face folder,
    whose ``.cache`` a download tool may rewrite without changing the model)."""
    manifest = os.path.join(folder, run_folder.CHECKPOINT_MANIFEST_FILE)
    if os.path.isfile(manifest):
        with open(manifest) as f:
            listed = json.load(f).get("files", {})
        return sorted(set(listed) | {run_folder.CHECKPOINT_MANIFEST_FILE})
    out = []
    for directory, subdirs, names in os.walk(folder):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        out += [os.path.relpath(os.path.join(directory, n), folder) for n in names if not n.startswith(".")]
    return sorted(out)


def _sampled_content_digest(folder: str) -> str:
    digest = hashlib.sha256()
    for name in _model_files(folder):
        path = os.path.join(folder, name)
        try:
            size = os.path.getsize(path)
        except OSError:  # listed by the manifest but gone: another base than the one recorded, not a crash
            digest.update(f"{name}\tmissing\n".encode())
            continue
        digest.update(f"{name}\t{size}\n".encode())
        with open(path, "rb") as f:
            if size <= WHOLE_FILE_BYTES:
                digest.update(f.read())
                continue
            last = size - DIGEST_BLOCK_BYTES
            for i in range(DIGEST_SAMPLES):
                f.seek(i * last // (DIGEST_SAMPLES - 1))
                digest.update(f.read(DIGEST_BLOCK_BYTES))
    return digest.hexdigest()


def _names_and_sizes_digest(folder: str) -> str:
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


_DIGESTS = {DIGEST_METHOD: _sampled_content_digest, NAMES_AND_SIZES: _names_and_sizes_digest}


def base_digest(folder: str, method: str = DIGEST_METHOD) -> str:
    """The digest of the base model in ``folder`` by ``method`` (:data:`DIGEST_METHOD`)."""
    return _DIGESTS[method](folder)


def matches_record(record: Dict[str, Any], folder: str, digest: Optional[str] = None) -> bool:
    """Whether ``folder`` is the base ``record`` was taken of, by the record's own digest method
    (``digest``: the folder's digest by :data:`DIGEST_METHOD`, where the caller has it)."""
    method = record.get("base_digest_method", NAMES_AND_SIZES)
    if method not in _DIGESTS:
        return False
    if digest is None or method != DIGEST_METHOD:
        digest = base_digest(folder, method)
    return digest == record["base_digest"]


#: The PEFT fields that decide which adapters exist and their shapes: a checkpoint resumes only with the
#: same values (alpha, dropout and the initializations may change).
SHAPE_FIELDS = ("target_modules", "exclude_modules", "dim")


def base_record(peft_type: str, peft: Any) -> Dict[str, Any]:
    """The record a PEFT checkpoint keeps of its base (``peft.base_folder``, the pretrained folder the run
    read, and ``peft.base_digest``, taken when it read it: a base replaced since is not recorded as the
    one trained on) and of the fields that shape its adapters (:data:`SHAPE_FIELDS`)."""
    return {"peft": peft_type, "base": os.path.abspath(peft.base_folder), "base_digest": peft.base_digest,
            "base_digest_method": DIGEST_METHOD, **{name: getattr(peft, name) for name in SHAPE_FIELDS}}


def read_record(checkpoint_folder: str) -> Optional[Dict[str, Any]]:
    """The base record of a checkpoint folder; None where it has none (a full checkpoint)."""
    path = os.path.join(checkpoint_folder, BASE_RECORD_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"is not readable as the JSON record of a PEFT checkpoint's base ({err})", path=path) from None
    wanted = ("peft", "base", "base_digest")
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in wanted):
        raise ConfigError(f"expected the record bridge_hpc writes ({', '.join(wanted)} as strings)", path=path)
    return record


def check_resume(checkpoint_folder: str, peft_type: Optional[str], base_folder: Optional[str], peft: Any) -> None:
    """Refuse to resume from ``checkpoint_folder`` where it does not fit this run: adapters of another base
    (``checkpoint.pretrained_checkpoint``) or of other shapes (``peft.<field>``), a full checkpoint under a
    PEFT run or an adapter checkpoint without one (``peft``). ``peft_type`` and ``peft`` are this run's
    (None: no PEFT); ``base_folder`` the base it reads. Each refusal names the checkpoint's record
    (:data:`BASE_RECORD_FILE`) and both values. The ranks check before they load; bridge-submit the same,
    before anything is queued (:func:`bridge_hpc.training.checkpoint.architecture.check_resumed_adapters`)."""
    record = read_record(checkpoint_folder)
    path = os.path.join(checkpoint_folder, BASE_RECORD_FILE)
    if peft_type is None:
        if record is not None:
            raise ConfigError(f"{path} records {record['peft']} adapters of {record['base']}, not a full model: "
                              f"resume it with the same [peft] section", key="peft")
        return
    if record is None:
        raise ConfigError(f"{checkpoint_folder} holds a full model (no {BASE_RECORD_FILE}), not {peft_type} adapters: a "
                          "PEFT run resumes only its own adapter checkpoints (give it another checkpoint.save folder)",
                          key="peft")
    if record["peft"] != peft_type:
        raise ConfigError(f"{path} records {record['peft']} adapters; this run's [peft] type is {peft_type!r}: resume "
                          "with the same type", key="peft.type")
    for name in SHAPE_FIELDS:
        if name in record and record[name] != getattr(peft, name):
            raise ConfigError(f"{path} records adapters with {name} = {record[name]!r}; this run has {name} = "
                              f"{getattr(peft, name)!r}: resume with the same value", key=f"peft.{name}")
    digest = (peft.base_digest or base_digest(base_folder)) if base_folder else None
    if not base_folder or not matches_record(record, base_folder, digest):
        ours = f"{base_folder} (digest {digest[:12]})" if digest else repr(base_folder)
        raise ConfigError(f"{path} records adapters trained on {record['base']} (digest {record['base_digest'][:12]}); "
                          f"this run's base is {ours}: resume on the same base, or give this run another "
                          "checkpoint.save folder", key="checkpoint.pretrained_checkpoint")
