"""The ``[dataset]`` section's configs: torch-free dataclasses with Megatron Bridge's names, re-exported
by :mod:`bridge_hpc.training.config` (Bridge's path for them), and the checks the login node runs on
the data they name: blends and splits here; ``.idx`` headers in
:mod:`~bridge_hpc.training.datasets.indexed_files` and fine-tuning records in
:mod:`~bridge_hpc.training.datasets.jsonl_records`, both re-exported here.

The configs never import a builder: :data:`bridge_hpc.training.datasets.builders.BUILDERS` maps each
built-in config type to the function that builds its datasets on the ranks, and a user's own
:class:`DatasetProvider` builds its own (``build_datasets``)."""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from bridge_hpc.contracts.errors import UnexpectedKeywordError
from bridge_hpc.contracts.schema import DeferredPostInit, check_left_at_default, did_you_mean
from bridge_hpc.contracts.schema import check as _check
from bridge_hpc.training.datasets.indexed_files import (  # noqa: F401 - re-exported (the login node's data checks)
    _INDEX_HEADER_BYTES,
    IndexedDatasetHeader,
    Progress,
    _bin_offset,
    read_index_header,
    verify_index,
)
from bridge_hpc.training.datasets.jsonl_records import (  # noqa: F401 - re-exported (the login node's data checks)
    SAMPLED_BYTES,
    SAMPLED_HEAD_RECORDS,
    SAMPLED_SPREAD_RECORDS,
    JsonlProblem,
    _jsonl_sample,
    _line_number,
    check_jsonl_records,
    parse_jsonl_record,
)

logger = logging.getLogger(__name__)


@dataclass
class DatasetBuildContext:
    """What the trainer tells a :class:`DatasetProvider`: how many samples each split must supply."""

    train_samples: int
    valid_samples: int
    test_samples: int
    tokenizer: Optional[Any] = None
    pg_collection: Optional[Any] = None
    #: The model's vocabulary size: token ids in the data must be below it.
    vocab_size: Optional[int] = None


@dataclass
class DataloaderConfig:
    """DataLoader settings shared by every dataset config (Bridge's names).

    ``dataloader_type``: ``"single"`` (None, Bridge's default, means it) loads one micro-batch at a
    time; ``"batch"`` loads each rank's share of a whole global batch at once and splits it into
    micro-batches, so that a dataset with its own ``collate_fn`` (fine-tuning:
    :class:`FinetuningDatasetConfig`) pads every micro-batch of a step to one length. Both read the
    same samples in the same order, the order exact resume relies on; Megatron's ``"cyclic"`` (a new
    random order every pass) and ``"external"`` (iterators the user builds) are refused by name.
    """

    dataloader_type: Optional[Literal["single", "cyclic", "batch", "external"]] = None
    num_workers: int = 2
    data_sharding: bool = True
    pin_memory: bool = True
    drop_last: bool = True
    persistent_workers: bool = True
    #: Bridge's, for Hugging Face dataset paths. Data here comes from local files only, which run no
    #: code, so there is nothing to trust: ``true`` is refused rather than ignored.
    trust_remote_code: Optional[bool] = None

    def finalize(self) -> None:
        _check(self.num_workers >= 0, "dataset.num_workers", "must be >= 0")
        _check(self.dataloader_type in (None, "single", "batch"), "dataset.dataloader_type",
               f"must be \"single\" or \"batch\", got {self.dataloader_type!r}: samples are read in index order from "
               "the consumed-sample count, which is what makes resume exact (no per-pass shuffling, no external "
               "iterators)")
        _check(not self.trust_remote_code, "dataset.trust_remote_code",
               "must not be true: data is read from local files only (no Hugging Face paths), which run no code")
        if self.num_workers == 0:
            self.persistent_workers = False


@dataclass
class DatasetProvider(DataloaderConfig, abc.ABC):
    """Hook for custom data: subclass, implement :meth:`build_datasets`, put it in ``cfg.dataset``.

    The built-in configs (:class:`MockGPTDatasetConfig`, :class:`GPTDatasetConfig`,
    :class:`FinetuningDatasetConfig`) are not providers, as in Megatron Bridge: their datasets are built
    by the function :data:`bridge_hpc.training.datasets.builders.BUILDERS` maps their type to.

    Datasets must be map-style (``__len__`` and ``__getitem__``) and deterministic in the index:
    the trainer samples them in order from the number of consumed samples, which is what makes the
    data position part of every checkpoint and resume exact. Samples are dicts of tensors, the
    shape the forward-step function expects (for :func:`bridge_hpc.training.gpt_step.forward_step`:
    ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, optionally ``attention_mask``).
    """

    @abc.abstractmethod
    def build_datasets(self, context: DatasetBuildContext) -> Tuple[Optional[Any], Optional[Any], Optional[Any]]:
        """Return ``(train, valid, test)``; any may be None."""


#: The ``[dataset]`` keys that name indexed datasets; any of them selects :class:`GPTDatasetConfig`.
GPT_DATASET_PATH_KEYS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")

