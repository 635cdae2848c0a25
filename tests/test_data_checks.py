"""Data that would fail on the ranks after the queue is refused by ``bridge-submit`` (issue 25, item 9).

Blend weights that are each finite but overflow when megatron-core adds them up; an indexed dataset of
empty documents only (a 0-byte ``.bin``, which megatron-core cannot memory-map); fine-tuning records
with a lone surrogate (valid JSON, not UTF-8 text) or without the prompt/answer fields; an empty
training file. Each is one ConfigError naming the file (and line) and the key, from a sample of the
records at submission, from every record with ``--verify-data``, and again on the ranks when they
index the files. Datasets are written with megatron-core's own ``IndexedDatasetBuilder``.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import List

import pytest
import toml
from bridge_test_helpers import MINIMAL_TRAINING, submit_cli

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.config import ConfigContainer
from bridge_hpc.training.datasets import config as training_config

BYTE_LEVEL = {"tokenizer_type": "ByteLevelTokenizer"}


def _indexed(prefix: Path, documents: List[List[int]]) -> str:
    """An indexed dataset written by megatron-core's builder (uint16 tokens), as bridge-prepare-data writes it."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in documents:
        builder.add_document(np.array(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _gpt_sections(dataset: dict) -> dict:
    """Training sections reading indexed ``dataset``; a ``data_path`` of 40 documents is split 8,1,1."""
    if "data_path" in dataset:
        dataset = {"split": "8,1,1", **dataset}
    return {"train": {"train_iters": 2, "micro_batch_size": 1, "global_batch_size": 2},
            "optimizer": {"lr": 1e-3}, "dataset": dataset, "tokenizer": dict(BYTE_LEVEL)}


def _qa(n: int) -> List[dict]:
    return [{"input": f"{i} plus {i % 7} is ", "output": str(i + i % 7)} for i in range(n)]


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _ft_sections(root: Path, **dataset) -> dict:
    return {"train": {"train_iters": 2, "micro_batch_size": 1, "global_batch_size": 2}, "optimizer": {"lr": 1e-3},
            "dataset": {"dataset_root": str(root), **dataset}, "tokenizer": dict(BYTE_LEVEL)}


def _ft_job(folder: Path, root: Path) -> Path:
    """A fine-tuning job file in ``folder`` (its run folder ``folder/run``) reading ``root``."""
    doc = {"job": {"name": "ft", "run_dir": str(folder / "run")}, "slurm": {"time": "00:05:00"}, **MINIMAL_TRAINING,
           "dataset": {"dataset_root": str(root)}, "tokenizer": BYTE_LEVEL}
    job = folder / "job.toml"
    job.write_text(toml.dumps(doc))
    return job


def _sbatch_shim(folder: Path) -> Path:
    """A folder whose ``sbatch`` records that it ran (and ``srun``, which submitit looks for)."""
    folder.mkdir()
    (folder / "sbatch").write_text(f'#!/bin/bash\ntouch "{folder}/SUBMITTED"\necho "Submitted batch job 4242"\n')
    (folder / "srun").write_text("#!/bin/bash\nexit 0\n")
    for tool in ("sbatch", "srun"):
        (folder / tool).chmod(0o755)
    return folder


# ---------------------------------------------------------------------------------------------
# (a) Blend weights
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory) -> List[str]:
    folder = tmp_path_factory.mktemp("indexed")
    docs = [[1 + (i * 7 + j) % 200 for j in range(20 + i)] for i in range(40)]
    return [_indexed(folder / "a", docs), _indexed(folder / "b", docs[::-1])]


@pytest.mark.parametrize("key, weights, expect", [
    ("data_path", ["1e308", "1e308"], "add up to more than a float64 holds"),
    ("data_path", [1e308, 1e308], "add up to more than a float64 holds"),
    ("data_path", ["6e307", "6e307"], "the blend weights add up to 1.2e+308, too close to the float64 limit"),
    ("train_data_path", ["1e308", "1e308"], "add up to more than a float64 holds"),
    ("valid_data_path", ["1e308", "1e308"], "add up to more than a float64 holds"),
    ("data_path", ["1e-320", "1"], "blend weight '1e-320' is too small next to their sum"),
    ("data_path", ["1", "nan"], "blend weight 'nan' must be a positive number (finite"),
    ("data_path", ["inf", "1"], "blend weight 'inf' must be a positive number (finite"),
], ids=["overflow", "overflow-floats", "near-limit", "train-overflow", "valid-overflow", "share-underflows", "nan",
        "inf"])
def test_blend_weights_that_megatron_cannot_normalize_are_refused(tmp_path, two_datasets, key, weights, expect):
    a, b = two_datasets
    dataset = {key: [weights[0], a, weights[1], b]}
    if key != "data_path":
        dataset.setdefault("train_data_path", [a])
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_gpt_sections(dataset), source="job.toml")
    assert err.value.key == f"dataset.{key}" and err.value.path == "job.toml"
    assert expect in err.value.message, err.value.message


