"""Fill-in-the-middle (FIM) on megatron-core's ``GPTDataset``: what :class:`GPTFIMDatasetConfig` builds.

megatron-core (0.16-0.19) has no FIM dataset; Megatron-LM's lives outside it. This module adds one on
top of megatron-core's document, sample and shuffle indices: :class:`GPTFIMDataset` reads a sample
exactly as ``GPTDataset`` does and rewrites it with :func:`apply_fim`, so everything else (blending,
splits, the index cache, masks, padding) is megatron-core's own. The transformation is described in
:class:`~bridge_hpc.training.config.GPTFIMDatasetConfig`; in short, each end-of-document-separated
segment becomes, with probability ``fim_rate``, ``<prefix> prefix <suffix> suffix <middle> middle``
(PSM) or ``<prefix> <suffix> suffix <middle> prefix middle`` (SPM), and the sample keeps its length.

Every random draw of sample ``i`` comes from a generator seeded with ``(random_seed, split, i)``: the
FIM form of a sample is a function of its index, like the sample itself, so loader workers and a
resumed run see the same tokens as an uninterrupted run.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.datasets.config import GPTFIMDatasetConfig

__all__ = ["FIMSettings", "GPTFIMDataset", "MCoreGPTFIMDatasetConfig", "apply_fim", "fim_settings", "token_id"]


@dataclass(frozen=True)
class FIMSettings:
    """A :class:`GPTFIMDatasetConfig` resolved against the run's tokenizer: rates and token ids."""

    rate: float
    spm_rate: float
    prefix_id: int
    middle_id: int
    suffix_id: int
    eod_id: int
    split_id: Optional[int] = None
    fragment_rate: Optional[float] = None
    no_prefix: Optional[str] = None


@dataclass
class MCoreGPTFIMDatasetConfig(MCoreGPTDatasetConfig):
    """megatron-core's GPT dataset config plus the resolved FIM settings, which the builder hands to
    every :class:`GPTFIMDataset` it makes."""

    fim: Optional[FIMSettings] = None


def token_id(tokenizer: Any, token: str, key: str, single_text_token: bool = False) -> int:
    """The id of ``token`` in a megatron-core tokenizer; a ConfigError naming ``key`` if it is not one token.

    A token is looked up in the vocabulary (special tokens included) and must map back to itself, so
    an unknown token (which some libraries map to ``<unk>``, and the byte-level one to the string itself)
    is refused. ``single_text_token`` also accepts text that tokenizes to exactly one id (a split
    token such as a newline need not be a special token; sentinels must be).
    """
    library = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        ids = list(library.tokens_to_ids([token]))
        found = (len(ids) == 1 and isinstance(ids[0], numbers.Integral)
                 and list(library.ids_to_tokens([int(ids[0])])) == [token])
    except (KeyError, ValueError, TypeError, IndexError, AttributeError):
        found = False
    if found:
        return int(ids[0])
    if single_text_token:
        ids = list(tokenizer.tokenize(token))
        if len(ids) == 1:
            return int(ids[0])
    raise ConfigError(f"{token!r} is not a token of the run's tokenizer ({type(library).__name__}): FIM needs it "
                      "as one token; add it to [tokenizer] special_tokens (the data need not be prepared again: "
                      "special tokens get ids after the text's)", key=key)


def fim_settings(config: GPTFIMDatasetConfig, tokenizer: Any) -> FIMSettings:
    """Resolve ``config``'s token names against ``tokenizer`` (ConfigErrors name the key)."""
    tokens = config.fim_extra_tokens or {}
    ids = {name: token_id(tokenizer, tokens[name], f"dataset.fim_extra_tokens.{name}")
           for name in ("prefix", "middle", "suffix")}
    # Accepted for Bridge recipes and checked, but never used: see GPTFIMDatasetConfig.
    if "pad" in tokens:
        token_id(tokenizer, tokens["pad"], "dataset.fim_extra_tokens.pad")
    eod = token_id(tokenizer, tokens["eod"], "dataset.fim_extra_tokens.eod") if "eod" in tokens else int(tokenizer.eod)
    split = (token_id(tokenizer, config.fim_split_sample, "dataset.fim_split_sample", single_text_token=True)
             if config.fim_split_sample is not None else None)
    return FIMSettings(rate=config.fim_rate, spm_rate=config.fim_spm_rate, prefix_id=ids["prefix"],
                       middle_id=ids["middle"], suffix_id=ids["suffix"], eod_id=eod, split_id=split,
                       fragment_rate=config.fim_fragment_rate, no_prefix=config.fim_no_prefix)


