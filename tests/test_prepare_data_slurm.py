"""``bridge-prepare-data --slurm`` on the local cluster: an array job (one task per input) plus the final step.

The output is read back through megatron-core's ``IndexedDataset`` and compared token for token with
tokenizing the same documents directly (byte-level tokenizer, + EOD). One array task is cancelled
midway (a large input, ``scancel JOBID_1`` once its temporary file exists); the final step then names
the missing shard, and the same command run again redoes only that shard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import toml
from bridge_test_helpers import MINIMAL_TRAINING_TOML, ROOT
from test_prepare_data import byte_level, documents, expected, read_back

from bridge_hpc.prepare import shards as prepare
from bridge_hpc.prepare import slurm_plan

pytestmark = pytest.mark.slurm

#: Copies of the corpus (each document cut to its first characters) in the large input: many short
#: documents, so that its task runs for several seconds (the byte-level tokenizer's cost is per document).
BIG_COPIES = 80000
BIG_CHARS = 60


def job_toml(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f'extends = "{ROOT / "configs" / "clusters" / "local.toml"}"\n\n[job]\nname = "prep-test"\n'
                    f'run_dir = "{tmp_path / "run"}"\n\n[slurm]\ntime = "00:05:00"\n' + MINIMAL_TRAINING_TOML)
    return path


def write_jsonl(path: Path, docs: List[str]) -> None:
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "i": i}) + "\n")


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bridge_hpc.cli.prepare_data", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def submitted_ids(proc: subprocess.Popen) -> List[str]:
    """The array and final job ids from the CLI's 'submitted' line (read as soon as it is printed)."""
    for line in proc.stderr:
        if "submitted array job" in line:
            words = line.split()
            return [words[words.index("job") + 1].rstrip(":"), words[words.index("step") + 2]]
    raise AssertionError("no 'submitted array job' line")


def scancel(*ids: str) -> None:
    subprocess.run(["scancel", *ids], capture_output=True, timeout=30)


def test_array_job_matches_direct_tokenization_and_a_cancelled_task_redoes_only_its_shard(slurm_cluster, tmp_path):
    docs = documents()
    short = [d[:BIG_CHARS] for d in docs]
    small = {"a": docs[:4], "b": docs[4:]}
    for name, ds in small.items():
        write_jsonl(tmp_path / f"{name}.jsonl", ds)
    write_jsonl(tmp_path / "big.jsonl", short * BIG_COPIES)  # task 1 (inputs in the order given)
    prefix = tmp_path / "out" / "corpus"
    args = ["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "big.jsonl"), str(tmp_path / "b.jsonl"),
            "--output-prefix", str(prefix), "--tokenizer-type", "ByteLevelTokenizer", "--append-eod",
            "--slurm", str(job_toml(tmp_path)), "--wait"]
    big_tmp = f"{prefix.name}_big_text_document{prepare.TMP_MARK}*.bin"  # private to the task that writes it
    started: List[str] = []
    try:
        # 1. Cancel task 1 once it is writing its shard; the others finish, the final step names the gap.
        first = cli(*args)
        array_id, finish_id = submitted_ids(first)
        started += [array_id, finish_id]
        deadline = time.monotonic() + 60
        while not list(prefix.parent.glob(big_tmp)):
            assert time.monotonic() < deadline, "task 1 never started writing its shard"
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.1)
        scancel(f"{array_id}_1")
        out, err = first.communicate(timeout=90)
        assert first.returncode == 1, err
        logs = Path(f"{prefix}{slurm_plan.SLURM_FOLDER_SUFFIX}") / "logs"
        finish_log = (logs / f"{finish_id}_0_log.err").read_text()
        assert "1 of 3 shard(s) not finished: big (task 1" in finish_log, finish_log
        assert not Path(f"{prefix}_big.shard.json").exists()
        assert not Path(f"{prefix}.manifest.json").exists()
        kept = {s: (Path(f"{prefix}_{s}_text_document.bin").stat().st_mtime_ns,
                    Path(f"{prefix}_{s}.shard.json").read_text()) for s in small}

        # 2. The same command again: only task 1 works, the final step writes the manifest and snippet.
        second = cli(*args)
        array_id2, finish_id2 = submitted_ids(second)
        started += [array_id2, finish_id2]
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err + out
        for s in small:
            assert (Path(f"{prefix}_{s}_text_document.bin").stat().st_mtime_ns,
                    Path(f"{prefix}_{s}.shard.json").read_text()) == kept[s], f"shard {s} was redone"
        task_logs = {i: (logs / f"{array_id2}_{i}_0_log.err").read_text() for i in range(3)}
        assert "skipped, up to date" in task_logs[0] and "skipped, up to date" in task_logs[2]
        assert "big: preparing" in task_logs[1] and "tokens/s" in task_logs[1]
        assert not list(prefix.parent.glob("*.tmp*")), "temporary files left behind"
    finally:
        for proc in [p for p in (locals().get("first"), locals().get("second")) if p is not None]:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if started:
            scancel(*started)

    # 3. Token for token what the tokenizer makes of the same documents (+ EOD); snippet and manifest agree.
    tokenizer = byte_level()
    for s, ds in small.items():
        assert read_back(f"{prefix}_{s}_text_document") == expected(tokenizer, ds, append_eod=True)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    big = IndexedDataset(f"{prefix}_big_text_document")
    one_copy = expected(tokenizer, short, append_eod=True)
    assert len(big) == len(docs) * BIG_COPIES
    assert big.sequence_lengths.tolist() == [len(ids) for ids in one_copy] * BIG_COPIES
    whole = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in one_copy if ids])
    assert np.array_equal(big.bin_reader.read(big.index.dtype, count=int(big.sequence_lengths.sum()), offset=0),
                          np.tile(whole, BIG_COPIES))
    snippet = toml.loads(out)
    assert snippet["dataset"]["data_path"] == [f"{prefix}_{s}_text_document" for s in ("a", "big", "b")]
    manifest: Dict = json.loads(Path(f"{prefix}.manifest.json").read_text())
    assert [s["name"] for s in manifest["shards"]] == ["a", "big", "b"]
    assert manifest["documents"] == len(docs) * (BIG_COPIES + 1)
    assert all(len(s["outputs"]["text"]["bin_sha256"]) == 64 for s in manifest["shards"])
    assert os.path.getsize(f"{prefix}_big_text_document.bin") == manifest["shards"][1]["outputs"]["text"]["bin_bytes"]


