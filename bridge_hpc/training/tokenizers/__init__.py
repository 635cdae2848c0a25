"""Build a :class:`~bridge_hpc.training.tokenizers.config.TokenizerConfig` into a megatron-core tokenizer.

Why megatron-core's own library (``megatron.core.tokenizers``) and not the libraries directly: the
object it returns is what megatron-core's datasets expect (``eod``, ``vocab_size``,
``unique_identifiers`` for the index cache), and it is what Megatron Bridge builds, so a forward step
that reads ``state.tokenizer`` behaves as under Bridge.

This module imports no torch, megatron or tokenizer library at module level: ``bridge-prepare-data``
and the login node import it, and each optional library is looked for only when its type is built,
so that a missing one is reported by name (with the pip extra that brings it) instead of as an
ImportError deep inside megatron-core.

Nothing is ever downloaded: :meth:`TokenizerConfig.finalize` has already required ``tokenizer_model``
to be a local path, and the Hugging Face libraries are switched to offline mode before they load.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.tokenizers.config import TokenizerConfig

if TYPE_CHECKING:  # training.config imports tokenizers.config, so a run-time import back would be a circle
    from bridge_hpc.training.config import ConfigContainer

#: The pip extra that installs every optional tokenizer library.
DATA_EXTRA = "bridge_hpc[data]"

#: tokenizer_type -> the Python modules it needs beyond megatron-core.
_NEEDS = {
    "HuggingFaceTokenizer": ("transformers", "tokenizers"),
    "SentencePieceTokenizer": ("sentencepiece",),
    "GPTSentencePieceTokenizer": ("sentencepiece",),
    "TikTokenizer": ("tiktoken",),
}

#: The byte-level tokenizer's layout: ids 0-255 are the bytes, then these special tokens in order,
#: so no text byte (not even NUL) can be mistaken for the end of a document.
BYTE_LEVEL_SPECIAL_TOKENS = ("<eod>", "<pad>")


def required_modules(tokenizer_type: str) -> tuple:
    """The optional Python modules a tokenizer type needs (empty for the built-in ones)."""
    return _NEEDS.get(tokenizer_type, ())


def check_libraries(cfg: TokenizerConfig) -> None:
    """Raise a ConfigError naming the tokenizer type and the pip extra when a library is missing."""
    missing = [m for m in required_modules(cfg.tokenizer_type) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"{cfg.tokenizer_type} needs the Python package(s) {', '.join(missing)}, which are not "
                          f"installed: pip install '{DATA_EXTRA}'", key="tokenizer.tokenizer_type")


def _extra_ids(cfg: TokenizerConfig) -> List[str]:
    return [f"<extra_id_{i}>" for i in range(cfg.vocab_extra_ids)]


def _library_and_kwargs(cfg: TokenizerConfig) -> tuple:
    """``(megatron library name, tokenizer path, constructor kwargs)`` for one config.

    The null library is called ``null`` in megatron-core 0.16 and ``null-text`` from 0.17 on (where
    ``megatron_tokenizer`` gained ``TEXT_LIBRARIES``); the other names are the same in 0.16-0.19.
    """
    t = cfg.tokenizer_type
    kwargs: Dict[str, Any] = {}
    if t == "ByteLevelTokenizer":
        specials = list(BYTE_LEVEL_SPECIAL_TOKENS) + _extra_ids(cfg) + list(cfg.special_tokens or [])
        # megatron's ByteLevelTokenizer numbers special tokens downwards from the end of the
        # vocabulary, so it gets them reversed: <eod> = 256, <pad> = 257, then the others.
        kwargs.update(special_tokens=list(reversed(specials)), vocab_size=256, _eos_id=256, _pad_id=257)
        return "byte-level", None, kwargs
    if t == "NullTokenizer":
        from megatron.core.tokenizers import megatron_tokenizer

        kwargs["vocab_size"] = cfg.vocab_size
        return ("null-text" if hasattr(megatron_tokenizer, "TEXT_LIBRARIES") else "null"), None, kwargs
    if t in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        specials = _extra_ids(cfg) + list(cfg.special_tokens or [])
        kwargs.update(cfg.sp_tokenizer_kwargs)
        if specials:
            # megatron-core's SentencePiece wrapper adds special tokens only in its legacy mode.
            kwargs.update(special_tokens=specials, legacy=True)
        return "sentencepiece", cfg.tokenizer_model, kwargs
    if t == "TikTokenizer":
        if cfg.tiktoken_pattern:
            kwargs["pattern"] = cfg.tiktoken_pattern
        if cfg.vocab_size:
            kwargs["vocab_size"] = cfg.vocab_size
        kwargs["num_special_tokens"] = cfg.tiktoken_num_special_tokens
        if cfg.special_tokens:
            kwargs["special_tokens"] = list(cfg.special_tokens)
        return "tiktoken", cfg.tokenizer_model, kwargs
    if t == "HuggingFaceTokenizer":
        path = cfg.tokenizer_model
        if os.path.isfile(path):
            # AutoTokenizer reads a folder; a tokenizer.json (with any tokenizer_config.json beside it)
            # is loaded through its folder.
            path = os.path.dirname(path)
        # Pinned rather than left to megatron-core, whose defaults changed between 0.16 and 0.19.
        kwargs.update(use_fast=True, include_special_tokens=False, trust_remote_code=False)
        kwargs.update(cfg.hf_tokenizer_kwargs)
        if cfg.vocab_file:
            kwargs["vocab_file"] = cfg.vocab_file
        if cfg.merge_file:
            kwargs["merges_file"] = cfg.merge_file
        specials = _extra_ids(cfg) + list(cfg.special_tokens or [])
        if specials:
            kwargs["additional_special_tokens"] = specials
        return "huggingface", path, kwargs
    raise ConfigError(f"unknown tokenizer type {t!r}", key="tokenizer.tokenizer_type")


def build_tokenizer(cfg: TokenizerConfig) -> Any:
    """The megatron-core tokenizer (a ``MegatronTokenizerBase``) that ``cfg`` describes.

    ``cfg`` must be finalized (paths checked and absolute). A library that fails to read the file
    (not a SentencePiece model, a corrupt tokenizer.json, ...) becomes a ConfigError naming
    ``tokenizer.tokenizer_model``.
    """
    check_libraries(cfg)
    if cfg.tokenizer_type == "HuggingFaceTokenizer":
        # Local files only, whatever the user's environment says.
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
    library, path, kwargs = _library_and_kwargs(cfg)
    from megatron.core.tokenizers import MegatronTokenizer

    metadata = {"library": library, "model_type": "gpt"}
    try:
        return MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path=metadata, **kwargs)
    except (OSError, ValueError, RuntimeError, AssertionError, TypeError, KeyError) as err:
        key = "tokenizer.tokenizer_model" if path else "tokenizer.tokenizer_type"
        raise ConfigError(f"{cfg.tokenizer_type} could not be built from {path or 'its settings'!r}: "
                          f"{type(err).__name__}: {err}", key=key) from None


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by`` x the tensor-parallel size.

    Megatron's ``vocab_size_with_padding``: each tensor-parallel rank holds an equal, GPU-friendly
    slice of the embedding.
    """
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def apply_tokenizer_vocab_size(cfg: ConfigContainer, tokenizer: Any) -> int:
    """Set ``cfg.model.vocab_size`` from the tokenizer when the config says so; return it.

    With ``tokenizer.use_tokenizer_vocab_size`` (the default when ``[model]`` sets no ``vocab_size``)
    the model gets the tokenizer's size padded by :func:`padded_vocab_size`. Otherwise the model's
    own size is kept, and must hold every id the tokenizer can produce.
    """
    tok_cfg: Optional[TokenizerConfig] = cfg.tokenizer
    if tok_cfg is None:
        return cfg.model.vocab_size
    if tok_cfg.use_tokenizer_vocab_size:
        cfg.model.vocab_size = padded_vocab_size(tokenizer.vocab_size, tok_cfg.make_vocab_size_divisible_by,
                                                 cfg.model.tensor_model_parallel_size)
    elif cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"{cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer.vocab_size}); leave model.vocab_size unset to follow the tokenizer",
                          key="model.vocab_size")
    return cfg.model.vocab_size


def build_tokenizer_for(cfg: ConfigContainer) -> Optional[Any]:
    """The run's tokenizer, with ``cfg.model.vocab_size`` set from it; None without ``[tokenizer]``.

    Called once on every rank before the model is built (the embedding's size depends on it) and
    before :meth:`ConfigContainer.validate` (which gives mock data the model's vocabulary). The
    tokenizer then goes to the datasets: megatron-core's GPTDataset reads its end-of-document and
    pad ids. Indexed data without a tokenizer is a ConfigError naming ``tokenizer.tokenizer_type``.
    """
    if cfg.tokenizer is None:
        cfg.check_data_needs()
        return None
    tokenizer = build_tokenizer(cfg.tokenizer)
    apply_tokenizer_vocab_size(cfg, tokenizer)
    return tokenizer
