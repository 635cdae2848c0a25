"""bridge-prepare-data throughput, as ratios measured within one run on the same cores.

1. **prepare vs bare tokenizer** — ``prepare_local`` with ``--workers W`` (read jsonl, tokenize, write
   ``.bin``/``.idx``, checksums) against the bare tokenizer encoding the same documents in batches
   with ``W`` processes (no files). Target: >= 0.9x.
2. **2 array tasks vs 1** — the same corpus as one input (an array of 1 task) and split in two
   (2 tasks), each through ``bridge-prepare-data --slurm --wait`` on the local cluster with 1 worker
   per task. Time is Slurm's: from the first task's start to the last task's end (sacct), so
   submission and the final step do not count. Target: >= 1.8x on 2 cores.

Prints a table and writes JSON (``--json``). The corpus is the standard library's docstrings,
repeated; nothing is downloaded. Run: ``python benchmarks/prepare_data.py [--mb 40] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import multiprocessing
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bridge_hpc.data import prepare  # noqa: E402
from bridge_hpc.training.config import TokenizerConfig  # noqa: E402
from bridge_hpc.training.tokenizers import build_tokenizer  # noqa: E402

TOKENIZER = "ByteLevelTokenizer"


def docstrings() -> List[str]:
    import importlib

    out = []
    for info in pkgutil.iter_modules():
        if info.name.startswith("_") or info.name in ("antigravity", "this", "idlelib", "tkinter", "turtle"):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - any module that fails to import is just left out
            continue
        doc = inspect.getdoc(module)
        if doc:
            out.append(doc)
        if len(out) >= 200:
            break
    return out


def write_corpus(path: Path, docs: List[str], target_bytes: int) -> int:
    """jsonl of ``docs`` repeated until about ``target_bytes``; returns the number of documents."""
    n = 0
    with open(path, "w") as f:
        while f.tell() < target_bytes:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
                n += 1
    return n


def _tokenizer_cfg() -> TokenizerConfig:
    cfg = TokenizerConfig(tokenizer_type=TOKENIZER)
    cfg.finalize()
    return cfg


_TOK = {}


def _init() -> None:
    _TOK["t"] = build_tokenizer(_tokenizer_cfg())


def _encode_batch(texts: List[str]) -> int:
    tok = _TOK["t"]
    return sum(len(tok.tokenize(t)) + 1 for t in texts)


def bare_tokens_per_s(path: Path, workers: int) -> float:
    """The tokenizer alone: documents already in memory, encoded in batches by ``workers`` processes."""
    texts = [json.loads(line)["text"] for line in open(path)]
    batches = [texts[i:i + prepare.CHUNK_LINES] for i in range(0, len(texts), prepare.CHUNK_LINES)]
    with multiprocessing.Pool(workers, initializer=_init) as pool:
        start = time.perf_counter()
        tokens = sum(pool.imap(_encode_batch, batches))
        return tokens / (time.perf_counter() - start)


def prepare_tokens_per_s(path: Path, out: Path, workers: int) -> float:
    start = time.perf_counter()
    records = prepare.prepare_local([str(path)], str(out), _tokenizer_cfg(), ["text"], True, workers,
                                    progress=prepare.Progress(open(os.devnull, "w"), interval=1e9))
    return sum(r.tokens for r in records) / (time.perf_counter() - start)


def _stamp(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()


def array_seconds(inputs: List[Path], out: Path, job: Path) -> float:
    """Slurm's time for the array job: first task start to last task end."""
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.prepare_data", "--input", *map(str, inputs),
                           "--output-prefix", str(out), "--tokenizer-type", TOKENIZER, "--append-eod",
                           "--slurm", str(job), "--wait"], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"bridge-prepare-data --slurm failed:\n{proc.stderr}")
    array_id = proc.stderr.split("submitted array job ")[1].split(":")[0]
    rows = subprocess.run(["sacct", "-n", "-P", "-X", "-j", array_id, "-o", "JobID,Start,End,State"],
                          capture_output=True, text=True).stdout.split()
    spans = [r.split("|") for r in rows if r.split("|")[0].startswith(f"{array_id}_")]
    return max(_stamp(s[2]) for s in spans) - min(_stamp(s[1]) for s in spans)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=40.0, help="corpus size in MB (default 40)")
    p.add_argument("--workers", type=int, default=2, help="processes for part 1 (default 2: the cores)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--skip-slurm", action="store_true", help="part 1 only")
    args = p.parse_args()
    results: Dict[str, object] = {"cores": os.cpu_count(), "corpus_mb": args.mb, "tokenizer": TOKENIZER}
    docs = docstrings()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp_path = Path(tmp)
        whole = tmp_path / "whole.jsonl"
        n_docs = write_corpus(whole, docs, int(args.mb * 1e6))
        bare = bare_tokens_per_s(whole, args.workers)
        prep = prepare_tokens_per_s(whole, tmp_path / "local" / "c", args.workers)
        results["prepare_vs_bare"] = {"workers": args.workers, "documents": n_docs, "bare_tokens_per_s": bare,
                                      "prepare_tokens_per_s": prep, "ratio": prep / bare, "target": 0.9}
        rows = [("prepare-data vs bare tokenizer", f"{prep:,.0f} vs {bare:,.0f} tokens/s", prep / bare, 0.9)]
        if not args.skip_slurm:
            job = tmp_path / "job.toml"
            job.write_text(f'extends = "{ROOT / "configs" / "clusters" / "local.toml"}"\n[job]\nname = "bench"\n'
                           f'run_dir = "{tmp_path / "run"}"\n[slurm]\ntime = "00:20:00"\n[train]\ntrain_iters = 1\n'
                           "micro_batch_size = 1\nglobal_batch_size = 1\n[optimizer]\nlr = 1e-3\n")
            lines = whole.read_text().splitlines(keepends=True)
            halves = [tmp_path / "half0.jsonl", tmp_path / "half1.jsonl"]
            halves[0].write_text("".join(lines[: len(lines) // 2]))
            halves[1].write_text("".join(lines[len(lines) // 2:]))
            one = array_seconds([whole], tmp_path / "one" / "c", job)
            two = array_seconds(halves, tmp_path / "two" / "c", job)
            results["array_2_vs_1"] = {"one_task_s": one, "two_tasks_s": two, "speedup": one / two, "target": 1.8}
            rows.append(("2 array tasks vs 1", f"{one:.0f} s vs {two:.0f} s", one / two, 1.8))
    print(f"{'measure':34} {'values':34} {'ratio':>6} {'target':>7}")
    for name, values, ratio, target in rows:
        print(f"{name:34} {values:34} {ratio:6.2f} {'>=' + str(target):>7} {'ok' if ratio >= target else 'BELOW'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