def test_what_the_weight_check_guards_against_and_what_it_lets_through(tmp_path, two_datasets):
    """megatron-core's normalize turns an overflowing sum into all-zero shares, which its own assertion
    rejects on the rank; large and small weights that stay in range are accepted unchanged."""
    from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
    from megatron.core.datasets.utils import normalize

    assert normalize([1e308, 1e308]) == [0.0, 0.0]
    with pytest.raises(AssertionError):
        _get_size_per_split_per_dataset(normalize([1e308, 1e308]), [10, 1, 1])
    a, b = two_datasets
    for weights in (["1e307", "1e307"], ["1e-300", "1e-300"], ["3", "1e-290"]):
        cfg = ConfigContainer.from_sections(_gpt_sections({"data_path": [weights[0], a, weights[1], b]}))
        assert cfg.dataset.blend == ([a, b], [float(w) for w in weights])
        shares = normalize(cfg.dataset.blend[1])
        assert all(s > 0 for s in shares)


def test_overflowing_weights_exit_2_through_bridge_submit(tmp_path, two_datasets):
    a, b = two_datasets
    doc = {"job": {"name": "blend", "run_dir": str(tmp_path / "run")}, "slurm": {"time": "00:05:00"},
           **MINIMAL_TRAINING, "dataset": {"data_path": ["1e308", a, "1e308", b], "split": "8,1,1"},
           "tokenizer": BYTE_LEVEL}
    (tmp_path / "job.toml").write_text(toml.dumps(doc))
    result = submit_cli("job.toml", "--dry-run", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "job.toml: key 'dataset.data_path': the blend weights add up to more than" in result.stderr


# ---------------------------------------------------------------------------------------------
# (b) A corpus of empty documents only
# ---------------------------------------------------------------------------------------------


def test_dataset_of_empty_documents_is_refused_naming_the_bin_and_key(tmp_path, two_datasets):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    empty = _indexed(tmp_path / "empty", [[]] * 40)
    assert os.path.getsize(empty + ".bin") == 0
    # What the ranks would hit: megatron-core memory-maps the .bin, and an empty file cannot be mapped.
    with pytest.raises(ValueError, match="cannot mmap an empty file"):
        IndexedDataset(empty, mmap=True)
    for key, dataset in (("data_path", {"data_path": [empty]}),
                         ("data_path", {"data_path": ["0.5", two_datasets[0], "0.5", empty]}),
                         ("train_data_path", {"train_data_path": [empty]}),
                         ("valid_data_path", {"train_data_path": [two_datasets[0]], "valid_data_path": [empty]})):
        with pytest.raises(ConfigError) as err:
            ConfigContainer.from_sections(_gpt_sections(dataset), source="job.toml")
        assert err.value.key == f"dataset.{key}" and err.value.path == "job.toml"
        assert f"{empty}.bin holds no tokens (every document is empty)" in err.value.message
    # The ranks read the header again before their token scan (check_token_ids): the same error there.
    with pytest.raises(ConfigError, match="holds no tokens"):
        training_config.read_index_header(empty, "dataset.data_path")


def test_split_whose_documents_are_all_empty_is_refused(tmp_path):
    """A split that gets documents, all of them empty, would loop forever in GPTDataset looking for tokens."""
    docs = [[5, 6, 7, 8]] * 8 + [[]] * 2  # split 8,2,0: valid gets documents 8 and 9, both empty
    prefix = _indexed(tmp_path / "tail_empty", docs)
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_gpt_sections({"data_path": [prefix], "split": "8,2,0"}), source="job.toml")
    assert err.value.key == "dataset.split"
    assert "gives the valid split documents 8 to 9" in err.value.message and "empty (no tokens)" in err.value.message
    ConfigContainer.from_sections(_gpt_sections({"data_path": [prefix], "split": "7,3,0"}))  # valid gets one with text