def _permute(tokens: np.ndarray, rate: float, fim: FIMSettings, rng: np.random.Generator,
             detokenize: Callable[[np.ndarray], str]) -> np.ndarray:
    """With probability ``rate``: the PSM or SPM form of ``tokens`` cut at two random token boundaries."""
    if rng.random() >= rate:
        return tokens
    if fim.no_prefix is not None and detokenize(tokens).startswith(fim.no_prefix):
        return tokens
    # Either cut may be 0 or len (empty prefix or suffix), and they may coincide (empty middle).
    lo, hi = sorted(int(b) for b in rng.integers(0, len(tokens) + 1, size=2))
    prefix, middle, suffix = tokens[:lo], tokens[lo:hi], tokens[hi:]
    if rng.random() < fim.spm_rate:
        parts = ([fim.prefix_id, fim.suffix_id], suffix, [fim.middle_id], prefix, middle)
    else:
        parts = ([fim.prefix_id], prefix, [fim.suffix_id], suffix, [fim.middle_id], middle)
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def _split_and_permute(segment: np.ndarray, fim: FIMSettings, rng: np.random.Generator,
                       detokenize: Callable[[np.ndarray], str]) -> np.ndarray:
    """FIM of one document segment; with ``fim.split_id``, of each of its fragments (Megatron-LM's rule:
    the segment is chosen with ``rate``, then each fragment with ``fragment_rate``)."""
    if fim.split_id is None or not np.any(segment == fim.split_id):
        return _permute(segment, fim.rate, fim, rng, detokenize)
    if rng.random() >= fim.rate:
        return segment
    out, start = [], 0
    for position in np.flatnonzero(segment == fim.split_id):
        if position > start:
            out.append(_permute(segment[start:position], fim.fragment_rate, fim, rng, detokenize))
        out.append(np.asarray([fim.split_id], dtype=np.int64))
        start = position + 1
    if start < len(segment):
        out.append(_permute(segment[start:], fim.fragment_rate, fim, rng, detokenize))
    return np.concatenate(out)


def apply_fim(sample: np.ndarray, fim: FIMSettings, rng: np.random.Generator,
              detokenize: Callable[[np.ndarray], str], pad_id: Optional[int] = None) -> np.ndarray:
    """``sample`` with FIM applied to each segment between end-of-document tokens, cut back to its length.

    Every end-of-document token stays where the segments put it (empty segments included). Trailing
    ``pad_id`` tokens (megatron-core pads the last, short sample) are not content: they are set aside
    and put back, so padding stays padding and keeps its zero loss mask.
    """
    sample = np.asarray(sample, dtype=np.int64)
    length = len(sample)
    content = length
    if pad_id is not None:
        while content > 0 and sample[content - 1] == pad_id:
            content -= 1
    body = sample[:content]
    out, start = [], 0
    for position in np.flatnonzero(body == fim.eod_id):
        if position > start:
            out.append(_split_and_permute(body[start:position], fim, rng, detokenize))
        out.append(np.asarray([fim.eod_id], dtype=np.int64))
        start = position + 1
    if start < content:
        out.append(_split_and_permute(body[start:], fim, rng, detokenize))
    result = np.concatenate(out)[:content] if out else body
    return np.concatenate([result, sample[content:]])


class GPTFIMDataset(GPTDataset):
    """megatron-core's ``GPTDataset`` whose samples are rewritten by :func:`apply_fim`.

    Built by megatron-core's ``BlendedMegatronDatasetBuilder`` like ``GPTDataset`` (same indices; the
    class name keeps its index cache files apart), with an :class:`MCoreGPTFIMDatasetConfig`.
    """

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        sample, document_ids = super()._query_document_sample_shuffle_indices(idx)
        fim: FIMSettings = self.config.fim
        rng = np.random.default_rng([int(self.config.random_seed), int(self.index_split.value), int(idx)])
        return apply_fim(sample, fim, rng, self._detokenize, pad_id=self._pad_token_id), document_ids

    def _detokenize(self, tokens: np.ndarray) -> str:
        return self.config.tokenizer.detokenize([int(t) for t in tokens])
