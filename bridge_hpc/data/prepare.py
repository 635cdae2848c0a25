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

A shard is written under ``.tmp`` names and renamed when complete. A re-run skips a shard whose
record matches its source (path, size and modification time; or, when only the time differs, the
sha256 of its bytes) and the settings (tokenizer, json keys, EOD). A record naming a *different*
source file is refused rather than overwritten.

Bad input is a :class:`ConfigError` naming the file and line (``file:line``) or the json key. Torch
and megatron-core are imported inside the functions that need them, so the module itself is cheap to import.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import re
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

from bridge_hpc.contracts.errors import ConfigError
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


def source_info(path: Path) -> SourceInfo:
    """Size, modification time and sha256 of an input file."""
    st = path.stat()
    return SourceInfo(path=str(path), size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=_sha256_file(path))


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
                 tokenizer: Any = None) -> None:
    """Set up a process to encode blocks: build the tokenizer once per process (not once per block),
    unless one is given (the process that already built it encodes too)."""
    if tokenizer is None:
        tokenizer = build_tokenizer(tokenizer_cfg)
    _WORKER.update(tokenizer=tokenizer, keys=list(json_keys), eod=(tokenizer.eod,) if append_eod else (), dtype=dtype)


def _encode_block(block: Tuple[int, bytes]) -> _Encoded:
    """Parse and tokenize one block's lines (in a worker, or in the main process with one worker)."""
    import numpy as np

    first, data = block
    tokenizer, keys, eod, dtype = _WORKER["tokenizer"], _WORKER["keys"], _WORKER["eod"], _WORKER["dtype"]
    # Per key: each document's ids (and the EOD) in order, joined into bytes once at the end;
    # np.fromiter over the chained lists costs less than extending one list and converting it.
    pieces: Dict[str, List[Sequence[int]]] = {k: [] for k in keys}
    lengths: Dict[str, List[int]] = {k: [] for k in keys}
    bad: List[Tuple[int, Optional[str], str]] = []
    for number, line in enumerate(data.split(b"\n"), start=first):
        if not line.strip():
            continue  # blank lines (a trailing newline, a gap) carry no document
        try:
            doc = json.loads(line)
        except (ValueError, UnicodeDecodeError) as err:
            bad.append((number, None, f"not valid JSON ({err})"))
            continue
        if not isinstance(doc, dict):
            bad.append((number, None, f"expected a JSON object, got {type(doc).__name__}"))
            continue
        texts = []
        for key in keys:
            if key not in doc:
                bad.append((number, key, f"the line has no key {key!r} (--json-keys)"))
                break
            if not isinstance(doc[key], str):
                bad.append((number, key, f"key {key!r} is {type(doc[key]).__name__}, not a string"))
                break
            texts.append(doc[key])
        else:
            for key, text in zip(keys, texts):
                doc_ids = tokenizer.tokenize(text) if text else ()
                n = len(doc_ids)
                if n:
                    pieces[key].append(doc_ids)
                    if eod:  # as preprocess_data.py: an empty document gets no EOD
                        pieces[key].append(eod)
                        n += 1
                lengths[key].append(n)
    tokens = {k: np.fromiter(itertools.chain.from_iterable(pieces[k]), dtype=dtype, count=sum(lengths[k])).tobytes()
              for k in keys}
    return _Encoded(bad=bad, lengths=lengths, tokens=tokens)


def _encode_all(blocks: Iterator[Tuple[int, bytes]], workers: int, initargs: tuple, tokenizer: Any) -> Iterator[_Encoded]:
    """Encoded blocks in input order. One worker: encoded here, with ``tokenizer`` (no second process,
    no second tokenizer). Several: a pool, with at most :data:`BLOCKS_IN_FLIGHT` ``x workers`` blocks
    in flight, so a large file is never read into memory far ahead of the writer."""
    if workers <= 1:
        _init_worker(*initargs, tokenizer=tokenizer)
        for block in blocks:
            yield _encode_block(block)
        return
    with multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for block in blocks:
            pending.append(pool.apply_async(_encode_block, (block,)))
            if len(pending) >= BLOCKS_IN_FLIGHT * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


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
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_up_to_date(record: Optional[ShardRecord], source: Path, settings: Dict[str, Any]) -> bool:
    """Whether a finished shard can be kept for ``source``.

    Raises ConfigError when the record names another source file: making this shard would overwrite
    finished data made from other input.
    """
    if record is None:
        return False
    if record.source.path != str(source):
        raise ConfigError(f"would overwrite the finished shard {record.name!r}, made from {record.source.path!r} "
                          "(see its .shard.json); choose another --output-prefix or remove that shard",
                          path=str(source), key="--output-prefix")
    if record.settings != settings:
        return False
    for out in record.outputs.values():
        for suffix, size in ((".bin", out.bin_bytes), (".idx", out.idx_bytes)):
            try:
                if os.path.getsize(out.prefix + suffix) != size:
                    return False
            except OSError:
                return False
    st = source.stat()
    if st.st_size != record.source.size:
        return False
    if st.st_mtime_ns == record.source.mtime_ns:
        return True
    return _sha256_file(source) == record.source.sha256  # touched but unchanged


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
    written, so it is never read back; the ``.idx`` (20 bytes per document) is hashed once written.
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