def test_verify_data_checks_every_idx_entry_that_the_header_check_skips(tmp_path, two_datasets):
    import shutil

    prefix = str(tmp_path / "copy")
    for suffix in (".bin", ".idx"):
        shutil.copy(two_datasets[0] + suffix, prefix + suffix)
    header = training_config.read_index_header(prefix, "dataset.data_path")
    cfg = ConfigContainer.from_sections(_gpt_sections({"data_path": [prefix]}))
    assert cfg.check_data_records(full=True) == [(prefix + ".idx", header.sequence_count)]
    with open(prefix + ".idx", "r+b") as f:  # the pointer of sequence 10 of 40, 6 bytes too far
        f.seek(training_config._INDEX_HEADER_BYTES + 4 * header.sequence_count + 8 * 10)
        pointer = int.from_bytes(f.read(8), "little")
        f.seek(-8, os.SEEK_CUR)
        f.write((pointer + 6).to_bytes(8, "little"))
    cfg = ConfigContainer.from_sections(_gpt_sections({"data_path": [prefix]}))  # O(1) reads: not seen
    with pytest.raises(ConfigError) as err:
        cfg.check_data_records(full=True)
    assert err.value.key == "dataset.data_path"
    assert f"{prefix}.idx is damaged: sequence 10 starts at byte {pointer + 6}" in err.value.message


# ---------------------------------------------------------------------------------------------
# (c), (d) Fine-tuning records: lone surrogates, missing fields, empty files
# ---------------------------------------------------------------------------------------------

LONE_SURROGATE = '{"input": "caf\\udc80", "output": "b"}'  # valid JSON; "\udc80" is not text


@pytest.mark.parametrize("line, key, expect", [
    (LONE_SURROGATE, "dataset.prompt_key", "has field 'input' with a lone surrogate '\\udc80' at character 4"),
    ('{"input": "a", "output": "\\ud800"}', "dataset.answer_key", "has field 'output' with a lone surrogate"),
    ('{"prompt": "a", "completion": "b"}', "dataset.prompt_key", "has no 'input' field (it has ['completion', "
                                                                 "'prompt'])"),
    ('{"input": "a", "answer": "b"}', "dataset.answer_key", "has no 'output' field"),
    ('{"input": "a", "output": null}', "dataset.answer_key", "has field 'output' of type NoneType"),
    ('"just a string"', "dataset.dataset_root", "is a JSON str, expected an object"),
    ("[" * 100000, "dataset.dataset_root", "is not a record: its JSON nests too deeply to read"),
], ids=["surrogate-prompt", "surrogate-answer", "no-prompt", "no-answer", "null", "string", "deep"])
def test_bad_record_is_refused_at_submission_naming_file_line_and_key(tmp_path, line, key, expect):
    root = tmp_path / "sft"
    root.mkdir()
    train = root / "training.jsonl"
    train.write_text('{"input": "a", "output": "b"}\n\n' + line + "\n" + '{"input": "c", "output": "d"}\n')
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_ft_sections(root), source="job.toml")
    assert err.value.key == key and err.value.path == "job.toml"
    assert err.value.message.startswith(f"{train}:3 {expect}"), err.value.message


def test_missing_fields_exit_2_through_bridge_submit_with_nothing_submitted(tmp_path):
    """A real submit (sbatch stood in for): one line naming the job file, the key and file:line; exit 2;
    no traceback; sbatch never run; no run folder made."""
    root = tmp_path / "sft"
    root.mkdir()
    records = _qa(50)
    records[0] = {"question": "2 plus 2 is ", "answer": "4"}
    _write_jsonl(root / "training.jsonl", records)
    job = _ft_job(tmp_path, root)
    shims = _sbatch_shim(tmp_path / "shims")
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")
    result = submit_cli(str(job), cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {job}: key 'dataset.prompt_key': {root / 'training.jsonl'}:1 has no "
                                    "'input' field (it has ['answer', 'question'])"), result.stderr
    assert not (shims / "SUBMITTED").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["zero-bytes", "blank-lines"])
