"""A toolkit checkpoint -> a Hugging Face folder (``bridge-hf export``; one process, torch).

The checkpoint is read without a distributed job: its model tensors, whole, straight from the
``torch.distributed.checkpoint`` files (DCP reads any saved sharding into a full tensor). Both back
ends' layouts are read: the CPU back end's (``model.<name>``, one model: CPU runs have no model
parallelism) and megatron-core's sharded one on GPUs (global tensors at any TP/PP layout, the layers
stacked along a first dimension, layer norms under Transformer Engine's names). The tensors are put into
the family's names and layout (:func:`bridge_hpc.training.hf.mapping.registry`'s mappings, the other way) and written as
``model.safetensors`` (sharded with an index above :data:`SHARD_BYTES`), with ``config.json`` and,
where the run had a Hugging Face tokenizer, its files: what ``transformers.AutoModelForCausalLM`` and
``AutoTokenizer`` load.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.new_output import new_output_folder
from bridge_hpc.training.hf import families, mapping

#: Above this many bytes of tensors the weights are split into shards with an index (transformers' 5 GB).
SHARD_BYTES = 5 * 10**9
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def read_checkpoint(path: str, warn: Callable[[str], None] = _warn
                    ) -> Tuple[str, Dict[str, Any], Dict[str, torch.Tensor]]:
    """``(checkpoint folder, its run_config.json, the model's tensors by local-spec name with global layer
    numbers, whole)`` of ``path``: a run's ``checkpoints/`` folder (its newest complete checkpoint) or
    one ``iter_NNNNNNN``. ConfigError naming the folder when there is none, and the damaged file when it
    fails verification; ``warn`` gets one line when a newer, damaged one is passed over (see
    :func:`checkpoint_folder`)."""
    folder = checkpoint_folder(path, warn)
    try:
        return _read_folder(folder, warn)
    except (ConfigError, OSError):
        if os.path.isdir(folder):
            raise
        raise _vanished(path, folder) from None


def _vanished(given: str, folder: str) -> ConfigError:
    """The one line for a checkpoint folder deleted while it was read: a running job's
    ``checkpoint.most_recent_k`` removes its older checkpoints as it saves newer ones (renamed to
    ``*.del``, then deleted), so the folder chosen may go in the middle of the read."""
    again = ("run the export again: it reads the newest checkpoint then" if os.path.normpath(given) != os.path.normpath(folder)
             else f"export one the run still keeps (in {os.path.dirname(os.path.normpath(folder)) or '.'})")
    return ConfigError(f"vanished while it was read: deleted meanwhile (a running job's checkpoint.most_recent_k removes "
                       f"its older checkpoints as it saves newer ones); nothing was written; {again}, or export "
                       "while the run is stopped", path=folder)


def _read_folder(folder: str, warn: Callable[[str], None]) -> Tuple[str, Dict[str, Any], Dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from bridge_hpc.training.checkpoint.layout import RUN_CONFIG_FILE

    try:
        with open(os.path.join(folder, RUN_CONFIG_FILE)) as f:
            run_config = json.load(f)
        model = run_config["model"]
        assert isinstance(model, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        raise ConfigError(f"unreadable, or without a model section ({type(err).__name__})",
                          path=os.path.join(folder, RUN_CONFIG_FILE)) from None
    reader = dcp.FileSystemReader(folder)
    try:
        metadata = reader.read_metadata()
        cpu_layout = any(key.startswith("model.") for key in metadata.state_dict_metadata)
    except (Exception, CheckpointException) as err:
        raise _unreadable(os.path.join(folder, ".metadata"), err) from None
    wanted: Dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata) or "_extra_state" in key:
            continue
        if cpu_layout and not key.startswith("model."):
            continue  # the optimizer's state
        if not cpu_layout and not key.startswith(("embedding.", "decoder.", "output_layer.")):
            continue
        wanted[key] = torch.empty(item.size, dtype=item.properties.dtype)
    try:
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:
        raise _unreadable(folder, err) from None
    tensors: Dict[str, torch.Tensor] = {}
    for key, value in wanted.items():
        name = key[len("model."):] if cpu_layout else key
        if not cpu_layout and name.startswith("decoder.layers.") and mapping.layer_number(name) is None:
            rest = name[len("decoder.layers."):]  # megatron-core's sharded layout: the layers stacked
            for i in range(value.shape[0]):
                tensors[mapping.canonical(f"decoder.layers.{i}.{rest}")] = value[i]
        else:
            tensors[mapping.canonical(name)] = value
    if run_config.get("peft"):
        tensors = _merged_with_base(folder, run_config["peft"], tensors, warn)
    return folder, run_config, tensors


def checkpoint_folder(path: str, warn: Callable[[str], None] = _warn) -> str:
    """The checkpoint folder ``path`` names: ``path`` itself if it is an ``iter_NNNNNNN`` folder, else the
    one a run resuming from it would load (:func:`bridge_hpc.training.checkpoint.layout.checkpoint_choice`:
    the tracker's, else the newest, that passes verification). A newer one passed over because it is
    damaged is one ``warn`` line naming it, its iteration, the file that makes it so and the folder
    exported instead; with none left, one ConfigError naming the damaged files."""
    from bridge_hpc.contracts.run_folder import TRACKER_FILE
    from bridge_hpc.training.checkpoint import layout

    def described(folder: str) -> str:
        name = os.path.basename(folder)
        return f"{name} (iteration {int(layout._ITER_RE.match(name).group(1))})"

    if not os.path.isdir(path):
        raise ConfigError(_NO_CHECKPOINT, path=path)
    if layout._ITER_RE.match(os.path.basename(os.path.normpath(path))):
        problem = layout.verify_checkpoint(path)
        if problem is not None:
            raise ConfigError(f"holds no complete checkpoint: {problem}", path=path)
        return path
    chosen, damaged, tracker_warning = layout.checkpoint_choice(path)
    if tracker_warning:
        warn(tracker_warning)
    parts = [f"{described(folder)} is damaged ({problem})" for folder, problem in damaged]
    if chosen is None:
        raise ConfigError(f"holds no complete checkpoint: {'; '.join(parts)}" if parts else _NO_CHECKPOINT, path=path)
    if parts:
        newest = max(layout.complete_iterations(path))
        first = "the newest checkpoint" if damaged[0][0] == layout.iteration_dir(path, newest) else \
            f"the checkpoint {TRACKER_FILE} names"
        parts[0] = f"{first}, {described(damaged[0][0])}, is damaged ({damaged[0][1]})"
        warn(f"{path}: {'; '.join(parts)}; exporting {described(chosen)} instead")
    return chosen


def _unreadable(path: str, err: BaseException) -> BaseException:
    """The one line for a checkpoint whose files have their manifest's sizes but cannot be read (their
    contents damaged): ConfigError naming ``path`` and the first failure; a Ctrl-C that
    torch.distributed.checkpoint wrapped into its CheckpointException comes back as a KeyboardInterrupt."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:  # CheckpointException: rank -> (exception, traceback)
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) else first
    if isinstance(err, KeyboardInterrupt):
        return KeyboardInterrupt()
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    cause = f"{type(err).__name__}: {text}" if text else type(err).__name__
    if len(cause) > 200:
        cause = cause[:200] + "..."
    return ConfigError(f"cannot be read: its files are all there, at their sizes, but their contents are damaged "
                       f"({cause})", path=path)


