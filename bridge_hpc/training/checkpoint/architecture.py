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
