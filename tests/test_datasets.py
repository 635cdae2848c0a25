"""Indexed data on megatron-core's GPTDataset / BlendedMegatronDatasetBuilder, and Bridge's GPT step and loss.

The corpus is standard-library docstrings (text already on the machine), prepared by
``bridge_hpc.prepare.shards`` with the byte-level tokenizer into two datasets that are blended. Samples are
compared with tokenizing the source text directly, following megatron-core's own document, sample and
shuffle indices. One test runs this file under torchrun with 2 ranks (gloo) to check that iterators
stopped at a number of consumed samples and rebuilt resume with bitwise the same batches. Bad input is a
ConfigError naming the file and the key.
"""

from __future__ import annotations

import csv
import gzip
import inspect
import json
import os
import shutil
import string
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from bridge_test_helpers import single_rank_world
from warm_ranks import run_ranks

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.config import ConfigContainer, GPTDatasetConfig, MockGPTDatasetConfig, TokenizerConfig
from bridge_hpc.training.datasets import config as described

SEQ = 32
BYTE_LEVEL = {"tokenizer_type": "ByteLevelTokenizer"}


# ---------------------------------------------------------------------------------------------
# The corpus and configs
# ---------------------------------------------------------------------------------------------


def _docs() -> List[str]:
    """Paragraphs of a few modules' docstrings: enough documents for every split to get some."""
    modules = (json, os, string, textwrap, gzip, inspect, csv, shutil)
    paragraphs = [p.strip() for m in modules for p in (inspect.getdoc(m) or "").split("\n\n")]
    return [p for p in paragraphs if p] + ["non-ASCII: héllo wörld ✓ 日本"]


def _tokenizer():
    from bridge_hpc.training.tokenizers import build_tokenizer

    cfg = TokenizerConfig(**BYTE_LEVEL)
    cfg.finalize()
    return build_tokenizer(cfg)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Dict[str, List[List[int]]]:
    """Two prepared datasets: prefix -> the token ids (+ EOD) of its documents, from the source text."""
    from bridge_hpc.prepare.shards import prepare_local

    folder = tmp_path_factory.mktemp("corpus")
    docs = _docs()
    half = len(docs) // 2
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:half]))
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[half:]))
    tok_cfg = TokenizerConfig(**BYTE_LEVEL)
    tok_cfg.finalize()
    records = prepare_local([str(folder / "a.jsonl"), str(folder / "b.jsonl")], str(folder / "text"), tok_cfg,
                            ["text"], append_eod=True, workers=1)
    tokenizer = _tokenizer()
    out = {}
    for record, part in zip(records, (docs[:half], docs[half:])):
        out[record.outputs["text"].prefix] = [list(tokenizer.tokenize(d)) + [tokenizer.eod] for d in part]
    return out


@pytest.fixture(scope="module")
def single_rank():
    yield from single_rank_world()


def _sections(tmp_path: Path, dataset: dict, tokenizer: bool = True) -> dict:
    sections = {
        "train": {"train_iters": 6, "micro_batch_size": 2, "global_batch_size": 4, "eval_interval": 3,
                  "eval_iters": 1},
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": SEQ},
        "optimizer": {"lr": 1e-3},
        "dataset": {"num_workers": 0, "pin_memory": False, **dataset},
        "checkpoint": {"save": str(tmp_path / "run" / "checkpoints")},
    }
    if tokenizer:
        sections["tokenizer"] = dict(BYTE_LEVEL)
    return sections


def _blend(corpus) -> list:
    a, b = corpus
    return ["0.7", a, "0.3", b]


def _built(tmp_path: Path, dataset: dict, world_size: int = 1):
    """(cfg, tokenizer, (train, valid, test)) the way pretrain builds them."""
    from bridge_hpc.training.datasets.builders import build_datasets
    from bridge_hpc.training.tokenizers import build_tokenizer_for

    cfg = ConfigContainer.from_sections(_sections(tmp_path, dataset), source="job.toml")
    tokenizer = build_tokenizer_for(cfg)
    cfg.validate(world_size)
    return cfg, tokenizer, build_datasets(cfg.dataset, cfg, tokenizer)


def _expected_text(gpt_dataset, index: int, docs: List[List[int]]) -> List[int]:
    """Sample ``index`` of a megatron GPTDataset recomputed from its own indices and the source token ids."""
    i = int(gpt_dataset.shuffle_index[index])
    (doc_beg, off_beg), (doc_end, _) = gpt_dataset.sample_index[i], gpt_dataset.sample_index[i + 1]
    flat = [t for d in gpt_dataset.document_index[doc_beg:doc_end + 1] for t in docs[int(d)]]
    return flat[int(off_beg):int(off_beg) + SEQ + 1]


