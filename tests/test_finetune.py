"""Fine-tuning: ``finetune()`` from a pretraining checkpoint, ``FinetuningDatasetConfig``'s jsonl data, and
``[job] entry = "finetune"``.

A 2-rank CPU pretraining run on mock data (the byte-level tokenizer sizes the vocabulary, as it does for
the fine-tuning run) leaves the checkpoint; the fine-tuning runs start from it on prompt/answer jsonl
written here. The fine-tuning schedule warms up from ``lr_warmup_init = 0``, so its first step changes no
weight: its checkpoint after step 1 must hold exactly the pretrained weights (they were loaded) next to an
optimizer that has taken one step (it is fresh). Resuming that run from its own checkpoint must then
reproduce an uninterrupted fine-tuning run bitwise. The dataset, collate and loss are checked by hand on
small samples; bad input is one ConfigError naming the file:line or the key.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from bridge_test_helpers import assert_bitwise_equal, model_params
from warm_ranks import run_job, run_module

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DataloaderConfig,
    FinetuningDatasetConfig,
    TokenizerConfig,
)
from bridge_hpc.training.engine.metrics import read_metrics

#: The tiny GPT of tests/data/tiny.toml, its vocabulary from the byte-level tokenizer (258 -> 384).
COMMON = """
[train]
train_iters = {train_iters}
micro_batch_size = 2
global_batch_size = 8
eval_interval = 6
eval_iters = 1

[model]
num_layers = 2
hidden_size = 64
num_attention_heads = 4
seq_length = 32

[tokenizer]
tokenizer_type = "ByteLevelTokenizer"

[optimizer]
lr = 3e-3
min_lr = 3e-4

[scheduler]
lr_decay_style = "cosine"
lr_warmup_iters = 3

[logger]
log_interval = 1

[rng]
seed = 1234
"""


def _tokenizer():
    from bridge_hpc.training.tokenizers import build_tokenizer

    cfg = TokenizerConfig(tokenizer_type="ByteLevelTokenizer")
    cfg.finalize()
    return build_tokenizer(cfg)


def _write_jsonl(path: Path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _qa(n: int, offset: int = 0) -> list:
    """Prompt/answer pairs of varied lengths; every fifth prompt is longer than the sequence."""
    out = []
    for i in range(offset, offset + n):
        prompt = f"{i} plus {i % 7} is " if i % 5 else f"long prompt {i}: " + "x" * 40 + " so the sum is "
        out.append({"input": prompt, "output": str(i + i % 7)})
    return out


def _torchrun(job: Path, *overrides: str):
    """2 ranks of ``job`` (tests/warm_ranks.py, as torchrun starts them); fails unless both exit 0."""
    return run_job(job, overrides, cwd=job.parent)


# ---------------------------------------------------------------------------------------------
# End to end: pretrain, then fine-tune from its checkpoint (2 ranks each)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The checkpoints folder of a 10-step pretraining run on mock data."""
    folder = tmp_path_factory.mktemp("pretrain")
    job = folder / "job.toml"
    job.write_text(textwrap.dedent("""
        [job]
        name = "pre"
        run_dir = "runs/pre"
        """) + COMMON.format(train_iters=10) + textwrap.dedent("""
        [dataset]
        seq_length = 32
        num_workers = 0
        pin_memory = false

        [checkpoint]
        save_interval = 10
        """))
    _torchrun(job)
    return folder / "runs" / "pre" / "checkpoints"


