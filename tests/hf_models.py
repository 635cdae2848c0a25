"""Small random Hugging Face checkpoints of each supported family, made with transformers (nothing is
downloaded), and the toolkit's model built from one: what the tests of bridge_hpc.models.hf share.

Weights are drawn with a large ``initializer_range`` and the norms and biases moved off their
initial ones/zeros, so a wrong mapping (a swapped key head, a missed rope scaling, an untransposed
Conv1D) changes the logits by far more than the parity tolerance (checked in test_hf_import)."""

from __future__ import annotations

import os
from typing import Dict

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
#: The Mixture-of-Experts families: Qwen3-MoE (a dense layer among expert layers, renormalized top-k),
#: Mixtral, Qwen2-MoE (a gated shared expert, top-k of the full softmax).
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
VOCAB = 100
SEQ = 16
#: A three-step fine-tuning job from the Hugging Face folder ``hf`` (``.format(seq=SEQ, hf=...)``).
FINETUNE_JOB = """
[job]
entry = "finetune"
[train]
train_iters = 3
global_batch_size = 2
micro_batch_size = 2
[optimizer]
lr = 0.01
[model]
seq_length = {seq}
hidden_dropout = 0.0
attention_dropout = 0.0
[dataset]
seq_length = {seq}
[checkpoint]
pretrained_checkpoint = "{hf}"
"""


def hf_config(family: str):
    import transformers as T

    common = dict(initializer_range=0.3, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    if family == "llama":  # Llama 3.1's rope scaling, untied output
        return T.LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    if family == "mistral":
        return T.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":  # qkv bias, tied
        return T.Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":  # qk-norm, head_dim != hidden / heads
        return T.Qwen3Config(**common, head_dim=32)
    moe = dict(common, num_hidden_layers=3, num_experts_per_tok=2)
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), probabilities renormalized over the top k
        return T.Qwen3MoeConfig(**moe, head_dim=32, num_experts=4, moe_intermediate_size=32, mlp_only_layers=[1],
                                norm_topk_prob=True)
    if family == "mixtral":
        return T.MixtralConfig(**dict(moe, intermediate_size=32), num_local_experts=4, sliding_window=None)
    if family == "qwen2_moe":  # a shared expert with its sigmoid gate, qkv bias, the full softmax's top k
        return T.Qwen2MoeConfig(**moe, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                norm_topk_prob=False)
    return T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, initializer_range=0.3,
                        bos_token_id=0, eos_token_id=0)


def make_hf_model(family: str, folder: str, seed: int = 0):
    """A random ``family`` model saved to ``folder`` (model.safetensors, config.json); returns it in eval mode."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(hf_config(family))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    return model.eval()


def make_hf_folders(root, families) -> Dict[str, str]:
    """A random model of each of ``families`` saved under the folder ``root``: family -> its folder."""
    folders = {family: os.path.join(str(root), family) for family in families}
    for family, folder in folders.items():
        make_hf_model(family, folder)
    return folders


def model_config(folder: str, **extra):
    """The finalized GPTModelConfig ``[model] hf_config = folder`` gives (dropout off)."""
    from bridge_hpc.training.config import GPTModelConfig
    from bridge_hpc.training.hf import families

    section = {"hf_config": folder, "seq_length": SEQ, "hidden_dropout": 0.0, "attention_dropout": 0.0, **extra}
    filled, _ = families.fill_model_section(section, folder)
    cfg = GPTModelConfig(**filled)
    cfg.finalize()
    return cfg


def batch(seed: int = 1) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    return {"tokens": tokens, "position_ids": torch.arange(SEQ).unsqueeze(0).expand(2, -1)}


def hf_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    import transformers as T

    os.environ["HF_HUB_OFFLINE"] = "1"
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def add_tokenizer(folder: str) -> None:
    """A small byte-level BPE tokenizer trained here on a few sentences, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:80])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)


def safetensors_in(folder: str) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``folder``, by name."""
    from safetensors.torch import load_file

    out = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out
