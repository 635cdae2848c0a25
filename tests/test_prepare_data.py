"""Tokenizers and ``bridge-prepare-data`` run locally (no Slurm, nothing downloaded).

The corpus is the docstrings of a few standard-library modules (text already on the machine), written
as jsonl and jsonl.gz. Output is read back through megatron-core's ``IndexedDataset`` and compared token
for token with tokenizing the same documents directly with the same tokenizer. Bad input: exit status 2
and one message naming the file and line, key or flag.
"""

from __future__ import annotations

import csv
import gzip
import inspect
import json
import os
import shutil
import string
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest
import toml
from bridge_test_helpers import MINIMAL_TRAINING, MINIMAL_TRAINING_TOML, submit_cli

from bridge_hpc.cli.prepare_data import main
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.config import ConfigContainer, TokenizerConfig
from bridge_hpc.training.tokenizers import apply_tokenizer_vocab_size, build_tokenizer, padded_vocab_size

BYTE_LEVEL = ["--tokenizer-type", "ByteLevelTokenizer"]


def documents() -> List[str]:
    docs = [inspect.getdoc(m) for m in (json, os, string, textwrap, gzip, inspect, csv, shutil)]
    return [d for d in docs if d] + ["non-ASCII: héllo wörld ✓ 日本", ""]


@pytest.fixture
def corpus(tmp_path: Path) -> Dict[str, List[str]]:
    """``a.jsonl`` and ``b.jsonl.gz`` in tmp_path: file name -> its documents in order."""
    docs = documents()
    half = len(docs) // 2
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:half])))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[half:]))
    return {"a": docs[:half], "b": docs[half:]}


