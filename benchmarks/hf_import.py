"""Hugging Face import speed: a Llama-shaped folder of random weights (made here, nothing downloaded).

CPU (always): the time the toolkit's import takes to read the folder into the model
(:func:`bridge_hpc.training.hf.load.load_hf_weights`: every tensor sliced, put into megatron-core's layout
and copied into the parameters) against reading the same safetensors bytes with safetensors' own
``load_file`` (each tensor cloned: it maps the file and reads lazily); each is run ``--repeats``
times, alternating, page cache warm, the best time kept.
Target (issue 29): within 1.5x.

GPU (``--gpu``, on one GPU): the time from the start of a one-step fine-tuning job's process to its
first step in metrics.jsonl, from the Hugging Face folder against the same job from a megatron-core
checkpoint of the same weights (made with ``bridge-hf import`` on the same GPU). Target: within 1.3x.

The default shape is Llama 3.2 1B's (hidden 2048, 16 layers, 32 heads, 8 KV groups, FFN 8192, vocabulary
128256, tied: 1.24 B parameters, bf16 on disk); ``--tiny`` makes a small one for smoke tests. Prints a
table and writes JSON (default ``benchmarks/results/hf_import.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"1b": dict(hidden=2048, layers=16, heads=32, groups=8, ffn=8192, vocab=128256),
          "tiny": dict(hidden=128, layers=2, heads=4, groups=2, ffn=256, vocab=1000)}


def make_folder(folder: Path, shape: dict) -> int:
    """A random Llama-shaped Hugging Face folder (config.json, model.safetensors in bf16); returns its bytes."""
    import torch
    from safetensors.torch import save_file

    from bridge_hpc.training.hf import families, mapping

    model = {"hidden_size": shape["hidden"], "num_layers": shape["layers"], "num_attention_heads": shape["heads"],
             "num_query_groups": shape["groups"], "ffn_hidden_size": shape["ffn"], "vocab_size": shape["vocab"],
             "kv_channels": shape["hidden"] // shape["heads"], "share_embeddings_and_output_weights": True,
             "max_position_embeddings": 4096, "layernorm_epsilon": 1e-5, "rotary_base": 500000,
             "rope_scaling": True, "rope_scaling_factor": 32.0, "attention_dropout": 0.0, "hidden_dropout": 0.0,
             "init_method_std": 0.02, "normalization": "RMSNorm", "activation_func": "swiglu",
             "add_bias_linear": False, "position_embedding_type": "rope"}
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(size, generator=generator) * 0.02).to(torch.bfloat16)
               for name, size in mapping.hf_shapes("llama", model).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(families.hf_config(model, None, "bfloat16"), indent=2))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def cpu_import(folder: Path, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from safetensors.torch import load_file

    from bridge_hpc.training.engine.model import gpt_model_provider
    from bridge_hpc.training.hf import load, mapping

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if torch.cuda.is_available():  # megatron-core initializes GPU weights under its model-parallel RNG
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = mapping.checked_model_config(str(folder))
    cfg.bf16 = True  # the parameters in the checkpoint's dtype: no cast in either reader
    started = time.perf_counter()
    model = gpt_model_provider(cfg)
    build = time.perf_counter() - started
    files = [str(p) for p in sorted(folder.glob("*.safetensors"))]
    ours, theirs = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        for path in files:
            # load_file maps the file and reads lazily: the clones read every byte, as the import does
            state = {name: tensor.clone() for name, tensor in load_file(path).items()}
        theirs.append(time.perf_counter() - started)
        del state
        started = time.perf_counter()
        read = load.load_hf_weights(str(folder), [model])
        ours.append(time.perf_counter() - started)
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"parameters": params, "bytes": read, "model_build_s": build, "import_s": min(ours),
            "safetensors_load_file_s": min(theirs), "ratio": min(ours) / min(theirs), "target_ratio": 1.5,
            "all_import_s": ours, "all_load_file_s": theirs}


JOB = """
[job]
entry = "finetune"
run_dir = "{run_dir}"
[slurm]
gpus_per_node = 1
[train]
train_iters = 1
global_batch_size = 1
micro_batch_size = 1
[optimizer]
lr = 1e-5
[logger]
log_interval = 1
[model]
hf_config = "{hf}"
seq_length = 1024
bf16 = true
[mixed_precision]
bf16 = true
[dataset]
seq_length = 1024
[checkpoint]
pretrained_checkpoint = "{start}"
save_interval = 1000000
"""


def first_step_s(work: Path, name: str, hf: Path, start: Path) -> float:
    """Seconds from the start of a one-rank fine-tuning job's process to its first step in metrics.jsonl."""
    run_dir = work / name
    job = work / f"{name}.toml"
    job.write_text(JOB.format(run_dir=run_dir, hf=hf, start=start))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bridge_hpc.rank", str(job)], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    output = proc.communicate(timeout=900)[0]
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{output[-4000:]}")
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a small model (smoke test)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpu", action="store_true", help="also the start-to-first-step comparison on one GPU")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "hf_import.json"))
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="hf_import_"))
    shape = SHAPES["tiny" if args.tiny else "1b"]
    try:
        hf = work / "hf"
        started = time.perf_counter()
        size = make_folder(hf, shape)
        results = {"shape": shape, "folder_bytes": size, "make_folder_s": time.perf_counter() - started}
        results["cpu"] = cpu_import(hf, args.repeats)
        if args.gpu:
            ckpt = work / "mcore"
            subprocess.run([sys.executable, "-m", "bridge_hpc.cli.hf", "import", str(hf), str(ckpt)], check=True)
            from_mcore = first_step_s(work, "from_mcore", hf, ckpt)
            from_hf = first_step_s(work, "from_hf", hf, hf)
            results["gpu"] = {"from_hf_s": from_hf, "from_mcore_checkpoint_s": from_mcore,
                              "ratio": from_hf / from_mcore, "target_ratio": 1.3}
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    cpu = results["cpu"]
    print(f"{'what':<44}{'seconds':>10}")
    print(f"{'safetensors load_file (same bytes)':<44}{cpu['safetensors_load_file_s']:>10.2f}")
    print(f"{'bridge_hpc import (load_hf_weights)':<44}{cpu['import_s']:>10.2f}")
    print(f"{'  ratio (target <= 1.5)':<44}{cpu['ratio']:>10.2f}")
    if "gpu" in results:
        g = results["gpu"]
        print(f"{'first step from megatron-core checkpoint':<44}{g['from_mcore_checkpoint_s']:>10.2f}")
        print(f"{'first step from Hugging Face folder':<44}{g['from_hf_s']:>10.2f}")
        print(f"{'  ratio (target <= 1.3)':<44}{g['ratio']:>10.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