#: Megatron-LM's ``--split`` default, used when ``data_path`` is given without ``split``.
DEFAULT_SPLIT = "969,30,1"

#: A blend as megatron-core takes it: dataset prefixes and their weights (None: by size).
Blend = Tuple[List[str], Optional[List[float]]]



def _blend_items(value: Union[str, List[Union[str, float]]]) -> List[Union[str, float]]:
    """A ``data_path`` value as a list: a string is split on whitespace (Megatron-LM's form)."""
    return value.split() if isinstance(value, str) else list(value)


def _as_weight(item: Union[str, float]) -> Optional[float]:
    """``item`` as a number, or None when it is not one (a prefix). An integer too large for a float
    (a config built in Python) is infinite, which :func:`parse_blend` then refuses as a weight."""
    try:
        return float(item)
    except OverflowError:
        return float("inf")
    except (TypeError, ValueError):
        return None


def parse_blend(value: Union[str, List[Union[str, float]]], key: str) -> Blend:
    """``data_path`` (or a per-split path) -> ``(prefixes, weights)``, Megatron-LM's ``--data-path`` rules.

    ``["a", "b"]`` is two datasets weighted by their size (weights None); ``["0.7", "a", "0.3", "b"]``
    (or ``"0.7 a 0.3 b"``) weights them explicitly: when the first item is a number, every other item
    is a weight, and each must be a finite positive number. megatron-core divides the weights by their
    float64 sum on every rank (``normalize``): a sum that overflows to inf makes every share 0, which
    fails its assertion that the shares add up to 1 (a bare AssertionError after the queue), and a
    weight tiny next to the others gets a share of 0, a dataset asked for nothing. So the sum must stay
    at most half the float64 range (no order of adding can then overflow) and every share must be a
    normal positive float64 (a margin over 0 for rounding differences between this sum and numpy's).
    Prefixes are returned as given (made absolute by
    :meth:`GPTDatasetConfig.finalize`). A malformed list raises ConfigError naming ``key``.
    """
    items = _blend_items(value)
    _check(len(items) > 0, key, "is empty: give one or more dataset prefixes")
    if _as_weight(items[0]) is None:
        bad = [item for item in items if not isinstance(item, str) or not item]
        _check(not bad, key, f"expected dataset prefixes, got {bad[0]!r} (weights go before every prefix: "
                              "['0.7', 'a', '0.3', 'b'])" if bad else "")
        return [str(item) for item in items], None
    _check(len(items) % 2 == 0, key, f"a weighted blend alternates weight and prefix, got {len(items)} items: "
                                     f"{items!r}")
    prefixes, weights = [], []
    for weight, prefix in zip(items[0::2], items[1::2]):
        number = _as_weight(weight)
        _check(number is not None, key, f"blend weight {weight!r} is not a number (expected weight, prefix, "
                                        "weight, prefix, ...)")
        _check(math.isfinite(number) and number > 0, key,
               f"blend weight {weight!r} must be a positive number (finite, above 0)")
        _check(isinstance(prefix, str) and prefix != "" and _as_weight(prefix) is None, key,
               f"expected a dataset prefix after weight {weight!r}, got {prefix!r}")
        prefixes.append(prefix)
        weights.append(number)
    total = sum(weights)
    _check(total <= sys.float_info.max / 2, key,
           ("the blend weights add up to more than a float64 holds" if math.isinf(total) else
            f"the blend weights add up to {total:g}, too close to the float64 limit ({sys.float_info.max:g})")
           + ": megatron-core divides them by their sum; scale them down (only their ratios matter)")
    for weight, number in zip(items[0::2], weights):
        _check(number / total >= sys.float_info.min, key,
               f"blend weight {weight!r} is too small next to their sum {total:g}: its share {number / total:g} "
               "is not a normal positive float64; raise it or drop its dataset")
    return prefixes, weights


def parse_split(split: str, key: str = "dataset.split") -> List[float]:
    """``"969,30,1"`` -> the train/valid/test fractions; up to three non-negative numbers with a positive sum.

    Stricter than megatron-core's own parser, which picks numbers out of any text and would turn
    ``"90;x"`` or ``"0,0,0"`` into an assertion or a division by zero on every rank.
    """
    parts = [p.strip() for p in str(split).split(",")]
    _check(1 <= len(parts) <= 3, key, f"expected up to three comma-separated weights (train,valid,test) like "
                                      f"'{DEFAULT_SPLIT}', got {split!r}")
    numbers = []
    for part in parts:
        number = _as_weight(part) if part else None
        _check(number is not None and number >= 0 and number != float("inf"), key,
               f"{part!r} is not a non-negative number (expected weights like '{DEFAULT_SPLIT}', got {split!r})")
        numbers.append(number)
    total = sum(numbers)
    _check(total > 0, key, f"the weights add up to 0; expected e.g. '{DEFAULT_SPLIT}', got {split!r}")
    return [n / total for n in numbers] + [0.0] * (3 - len(numbers))




