"""The model a toolkit checkpoint holds, read without torch, against the model a job asks for.

A run that starts from ``checkpoint.pretrained_checkpoint`` reads its tensors into a model built from
the job's ``[model]``. When the two disagree on a field that fixes a tensor's name or shape (a GPT-2
imported with ``bridge-hf import`` under a Llama-shaped job, say), the ranks fail on a size mismatch
after the queue, once per requeue. Every checkpoint carries the model it was written by (rank 0's
``run_config.json``, also written by ``bridge-hf import``), so bridge-submit compares them on the login
node, as it compares a Hugging Face base's config.json (:mod:`bridge_hpc.training.hf.mapping`).

Torch-free: the login node imports it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Tuple

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError

RUN_CONFIG_FILE = run_folder.CHECKPOINT_RUN_CONFIG_FILE

#: ``[model]`` fields (finalized, as run_config.json records them) that fix the name or shape of a
#: tensor of the checkpoint: a base written with another value cannot be read into the job's model.
#: Not ``vocab_size``: the ranks take it from the tokenizer, so the job file's value is not the one
#: the run records.
SHAPE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
    "position_embedding_type", "normalization", "activation_func", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "share_embeddings_and_output_weights",
)


def base_iteration_folder(pretrained: str) -> Optional[str]:
    """The iteration folder a run reads from ``pretrained`` (an iteration folder, or a run's
    checkpoints folder: its tracker's iteration, else its newest), or None where none is there.
    The ranks verify the folder's files when they read it; this only needs its run_config.json."""
    if run_folder.ITERATION_DIR_RE.match(os.path.basename(os.path.normpath(pretrained))):
        return pretrained if os.path.isfile(os.path.join(pretrained, RUN_CONFIG_FILE)) else None
    if not os.path.isdir(pretrained):
        return None
    candidates = sorted((int(m.group(1)), name) for name in os.listdir(pretrained)
                        if (m := run_folder.ITERATION_DIR_RE.match(name)))
    tracked = run_folder.tracked_iteration(pretrained)
    ordered = [name for it, name in candidates if it == tracked] + [name for _, name in reversed(candidates)]
    for name in ordered:
        folder = os.path.join(pretrained, name)
        if os.path.isfile(os.path.join(folder, RUN_CONFIG_FILE)):
            return folder
    return None


def saved_model(folder: str) -> Dict[str, Any]:
    """The ``model`` table of ``folder``'s run_config.json; ConfigError naming the file when it
    cannot be read as one."""
    path = os.path.join(folder, RUN_CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"cannot be read as the checkpoint's configuration ({err})", path=path) from None
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        raise ConfigError("has no 'model' table: not a configuration this toolkit wrote", path=path)
    return model


def first_contradiction(saved: Dict[str, Any], wanted: Dict[str, Any]) -> Optional[Tuple[str, Any, Any]]:
    """``(field, the job's value, the checkpoint's value)`` of the first :data:`SHAPE_FIELDS` field the
    two finalized model tables disagree on, or None. A field the checkpoint does not record is not
    compared (an older checkpoint, or one a field was added after)."""
    for name in SHAPE_FIELDS:
        if name in saved and name in wanted and saved[name] != wanted[name]:
            return name, wanted[name], saved[name]
    return None


def loaded_folder(root: str) -> Optional[str]:
    """The checkpoint folder a run reads from ``root``, or None where that cannot be told without torch:
    ``root`` itself if it is a complete iteration folder, else, of a checkpoints folder, the tracker's
    complete checkpoint, else the newest, whose files have their manifest's sizes (the choice of
    :func:`bridge_hpc.training.checkpoint.layout.checkpoint_choice`, which the ranks make). None also where
    the one chosen has no manifest (an old format, verified with torch only)."""
    manifest = run_folder.CHECKPOINT_MANIFEST_FILE
    if run_folder.ITERATION_DIR_RE.match(os.path.basename(os.path.normpath(root))):
        return root if os.path.isfile(os.path.join(root, manifest)) else None
    try:
        names = os.listdir(root)
    except OSError:
        return None
    complete = sorted(int(m.group(1)) for name in names if (m := run_folder.ITERATION_DIR_RE.match(name)) and any(
        os.path.isfile(os.path.join(root, name, f)) for f in (manifest, "common.pt")))
    tracked = run_folder.tracked_iteration(root)
    order = [tracked] + [i for i in reversed(complete) if i < tracked] if tracked in complete else complete[::-1]
    for iteration in order:
        folder = run_folder.iteration_dir(root, iteration)
        try:
            with open(os.path.join(folder, manifest), encoding="utf-8") as f:
                files = {str(rel): int(size) for rel, size in json.load(f)["files"].items()}
        except FileNotFoundError:
            return None  # an old format's checkpoint: its verification needs torch
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # damaged: the ranks pass it over too
        if all(_size(os.path.join(folder, rel)) == size for rel, size in files.items()):
            return folder
    return None


def _size(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def check_resumed_adapters(checkpoint: Any, peft: Any) -> None:
    """bridge-submit's check of what the ranks check before they resume (:func:`bridge_hpc.peft.checkpoint.check_resume`):
    the checkpoint a run would resume from ``checkpoint.load`` (else ``checkpoint.save``) against this job's
    ``[peft]`` and base (``checkpoint.pretrained_checkpoint``: a Hugging Face folder, or the toolkit checkpoint
    read from it), so that adapters of another base or shape, or a full checkpoint under a PEFT job (or the
    reverse), are refused before the queue, not on every rank after it. ConfigError naming the key."""
    from bridge_hpc.peft import checkpoint as peft_checkpoint
    from bridge_hpc.peft.config import peft_type
    from bridge_hpc.training.hf import families

    root = checkpoint.load or checkpoint.save
    resumed = loaded_folder(root) if root else None
    if resumed is None:
        return  # nothing to resume: the run starts from its pretrained checkpoint
    base = checkpoint.pretrained_checkpoint
    if peft is not None:
        if not base:
            return  # the job's own check names checkpoint.pretrained_checkpoint
        base = base if families.is_hf_folder(base) else loaded_folder(base)
        if base is None:
            return  # no base to compare yet (the ranks say what is missing)
    peft_checkpoint.check_resume(resumed, peft_type(peft) if peft is not None else None, base, peft)