_NO_CHECKPOINT = "holds no complete checkpoint (expected a run's checkpoints/ folder or one iter_NNNNNNN)"


def _merged_with_base(folder: str, peft: Dict[str, Any], adapters: Dict[str, torch.Tensor],
                      warn: Callable[[str], None] = _warn) -> Dict[str, torch.Tensor]:
    """The plain model's whole tensors of a PEFT run's checkpoint (``folder``, which holds the adapters
    only): its base (the folder its record names, a toolkit checkpoint or a Hugging Face folder) with
    the adapters merged in (:func:`bridge_hpc.peft.merge.merge_state_dicts`). ConfigError naming the
    record when the base is gone or is no longer the one the adapters were trained on (its digest)."""
    from bridge_hpc.peft import checkpoint as peft_checkpoint
    from bridge_hpc.peft.merge import merge_state_dicts

    record_path = os.path.join(folder, peft_checkpoint.BASE_RECORD_FILE)
    record = peft_checkpoint.read_record(folder)
    if record is None:
        raise ConfigError("is missing: the checkpoint holds PEFT adapters without the record of their base model",
                          path=record_path)
    base = record["base"]
    if not os.path.isdir(base):
        raise ConfigError(f"names the base model {base!r}, which is gone: the adapters cannot be merged without it",
                          path=record_path)
    if not peft_checkpoint.matches_record(record, base):
        raise ConfigError(f"names the base model {base!r}, which changed since the adapters were trained on it "
                          "(another digest): merging them into it would export another model", path=record_path)
    base_tensors = _hf_as_megatron(base) if families.is_hf_folder(base) else read_checkpoint(base, warn)[2]
    return merge_state_dicts(base_tensors, adapters, float(peft["alpha"]), int(peft["dim"]))


