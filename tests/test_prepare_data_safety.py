"""``bridge-prepare-data`` never gives silently wrong data (issue 25): one writer per prefix, damaged
shards rebuilt, hostile prefixes refused, bounded workers, a clean Ctrl-C, one line for bad text.

Everything runs for real: the CLI's ``main`` in this process, or as a process of its own where the
test is about processes (concurrent writers, signals); the shards are read back through
megatron-core's ``IndexedDataset``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

import pytest
from bridge_test_helpers import MINIMAL_TRAINING_TOML, ROOT
from test_prepare_data import BYTE_LEVEL, byte_level, expected, read_back, run, write_lines

from bridge_hpc.cli.prepare_data import EXIT_INTERRUPTED, main
from bridge_hpc.prepare import shards as prepare

ROUNDS = 20


def jsonl(path: Path, docs: List[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def shard_files(prefix: Path, shard: str) -> Tuple[Path, dict]:
    """The shard's .bin and its record."""
    record = json.loads(Path(f"{prefix}_{shard}.shard.json").read_text())
    return Path(f"{prefix}_{shard}_text_document.bin"), record


def record_matches_files(prefix: Path, shard: str) -> bool:
    _, record = shard_files(prefix, shard)
    out = record["outputs"]["text"]
    return all(prepare._sha256_file(Path(out["prefix"] + s)) == out[f"{s[1:]}_sha256"] for s in (".bin", ".idx"))


def _child(argv: List[str], err_path: str, start_at: float) -> None:
    """A prepare in a forked process (torch already imported: the race starts at once)."""
    time.sleep(max(0.0, start_at - time.time()))
    with open(err_path, "w") as err:
        os.dup2(err.fileno(), 2)
        sys.stderr = err
        with open(os.devnull, "w") as out:
            sys.stdout = out
            code = main(argv)
            err.flush()
            os._exit(code)


def test_two_concurrent_prepares_on_one_prefix_one_writes_the_other_is_refused(tmp_path):
    """Item 1, repeated: each time exactly one writes, the other exits 2 naming the prefix, and the
    shard's bytes are one input's tokens only, matching their record."""
    docs = {name: [f"{name} document {i} " * 40 for i in range(3000)] for name in ("ca", "cb")}
    inputs = {name: jsonl(tmp_path / name / "part.jsonl", d) for name, d in docs.items()}
    tokenizer = byte_level()
    want = {name: expected(tokenizer, d, append_eod=True) for name, d in docs.items()}
    ctx = multiprocessing.get_context("fork")
    for round_ in range(ROUNDS):
        prefix = tmp_path / f"out{round_}" / "mix"
        start_at = time.time() + 0.2
        procs = {}
        for name, path in inputs.items():
            argv = ["--input", str(path), "--output-prefix", str(prefix), *BYTE_LEVEL, "--append-eod"]
            procs[name] = ctx.Process(target=_child, args=(argv, str(tmp_path / f"{name}{round_}.err"), start_at))
            procs[name].start()
        for proc in procs.values():
            proc.join(60)
            assert proc.exitcode is not None, "a prepare hung"
        codes = {name: proc.exitcode for name, proc in procs.items()}
        assert sorted(codes.values()) == [0, 2], (round_, codes)
        winner = next(name for name, code in codes.items() if code == 0)
        loser = next(name for name, code in codes.items() if code == 2)
        err = (tmp_path / f"{loser}{round_}.err").read_text()
        assert "key '--output-prefix'" in err and "Traceback" not in err and err.count("\n") == 1, err
        assert "is in use by bridge-prepare-data" in err or "would overwrite the finished shard" in err, err
        assert read_back(f"{prefix}_part_text_document") == want[winner]
        assert record_matches_files(prefix, "part")
        assert not list(prefix.parent.glob("*.tmp*")) and not Path(f"{prefix}.lock").exists()


def test_a_held_prefix_names_its_holder(tmp_path, capsys):
    """The refusal says who holds the prefix (the lock taken as a local run takes it)."""
    from bridge_hpc.prepare.prefix_lock import hold_prefix

    path = jsonl(tmp_path / "a.jsonl", ["some text"])
    prefix = tmp_path / "o"
    with hold_prefix(str(prefix), "local"):
        rc, out, err = run(capsys, "--input", str(path), "--output-prefix", str(prefix), *BYTE_LEVEL)
    assert rc == 2 and out == ""
    assert f"pid {os.getpid()}" in err and "(local)" in err and "in use" in err
    assert not list(tmp_path.glob("o_*"))
    assert run(capsys, "--input", str(path), "--output-prefix", str(prefix), *BYTE_LEVEL)[0] == 0


