"""``bridge-hf`` and ``bridge-submit`` on bad Hugging Face input: one line naming the file (and tensor),
exit status 2, no traceback, nothing written under OUT; and a good import from the command line."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from bridge_test_helpers import MINIMAL_TRAINING_TOML, run_cli_cases, single_rank_world
from hf_models import MOE_FAMILIES, VOCAB, batch, hf_logits, make_hf_folders, make_hf_model, model_config, safetensors_in
from warm_ranks import run_module

from bridge_hpc.training.hf import families

HF_MODULE = "bridge_hpc.cli.hf"
HF = [sys.executable, "-m", HF_MODULE]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good") / "qwen2"
    make_hf_model("qwen2", str(folder))
    return folder


def _variant(good, tmp_path, name):
    folder = tmp_path / name
    shutil.copytree(good, folder)
    return folder


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _rename_tensor(folder, old, new):
    """Rewrite the safetensors header with one tensor renamed (``new`` no longer: the data stays put)."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length].decode().replace(f'"{old}"', f'"{new}"')
    header += " " * (length - len(header))  # safetensors pads its header with spaces
    assert len(header) == length
    path.write_bytes(data[:8] + header.encode() + data[8 + length:])


def _header(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return path, data, length, json.loads(data[8:8 + length])


def _move_tensor_onto(folder, name, onto):
    """Rewrite the header so that tensor ``name`` reads the bytes of tensor ``onto`` (of its size): two
    tensors on one byte range, and a gap where ``name``'s were."""
    path, data, length, header = _header(folder)
    header[name]["data_offsets"] = header[onto]["data_offsets"]
    text = json.dumps(header, separators=(",", ":"))
    assert len(text) <= length
    path.write_bytes(data[:8] + text.ljust(length).encode() + data[8 + length:])


def _poison_tensor(folder, name, value):
    """One float32 value inside tensor ``name`` overwritten in place (the file's size and header unchanged)."""
    path, data, length, header = _header(folder)
    start = 8 + length + header[name]["data_offsets"][0] + 4 * 7
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(struct.pack("<f", value))


def _damaged(good, tmp, damage):
    folder = _variant(good, tmp, "x")
    damage(folder)
    return folder


BAD = {
    "missing folder": (lambda good, tmp: tmp / "nope", "no such file or folder"),
    "no config.json": (lambda good, tmp: (lambda f: (os.remove(f / "config.json"), f)[1])(_variant(good, tmp, "x")),
                       "config.json: missing"),
    "unsupported model_type": (lambda good, tmp: (lambda f: (_edit_config(f, model_type="bert"), f)[1])(
        _variant(good, tmp, "x")), "supported: llama, mistral, qwen2, qwen3, gpt2"),
    "truncated shard": (lambda good, tmp: (lambda f: (os.truncate(f / "model.safetensors", 5000), f)[1])(
        _variant(good, tmp, "x")), "model.safetensors: truncated"),
    "wrong shape": (lambda good, tmp: (lambda f: (_edit_config(f, intermediate_size=128), f)[1])(
        _variant(good, tmp, "x")), "key 'model.layers.0.mlp.gate_proj.weight': has shape [96, 64], expected [128, 64]"),
    "wrong name": (lambda good, tmp: (lambda f: (_rename_tensor(f, "model.norm.weight", "model.nrm.weight"), f)[1])(
        _variant(good, tmp, "x")), "key 'model.norm.weight': missing"),
    "newline in path": (lambda good, tmp: tmp / "a\nb", "control characters"),
    "command in path": (lambda good, tmp: tmp / "$(touch pwned)", "no such file or folder"),
    "missing index shard": (lambda good, tmp: (lambda f: ((f / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})), f)[1])(_variant(good, tmp, "x")),
        "model-00002-of-00002.safetensors: missing"),
    # damaged contents (issue 36, item 9): what can be told without a checksum, which safetensors lacks
    "NaN in a tensor": (lambda good, tmp: _damaged(good, tmp, lambda f: _poison_tensor(
        f, "model.layers.1.mlp.up_proj.weight", float("nan"))),
        "model.safetensors: key 'model.layers.1.mlp.up_proj.weight': holds 1 NaN or infinite value"),
    "Inf in a tensor": (lambda good, tmp: _damaged(good, tmp, lambda f: _poison_tensor(
        f, "model.layers.0.self_attn.k_proj.weight", float("-inf"))),
        "model.safetensors: key 'model.layers.0.self_attn.k_proj.weight': holds 1 NaN or infinite value"),
    "bytes appended": (lambda good, tmp: _damaged(good, tmp, lambda f: open(f / "model.safetensors", "ab").write(
        b"\0" * 64)), "bytes after its last tensor"),
    "overlapping tensors": (lambda good, tmp: _damaged(good, tmp, lambda f: _move_tensor_onto(
        f, "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight")),
        "not a file safetensors reads"),
}