def prepare_shard(input_path: Path, output_prefix: str, tokenizer_cfg: TokenizerConfig, json_keys: Sequence[str],
                  append_eod: bool, workers: int, on_bad_line: str = "fail",
                  progress: Optional[Progress] = None) -> ShardRecord:
    """Tokenize one jsonl (or jsonl.gz) file into one indexed dataset per json key; return its record.

    ``tokenizer_cfg`` must be finalized. The files are written under ``.tmp`` names and renamed when
    complete, then the record is written (:func:`record_path`): an interrupted run leaves no file that
    looks finished. ``on_bad_line`` is ``"fail"`` (ConfigError naming ``file:line``) or ``"skip"``.
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
    st = input_path.stat()
    finals = {k: dataset_prefix(output_prefix, shard, k) for k in json_keys}
    tmps = {k: v + ".tmp" for k, v in finals.items()}
    Path(output_prefix).absolute().parent.mkdir(parents=True, exist_ok=True)
    if progress:
        progress.begin(shard)
    writers: Dict[str, DatasetWriter] = {}
    documents, skipped = 0, 0
    try:
        for key in json_keys:
            writers[key] = DatasetWriter(tmps[key], dtype)
        with _HashingReader(open(input_path, "rb")) as reader:
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
        outputs = {}
        for key, writer in writers.items():
            written = writer.finalize()
            outputs[key] = OutputFiles(prefix=finals[key], documents=documents, tokens=writer.tokens,
                                       bin_bytes=written.bin_bytes, idx_bytes=written.idx_bytes,
                                       bin_sha256=written.bin_sha256, idx_sha256=written.idx_sha256)
        for key in json_keys:
            os.replace(tmps[key] + ".bin", finals[key] + ".bin")
            os.replace(tmps[key] + ".idx", finals[key] + ".idx")
    finally:
        for writer in writers.values():
            writer.close()
        for tmp in tmps.values():
            for suffix in (".bin", ".idx"):
                if os.path.exists(tmp + suffix):
                    os.unlink(tmp + suffix)
    record = ShardRecord(name=shard, source=source, settings=settings, dtype=dtype.__name__, documents=documents,
                         skipped_lines=skipped, outputs=outputs)
    _write_json_atomically(record_path(output_prefix, shard), record.to_json())
    if progress:
        progress.shard_done()
    return record


# ---------------------------------------------------------------------------------------------
# All shards: check, manifest, snippet
# ---------------------------------------------------------------------------------------------


def check_shards(records: Sequence[ShardRecord]) -> None:
    """Verify every shard's files against its record: present, same size and same sha256.

    Raises ConfigError naming the first file that is missing, truncated or different.
    """
    for record in records:
        for out in record.outputs.values():
            for suffix, size, digest in ((".bin", out.bin_bytes, out.bin_sha256), (".idx", out.idx_bytes, out.idx_sha256)):
                path = Path(out.prefix + suffix)
                if not path.is_file():
                    raise ConfigError(f"missing (shard {record.name!r})", path=str(path))
                if path.stat().st_size != size:
                    raise ConfigError(f"has {path.stat().st_size} bytes, its record says {size} (truncated or "
                                      f"rewritten; shard {record.name!r})", path=str(path))
                if _sha256_file(path) != digest:
                    raise ConfigError(f"checksum differs from its record (shard {record.name!r})", path=str(path))


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


def data_path_snippet(records: Sequence[ShardRecord], json_keys: Sequence[str]) -> str:
    """The ``[dataset]`` lines to paste into a job config (one ``data_path`` per json key; the first is live)."""
    lines = ["[dataset]"]
    for i, key in enumerate(json_keys):
        prefixes = ", ".join(json.dumps(r.outputs[key].prefix) for r in records)
        lines.append(("" if i == 0 else f"# json key {key!r}: ") + f"data_path = [{prefixes}]")
    return "\n".join(lines)


def prepare_local(inputs: Sequence[str], output_prefix: str, tokenizer_cfg: TokenizerConfig, json_keys: Sequence[str],
                  append_eod: bool, workers: int, on_bad_line: str = "fail",
                  progress: Optional[Progress] = None) -> List[ShardRecord]:
    """Prepare every input file on this machine, skipping shards that are up to date; then write the manifest.

    Every shard's record is checked (:func:`is_up_to_date`) before any work starts, so a prefix that
    would overwrite shards of other input is refused before anything is written.
    """
    progress = progress or Progress()
    output_prefix = str(Path(output_prefix).absolute())
    paths = expand_inputs(inputs)
    settings = settings_of(tokenizer_cfg, json_keys, append_eod)
    plan = []
    for path in paths:
        record = load_record(output_prefix, shard_name(path))
        plan.append((path, record if is_up_to_date(record, path, settings) else None))
    records = []
    for path, record in plan:
        if record is not None:
            progress.message(f"[prepare-data] {record.name}: skipped, up to date ({record.documents} documents, "
                             f"{record.tokens} tokens)")
        else:
            record = prepare_shard(path, output_prefix, tokenizer_cfg, json_keys, append_eod, workers, on_bad_line,
                                   progress)
            if record.skipped_lines:
                progress.message(f"[prepare-data] {record.name}: {record.skipped_lines} bad lines skipped")
        records.append(record)
    write_manifest(output_prefix, records, settings)
    return records
