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

from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.api import CheckpointException

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.checkpoint.config import CheckpointConfig
from bridge_hpc.training.checkpoint.layout import _rank, _resolve_checkpoint_dir, complete_iterations
from bridge_hpc.training.checkpoint.megatron import (
    _load_model_and_optimizer,
    _uses_megatron_dist,
    model_sharded_state_dict,
)
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
    _check_shapes(chunks, folder)
    try:
        _load_model_and_optimizer(chunks, None, folder, load_optim=False)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        raise _unreadable(folder, err) from None
    if _rank() == 0:
        print(f"loaded pretrained weights from {folder}", flush=True)
    return folder


def _unreadable(folder: str, err: BaseException) -> BaseException:
    """What a failed read of the base becomes. Its files have their manifest's sizes (the folder was
    verified when it was chosen), so a failure that is not the file system's (an OSError: a requeue may
    help) is damaged contents: one ConfigError naming ``checkpoint.pretrained_checkpoint``, the folder and
    the first reader's error (exit 2, not requeued: a requeue reads the same bytes), not
    torch.distributed.checkpoint's wrapper (``CheckpointException ranks:dict_keys([0])``), which names
    neither."""
    cause = err
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:  # CheckpointException: rank -> (exception, traceback)
        first = sorted(failures.items())[0][1]
        cause = first[0] if isinstance(first, tuple) else first
    if isinstance(cause, (OSError, KeyboardInterrupt, SystemExit)) or not isinstance(cause, Exception):
        return err
    text = next((line.strip() for line in str(cause).splitlines() if line.strip()), "").split(". ")[0][:200]
    text = f"{type(cause).__name__}: {text}" if text else type(cause).__name__
    return ConfigError(f"{folder} cannot be read: its files have their manifest's sizes, but their contents are "
                       f"damaged ({text}); give an intact base (import it again with bridge-hf import, or copy "
                       "it again)", key="checkpoint.pretrained_checkpoint")


def _expected_shapes(chunks: List[torch.nn.Module]) -> Dict[str, Tuple[int, ...]]:
    """The global shape of each tensor this model reads, under the key the checkpoint format stores it
    at: megatron-core's sharded keys (GPU back end), or ``model.<name>`` of torch DCP (CPU back end)."""
    if _uses_megatron_dist(chunks):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        return {t.key: tuple(t.global_shape) for table in model_sharded_state_dict(chunks).values()
                for t in table.values() if isinstance(t, ShardedTensor)}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {f"model.{name}": tuple(t.shape) for name, t in get_model_state_dict(chunks[0]).items()
            if isinstance(t, torch.Tensor)}


def _check_shapes(chunks: List[torch.nn.Module], folder: str) -> None:
    """Every tensor of the base that this model reads has this model's shape there, or one ConfigError
    naming ``checkpoint.pretrained_checkpoint``, the tensor and both shapes (exit 2, not requeued: a
    requeue cannot change either). bridge-submit compares the architectures already
    (:mod:`bridge_hpc.training.checkpoint.architecture`); what it cannot see (the vocabulary the
    tokenizer gives, a checkpoint replaced after submission) would otherwise surface as a size
    mismatch deep inside the load, on every rank. Reads the checkpoint's metadata only."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    for key, shape in sorted(_expected_shapes(chunks).items()):
        size = getattr(saved.get(key), "size", None)
        if size is not None and tuple(size) != shape:
            raise ConfigError(f"{folder} holds {key} with shape {tuple(size)}, this model's is {shape}: the base "
                              "was written by a model of another architecture or vocabulary",
                              key="checkpoint.pretrained_checkpoint")