def dataset_config_class(body: Dict[str, Any]) -> type:
    """The dataset config a ``[dataset]`` table selects: fine-tuning data when it names a ``dataset_root``
    (indexed-data keys beside it are then unknown keys), indexed data when it names any prefixes, else
    mock data. Indexed data with any ``fim_*`` key is fill-in-the-middle data (:class:`GPTFIMDatasetConfig`);
    a ``fim_*`` key without prefixes selects it too, so that the missing ``data_path`` is what is reported."""
    if body.get("dataset_root") is not None:
        return FinetuningDatasetConfig
    if any(str(k).startswith("fim_") for k in body):
        return GPTFIMDatasetConfig
    return GPTDatasetConfig if any(body.get(k) is not None for k in GPT_DATASET_PATH_KEYS) else MockGPTDatasetConfig


#: What a job file's ``[dataset]`` of GPT data gets for the fields it leaves out that Bridge's config requires.
JOB_FILE_DEFAULTS = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}


def job_file_body(section_cls: type, body: Dict[str, Any]) -> Dict[str, Any]:
    """``body`` (a ``[dataset]`` table) with :data:`JOB_FILE_DEFAULTS` under it for a GPT dataset config: a job
    file states what differs from plain causal LM data, where a Python config must set all three (Bridge)."""
    return {**JOB_FILE_DEFAULTS, **body} if issubclass(section_cls, GPTDatasetConfig) else body


def absolute_dataset_paths(body: Dict[str, Any], base: str) -> Dict[str, Any]:
    """A copy of a ``[dataset]`` table with every dataset prefix made absolute against ``base``.

    For the launcher: relative prefixes mean the folder bridge-submit runs in, and resolved.toml must hold
    them absolute. Weights stay as they are; a value that does not parse is left for
    :meth:`GPTDatasetConfig.finalize` to report. (``path_to_cache`` is a run-folder path: the launcher
    resolves it against the run folder, like ``checkpoint.save``.)
    """
    out = dict(body)
    for key in GPT_DATASET_PATH_KEYS:
        value = body.get(key)
        if not isinstance(value, (str, list)):
            continue
        items = _blend_items(value)
        weighted = bool(items) and _as_weight(items[0]) is not None
        out[key] = [os.path.join(base, os.path.expanduser(item))
                    if isinstance(item, str) and (not weighted or i % 2 == 1) and _as_weight(item) is None
                    else item for i, item in enumerate(items)]
    return out


