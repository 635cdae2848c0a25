"""A PEFT fine-tune of a Hugging Face model exports merged weights: the run's checkpoint holds only the
adapters, and ``bridge-hf export`` merges them into the base its record names, so transformers computes
the adapted model's loss; a base that changed since is refused by name."""

from __future__ import annotations

import os

import pytest
import torch
from bridge_test_helpers import direct_rank_env, single_rank_world
from hf_models import FINETUNE_JOB, SEQ, VOCAB, batch, make_hf_model, model_config
from warm_ranks import run_module

PEFT_JOB = FINETUNE_JOB + """[peft]
type = "{kind}"
dim = 4
alpha = 8
"""


@pytest.fixture
def world():
    yield from single_rank_world()


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item()


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_a_peft_run_exports_its_adapters_merged_into_the_base(tmp_path, world, kind):
    import transformers as T

    from bridge_hpc.contracts.errors import ConfigError
    from bridge_hpc.models.hf.export import export
    from bridge_hpc.peft.config import PEFT_TYPES
    from bridge_hpc.training.checkpoint.megatron import _load_model_and_optimizer
    from bridge_hpc.training.engine.model import gpt_model_provider
    from bridge_hpc.training.hf.load import load_hf_weights

    hf = str(tmp_path / "llama")
    original = make_hf_model("llama", hf)
    (tmp_path / "job.toml").write_text(PEFT_JOB.format(seq=SEQ, hf=hf, kind=kind))
    proc = run_module("bridge_hpc.rank", ["job.toml"], cwd=tmp_path, env=direct_rank_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoints = tmp_path / "runs" / "job" / "checkpoints"
    export(str(checkpoints), str(tmp_path / "exported"))

    # The toolkit's adapted model: the base from the folder, the adapters from the run's checkpoint.
    ours = gpt_model_provider(model_config(hf))
    load_hf_weights(hf, [ours])
    PEFT_TYPES[kind](dim=4, alpha=8)(ours, training=False)
    _load_model_and_optimizer([ours], None, str(checkpoints / "iter_0000003"), load_optim=False)
    b = batch(seed=7)
    labels = torch.roll(b["tokens"], -1, dims=1)
    with torch.no_grad():
        toolkit_loss = ours(b["tokens"], b["position_ids"], None, labels=labels)[:, :-1].mean().item()
        exported = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), dtype=torch.float32).eval()
        hf_loss = _loss(exported(b["tokens"]).logits[:, :-1], labels[:, :-1])
        before = _loss(original(b["tokens"]).logits[:, :-1], labels[:, :-1])
    assert abs(hf_loss - toolkit_loss) <= 1e-4, (hf_loss, toolkit_loss)
    assert abs(hf_loss - before) > 1e-4  # the adapters are in the export, not the base alone

    # A base changed after training: the adapters would be merged into another model.
    shard = next(name for name in sorted(os.listdir(hf)) if name.endswith(".safetensors"))
    with open(os.path.join(hf, shard), "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(ConfigError, match="changed since the adapters were trained"):
        export(str(checkpoints), str(tmp_path / "exported-again"))
    assert not (tmp_path / "exported-again").exists()

    # A damaged base record, through bridge-hf export: one line naming the file, exit 2, nothing written.
    # (Padded to its size: a record of another size fails the checkpoint's manifest first, also exit 2.)
    record = checkpoints / "iter_0000003" / "peft_base.json"
    size = len(record.read_bytes())
    for damage in ("{not json", '{"peft": "lora"}'):
        record.write_text(damage.ljust(size))
        proc = run_module("bridge_hpc.cli.hf", ["export", str(checkpoints), str(tmp_path / "exported-damaged")],
                          timeout=300)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert str(record) in lines[-1] and lines[-1].startswith("error: "), lines[-1]
        assert not (tmp_path / "exported-damaged").exists()
