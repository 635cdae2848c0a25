"""bridge-report and bridge-status on damaged, copied, moved and missing run folders (issue 25: 2, 3, 11, 12).

Two real jobs are run once for the module on the local cluster: the demo (configs/local-tiny.toml, 6 steps,
checkpoints at 3 and 6, progress logging on) and the same demo with a forward step that fails before the
first step is done (no retries). Each case copies a run folder (shutil.copytree), damages the copy the
way a disk, a kill or a person would, and checks what the tools say about it:

* the folder named is the one read: a copied or moved folder never reports its original's figures, and
  one line on stderr says that it was moved or copied (item 2);
* a run that trained no step has goodput 0 %, in the table, the JSON and the figure (item 3);
* damage that leaves something usable is passed over, counted and said in one line, exit 0; only an
  argument with nothing usable left is refused: exit 2 and one line (item 11);
* bridge-status refuses a folder that does not exist, and no word of a damaged jobs.jsonl reaches
  squeue, sacct or scontrol (item 12).

The command-line tools run as a user runs them (a fresh interpreter) wherever their output is checked
whole: one line per message, no traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bridge_test_helpers import CONFIG, ROOT, drive, log_text, submit_cli

from bridge_hpc.cli.report import load_run_report
from bridge_hpc.cli.watch import LiveReader
from bridge_hpc.report.units import format_rate
from bridge_hpc.slurm import query

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 6
#: The demo, small: checkpoints (and progress-log save lines) at 3 and 6, a metrics record per step.
DEMO = ("train.train_iters=6", "checkpoint.save_interval=3", "logger.log_interval=1", "train.eval_interval=3")
FAILING_STEP = '''def forward_step(*args, **kwargs):
    raise RuntimeError("this forward step fails on purpose, before the first step is done")
'''
HOSTILE_NAMES = ["new\nline", "$(touch PWNED)", "100% %s %n", "tab\there `id` ; rm -rf x"]


@pytest.fixture(scope="module")
def runs(slurm_cluster, tmp_path_factory) -> dict:
    """{"good": (run_dir, job_id), "failed": (run_dir, job_id)}: the demo COMPLETED, and the demo whose
    forward step raises before its first step is done, FAILED without a retry."""
    base = tmp_path_factory.mktemp("report-damage")
    step = base / "failing_step.py"
    step.write_text(FAILING_STEP)
    jobs = {}
    for name, extra in (("good", ()),
                        ("failed", (f"job.forward_step='{step}:forward_step'", "slurm.retries_without_progress=0"))):
        args = [str(CONFIG), "--set", f"job.run_dir={base / name}"]
        for item in DEMO + extra:
            args += ["--set", item]
        proc = submit_cli(*args, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        jobs[name] = (base / name, proc.stdout.split()[2])
    for name, want in (("good", "COMPLETED"), ("failed", "FAILED")):
        run_dir, job_id = jobs[name]
        assert drive(job_id, timeout=600) == want, log_text(run_dir, job_id)[-3000:]
    return jobs


def copy(runs: dict, which: str, to: Path) -> Path:
    """A copy of a real run folder (its resolved.toml still names the original)."""
    shutil.copytree(runs[which][0], to, symlinks=True)
    return to


def cli(tool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``bridge-report``/``bridge-status`` as a user runs it; no traceback, whatever it says."""
    proc = subprocess.run([sys.executable, "-m", f"bridge_hpc.cli.{tool}", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def messages(proc: subprocess.CompletedProcess) -> list:
    """stderr's lines, each checked to be a one-line ``note:`` or ``error:`` message."""
    lines = proc.stderr.splitlines()
    assert all(re.match(r"(note|error): \S", line) for line in lines), proc.stderr
    return lines


def metrics_records(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def progress(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "progress.txt"


def rewrite_lines(path: Path, change) -> None:
    """Apply ``change`` to the list of the file's lines (bytes, newline-less) and write them back."""
    lines = path.read_bytes().split(b"\n")
    change(lines)
    path.write_bytes(b"\n".join(lines))


# --------------------------------------------------------------------------------------------------
# Item 2: the folder named is the truth


def test_copied_and_moved_folders_report_themselves_not_their_original(runs, tmp_path):
    good, _ = runs["good"]
    copy(runs, "good", tmp_path / "copied")
    moved = copy(runs, "good", tmp_path / "staging")
    moved = moved.rename(tmp_path / "moved")  # a folder moved after the job: its original place is gone too
    # damage the moved one: it lost the run's end and the steps after the first checkpoint
    rewrite_lines(progress(moved), lambda lines: lines.__delitem__(slice(3, -1)))  # Starting, First step, save 3
    (moved / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_records(good)[:3]))

    proc = cli("report", "copied", "moved", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    copied_json, moved_json = json.loads(proc.stdout)["reports"]
    assert copied_json["progress_log"] == os.path.join("copied", "checkpoints", "progress.txt")
    assert moved_json["progress_log"] == os.path.join("moved", "checkpoints", "progress.txt")
    assert moved_json["metrics"] == os.path.join("moved", "metrics.jsonl")
    assert (copied_json["totals"]["steps"], copied_json["totals"]["final_step"]) == (STEPS, STEPS)
    assert (moved_json["totals"]["steps"], moved_json["totals"]["final_step"]) == (3, 3)
    assert moved_json["runs"][0]["reason"] is None and copied_json["runs"][0]["reason"] == "done"
    assert messages(proc) == [
        f"note: {name}: its resolved.toml says the job ran in {good}: this folder was moved or copied from there, "
        f"and the paths recorded there are read under {name}" for name in ("copied", "moved")]

    table = cli("report", "copied", "moved", cwd=tmp_path)
    rows = table.stdout.split("comparison\n")[1].splitlines()[1:]
    assert [re.split(r"\s{2,}", row)[:4] for row in rows] == [["copied", "2 cpu", "1", "6"], ["moved", "2 cpu", "1", "3"]]


def test_live_view_and_status_of_a_moved_folder_read_that_folder(runs, tmp_path):
    good, job_id = runs["good"]
    moved = copy(runs, "good", tmp_path / "moved")
    (moved / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_records(good)[:2]))
    status = LiveReader(moved, job_id).poll()  # what bridge-status --follow shows: Slurm's job, this folder's files
    assert (status.state, status.step, status.train_iters) == ("COMPLETED", 2, STEPS)
    assert LiveReader(good, job_id).poll().step == STEPS

    proc = cli("status", str(moved), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert messages(proc) == [f"note: {moved}: its resolved.toml says the job ran in {good}: this folder was moved or "
                              f"copied from there, and the paths recorded there are read under {moved}"]
    assert f"{job_id}  COMPLETED" in proc.stdout and f"{moved}/logs/{job_id}_0_log.out" in proc.stdout


# --------------------------------------------------------------------------------------------------
# Item 3: honest goodput


def test_a_run_that_failed_before_its_first_step_has_goodput_0(runs, tmp_path):
    failed, job_id = runs["failed"]
    proc = cli("report", str(failed), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    (row,) = data["runs"]
    assert (row["job_id"], row["reason"], row["steps"], row["training_s"]) == (job_id, "error", 0, 0.0)
    totals = data["totals"]
    assert totals["goodput"] == 0.0 and totals["training_s"] == 0.0 and totals["allocated_s"] > 0
    # the run's time is start-up (it never got past it), and the segments still add up
    assert totals["lost_s"]["start-up"] == pytest.approx(totals["allocated_s"]) and totals["complete"]

    text = cli("report", str(failed), cwd=tmp_path).stdout
    assert re.search(r"^training\s+0\.0\s+0\.0%$", text, re.M) and "\ngoodput 0.0%\n" in text

    from bridge_hpc.report.plot import build_figure

    goodput = build_figure([load_run_report(str(failed))]).axes[3]
    widths = {c.get_label().split(" ")[0]: sum(p.get_width() for p in c.patches) for c in goodput.containers}
    assert widths["training"] == 0 and widths["start-up"] > 0
    assert goodput.get_title().startswith("goodput 0.0% ")


# --------------------------------------------------------------------------------------------------
# Item 11: best effort on damage


SKIPPED_PROGRESS = "that could not be read (damaged, cut short, or of no run)"
SKIPPED_METRICS = "that are not complete JSON records"


def torn_metrics_line(run_dir: Path) -> list:
    """A record cut short in the middle of metrics.jsonl (a full disk, then more records)."""
    rewrite_lines(run_dir / "metrics.jsonl", lambda lines: lines.__setitem__(2, lines[2][:25]))  # step 3
    return [f"metrics.jsonl: skipped 1 of 6 lines (3) {SKIPPED_METRICS}"]


def non_utf8_bytes(run_dir: Path) -> list:
    """Bytes that are not UTF-8 in a metrics record and in a progress line (a flipped bit)."""
    rewrite_lines(run_dir / "metrics.jsonl", lambda lines: lines.__setitem__(1, lines[1][:12] + b"\xff\xfe" + lines[1][12:]))
    rewrite_lines(progress(run_dir), lambda lines: lines.__setitem__(2, lines[2].replace(b"Iteration: 3", b"Iteration: \xc33")))
    return [f"checkpoints/progress.txt: skipped 1 of 5 lines (3) {SKIPPED_PROGRESS}",
            f"metrics.jsonl: skipped 1 of 6 lines (2) {SKIPPED_METRICS}"]


def cut_short_progress(run_dir: Path) -> list:
    """progress.txt truncated in its fourth line (a copy interrupted, a disk that filled)."""
    def cut(lines: list) -> None:
        lines[3:] = [lines[3][:30]]

    rewrite_lines(progress(run_dir), cut)
    return [f"checkpoints/progress.txt: skipped 1 of 4 lines (4) {SKIPPED_PROGRESS}"]


def unreadable_resolved_toml(run_dir: Path) -> list:
    """A resolved.toml that is neither UTF-8 nor TOML: the default paths remain."""
    (run_dir / "resolved.toml").write_bytes(b"[job\nrun_dir = \xff\n")
    return ["resolved.toml: passed over (not UTF-8 text at byte 16); the run folder's default paths are read"]


@pytest.mark.parametrize("damage", [torn_metrics_line, non_utf8_bytes, cut_short_progress, unreadable_resolved_toml])
def test_damage_that_leaves_most_data_is_passed_over_counted_and_said(runs, tmp_path, damage):
    run_dir = copy(runs, "good", tmp_path / "run")
    said = damage(run_dir)
    proc = cli("report", "run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in messages(proc) if "moved or copied" not in line]
    assert notes == [f"note: run/{line}" for line in said]
    data = json.loads(proc.stdout)
    assert data["notes"] == [line[len("note: "):] for line in messages(proc)]
    assert data["progress_log"] == os.path.join("run", "checkpoints", "progress.txt")
    # the rest is reported: the run, its goodput, the curves
    assert data["totals"]["runs"] == 1 and data["totals"]["final_step"] == STEPS
    assert isinstance(data["totals"]["goodput"], float) and data["totals"]["tokens_per_s"] > 0


def test_no_progress_log_says_log_progress_and_reports_metrics_alone(runs, tmp_path):
    run_dir = copy(runs, "good", tmp_path / "run")
    progress(run_dir).unlink()
    proc = cli("report", "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (note,) = [line for line in messages(proc) if "moved or copied" not in line]
    assert note.startswith("note: run: no progress.txt (looked in run/checkpoints, run and below); ")
    assert "logger.log_progress is on in this run's resolved.toml" in note
    assert note.endswith("reported from run/metrics.jsonl alone: the runs, where the time went and goodput are unknown")
    records = metrics_records(run_dir)
    trained = records[1:]  # the first step compiles and warms up
    rate = sum(r["tokens_per_s"] * r["step_time_s"] for r in trained) / sum(r["step_time_s"] for r in trained)
    assert proc.stdout.splitlines() == [
        "no progress log: the runs, where the time went and goodput are unknown",
        f"from run/metrics.jsonl: steps 1-{STEPS} ({STEPS} records), final loss {records[-1]['loss']:.4f}, "
        f"validation loss {records[-1]['val_loss']:.4f}, tokens/s {format_rate(rate)}",
        "goodput ?",
    ]
    data = json.loads(cli("report", "run", "--json", cwd=tmp_path).stdout)
    assert data["progress_log"] is None and data["runs"] == []
    assert data["totals"]["goodput"] is None and data["totals"]["steps"] is None
    assert data["totals"]["final_step"] == STEPS and data["totals"]["tokens_per_s"] > 0

    # with the setting off in resolved.toml, the message says so; with no metrics either, nothing is left
    resolved = run_dir / "resolved.toml"
    resolved.write_text(resolved.read_text().replace("log_progress = true", "log_progress = false"))
    (run_dir / "metrics.jsonl").unlink()
    proc = cli("report", "run", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert [line for line in messages(proc) if "moved or copied" not in line] == [
        "error: run: no progress.txt (looked in run/checkpoints, run and below); progress logging "
        "(logger.log_progress) is off in this run's resolved.toml; nothing else to report (run/metrics.jsonl: no such file)"]


def test_nothing_usable_left_is_refused_in_one_line(runs, tmp_path):
    run_dir = copy(runs, "good", tmp_path / "run")
    progress(run_dir).write_bytes(b"\x00" * 100 + b"\n")  # zeroed by a crash of the file system
    (run_dir / "metrics.jsonl").write_bytes(b"\xff\xfe garbage\n{not json}\n")
    proc = cli("report", "run", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert messages(proc)[-1] == (
        "error: run/checkpoints/progress.txt: no 'Starting job' line: not a progress log, or no run has started; "
        "nothing else to report (run/metrics.jsonl: no record with a loss)")
    # next to a usable folder: that one is reported, this one refused in its line, and the status says so
    good = copy(runs, "good", tmp_path / "good")
    proc = cli("report", str(good), "run", cwd=tmp_path)
    # the table first (its first column is as wide as the job ids, so not a fixed spacing)
    assert proc.returncode == 2 and proc.stdout.split()[:2] == ["job", "restart"]
    assert sum(line.startswith("error: ") for line in messages(proc)) == 1


def test_the_failed_runs_empty_metrics_are_no_obstacle(runs, tmp_path):
    """The failed run wrote an empty metrics.jsonl: its progress log alone makes its report."""
    failed, _ = runs["failed"]
    assert (failed / "metrics.jsonl").read_bytes() == b""
    proc = cli("report", str(failed), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "" and "goodput 0.0%" in proc.stdout


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_folder_names(runs, tmp_path, name):
    run_dir = copy(runs, "good", tmp_path / name)
    for tool, args in (("report", [name]), ("report", [name, "--json"]), ("status", [name])):
        proc = cli(tool, *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and "moved or copied" in proc.stderr  # one line, however named
    assert json.loads(cli("report", name, "--json", cwd=tmp_path).stdout)["target"] == name
    two = cli("report", name, str(run_dir), cwd=tmp_path)
    assert two.returncode == 0 and len(two.stdout.split("comparison\n")[1].splitlines()) == 3  # header, 2 rows
    missing = name + "-missing"
    for tool in ("report", "status"):
        proc = cli(tool, missing, cwd=tmp_path)
        assert proc.returncode == 2 and len(messages(proc)) == 1
    assert not (tmp_path / "PWNED").exists() and not (ROOT / "PWNED").exists()


# --------------------------------------------------------------------------------------------------
# Item 12: bridge-status


def test_status_of_a_folder_that_does_not_exist(tmp_path):
    missing = tmp_path / "no" / "such"
    proc = cli("status", str(missing), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert messages(proc) == [f"error: {missing}: no such folder"]
    (tmp_path / "file").write_text("")
    proc = cli("status", "file", cwd=tmp_path)
    assert proc.returncode == 2 and messages(proc) == ["error: file: not a folder: expected a run folder (job.run_dir)"]


def test_status_passes_over_damaged_jobs_lines_and_hands_slurm_only_job_ids(runs, tmp_path):
    _, job_id = runs["good"]
    run_dir = copy(runs, "good", tmp_path / "run")
    with open(run_dir / "jobs.jsonl", "ab") as f:
        f.write(b'{"job_id": "--help"}\n{"job_id": "1,2"}\nnot json\n\xff\xfe\n{"job_id": true}\n{"job_id": "-j1')
    proc = cli("status", "run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [job["job_id"] for job in json.loads(proc.stdout)["jobs"]] == [job_id]
    assert json.loads(proc.stdout)["jobs"][0]["state"] == "COMPLETED"
    notes = [line for line in messages(proc) if "moved or copied" not in line]
    assert notes == ['note: run/jobs.jsonl: skipped 6 lines (2, 3, 4, 5, 6, ...) without a Slurm job id (expected JSON '
                     'lines with a "job_id" of digits, or <job>_<task>)']

    (run_dir / "jobs.jsonl").write_bytes(b'{"job_id": "--help"}\n')
    proc = cli("status", "run", cwd=tmp_path)
    assert proc.returncode == 2 and [line for line in messages(proc)] == [
        'error: run/jobs.jsonl: no Slurm job id in any line: 1 line (1) passed over (expected JSON lines with a '
        '"job_id" of digits, or <job>_<task>)']


@pytest.mark.parametrize("word", ["--help", "-h", "1,2", "1 2", "", "1_", "_1", "--jobs=1", "\n1"])
def test_slurm_queries_refuse_words_that_are_not_job_ids(slurm_cluster, word):
    """What squeue/sacct/scontrol would read as an option or a list never reaches them (``squeue -j --help``
    prints its usage, which the old reader took for the job's state)."""
    assert query.job_runs(word) == [] and query.live_state(word) is None and query.job_times(word) is None
    assert query.scontrol_job(word) == {} and query.stop_cause(word, 0) is None
    assert not query.is_job_id(word)


def test_slurm_queries_take_job_and_array_task_ids(runs):
    _, job_id = runs["good"]
    assert query.is_job_id(job_id) and query.is_job_id("12_3")
    assert [run.state for run in query.job_runs(job_id)] == ["COMPLETED"]
