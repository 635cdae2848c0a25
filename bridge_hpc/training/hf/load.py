"""Hugging Face weights into this rank's model chunks (ranks; torch).

Each rank reads only what it holds: the tensors of its pipeline stage's layers (and the embedding or
output layer where its stage has them), and of those only its tensor-parallel slice, through
safetensors' lazy ``get_slice`` (the file is memory-mapped; a slice reads its own bytes). The slices
are put into megatron-core's layout by the family's mappings (:func:`bridge_hpc.training.hf.mapping.registry`:
each parameter's mapping, looked up by its name with the layer and expert counted over the whole model)
and copied into the parameters in their dtype.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Dict, List

import torch

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.hf import families, mapping
from bridge_hpc.training.hf.param_mapping import ExpertMapping, MegatronParamMapping, Shard
from bridge_hpc.training.hf.safetensors_files import SafetensorsFolder


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


class _Checked:
    """One Hugging Face tensor as the mappings read it: sliced lazily through safetensors'
    ``get_slice`` (only the slice's bytes are read), each slice read checked to be finite."""

    def __init__(self, lazy, name: str, file: str):
        self._lazy, self.name, self.file = lazy, name, file

    def __getitem__(self, index) -> torch.Tensor:
        value = self._lazy[index]
        finite = torch.isfinite(value)
        if not bool(finite.all()):  # damaged bytes, or a model that diverged (safetensors has no checksum)
            bad = int(value.numel() - finite.sum())
            raise ConfigError(f"holds {bad} NaN or infinite value{'s' if bad > 1 else ''} (of the {value.numel()} "
                              "read): its contents are damaged, or the model diverged; a model's weights are finite",
                              path=self.file, key=self.name)
        return value


class _Reader:
    """The folder's tensors by name, as :class:`_Checked` slices (each file opened once)."""

    def __init__(self, folder: SafetensorsFolder, stack: ExitStack):
        from safetensors import safe_open

        self.folder, self._open, self._stack, self._files = folder, safe_open, stack, {}

    def __getitem__(self, name: str) -> _Checked:
        info = self.folder.tensors[name]
        handle = self._files.get(info.file)
        if handle is None:
            handle = self._stack.enter_context(self._open(info.file, framework="pt"))
            self._files[info.file] = handle
        return _Checked(handle.get_slice(name), name, info.file)

    def weights(self, mapping: MegatronParamMapping):
        """What ``mapping.hf_to_megatron`` takes: the one tensor, or role -> tensor."""
        if isinstance(mapping.hf_param, str):
            return self[mapping.hf_param]
        return {role: self[name] for role, name in mapping.hf_param.items()}


def _parallel_state() -> Dict[str, int]:
    """This rank's tensor-, expert- and expert-tensor-parallel ranks and sizes (all 0 of 1 without
    megatron-core's parallel state: a tool's world of one)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"tp_rank": 0, "tp": 1, "ep_rank": 0, "ep": 1, "etp_rank": 0, "etp": 1}
    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_world_size(),
            "ep_rank": ps.get_expert_model_parallel_rank(), "ep": ps.get_expert_model_parallel_world_size(),
            "etp_rank": ps.get_expert_tensor_parallel_rank(), "etp": ps.get_expert_tensor_parallel_world_size()}


def _global_name(name: str, layers: List[torch.nn.Module], ranks: Dict[str, int], num_experts: int) -> str:
    """``name`` (a chunk's parameter, local-spec name) with its layer and expert counted over the whole
    model: a chunk's ``decoder.layers.<j>`` is layer ``layer_number - 1``, an expert-parallel rank's
    ``local_experts.<k>`` expert :meth:`ExpertMapping.global_expert`."""
    name = mapping.canonical(name)
    local = mapping.layer_number(name)
    if local is None:
        return name
    index, rest = local
    expert = mapping.local_expert(rest)
    if expert is not None:
        k, tail = expert
        e = ExpertMapping.global_expert(k, ranks["ep_rank"], ranks["ep"], num_experts)
        rest = f"{mapping.EXPERTS}{e}.{tail}"
    return f"decoder.layers.{layers[index].layer_number - 1}.{rest}"


def load_hf_weights(folder: str, chunks: List[torch.nn.Module]) -> int:
    """Copy the Hugging Face checkpoint in ``folder`` into ``chunks`` (this rank's model chunks, built
    from ``[model] hf_config`` = the same folder); returns the bytes read.

    The sizes come from the folder's ``config.json`` (those the ``[model]`` section was filled from;
    the login node refused a section that contradicts them), the layout from megatron-core's parallel
    state and each chunk's layers. Every parameter of every chunk is set, or ConfigError names the
    tensor that could not make it (the login node checks the headers before submission:
    :func:`bridge_hpc.training.hf.mapping.check_folder`)."""
    hf = families.read_config(folder)
    model = families.model_fields(hf, os.path.join(folder, families.CONFIG_FILE))
    return copy_weights(SafetensorsFolder(folder), hf["model_type"], model, chunks)


def copy_weights(files: SafetensorsFolder, family: str, model: Dict, chunks: List[torch.nn.Module]) -> int:
    """Copy the tensors of ``files`` (a ``family`` folder) into ``chunks``, the model of the ``[model]``
    fields ``model`` (those :func:`bridge_hpc.training.hf.families.model_fields` reads); returns the
    bytes read. :func:`load_hf_weights` with the folder's config already read."""
    folder = files.folder
    prefix = mapping.gpt2_prefix(files.tensors) if family == "gpt2" else ""
    mappings = mapping.registry(family, model, prefix)
    ranks = _parallel_state()
    read = 0
    with ExitStack() as stack, torch.no_grad():
        reader = _Reader(files, stack)
        for chunk in chunks:
            module = _unwrap(chunk)
            layers = list(module.decoder.layers) if hasattr(module, "decoder") else []
            for name, param in module.state_dict(keep_vars=True).items():
                if param is None or name.endswith("_extra_state"):
                    continue
                target = mappings.megatron_to_hf_lookup(
                    _global_name(name, layers, ranks, model.get("num_moe_experts") or 0))
                if target is None and name == "output_layer.weight" and model["share_embeddings_and_output_weights"]:
                    # a last pipeline stage without the embedding keeps its own copy of the tied weight
                    target = mappings.megatron_to_hf_lookup("embedding.word_embeddings.weight")
                if target is None:
                    raise ConfigError(f"no {family} tensor makes the model's parameter {name}", path=folder)
                rank, size = (ranks["etp_rank"], ranks["etp"]) if target.is_expert else (ranks["tp_rank"], ranks["tp"])
                value = target.hf_to_megatron(reader.weights(target), Shard(rank, size, tuple(param.shape)))
                if tuple(value.shape) != tuple(param.shape):
                    raise ConfigError(f"gives {tuple(value.shape)} for {name}, whose shape is {tuple(param.shape)}",
                                      path=folder, key=target.first_hf_name())
                param.data.copy_(value)
                read += value.numel() * value.element_size()
    return read
