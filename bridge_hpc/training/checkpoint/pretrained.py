"""The weights a run starts from (``checkpoint.pretrained_checkpoint``), read into the bare model.

They are read before the model is wrapped for data parallelism and before the optimizer exists, as
Megatron Bridge's pre-wrap hook does: the optimizer's fp32 main copies of bf16/fp16 parameters are
taken from the model when it is built, so weights loaded after it would be overwritten by its first
step; and whatever changes the model's parameters (PEFT freezes the base and adds adapters) must
happen before the wrapper buckets the gradients.

A run with a complete checkpoint of its own under ``checkpoint.load`` resumes from that instead and
reads nothing here (:func:`starts_from_pretrained`); the run's own load happens after the wrap
(:func:`bridge_hpc.training.checkpoint.checkpointing.load_checkpoint`).

``pretrained_checkpoint`` is a toolkit checkpoint (a run's ``checkpoints/`` folder or one
``iter_NNNNNNN``) or a Hugging Face folder (``config.json`` and ``*.safetensors``), whose tensors each
rank converts and reads its slices of (:mod:`bridge_hpc.training.hf.load`).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from bridge_hpc.training.checkpoint.config import CheckpointConfig
from bridge_hpc.training.checkpoint.layout import _rank, _resolve_checkpoint_dir, complete_iterations
from bridge_hpc.training.checkpoint.megatron import _load_model_and_optimizer
from bridge_hpc.training.hf import families
from bridge_hpc.training.hf.load import load_hf_weights


def starts_from_pretrained(cfg: CheckpointConfig, with_adapters: bool = False) -> bool:
    """Whether this run reads ``checkpoint.pretrained_checkpoint``: it is set and the run has no
    complete checkpoint of its own to resume, or the run trains adapters (``with_adapters``: PEFT), whose
    checkpoints hold the adapters only, so the base is read at every start. Reads the file system only
    (every rank decides alike)."""
    return bool(cfg.pretrained_checkpoint) and (with_adapters or not (cfg.load and complete_iterations(cfg.load)))


def load_pretrained_weights(cfg: CheckpointConfig, chunks: List[torch.nn.Module],
                            with_adapters: bool = False) -> Optional[str]:
    """Read the pretrained model weights into ``chunks`` (this rank's unwrapped model chunks) when
    :func:`starts_from_pretrained`; returns the folder read, or None. Collective.

    Raises FileNotFoundError when ``checkpoint.pretrained_checkpoint`` holds no complete checkpoint
    (``finetune()`` refuses that before the ranks start: :func:`bridge_hpc.training.finetune.check_starting_point`).
    """
    if not starts_from_pretrained(cfg, with_adapters):
        return None
    if families.is_hf_folder(cfg.pretrained_checkpoint):  # a Hugging Face folder: its safetensors, converted
        read = load_hf_weights(cfg.pretrained_checkpoint, chunks)
        if _rank() == 0:
            print(f"loaded pretrained weights from Hugging Face folder {cfg.pretrained_checkpoint} "
                  f"({read / 2**20:.1f} MiB on rank 0)", flush=True)
        return cfg.pretrained_checkpoint
    folder = _resolve_checkpoint_dir(cfg.pretrained_checkpoint)
    if folder is None:
        raise FileNotFoundError(f"no complete checkpoint under {cfg.pretrained_checkpoint}")
    _load_model_and_optimizer(chunks, None, folder, load_optim=False)
    if _rank() == 0:
        print(f"loaded pretrained weights from {folder}", flush=True)
    return folder
