"""Hugging Face weights into this rank's model chunks (ranks; torch).

Each rank reads only what it holds: the tensors of its pipeline stage's layers (and the embedding or
output layer where its stage has them), and of those only its tensor-parallel slice, through
safetensors' lazy ``get_slice`` (the file is memory-mapped; a slice reads its own bytes). The slices
are put into megatron-core's layout by :mod:`bridge_hpc.training.hf.mapping`'s rules and copied into the
parameters in their dtype.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Dict, List

import torch

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.hf import families, mapping
from bridge_hpc.training.hf.safetensors_files import SafetensorsFolder


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


class _Reader:
    """Slices of the folder's tensors in megatron's ``[out, in]`` orientation (GPT-2's Conv1D weights
    are transposed on the way)."""

    def __init__(self, folder: SafetensorsFolder, stack: ExitStack):
        from safetensors import safe_open

        self.folder, self._open, self._stack, self._files = folder, safe_open, stack, {}

    def _slice(self, name: str):
        info = self.folder.tensors[name]
        handle = self._files.get(info.file)
        if handle is None:
            handle = self._stack.enter_context(self._open(info.file, framework="pt"))
            self._files[info.file] = handle
        return handle.get_slice(name)

    def _finite(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` (read from tensor ``name``), or ConfigError naming the file and tensor where it holds
        NaN or infinite values: damaged bytes, or a model that diverged (safetensors has no checksum;
        these are the damaged contents a reader can tell)."""
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            bad = int(value.numel() - finite.sum())
            raise ConfigError(f"holds {bad} NaN or infinite value{'s' if bad > 1 else ''} (of the {value.numel()} "
                              "read): its contents are damaged, or the model diverged; a model's weights are finite",
                              path=self.folder.tensors[name].file, key=name)
        return value

    def rows(self, name: str, start: int, stop: int, transpose: bool) -> torch.Tensor:
        s = self._slice(name)
        if transpose:
            return self._finite(name, s[:, start:stop]).t()
        return self._finite(name, s[start:stop])

    def cols(self, name: str, start: int, stop: int, transpose: bool) -> torch.Tensor:
        s = self._slice(name)
        if transpose:
            return self._finite(name, s[start:stop, :]).t()
        return self._finite(name, s[:, start:stop])

    def full(self, name: str) -> torch.Tensor:
        return self._finite(name, self._slice(name)[:])


def _local(rule: mapping.Rule, layer: int, reader: _Reader, shape: torch.Size, model: Dict, tp: int,
           rank: int) -> torch.Tensor:
    """This tensor-parallel rank's ``shape``-shaped part of the parameter of ``rule`` at ``layer``."""
    names = [(template.format(i=layer), offset) for template, offset in rule.hf]
    if rule.kind == "copy":
        return reader.full(names[0][0])
    if rule.kind == "column":
        n = shape[0]
        return reader.rows(names[0][0], rank * n, (rank + 1) * n, rule.transpose)
    if rule.kind == "row":
        n = shape[1]
        return reader.cols(names[0][0], rank * n, (rank + 1) * n, rule.transpose)
    if rule.kind == "vocab":
        n, vocab = shape[0], model["vocab_size"]
        start, stop = rank * n, min((rank + 1) * n, vocab)
        out = torch.zeros(shape, dtype=torch.float32)
        if stop > start:
            part = reader.rows(names[0][0], start, stop, rule.transpose)
            out = out.to(part.dtype)
            out[: stop - start] = part
        return out
    if rule.kind == "gated":
        n = shape[0] // 2
        return torch.cat([reader.rows(name, rank * n, (rank + 1) * n, rule.transpose) for name, _ in names])
    if rule.kind == "qkv":
        d = mapping.head_dim(model)
        heads = model["num_attention_heads"]
        groups = model.get("num_query_groups") or heads
        per_group, local_groups = heads // groups, groups // tp
        g0 = rank * local_groups
        (q, q_off), (k, k_off), (v, v_off) = names
        qs = reader.rows(q, q_off + g0 * per_group * d, q_off + (g0 + local_groups) * per_group * d, rule.transpose)
        ks = reader.rows(k, k_off + g0 * d, k_off + (g0 + local_groups) * d, rule.transpose)
        vs = reader.rows(v, v_off + g0 * d, v_off + (g0 + local_groups) * d, rule.transpose)
        rest = qs.shape[1:]
        fused = torch.cat([qs.reshape(local_groups, per_group * d, *rest), ks.reshape(local_groups, d, *rest),
                           vs.reshape(local_groups, d, *rest)], dim=1)
        return fused.reshape(local_groups * (per_group + 2) * d, *rest)
    raise ValueError(rule.kind)


def load_hf_weights(folder: str, chunks: List[torch.nn.Module]) -> int:
    """Copy the Hugging Face checkpoint in ``folder`` into ``chunks`` (this rank's model chunks, built
    from ``[model] hf_config`` = the same folder); returns the bytes read.

    The sizes come from the folder's ``config.json`` (those the ``[model]`` section was filled from;
    the login node refused a section that contradicts them), the layout from megatron-core's parallel
    state and each chunk's layers. Every parameter of every chunk is set, or ConfigError names the
    tensor that could not make it (the login node checks the headers before submission:
    :func:`bridge_hpc.training.hf.mapping.check_folder`)."""
    from megatron.core import parallel_state

    hf = families.read_config(folder)
    files = SafetensorsFolder(folder)
    model = families.model_fields(hf, os.path.join(folder, families.CONFIG_FILE))
    family = hf["model_type"]
    prefix = mapping.gpt2_prefix(files.tensors) if family == "gpt2" else ""
    layer_rules, other_rules = mapping.layer_rules(mapping.rules(family, model, prefix))
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    read = 0
    with ExitStack() as stack, torch.no_grad():
        reader = _Reader(files, stack)
        for chunk in chunks:
            module = _unwrap(chunk)
            layers = list(module.decoder.layers) if hasattr(module, "decoder") else []
            for name, param in module.state_dict(keep_vars=True).items():
                if param is None or name.endswith("_extra_state"):
                    continue
                local = mapping.layer_number(mapping.canonical(name))
                if local is not None:
                    index, rest = local
                    rule, layer = layer_rules.get(rest), layers[index].layer_number - 1
                else:
                    rule, layer = other_rules.get(mapping.canonical(name)), None
                    if rule is None and name == "output_layer.weight" and model["share_embeddings_and_output_weights"]:
                        # a last pipeline stage without the embedding keeps its own copy of the tied weight
                        rule = other_rules["embedding.word_embeddings.weight"]
                if rule is None:
                    raise ConfigError(f"no {family} tensor makes the model's parameter {name}", path=folder)
                value = _local(rule, layer, reader, param.shape, model, tp, rank)
                if tuple(value.shape) != tuple(param.shape):
                    raise ConfigError(f"gives {tuple(value.shape)} for {name}, whose shape is {tuple(param.shape)}",
                                      path=folder, key=rule.hf[0][0].format(i=layer))
                param.data.copy_(value)
                read += value.numel() * value.element_size()
    return read