@dataclass(init=False)
class GPTDatasetConfig(DataloaderConfig, DeferredPostInit):
    """Megatron indexed datasets (``.bin``/``.idx``) read by megatron-core's ``GPTDataset``, blended and
    split by its ``BlendedMegatronDatasetBuilder``: Megatron Bridge's ``GPTDatasetConfig``, with every
    field of megatron-core's ``GPTDatasetConfig`` (its names and defaults) and Bridge's ``data_path`` and
    ``skip_getting_attention_mask_from_dataset``, and Bridge's constructor
    ``GPTDatasetConfig(seq_length=None, skip_getting_attention_mask_from_dataset=True, data_path=None,
    **kwargs)`` (megatron-core's ``sequence_length=`` works too; ``seq_length`` and ``sequence_length``
    are one value).

    Not a subclass of megatron-core's class, unlike Bridge's: that class's module imports torch and
    megatron-core (about 4 s), and the login node checks a job without them (``bridge-submit
    --dry-run`` in 0.2 s, benchmarks/submit_latency.py). On the ranks
    :func:`bridge_hpc.training.datasets.builders.build_gpt_datasets` builds megatron-core's config from
    it, field for field (:meth:`megatron_fields`), so megatron-core acts on each of them.

    As in Bridge, ``finalize()`` is deferred and turns the CLI-friendly ``data_path`` into
    megatron-core's ``blend``:

    - ``data_path``: prefixes (``["a", "b"]``, weighted by size) or a weighted blend
      (``["0.7", "a", "0.3", "b"]``), split into train/valid/test by ``split`` (default
      ``"969,30,1"``, Megatron-LM's);
    - or ``train_data_path`` / ``valid_data_path`` / ``test_data_path``, each its own blend
      (megatron-core's ``blend_per_split``), without ``split``;
    - or, in Python, megatron-core's ``blend`` / ``blend_per_split`` themselves.

    ``path_to_cache`` holds megatron-core's index cache (document, sample and shuffle indices, blend
    indices), built by rank 0 and then read by the other ranks; ``bridge-submit`` puts it in the run
    folder. ``seq_length = None`` takes ``model.seq_length``. ``skip_getting_attention_mask_from_dataset``
    (Bridge's, default true) leaves the causal mask to the attention kernel, so megatron-core builds no
    mask (:meth:`attention_mask_from_dataset`); ``reset_attention_mask`` needs the dataset's
    per-document mask and so always gets it. Refused when set: object storage (data is local files),
    megatron-core's hybrid context parallelism, and the multiple/full validation modes (see
    ``[validation]``).
    """

    random_seed: int = 1234
    seq_length: Optional[int] = None
    data_path: Optional[Union[str, List[Union[str, float]]]] = None
    train_data_path: Optional[Union[str, List[Union[str, float]]]] = None
    valid_data_path: Optional[Union[str, List[Union[str, float]]]] = None
    test_data_path: Optional[Union[str, List[Union[str, float]]]] = None
    blend: Optional[Blend] = None
    blend_per_split: Optional[List[Optional[Blend]]] = None
    multiple_validation_sets: Optional[bool] = None
    full_validation: Optional[bool] = None
    split: Optional[str] = None
    split_matrix: Optional[List[Tuple[float, float]]] = field(default=None, init=False)
    num_dataset_builder_threads: int = 1
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    mock: bool = field(default=False, init=False)
    #: The run's tokenizer, set on the ranks (from ``[tokenizer]``); never in a job file.
    tokenizer: Optional[Any] = None
    mid_level_dataset_surplus: float = 0.005
    allow_ambiguous_pad_tokens: Optional[bool] = False
    fast_cache_load: bool = False
    defer_npy_index_mmap: bool = False
    reset_position_ids: Optional[bool] = None
    reset_attention_mask: Optional[bool] = None
    eod_mask_loss: Optional[bool] = None
    create_attention_mask: bool = True
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    object_storage_cache_path: Optional[str] = None
    data_parallel_size: int = 1
    sequence_parallel_size: int = 0
    hybrid_context_parallel: bool = False
    sequences_per_dataset: Optional[Dict[str, int]] = None
    token_dtype_code: Optional[int] = field(default=None, init=False)
    context_parallel_size: Optional[int] = None
    skip_getting_attention_mask_from_dataset: bool = True

    def __init__(self, seq_length: Optional[int] = None, skip_getting_attention_mask_from_dataset: bool = True,
                 data_path: Optional[Union[str, List[Union[str, float]]]] = None, *args: Any,
                 sequence_length: Optional[int] = None, **kwargs: Any):
        _check(not args, "dataset", f"takes keyword arguments only, got {len(args)} positional ones")
        _check(seq_length is None or sequence_length is None or seq_length == sequence_length, "dataset.seq_length",
               f"and sequence_length disagree ({seq_length} and {sequence_length}): give one of them")
        fields = {f.name: f for f in dataclasses.fields(self) if f.init}
        unknown = [k for k in kwargs if k not in fields]
        if unknown:
            raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}")
        values = {"seq_length": seq_length if seq_length is not None else sequence_length,
                  "skip_getting_attention_mask_from_dataset": skip_getting_attention_mask_from_dataset,
                  "data_path": data_path, **kwargs}
        for name, f in fields.items():
            if name in values:
                setattr(self, name, values[name])
            elif f.default_factory is not dataclasses.MISSING:
                setattr(self, name, f.default_factory())
            else:
                setattr(self, name, f.default)
        for f in dataclasses.fields(self):
            if not f.init:
                setattr(self, f.name, f.default)

    @property
    def sequence_length(self) -> Optional[int]:
        """megatron-core's name for ``seq_length`` (Bridge's ``seq_length`` is the alias of this one)."""
        return self.seq_length

    @sequence_length.setter
    def sequence_length(self, value: Optional[int]) -> None:
        self.seq_length = value

    def attention_mask_from_dataset(self) -> bool:
        """Whether megatron-core's dataset builds the attention mask: ``create_attention_mask`` and a mask
        that says more than "causal" is wanted (``reset_attention_mask``, or
        ``skip_getting_attention_mask_from_dataset = false``)."""
        return bool(self.create_attention_mask
                    and (self.reset_attention_mask or not self.skip_getting_attention_mask_from_dataset))

    def megatron_fields(self) -> Dict[str, Any]:
        """The values of megatron-core's ``GPTDatasetConfig`` fields (``sequence_length`` for
        ``seq_length``, the attention mask as :meth:`attention_mask_from_dataset` says): what the
        builder gives megatron-core's config on the ranks."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.init and f.name not in _BRIDGE_ONLY_FIELDS}
        out["sequence_length"] = out.pop("seq_length")
        out["create_attention_mask"] = self.attention_mask_from_dataset()
        for key in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            out[key] = bool(out[key])
        return out

    def finalize(self) -> None:
        super().finalize()
        self._check_megatron_options()
        self._check_defined()
        per_split = {k: getattr(self, k) for k in GPT_DATASET_PATH_KEYS[1:] if getattr(self, k) is not None}
        if self.data_path is None and not per_split and (self.blend is not None or self.blend_per_split is not None):
            self._finalize_given_blends()
            return
        if self.data_path is None and not per_split:
            # megatron-core's rule: no blend at all means mock data (a config built in Python, FIM data
            # too, as in Bridge; a job file without data paths gets MockGPTDatasetConfig, see
            # dataset_config_class).
            self.mock, self.split = True, self.split or "1,1,1"
            _check(self.seq_length is None or self.seq_length > 0, "dataset.seq_length", "must be > 0")
            return
        _check(self.data_path is not None or per_split, "dataset.data_path",
               "must be set (or train_data_path / valid_data_path / test_data_path)")
        _check(self.data_path is None or not per_split, f"dataset.{next(iter(per_split), 'train_data_path')}",
               "use either dataset.data_path (with dataset.split) or per-split paths, not both")
        if self.data_path is not None:
            if self.split is None:
                self.split = DEFAULT_SPLIT
            self.blend = self._checked_blend(self.data_path, "dataset.data_path")
            self._check_split_documents()
        else:
            _check(self.split is None, "dataset.split",
                   "is for dataset.data_path; per-split paths are not split again (remove it)")
            self.blend_per_split = [
                self._checked_blend(value, f"dataset.{key}") if value is not None else None
                for key, value in ((k, getattr(self, k)) for k in GPT_DATASET_PATH_KEYS[1:])
            ]
        if self.path_to_cache is not None:
            self.path_to_cache = os.path.abspath(os.path.expanduser(self.path_to_cache))
        _check(self.seq_length is None or self.seq_length > 0, "dataset.seq_length", "must be > 0")
        _check(self.num_dataset_builder_threads >= 1, "dataset.num_dataset_builder_threads", "must be >= 1")
        _check(self.mid_level_dataset_surplus >= 0, "dataset.mid_level_dataset_surplus", "must be >= 0")

    def _check_defined(self) -> None:
        """Bridge's rule, in its words after the key: the three masking switches have no default (megatron-core's
        None); a job file's loader gives them false when the TOML leaves them out (:func:`job_file_body`)."""
        for key in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            _check(getattr(self, key) is not None, f"dataset.{key}", f"{key} must be defined.")

    def _check_megatron_options(self) -> None:
        """megatron-core's options this trainer cannot act on, refused by name; their defaults pass."""
        _check(self.random_seed >= 0, "dataset.random_seed", "must be >= 0")
        check_left_at_default(self, "dataset", {
            "multiple_validation_sets": "the validation split is one dataset (or one blend)",
            "full_validation": "each evaluation reads validation.eval_iters batches",
            "object_storage_cache_path": "data is read from local files (no object storage)",
            "hybrid_context_parallel": "megatron-core's hybrid context parallelism is not set up by bridge_hpc",
        })
        _check(self.tokenizer is None or not isinstance(self.tokenizer, (str, int, float, list, dict)),
               "dataset.tokenizer", "is set on the ranks from the [tokenizer] section, not in [dataset]")
        _check(not (self.fast_cache_load or self.defer_npy_index_mmap) or self.path_to_cache is not None,
               "dataset.fast_cache_load" if self.fast_cache_load else "dataset.defer_npy_index_mmap",
               "needs dataset.path_to_cache (the index cache it reads); bridge-submit sets it for a job")
        _check(self.data_parallel_size >= 1, "dataset.data_parallel_size", "must be >= 1")

    def _finalize_given_blends(self) -> None:
        """``blend`` / ``blend_per_split`` given directly (megatron-core's way, in Python): checked the
        way megatron-core checks them, and every prefix's ``.idx`` read. (Data paths, when given, make the
        blends again in :meth:`finalize`, as Bridge's ``data_path`` does; so finalizing twice is harmless.)"""
        _check(self.blend is None or self.blend_per_split is None, "dataset.blend_per_split",
               "and dataset.blend are incompatible (megatron-core)")
        blends = [("dataset.blend", self.blend)] if self.blend is not None else [
            (f"dataset.blend_per_split[{i}]", b) for i, b in enumerate(self.blend_per_split) if b is not None]
        if self.blend_per_split is not None:
            _check(len(self.blend_per_split) == 3, "dataset.blend_per_split", "must hold 3 blends (train, valid, test)")
            _check(self.split is None, "dataset.split", "and dataset.blend_per_split are incompatible (megatron-core)")
        elif self.split is None:
            self.split = DEFAULT_SPLIT
        for key, (prefixes, weights) in blends:
            _check(weights is None or len(weights) == len(prefixes), key,
                   "prefixes and weights must be equal in number (megatron-core)")
            for prefix in prefixes:
                read_index_header(prefix, key)
        if self.blend is not None:
            self._check_split_documents()
        _check(self.seq_length is None or self.seq_length > 0, "dataset.seq_length", "must be > 0")

    @staticmethod
    def _checked_blend(value: Union[str, List[Union[str, float]]], key: str) -> Blend:
        prefixes, weights = parse_blend(value, key)
        prefixes = [os.path.abspath(os.path.expanduser(p)) for p in prefixes]
        for prefix in prefixes:
            read_index_header(prefix, key)
        return prefixes, weights

    def _check_split_documents(self) -> None:
        """Every split that ``split`` gives a share must get at least one document of every dataset.

        megatron-core splits each dataset by document with ``round(fraction * documents)``; a split
        left with no document, or with empty documents only (no tokens), makes its GPTDataset loop
        forever looking for tokens, on every rank. So a dataset of few documents with a small valid or
        test share is refused here, naming both; the token count of a split takes two reads of the
        ``.idx`` (where its first and its last document start in the ``.bin``).
        """
        fractions = parse_split(self.split)
        bounds, start = [], 0.0
        for fraction in fractions:
            bounds.append((start, start + fraction) if fraction > 0 else None)
            start += fraction
        for prefix in self.blend[0]:
            header = read_index_header(prefix, "dataset.data_path")
            documents = header.sequence_count
            for name, bound in zip(("train", "valid", "test"), bounds):
                if bound is not None:
                    first, end = round(bound[0] * documents), round(bound[1] * documents)
                    _check(end > first, "dataset.split",
                           f"{self.split!r} gives the {name} split none of the {documents} documents of {prefix} "
                           f"(megatron-core splits by document); give it more documents or set its share to 0")
                    _check(_bin_offset(header, end) > _bin_offset(header, first), "dataset.split",
                           f"{self.split!r} gives the {name} split documents {first} to {end - 1} of {prefix}, "
                           "and every one of them is empty (no tokens); give it other documents or set its "
                           "share to 0")

    def prefixes(self) -> List[Tuple[str, str]]:
        """``(prefix, key)`` of every dataset the config reads, in order, each once."""
        out: List[Tuple[str, str]] = []
        named = [("dataset.data_path", self.blend)] if self.blend else [
            (f"dataset.{k}", b) for k, b in zip(GPT_DATASET_PATH_KEYS[1:], self.blend_per_split or []) if b]
        for key, (paths, _) in named:
            out.extend((p, key) for p in paths if p not in [q for q, _ in out])
        return out