# ---------------------------------------------------------------------------------------------
# Config: which class, blend and split parsing
# ---------------------------------------------------------------------------------------------


def test_data_path_selects_gpt_dataset_config_and_mock_stays_default(tmp_path, corpus):
    a, b = corpus
    # Megatron-LM's default split leaves 22 documents none for the test split (megatron-core would loop).
    with pytest.raises(ConfigError, match="'969,30,1' gives the test split none of the 22 documents"):
        ConfigContainer.from_sections(_sections(tmp_path, {"data_path": _blend(corpus)}), source="job.toml")
    cfg = ConfigContainer.from_sections(_sections(tmp_path, {"data_path": _blend(corpus), "split": "8,1,1"}),
                                        source="job.toml")
    assert isinstance(cfg.dataset, described.GPTDatasetConfig)  # the loader's torch-free description
    assert cfg.dataset.blend == ([a, b], [0.7, 0.3]) and cfg.dataset.split == "8,1,1"
    cfg = ConfigContainer.from_sections(_sections(tmp_path, {"data_path": f"{a} {b}", "split": "8,1,1"}),
                                        source="job.toml")
    assert cfg.dataset.blend == ([a, b], None)
    cfg = ConfigContainer.from_sections(_sections(tmp_path, {"train_data_path": [a], "valid_data_path": [b]}),
                                        source="job.toml")
    assert cfg.dataset.blend is None and cfg.dataset.blend_per_split == [([a], None), ([b], None), None]
    cfg = ConfigContainer.from_sections(_sections(tmp_path, {"seq_length": SEQ}, tokenizer=False), source="job.toml")
    assert isinstance(cfg.dataset, described.MockGPTDatasetConfig)


def test_relative_prefixes_resolve_against_a_base_folder(corpus):
    from bridge_hpc.training.config import absolute_dataset_paths

    body = {"data_path": ["0.7", "data/a", "0.3", "~/b"], "test_data_path": "c /abs/d", "split": "1"}
    out = absolute_dataset_paths(body, "/jobs")
    assert out["data_path"] == ["0.7", "/jobs/data/a", "0.3", os.path.expanduser("~/b")]
    assert out["test_data_path"] == ["/jobs/c", "/abs/d"] and out["split"] == "1"


# ---------------------------------------------------------------------------------------------
# Samples are megatron's GPTDataset's and equal the source text's token ids
# ---------------------------------------------------------------------------------------------


def test_blended_samples_come_from_gpt_dataset_and_equal_source_tokens(single_rank, tmp_path, corpus):
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.gpt_dataset import GPTDataset

    cfg, tokenizer, (train, valid, test) = _built(tmp_path, {"data_path": _blend(corpus), "split": "8,1,1"})
    assert cfg.model.vocab_size == 384  # the byte-level tokenizer's 258, padded to a multiple of 128
    assert cfg.dataset.path_to_cache == str(tmp_path / "run" / "dataset_cache")
    assert isinstance(train, BlendedDataset) and all(isinstance(d, GPTDataset) for d in train.datasets)
    assert len(train) >= 6 * 4 and valid is not None and test is not None
    docs = list(corpus.values())
    seen = set()
    for i in range(len(train)):
        sample = train[i]
        which, j = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        seen.add(which)
        text = _expected_text(train.datasets[which], j, docs[which])
        assert len(text) == SEQ + 1
        assert sample["tokens"].tolist() == text[:-1] and sample["labels"].tolist() == text[1:]
        assert sample["loss_mask"].tolist() == [1.0] * SEQ and "attention_mask" not in sample
    assert seen == {0, 1}
    cache = tmp_path / "run" / "dataset_cache"
    assert list(cache.glob("*-document_index.npy")) and (cache / "max_token_ids.json").is_file()


def test_eod_mask_and_reset_options_reach_the_samples(single_rank, tmp_path, corpus):
    a = next(iter(corpus))
    options = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
    _, tokenizer, (train, _, _) = _built(tmp_path, {"data_path": [a], "split": "1,0,0", **options})
    sample = next(train[i] for i in range(len(train)) if tokenizer.eod in train[i]["tokens"].tolist())
    tokens = sample["tokens"].tolist()
    at = tokens.index(tokenizer.eod)
    assert sample["loss_mask"][at] == 0 and sample["loss_mask"].sum() == SEQ - tokens.count(tokenizer.eod)
    assert sample["position_ids"][at + 1] == 0  # positions restart after the end of a document
    mask = sample["attention_mask"][0]  # True = masked out
    assert bool(mask[at + 1, at]) and not bool(mask[at, at])