def _hf_as_megatron(hf_dir: str) -> Dict[str, torch.Tensor]:
    """A Hugging Face folder's tensors in the local spec's names and layout, whole (one process at
    tensor-parallel size 1, read by the ranks' own loader)."""
    from bridge_hpc.models.hf.convert import _world_of_one
    from bridge_hpc.training.engine.model import gpt_model_provider
    from bridge_hpc.training.hf.load import load_hf_weights

    _world_of_one()
    model = gpt_model_provider(mapping.checked_model_config(hf_dir))
    load_hf_weights(hf_dir, [model])
    return {mapping.canonical(key): value.detach().cpu() for key, value in model.state_dict().items()
            if isinstance(value, torch.Tensor) and "_extra_state" not in key}


def to_hf(tensors: Dict[str, torch.Tensor], model: Dict[str, Any], family: str) -> Dict[str, torch.Tensor]:
    """The Hugging Face tensors of ``family`` made from the model's whole tensors: each mapping of the
    family's registry, the other way (``megatron_to_hf``)."""
    out: Dict[str, torch.Tensor] = {}
    prefix = "transformer." if family == "gpt2" else ""
    for target in mapping.registry(family, model, prefix).resolved():
        if target.megatron_param not in tensors:
            raise ConfigError("missing from the checkpoint", key=target.megatron_param)
        out.update(target.megatron_to_hf(tensors[target.megatron_param]))
    return out


