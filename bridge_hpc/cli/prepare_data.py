"""``bridge-prepare-data``: jsonl / jsonl.gz text to megatron-core indexed datasets, one shard per file.

The flags are those of Megatron-LM's ``tools/preprocess_data.py`` that users already know (``--input``,
``--output-prefix``, ``--tokenizer-type``, ``--tokenizer-model``, ``--json-keys``, ``--append-eod``,
``--workers``); ``--input`` takes several files or globs. Runs here with ``--workers`` processes; the
work itself is :mod:`bridge_hpc.data.prepare`. Bad input: one message naming the file (and line or key),
exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from bridge_hpc.contracts.errors import ConfigError, exits_on_config_error
from bridge_hpc.data import prepare
from bridge_hpc.training.config import TokenizerConfig

#: TokenizerConfig key -> the flag that sets it, so a bad value is blamed on what the user typed.
_FLAGS = {"tokenizer_type": "--tokenizer-type", "tokenizer_model": "--tokenizer-model", "vocab_size": "--vocab-size",
          "vocab_file": "--vocab-file", "merge_file": "--merge-file", "tiktoken_pattern": "--tiktoken-pattern"}
_TYPES = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "TikTokenizer",
          "NullTokenizer", "ByteLevelTokenizer")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bridge-prepare-data", description=__doc__.split("\n\n")[0])
    group = p.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_GLOB",
                       help="jsonl or jsonl.gz files (or quoted globs); each becomes one shard")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each line (default: text)")
    group.add_argument("--on-bad-line", choices=("fail", "skip"), default="fail",
                       help="a line that is not JSON or lacks a key: fail naming file:line (default) or skip it")
    group = p.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=_TYPES)
    group.add_argument("--tokenizer-model", help="local tokenizer file or folder (nothing is downloaded)")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer / TikTokenizer vocabulary size")
    group.add_argument("--vocab-file", help="HuggingFaceTokenizer vocabulary file")
    group.add_argument("--merge-file", help="HuggingFaceTokenizer BPE merges file")
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"))
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    group = p.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="path prefix: shards are <prefix>_<shard>_<key>_document.bin/.idx, plus "
                            "<prefix>_<shard>.shard.json and <prefix>.manifest.json")
    group = p.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes on this machine (default 1)")
    return p


def tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    """The finalized TokenizerConfig the flags describe; a bad value names its flag."""
    cfg = TokenizerConfig(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                          vocab_size=args.vocab_size, vocab_file=args.vocab_file, merge_file=args.merge_file,
                          tiktoken_pattern=args.tiktoken_pattern)
    try:
        cfg.finalize()
    except ConfigError as err:
        field = (err.key or "").rpartition(".")[2]
        raise ConfigError(err.message, key=_FLAGS.get(field, err.key)) from None
    return cfg


@exits_on_config_error
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.workers < 1:
        raise ConfigError("must be >= 1", key="--workers")
    cfg = tokenizer_config(args)
    keys: List[str] = list(dict.fromkeys(args.json_keys))
    records = prepare.prepare_local(args.input, args.output_prefix, cfg, keys, args.append_eod, args.workers,
                                    args.on_bad_line, prepare.Progress(sys.stderr))
    documents = sum(r.documents for r in records)
    tokens = sum(r.tokens for r in records)
    print(f"[prepare-data] {len(records)} shard(s), {documents} documents, {tokens} tokens; manifest "
          f"{prepare.manifest_path(str(Path(args.output_prefix).absolute()))}", file=sys.stderr)
    print(prepare.data_path_snippet(records, keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