def test_training_file_without_records_is_refused_at_submission(tmp_path, content):
    (tmp_path / "training.jsonl").write_text(content)
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_ft_sections(tmp_path), source="job.toml")
    assert err.value.key == "dataset.dataset_root"
    assert err.value.message.startswith(f"{tmp_path / 'training.jsonl'} holds no records")


def test_only_the_files_the_run_reads_are_checked(tmp_path):
    """validation.jsonl is read only with evaluation on (validation.eval_interval), test.jsonl with
    eval_iters > 0, and neither with do_validation / do_test = false: a bad file the run never reads is
    not the run's problem."""
    _write_jsonl(tmp_path / "training.jsonl", _qa(5))
    (tmp_path / "validation.jsonl").write_text('{"nothing": 1}\n')
    (tmp_path / "test.jsonl").write_text('{"nothing": 1}\n')
    sections = _ft_sections(tmp_path, do_test=False)
    ConfigContainer.from_sections(sections)  # no evaluation: validation.jsonl is never read
    sections["validation"] = {"eval_interval": 1, "eval_iters": 1}
    with pytest.raises(ConfigError, match="validation.jsonl:1 has no 'input' field"):
        ConfigContainer.from_sections(sections)
    with pytest.raises(ConfigError, match="test.jsonl:1 has no 'input' field"):
        ConfigContainer.from_sections(_ft_sections(tmp_path, do_validation=False))


# ---------------------------------------------------------------------------------------------
# The sample, and --verify-data
# ---------------------------------------------------------------------------------------------


def test_sample_reads_a_bounded_part_of_a_large_file_and_finds_spread_lines_with_their_numbers(tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "training.jsonl", _qa(20000))
    read = []
    real_open = open

    class Counting(io.BufferedReader):
        def read(self, *args):
            data = super().read(*args)
            read.append(len(data))
            return data

        def readline(self, *args):
            data = super().readline(*args)
            read.append(len(data))
            return data

    def counting_open(file, mode="r", *args, **kwargs):
        if mode == "rb" and str(file) == str(path):
            return Counting(real_open(file, "rb", buffering=0))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    checked = training_config.check_jsonl_records(str(path), "input", "output")
    monkeypatch.undo()
    size = path.stat().st_size
    assert checked == training_config.SAMPLED_HEAD_RECORDS + training_config.SAMPLED_SPREAD_RECORDS
    assert sum(read) < size / 10  # a sample, not a pass over the file
    # A bad record at a sampled spread point is reported with its line number (counted on demand).
    with real_open(path, "rb") as f:
        lines, whole = training_config._jsonl_sample(f, size)
    assert not whole and [n for _, n, _ in lines[:3]] == [1, 2, 3] and lines[-1][1] is None
    offset = lines[-1][0]
    data = path.read_bytes()
    number = data[:offset].count(b"\n") + 1
    records = _qa(20000)
    records[number - 1] = {"input": records[number - 1]["input"], "outpux": records[number - 1]["output"]}
    _write_jsonl(path, records)  # the same length: the same lines sampled
    assert path.read_bytes()[:offset] == data[:offset]
    with pytest.raises(ConfigError) as err:
        training_config.check_jsonl_records(str(path), "input", "output")
    assert err.value.message.startswith(f"{path}:{number} has no 'output' field"), err.value.message