# ---------------------------------------------------------------------------------------------
# Exact resume with 2 ranks (torchrun runs this file)
# ---------------------------------------------------------------------------------------------

STEPS, STOP_AT = 6, 2


def _two_rank_main(workdir: str) -> None:
    """Under torchrun: one straight pass of the train iterator, and one stopped after STOP_AT batches
    whose datasets are rebuilt (from the index cache) and iterator resumed from consumed_samples."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bridge_hpc.training.datasets.builders import build_data_iterator

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    rank = dist.get_rank()
    dataset = json.loads(Path(workdir, "dataset.json").read_text())
    cfg, _, (train, _, _) = _built(Path(workdir), dataset, world_size=2)
    mbs, dp = cfg.train.micro_batch_size, 2

    def iterator(ds, consumed):
        return build_data_iterator(ds, consumed, mbs, rank, dp, cfg.dataset, cfg.rng.seed)

    straight = iterator(train, 0)
    straight_batches = [next(straight) for _ in range(STEPS)]
    first = iterator(train, 0)
    resumed_batches = [next(first) for _ in range(STOP_AT)]
    consumed = first.state_dict()["consumed_samples"]
    del train, first
    _, _, (train, _, _) = _built(Path(workdir), dataset, world_size=2)
    second = iterator(train, consumed)
    resumed_batches += [next(second) for _ in range(STEPS - STOP_AT)]
    indices = [[(k * mbs * dp + rank * mbs + j) % len(train) for j in range(mbs)] for k in range(STEPS)]
    torch.save({"straight": straight_batches, "resumed": resumed_batches, "consumed": consumed,
                "expected_tokens": [torch.stack([train[i]["tokens"] for i in ids]) for ids in indices]},
               Path(workdir, f"batches_{rank}.pt"))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_two_ranks_resume_from_consumed_samples_bitwise(tmp_path, corpus):
    (tmp_path / "dataset.json").write_text(json.dumps({"data_path": _blend(corpus), "split": "8,1,1"}))
    done = run_ranks([str(tmp_path)], cwd=str(tmp_path), script=os.path.abspath(__file__), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    per_rank = [torch.load(tmp_path / f"batches_{r}.pt", weights_only=False) for r in (0, 1)]
    for got in per_rank:
        assert got["consumed"] == STOP_AT * 4
        assert len(got["straight"]) == len(got["resumed"]) == STEPS
        for a, b, tokens in zip(got["straight"], got["resumed"], got["expected_tokens"]):
            assert a.keys() == b.keys() and {"tokens", "labels", "loss_mask", "position_ids"} <= a.keys()
            assert all(torch.equal(a[k], b[k]) for k in a)
            assert torch.equal(a["tokens"], tokens)  # rank r reads samples consumed + r*mbs + j
    assert not torch.equal(per_rank[0]["straight"][0]["tokens"], per_rank[1]["straight"][0]["tokens"])


# ---------------------------------------------------------------------------------------------
# Bad input: one ConfigError naming the file and the key
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def copy_of(tmp_path, corpus):
    """A private copy of the first prepared dataset, to damage."""
    source = next(iter(corpus))
    prefix = str(tmp_path / "copy_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(source + suffix, prefix + suffix)
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage,names,expect", [
    (lambda p: os.unlink(p + ".bin"), ".bin", "is missing"),
    (lambda p: os.unlink(p + ".idx"), ".idx", "is missing"),
    (lambda p: os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 10), ".bin", "the .bin is truncated"),
    (lambda p: os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8), ".idx", "is truncated"),
    (lambda p: os.truncate(p + ".idx", 20), ".idx", "shorter than the index header"),
    (lambda p: _patch(p + ".idx", 17, bytes([4])), ".bin", "disagree (dtype or dataset)"),  # uint16 -> int32
    (lambda p: _patch(p + ".idx", 17, bytes([7])), ".idx", "not an integer token dtype"),  # float32
    (lambda p: open(p + ".idx", "ab").write(b"\0" * 100), ".idx", "its header"),
    (lambda p: _patch(p + ".idx", 0, b"NOTANIDX"), ".idx", "bad magic"),
], ids=["no-bin", "no-idx", "short-bin", "short-idx", "short-header", "dtype", "float-dtype", "long-idx", "magic"])
def test_damaged_dataset_files_name_the_file_and_key(tmp_path, copy_of, damage, names, expect):
    damage(copy_of)
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_sections(tmp_path, {"data_path": [copy_of]}), source="job.toml")
    assert err.value.key == "dataset.data_path" and err.value.path == "job.toml"
    assert copy_of + names in err.value.message and expect in err.value.message


@pytest.mark.parametrize("dataset,key,expect", [
    ({"data_path": ["0.7", "A", "zero", "B"]}, "dataset.data_path", "'zero' is not a number"),
    ({"data_path": ["0.7", "A", "B"]}, "dataset.data_path", "alternates weight and prefix"),
    ({"data_path": ["0.7", "A", "-0.3", "B"]}, "dataset.data_path", "must be a positive number"),
    ({"data_path": ["0.7", "A", "0.3", "0.5"]}, "dataset.data_path", "expected a dataset prefix"),
    ({"data_path": []}, "dataset.data_path", "is empty"),
    ({"data_path": ["A"], "split": "90;10"}, "dataset.split", "is not a non-negative number"),
    ({"data_path": ["A"], "split": "0,0,0"}, "dataset.split", "add up to 0"),
    ({"data_path": ["A"], "split": "1,1,1,1"}, "dataset.split", "up to three"),
    ({"data_path": ["A"], "split": "98,-1,3"}, "dataset.split", "not a non-negative number"),
    ({"data_path": ["A"], "split": "1000,1,0"}, "dataset.split", "gives the valid split none of the"),
    ({"data_path": ["A"], "train_data_path": ["A"]}, "dataset.train_data_path", "not both"),
    ({"train_data_path": ["A"], "split": "1,1,1"}, "dataset.split", "per-split paths"),
], ids=["weight", "odd", "negative", "two-weights", "empty", "split-chars", "split-zero", "split-four",
        "split-negative", "split-empty", "both", "split-per-split"])
def test_bad_blend_or_split_names_the_key(tmp_path, corpus, dataset, key, expect):
    a, b = corpus
    swap = {"A": a, "B": b}
    dataset = {k: [swap.get(x, x) for x in v] if isinstance(v, list) else v for k, v in dataset.items()}
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_sections(tmp_path, dataset), source="job.toml")
    assert err.value.key == key and err.value.path == "job.toml" and expect in err.value.message


def test_split_without_train_data_is_refused_when_training(tmp_path, corpus):
    cfg = ConfigContainer.from_sections(_sections(tmp_path, {"data_path": _blend(corpus), "split": "0,1,1"}),
                                        source="job.toml")
    with pytest.raises(ConfigError) as err:
        cfg.validate(1)
    assert err.value.key == "dataset.split" and "no data" in err.value.message


def test_data_path_without_tokenizer_names_tokenizer_type(tmp_path, corpus):
    dataset = {"data_path": _blend(corpus), "split": "8,1,1"}
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_sections(tmp_path, dataset, tokenizer=False),
                                      source="job.toml")
    assert err.value.key == "tokenizer.tokenizer_type" and "[tokenizer]" in err.value.message


def test_token_ids_beyond_the_vocabulary_name_the_bin(single_rank, tmp_path, corpus):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    other = str(tmp_path / "other_tokenizer_text_document")  # as if made by a 32k tokenizer
    builder = IndexedDatasetBuilder(other + ".bin", dtype=np.uint16)
    for doc in ([5, 17, 3000, 2], [9] * 40):
        builder.add_document(np.array(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(other + ".idx")
    a = next(iter(corpus))
    dataset = {"data_path": ["0.5", a, "0.5", other], "split": "1,0,0"}
    with pytest.raises(ConfigError) as err:
        _built(tmp_path, dataset)
    assert err.value.key == "dataset.data_path" and err.value.path == other + ".bin"
    assert "token id 3000" in err.value.message and "vocabulary (size 384)" in err.value.message
    # The scan's result is kept: a restart fails the same way without reading the file again.
    scans = json.loads((tmp_path / "run" / "dataset_cache" / "max_token_ids.json").read_text())
    assert scans[other + ".bin"]["max_id"] == 3000 and scans[a + ".bin"]["max_id"] == 256
    with pytest.raises(ConfigError, match="token id 3000"):
        _built(tmp_path, dataset)


# ---------------------------------------------------------------------------------------------
# Bridge's step and loss
# ---------------------------------------------------------------------------------------------


def test_masked_token_loss_matches_a_hand_computation_with_masked_prompt():
    from bridge_hpc.training.losses import masked_token_loss

    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 1.5, 2.5, 3.5]], requires_grad=True)
    # Prompt tokens (the first two of row 0, the first three of row 1) do not count.
    loss_mask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]], dtype=torch.float32)
    loss, num_tokens, report = masked_token_loss(loss_mask, per_token)
    assert loss.item() == 3.0 + 4.0 + 3.5 and num_tokens.item() == 3 and num_tokens.dtype == torch.int32
    assert report["lm loss"].tolist() == [10.5, 3.0]
    loss.backward()
    assert per_token.grad.tolist() == loss_mask.tolist()  # no gradient through masked positions


def test_forward_step_importable_from_both_paths_and_passes_the_mask():
    from bridge_hpc.training import gpt_step, losses
    from bridge_hpc.training.engine import model as gpt
    from bridge_hpc.training.state import GlobalState

    assert gpt.forward_step is gpt_step.forward_step and gpt.get_batch is gpt_step.get_batch
    assert gpt.masked_next_token_loss is losses.masked_token_loss is losses.masked_next_token_loss
    calls = []

    def model(tokens, position_ids, attention_mask, labels):
        calls.append(attention_mask)
        return torch.ones_like(tokens, dtype=torch.float32)

    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    batch = {"tokens": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long),
             "position_ids": torch.arange(4).view(1, 4), "loss_mask": torch.tensor([[0.0, 1, 1, 1]])}
    output, loss_func = gpt_step.forward_step(GlobalState(), iter([batch, dict(batch, attention_mask=mask)]), model)
    assert loss_func(output)[1].item() == 3 and calls == [None]
    gpt_step.forward_step(GlobalState(), iter([dict(batch, attention_mask=mask)]), model)
    assert calls[-1] is not None and torch.equal(calls[-1], mask)


def test_sdpa_attention_honours_an_explicit_mask_under_causal_type():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from bridge_hpc.training.engine.model import SDPACoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                               attention_dropout=0.0)
    attention = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = (torch.randn(4, 1, 2, 4) for _ in range(3))  # [s, b, heads, dim]
    causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1).view(1, 1, 4, 4)
    documents = causal.clone()
    documents[..., 2:, :2] = True  # a second document starts at position 2
    assert torch.allclose(attention(q, k, v, None), attention(q, k, v, causal), atol=1e-6)
    assert not torch.allclose(attention(q, k, v, None), attention(q, k, v, documents), atol=1e-4)


if __name__ == "__main__":
    _two_rank_main(sys.argv[1])


def test_submission_records_input_paths_absolute_and_the_cache_in_the_run_folder(tmp_path, corpus):
    """A job submitted from the corpus folder with relative prefixes: resolved.toml (what the ranks
    read) holds them absolute, and the index cache defaults to the run folder's dataset_cache."""
    import toml
    from bridge_test_helpers import MINIMAL_TRAINING, submit_cli

    from bridge_hpc.contracts.run_folder import DATASET_CACHE_DIR
    from bridge_hpc.jobfile.jobconfig import load_job_config

    prefixes = sorted(corpus)
    folder = Path(prefixes[0]).parent
    relative = ["0.5", os.path.basename(prefixes[0]), "0.5", os.path.basename(prefixes[1])]
    doc = {"job": {"name": "text", "run_dir": str(tmp_path / "run")}, "slurm": {"time": "00:05:00"},
           **MINIMAL_TRAINING, "model": {"seq_length": SEQ},
           "dataset": {"data_path": relative, "split": "80,20,0", "seq_length": SEQ}, "tokenizer": BYTE_LEVEL}
    job = folder / "job-text.toml"
    job.write_text(toml.dumps(doc))
    result = submit_cli(str(job), "--dry-run", cwd=folder)
    assert result.returncode == 0, result.stdout + result.stderr
    resolved = load_job_config(job, cwd=folder).raw  # what bridge-submit writes to resolved.toml
    assert resolved["dataset"]["data_path"] == ["0.5", prefixes[0], "0.5", prefixes[1]]
    assert resolved["dataset"]["path_to_cache"] == str(tmp_path / "run" / DATASET_CACHE_DIR)
    # the same job from another folder: the relative prefixes name nothing there, and the check says which key
    elsewhere = submit_cli(str(job), "--dry-run", "--set", f"job.run_dir={tmp_path / 'run2'}", cwd=tmp_path)
    assert elsewhere.returncode == 2 and "dataset.data_path" in elsewhere.stderr, elsewhere.stderr