@pytest.mark.parametrize("keep_time", [False, True], ids=["written", "time-restored"])
def test_a_flipped_byte_is_rebuilt_not_skipped(tmp_path, capsys, keep_time):
    """Item 4: a .bin with one byte flipped (same size, even with its time put back) is rebuilt, and
    the manifest then holds the rebuilt file's checksum."""
    docs = [f"document {i} with some text" for i in range(200)]
    path = jsonl(tmp_path / "a.jsonl", docs)
    prefix = tmp_path / "o"
    args = ["--input", str(path), "--output-prefix", str(prefix), *BYTE_LEVEL, "--append-eod"]
    assert run(capsys, *args)[0] == 0
    bin_path, _ = shard_files(prefix, "a")
    st = bin_path.stat()
    data = bytearray(bin_path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bin_path.write_bytes(bytes(data))
    if keep_time:
        os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    rc, _, err = run(capsys, *args)
    assert rc == 0 and "skipped" not in err and "rebuilding" in err and str(bin_path) in err, err
    assert read_back(str(prefix) + "_a_text_document") == expected(byte_level(), docs, append_eod=True)
    manifest = json.loads(Path(f"{prefix}.manifest.json").read_text())
    assert manifest["shards"][0]["outputs"]["text"]["bin_sha256"] == prepare._sha256_file(bin_path)
    assert record_matches_files(prefix, "a")


def test_verify_reads_every_byte_of_a_large_shard(tmp_path, capsys, monkeypatch):
    """A shard too large to digest whole on every re-run is sampled; a flipped byte between the
    samples with its time put back is found by --verify (and a plain re-run keeps the shard)."""
    monkeypatch.setattr(prepare, "SAMPLE_WHOLE_BYTES", 4096)
    monkeypatch.setattr(prepare, "SAMPLE_BLOCKS", 2)
    monkeypatch.setattr(prepare, "SAMPLE_BLOCK_BYTES", 512)
    docs = [f"document {i} with some more text in it" for i in range(2000)]
    path = jsonl(tmp_path / "a.jsonl", docs)
    prefix = tmp_path / "o"
    args = ["--input", str(path), "--output-prefix", str(prefix), *BYTE_LEVEL]
    assert run(capsys, *args)[0] == 0
    bin_path, _ = shard_files(prefix, "a")
    st = bin_path.stat()
    assert st.st_size > 8192
    data = bytearray(bin_path.read_bytes())
    data[st.st_size // 2] ^= 0x01  # between the first and the last sampled block
    bin_path.write_bytes(bytes(data))
    os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    rc, _, err = run(capsys, *args)
    assert rc == 0 and "a: skipped, up to date" in err  # what a sample cannot see ...
    rc, _, err = run(capsys, *args, "--verify")
    assert rc == 0 and "its sha256 differs from its record" in err and "rebuilding" in err, err  # ... --verify does
    assert read_back(str(prefix) + "_a_text_document") == expected(byte_level(), docs, append_eod=False)
    rc, _, err = run(capsys, *args, "--verify")
    assert rc == 0 and "every byte verified" in err


def test_same_input_through_a_symlink_or_a_moved_folder_is_kept(tmp_path, capsys):
    """Item 13: the same bytes under another path are the same input: kept, and the record follows."""
    docs = ["one document", "another one"]
    jsonl(tmp_path / "data" / "a.jsonl", docs)
    prefix = tmp_path / "out" / "p"
    assert run(capsys, "--input", str(tmp_path / "data" / "a.jsonl"), "--output-prefix", str(prefix), *BYTE_LEVEL)[0] == 0
    (tmp_path / "link").symlink_to(tmp_path / "data")
    rc, _, err = run(capsys, "--input", str(tmp_path / "link" / "a.jsonl"), "--output-prefix", str(prefix), *BYTE_LEVEL)
    assert rc == 0 and "a: skipped, up to date" in err, err
    (tmp_path / "data").rename(tmp_path / "moved")
    rc, _, err = run(capsys, "--input", str(tmp_path / "moved" / "a.jsonl"), "--output-prefix", str(prefix), *BYTE_LEVEL)
    assert rc == 0 and "a: skipped, up to date" in err and "moved from" in err, err
    _, record = shard_files(prefix, "a")
    assert record["source"]["path"] == str(tmp_path / "moved" / "a.jsonl")
    # Other bytes under the recorded name are still other input: refused.
    jsonl(tmp_path / "third" / "a.jsonl", ["different text"])
    rc, _, err = run(capsys, "--input", str(tmp_path / "third" / "a.jsonl"), "--output-prefix", str(prefix), *BYTE_LEVEL)
    assert rc == 2 and "would overwrite the finished shard 'a'" in err


@pytest.mark.parametrize("prefix", ["out/a\ntouch PWNED\n#", "out/a\rb", "out/%j/x", "out/a\\b", "out/\u2028x"])
def test_hostile_output_prefix_is_refused_before_anything_is_submitted(tmp_path, capsys, monkeypatch, prefix):
    """Item 5: a prefix that would break a line of the batch script or an sbatch pattern is refused
    with --slurm (control characters without it too), naming the flag; nothing is submitted."""
    shims = tmp_path / "shims"
    shims.mkdir()
    for tool in ("sbatch", "squeue", "scancel", "sacct"):
        (shims / tool).write_text(f"#!/bin/bash\ntouch {tmp_path}/CALLED-{tool}\nexit 1\n")
        (shims / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{ROOT / "configs" / "clusters" / "local.toml"}"\n[job]\nname = "p"\n'
                   + MINIMAL_TRAINING_TOML)
    path = jsonl(tmp_path / "a.jsonl", ["text"])
    rc, out, err = run(capsys, "--input", str(path), "--output-prefix", prefix, *BYTE_LEVEL, "--slurm", str(job))
    assert rc == 2 and out == "" and err.count("\n") == 1 and "key '--output-prefix'" in err, err
    assert not list(tmp_path.glob("CALLED-*")) and not (tmp_path / "PWNED").exists()
    assert not (tmp_path / "out").exists()
    if "%" not in prefix and "\\" not in prefix:
        rc, _, err = run(capsys, "--input", str(path), "--output-prefix", prefix, *BYTE_LEVEL)
        assert rc == 2 and "key '--output-prefix'" in err and not (tmp_path / "out").exists()


def test_the_renderer_refuses_a_control_character_whatever_let_it_through(tmp_path):
    """The last guard: a value with a newline never becomes a line of a batch script."""
    from bridge_hpc.contracts.errors import ConfigError
    from bridge_hpc.jobfile.jobconfig import load_job_config
    from bridge_hpc.launch.render import render_prepare_script

    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{ROOT / "configs" / "clusters" / "local.toml"}"\n[job]\nname = "p"\n'
                   + MINIMAL_TRAINING_TOML)
    cfg = load_job_config(job, training=False)
    for hostile in ({"step_args": ["x\ntouch PWNED"], "folder": str(tmp_path)},
                    {"step_args": ["x"], "folder": f"{tmp_path}/a\ntouch PWNED\n#"}):
        with pytest.raises(ConfigError, match="control character"):
            render_prepare_script(cfg, step="shard", step_module="m", tasks=1, cpus_per_task=1, **hostile)


def test_workers_are_capped_by_cpus_and_input_blocks(tmp_path, capsys):
    """Item 6: --workers 100000 on a 2-line file runs with one worker and says so in one line."""
    path = write_lines(tmp_path / "two.jsonl", ['{"text": "a"}', '{"text": "b"}'])
    started = time.monotonic()
    rc, _, err = run(capsys, "--input", str(path), "--output-prefix", str(tmp_path / "o"), *BYTE_LEVEL,
                     "--workers", "100000")
    assert rc == 0 and "--workers 100000 reduced to 1: " in err and "block" in err, err
    assert time.monotonic() - started < 30
    cpus = len(os.sched_getaffinity(0))
    assert prepare.worker_count(100000, [path], cpus=cpus)[0] == 1
    big = jsonl(tmp_path / "big.jsonl", ["x" * 1000] * (prepare.BLOCK_BYTES // 1000 * (cpus + 2)))
    workers, why = prepare.worker_count(100000, [big])
    assert workers == cpus and f"this process may use {cpus} CPUs" in why


@pytest.fixture(scope="module")
def big_input(tmp_path_factory) -> Path:
    """About 80 MB of jsonl: seconds of work for two workers, so a signal lands mid-shard."""
    return jsonl(tmp_path_factory.mktemp("big") / "big.jsonl", [f"document {i} " * 30 for i in range(200000)])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGINT, signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_ends_a_run_within_5_s_leaving_nothing(tmp_path, big_input, sig):
    """Item 7: Ctrl-C (SIGINT to the process group, as a terminal sends it) or SIGTERM while two
    workers tokenize: the run ends within 5 s, exit 130, one line, no traceback, no temporary file,
    no shard published.

    5 s is the promise, not a race: the stop takes 0.2-0.5 s on a 2-core machine with both cores
    busy. It failed when it was a hang (multiprocessing.Pool's result thread waiting forever on half a
    result, tests/test_prepare_worker_pool.py) or the interpreter's teardown (2-15 s under load)."""
    prefix = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "bridge_hpc.cli.prepare_data", "--input", str(big_input),
                             "--output-prefix", str(prefix), *BYTE_LEVEL, "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # as from a terminal's foreground: a suite started in the background (`make test &`)
                            # hands its children SIGINT ignored, which Python then keeps ignoring
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(f"o_big_text_document{prepare.TMP_MARK}*.bin")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.3)
        sent = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # the group: the workers get it too, as from a terminal
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=5)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == EXIT_INTERRUPTED and took < 5, (proc.returncode, took, err)
    assert "Traceback" not in err and "interrupted" in err.splitlines()[-1]
    assert not list(tmp_path.glob("o*.tmp*")) and not list(tmp_path.glob("o_big*"))
    assert not Path(f"{prefix}.lock").exists()


@pytest.mark.parametrize("lines, flags, phrase", [
    (['{"text": "ok"}', '{"text": "\\ud800"}'], [], "lone surrogate"),
    (['{"text": "ok"}', '{"text": "x\\udfffy"}'], ["--tokenizer-type", "ByteLevelTokenizer"], "lone surrogate"),
    (['{"text": "1 2 3"}', '{"text": "hello world"}'], ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
     "cannot tokenize"),
    (['{"text": "1 2 3"}', '{"text": "7 5000"}'], ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
     "outside"),
])
def test_text_no_tokenizer_can_read_is_a_bad_line(tmp_path, capsys, lines, flags, phrase):
    """Item 8: a lone surrogate (valid JSON), text given to NullTokenizer, an id outside the
    vocabulary: exit 2 naming file:2, or skipped with --on-bad-line skip."""
    path = write_lines(tmp_path / "bad.jsonl", lines)
    tok = flags or BYTE_LEVEL
    rc, out, err = run(capsys, "--input", str(path), "--output-prefix", str(tmp_path / "o"), *tok)
    last = err.splitlines()[-1]
    assert rc == 2 and out == "" and f"{path}:2" in last and phrase in last and err.count("error:") == 1, err
    assert "Traceback" not in err
    rc, _, err = run(capsys, "--input", str(path), "--output-prefix", str(tmp_path / "o"), *tok,
                     "--on-bad-line", "skip")
    assert rc == 0 and "1 bad lines skipped" in err, err
    assert len(read_back(str(tmp_path / "o_bad_text_document"))) == 1


@pytest.mark.parametrize("where", ["under-a-file", "/proc", "/sys"])
def test_output_prefix_that_cannot_be_written_exits_2(tmp_path, capsys, where):
    """Item 8: a prefix under a file, in /proc or in /sys: one line naming --output-prefix."""
    path = jsonl(tmp_path / "a.jsonl", ["text"])
    (tmp_path / "file").write_text("x")
    prefix = {"under-a-file": str(tmp_path / "file" / "o"), "/proc": "/proc/bridge-test/o",
              "/sys": "/sys/bridge-test/o"}[where]
    rc, out, err = run(capsys, "--input", str(path), "--output-prefix", prefix, *BYTE_LEVEL)
    assert rc == 2 and out == "" and "key '--output-prefix'" in err and err.count("\n") == 1, err


def test_a_corpus_of_only_empty_documents_is_refused(tmp_path, capsys):
    """Item 9 (prepare's side): documents that are all empty make no tokens: exit 2, no shard (a
    rank cannot map an empty .bin)."""
    path = jsonl(tmp_path / "empty.jsonl", ["", "", ""])
    rc, out, err = run(capsys, "--input", str(path), "--output-prefix", str(tmp_path / "o"), *BYTE_LEVEL, "--append-eod")
    assert rc == 2 and out == "" and "no tokens" in err and str(path) in err
    assert not list(tmp_path.glob("o_*"))


def test_slurm_mode_checks_the_job_configs_secrets_before_submitting(tmp_path, capsys, monkeypatch):
    """Item 10: an [env] secret whose shell variable is unset is refused at submission, as bridge-submit does."""
    monkeypatch.delenv("BRIDGE_TEST_UNSET_SECRET", raising=False)
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "sbatch").write_text(f"#!/bin/bash\ntouch {tmp_path}/SUBMITTED\nexit 1\n")
    (shims / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{ROOT / "configs" / "clusters" / "local.toml"}"\n[job]\nname = "p"\n'
                   '[env]\nHF_TOKEN = { from_shell = "BRIDGE_TEST_UNSET_SECRET" }\n' + MINIMAL_TRAINING_TOML)
    path = jsonl(tmp_path / "a.jsonl", ["text"])
    rc, _, err = run(capsys, "--input", str(path), "--output-prefix", str(tmp_path / "o"), *BYTE_LEVEL,
                     "--slurm", str(job))
    assert rc == 2 and "key 'env.HF_TOKEN'" in err and "BRIDGE_TEST_UNSET_SECRET" in err, err
    assert not (tmp_path / "SUBMITTED").exists() and not (tmp_path / "o.slurm").exists()


