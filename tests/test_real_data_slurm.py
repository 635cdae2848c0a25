"""Real indexed data through a preemption, end to end on the local cluster.

A small corpus (docstrings of standard-library functions and classes, text already on the machine) is
prepared by the ``bridge-prepare-data`` command into two megatron-core indexed datasets. The demo's tiny
GPT then trains on a 0.7/0.3 blend of both with 2 ranks in a Slurm job, which is preempted mid-run with
``scancel --signal=USR1``, requeues itself and finishes. Its losses, grad norms and final parameters must
equal bit for bit those of the same config trained in one go, and the progress log must show that the
second run resumed from the checkpoint the first one wrote when it stopped (not from the start), so an
equality cannot come from a run that was never interrupted. One dataset alone (no blend: megatron-core's
GPTDataset itself) is stopped and resumed the same way by two runs of the ranks, without Slurm, whose
part in the resume the blend's job covers.
"""

from __future__ import annotations

import argparse
import asyncio.base_events
import asyncio.streams
import collections
import configparser
import csv
import datetime
import email.message
import functools
import http.client
import inspect
import itertools
import json
import logging
import os
import pathlib
import re
import shutil
import string
import subprocess
import sys
import tarfile
import textwrap
import typing
import unittest.case
import urllib.request
import zipfile
from pathlib import Path
from typing import Dict, List

import pytest
import toml
from bridge_test_helpers import (
    CONFIG,
    ROOT,
    assert_bitwise_equal,
    drive,
    job_story,
    log_text,
    losses,
    model_params,
    overrides,
    reference_run,
    sacct_runs,
    submit_cli,
    wait_running_past,
)

from bridge_hpc.contracts.progress_log import ENDING_JOB, LOADED_CHECKPOINT, parse_progress
from bridge_hpc.contracts.run_folder import DATASET_CACHE_DIR, METRICS_FILE
from bridge_hpc.training.engine.metrics import read_metrics

pytestmark = [pytest.mark.slow]

ITERS = 300  # about 15 s of training on 2 CPU ranks: the signal lands well before the end
PREEMPT_AT = 40  # past the first periodic checkpoint (save_interval 25), well before the end
#: train/valid/test shares of each dataset's documents (few documents: Megatron's default leaves test none)
SPLIT, TRAIN_SHARE = "90,5,5", 0.9
#: The modules whose public functions' and classes' docstrings make the corpus.
MODULES = (argparse, asyncio.base_events, asyncio.streams, collections, configparser, csv, datetime, email.message,
           functools, http.client, inspect, itertools, json, logging, os, pathlib, re, shutil, string, subprocess,
           tarfile, textwrap, typing, unittest.case, urllib.request, zipfile)


