"""Training tokens/s on a megatron-core indexed dataset against mock data of the same shape.

The question is whether reading real data (memory-mapped ``.bin``/``.idx`` shards through
megatron-core's ``GPTDataset`` and the blend builder, plus the dataloader's workers) ever starves
the GPU. Both runs train the same GPT with the same batch shape, through the same entry point
(``torchrun -m bridge_hpc.rank``); only ``[dataset]`` differs:

- **mock**: ``MockGPTDatasetConfig`` (no files);
- **indexed**: ``GPTDatasetConfig`` over shards made by ``bridge-prepare-data`` from a generated
  jsonl corpus (``NullTokenizer``: a document is space-separated ids drawn at random with lengths
  spread like real documents, so samples cross document boundaries as they do in a real corpus).

The runs alternate (mock, indexed, mock, indexed, ...) so that a drift of the machine hits both,
and each run's figure is the median tokens/s of its steps after a warm-up, from ``metrics.jsonl``.
Target: indexed / mock >= 0.99. The default shape is the issue's: a 370 M GPT (24 layers, hidden
1024, 16 heads, vocab 32768), seq 2048 x micro-batch 8, bf16, adam, on one GPU; ``--tiny`` runs a
small model on CPU, to check the script itself.

Run: ``python benchmarks/indexed_vs_mock.py [--steps 60] [--repeats 2] [--json out.json]``. It is
part 3 of ``benchmarks/prepare_data.py`` and runs on its own where there is a GPU but no Slurm.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent

#: The issue's model: 370 M parameters at vocab 32768.
GPT_370M = {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "vocab_size": 32768,
            "seq_length": 2048, "micro_batch_size": 8}
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512, "seq_length": 128,
        "micro_batch_size": 4}


def write_corpus(path: Path, tokens: int, vocab: int, seed: int = 0) -> int:
    """A jsonl of NullTokenizer documents (ids < ``vocab - 1``: the last id is the EOD token) holding
    about ``tokens`` ids; lengths are log-normal around 700 ids, clipped to [16, 8000]."""
    rng = random.Random(seed)
    written = documents = 0
    with open(path, "w") as f:
        while written < tokens:
            n = int(min(8000, max(16, rng.lognormvariate(6.5, 0.9))))
            f.write(json.dumps({"text": " ".join(str(rng.randrange(vocab - 1)) for _ in range(n))}) + "\n")
            written += n + 1
            documents += 1
    return documents


def job_toml(shape: Dict[str, int], steps: int, run_dir: Path, dataset: str, gpu: bool) -> str:
    precision = "bf16 = true\n" if gpu else ""
    return f"""[job]
name = "indexed-vs-mock"
run_dir = "{run_dir}"

[train]
train_iters = {steps}
micro_batch_size = {shape["micro_batch_size"]}
global_batch_size = {shape["micro_batch_size"]}

[model]
num_layers = {shape["num_layers"]}
hidden_size = {shape["hidden_size"]}
num_attention_heads = {shape["num_attention_heads"]}
vocab_size = {shape["vocab_size"]}
seq_length = {shape["seq_length"]}
hidden_dropout = 0.0
attention_dropout = 0.0
share_embeddings_and_output_weights = false
{precision}
[optimizer]
optimizer = "adam"
lr = 1e-4
{precision}
[ddp]
grad_reduce_in_fp32 = true

[logger]
log_interval = 10

[checkpoint]
save_interval = 1000000

{dataset}"""


def mock_section(shape: Dict[str, int]) -> str:
    return f"[dataset]\nseq_length = {shape['seq_length']}\n"


def indexed_section(shape: Dict[str, int], prefix: str) -> str:
    return (f'[tokenizer]\ntokenizer_type = "NullTokenizer"\nvocab_size = {shape["vocab_size"] - 1}\n\n'
            f'[dataset]\nseq_length = {shape["seq_length"]}\ndata_path = ["{prefix}"]\nsplit = "100,0,0"\n')


def median_tokens_per_s(metrics: Path, warmup: int) -> float:
    rates = [r["tokens_per_s"] for r in map(json.loads, metrics.read_text().splitlines())
             if r["step"] > warmup and r.get("tokens_per_s")]
    if not rates:
        raise SystemExit(f"{metrics}: no steps after the {warmup} warm-up steps")
    return statistics.median(rates)


def train(job: Path, run_dir: Path, warmup: int) -> float:
    cmd = ["torchrun", "--standalone", "--nproc-per-node=1", "-m", "bridge_hpc.rank", str(job)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return median_tokens_per_s(run_dir / "metrics.jsonl", warmup)


def prepare(corpus: Path, prefix: Path, vocab: int, workers: int) -> str:
    cmd = [sys.executable, "-m", "bridge_hpc.cli.prepare_data", "--input", str(corpus), "--output-prefix",
           str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1), "--append-eod",
           "--workers", str(workers)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bridge-prepare-data failed:\n{proc.stderr[-4000:]}")
    return f"{prefix}_{corpus.stem}_text_document"


def run(steps: int, warmup: int, repeats: int, tiny: bool, tmp: Path) -> Dict[str, object]:
    import torch

    gpu = torch.cuda.is_available() and not tiny
    shape = TINY if tiny else GPT_370M
    needed = steps * shape["micro_batch_size"] * (shape["seq_length"] + 1)
    corpus = tmp / "corpus.jsonl"
    start = time.perf_counter()
    documents = write_corpus(corpus, int(needed * 1.5), shape["vocab_size"])
    prefix = prepare(corpus, tmp / "data" / "bench", shape["vocab_size"], max(1, min(8, os.cpu_count() or 1)))
    print(f"[indexed-vs-mock] corpus: {documents} documents, ~{int(needed * 1.5):,} tokens, prepared in "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    sections = {"mock": mock_section(shape), "indexed": indexed_section(shape, prefix)}
    rates: Dict[str, List[float]] = {"mock": [], "indexed": []}
    for i in range(repeats):
        for kind, section in sections.items():
            run_dir = tmp / f"{kind}{i}"
            job = tmp / f"{kind}{i}.toml"
            job.write_text(job_toml(shape, steps, run_dir, section, gpu))
            rates[kind].append(train(job, run_dir, warmup))
            print(f"[indexed-vs-mock] {kind} run {i + 1}/{repeats}: {rates[kind][-1]:,.0f} tokens/s", file=sys.stderr)
    mock, indexed = statistics.median(rates["mock"]), statistics.median(rates["indexed"])
    device = torch.cuda.get_device_name() if gpu else "cpu"
    return {"device": device, "shape": shape, "steps": steps, "warmup": warmup, "runs": rates,
            "mock_tokens_per_s": mock, "indexed_tokens_per_s": indexed, "ratio": indexed / mock, "target": 0.99}


def table_row(result: Dict[str, object]) -> tuple:
    return (f"training on indexed vs mock data ({result['device']})",
            f"{result['indexed_tokens_per_s']:,.0f} vs {result['mock_tokens_per_s']:,.0f} tokens/s",
            result["ratio"], result["target"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="steps per run (default 60)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of each run's median (default 10)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternating (default 2)")
    p.add_argument("--tiny", action="store_true", help="a small model on CPU: checks the script, not the loader")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        result = run(args.steps, args.warmup, args.repeats, args.tiny, Path(tmp))
    name, figures, ratio, target = table_row(result)
    print(f"| what | measured | ratio | target |\n| --- | --- | --- | --- |\n"
          f"| {name} | {figures} | {ratio:.3f}x | >= {target}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