@pytest.mark.parametrize("names, keys", [
    (["train", "valid"], {"train_data_path": ["train"], "valid_data_path": ["valid"]}),
    (["wiki-train-00", "wiki-train-01", "wiki-validation", "test"],
     {"train_data_path": ["wiki-train-00", "wiki-train-01"], "valid_data_path": ["wiki-validation"],
      "test_data_path": ["test"]}),
    (["train", "misc"], {"data_path": ["train", "misc"]}),
    (["part-00", "part-01"], {"data_path": ["part-00", "part-01"]}),
])
def test_the_printed_dataset_lines_keep_held_out_inputs_out_of_training(tmp_path, capsys, names, keys):
    """Item 14: inputs named by split print per-split paths (a pasted data_path would blend the held-out
    text into training); otherwise one data_path. The lines load into a job config as printed."""
    import toml

    paths = [str(jsonl(tmp_path / f"{name}.jsonl", [f"text of {name}"])) for name in names]
    rc, out, _ = run(capsys, "--input", *paths, "--output-prefix", str(tmp_path / "d"), *BYTE_LEVEL)
    assert rc == 0
    printed = toml.loads(out)["dataset"]
    assert printed == {k: [f"{tmp_path}/d_{n}_text_document" for n in v] for k, v in keys.items()}
    job = tmp_path / "job.toml"
    job.write_text(MINIMAL_TRAINING_TOML + out
                   + '[tokenizer]\ntokenizer_type = "ByteLevelTokenizer"\n')
    from bridge_hpc.jobfile.jobconfig import load_job_config

    cfg = load_job_config(job, overrides=["dataset.split=1,0,0"] if "data_path" in keys else [], cwd=tmp_path)
    assert type(cfg.training.dataset).__name__ == "GPTDatasetConfig"


def test_a_slurm_task_waits_for_the_submission_that_holds_the_prefix(tmp_path):
    """An array task can start while its submission still holds the prefix (it records the job ids
    after both sbatch calls): the task waits for it instead of failing; a user's run is refused at once."""
    import threading

    from bridge_hpc.contracts.errors import ConfigError
    from bridge_hpc.prepare.prefix_lock import hold_prefix

    prefix = str(tmp_path / "o")
    leaving = threading.Event()

    def submission():
        with hold_prefix(prefix, "submit"):
            time.sleep(1.0)
            leaving.set()

    thread = threading.Thread(target=submission)
    thread.start()
    time.sleep(0.2)
    with pytest.raises(ConfigError, match=r"in use by bridge-prepare-data \(submit\)"):
        with hold_prefix(prefix, "local"):
            pass
    with hold_prefix(prefix, "task 0", shared=True, wait_s=30):
        assert leaving.is_set()  # got it only once the submission let go
    thread.join()
