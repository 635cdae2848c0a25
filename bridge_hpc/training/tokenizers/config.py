"""``bridge.training.tokenizers.config`` (Megatron Bridge's module path): the ``[tokenizer]`` section.

Beside the builder that reads it (:mod:`bridge_hpc.training.tokenizers`), as the other sections live
beside their components; re-exported by :mod:`bridge_hpc.training.config`, which gathers every
section into the ``ConfigContainer``. Torch-free: the login node checks the tokenizer's files when a
job is submitted, rather than minutes later on every rank."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

from bridge_hpc.contracts.schema import check as _check

#: Tokenizer types that read a file or folder named by ``tokenizer.tokenizer_model``.
TOKENIZER_TYPES_WITH_MODEL = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                              "TikTokenizer")


@dataclass
class TokenizerConfig:
    """Which tokenizer turns text into token ids: Megatron Bridge's ``TokenizerConfig`` names.

    Built on the ranks (and by ``bridge-prepare-data``) with megatron-core's own tokenizer library,
    see :mod:`bridge_hpc.training.tokenizers`. Types: ``HuggingFaceTokenizer`` (a local folder or
    ``tokenizer.json``), ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` (a local ``.model``),
    ``TikTokenizer`` (a local tiktoken vocabulary file), ``NullTokenizer`` (text is space-separated
    ids; needs ``vocab_size``) and ``ByteLevelTokenizer`` (ours, not Bridge's: UTF-8 bytes 0-255 plus
    special tokens from id 256 on, no file at all).

    Nothing is ever downloaded, so ``tokenizer_model`` must be an existing local path: checked here,
    at submission, rather than minutes later on every rank. A relative path means the folder
    bridge-submit runs in (as for ``job.run_dir``); resolved.toml records it absolute.

    ``vocab_size`` is the tokenizer's (Bridge: "size of vocab before EOD or padding"; NullTokenizer
    and TikTokenizer read it). ``use_tokenizer_vocab_size`` says whether the model's vocabulary comes
    from the tokenizer: left unset, :meth:`ConfigContainer.from_sections` makes it true exactly when
    ``[model]`` does not set ``vocab_size``. The tokenizer's size is then padded up to a multiple of
    ``make_vocab_size_divisible_by`` (Megatron's default 128) x the tensor-parallel size.
    ``vocab_extra_ids`` adds ``<extra_id_0>``... special tokens (HuggingFace, SentencePiece, byte-level).
    """

    tokenizer_type: Optional[Literal["HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                                     "TikTokenizer", "NullTokenizer", "ByteLevelTokenizer"]] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_extra_ids: int = 0
    special_tokens: Optional[List[str]] = None
    tiktoken_pattern: Optional[Literal["v1", "v2"]] = None
    tiktoken_num_special_tokens: int = 1000
    hf_tokenizer_kwargs: Dict[str, Any] = field(default_factory=dict)
    sp_tokenizer_kwargs: Dict[str, Any] = field(default_factory=dict)
    make_vocab_size_divisible_by: int = 128
    use_tokenizer_vocab_size: Optional[bool] = None

    def finalize(self) -> None:
        _check(self.tokenizer_type is not None, "tokenizer.tokenizer_type",
               "must be set: HuggingFaceTokenizer, SentencePieceTokenizer, TikTokenizer, NullTokenizer "
               "or ByteLevelTokenizer")
        if self.tokenizer_type in TOKENIZER_TYPES_WITH_MODEL:
            _check(self.tokenizer_model is not None, "tokenizer.tokenizer_model",
                   f"must be set for {self.tokenizer_type}: a local file or folder (nothing is downloaded)")
        else:
            _check(self.tokenizer_model is None, "tokenizer.tokenizer_model",
                   f"is not used by {self.tokenizer_type}; remove it")
        for key in ("tokenizer_model", "vocab_file", "merge_file"):
            value = getattr(self, key)
            if value is None:
                continue
            path = os.path.abspath(os.path.expanduser(value))
            _check(os.path.exists(path), f"tokenizer.{key}",
                   f"{value!r} is not an existing local file or folder (nothing is downloaded: a hub name does not work)")
            setattr(self, key, path)
        _check(self.tokenizer_type != "NullTokenizer" or self.vocab_size is not None, "tokenizer.vocab_size",
               "must be set for NullTokenizer")
        _check(self.vocab_size is None or self.vocab_size > 0, "tokenizer.vocab_size", "must be > 0")
        _check(self.vocab_extra_ids >= 0, "tokenizer.vocab_extra_ids", "must be >= 0")
        _check(self.vocab_extra_ids == 0 or self.tokenizer_type not in ("TikTokenizer", "NullTokenizer"),
               "tokenizer.vocab_extra_ids", f"is not supported by {self.tokenizer_type}")
        _check(self.make_vocab_size_divisible_by > 0, "tokenizer.make_vocab_size_divisible_by", "must be > 0")
        _check(self.tiktoken_num_special_tokens >= 0, "tokenizer.tiktoken_num_special_tokens", "must be >= 0")


__all__ = ["TokenizerConfig"]
