"""The records of a fine-tuning jsonl file, checked the same way on the login node and on the ranks.

Why a module of its own: a fine-tuning file is read line by line as JSON, not through an index like
the ``.idx`` / ``.bin`` pairs (:mod:`bridge_hpc.training.datasets.indexed_files`), and its checks are
two things the dataset configs only call: :func:`parse_jsonl_record`, which the ranks' dataset
(:mod:`bridge_hpc.training.datasets.builders`) applies to every line it indexes, and
:func:`check_jsonl_records`, which ``bridge-submit`` runs on a sample of each file (every line with
``--verify-data``) before the job queues. Torch-free; re-exported by
:mod:`bridge_hpc.training.datasets.config`, whose :class:`FinetuningDatasetConfig` names the files."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple, Union

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import check as _check
from bridge_hpc.training.datasets.indexed_files import Progress

#: Records of each fine-tuning file a run reads that are checked when it is submitted (all of them with
#: ``bridge-submit --verify-data``, and by every rank at start-up): the first ones, and the first one
#: after each of as many points spread evenly over the rest of the file.
SAMPLED_HEAD_RECORDS = 64
SAMPLED_SPREAD_RECORDS = 64
#: The most bytes of one file that the sample reads, half for its first records and half for the
#: spread; a line the budget cuts is not checked. So the check at submission costs the same on a file
#: of any size, with any line lengths (milliseconds for records of usual sizes).
SAMPLED_BYTES = 1 << 23


class JsonlProblem(NamedTuple):
    """What is wrong with a line of a fine-tuning jsonl file: the config key to name, and the problem,
    worded to read after where the line is (``line 7 has no 'output' field``)."""

    key: str
    problem: str


def parse_jsonl_record(line: bytes, prompt_key: str, answer_key: str) -> Union[Dict[str, Any], JsonlProblem]:
    """One non-blank line of a fine-tuning jsonl file as its record, or what is wrong with it.

    A good line is a JSON object whose ``prompt_key`` and ``answer_key`` fields are strings of text:
    ``"\\ud800"`` is valid JSON but a lone surrogate, which the tokenizer cannot encode as UTF-8
    (``str.encode`` raises), so the rank reading that sample would die of a bare UnicodeEncodeError.
    The login node (:func:`check_jsonl_records`) and the ranks (``bridge_hpc.training.datasets.builders``) both use
    it, so the two refuse the same records.
    """
    try:
        record = json.loads(line)
    except UnicodeDecodeError as err:
        return JsonlProblem("dataset.dataset_root", f"is not UTF-8 text ({err.reason} at byte {err.start + 1} of "
                                                    "the line)")
    except RecursionError:
        return JsonlProblem("dataset.dataset_root", "is not a record: its JSON nests too deeply to read")
    except ValueError as err:
        return JsonlProblem("dataset.dataset_root", f"is not JSON ({err})")
    if not isinstance(record, dict):
        return JsonlProblem("dataset.dataset_root", f"is a JSON {type(record).__name__}, expected an object with "
                                                    f"{prompt_key!r} and {answer_key!r} fields")
    for name, key in ((prompt_key, "dataset.prompt_key"), (answer_key, "dataset.answer_key")):
        if name not in record:
            fields = sorted(record)
            shown = repr(fields) if len(fields) <= 8 else repr(fields[:8])[:-1] + f", ... ({len(fields)} fields)]"
            return JsonlProblem(key, f"has no {name!r} field (it has {shown})")
        value = record[name]
        if not isinstance(value, str):
            return JsonlProblem(key, f"has field {name!r} of type {type(value).__name__}, expected a string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return JsonlProblem(key, f"has field {name!r} with a lone surrogate {value[err.start]!r} at character "
                                     f"{err.start + 1}: not text, so the tokenizer cannot encode it as UTF-8")
    return record


def _jsonl_sample(f: Any, size: int) -> Tuple[List[Tuple[int, Optional[int], bytes]], bool]:
    """The lines of an open jsonl file that a sample checks, as ``(offset, line number, line)``, and
    whether they were the whole file. The first :data:`SAMPLED_HEAD_RECORDS` records are read with
    their line numbers; then, past them, the first record after each of :data:`SAMPLED_SPREAD_RECORDS`
    evenly spread points (seeking there costs nothing on a file of any size), whose line number is
    None (counted only for an error: :func:`_line_number`). At most :data:`SAMPLED_BYTES` are read."""
    lines: List[Tuple[int, Optional[int], bytes]] = []
    budget, number, records = SAMPLED_BYTES // 2, 0, 0
    while records < SAMPLED_HEAD_RECORDS and budget > 0:
        offset = f.tell()
        line = f.readline(budget)
        if not line:
            return lines, True
        if not line.endswith(b"\n") and f.tell() < size:
            break  # cut by the budget
        budget, number = budget - len(line), number + 1
        if line.strip():
            lines.append((offset, number, line))
            records += 1
    position = f.tell()
    if position >= size:
        return lines, True
    budget += SAMPLED_BYTES // 2
    frontier = position
    for k in range(1, SAMPLED_SPREAD_RECORDS + 1):
        point = frontier + (size - frontier) * k // (SAMPLED_SPREAD_RECORDS + 1)
        if point < position or point < 1:
            continue  # inside a line read already
        f.seek(point - 1)
        rest = f.readline(budget)  # from the byte before the point to the end of its line
        budget -= len(rest)
        if not rest.endswith(b"\n") or budget <= 0:
            break  # the end of the file, or of the budget
        while budget > 0:
            offset = f.tell()
            line = f.readline(budget)
            if not line or (not line.endswith(b"\n") and f.tell() < size):
                budget = 0  # the end of the file, or a line cut by the budget
                break
            budget -= len(line)
            if line.strip():
                lines.append((offset, None, line))
                break
        position = f.tell()
        if budget <= 0:
            break
    return lines, False


def _line_number(f: Any, offset: int) -> int:
    """The number of the line that starts at byte ``offset`` of the open file ``f`` (one pass up to it)."""
    f.seek(0)
    newlines, left = 0, offset
    while left > 0:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            break
        newlines += chunk.count(b"\n")
        left -= len(chunk)
    return newlines + 1


def check_jsonl_records(path: str, prompt_key: str, answer_key: str, full: bool = False,
                        progress: Optional[Progress] = None) -> int:
    """Check the records of a fine-tuning jsonl file at submission: a sample (:func:`_jsonl_sample`), or
    every line with ``full`` (``bridge-submit --verify-data``; ``progress`` then hears how far it is).

    Raises ConfigError whose message starts with ``FILE:LINE`` and whose key is the config key of the
    problem (:func:`parse_jsonl_record`), or names the file when it holds no record at all or cannot be
    read; so a bad record is found on the login node, not on the ranks after the queue. Returns the
    number of records checked.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if full:
                lines: Any = _every_line(f, path, size, progress)
                whole = True
            else:
                lines, whole = _jsonl_sample(f, size)
            checked = 0
            for offset, number, line in lines:
                record = parse_jsonl_record(line, prompt_key, answer_key)
                if isinstance(record, JsonlProblem):
                    number = number if number is not None else _line_number(f, offset)
                    raise ConfigError(f"{path}:{number} {record.problem}", key=record.key)
                checked += 1
    except OSError as err:
        raise ConfigError(f"{path} cannot be read: {err.strerror or err}", key="dataset.dataset_root") from None
    _check(checked > 0 or not whole, "dataset.dataset_root",
           f"{path} holds no records: expected one JSON object per line with {prompt_key!r} and {answer_key!r} "
           "fields")
    return checked


def _every_line(f: Any, path: str, size: int, progress: Optional[Progress]) -> Iterator[Tuple[int, int, bytes]]:
    """``(offset, line number, line)`` of every non-blank line of the open file ``f``, telling ``progress``
    how far it is every 16 MiB and at the end."""
    done = reported = 0
    for number, line in enumerate(f, 1):
        if line.strip():
            yield done, number, line
        done += len(line)
        if progress is not None and done - reported >= 1 << 24:
            progress(path, done, size)
            reported = done
    if progress is not None:
        progress(path, done, size)