def test_verify_data_finds_a_bad_record_beyond_the_sample(tmp_path):
    """A lone surrogate deep in a 20000-record file, between two sampled lines: bridge-submit's sample
    passes it, ``--verify-data`` names its line; on a good file it says what it checked."""
    root = tmp_path / "sft"
    root.mkdir()
    path = root / "training.jsonl"
    records = _qa(20000)
    _write_jsonl(path, records)
    with open(path, "rb") as f:
        lines, _ = training_config._jsonl_sample(f, path.stat().st_size)
    data = path.read_bytes()
    sampled = {data[:offset].count(b"\n") + 1 for offset, _, _ in lines}
    bad = 15001
    assert bad not in sampled and bad > training_config.SAMPLED_HEAD_RECORDS
    records[bad - 1] = {"input": "caf\udc80", "output": "x"}
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # json.dumps writes it as "\udc80"
    job = _ft_job(tmp_path, root)
    sampled_only = submit_cli(str(job), "--dry-run", cwd=tmp_path)
    assert sampled_only.returncode == 0, sampled_only.stderr
    full = submit_cli(str(job), "--dry-run", "--verify-data", cwd=tmp_path)
    assert full.returncode == 2 and full.stdout == "" and "Traceback" not in full.stderr, full.stderr
    assert full.stderr.count("\n") == 1
    assert full.stderr.startswith(f"error: {job}: key 'dataset.prompt_key': {path}:{bad} has field 'input' with a "
                                  "lone surrogate"), full.stderr
    records[bad - 1] = {"input": "café", "output": "x"}
    _write_jsonl(path, records)
    good = submit_cli(str(job), "--dry-run", "--verify-data", cwd=tmp_path)
    assert good.returncode == 0 and good.stdout.startswith("#!/bin/bash"), good.stderr
    verified, unchecked = good.stderr.splitlines()  # then the dry run's line on the checks that need Slurm
    assert verified == "verified 1 data file(s): 20000 records, all good" and "need Slurm" in unchecked


def test_verify_data_progress_on_a_long_file(monkeypatch):
    from bridge_hpc.cli.submit import _Progress

    clock = iter([0.0, 0.5, 2.0, 5.0, 13.0, 14.0])
    monkeypatch.setattr("bridge_hpc.cli.submit.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    progress = _Progress(out)
    total = 100 << 20
    for done in (0, 10 << 20, 20 << 20, 30 << 20, 90 << 20, total):
        progress("/data/training.jsonl", done, total)
    progress.close()
    assert out.getvalue().splitlines() == ["verifying /data/training.jsonl: 20% of 100 MiB",
                                           "verifying /data/training.jsonl: 90% of 100 MiB",
                                           "verifying /data/training.jsonl: 100% of 100 MiB"]


# ---------------------------------------------------------------------------------------------
# The ranks: every record checked again at start-up, and each as it is read
# ---------------------------------------------------------------------------------------------


def _tokenizer():
    from bridge_hpc.training.config import TokenizerConfig
    from bridge_hpc.training.tokenizers import build_tokenizer

    cfg = TokenizerConfig(**BYTE_LEVEL)
    cfg.finalize()
    return build_tokenizer(cfg)


def test_rank_side_reader_refuses_a_lone_surrogate_naming_file_line_and_key(tmp_path):
    """The file may change after submission: the ranks index every record again and refuse it there, as a
    ConfigError (exit 2 on every rank), not the tokenizer's UnicodeEncodeError at the step that reads it."""
    from bridge_hpc.training.datasets.builders import FinetuningDataset

    path = tmp_path / "training.jsonl"
    path.write_text('{"input": "a", "output": "b"}\n\n' + LONE_SURROGATE + "\n")
    with pytest.raises(UnicodeEncodeError):
        _tokenizer().tokenize("caf\udc80")  # what the rank would have died of
    with pytest.raises(ConfigError) as err:
        FinetuningDataset(str(path), _tokenizer(), 32, "input", "output")
    assert err.value.path == f"{path}:3" and err.value.key == "dataset.prompt_key"
    assert err.value.message.startswith("line 3 has field 'input' with a lone surrogate")


def test_rank_side_reader_refuses_a_record_changed_after_it_was_indexed(tmp_path):
    from bridge_hpc.training.datasets.builders import FinetuningDataset

    path = tmp_path / "training.jsonl"
    _write_jsonl(path, [{"input": "aa", "output": "b"}, {"input": "cc", "output": "d"}])
    ds = FinetuningDataset(str(path), _tokenizer(), 32, "input", "output")
    assert ds.record(1) == {"input": "cc", "output": "d"}
    _write_jsonl(path, [{"input": "aa", "output": "b"}, {"inpt": "cc", "output": "d"}])  # same length
    with pytest.raises(ConfigError) as err:
        ds[1]
    assert err.value.path == f"{path}:2" and err.value.key == "dataset.prompt_key"
    assert "has no 'input' field" in err.value.message and "changed after the run indexed it" in err.value.message