def test_megatron_core_dataset_options_reach_its_dataset(single_rank, tmp_path, corpus):
    """megatron-core's own GPTDatasetConfig fields, set in [dataset], act in megatron-core's GPTDataset:
    without the extra token a sample's labels are its tokens shifted by one inside seq_length tokens;
    skip_getting_attention_mask_from_dataset = false asks the dataset for its mask."""
    a = next(iter(corpus))
    _, _, (train, _, _) = _built(tmp_path / "a", {"data_path": [a], "split": "1,0,0",
                                                  "add_extra_token_to_sequence": False})
    _, _, (plain, _, _) = _built(tmp_path / "b", {"data_path": [a], "split": "1,0,0"})
    assert train.config.add_extra_token_to_sequence is False and plain.config.add_extra_token_to_sequence is True
    sample = train[0]
    assert sample["tokens"].shape[0] == SEQ and sample["tokens"][1:].tolist() == sample["labels"][:-1].tolist()
    assert "attention_mask" not in plain[0]
    _, _, (masked, _, _) = _built(tmp_path / "c", {"data_path": [a], "split": "1,0,0",
                                                   "skip_getting_attention_mask_from_dataset": False})
    assert masked[0]["attention_mask"].shape[-1] == SEQ


def test_bridge_constructor_and_megatron_core_names():
    import dataclasses

    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig

    from bridge_hpc.training.tokenizers import build_tokenizer

    assert GPTDatasetConfig(seq_length=64).sequence_length == 64
    assert GPTDatasetConfig(sequence_length=64).seq_length == 64
    mock = MockGPTDatasetConfig(seq_length=16, random_seed=3,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    assert isinstance(mock, GPTDatasetConfig)
    mock.finalize()
    assert mock.mock and mock.seq_length == 16
    mine = {f.name for f in dataclasses.fields(GPTDatasetConfig)}
    for f in dataclasses.fields(MCoreGPTDatasetConfig):
        assert f.name in mine or f.name == "sequence_length", f.name  # sequence_length: seq_length's other name
        if f.name in mine and f.default is not dataclasses.MISSING and f.name not in ("random_seed",):
            assert getattr(GPTDatasetConfig(), f.name) == f.default, f.name
    # what the ranks hand megatron-core builds megatron-core's own config
    tok = TokenizerConfig(**BYTE_LEVEL)
    tok.finalize()
    fields = GPTDatasetConfig(seq_length=8, random_seed=1).megatron_fields()
    assert MCoreGPTDatasetConfig(**{**fields, "tokenizer": build_tokenizer(tok)}).sequence_length == 8
    with pytest.raises(TypeError, match="no_such_field"):
        GPTDatasetConfig(seq_length=8, no_such_field=1)
    with pytest.raises(ValueError, match=r"dataset\.object_storage_cache_path"):
        MockGPTDatasetConfig(seq_length=8, object_storage_cache_path="/s3").finalize()
    with pytest.raises(ValueError, match=r"dataset\.dataloader_type"):
        MockGPTDatasetConfig(seq_length=8, dataloader_type="cyclic").finalize()


def test_a_gpt_dataset_config_given_no_data_is_megatron_cores_mock_mode(single_rank, tmp_path):
    """As megatron-core's GPTDatasetConfig: no blend at all means mock data (a config built in Python)."""
    from bridge_hpc.training.datasets.builders import MockGPTDataset, build_datasets

    cfg = ConfigContainer.from_sections(_sections(tmp_path, {"random_seed": 5}, tokenizer=False), source="job.toml")
    cfg.dataset = GPTDatasetConfig(random_seed=5,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    cfg.dataset.finalize()
    assert cfg.dataset.mock and cfg.dataset.split == "1,1,1"
    cfg.validate(world_size=1)
    assert cfg.dataset.seq_length == SEQ
    train, valid, _ = build_datasets(cfg.dataset, cfg)
    assert isinstance(train, MockGPTDataset) and len(train) == 6 * 4
    assert int(train[0]["tokens"].max()) < cfg.model.vocab_size


def test_finalizing_twice_is_harmless_and_data_path_makes_the_blend(corpus):
    a = next(iter(corpus))
    cfg = GPTDatasetConfig(seq_length=SEQ, data_path=[a], split="1,0,0", num_workers=0,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    cfg.finalize()
    blend = cfg.blend
    cfg.finalize()  # the blend made from data_path is made again, not taken for a second one
    assert cfg.blend == blend == ([a], None)