def _base_config(model: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    folder = model.get("hf_config")
    if not folder or not families.is_hf_folder(folder):
        return None
    try:
        return families.read_config(folder)
    except ConfigError:
        return None


def export(checkpoint: str, out_dir: str, dtype: Optional[str] = None,
           progress: Callable[[str], None] = lambda line: None, warn: Callable[[str], None] = _warn) -> Dict[str, Any]:
    """Write the model of ``checkpoint`` to the new folder ``out_dir`` as a Hugging Face model; returns a
    summary. The folder is written into a temporary folder of its own and renamed when complete
    (:func:`bridge_hpc.contracts.new_output.new_output_folder`: nothing half written is left, nothing is
    overwritten). ``dtype``: the saved tensors' (default: the Hugging Face checkpoint the run started
    from, else the checkpoint's own). ``warn``: one line when a newer, damaged checkpoint is passed over."""
    from safetensors.torch import save_file

    progress(f"reading {checkpoint}")
    folder, run_config, tensors = read_checkpoint(checkpoint, warn)
    model = run_config["model"]
    base = _base_config(model)
    family = base["model_type"] if base else families.family_of(model)
    if family is None:
        key, wanted = families.misfit(model)
        raise ConfigError(f"is {model.get(key.split('.', 1)[1])!r}: no supported Hugging Face family has this model "
                          f"(it would need {wanted})", path=os.path.join(folder, run_folder.CHECKPOINT_RUN_CONFIG_FILE), key=key)
    if dtype is None:
        dtype = (base or {}).get("dtype") or (base or {}).get("torch_dtype") or str(
            tensors["embedding.word_embeddings.weight"].dtype).replace("torch.", "")
    if dtype not in _DTYPES:
        raise ConfigError(f"expected one of {', '.join(_DTYPES)}, got {dtype!r}", key="--dtype")
    progress(f"converting {len(tensors)} tensors to {family}'s layout ({dtype})")
    hf_tensors = {k: v.to(_DTYPES[dtype]) for k, v in to_hf(tensors, model, family).items()}
    with new_output_folder(out_dir) as tmp:
        shards = _shards(hf_tensors)
        total = sum(t.numel() * t.element_size() for t in hf_tensors.values())
        weight_map = {}
        for n, shard in enumerate(shards, 1):
            name = "model.safetensors" if len(shards) == 1 else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            progress(f"writing {name} ({n}/{len(shards)})")
            save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        if len(shards) > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        with open(os.path.join(tmp, families.CONFIG_FILE), "w") as f:
            json.dump(families.hf_config(model, base, dtype, None if base else _special_token_ids(run_config)), f,
                      indent=2, sort_keys=True)
        copied = _copy_tokenizer(run_config.get("tokenizer") or {}, model, tmp)
    return {"checkpoint": folder, "family": family, "dtype": dtype, "tensors": len(hf_tensors), "bytes": total,
            "shards": len(shards), "tokenizer_files": copied}


def _special_token_ids(run_config: Dict[str, Any]) -> Dict[str, Optional[int]]:
    """The ``bos``, ``eos`` (a megatron tokenizer's ``eod`` where it has no ``eos``) and ``pad`` ids of the
    run's tokenizer (its ``[tokenizer]`` section, built again), each None where it has none or cannot be
    built again here (its files moved, say): a config without them names no special token, rather than
    transformers' defaults for the family."""
    from bridge_hpc.training.config import TokenizerConfig
    from bridge_hpc.training.tokenizers import build_tokenizer

    section = run_config.get("tokenizer")
    try:
        cfg = TokenizerConfig(**section)
        cfg.finalize()
        tokenizer = build_tokenizer(cfg)
    except Exception:  # noqa: BLE001 - any failure: no ids rather than wrong ones
        return {}
    out: Dict[str, Optional[int]] = {}
    for name, attributes in (("bos", ("bos",)), ("eos", ("eos", "eod")), ("pad", ("pad",))):
        for attribute in attributes:
            try:
                value = getattr(tokenizer, attribute, None)
            except Exception:  # noqa: BLE001 - megatron's tokenizers raise where they have no such token
                value = None
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                out[name] = value
                break
    return out


def _shards(tensors: Dict[str, torch.Tensor]):
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    return shards + [current]


def _copy_tokenizer(tokenizer: Dict[str, Any], model: Dict[str, Any], out: str) -> list:
    """The run's Hugging Face tokenizer files (and the generation config of the folder it started from)."""
    copied = []
    source = tokenizer.get("tokenizer_model") if tokenizer.get("tokenizer_type") == "HuggingFaceTokenizer" else None
    if source and os.path.isfile(source):
        source = os.path.dirname(source)
    if source and os.path.isdir(source):
        for name in families.TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copy2(os.path.join(source, name), os.path.join(out, name))
                copied.append(name)
    hf_dir = model.get("hf_config")
    if hf_dir and os.path.isfile(os.path.join(hf_dir, "generation_config.json")):
        shutil.copy2(os.path.join(hf_dir, "generation_config.json"), os.path.join(out, "generation_config.json"))
    return copied
