"""The ranks' sections of a job file as resolved.toml records them, and the login node's checks of the
models they name.

Why a module of its own: :mod:`bridge_hpc.jobfile.jobconfig` checks the launcher's sections
(``[job]``, ``[slurm]``, ``[env]``, ...); the training sections it carries to the ranks unchanged but
resolved here first: every path made absolute (outputs in the run folder, inputs where bridge-submit
runs), the stop signal's list in ``train.exit_signal``, a Hugging Face folder turned into ``[model]``
(and ``[tokenizer]``), and a base checkpoint checked against the model, so that none of it fails on
the ranks after the queue. Torch-free: the training package's modules it reads are its torch-free
ones, a floor below.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict

from bridge_hpc.contracts import run_folder, signals
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import build_dataclass
from bridge_hpc.jobfile.sources import _expanduser, _Where
from bridge_hpc.training.checkpoint import architecture as base_architecture
from bridge_hpc.training.config import SECTIONS as TRAINING_SECTIONS  # torch-free
from bridge_hpc.training.config import GPTModelConfig, absolute_dataset_paths, dataset_config_class, recipe_fields
from bridge_hpc.training.datasets.config import GPTDatasetConfig, MockGPTDatasetConfig  # the torch-free ones
from bridge_hpc.training.hf import families as hf_families
from bridge_hpc.training.hf import mapping as hf_mapping

#: Training paths placed in the run folder: (section, key, default name in the run folder or None).
_RUN_FOLDER_PATHS = (
    ("checkpoint", "save", run_folder.CHECKPOINTS_DIR),
    ("checkpoint", "load", None),
    ("logger", "tensorboard_dir", run_folder.TENSORBOARD_DIR),
    ("logger", "metrics_file", run_folder.METRICS_FILE),
    ("logger", "save_config_filepath", None),
    ("logger", "wandb_save_dir", None),
    ("dist", "flight_recorder_dump_path", None),
)
#: Run-folder paths that an empty string turns off (what is then not written): ``tensorboard_dir = ""``
#: is Megatron Bridge's "no TensorBoard" (its default, None, cannot be written in TOML).
_OFF_WHEN_EMPTY = {("logger", "tensorboard_dir"): "TensorBoard"}


#: What a job gets unless it says otherwise, where Megatron Bridge's default suits a script but not a
#: job on a preemptible cluster: (section, key, value). The progress log is what bridge-report and the
#: goodput figures read, so a job writes it, as it writes TensorBoard events (``log_progress = false``
#: turns it off).
_JOB_DEFAULTS = (("logger", "log_progress", True),)


#: Training inputs given as paths: relative ones mean the folder bridge-submit runs in, as for
#: ``job.run_dir`` and ``job.forward_step``. (Dataset prefixes: :func:`absolute_dataset_paths`.)
_INPUT_PATHS = (
    ("checkpoint", "pretrained_checkpoint"),
    ("model", "hf_config"),
    ("dataset", "dataset_root"),
    ("tokenizer", "tokenizer_model"),
    ("tokenizer", "vocab_file"),
    ("tokenizer", "merge_file"),
    ("dist", "nccl_communicator_config_path"),
)


def _recipe_table(value: Any, where: "_Where") -> Dict[str, Any]:
    """``[mixed_precision]`` as a table: a recipe name (``mixed_precision = "bf16_mixed"``, Bridge's
    spelling) becomes the fields it sets, so resolved.toml records the precision the ranks used."""
    if not isinstance(value, str):
        return dict(value)
    try:
        return recipe_fields(value)
    except ConfigError as err:
        raise where.error("mixed_precision", err.message) from None


def _resolved_training_sections(doc: Dict[str, Any], run_dir: str, base: Path, stop_signal: signals.StopSignal,
                                where: "_Where") -> Dict[str, Dict[str, Any]]:
    """The ranks' sections as resolved.toml records them: every path absolute (outputs relative to the
    run folder, so a job file and its resolved.toml place files identically; inputs relative to
    ``base``, the folder bridge-submit runs in) and ``train.exit_signal`` set to the stop signal's list
    (:mod:`bridge_hpc.contracts.signals`)."""
    training = {k: _recipe_table(v, where) if k == "mixed_precision" else dict(v)
                for k, v in doc.items() if k in TRAINING_SECTIONS}
    for section, key in _INPUT_PATHS:
        value = training.get(section, {}).get(key)
        if isinstance(value, str) and value.strip():
            try:
                path = _expanduser(value)
            except ValueError as err:
                raise where.error(f"{section}.{key}", str(err)) from None
            training[section][key] = str(path if path.is_absolute() else base / path)
    _hugging_face_sections(training, where)
    _toolkit_base_matches_model(training, where)
    dataset = training.get("dataset")
    indexed = dataset is not None and issubclass(dataset_config_class(dataset), GPTDatasetConfig) and not issubclass(
        dataset_config_class(dataset), MockGPTDatasetConfig)  # mock data is a GPTDatasetConfig that reads no files
    if indexed:
        dataset = absolute_dataset_paths(dataset, str(base))
        cache = dataset.get("path_to_cache") or run_folder.DATASET_CACHE_DIR
        if isinstance(cache, str):
            try:
                cache_path = _expanduser(cache)
            except ValueError as err:
                raise where.error("dataset.path_to_cache", str(err)) from None
            dataset["path_to_cache"] = str(cache_path if cache_path.is_absolute() else Path(run_dir) / cache_path)
        training["dataset"] = dataset
    for section, key, default in _RUN_FOLDER_PATHS:
        value = training.get(section, {}).get(key)
        if value is None and default is None:
            continue
        switch = _OFF_WHEN_EMPTY.get((section, key))
        if switch and value is not None and (not isinstance(value, str) or value != value.strip()):
            raise where.error(f"{section}.{key}", f'expected a folder path (relative ones are in the run folder), or "" '
                              f"to turn {switch} off, got {value!r}")
        if value is not None and not isinstance(value, str):
            continue  # the section's own type check names it
        if switch and value == "":
            continue  # off: resolved.toml keeps the "" so that the ranks see it too
        try:
            path = _expanduser(value) if value is not None else Path(default)
        except ValueError as err:
            raise where.error(f"{section}.{key}", str(err)) from None
        training.setdefault(section, {})[key] = str(path if path.is_absolute() else Path(run_dir) / path)
    for section, key, value in _JOB_DEFAULTS:
        training.setdefault(section, {}).setdefault(key, value)
    train = training.setdefault("train", {})
    wanted = list(stop_signal.rank_signals)
    given = train.get("exit_signal")
    if given is None:
        train["exit_signal"] = wanted
    else:
        names = [given] if isinstance(given, str) else given
        missing = [n for n in wanted if isinstance(names, list) and n not in names]
        if missing:
            raise where.error("train.exit_signal", f"must include {', '.join(missing)}: Slurm will send it "
                              f"(slurm.signal = {stop_signal.sbatch_value!r}) and a rank without a handler dies "
                              "without a checkpoint; leave train.exit_signal unset to follow slurm.signal")
    return training


def _hugging_face_sections(training: Dict[str, Dict[str, Any]], where: "_Where") -> None:
    """``[model] hf_config`` (also implied by a Hugging Face folder as ``checkpoint.pretrained_checkpoint``):
    the model section filled from the folder's config.json (:func:`bridge_hpc.training.hf.families.fill_model_section`:
    explicit keys win, contradictions refused), the folder's tokenizer unless ``[tokenizer]`` is given,
    and a Hugging Face ``pretrained_checkpoint`` checked against the model from its safetensors headers
    (missing, truncated or misshapen tensors), so that none of it fails on the ranks."""
    model = training.get("model")
    pretrained = training.get("checkpoint", {}).get("pretrained_checkpoint")
    hf_pretrained = isinstance(pretrained, str) and hf_families.is_hf_folder(pretrained)
    config_key = "model.hf_config"  # the job's key that names the folder the model comes from
    if hf_pretrained and (model is None or model.get("hf_config") is None):
        model = training.setdefault("model", {})
        model["hf_config"] = pretrained
        config_key = "checkpoint.pretrained_checkpoint"
    folder = model.get("hf_config") if isinstance(model, dict) else None
    if folder is None:
        return
    if not isinstance(folder, str) or not folder.strip():
        raise where.error("model.hf_config", f"expected a Hugging Face model folder (with config.json), got {folder!r}")
    folder_key = config_key
    try:
        filled, _ = hf_families.fill_model_section(model, folder)
        if hf_pretrained:
            finalized = build_dataclass(GPTModelConfig, "model", filled, lambda key, message: ConfigError(message, key=key))
            finalized.finalize()
            folder_key = "checkpoint.pretrained_checkpoint"
            hf_mapping.check_folder(pretrained, dataclasses.asdict(finalized))
    except ConfigError as err:
        if err.key and not err.path:  # a key of the job's [model]
            raise where.error(err.key, err.message) from None
        if not err.key:  # the folder itself (no config.json, say): the job's key that names it
            raise where.error(folder_key, f"{err.path}: {err.message}" if err.path else err.message) from None
        raise  # a key of one of the folder's files (config.json's model_type, a tensor): that file and key
    training["model"] = filled
    if "tokenizer" not in training and any(os.path.isfile(os.path.join(folder, name))
                                           for name in hf_families.TOKENIZER_FILES):
        training["tokenizer"] = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": folder}


def _toolkit_base_matches_model(training: Dict[str, Dict[str, Any]], where: "_Where") -> None:
    """A toolkit checkpoint as ``checkpoint.pretrained_checkpoint``: the model it was written by (its
    run_config.json) against the job's ``[model]``, on every field that fixes a tensor's shape
    (:mod:`bridge_hpc.training.checkpoint.architecture`), so that a base of another architecture is
    refused here, not by a size mismatch on every rank after the queue."""
    pretrained = training.get("checkpoint", {}).get("pretrained_checkpoint")
    if not isinstance(pretrained, str) or not pretrained.strip() or hf_families.is_hf_folder(pretrained):
        return
    folder = base_architecture.base_iteration_folder(pretrained)
    if folder is None:
        return  # nothing to compare yet (the ranks say what is missing when they read it)
    try:
        saved = base_architecture.saved_model(folder)
    except ConfigError as err:
        raise where.error("checkpoint.pretrained_checkpoint", f"{err.path}: {err.message}") from None
    try:
        model = build_dataclass(GPTModelConfig, "model", training.get("model", {}),
                                lambda key, message: ConfigError(message, key=key))
        model.finalize()
    except ConfigError as err:
        raise where.error(err.key or "model", err.message) from None
    found = base_architecture.first_contradiction(saved, dataclasses.asdict(model))
    if found is not None:
        name, wanted, theirs = found
        raise where.error(f"model.{name}", f"is {wanted!r}, but checkpoint.pretrained_checkpoint {folder} holds a model "
                          f"with {name} = {theirs!r} (its tensors cannot be read into this model): set model.{name} = "
                          f"{theirs!r}, or start from a checkpoint of this architecture")
