"""``finetune(config, forward_step_func)``: Megatron Bridge's fine-tuning entry point.

Fine-tuning is pretraining that starts from other weights, so this is :func:`pretrain` after one
check, as in Bridge. The starting point comes from :func:`bridge_hpc.training.checkpoint.checkpointing.load_checkpoint`:
a run whose ``checkpoint.load`` holds a checkpoint of its own resumes from it exactly (iteration,
optimizer, scheduler, RNG and data position), as a preempted pretraining run does; otherwise only the
model weights are read from ``checkpoint.pretrained_checkpoint`` (a run folder's checkpoints or one
``iter_NNNNNNN`` folder, or a Hugging Face model folder), and the optimizer, the scheduler and the iteration count start fresh.
"""

from __future__ import annotations

import os
from typing import Callable

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.peft import checkpoint as peft_checkpoint
from bridge_hpc.training.checkpoint import checkpointing
from bridge_hpc.training.config import CheckpointConfig, ConfigContainer
from bridge_hpc.training.hf import families
from bridge_hpc.training.pretrain import pretrain


def finetune(config: ConfigContainer, forward_step_func: Callable) -> None:
    """Fine-tune the GPT of ``config`` from ``checkpoint.pretrained_checkpoint`` with ``forward_step_func``.

    Raises ConfigError naming the key when there is nothing to start from (see
    :func:`check_starting_point`); otherwise exactly :func:`pretrain`.
    """
    check_starting_point(config.checkpoint, with_adapters=config.peft is not None)
    pretrain(config, forward_step_func)


def check_starting_point(ckpt: CheckpointConfig, with_adapters: bool = False) -> None:
    """Refuse a fine-tuning run that would silently start from random weights, or restart on every resume.

    Resuming (``checkpoint.load`` holds a complete checkpoint) needs nothing more. Otherwise
    ``checkpoint.pretrained_checkpoint`` must be set and hold a complete checkpoint. Megatron's
    ``checkpoint.finetune = true`` is refused: it makes a load from ``checkpoint.load`` (this run's own
    folder, by default) reset the iteration, optimizer and data position, so every requeue would start
    the run over; ``pretrained_checkpoint`` is the one way in. Reads the file system only, so every rank
    decides alike before torch.distributed is up.

    With PEFT (``with_adapters``) the run's own checkpoints hold its adapters only: the pretrained
    checkpoint is read at every start, resuming included, and must be a model (not another PEFT run's
    adapters).
    """
    if ckpt.finetune:
        raise ConfigError("must be false for finetune(): it starts from checkpoint.pretrained_checkpoint (model "
                          "weights only) and resumes its own run from checkpoint.load in full; "
                          "checkpoint.finetune = true would restart the run from iteration 0 at every resume",
                          key="checkpoint.finetune")
    if ckpt.pretrained_checkpoint and ckpt.save and _inside(ckpt.pretrained_checkpoint, ckpt.save):
        raise ConfigError(f"{ckpt.pretrained_checkpoint!r} is inside checkpoint.save ({ckpt.save!r}): the run would "
                          "resume the pretraining run there instead of fine-tuning from it; give the fine-tuning "
                          "run its own folder", key="checkpoint.pretrained_checkpoint")
    if ckpt.load and checkpointing.complete_iterations(ckpt.load) and not with_adapters:
        return
    if not ckpt.pretrained_checkpoint:
        raise ConfigError("must be set for fine-tuning: the checkpoint folder (or one iter_NNNNNNN folder) of the "
                          "pretrained model whose weights the run starts from", key="checkpoint.pretrained_checkpoint")
    if families.is_hf_folder(ckpt.pretrained_checkpoint):
        return  # a Hugging Face folder, checked in full at submission (bridge_hpc.training.hf.mapping.check_folder)
    folder = checkpointing._resolve_checkpoint_dir(ckpt.pretrained_checkpoint)
    if folder is not None and peft_checkpoint.read_record(folder) is not None:
        raise ConfigError(f"{folder} holds a PEFT run's adapters, not a model: name the model they were trained on "
                          f"({peft_checkpoint.read_record(folder)['base']})", key="checkpoint.pretrained_checkpoint")
    if folder is None:
        raise ConfigError(f"{ckpt.pretrained_checkpoint!r} holds no complete checkpoint (expected a folder with "
                          "iter_NNNNNNN checkpoints, or one of them, or a Hugging Face folder with config.json)",
                          key="checkpoint.pretrained_checkpoint")


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder
