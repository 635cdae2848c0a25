"""LoRA as users run it today without this toolkit: Hugging Face ``transformers`` + ``peft`` on one GPU.

The comparison row of ``benchmarks/peft.py --base llama`` (issue 35): the same Hugging Face folder, LoRA
of the same rank ``--dim`` and ``--alpha``, no dropout, on the same projections as peft users name them
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``). The toolkit,
as Megatron Bridge, adapts the fused ``linear_qkv`` and ``linear_fc1`` with one adapter each where peft
has one each for q, k, v and for gate, up: peft trains more adapter parameters (rank 16 on Llama 3.2 1B's
shape: 704,512 a layer against 606,208, 16 % more; peft's count is in the JSON). The same tokens a step
(global batch of ``--global-batch`` sequences of ``--seq-length`` tokens, in micro-batches of
``--micro-batch`` with gradient accumulation), random tokens as the toolkit's mock data. The loop is the plain one of peft's
own examples: the base in bf16 (``--device cuda``; fp32 on CPU), peft's adapters in fp32 (its default
``autocast_adapter_dtype``), ``torch.optim.AdamW`` (fused on a GPU) over the adapters, the model's own
loss (transformers' default attention, SDPA), no gradient checkpointing.

Measured: tokens/s (the median of the steps after the first ``--warmup``, each step timed from its first
micro-batch to the optimizer step, the GPU synchronized) and ``torch.cuda.max_memory_allocated`` at the
end, the peak since the process started, loading included, in 10^9 bytes (as the toolkit's
``mem-max-allocated-gigabytes``). Writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# Python puts this script's folder first on the path, and ``benchmarks/peft.py`` there would stand in for the
# ``peft`` package: the folder is taken off (this script imports nothing from it).
HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]

#: peft's names of the projections the toolkit's four LoRA targets cover in a Llama-family model.
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True, help="a Hugging Face folder (config.json, *.safetensors)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--alpha", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--json", required=True, help="where the result goes")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must be more than --warmup")
    if args.global_batch % args.micro_batch:
        p.error("--global-batch must be a multiple of --micro-batch")

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU here")
    device = torch.device("cuda" if gpu else "cpu")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if gpu else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype)
    except TypeError:  # transformers before the `dtype` argument (about 4.56)
        model = AutoModelForCausalLM.from_pretrained(args.folder, torch_dtype=dtype)
    if model.dtype != dtype:
        raise SystemExit(f"transformers loaded the model in {model.dtype}, not {dtype}")
    model.config.use_cache = False
    model.to(device)
    model = get_peft_model(model, LoraConfig(r=args.dim, lora_alpha=args.alpha, lora_dropout=0.0,
                                             target_modules=HF_TARGETS, bias="none", task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, **({"fused": True} if gpu else {}))
    vocab = model.config.vocab_size
    accumulation = args.global_batch // args.micro_batch
    generator = torch.Generator(device=device).manual_seed(0)

    records = []
    for step in range(1, args.steps + 1):
        if gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        total = 0.0
        for _ in range(accumulation):
            tokens = torch.randint(vocab, (args.micro_batch, args.seq_length), device=device, generator=generator)
            loss = model(input_ids=tokens, labels=tokens).loss / accumulation
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        step_s = time.perf_counter() - started
        records.append({"step": step, "step_time_s": step_s, "loss": float(total),
                        "tokens_per_s": args.global_batch * args.seq_length / step_s})
        print(f"[hf-peft] step {step}/{args.steps}: {step_s:.3f} s, loss {float(total):.4f}", flush=True)

    steady = [r for r in records if r["step"] > args.warmup]
    result = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
              "step_s": statistics.median(r["step_time_s"] for r in steady), "steps_timed": len(steady),
              "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if gpu else None,
              "final_loss": records[-1]["loss"], "trainable_parameters": sum(p.numel() for p in trainable),
              "targets": HF_TARGETS, "records": records,
              "versions": {"torch": torch.__version__, "transformers": sys.modules["transformers"].__version__,
                           "peft": sys.modules["peft"].__version__}}
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