def test_bad_job_config_exits_2_naming_the_key(slurm_cluster, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", documents()[:2])
    job = job_toml(tmp_path)
    job.write_text(job.read_text().replace('time = "00:05:00"', 'time = "five minutes"'))
    proc = cli("--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
               "ByteLevelTokenizer", "--slurm", str(job))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "slurm.time" in err and str(job) in err and "Traceback" not in err
    assert not Path(f"{tmp_path / 'o'}{slurm_plan.SLURM_FOLDER_SUFFIX}").exists()


def test_a_prefix_whose_array_has_not_finished_is_refused_to_a_second_submit_and_a_local_run(slurm_cluster, tmp_path):
    """Issue 25, item 1: re-running a --slurm command while its array is queued or running, or a local
    run of the same prefix then, is refused naming the job; nothing is written or submitted."""
    write_jsonl(tmp_path / "a.jsonl", documents()[:3])
    prefix = tmp_path / "out" / "p"
    base = ["--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(prefix), "--tokenizer-type",
            "ByteLevelTokenizer"]
    job = job_toml(tmp_path)
    # Held in the queue (--begin in an hour), so it is certainly unfinished while the others try.
    first = cli(*base, "--slurm", str(job), "--set", 'slurm.extra = { begin = "now+3600" }')
    array_id, finish_id = submitted_ids(first)
    try:
        first.communicate(timeout=60)
        assert first.returncode == 0
        for extra in (["--slurm", str(job)], []):
            again = cli(*base, *extra)
            out, err = again.communicate(timeout=120)
            assert again.returncode == 2 and out == "", err
            assert "key '--output-prefix'" in err and array_id in err and "PENDING" in err and "Traceback" not in err
        assert not list(prefix.parent.glob("p_*"))
        folder = Path(f"{prefix}{slurm_plan.SLURM_FOLDER_SUFFIX}")
        jobs = [json.loads(line)["job_id"] for line in (folder / "jobs.jsonl").read_text().splitlines()]
        assert jobs == [array_id, finish_id]
    finally:
        scancel(array_id, finish_id)


def test_wait_names_each_failed_task_and_its_error(slurm_cluster, tmp_path):
    """Issue 25, item 10: when a task fails on its input, --wait prints the task, its state and its
    error line, not only a pointer to a log."""
    write_jsonl(tmp_path / "good.jsonl", documents()[:2])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    proc = cli("--input", str(tmp_path / "good.jsonl"), str(tmp_path / "bad.jsonl"), "--output-prefix",
               str(tmp_path / "o"), "--tokenizer-type", "ByteLevelTokenizer", "--slurm", str(job_toml(tmp_path)),
               "--wait")
    ids = submitted_ids(proc)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        scancel(*ids)
    assert proc.returncode == 1 and out == "", err
    line = next(ln for ln in err.splitlines() if "task 1 (bad," in ln)
    assert "FAILED" in line and f"{tmp_path / 'bad.jsonl'}:2" in line and "not valid JSON" in line, err
    assert "task 0" not in err