#: Bridge's fields of :class:`GPTDatasetConfig` that megatron-core's class does not have.
_BRIDGE_ONLY_FIELDS = frozenset({"data_path", "train_data_path", "valid_data_path", "test_data_path",
                                 "skip_getting_attention_mask_from_dataset", "dataloader_type", "num_workers",
                                 "data_sharding", "pin_memory", "drop_last", "persistent_workers",
                                 "trust_remote_code", "vocab_size", "fim_rate", "fim_spm_rate", "fim_extra_tokens",
                                 "fim_split_sample", "fim_fragment_rate", "fim_no_prefix"})


@dataclass(init=False)
class MockGPTDatasetConfig(GPTDatasetConfig):
    """Synthetic, learnable token sequences (Bridge's ``MockGPTDatasetConfig(seq_length, **kwargs)``, a
    :class:`GPTDatasetConfig` that reads no files): each sample is fully determined by
    ``(random_seed, split, index)``, so resume is exact without any data on disk.

    ``vocab_size`` (bridge_hpc's) bounds the token ids; None takes the model's vocabulary size.
    ``finalize`` refuses ``blend`` / ``blend_per_split`` with Bridge's TypeError ("got an unexpected
    keyword argument 'blend'", a ConfigError naming the key too) and data paths with a ConfigError (Bridge
    would turn ``data_path`` into a blend and read it: mock data reads no files here), drops the two
    blend fields from the instance as Bridge does, and sets megatron-core's ``mock``.
    """

    vocab_size: Optional[int] = None

    def __init__(self, seq_length: Optional[int] = 32, **kwargs: Any):
        super().__init__(seq_length=seq_length, **kwargs)

    def finalize(self) -> None:
        DataloaderConfig.finalize(self)
        self._check_megatron_options()
        for key in ("blend", "blend_per_split"):  # Bridge's error, in its words after the key
            if getattr(self, key):
                raise UnexpectedKeywordError(f"got an unexpected keyword argument '{key}'", key=f"dataset.{key}")
            self.__dict__.pop(key, None)  # as Bridge: a mock config holds no blend (the class's None reads through)
        self._check_defined()
        for key in (*GPT_DATASET_PATH_KEYS, "blend", "blend_per_split"):
            _check(getattr(self, key) is None, f"dataset.{key}", "must be unset for mock data (it reads no files)")
        self.mock = True
        _check(self.seq_length is None or self.seq_length > 0, "dataset.seq_length", "must be > 0")