def run(capsys, *argv: str):
    """main(argv) in this process: (exit status, stdout, stderr)."""
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def read_back(prefix: str) -> List[List[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def expected(tokenizer, docs: List[str], append_eod: bool) -> List[List[int]]:
    out = []
    for text in docs:
        ids = list(tokenizer.tokenize(text)) if text else []
        out.append(ids + [tokenizer.eod] if ids and append_eod else ids)
    return out


def byte_level():
    cfg = TokenizerConfig(tokenizer_type="ByteLevelTokenizer")
    cfg.finalize()
    return build_tokenizer(cfg)


def test_output_equals_direct_tokenization_with_eod_and_manifest(tmp_path, corpus, capsys):
    prefix = tmp_path / "out" / "corpus"
    rc, out, err = run(capsys, "--input", str(tmp_path / "a.jsonl"), str(tmp_path / "*.gz"), "--output-prefix",
                       str(prefix), *BYTE_LEVEL, "--append-eod", "--workers", "2")
    assert rc == 0, err
    tokenizer = byte_level()
    assert tokenizer.vocab_size == 258 and tokenizer.eod == 256
    for shard, docs in corpus.items():
        got = read_back(f"{prefix}_{shard}_text_document")
        assert got == expected(tokenizer, docs, append_eod=True)
    # The snippet is TOML ready to paste; the manifest accounts for every shard with checksums.
    snippet = toml.loads(out)
    assert snippet["dataset"]["data_path"] == [f"{prefix}_a_text_document", f"{prefix}_b_text_document"]
    manifest = json.loads(Path(f"{prefix}.manifest.json").read_text())
    assert manifest["documents"] == sum(len(d) for d in corpus.values())
    assert manifest["tokens"] == sum(len(ids) for docs in corpus.values() for ids in expected(tokenizer, docs, True))
    for shard in manifest["shards"]:
        source = Path(shard["source"]["path"])
        assert shard["source"]["size"] == source.stat().st_size
        assert len(shard["source"]["sha256"]) == 64
        files = shard["outputs"]["text"]
        from bridge_hpc.prepare.shards import _sha256_file

        assert files["bin_sha256"] == _sha256_file(Path(files["prefix"] + ".bin"))
        assert files["idx_bytes"] == os.path.getsize(files["prefix"] + ".idx")
    assert not list(prefix.parent.glob("*.tmp*")), "temporary files left behind"
    assert "docs/s" in err and "tokens/s" in err


def test_rerun_skips_up_to_date_shards_and_redoes_changed_ones(tmp_path, corpus, capsys):
    args = ["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz"), "--output-prefix",
            str(tmp_path / "c"), *BYTE_LEVEL, "--workers", "2"]
    assert run(capsys, *args)[0] == 0
    bins = {s: tmp_path / f"c_{s}_text_document.bin" for s in ("a", "b")}
    before = {s: p.stat().st_mtime_ns for s, p in bins.items()}
    rc, _, err = run(capsys, *args)
    assert rc == 0 and err.count("skipped, up to date") == 2
    assert {s: p.stat().st_mtime_ns for s, p in bins.items()} == before
    # Touched but unchanged: the sha256 matches, still skipped.
    os.utime(tmp_path / "a.jsonl", ns=(1, 1))
    rc, _, err = run(capsys, *args)
    assert rc == 0 and err.count("skipped, up to date") == 2
    # Changed content: only that shard is redone.
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    rc, _, err = run(capsys, *args)
    assert rc == 0 and "a: skipped" not in err and "b: skipped, up to date" in err
    assert bins["b"].stat().st_mtime_ns == before["b"]
    assert read_back(str(tmp_path / "c_a_text_document"))[-1] == byte_level().tokenize("one more document")


def test_console_entry_point_in_a_subprocess(tmp_path, corpus):
    command = shutil.which("bridge-prepare-data")
    argv = [command] if command else [sys.executable, "-m", "bridge_hpc.cli.prepare_data"]
    result = subprocess.run([*argv, "--input", str(tmp_path / "*.jsonl*"), "--output-prefix", str(tmp_path / "p"),
                             *BYTE_LEVEL, "--workers", "2", "--json-keys", "text"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "[dataset]" in result.stdout and "Traceback" not in result.stderr
    tokenizer = byte_level()
    for shard, docs in corpus.items():
        assert read_back(str(tmp_path / f"p_{shard}_text_document")) == expected(tokenizer, docs, append_eod=False)


def write_lines(path: Path, lines: List[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("lines, where, phrase", [
    (['{"text": "ok"}', '{"text": "fine"}', '{"text": broken'], "bad.jsonl:3", "not valid JSON"),
    (['{"text": "ok"}', '{"body": "no text key"}'], "bad.jsonl:2", "no key 'text'"),
    (['{"text": 42}'], "bad.jsonl:1", "not a string"),
    ([], "bad.jsonl", "empty"),
])
def test_bad_lines_and_empty_corpus_exit_2_naming_file_and_line(tmp_path, capsys, lines, where, phrase):
    bad = write_lines(tmp_path / "bad.jsonl", lines)
    rc, out, err = run(capsys, "--input", str(bad), "--output-prefix", str(tmp_path / "o"), *BYTE_LEVEL)
    assert rc == 2 and out == ""
    assert f"{tmp_path / where}:" in err or f"{tmp_path / where} " in err, err
    assert phrase in err and "Traceback" not in err
    assert not list(tmp_path.glob("o_*")), "nothing may be left behind"


def test_on_bad_line_skip_drops_bad_lines(tmp_path, capsys):
    bad = write_lines(tmp_path / "mixed.jsonl", ['{"text": "kept"}', 'not json', '{"x": 1}', '{"text": "also"}'])
    rc, _, err = run(capsys, "--input", str(bad), "--output-prefix", str(tmp_path / "o"), *BYTE_LEVEL,
                     "--on-bad-line", "skip")
    assert rc == 0 and "2 bad lines skipped" in err
    tokenizer = byte_level()
    assert read_back(str(tmp_path / "o_mixed_text_document")) == expected(tokenizer, ["kept", "also"], False)


def test_missing_tokenizer_file_and_missing_input_exit_2(tmp_path, capsys, corpus):
    rc, _, err = run(capsys, "--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "o"),
                     "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "nope.model"))
    assert rc == 2 and "--tokenizer-model" in err and "nope.model" in err and "Traceback" not in err
    rc, _, err = run(capsys, "--input", str(tmp_path / "missing*.jsonl"), "--output-prefix", str(tmp_path / "o"),
                     *BYTE_LEVEL)
    assert rc == 2 and "missing*.jsonl" in err and "matches no file" in err


def test_prefix_that_would_overwrite_shards_of_other_input_is_refused(tmp_path, capsys, corpus):
    assert run(capsys, "--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "o"), *BYTE_LEVEL)[0] == 0
    other = tmp_path / "elsewhere" / "a.jsonl"
    other.parent.mkdir()
    write_lines(other, ['{"text": "different input, same shard name"}'])
    before = (tmp_path / "o_a_text_document.bin").read_bytes()
    rc, _, err = run(capsys, "--input", str(other), "--output-prefix", str(tmp_path / "o"), *BYTE_LEVEL)
    assert rc == 2 and "would overwrite the finished shard 'a'" in err and str(other) in err
    assert (tmp_path / "o_a_text_document.bin").read_bytes() == before


def test_submit_dry_run_rejects_a_tokenizer_model_that_is_not_a_local_path(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(MINIMAL_TRAINING_TOML + textwrap.dedent("""
        [tokenizer]
        tokenizer_type = "SentencePieceTokenizer"
        tokenizer_model = "meta-llama/Llama-2-7b-hf"
    """))
    result = submit_cli("job.toml", "--dry-run", cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "tokenizer.tokenizer_model" in result.stderr and "job.toml" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()
    # The same job with a byte-level tokenizer (no file) is accepted.
    job.write_text(MINIMAL_TRAINING_TOML + '\n[tokenizer]\ntokenizer_type = "ByteLevelTokenizer"\n')
    result = submit_cli("job.toml", "--dry-run", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr


def test_vocab_size_comes_from_the_tokenizer_padded_unless_the_model_sets_it():
    assert padded_vocab_size(258, 128) == 384
    assert padded_vocab_size(50257, 128, tensor_model_parallel_size=2) == 50432
    assert padded_vocab_size(256, 128) == 256
    tokenizer = byte_level()
    sections = dict(MINIMAL_TRAINING, tokenizer={"tokenizer_type": "ByteLevelTokenizer"})
    cfg = ConfigContainer.from_sections(sections)
    assert cfg.tokenizer.use_tokenizer_vocab_size is True
    assert apply_tokenizer_vocab_size(cfg, tokenizer) == 384 and cfg.model.vocab_size == 384
    cfg = ConfigContainer.from_sections(dict(sections, model={"vocab_size": 512}))
    assert cfg.tokenizer.use_tokenizer_vocab_size is False
    assert apply_tokenizer_vocab_size(cfg, tokenizer) == 512
    cfg = ConfigContainer.from_sections(dict(sections, model={"vocab_size": 100}))
    with pytest.raises(ConfigError) as err:
        apply_tokenizer_vocab_size(cfg, tokenizer)
    assert err.value.key == "model.vocab_size"


def test_missing_optional_library_names_the_type_and_the_extra(tmp_path, monkeypatch):
    import importlib.util

    model = tmp_path / "tok.model"
    model.write_bytes(b"x")
    cfg = TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(model))
    cfg.finalize()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sentencepiece" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        build_tokenizer(cfg)
    assert "SentencePieceTokenizer" in str(err.value) and "bridge_hpc[data]" in str(err.value)


def test_sentencepiece_model_round_trips(tmp_path, corpus, capsys):
    spm = pytest.importorskip("sentencepiece")
    model_prefix = tmp_path / "sp"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(documents()[:-1]), model_prefix=str(model_prefix),
                                   vocab_size=300, model_type="bpe", character_coverage=1.0, minloglevel=2)
    model = f"{model_prefix}.model"
    rc, _, err = run(capsys, "--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "sp_out"),
                     "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod")
    assert rc == 0, err
    cfg = TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)
    cfg.finalize()
    tokenizer = build_tokenizer(cfg)
    assert read_back(str(tmp_path / "sp_out_a_text_document")) == expected(tokenizer, corpus["a"], True)


def test_huggingface_tokenizer_json_round_trips(tmp_path, corpus, capsys):
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(), trainer)
    folder = tmp_path / "hf"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "unk_token": "<unk>"}))
    rc, _, err = run(capsys, "--input", str(tmp_path / "b.jsonl.gz"), "--output-prefix", str(tmp_path / "hf_out"),
                     "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder / "tokenizer.json"),
                     "--append-eod", "--workers", "2")
    assert rc == 0, err
    cfg = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder))
    cfg.finalize()
    tokenizer = build_tokenizer(cfg)
    assert tokenizer.eod == tok.token_to_id("<eos>")
    assert read_back(str(tmp_path / "hf_out_b_text_document")) == expected(tokenizer, corpus["b"], True)


@pytest.mark.parametrize("dtype_name", ["uint16", "int32"])
def test_block_writer_is_byte_identical_to_add_document_per_document(tmp_path, dtype_name):
    """DatasetWriter writes a block of documents at once; megatron-core's IndexedDatasetBuilder
    .add_document once per document must give the very same .bin and .idx bytes (empty documents
    too), and the checksums the writer computed while writing are those of the files."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    from bridge_hpc.prepare.shards import DatasetWriter, _sha256_file

    dtype = getattr(np, dtype_name)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 65535, size=n).astype(dtype) for n in (5, 0, 1, 300, 0, 17, 2, 64, 0)]
    reference = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for doc in docs:
        reference.add_document(doc, [len(doc)])
    reference.finalize(str(tmp_path / "ref.idx"))
    writer = DatasetWriter(str(tmp_path / "blocks"), dtype)
    for block in (docs[0:3], docs[3:4], docs[4:]):
        writer.add_documents(np.concatenate(block).tobytes(), [len(d) for d in block])
    written = writer.finalize()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"blocks{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes(), suffix
    assert written.bin_sha256 == _sha256_file(tmp_path / "blocks.bin")
    assert written.idx_sha256 == _sha256_file(tmp_path / "blocks.idx")
    assert (written.bin_bytes, written.idx_bytes) == ((tmp_path / "ref.bin").stat().st_size,
                                                     (tmp_path / "ref.idx").stat().st_size)
    assert writer.tokens == sum(len(d) for d in docs)
    ds = IndexedDataset(str(tmp_path / "blocks"))
    assert [ds[i].tolist() for i in range(len(ds))] == [d.tolist() for d in docs]


def test_shards_cut_in_many_blocks_equal_add_document_per_document(tmp_path, corpus, capsys, monkeypatch):
    """With blocks of a few lines (so lines fall across block boundaries) and 2 workers, each shard's
    files are byte for byte what add_document per directly tokenized document (+ EOD) makes; a bad
    line far into the file is still named by its own line number; CRLF line ends and a last line
    without a newline are read as lines."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from bridge_hpc.prepare import shards as prepare

    monkeypatch.setattr(prepare, "BLOCK_BYTES", 100)
    prefix = tmp_path / "out" / "c"
    rc, _, err = run(capsys, "--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz"), "--output-prefix",
                     str(prefix), *BYTE_LEVEL, "--append-eod", "--workers", "2")
    assert rc == 0, err
    tokenizer = byte_level()
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    for shard, docs in corpus.items():
        reference = IndexedDatasetBuilder(str(tmp_path / f"ref_{shard}.bin"), dtype=dtype)
        for ids in expected(tokenizer, docs, append_eod=True):
            reference.add_document(ids, [len(ids)])
        reference.finalize(str(tmp_path / f"ref_{shard}.idx"))
        for suffix in (".bin", ".idx"):
            got = Path(f"{prefix}_{shard}_text_document{suffix}").read_bytes()
            assert got == (tmp_path / f"ref_{shard}{suffix}").read_bytes(), (shard, suffix)
    lines = [json.dumps({"text": d}) for d in documents()[:-1]] * 3
    bad = write_lines(tmp_path / "late.jsonl", lines + ["", '{"text": "fine"}', "{broken", '{"text": "x"}'])
    rc, out, err = run(capsys, "--input", str(bad), "--output-prefix", str(tmp_path / "o"), *BYTE_LEVEL)
    assert rc == 2 and f"{bad}:{len(lines) + 3}" in err and "not valid JSON" in err, err
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(b"".join(json.dumps({"text": d}).encode() + b"\r\n" for d in documents()[:3]) + b'{"text": "last"}')
    rc, _, err = run(capsys, "--input", str(crlf), "--output-prefix", str(tmp_path / "o"), *BYTE_LEVEL, "--workers", "2")
    assert rc == 0, err
    assert read_back(str(tmp_path / "o_crlf_text_document")) == expected(tokenizer, documents()[:3] + ["last"], False)