@pytest.fixture(scope="module")
def bad_imports(good, tmp_path_factory):
    """Every :data:`BAD` case's import in one interpreter (:func:`run_cli_cases`), each in its own folder:
    case -> (the result, the folder's names before the import, after it)."""
    cases, folders = [], {}
    for case in sorted(BAD):
        folder = tmp_path_factory.mktemp("bad")
        source = BAD[case][0](good, folder)
        folders[case] = (folder, set(os.listdir(folder)))
        cases.append((["import", str(source), str(folder / "out")], folder))
    results = run_cli_cases("bridge_hpc.cli.hf", cases)
    return {case: (result, folders[case][1], set(os.listdir(folders[case][0])))
            for case, result in zip(sorted(BAD), results)}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_import_input_is_one_line_and_exit_2_with_nothing_written(bad_imports, case):
    proc, before, after = bad_imports[case]
    words = BAD[case][1]
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert after == before  # no OUT, no temporary folder, no pwned


@pytest.mark.parametrize("value, words", [
    ("transformer_engine", "key '--transformer-impl': needs a GPU with Transformer Engine"),
    ("$(touch pwned)", "invalid choice"),
    ("local\ntransformer_engine", "invalid choice"),
])
def test_import_into_layers_this_machine_cannot_build_is_one_line_and_exit_2(good, tmp_path, value, words):
    if value == "transformer_engine" and importlib.util.find_spec("transformer_engine") and torch.cuda.is_available():
        pytest.skip("this machine has Transformer Engine on a GPU (tests/test_gpu_te.py imports into its layers)")
    before = set(os.listdir(tmp_path))
    proc = run_module(HF_MODULE, ["import", str(good), str(tmp_path / "out"), "--transformer-impl", value],
                      cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert words in proc.stderr and len([x for x in proc.stderr.splitlines() if "error:" in x]) == 1, proc.stderr
    assert set(os.listdir(tmp_path)) == before


def test_export_refuses_what_is_no_checkpoint_and_an_existing_out(good, tmp_path):
    for args, words in (([str(good), str(tmp_path / "o")], "holds no complete checkpoint"),
                        ([str(tmp_path), str(good)], "exists already")):
        proc = run_module(HF_MODULE, ["export"] + args, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert words in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "o").exists()


def test_import_writes_a_checkpoint_that_submission_takes_and_a_bad_folder_is_refused_at_submission(good, tmp_path):
    proc = run_module(HF_MODULE, ["import", str(good), str(tmp_path / "ckpt")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[bridge-hf" in proc.stderr and (tmp_path / "ckpt" / "iter_0000000" / "manifest.json").is_file()
    bad = _variant(good, tmp_path, "bad")
    _edit_config(bad, num_hidden_layers=3)
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nentry = "finetune"\n[optimizer]\nlr = 1e-4\n[checkpoint]\npretrained_checkpoint = "{bad}"\n')
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "key 'model.layers.2.input_layernorm.weight': missing" in proc.stderr


@pytest.mark.parametrize("case", ["bytes appended", "overlapping tensors"])
def test_a_shard_safetensors_would_refuse_is_refused_at_submission(good, tmp_path, case):
    """Issue 36, item 9: a shard's length or byte ranges that safetensors refuses on the ranks (there: a
    traceback after the queue) are refused by bridge-submit, from the header alone."""
    make, words = BAD[case]
    bad = make(good, tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nentry = "finetune"\n[optimizer]\nlr = 1e-4\n[checkpoint]\npretrained_checkpoint = "{bad}"\n')
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad / "model.safetensors") in lines[0] and words in lines[0], lines


# --- where the output is written: a temporary folder of the tool's own beside OUT (issue 36) -----------

#: Runs ``bridge-hf`` (its ``__main__``) on a gated disk: the first write of its main thread under $GATE_UNDER
#: (a write-mode ``open`` or an ``fsync``) makes ``$GATE_DIR/writing`` and then waits until ``$GATE_DIR/go``
#: exists. A test thus acts inside the write phase on an event, whatever the machine's load: a half-second
#: delay (the earlier way) let a loaded machine's signal arrive after the write was done. Only the main
#: thread waits, as it is the one Python delivers signals to; writer threads (torch DCP's) pass.
GATED_DISK = [sys.executable, "-c", """
import builtins, os, runpy, sys, threading, time
under, gate, _open, _fsync = os.environ["GATE_UNDER"], os.environ["GATE_DIR"], builtins.open, os.fsync
def _gate(path):
    if threading.current_thread() is not threading.main_thread() or not os.path.abspath(path).startswith(under):
        return
    if os.path.exists(os.path.join(gate, "writing")):
        return
    _open(os.path.join(gate, "writing"), "w").close()
    while not os.path.exists(os.path.join(gate, "go")):
        time.sleep(0.02)
def gated_open(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
        _gate(os.fsdecode(file))
    return _open(file, mode, *args, **kwargs)
def gated_fsync(fd):
    _gate(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"))
    return _fsync(fd)
builtins.open, os.fsync = gated_open, gated_fsync
sys.argv[0] = "bridge-hf"
runpy.run_module("bridge_hpc.cli.hf", run_name="__main__", alter_sys=True)
"""]
#: How long a test waits for a tool to reach its write phase (torch's import alone takes 5-30 s on a
#: loaded 2-core machine); the wait ends as soon as it is there.
WRITE_PHASE_WAIT_S = 300


@pytest.fixture(scope="module")
def imported(good, tmp_path_factory):
    """``bridge-hf import`` of the good folder: a toolkit checkpoint folder (iter_0000000 and the tracker)."""
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    proc = run_module(HF_MODULE, ["import", str(good), str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def _args(command, good, imported, out):
    return [command, str(good if command == "import" else imported), str(out)]


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _start_gated(args, tmp_path, gate):
    return subprocess.Popen(GATED_DISK + args, env={**os.environ, "GATE_UNDER": str(tmp_path), "GATE_DIR": str(gate)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_until_writing(proc, gate):
    """Returns once ``proc`` waits at its first write under the gate (see GATED_DISK)."""
    deadline = time.monotonic() + WRITE_PHASE_WAIT_S
    while time.monotonic() < deadline:
        if (gate / "writing").exists():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"ended (exit {proc.returncode}) before its write phase:\n{out}\n{err[-3000:]}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"no write began in {WRITE_PHASE_WAIT_S} s")


@pytest.fixture
def gate(tmp_path_factory):
    """The folder of GATED_DISK's two marker files, apart from the folder a test lists."""
    return tmp_path_factory.mktemp("gate")


@pytest.mark.parametrize("command", ["import", "export"])
@pytest.mark.parametrize("kind", ["folder", "symlink"])
def test_an_existing_out_tmp_is_left_alone(good, imported, tmp_path, command, kind):
    """Someone's ``OUT.tmp`` (a folder with a file in it, or a link to another folder) is neither removed
    nor followed: the tool writes into a temporary folder of its own."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if kind == "folder":
        (tmp_path / "out.tmp").mkdir()
        (tmp_path / "out.tmp" / "mine.txt").write_text("keep me")
    else:
        (tmp_path / "out.tmp").symlink_to(elsewhere)
    out = tmp_path / "out"
    proc = run_module(HF_MODULE, _args(command, good, imported, out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.is_dir() and not out.is_symlink()
    assert (out / ("iter_0000000" if command == "import" else "config.json")).exists()
    assert os.listdir(elsewhere) == []
    if kind == "folder":
        assert (tmp_path / "out.tmp" / "mine.txt").read_text() == "keep me"
    else:
        assert (tmp_path / "out.tmp").is_symlink() and os.readlink(tmp_path / "out.tmp") == str(elsewhere)
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "out", "out.tmp"]  # no temporary folder left


@pytest.mark.parametrize("command,signum", [("import", signal.SIGINT), ("export", signal.SIGINT),
                                            ("import", signal.SIGTERM)], ids=["import", "export", "import-SIGTERM"])
def test_ctrl_c_while_writing_leaves_nothing_and_says_so(good, imported, tmp_path, gate, command, signum):
    """SIGINT (or SIGTERM) in the write phase: no success summary, one line saying OUT was not written,
    exit status 130, and the tool's temporary folder gone (and nothing else touched). The write stays
    blocked at the gate: only the signal can end it."""
    out = tmp_path / "out"
    before = set(os.listdir(tmp_path))
    proc = _start_gated(_args(command, good, imported, out), tmp_path, gate)
    _wait_until_writing(proc, gate)
    proc.send_signal(signum)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still writing 120 s after signal {signum}")
    assert proc.returncode == 130, stderr[-3000:]
    assert stdout == "" and "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and f"{out} was not written" in lines[0], stderr[-3000:]
    assert set(os.listdir(tmp_path)) == before


def test_out_made_by_someone_else_during_an_import_is_not_overwritten(good, tmp_path, gate):
    """OUT appearing while the import writes (here an empty folder, which a plain rename would replace):
    one line, exit 2, that folder untouched, the import's temporary folder gone."""
    out = tmp_path / "out"
    before = set(os.listdir(tmp_path))
    proc = _start_gated(["import", str(good), str(out)], tmp_path, gate)
    _wait_until_writing(proc, gate)
    out.mkdir()
    (gate / "go").touch()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    lines = _error_lines(stderr)
    assert len(lines) == 1 and f"{out}: exists already" in lines[0], stderr[-3000:]
    assert os.listdir(out) == [] and set(os.listdir(tmp_path)) == before | {"out"}


def test_two_imports_into_one_out_one_wins_and_the_other_says_so(good, tmp_path):
    out = tmp_path / "out"
    procs = [subprocess.Popen(HF + ["import", str(good), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = sorted((p.communicate(timeout=300), p.returncode) for p in procs)
    codes = sorted(code for _, code in results)
    assert codes == [0, 2], [err[-2000:] for (_, err), _ in results]
    (_, loser_err), = [streams for streams, code in results if code == 2]
    lines = _error_lines(loser_err)
    assert len(lines) == 1 and f"{out}: exists already" in lines[0] and "Traceback" not in loser_err, loser_err[-3000:]
    assert (out / "iter_0000000" / "manifest.json").is_file() and (out / "latest_checkpointed_iteration.txt").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("command", ["import", "export"])
def test_a_full_disk_while_writing_is_one_line_and_leaves_nothing(good, imported, small_disk, command):
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * (free - 100 * 1024))  # 100 KiB left: less than either output
    out = small_disk / "out"
    proc = run_module(HF_MODULE, _args(command, good, imported, out), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and f"{out}: not written" in lines[0] and "No space left on device" in lines[0], \
        proc.stderr[-3000:]
    assert os.listdir(small_disk) == ["filler"]


def _run_folder_with(imported, tmp_path, iterations, tracker):
    """A run's checkpoints/ folder holding copies of the imported checkpoint as ``iterations``."""
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    for i in iterations:
        folder = root / f"iter_{i:07d}"
        shutil.copytree(imported / "iter_0000000", folder)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["iteration"] = i
        (folder / "manifest.json").write_text(json.dumps(manifest))
    (root / "latest_checkpointed_iteration.txt").write_text(f"{tracker}\n")
    return root


def test_export_says_the_newest_checkpoint_is_damaged_and_which_one_it_exported(imported, tmp_path):
    root = _run_folder_with(imported, tmp_path, [20, 30], tracker=30)
    os.truncate(root / "iter_0000030" / "__0_0.distcp", 1000)
    proc = run_module(HF_MODULE, ["export", str(root), str(tmp_path / "out")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert all(words in warnings[0] for words in (
        "iter_0000030 (iteration 30)", "is damaged", "iter_0000030/__0_0.distcp: 1000 bytes, manifest says 298896",
        "exporting iter_0000020 (iteration 20) instead")), warnings[0]
    assert f"checkpoint={root / 'iter_0000020'}" in proc.stdout


@pytest.mark.parametrize("given", ["checkpoints", "iteration folder"])
def test_export_of_a_damaged_only_checkpoint_names_the_file(imported, tmp_path, given):
    root = _run_folder_with(imported, tmp_path, [10], tracker=10)
    os.truncate(root / "iter_0000010" / "__0_0.distcp", 1000)
    source = root if given == "checkpoints" else root / "iter_0000010"
    proc = run_module(HF_MODULE, ["export", str(source), str(tmp_path / "out")], timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "iter_0000010/__0_0.distcp: 1000 bytes, manifest says 298896" in lines[0], \
        proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damaged", [".metadata", "__0_0.distcp"])
def test_export_of_a_checkpoint_damaged_at_its_full_size_is_one_line(imported, tmp_path, damaged):
    """Bytes overwritten in place pass the size check: the read that fails is one line naming the folder
    (or its .metadata), exit 2, no traceback."""
    root = _run_folder_with(imported, tmp_path, [10], tracker=10)
    path = root / "iter_0000010" / damaged
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(b"\xff" * min(4096, path.stat().st_size))
    proc = run_module(HF_MODULE, ["export", str(root), str(tmp_path / "out")], timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    where = path if damaged == ".metadata" else path.parent
    assert len(lines) == 1 and f"{where}: cannot be read" in lines[0] and "contents are damaged" in lines[0], \
        proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


#: Runs ``bridge-hf`` (its ``__main__``) while a job deletes the checkpoint it reads: on the first ``open``
#: of $VANISH_AT in the folder $VANISH_FOLDER, that folder is deleted as checkpoint.most_recent_k deletes an
#: old checkpoint (renamed to ``*.del``, then removed), before the open itself runs. An audit hook: the
#: deletion happens at that event, whatever the timing of the machine.
VANISHING = [sys.executable, "-c", """
import os, runpy, shutil, sys
folder, target, done = os.environ["VANISH_FOLDER"], os.environ["VANISH_AT"], []
def hook(event, args):
    if event == "open" and not done and isinstance(args[0], (str, bytes)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if os.path.dirname(path) == folder and os.path.basename(path) == target:
            done.append(path)
            os.replace(folder, folder + ".del")
            shutil.rmtree(folder + ".del")
sys.addaudithook(hook)
sys.argv[0] = "bridge-hf"
runpy.run_module("bridge_hpc.cli.hf", run_name="__main__", alter_sys=True)
"""]


@pytest.mark.parametrize("vanish_at", ["run_config.json", ".metadata", "__0_0.distcp"])
def test_export_of_a_checkpoint_deleted_while_it_is_read_says_so_in_one_line(imported, tmp_path, vanish_at):
    """Issue 36, item 7: ``bridge-hf export`` racing a running job's ``most_recent_k`` deletion of the
    checkpoint it reads: one line naming the checkpoint that vanished and what to do, exit 2, no
    traceback, no claim of damage, nothing written."""
    root = _run_folder_with(imported, tmp_path, [10], tracker=10)
    folder = root / "iter_0000010"
    proc = subprocess.run(VANISHING + ["export", str(root), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VANISH_FOLDER": str(folder), "VANISH_AT": vanish_at})
    assert not folder.exists()  # the deletion happened, mid-read
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: {folder}: vanished while it was read"), proc.stderr[-3000:]
    assert "most_recent_k" in lines[0] and "run the export again" in lines[0] and "damaged" not in lines[0], lines[0]
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no OUT, no temporary folder


#: A GPT trained by the toolkit from scratch (its byte-level tokenizer: <eod> = 256, <pad> = 257, no BOS).
SCRATCH_GPT_JOB = MINIMAL_TRAINING_TOML + """
[model]
num_layers = 2
hidden_size = 64
num_attention_heads = 4
seq_length = 32
max_position_embeddings = 32
[dataset]
seq_length = 32
[tokenizer]
tokenizer_type = "ByteLevelTokenizer"
[checkpoint]
save_interval = 1
"""


def test_an_exported_toolkit_gpt_names_its_own_special_tokens_inside_its_vocabulary(tmp_path):
    """Issue 36, item 10: the config.json of a GPT trained here (no Hugging Face folder to start from)
    carried no token ids, so transformers gave it GPT-2's bos/eos 50256, outside its vocabulary of 384.
    It now names its tokenizer's own: eos = <eod> (256), pad = <pad> (257), no BOS."""
    from bridge_test_helpers import direct_rank_env

    (tmp_path / "job.toml").write_text(SCRATCH_GPT_JOB)
    proc = run_module("bridge_hpc.rank", ["job.toml"], cwd=tmp_path, env=direct_rank_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "exported"
    proc = run_module(HF_MODULE, ["export", str(tmp_path / "runs" / "job" / "checkpoints"), str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, 256, 257), config
    import transformers

    loaded = transformers.AutoConfig.from_pretrained(str(out))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(loaded, name)
        assert value is None or 0 <= value < loaded.vocab_size, (name, value, loaded.vocab_size)


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    return make_hf_folders(tmp_path_factory.mktemp("moe"), MOE_FAMILIES)


@pytest.fixture
def world():
    yield from single_rank_world()


def _refused(source, tmp_path, words):
    before = set(os.listdir(tmp_path))
    proc = run_module(HF_MODULE, ["import", str(source), str(tmp_path / "out")], cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr[-2000:]
    assert set(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_folders_import_with_transformers_logits_and_export_bitwise_and_misfits_are_refused(
        moe_folders, world, tmp_path, family):
    """Qwen3-MoE, Mixtral, Qwen2-MoE through ``bridge-hf``: the imported checkpoint in the toolkit's
    model (``[model] hf_config``'s fields) gives transformers' logits, its export is the original's
    tensors bitwise; a config.json counting other experts than the tensors hold, and an expert's
    missing tensor, are one line naming the file and the key, exit 2, nothing written."""
    from bridge_hpc.models.hf.export import read_checkpoint
    from bridge_hpc.training.engine.model import gpt_model_provider

    source = moe_folders[family]
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    for args in (["import", source, str(ckpt)], ["export", str(ckpt), str(out)]):
        proc = run_module(HF_MODULE, args, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = safetensors_in(source), safetensors_in(str(out))
    assert sorted(before) == sorted(after)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    _, _, tensors = read_checkpoint(str(ckpt))
    model = gpt_model_provider(model_config(source)).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all("_extra_state" in k for k in missing)
    b = batch()
    with torch.no_grad():
        ours = model(b["tokens"], b["position_ids"], None)[..., :VOCAB]
    theirs = hf_logits(source, b["tokens"])
    assert (ours - theirs).abs().max().item() <= 1e-4 and torch.equal(ours.argmax(-1), theirs.argmax(-1))

    bad = tmp_path / "bad"
    bad.mkdir()
    counted = _variant(Path(source), bad, "counted")
    config = json.loads((counted / "config.json").read_text())
    _edit_config(counted, **{families._experts_key(config): 3})
    _refused(counted, bad, [f"{counted / 'model.safetensors'}: key '", ".gate.weight'",
                            "has shape [4, 64], expected [3, 64]"])
    shutil.rmtree(counted)
    gone = next(k for k in before if ".experts.2." in k and k.startswith("model.layers.2."))
    missing_one = _variant(Path(source), bad, "missing")
    _rename_tensor(missing_one, gone, gone.replace(".experts.", ".expertz."))
    _refused(missing_one, bad, [f"key '{gone}': missing"])