def _documents() -> List[str]:
    """One document per docstring of a public function, class or method of :data:`MODULES`, in a fixed order."""
    docs = []
    for module in MODULES:
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            members = [obj] + ([m for n, m in sorted(vars(obj).items()) if inspect.isfunction(m) and not n.startswith("_")]
                               if inspect.isclass(obj) else [])
            docs += [m.__doc__.strip() for m in members if m.__doc__ and m.__doc__.strip()]
    return list(dict.fromkeys(docs))  # each text once


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> Dict[str, str]:
    """The corpus split into shards ``a`` and ``b``, prepared by the ``bridge-prepare-data`` command:
    shard name -> dataset prefix (from the ``[dataset]`` snippet it prints)."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = _documents()
    for shard, part in (("a", docs[0::2]), ("b", docs[1::2])):
        (folder / f"{shard}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    command = shutil.which("bridge-prepare-data")
    argv = [command] if command else [sys.executable, "-m", "bridge_hpc.cli.prepare_data"]
    result = subprocess.run([*argv, "--input", str(folder / "a.jsonl"), str(folder / "b.jsonl"),
                             "--output-prefix", str(folder / "docstrings"), "--tokenizer-type", "ByteLevelTokenizer",
                             "--append-eod"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    data_path = toml.loads(result.stdout)["dataset"]["data_path"]
    assert data_path == [str(folder / f"docstrings_{s}_text_document") for s in ("a", "b")]
    manifest = json.loads((folder / "docstrings.manifest.json").read_text())
    # Enough text that the training split of each shard holds the whole run's samples: the run
    # reads real text, not one short document over and over.
    demo = toml.load(CONFIG)
    run_tokens = ITERS * demo["train"]["global_batch_size"] * demo["model"]["seq_length"]
    assert all(TRAIN_SHARE * s["outputs"]["text"]["tokens"] > run_tokens for s in manifest["shards"]), manifest["shards"]
    return dict(zip("ab", data_path))


def _job_config(folder: Path, data_path: List[str]) -> Path:
    """The demo config (configs/local-tiny.toml) on prepared data with its byte-level tokenizer."""
    job = folder / "job.toml"
    job.write_text(toml.dumps({
        "extends": str(CONFIG),
        "job": {"name": "real-data"},
        # the model's vocabulary follows the tokenizer's (258, padded to 384), not the demo's 128
        "tokenizer": {"tokenizer_type": "ByteLevelTokenizer", "use_tokenizer_vocab_size": True},
        "dataset": {"data_path": data_path, "split": SPLIT},
    }))
    return job


def _submit(job: Path, run_dir: Path) -> str:
    args = [str(job)]
    for item in overrides(run_dir, ITERS):
        args += ["--set", item]
    proc = submit_cli(*args, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()[2]


def _train_dataset(run_dir: Path) -> dict:
    """megatron-core's description of the training dataset a run read (the blend when there is one), from
    the index cache in its run folder."""
    cache = run_dir / DATASET_CACHE_DIR
    found = sorted(cache.glob("*-BlendedDataset-train-description.txt")) or \
        sorted(cache.glob("*-GPTDataset-train-description.txt"))
    assert len(found) == 1, sorted(p.name for p in cache.iterdir())
    return json.loads(found[0].read_text())


def _assert_same_training(run_dir: Path, reference: Path, iters: int, scratch: Path, log: str = "") -> None:
    """Bit for bit the uninterrupted run: every step once, same losses, grad norms and final parameters."""
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == list(range(1, iters + 1)), log[-4000:]
    assert got == want
    got_metrics, want_metrics = read_metrics(str(run_dir / METRICS_FILE)), read_metrics(str(reference / METRICS_FILE))
    assert {s: r["grad_norm"] for s, r in got_metrics.items()} == {s: r["grad_norm"] for s, r in want_metrics.items()}
    final = f"iter_{iters:07d}"
    assert_bitwise_equal(model_params(str(run_dir / "checkpoints" / final), str(scratch)),
                         model_params(str(reference / "checkpoints" / final), str(scratch)))


#: The one-dataset runs: stopped by ``exit_interval`` at the middle, resumed to the end.
ONE_DATASET_ITERS = 60


def test_one_prepared_dataset_stopped_and_resumed_is_bitwise(prefixes, tmp_path):
    job = _job_config(tmp_path, [prefixes["a"]])
    reference = reference_run(tmp_path / "reference", ONE_DATASET_ITERS, config=job)
    run_dir = tmp_path / "run"
    for _ in range(2):
        reference_run(run_dir, ONE_DATASET_ITERS, config=job, extra=[f"train.exit_interval={ONE_DATASET_ITERS // 2}"])
    runs = parse_progress(str(run_dir / "checkpoints" / "progress.txt"))
    assert [r.last(ENDING_JOB).fields["Reason"] for r in runs] == ["interval", "done"]
    assert int(runs[1].last(LOADED_CHECKPOINT).fields["Iteration"]) == ONE_DATASET_ITERS // 2
    for folder in (run_dir, reference):
        train = _train_dataset(folder)
        assert train["class"] == "GPTDataset" and train["dataset_path"] == prefixes["a"]
    _assert_same_training(run_dir, reference, ONE_DATASET_ITERS, tmp_path)


@pytest.mark.slurm
def test_usr1_preemption_on_prepared_data_resumes_bitwise(slurm_cluster, prefixes, tmp_path):
    data_path = ["0.7", prefixes["a"], "0.3", prefixes["b"]]
    job = _job_config(tmp_path, data_path)
    reference = reference_run(tmp_path / "reference", ITERS, config=job)

    run_dir = tmp_path / "run"
    job_id = _submit(job, run_dir)
    wait_running_past(job_id, run_dir, PREEMPT_AT)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    assert drive(job_id) == "COMPLETED"
    log = log_text(run_dir, job_id)

    # Slurm ran it twice: preempted, requeued by its batch script, finished.
    assert sacct_runs(job_id) == ["REQUEUED", "COMPLETED"] and "requeueing" in log, job_story(run_dir, job_id)
    runs = parse_progress(str(run_dir / "checkpoints" / "progress.txt"))
    assert len(runs) == 2, job_story(run_dir, job_id)
    first_end = runs[0].last(ENDING_JOB)
    assert first_end.fields["Reason"] == "signal" and first_end.fields["Steps lost"] == "0", first_end
    stopped_at = int(first_end.fields["Iteration"])
    assert PREEMPT_AT <= stopped_at < ITERS
    # the second run loaded exactly the step the first stopped at, and Slurm's restart count reached it
    assert int(runs[1].last(LOADED_CHECKPOINT).fields["Iteration"]) == stopped_at
    assert runs[1].restart_count == 1 and runs[1].last(ENDING_JOB).fields["Reason"] == "done"

    # Both trained on the prepared data: megatron-core's description of the training dataset it built
    for folder in (run_dir, reference):
        train = _train_dataset(folder)
        assert train["class"] == "BlendedDataset" and train["weights"] == [0.7, 0.3]
        assert [d["dataset_path"] for d in train["datasets"]] == [prefixes["a"], prefixes["b"]]
    _assert_same_training(run_dir, reference, ITERS, tmp_path, log)
