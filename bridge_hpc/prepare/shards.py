"""Raw jsonl text to megatron-core indexed datasets, one shard per input file.

The pieces are separate so that a Slurm array job (one task per input file, then a final step) can
reuse them as they are: :func:`prepare_shard` makes one shard and its record, :func:`check_shards`
verifies finished shards against their records, :func:`write_manifest` writes the manifest and
:func:`data_path_snippet` the ``[dataset]`` lines. :func:`prepare_local` strings them together for
a run on this machine.

Files, for ``--output-prefix out/corpus`` and an input ``wiki_00.jsonl.gz`` (shard name ``wiki_00``,
the file name without ``.jsonl``/``.json``/``.gz``) and json key ``text``:

- ``out/corpus_wiki_00_text_document.bin`` / ``.idx`` — megatron-core's format, written by its
  ``IndexedDatasetBuilder``; ``out/corpus_wiki_00_text_document`` is the prefix ``data_path`` names
  (the ``<prefix>_<key>_document`` naming of Megatron-LM's ``preprocess_data.py``, with the shard);
- ``out/corpus_wiki_00.shard.json`` — the shard's record (:class:`ShardRecord`): written last, after
  the data files were renamed into place, so its presence means the shard is complete. A Slurm task
  writes only its own record; nothing is shared between tasks;
- ``out/corpus.manifest.json`` — every shard's record plus the settings and totals.

One writer per prefix: every writer holds ``<output-prefix>.lock``
(:mod:`bridge_hpc.prepare.prefix_lock`) before it reads a record. A shard is written under temporary
names private to its writer (host, pid), read back and checked against the checksums computed while
writing, and only then renamed into place; the record comes last. A re-run keeps a shard only when
its record matches the source (path, size and modification time; or, when the time differs or the
file was moved or reached through a symlink, the sha256 of its bytes), the settings (tokenizer, json
keys, EOD) and the shard's own files: their sizes, and a digest of a sample of their bytes (the whole
file up to :data:`SAMPLE_WHOLE_BYTES`; all bytes when a file's time differs from its record, or with
``verify``). A damaged shard is rebuilt, never trusted. A record naming a *different* source file is
refused rather than overwritten.

Bad input is a :class:`ConfigError` naming the file and line (``file:line``) or the json key. Torch
and megatron-core are imported inside the functions that need them, so the module itself is cheap to import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import gzip
import hashlib
import io
import itertools
import json
import os
import re
import signal
import socket
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.text import has_control_chars
from bridge_hpc.prepare import worker_pool
from bridge_hpc.prepare.prefix_lock import hold_prefix
from bridge_hpc.training.config import TokenizerConfig
from bridge_hpc.training.tokenizers import build_tokenizer

#: Format version of shard records and the manifest.
FORMAT = 1
#: Bytes of input per unit of work sent to a worker (whole lines, so a little more): large enough
#: that sending it costs little per document, small enough that the last blocks of a file keep
#: every worker busy until close to the end.
BLOCK_BYTES = 256 * 1024
#: Blocks per worker sent ahead of the one the writer waits for. Results come back in input order,
#: so a worker that finishes early idles unless blocks after the awaited one are already queued.
BLOCKS_IN_FLIGHT = 8
#: Bytes of a text file per block of compressed input, to size the worker pool of a ``.gz`` input.
GZIP_EXPANSION = 4
#: A shard file up to this size is digested whole on every re-run; a larger one by
#: :data:`SAMPLE_BLOCKS` blocks of :data:`SAMPLE_BLOCK_BYTES` spread over it (first and last included).
SAMPLE_WHOLE_BYTES = 64 << 20
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 64 << 10
#: Temporary files of a shard: ``<dataset prefix>`` + this + ``<host>-<pid>`` + ``.bin``/``.idx``.
TMP_MARK = ".tmp-"
_GLOB_CHARS = re.compile(r"[*?\[]")
_SHARD_SUFFIXES = (".gz", ".jsonl", ".json")


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass
class SourceInfo:
    """The input file a shard was made from: enough to tell whether it changed since."""

    path: str
    size: int
    mtime_ns: int
    sha256: str


@dataclass
class OutputFiles:
    """One indexed dataset (one json key) of a shard: ``prefix`` + ``.bin`` / ``.idx``."""

    prefix: str
    documents: int
    tokens: int
    bin_bytes: int
    idx_bytes: int
    bin_sha256: str
    idx_sha256: str
    # What a re-run checks cheaply (None in records of earlier versions: the full sha256 is checked).
    bin_mtime_ns: Optional[int] = None
    idx_mtime_ns: Optional[int] = None
    bin_sample_sha256: Optional[str] = None
    idx_sample_sha256: Optional[str] = None

    def files(self) -> List[Tuple[str, int, str, Optional[int], Optional[str]]]:
        """``(path, bytes, sha256, mtime_ns, sample sha256)`` of the ``.bin`` and the ``.idx``."""
        return [(self.prefix + ".bin", self.bin_bytes, self.bin_sha256, self.bin_mtime_ns, self.bin_sample_sha256),
                (self.prefix + ".idx", self.idx_bytes, self.idx_sha256, self.idx_mtime_ns, self.idx_sample_sha256)]


@dataclass
class ShardRecord:
    """What one input file became; written beside the shard as ``<output-prefix>_<name>.shard.json``.

    ``settings`` is :func:`settings_of` (tokenizer, json keys, EOD): a shard made with other
    settings is not reused. ``skipped_lines`` counts lines dropped by ``--on-bad-line skip``.
    """

    name: str
    source: SourceInfo
    settings: Dict[str, Any]
    dtype: str
    documents: int
    skipped_lines: int
    outputs: Dict[str, OutputFiles] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.outputs.values())

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "ShardRecord":
        return cls(name=data["name"], source=SourceInfo(**data["source"]), settings=data["settings"],
                   dtype=data["dtype"], documents=data["documents"], skipped_lines=data["skipped_lines"],
                   outputs={k: OutputFiles(**v) for k, v in data["outputs"].items()})


def settings_of(tokenizer_cfg: TokenizerConfig, json_keys: Sequence[str], append_eod: bool) -> Dict[str, Any]:
    """The settings that decide a shard's token ids; a shard is reused only when they are equal.

    The vocabulary padding fields only concern the model, not the ids, so they are left out.
    """
    tok = dataclasses.asdict(tokenizer_cfg)
    for key in ("make_vocab_size_divisible_by", "use_tokenizer_vocab_size"):
        tok.pop(key)
    return {"format": FORMAT, "tokenizer": tok, "json_keys": list(json_keys), "append_eod": append_eod}


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------


def shard_name(path: Path) -> str:
    """The shard's name: the file name less ``.gz``/``.jsonl``/``.json``, other characters than
    letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``."""
    name = path.name
    for suffix in _SHARD_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def dataset_prefix(output_prefix: str, shard: str, key: str) -> str:
    """``<output-prefix>_<shard>_<key>_document``: what ``[dataset] data_path`` lists."""
    return f"{output_prefix}_{shard}_{key}_document"


def record_path(output_prefix: str, shard: str) -> Path:
    return Path(f"{output_prefix}_{shard}.shard.json")


def manifest_path(output_prefix: str) -> Path:
    return Path(f"{output_prefix}.manifest.json")


def check_output_names(output_prefix: str, paths: Sequence[Path], json_keys: Sequence[str]) -> None:
    """Refuse, before anything is written, output file names the file system cannot hold: a json key
    is part of each dataset's file name (``<prefix>_<shard>_<key>_document.bin``, Megatron-LM's
    naming), so it may not hold ``/`` or control characters; and the longest name, with its
    temporary suffix, must fit the file system's name limit. Blames the key, the input whose name
    makes the shard's name, or the prefix."""
    for key in json_keys:
        if not key or key in (".", "..") or "/" in key or has_control_chars(key):
            raise ConfigError(f"{key!r} names the dataset files (<prefix>_<shard>_<key>_document.bin): expected a "
                              "json key without '/' or control characters", key="--json-keys")
    folder = Path(output_prefix).absolute().parent
    try:
        limit = os.pathconf(folder if folder.is_dir() else "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    base = Path(output_prefix).name
    tmp_suffix = f"{TMP_MARK}{socket.gethostname()}-{os.getpid()}.bin"
    for key in json_keys:
        for path in paths:
            name = f"{base}_{shard_name(path)}_{key}_document{tmp_suffix}"
            if len(os.fsencode(name)) > limit:
                blame = {"path": str(path), "key": "--input"} if len(os.fsencode(shard_name(path))) > limit // 2 \
                    else {"key": "--output-prefix"}
                raise ConfigError(f"its dataset files would be named {len(os.fsencode(name))} bytes long "
                                  f"({name[:40]}...), more than the file system's {limit}: shorten the input's "
                                  "name or --output-prefix", **blame)


def expand_inputs(patterns: Sequence[str]) -> List[Path]:
    """Files named by ``--input`` (names or globs), in the order given, each once, absolute.

    A name that does not exist, a glob that matches nothing, a folder, or two files that would make
    shards of the same name are refused, naming the input.
    """
    found: List[Path] = []
    for pattern in patterns:
        if _GLOB_CHARS.search(pattern):
            matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
            if not matches:
                raise ConfigError("matches no file", path=pattern, key="--input")
        else:
            matches = [os.path.expanduser(pattern)]
        for match in matches:
            path = Path(match).absolute()
            if not path.exists():
                raise ConfigError("no such file", path=match, key="--input")
            if not path.is_file():
                raise ConfigError("not a regular file (a folder? give a glob like 'dir/*.jsonl')", path=match,
                                  key="--input")
            if path not in found:
                found.append(path)
    names: Dict[str, Path] = {}
    for path in found:
        other = names.setdefault(shard_name(path), path)
        if other != path:
            raise ConfigError(f"makes the same shard name {shard_name(path)!r} as {str(other)!r}; rename one",
                              path=str(path), key="--input")
    return found


# ---------------------------------------------------------------------------------------------
# Reading the input
# ---------------------------------------------------------------------------------------------


class _HashingReader(io.RawIOBase):
    """A file read once for both the lines and the sha256 of its bytes (compressed bytes for .gz)."""

    def __init__(self, raw):
        self._raw = raw
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._raw.readinto(buffer)
        if n:
            self.sha256.update(memoryview(buffer)[:n])
        return n

    def drain(self) -> str:
        """Hash whatever is left unread; the hex digest of the whole file."""
        while self.read(1 << 20):
            pass
        return self.sha256.hexdigest()

    def close(self) -> None:
        self._raw.close()
        super().close()


def line_blocks(stream, size: int) -> Iterator[Tuple[int, bytes]]:
    """``(number of the first line, bytes)``: the stream cut into blocks of whole lines, about ``size``
    bytes each (a block ends at the first newline after ``size`` bytes, or at the end of the file).

    Blocks rather than lists of lines: one ``read`` and one pickled object per block, so the process
    that reads does no work per line (it shares the cores with the workers that do).
    """
    number = 1
    while True:
        block = stream.read(size)
        if not block:
            return
        if not block.endswith(b"\n"):
            block += stream.readline()
        yield number, block
        number += block.count(b"\n")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Encoding (in worker processes)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Encoded:
    """One block's documents: per json key the ids of all its documents, concatenated, as the bytes
    of the shard's dtype (what the ``.bin`` holds), and each document's length in tokens."""

    bad: List[Tuple[int, Optional[str], str]]  # (line number, json key or None, message)
    tokens: Dict[str, bytes]
    lengths: Dict[str, List[int]]


_WORKER: Dict[str, Any] = {}


def _init_worker(tokenizer_cfg: TokenizerConfig, json_keys: Sequence[str], append_eod: bool, dtype: str,
                 tokenizer: Any = None, in_pool: bool = True) -> None:
    """Set up a process to encode blocks: build the tokenizer once per process (not once per block),
    unless one is given (the process that already built it encodes too).

    A worker process ignores SIGINT: Ctrl-C reaches the whole process group, and the parent stops its
    workers itself, after it has stopped reading their results. SIGTERM gets its default action back,
    whatever handler the parent had when it forked."""
    if in_pool:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if tokenizer is None:
        tokenizer = build_tokenizer(tokenizer_cfg)
    _WORKER.update(tokenizer=tokenizer, keys=list(json_keys), eod=(tokenizer.eod,) if append_eod else (), dtype=dtype,
                   vocab_size=tokenizer.vocab_size, name=tokenizer_cfg.tokenizer_type)


def _document_texts(number: int, line: bytes, keys: Sequence[str]) -> Tuple[Optional[List[str]], Optional[Tuple]]:
    """The texts of one line's json keys, or the reason the line is bad: ``(line number, key, message)``."""
    try:
        doc = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        return None, (number, None, f"not valid JSON ({str(err)[:200]})")
    if not isinstance(doc, dict):
        return None, (number, None, f"expected a JSON object, got {type(doc).__name__}")
    texts = []
    for key in keys:
        if key not in doc:
            return None, (number, key, f"the line has no key {key!r} (--json-keys)")
        text = doc[key]
        if not isinstance(text, str):
            return None, (number, key, f"key {key!r} is {type(text).__name__}, not a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # valid JSON ("\ud800"), but no text a tokenizer can read
            return None, (number, key, f"key {key!r} holds {text[err.start]!r} at character {err.start}, a lone "
                                       "surrogate: not Unicode text")
        texts.append(text)
    return texts, None


def _encode_block(block: Tuple[int, bytes], check_each_document: bool = False) -> _Encoded:
    """Parse and tokenize one block's lines (in a worker, or in the main process with one worker).

    A line is bad when it is not a JSON object with a string at every json key, when its text is not
    Unicode (a lone surrogate), when the tokenizer refuses it (NullTokenizer reads space-separated
    ids), or when a token id falls outside ``[0, vocab_size)``: the line is reported, never a crash.
    Token ids are range-checked for the whole block at once; only a block that fails is encoded again
    with ``check_each_document`` to find the lines.
    """
    import numpy as np

    first, data = block
    tokenizer, keys, eod, dtype = _WORKER["tokenizer"], _WORKER["keys"], _WORKER["eod"], _WORKER["dtype"]
    vocab_size = _WORKER["vocab_size"]
    # Per key: each document's ids (and the EOD) in order, joined into bytes once at the end;
    # np.fromiter over the chained lists costs less than extending one list and converting it.
    pieces: Dict[str, List[Sequence[int]]] = {k: [] for k in keys}
    lengths: Dict[str, List[int]] = {k: [] for k in keys}
    bad: List[Tuple[int, Optional[str], str]] = []
    for number, line in enumerate(data.split(b"\n"), start=first):
        if not line.strip():
            continue  # blank lines (a trailing newline, a gap) carry no document
        texts, problem = _document_texts(number, line, keys)
        encoded: List[Sequence[int]] = []
        for key, text in zip(keys, texts or ()):
            try:
                doc_ids = tokenizer.tokenize(text) if text else ()
            except Exception as err:  # noqa: BLE001 - whatever the tokenizer raises is about this line
                problem = (number, key, f"the {_WORKER['name']} cannot tokenize key {key!r}: "
                                        f"{type(err).__name__}: {str(err)[:200]}")
                break
            if check_each_document and len(doc_ids) and (min(doc_ids) < 0 or max(doc_ids) >= vocab_size):
                wrong = next(i for i in doc_ids if not 0 <= i < vocab_size)
                problem = (number, key, f"token id {wrong} of key {key!r} is outside the {_WORKER['name']}'s "
                                        f"vocabulary [0, {vocab_size})")
                break
            encoded.append(doc_ids)
        if problem is not None:
            bad.append(problem)
            continue
        for key, doc_ids in zip(keys, encoded):
            n = len(doc_ids)
            if n:
                pieces[key].append(doc_ids)
                if eod:  # as preprocess_data.py: an empty document gets no EOD
                    pieces[key].append(eod)
                    n += 1
            lengths[key].append(n)
    tokens = {}
    for key in keys:
        ids = np.fromiter(itertools.chain.from_iterable(pieces[key]), dtype=np.int64, count=sum(lengths[key]))
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            if check_each_document:  # every document's ids were in range: only the EOD id is left
                raise ConfigError(f"the {_WORKER['name']}'s end-of-document id {eod} is outside its vocabulary "
                                  f"[0, {vocab_size})", key="--append-eod")
            return _encode_block(block, check_each_document=True)
        tokens[key] = ids.astype(dtype).tobytes()
    return _Encoded(bad=bad, lengths=lengths, tokens=tokens)


def _encode_all(blocks: Iterator[Tuple[int, bytes]], workers: int, initargs: tuple, tokenizer: Any) -> Iterator[_Encoded]:
    """Encoded blocks in input order. One worker: encoded here, with ``tokenizer`` (no second process,
    no second tokenizer). Several: :func:`worker_pool.ordered_map`, with at most
    :data:`BLOCKS_IN_FLIGHT` ``x workers`` blocks in flight, so a large file is never read into memory
    far ahead of the writer. However the generator ends (done, a bad line, Ctrl-C), no worker outlives it."""
    if workers <= 1:
        _init_worker(*initargs, tokenizer=tokenizer, in_pool=False)
        for block in blocks:
            yield _encode_block(block)
        return
    yield from worker_pool.ordered_map(_encode_block, blocks, workers, _init_worker, initargs, BLOCKS_IN_FLIGHT)


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------


class Progress:
    """Documents and tokens per second on stderr: one line redrawn with ``\\r`` on a terminal, plain
    lines every ``interval`` seconds otherwise (a log file should not fill with redraws)."""

    def __init__(self, stream: TextIO = sys.stderr, interval: Optional[float] = None):
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval if interval is not None else (0.2 if self.tty else 10.0)
        self.begin("")

    def begin(self, shard: str) -> None:
        """Start counting a new shard (rates are per shard)."""
        self.start = time.monotonic()
        self.last = self.start
        self.documents = 0
        self.tokens = 0
        self.shard = shard

    def _line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        return (f"[prepare-data] {self.shard}: {self.documents} documents, {self.tokens} tokens, "
                f"{self.documents / elapsed:.0f} docs/s, {self.tokens / elapsed:.0f} tokens/s")

    def update(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self._write(self._line())

    def message(self, text: str) -> None:
        self._write(text, final=True)

    def shard_done(self) -> None:
        self._write(self._line(), final=True)

    def _write(self, text: str, final: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------------
# One shard
# ---------------------------------------------------------------------------------------------


def load_record(output_prefix: str, shard: str) -> Optional[ShardRecord]:
    """The shard's record, or None when there is none (or it is unreadable: the shard is redone)."""
    path = record_path(output_prefix, shard)
    try:
        return ShardRecord.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def sample_sha256(path: str, size: int, whole: Optional[str] = None) -> str:
    """The sha256 of the whole file when it is at most :data:`SAMPLE_WHOLE_BYTES`, else of
    :data:`SAMPLE_BLOCKS` blocks spread evenly from its first byte to its last: what a re-run reads
    to vouch for a shard it keeps without reading every byte (``--verify`` reads them all).
    ``whole``: the whole file's sha256 where the caller has just checked it (not read again)."""
    if size <= SAMPLE_WHOLE_BYTES:
        return whole or _sha256_file(Path(path))
    digest = hashlib.sha256()
    step = (size - SAMPLE_BLOCK_BYTES) / (SAMPLE_BLOCKS - 1)
    with open(path, "rb") as f:
        for i in range(SAMPLE_BLOCKS):
            f.seek(int(i * step))
            digest.update(f.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def file_problem(path: str, size: int, sha256: str, mtime_ns: Optional[int], sample: Optional[str],
                 verify: bool) -> Tuple[Optional[str], Optional[int]]:
    """``(what is wrong with a shard file, its modification time)``; the problem is None when it
    matches its record. Every byte is read when ``verify``, when the record has no sample digest,
    or when the file's time differs from the record's (copied, or written since); else its size and
    :func:`sample_sha256`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing", None
    except OSError as err:
        return f"unreadable ({err.strerror})", None
    if st.st_size != size:
        return f"has {st.st_size} bytes, its record says {size} (truncated or rewritten)", st.st_mtime_ns
    try:
        if verify or sample is None or st.st_mtime_ns != mtime_ns:
            if _sha256_file(Path(path)) != sha256:
                return "its sha256 differs from its record (damaged or rewritten)", st.st_mtime_ns
        elif sample_sha256(path, size) != sample:
            return "the sha256 of a sample of its bytes differs from its record (damaged)", st.st_mtime_ns
    except OSError as err:
        return f"unreadable ({err.strerror})", st.st_mtime_ns
    return None, st.st_mtime_ns


#: :attr:`ShardCheck.reason` of a shard that was never made (nothing to say about it).
NOT_PREPARED = "no finished shard"


@dataclass
class ShardCheck:
    """What a re-run found for one input's shard: keep ``record`` (not None), or (re)build it.

    ``reason`` says why, for the one line the run prints. ``refreshed``: ``record`` differs from the
    record file only in what moved without changing the data (the source's path or time, the shard
    files' times after a copy), and the holder of the prefix writes it back.
    """

    record: Optional[ShardRecord]
    reason: str
    refreshed: bool = False


def _same_source(recorded: SourceInfo, source: Path, st: os.stat_result) -> bool:
    """Whether ``source`` is the file a record names under another path: the same file (a symlink,
    a hard link) or the same bytes (a moved or copied folder)."""
    with contextlib.suppress(OSError):
        if os.path.samefile(recorded.path, source):
            return True
    return st.st_size == recorded.size and _sha256_file(source) == recorded.sha256


def check_shard(output_prefix: str, source: Path, settings: Dict[str, Any], verify: bool = False) -> ShardCheck:
    """Whether the finished shard of ``source`` can be kept, checked against its record (see the
    module docstring for what is read). Raises ConfigError when the record names another input with
    other bytes: making this shard would overwrite finished data made from other input."""
    shard = shard_name(source)
    record = load_record(output_prefix, shard)
    if record is None:
        return ShardCheck(None, NOT_PREPARED)
    try:
        st = source.stat()
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror}", path=str(source), key="--input") from None
    src = record.source
    moved = src.path != str(source)
    if moved and not _same_source(src, source, st):
        raise ConfigError(f"would overwrite the finished shard {record.name!r}, made from {src.path!r} "
                          "(see its .shard.json); choose another --output-prefix or remove that shard",
                          path=str(source), key="--output-prefix")
    if record.settings != settings:
        return ShardCheck(None, "made with other settings (tokenizer, json keys or EOD): rebuilding")
    if not moved and (st.st_size != src.size or (st.st_mtime_ns != src.mtime_ns
                                                 and _sha256_file(source) != src.sha256)):
        return ShardCheck(None, "its input changed: rebuilding")
    refreshed = moved or st.st_mtime_ns != src.mtime_ns
    outputs = {}
    for key, out in record.outputs.items():
        times = []
        for path, size, digest, mtime_ns, sample in out.files():
            problem, now = file_problem(path, size, digest, mtime_ns, sample, verify)
            if problem:
                return ShardCheck(None, f"{path} {problem}: rebuilding the shard")
            times.append(now)
        refreshed = refreshed or times != [out.bin_mtime_ns, out.idx_mtime_ns]
        outputs[key] = dataclasses.replace(
            out, bin_mtime_ns=times[0], idx_mtime_ns=times[1],
            bin_sample_sha256=out.bin_sample_sha256 or sample_sha256(out.prefix + ".bin", out.bin_bytes, out.bin_sha256),
            idx_sample_sha256=out.idx_sample_sha256 or sample_sha256(out.prefix + ".idx", out.idx_bytes, out.idx_sha256))
    if not refreshed:
        return ShardCheck(record, "up to date" + (" (every byte verified)" if verify else ""))
    fresh = dataclasses.replace(record, outputs=outputs,
                                source=dataclasses.replace(src, path=str(source), mtime_ns=st.st_mtime_ns))
    note = f" (its input moved from {src.path!r})" if moved else " (files touched or copied, bytes unchanged)"
    return ShardCheck(fresh, "up to date" + note, refreshed=True)


def write_record(output_prefix: str, record: ShardRecord) -> None:
    """Write a shard's record (atomically): the mark that the shard is complete."""
    _write_json_atomically(record_path(output_prefix, record.name), record.to_json())


@dataclass
class WrittenFiles:
    """Sizes and sha256 of a finished ``.bin``/``.idx`` pair."""

    bin_bytes: int
    idx_bytes: int
    bin_sha256: str
    idx_sha256: str


class DatasetWriter:
    """One indexed dataset (``<prefix>.bin`` / ``.idx``), written through megatron-core's
    ``IndexedDatasetBuilder`` a block of documents at a time.

    Why not ``builder.add_document`` once per document: that is a numpy copy, a write and two list
    appends per document, in the one process that also reads the input and feeds the workers.
    :meth:`add_documents` does what that many ``add_document(ids, [n])`` calls do (the same bytes
    written in the same order, the same ``sequence_lengths`` and ``document_indices``) with one
    write per block, so the files are byte for byte the same (tests/test_prepare_data.py proves it);
    the ``.idx`` is still written by the builder's own ``finalize``. The ``.bin`` is hashed as it is
    written (what it should hold, to check the file read back against before it is published); the
    ``.idx`` (20 bytes per document) is hashed once written.
    """

    def __init__(self, prefix: str, dtype: type):
        import numpy as np
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = prefix
        self.builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        self.tokens = 0
        self._itemsize = np.dtype(dtype).itemsize
        self._bin_sha256 = hashlib.sha256()

    def add_documents(self, ids: bytes, lengths: Sequence[int]) -> None:
        """Append documents: ``ids`` are their tokens, concatenated, as bytes of the builder's dtype;
        ``lengths`` their lengths in tokens, in order."""
        builder = self.builder
        builder.data_file.write(ids)
        self._bin_sha256.update(ids)
        first = len(builder.sequence_lengths)
        builder.sequence_lengths.extend(lengths)
        builder.document_indices.extend(range(first + 1, first + len(lengths) + 1))
        self.tokens += len(ids) // self._itemsize

    def finalize(self) -> WrittenFiles:
        """Close the ``.bin``, write the ``.idx``; their sizes and checksums."""
        self.builder.finalize(self.prefix + ".idx")
        return WrittenFiles(bin_bytes=os.path.getsize(self.prefix + ".bin"), idx_bytes=os.path.getsize(self.prefix + ".idx"),
                            bin_sha256=self._bin_sha256.hexdigest(), idx_sha256=_sha256_file(Path(self.prefix + ".idx")))

    def close(self) -> None:
        self.builder.data_file.close()


def _write_json_atomically(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def input_blocks(path: Path) -> int:
    """How many blocks of :data:`BLOCK_BYTES` the input makes (estimated for ``.gz``): more workers than
    that would have nothing to do."""
    size = path.stat().st_size * (GZIP_EXPANSION if path.name.endswith(".gz") else 1)
    return max(1, -(-size // BLOCK_BYTES))


def worker_count(requested: int, paths: Sequence[Path], cpus: Optional[int] = None) -> Tuple[int, Optional[str]]:
    """``--workers`` capped by the CPUs this process may use (``os.sched_getaffinity``, or ``cpus``
    where the work runs elsewhere) and by the blocks of the largest input; with the line that says so
    when it was reduced (None when not). Each worker is a process with its own tokenizer and imports:
    asking for thousands would fork until memory runs out."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    blocks = max((input_blocks(p) for p in paths), default=1)
    workers = min(requested, cpus, blocks)
    if workers == requested:
        return workers, None
    why = [f"this process may use {cpus} CPUs"] if cpus < requested else []
    if blocks < requested:
        why.append(f"the largest input makes {blocks} block(s) of {BLOCK_BYTES >> 10} KiB")
    return workers, f"--workers {requested} reduced to {workers}: {' and '.join(why)}"


def _remove_stale_tmp(final: str) -> None:
    """Remove temporary files a killed writer of this dataset left (the caller is now its only
    writer: it holds the prefix, or is the one array task of this shard)."""
    for path in glob.glob(glob.escape(final) + TMP_MARK + "*") + [final + ".tmp.bin", final + ".tmp.idx"]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def prepare_shard(input_path: Path, output_prefix: str, tokenizer_cfg: TokenizerConfig, json_keys: Sequence[str],
                  append_eod: bool, workers: int, on_bad_line: str = "fail",
                  progress: Optional[Progress] = None) -> ShardRecord:
    """Tokenize one jsonl (or jsonl.gz) file into one indexed dataset per json key; return its record.

    The caller holds the prefix (:func:`bridge_hpc.prepare.prefix_lock.hold_prefix`). ``tokenizer_cfg``
    must be finalized. The files are written under temporary names private to this process, read
    back and checked against the sha256 computed as they were written, renamed into place, and only
    then is the record written (:func:`record_path`): an interrupted or failed run leaves no file
    that looks finished, and no temporary file. ``on_bad_line`` is ``"fail"`` (ConfigError naming
    ``file:line``) or ``"skip"``. A shard without a single token is refused: a rank cannot map an
    empty ``.bin``. A file that cannot be written is a ConfigError naming ``--output-prefix``.
    """
    from megatron.core.datasets.indexed_dataset import DType

    input_path = Path(input_path).absolute()
    shard = shard_name(input_path)
    tokenizer = build_tokenizer(tokenizer_cfg)
    if append_eod and tokenizer.eod is None:
        raise ConfigError(f"--append-eod: the {tokenizer_cfg.tokenizer_type} from {tokenizer_cfg.tokenizer_model!r} "
                          "has no end-of-document token (for Hugging Face, set eos_token)", key="--append-eod")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    settings = settings_of(tokenizer_cfg, json_keys, append_eod)
    try:
        st = input_path.stat()
        source_file = open(input_path, "rb")
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror or err}", path=str(input_path), key="--input") from None
    workers = min(workers, input_blocks(input_path))
    finals = {k: dataset_prefix(output_prefix, shard, k) for k in json_keys}
    tmps = {k: f"{v}{TMP_MARK}{socket.gethostname()}-{os.getpid()}" for k, v in finals.items()}
    if progress:
        progress.begin(shard)
    writers: Dict[str, DatasetWriter] = {}
    documents, skipped = 0, 0
    try:
        Path(output_prefix).absolute().parent.mkdir(parents=True, exist_ok=True)
        for key in json_keys:
            _remove_stale_tmp(finals[key])
            writers[key] = DatasetWriter(tmps[key], dtype)
        with _HashingReader(source_file) as reader:
            stream = gzip.GzipFile(fileobj=reader, mode="rb") if input_path.name.endswith(".gz") else io.BufferedReader(reader)
            initargs = (tokenizer_cfg, list(json_keys), append_eod, dtype.__name__)
            encoded_blocks = _encode_all(line_blocks(stream, BLOCK_BYTES), workers, initargs, tokenizer)
            try:
                for encoded in encoded_blocks:
                    if encoded.bad:
                        if on_bad_line == "fail":
                            number, key, message = encoded.bad[0]
                            raise ConfigError(message + " (--on-bad-line skip drops such lines)",
                                              path=f"{input_path}:{number}", key=key)
                        skipped += len(encoded.bad)
                    for key, writer in writers.items():
                        writer.add_documents(encoded.tokens[key], encoded.lengths[key])
                    n_docs = len(encoded.lengths[json_keys[0]])
                    documents += n_docs
                    if progress:
                        progress.update(n_docs, sum(sum(v) for v in encoded.lengths.values()))
            except (gzip.BadGzipFile, EOFError, zlib.error) as err:
                raise ConfigError(f"not a readable gzip file ({err})", path=str(input_path), key="--input") from None
            finally:
                encoded_blocks.close()  # stops the worker pool at once when a bad line ends the shard
            source = SourceInfo(path=str(input_path), size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=reader.drain())
        if documents == 0:
            raise ConfigError("no documents: the corpus is empty" + (f" ({skipped} bad lines skipped)" if skipped else ""),
                              path=str(input_path), key="--input")
        empty = [key for key, writer in writers.items() if writer.tokens == 0]
        if empty:
            raise ConfigError(f"no tokens under key {empty[0]!r}: every one of its {documents} documents is empty "
                              "(a training run cannot read an empty dataset)", path=str(input_path), key="--input")
        outputs = {}
        for key, writer in writers.items():
            written = writer.finalize()
            if _sha256_file(Path(tmps[key] + ".bin")) != written.bin_sha256:
                raise ConfigError(f"{tmps[key]}.bin reads back other bytes than were written to it: the file system "
                                  "lost or changed data; nothing was published", key="--output-prefix")
            outputs[key] = OutputFiles(
                prefix=finals[key], documents=documents, tokens=writer.tokens, bin_bytes=written.bin_bytes,
                idx_bytes=written.idx_bytes, bin_sha256=written.bin_sha256, idx_sha256=written.idx_sha256,
                bin_sample_sha256=sample_sha256(tmps[key] + ".bin", written.bin_bytes, written.bin_sha256),
                idx_sample_sha256=sample_sha256(tmps[key] + ".idx", written.idx_bytes, written.idx_sha256))
        for key in json_keys:
            for suffix in (".bin", ".idx"):
                os.replace(tmps[key] + suffix, finals[key] + suffix)
            outputs[key].bin_mtime_ns = os.stat(finals[key] + ".bin").st_mtime_ns
            outputs[key].idx_mtime_ns = os.stat(finals[key] + ".idx").st_mtime_ns
        record = ShardRecord(name=shard, source=source, settings=settings, dtype=dtype.__name__, documents=documents,
                             skipped_lines=skipped, outputs=outputs)
        write_record(output_prefix, record)
    except OSError as err:
        what = f"cannot write {err.filename}" if err.filename else "input/output error"
        raise ConfigError(f"{what}: {err.strerror or err}", key="--output-prefix") from None
    finally:
        for writer in writers.values():
            writer.close()
        for tmp in tmps.values():
            for suffix in (".bin", ".idx"):
                with contextlib.suppress(OSError):
                    os.unlink(tmp + suffix)
    if progress:
        progress.shard_done()
    return record


# ---------------------------------------------------------------------------------------------
# All shards: check, manifest, snippet
# ---------------------------------------------------------------------------------------------


def check_shards(records: Sequence[ShardRecord]) -> None:
    """Verify every byte of every shard's files against its record (:func:`file_problem`).

    Raises ConfigError naming the first file that is missing, truncated or different.
    """
    for record in records:
        for out in record.outputs.values():
            for path, size, digest, mtime_ns, sample in out.files():
                problem, _ = file_problem(path, size, digest, mtime_ns, sample, verify=True)
                if problem:
                    raise ConfigError(f"{problem} (shard {record.name!r})", path=path)


def write_manifest(output_prefix: str, records: Sequence[ShardRecord], settings: Dict[str, Any]) -> Path:
    """Write ``<output-prefix>.manifest.json`` (atomically): settings, totals and every shard's record."""
    path = manifest_path(output_prefix)
    _write_json_atomically(path, {
        "format": FORMAT,
        "settings": settings,
        "documents": sum(r.documents for r in records),
        "tokens": sum(r.tokens for r in records),
        "bytes": sum(o.bin_bytes + o.idx_bytes for r in records for o in r.outputs.values()),
        "shards": [r.to_json() for r in records],
    })
    return path


#: Words in a shard's name that say which split its input is (``train.jsonl``, ``wiki-validation-00``).
SPLIT_WORDS = {"train": ("train", "training"), "valid": ("valid", "validation", "val", "dev"), "test": ("test",)}


def split_of_shard(name: str) -> Optional[str]:
    """The split a shard's name says it is (one of :data:`SPLIT_WORDS`), or None (no word, or two)."""
    words = set(re.split(r"[._-]+", name.lower()))
    found = [split for split, names in SPLIT_WORDS.items() if words & set(names)]
    return found[0] if len(found) == 1 else None


def data_path_snippet(records: Sequence[ShardRecord], json_keys: Sequence[str]) -> str:
    """The ``[dataset]`` lines to paste into a job config (one set per json key; the first is live).

    When the inputs' names say their splits (every shard's name holds one of :data:`SPLIT_WORDS`,
    a training one among them, and another split too), the lines are ``train_data_path`` /
    ``valid_data_path`` / ``test_data_path``: a single ``data_path`` would blend the held-out text into
    training and split every shard by ``split``. Otherwise one ``data_path`` lists every shard.
    """
    splits = [split_of_shard(r.name) for r in records]
    per_split = None not in splits and "train" in splits and len(set(splits)) > 1
    lines = ["[dataset]"]
    if per_split:
        lines.append("# per split, as the input names say (train/valid/test)")
    for i, key in enumerate(json_keys):
        lead = "" if i == 0 else f"# json key {key!r}: "
        if per_split:
            for split in SPLIT_WORDS:
                prefixes = ", ".join(json.dumps(r.outputs[key].prefix) for r, s in zip(records, splits) if s == split)
                if prefixes:
                    lines.append(f"{lead}{split}_data_path = [{prefixes}]")
        else:
            prefixes = ", ".join(json.dumps(r.outputs[key].prefix) for r in records)
            lines.append(f"{lead}data_path = [{prefixes}]")
    return "\n".join(lines)


def prepare_local(inputs: Sequence[str], output_prefix: str, tokenizer_cfg: TokenizerConfig, json_keys: Sequence[str],
                  append_eod: bool, workers: int, on_bad_line: str = "fail", progress: Optional[Progress] = None,
                  verify: bool = False, unfinished_jobs: Optional[Callable[[], Dict[str, str]]] = None,
                  ) -> List[ShardRecord]:
    """Prepare every input file on this machine, keeping shards that check out; then write the manifest.

    The prefix is held exclusively for the whole run (:func:`~bridge_hpc.prepare.prefix_lock.hold_prefix`,
    refused while ``unfinished_jobs()`` names a --slurm job of it). Every shard is checked
    (:func:`check_shard`; every byte with ``verify``) before any work starts, so a prefix that would
    overwrite shards of other input is refused before anything is written.
    """
    progress = progress or Progress()
    output_prefix = str(Path(output_prefix).absolute())
    paths = expand_inputs(inputs)
    check_output_names(output_prefix, paths, json_keys)
    settings = settings_of(tokenizer_cfg, json_keys, append_eod)
    with hold_prefix(output_prefix, "local", unfinished_jobs=unfinished_jobs):
        checks = [check_shard(output_prefix, path, settings, verify) for path in paths]
        records = [keep_or_prepare(path, check, output_prefix, tokenizer_cfg, json_keys, append_eod, workers,
                                   on_bad_line, progress) for path, check in zip(paths, checks)]
        try:
            write_manifest(output_prefix, records, settings)
        except OSError as err:
            raise ConfigError(f"cannot write {err.filename}: {err.strerror or err}", key="--output-prefix") from None
    return records


def keep_or_prepare(path: Path, check: ShardCheck, output_prefix: str, tokenizer_cfg: TokenizerConfig,
                    json_keys: Sequence[str], append_eod: bool, workers: int, on_bad_line: str,
                    progress: Progress, label: str = "[prepare-data] ") -> ShardRecord:
    """One input, by what :func:`check_shard` found: keep its shard (writing a refreshed record back)
    or prepare it, saying which in one line (``label`` starts it). The caller holds the prefix."""
    record = check.record
    if record is not None:
        if check.refreshed:
            try:
                write_record(output_prefix, record)
            except OSError as err:
                raise ConfigError(f"cannot write {err.filename}: {err.strerror or err}", key="--output-prefix") from None
        progress.message(f"{label}{record.name}: skipped, {check.reason} ({record.documents} documents, "
                         f"{record.tokens} tokens)")
        return record
    progress.message(f"{label}{shard_name(path)}: " + (f"preparing {path}" if check.reason == NOT_PREPARED
                                                       else check.reason))
    record = prepare_shard(path, output_prefix, tokenizer_cfg, json_keys, append_eod, workers, on_bad_line, progress)
    if record.skipped_lines:
        progress.message(f"{label}{record.name}: {record.skipped_lines} bad lines skipped")
    return record