def _finetune_job(folder: Path, pretrained: Path, data: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.toml"
    job.write_text(textwrap.dedent("""
        [job]
        name = "ft"
        run_dir = "runs/ft"
        entry = "finetune"
        """) + COMMON.format(train_iters=12) + textwrap.dedent(f"""
        [dataset]
        dataset_root = "{data}"
        num_workers = 1
        pin_memory = false

        [checkpoint]
        save_interval = 6
        pretrained_checkpoint = "{pretrained}"
        """))
    return job


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    _write_jsonl(root / "training.jsonl", _qa(40))
    _write_jsonl(root / "validation.jsonl", _qa(8, offset=100))
    return root


@pytest.fixture(scope="module")
def straight(tmp_path_factory, pretrained, sft_data) -> Path:
    """12 fine-tuning steps in one go; returns its run folder."""
    job = _finetune_job(tmp_path_factory.mktemp("straight"), pretrained, sft_data)
    proc = _torchrun(job)
    assert f"loaded pretrained weights from {pretrained / 'iter_0000010'}" in proc.stdout
    return job.parent / "runs" / "ft"


def test_finetune_starts_from_pretrained_weights_with_fresh_optimizer_and_resumes_exactly(
        tmp_path, pretrained, sft_data, straight):
    job = _finetune_job(tmp_path / "interrupted", pretrained, sft_data)
    run_dir = job.parent / "runs" / "ft"
    first = _torchrun(job, "train.exit_interval=1")
    assert "loaded pretrained weights" in first.stdout
    step1 = run_dir / "checkpoints" / "iter_0000001"
    # One step from iteration 0 at the warm-up's first learning rate, lr_warmup_init = 0 (megatron-core's
    # scheduler sets it at step 0; metrics log the rate after the step): the weights are the pretrained ones.
    assert_bitwise_equal(model_params(str(pretrained / "iter_0000010"), str(tmp_path)),
                         model_params(str(step1), str(tmp_path)))
    # The optimizer is fresh: one Adam step taken, where the pretrained optimizer had ten.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def adam_steps(folder: Path) -> set:
        out = tmp_path / f"{folder.name}_{folder.parent.parent.name}.pt"
        dcp_to_torch_save(str(folder), str(out))
        return {float(s["step"]) for s in torch.load(out, weights_only=False)["optimizer"]["state"].values()}

    assert adam_steps(step1) == {1.0} and adam_steps(pretrained / "iter_0000010") == {10.0}
    assert torch.load(step1 / "train_state.pt", weights_only=False)["iteration"] == 1

    # Resuming its own run continues from checkpoint.load, not from the pretrained weights again.
    second = _torchrun(job)
    assert "loaded checkpoint" in second.stdout and "iter_0000001" in second.stdout
    assert "loaded pretrained weights" not in second.stdout
    a = read_metrics(str(straight / "metrics.jsonl"))
    b = read_metrics(str(run_dir / "metrics.jsonl"))
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in range(1, 13):
        assert b[step]["loss"] == a[step]["loss"], step  # exact, not approximate
        assert b[step]["grad_norm"] == a[step]["grad_norm"], step
    assert a[12]["loss"] < a[2]["loss"]  # it learns the answers
    assert_bitwise_equal(model_params(str(straight / "checkpoints" / "iter_0000012"), str(tmp_path)),
                         model_params(str(run_dir / "checkpoints" / "iter_0000012"), str(tmp_path)))


def test_finetune_entry_without_pretrained_checkpoint_names_the_key(tmp_path, sft_data):
    job = _finetune_job(tmp_path, Path("unused"), sft_data)
    job.write_text(job.read_text().replace('pretrained_checkpoint = "unused"\n', ""))
    proc = run_module("bridge_hpc.rank", [str(job)], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {job}: key 'checkpoint.pretrained_checkpoint'")


# ---------------------------------------------------------------------------------------------
# The starting-point check
# ---------------------------------------------------------------------------------------------


def test_starting_point_check(tmp_path, pretrained):
    from bridge_hpc.training.finetune import check_starting_point

    save = str(tmp_path / "ft" / "checkpoints")
    with pytest.raises(ConfigError) as err:
        check_starting_point(CheckpointConfig(save=save, load=save))
    assert err.value.key == "checkpoint.pretrained_checkpoint"
    with pytest.raises(ConfigError, match="holds no complete checkpoint") as err:
        check_starting_point(CheckpointConfig(save=save, load=save, pretrained_checkpoint=str(tmp_path)))
    assert err.value.key == "checkpoint.pretrained_checkpoint"
    with pytest.raises(ConfigError) as err:
        check_starting_point(CheckpointConfig(save=save, load=save, pretrained_checkpoint=str(pretrained),
                                              finetune=True))
    assert err.value.key == "checkpoint.finetune"
    with pytest.raises(ConfigError, match="inside checkpoint.save"):
        check_starting_point(CheckpointConfig(save=str(pretrained), load=str(pretrained),
                                              pretrained_checkpoint=str(pretrained / "iter_0000010")))
    check_starting_point(CheckpointConfig(save=save, load=save, pretrained_checkpoint=str(pretrained)))
    check_starting_point(CheckpointConfig(save=save, load=save, pretrained_checkpoint=str(pretrained / "iter_0000010")))
    # Resuming its own run needs no pretrained checkpoint (it may be gone by then).
    check_starting_point(CheckpointConfig(save=str(pretrained.parent / "other"), load=str(pretrained)))


# ---------------------------------------------------------------------------------------------
# Config selection and bad input
# ---------------------------------------------------------------------------------------------


def _sections(dataset: dict, tokenizer: bool = True) -> dict:
    out = {"train": {"train_iters": 2, "micro_batch_size": 1, "global_batch_size": 2}, "optimizer": {"lr": 1e-3},
           "dataset": dataset}
    if tokenizer:
        out["tokenizer"] = {"tokenizer_type": "ByteLevelTokenizer"}
    return out


def test_dataset_root_selects_finetuning_config_with_bridge_defaults(tmp_path):
    _write_jsonl(tmp_path / "training.jsonl", _qa(3))
    cfg = ConfigContainer.from_sections(_sections({"dataset_root": str(tmp_path)}))
    d = cfg.dataset
    assert isinstance(d, FinetuningDatasetConfig)
    assert (d.dataloader_type, d.seed, d.prompt_key, d.answer_key, d.do_validation, d.do_test) == (
        "batch", 1234, "input", "output", True, True)
    assert d.split_path("train") == str(tmp_path / "training.jsonl") and d.split_path("valid") is None
    cfg.validate(world_size=1)
    assert d.seq_length == cfg.model.seq_length


@pytest.mark.parametrize("dataset, tokenizer, key, expect", [
    ({"dataset_root": "{root}/nowhere"}, True, "dataset.dataset_root", "not an existing folder"),
    ({"dataset_root": "{root}/empty"}, True, "dataset.dataset_root", "has no training.jsonl"),
    ({"dataset_root": "{root}"}, False, "tokenizer.tokenizer_type", "tokenized on the fly"),
    ({"dataset_root": "{root}", "answer_key": "input"}, True, "dataset.answer_key", "must differ"),
    ({"dataset_root": "{root}", "dataloader_type": "cyclic"}, True, "dataset.dataloader_type", "batch"),
    ({"dataset_root": "{root}", "data_path": ["x"]}, True, "dataset.data_path", "unknown key"),
])
def test_bad_finetuning_config_names_the_key(tmp_path, dataset, tokenizer, key, expect):
    _write_jsonl(tmp_path / "training.jsonl", _qa(3))
    (tmp_path / "empty").mkdir()
    dataset = {k: v.format(root=tmp_path) if isinstance(v, str) else v for k, v in dataset.items()}
    with pytest.raises(ConfigError, match=expect) as err:
        ConfigContainer.from_sections(_sections(dataset, tokenizer), source="job.toml")
    assert err.value.key == key and err.value.path == "job.toml"


@pytest.mark.parametrize("line, key, expect", [
    ('{"input": "a", "output": "b"', "dataset.dataset_root", "line 3 is not JSON"),
    ('["a", "b"]', "dataset.dataset_root", "is a JSON list"),
    ('{"input": "a"}', "dataset.answer_key", "line 3 has no 'output' field"),
    ('{"prompt": "a", "output": "b"}', "dataset.prompt_key", "line 3 has no 'input' field"),
    ('{"input": "a", "output": 7}', "dataset.answer_key", "line 3 has field 'output' of type int"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, key, expect):
    from bridge_hpc.training.datasets.builders import FinetuningDataset

    path = tmp_path / "training.jsonl"
    path.write_text('{"input": "a", "output": "b"}\n\n' + line + "\n")
    with pytest.raises(ConfigError, match=expect) as err:
        FinetuningDataset(str(path), _tokenizer(), 32, "input", "output")
    assert err.value.path == f"{path}:3" and err.value.key == key
    path.write_text("\n")
    with pytest.raises(ConfigError, match="holds no records"):
        FinetuningDataset(str(path), _tokenizer(), 32, "input", "output")


# ---------------------------------------------------------------------------------------------
# Samples, padding and the loss, by hand
# ---------------------------------------------------------------------------------------------


def _dataset(tmp_path: Path, records, seq_length: int = 32, **kwargs):
    from bridge_hpc.training.datasets.builders import FinetuningDataset

    path = tmp_path / "training.jsonl"
    _write_jsonl(path, records)
    return FinetuningDataset(str(path), _tokenizer(), seq_length, "input", "output", **kwargs)


def test_samples_mask_the_prompt_and_truncate_it_first(tmp_path):
    eod = _tokenizer().eod
    ds = _dataset(tmp_path, [{"input": "Hi ", "output": "yo"}, {"input": "0123456789", "output": "ab"},
                             {"input": "p", "output": "0123456789"}], seq_length=8)
    s = ds[0]  # ids H i ' ' y o EOD
    assert s["tokens"].tolist() == list(b"Hi yo") and s["labels"].tolist() == list(b"i yo") + [eod]
    assert s["loss_mask"].tolist() == [0, 0, 1, 1, 1] and s["position_ids"].tolist() == [0, 1, 2, 3, 4]
    s = ds[1]  # 13 ids > 8 + 1: the prompt loses its first 4 bytes
    assert s["tokens"].tolist() == list(b"456789ab") and s["labels"].tolist() == list(b"56789ab") + [eod]
    assert s["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    s = ds[2]  # the prompt goes entirely, then the answer's end
    assert s["tokens"].tolist() == list(b"01234567") and s["labels"].tolist() == list(b"12345678")
    assert s["loss_mask"].tolist() == [1] * 8


def test_masked_token_loss_on_a_finetuning_batch_matches_a_hand_computation(tmp_path):
    from bridge_hpc.training.losses import masked_token_loss

    eod = _tokenizer().eod
    ds = _dataset(tmp_path, [{"input": "Hi ", "output": "yo"}, {"input": "Q", "output": "A"}])
    batch = ds.collate_fn([ds[0], ds[1]])
    # Padded to 8 (the longest, 5 tokens, rounded up to a multiple of 8); padding is EOD, masked.
    assert batch["tokens"].tolist() == [list(b"Hi yo") + [eod] * 3, list(b"QA") + [eod] * 6]
    assert batch["labels"].tolist() == [list(b"i yo") + [eod] * 4, [ord("A")] + [eod] * 7]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [list(range(8))] * 2
    per_token = (torch.arange(16, dtype=torch.float32).view(2, 8) + 1).requires_grad_()
    loss, num_tokens, report = masked_token_loss(batch["loss_mask"], per_token)
    # Row 0 counts positions 2, 3, 4 (losses 3, 4, 5: y, o, EOD); row 1 positions 0, 1 (losses 9, 10: A, EOD).
    assert loss.item() == 3 + 4 + 5 + 9 + 10 and num_tokens.item() == 5
    assert report["lm loss"].tolist() == [31.0, 5.0]
    loss.backward()
    assert per_token.grad.tolist() == batch["loss_mask"].tolist()


def _iterator(ds, consumed: int, dataloader_type: str):
    from bridge_hpc.training.datasets.builders import SampleIterator

    return SampleIterator(ds, consumed, 2, 0, 1, DataloaderConfig(dataloader_type=dataloader_type, num_workers=0,
                                                                  pin_memory=False), seed=1, global_batch_size=8)


def test_batch_dataloader_pads_each_global_batch_to_one_length_and_resumes(tmp_path):
    records = [{"input": "p" * (i % 6), "output": "a" * (1 + 3 * (i % 4))} for i in range(13)]
    ds = _dataset(tmp_path, records, num_samples=64, seed=5)
    straight = _iterator(ds, 0, "batch")
    micro = [next(straight) for _ in range(12)]
    assert straight.state_dict() == {"consumed_samples": 24}
    for g in range(3):  # 4 micro-batches per global batch of 8
        group = micro[4 * g:4 * g + 4]
        longest = max(len(ds[8 * g + i]["tokens"]) for i in range(8))
        assert {m["tokens"].shape[1] for m in group} == {ds.padded_length(longest)}
        for i, m in enumerate(group):  # the samples, in order, as the pretraining sampler gives them
            for row in range(2):
                sample = ds[8 * g + 2 * i + row]
                n = len(sample["tokens"])
                assert torch.equal(m["tokens"][row, :n], sample["tokens"])
                assert torch.equal(m["loss_mask"][row, :n], sample["loss_mask"])
                assert m["loss_mask"][row, n:].sum() == 0
    # "single" reads the same samples, each micro-batch padded on its own.
    single = _iterator(ds, 0, "single")
    for m in micro[:4]:
        s = next(single)
        n = s["tokens"].shape[1]
        assert torch.equal(m["tokens"][:, :n], s["tokens"]) and (m["loss_mask"][:, n:] == 0).all()
    # Resuming at a global batch boundary gives the same batches; each pass over the file has its own order.
    resumed = _iterator(ds, 8, "batch")
    for m in micro[4:]:
        r = next(resumed)
        assert all(torch.equal(m[k], r[k]) for k in m)
    first_pass = [ds.record(i)["output"] + ds.record(i)["input"] for i in range(13)]
    second_pass = [ds.record(i)["output"] + ds.record(i)["input"] for i in range(13, 26)]
    assert sorted(first_pass) == sorted(second_pass) and first_pass != second_pass


def test_a_base_of_another_vocabulary_is_one_line_naming_the_key_and_the_tensor(pretrained, sft_data, tmp_path):
    """What bridge-submit cannot compare, the vocabulary the tokenizer gives on the ranks (200 extra ids:
    384 -> 512 rows), fails before any weight is read: one line naming checkpoint.pretrained_checkpoint,
    the tensor and both shapes, exit 2 (the batch script does not requeue it), no traceback (issue 36)."""
    from bridge_test_helpers import direct_rank_env

    job = _finetune_job(tmp_path / "ft", pretrained, sft_data)
    proc = run_module("bridge_hpc.rank", [str(job), "--set", "tokenizer.vocab_extra_ids=200"], cwd=job.parent,
                      env=direct_rank_env(), timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "key 'checkpoint.pretrained_checkpoint'" in last and "word_embeddings" in last, last
    assert "(384, 64)" in last and "(512, 64)" in last, last