def reads_indexed_data(dataset: Any) -> bool:
    """A :class:`GPTDatasetConfig` that reads ``.bin``/``.idx`` files: not the mock one, which is a
    GPTDatasetConfig too (as in Bridge) but reads nothing, nor one without any data (megatron-core's
    mock mode, ``mock`` set by finalize)."""
    return isinstance(dataset, GPTDatasetConfig) and not isinstance(dataset, MockGPTDatasetConfig) and not dataset.mock


#: ``fim_extra_tokens`` keys (Bridge's): the three sentinels, padding and end of document.
FIM_TOKEN_KEYS = ("prefix", "middle", "suffix", "pad", "eod")
#: Megatron-LM's FIM sentinel names, used for the keys ``fim_extra_tokens`` leaves out; ``eod`` left
#: out means the tokenizer's own end-of-document token.
DEFAULT_FIM_TOKENS = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>"}


@dataclass(init=False)
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """Fill-in-the-middle on indexed data: Megatron Bridge's ``GPTFIMDatasetConfig`` (Megatron-LM's FIM).

    Any ``fim_*`` key in ``[dataset]`` selects it (see :func:`dataset_config_class`); the rest of the
    table is :class:`GPTDatasetConfig`'s. megatron-core has no FIM dataset, so
    :class:`bridge_hpc.training.datasets.fim.GPTFIMDataset` adds it to megatron-core's ``GPTDataset``: every
    end-of-document-separated segment of a sample is, with probability ``fim_rate``, cut at two
    random points into prefix, middle and suffix and rewritten as PSM
    ``<prefix> prefix <suffix> suffix <middle> middle`` or, with probability ``fim_spm_rate``, SPM
    ``<prefix> <suffix> suffix <middle> prefix middle``; the sample is then cut back to its length.
    With ``fim_split_sample`` (a token, e.g. a file separator) a segment that contains it is, with
    probability ``fim_rate``, split there and each fragment gets FIM with ``fim_fragment_rate``;
    fragments whose text starts with ``fim_no_prefix`` are left as they are. (Without
    ``fim_split_sample`` there are no fragments, and ``fim_fragment_rate``, accepted as in Bridge, acts on none.)

    ``fim_extra_tokens`` names the sentinel tokens (keys ``prefix``, ``middle``, ``suffix``, ``pad``,
    ``eod``); keys left out take Megatron-LM's ``<fim_prefix>``, ``<fim_middle>``, ``<fim_suffix>``,
    ``<fim_pad>`` and the tokenizer's end-of-document token. Each must be one token of the run's
    tokenizer (for the byte-level one: list them in ``[tokenizer] special_tokens``); that is checked
    when the datasets are built, a ConfigError naming ``dataset.fim_extra_tokens.<key>``. Unset
    rates take Megatron-LM's defaults: ``fim_rate`` 0.5, ``fim_spm_rate`` 0.5.

    What differs from Megatron-LM, and why: the cut points fall between tokens, not characters, so
    no text is re-tokenized and a FIM segment holds exactly the segment's tokens plus the three
    sentinels (no tokenizer drift, and never shorter, so the ``pad`` token is accepted for Bridge
    recipes but never needed); and the random draws come from ``(random_seed, split, sample
    index)``, not from one generator shared by every read, so a sample's FIM form does not depend on
    which samples were read before it, which exact resume and loader workers need.
    """

    fim_rate: Optional[float] = None
    fim_spm_rate: Optional[float] = None
    fim_extra_tokens: Optional[Dict[str, str]] = None
    fim_split_sample: Optional[str] = None
    fim_fragment_rate: Optional[float] = None
    fim_no_prefix: Optional[str] = None

    def __init__(self, fim_rate: Optional[float] = None, fim_spm_rate: Optional[float] = None,
                 fim_extra_tokens: Optional[Dict[str, str]] = None, fim_split_sample: Optional[str] = None,
                 fim_fragment_rate: Optional[float] = None, fim_no_prefix: Optional[str] = None, **kwargs: Any):
        super().__init__(fim_rate=fim_rate, fim_spm_rate=fim_spm_rate, fim_extra_tokens=fim_extra_tokens,
                         fim_split_sample=fim_split_sample, fim_fragment_rate=fim_fragment_rate,
                         fim_no_prefix=fim_no_prefix, **kwargs)

    def finalize(self) -> None:
        super().finalize()
        if self.fim_rate is None:
            self.fim_rate = 0.5
        if self.fim_spm_rate is None:
            self.fim_spm_rate = 0.5
        for key in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            value = getattr(self, key)
            _check(value is None or 0 <= value <= 1, f"dataset.{key}", f"must be a probability in [0, 1], got {value!r}")
        tokens = dict(self.fim_extra_tokens or {})
        for name, token in tokens.items():
            _check(name in FIM_TOKEN_KEYS, f"dataset.fim_extra_tokens.{name}",
                   f"unknown key{did_you_mean(name, FIM_TOKEN_KEYS)}; known keys: {', '.join(FIM_TOKEN_KEYS)}")
            _check(isinstance(token, str) and token != "", f"dataset.fim_extra_tokens.{name}",
                   f"expected a token (a non-empty string), got {token!r}")
        self.fim_extra_tokens = {**DEFAULT_FIM_TOKENS, **tokens}
        sentinels = [self.fim_extra_tokens[k] for k in ("prefix", "middle", "suffix")]
        _check(len(set(sentinels)) == 3, "dataset.fim_extra_tokens",
               f"prefix, middle and suffix must be three different tokens, got {sentinels}")
        _check(self.fim_split_sample is None or self.fim_split_sample != "", "dataset.fim_split_sample",
               "expected a token to split samples at, got an empty string")
        # (a fragment rate without fim_split_sample is Bridge's config too: there are no fragments to apply it to)
        _check(self.fim_split_sample is None or self.fim_fragment_rate is not None, "dataset.fim_fragment_rate",
               "must be set with dataset.fim_split_sample (the FIM rate of each fragment)")
        _check(self.fim_no_prefix is None or self.fim_no_prefix != "", "dataset.fim_no_prefix",
               "expected the text that exempts a fragment from FIM, got an empty string")



#: The jsonl files of a fine-tuning ``dataset_root`` (Megatron Bridge's names), per split.
FINETUNING_FILES = {"train": "training.jsonl", "valid": "validation.jsonl", "test": "test.jsonl"}


@dataclass
class FinetuningDatasetConfig(DataloaderConfig):
    """Prompt/answer pairs in jsonl files, tokenized on the fly: Megatron Bridge's ``FinetuningDatasetConfig``.

    ``dataset_root`` holds ``training.jsonl`` and optionally ``validation.jsonl`` and ``test.jsonl``
    (Bridge's names; a missing validation or test file means no such split, as in Bridge, and
    ``do_validation`` / ``do_test = false`` skip one that exists). Each line is a JSON object whose
    ``prompt_key`` and ``answer_key`` fields are strings; the defaults are the fields of Bridge's
    default SFT template (``"{input} {output}"``). A sample is the prompt's tokens followed directly by
    the answer's and the tokenizer's end-of-document token (put any separator into the data), cut to
    ``seq_length`` + 1 tokens by dropping prompt tokens from its start first (the end of a prompt,
    next to the answer, is what the answer depends on), then answer tokens from its end. Only the
    answer and its end-of-document token count in the loss: prompt and padding positions have
    ``loss_mask = 0``.

    ``dataloader_type = "batch"`` (Bridge's default here) pads all micro-batches of one step on a rank
    to one length, the longest sample of that rank's share of the global batch rounded up to a
    multiple of 8 (at most ``seq_length``); ``"single"`` pads each micro-batch on its own.

    The training split is read in a fresh order every pass over the file, shuffled by ``seed``;
    validation and test in file order. ``max_train_samples`` (Bridge's) sets how many training
    samples the run draws before it starts again from the first one; unset, the run's own
    ``train_iters`` x ``global_batch_size``. ``seq_length = None`` takes ``model.seq_length``. Bridge's
    ``memmap_workers``, ``packed_sequence_specs`` and free-form ``dataset_kwargs`` are accepted at
    their defaults only (anything else is a ConfigError): the files are indexed in one pass, sequences
    are not packed, and the options are the typed fields here.
    """

    dataloader_type: Optional[Literal["single", "cyclic", "batch", "external"]] = "batch"
    dataset_root: Optional[str] = None
    seq_length: Optional[int] = None
    seed: int = 1234
    memmap_workers: int = 1
    max_train_samples: Optional[int] = None
    packed_sequence_specs: Optional[Any] = None
    dataset_kwargs: Optional[Dict[str, Any]] = None
    do_validation: bool = True
    do_test: bool = True
    prompt_key: str = "input"
    answer_key: str = "output"

    def finalize(self) -> None:
        super().finalize()
        _check(self.memmap_workers == 1, "dataset.memmap_workers",
               "must be 1: the jsonl files are indexed in one pass, with no memory-map workers")
        _check(self.packed_sequence_specs is None, "dataset.packed_sequence_specs",
               "must be unset: fine-tuning samples are padded, not packed")
        _check(self.dataset_kwargs is None, "dataset.dataset_kwargs",
               "must be unset: the fine-tuning options are this section's own fields (prompt_key, answer_key, ...)")
        _check(self.dataset_root is not None, "dataset.dataset_root",
               f"must be set: the folder with {FINETUNING_FILES['train']} (and optionally "
               f"{FINETUNING_FILES['valid']}, {FINETUNING_FILES['test']})")
        root = os.path.abspath(os.path.expanduser(self.dataset_root))
        _check(os.path.isdir(root), "dataset.dataset_root", f"{self.dataset_root!r} is not an existing folder")
        self.dataset_root = root
        _check(self.dataloader_type in ("single", "batch"), "dataset.dataloader_type",
               f"must be \"batch\" (pad per global batch) or \"single\" for fine-tuning data, got "
               f"{self.dataloader_type!r}")
        _check(self.seq_length is None or self.seq_length > 0, "dataset.seq_length", "must be > 0")
        _check(self.seed >= 0, "dataset.seed", "must be >= 0")
        _check(self.max_train_samples is None or self.max_train_samples > 0, "dataset.max_train_samples",
               "must be > 0")
        for key in ("prompt_key", "answer_key"):
            _check(getattr(self, key) != "", f"dataset.{key}", "must name a jsonl field")
        _check(self.prompt_key != self.answer_key, "dataset.answer_key",
               f"must differ from dataset.prompt_key ({self.prompt_key!r})")

    def split_path(self, split: str) -> Optional[str]:
        """The jsonl file of ``split`` ("train", "valid", "test") when the run reads it, else None."""
        if (split == "valid" and not self.do_validation) or (split == "test" and not self.do_test):
            return None
        path = os.path.join(self.dataset_root, FINETUNING_FILES[split])
        return path if os.path.isfile(path) else None
