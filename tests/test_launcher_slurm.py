"""bridge-submit against the real local Slurm cluster.

The rendered scripts run for real under sbatch/srun. Most tests here swap only the rank program
(``job.python`` points at a small recorder script instead of the Python that would run
``bridge_hpc.rank``), so they check the launcher — script, quoting, environment, srun placement — in a
second each; tests/test_run_slurm.py runs the training entry itself.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import toml
from bridge_test_helpers import MINIMAL_TRAINING, sacct_runs, sacct_state, submit_cli

pytestmark = pytest.mark.slurm

RECORDER = """\
#!{python}
# Stands in for the interpreter of the ranks: records what one rank saw, then exits 0. The batch
# script's other uses of the interpreter (the requeue reader) get the real one.
import json, os, sys
if sys.argv[1:4] != ["-u", "-m", "bridge_hpc.rank"]:
    os.execv("{python}", ["{python}", *sys.argv[1:]])
run_dir = os.environ["BRIDGE_RUN_DIR"]
os.makedirs(os.path.join(run_dir, "ranks"), exist_ok=True)
keys = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURMD_NODENAME", "SLURM_NODEID", "SLURM_JOB_NAME",
        "EVIL", "API_KEY", "BRIDGE_CONFIG"]
record = {{"argv": sys.argv[1:], **{{k: os.environ.get(k) for k in keys}}}}
with open(os.path.join(run_dir, "ranks", os.environ["SLURM_PROCID"] + ".json"), "w") as f:
    json.dump(record, f)
"""


def make_job(tmp_path: Path, **sections) -> Path:
    recorder = tmp_path / "recorder"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    doc = {"job": {"name": "launch-test", "python": str(recorder)}, "slurm": {"time": "00:05:00", "ntasks_per_node": 2},
           **copy.deepcopy(MINIMAL_TRAINING)}
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    path = tmp_path / "job.toml"
    path.write_text(toml.dumps(doc))
    return path


def ranks(run_dir: Path) -> list:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("*.json"))]


def job_id_of(stdout: str) -> str:
    first = stdout.splitlines()[0]
    assert first.startswith("Submitted job "), stdout
    return first.split()[2]


def test_two_ranks_on_one_node_run_and_the_run_folder_is_complete(slurm_cluster, tmp_path: Path):
    make_job(tmp_path)
    result = submit_cli("job.toml", "--wait", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = job_id_of(result.stdout)
    run_dir = tmp_path / "runs" / "launch-test"
    seen = ranks(run_dir)
    assert sorted(r["SLURM_PROCID"] for r in seen) == ["0", "1"]
    assert all(r["SLURM_NTASKS"] == "2" for r in seen)
    assert all(r["argv"] == ["-u", "-m", "bridge_hpc.rank", str(run_dir / "resolved.toml")] for r in seen)
    # the run folder: the script exactly as submitted, the resolved config, the log, the submission record
    script = (run_dir / "job.sbatch").read_text()
    assert (run_dir / "logs" / f"{job_id}_submission.sh").resolve().read_text() == script
    resolved = toml.loads((run_dir / "resolved.toml").read_text())
    assert resolved["job"]["run_dir"] == str(run_dir) and resolved["slurm"]["ntasks_per_node"] == 2
    log = (run_dir / "logs" / f"{job_id}_0_log.out").read_text()
    assert f"bridge_hpc: job {job_id} restart 0" in log
    assert [json.loads(line)["job_id"] for line in (run_dir / "jobs.jsonl").read_text().splitlines()] == [job_id]
    # submitit tracks the job through sacct
    import submitit

    assert submitit.SlurmJob(folder=run_dir / "logs", job_id=job_id).state == "COMPLETED"
    assert sacct_state(job_id) == "COMPLETED"
    # bridge-status reads the same
    status = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.status", str(run_dir), "--json"],
                            capture_output=True, text=True)
    info = json.loads(status.stdout)
    assert info["jobs"][0]["job_id"] == job_id and info["jobs"][0]["state"] == "COMPLETED"
    assert info["jobs"][0]["restarts"] == 0 and info["jobs"][0]["logs"][0].endswith(f"{job_id}_0_log.out")


def test_injection_strings_stay_inert_when_the_script_runs(slurm_cluster, tmp_path: Path):
    marker = Path("/tmp") / f"bridge-pwned-{uuid.uuid4().hex}"
    evil = f"x$(touch {marker})`touch {marker}`'\"; touch {marker}"
    make_job(tmp_path, job={"name": evil, "run_dir": "runs/evil"}, env={"EVIL": evil})
    result = submit_cli("job.toml", "--wait", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = ranks(tmp_path / "runs" / "evil")
    assert len(seen) == 2
    assert all(r["EVIL"] == evil and r["SLURM_JOB_NAME"] == evil for r in seen)
    assert not marker.exists()


def test_secret_reaches_the_ranks_but_no_file(slurm_cluster, tmp_path: Path):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    make_job(tmp_path, env={"API_KEY": {"from_shell": "BRIDGE_TEST_SECRET"}})
    result = submit_cli("job.toml", "--wait", cwd=tmp_path, env=dict(os.environ, BRIDGE_TEST_SECRET=secret))
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "launch-test"
    assert all(r["API_KEY"] == secret for r in ranks(run_dir))
    for path in run_dir.rglob("*"):
        if path.is_file() and path.parent.name != "ranks":
            assert secret not in path.read_text(errors="replace"), path


def test_a_different_job_is_refused_in_an_existing_run_folder(slurm_cluster, tmp_path: Path):
    make_job(tmp_path)
    first = submit_cli("job.toml", "--wait", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "runs" / "launch-test"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    second = submit_cli("job.toml", "--set", "slurm.time=00:06:00", cwd=tmp_path)
    assert second.returncode == 2 and "key 'job.run_dir'" in second.stderr and "Traceback" not in second.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # the same job again is welcome (it resumes), and the folder keeps one script
    again = submit_cli("job.toml", "--wait", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert len((run_dir / "jobs.jsonl").read_text().splitlines()) == 2
    assert not list(run_dir.glob("job.sbatch.*"))


def live_state(job_id: str) -> str:
    """squeue's state of a job ("" once the controller has forgotten it)."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def wait_for_state(job_id: str, wanted, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = live_state(job_id)
        if state in wanted or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


SLEEPER = """#!/bin/bash
# Stands in for the interpreter of the ranks: a rank that runs until the job is cancelled, then
# stops cleanly as a real one does (so the batch script does not retry it as a failure).
[ "$1 $2 $3" = "-u -m bridge_hpc.rank" ] || exec {python} "$@"
trap 'exit 0' TERM
sleep 600 &
wait
"""


def test_a_run_folder_in_use_refuses_a_second_job(slurm_cluster, tmp_path: Path):
    """Two submits of one config into one run folder: while the first job is pending or running the
    second is refused with its id (exit 2, nothing in the folder rewritten); --force submits anyway;
    once the jobs are over the folder takes the next one (which resumes there)."""
    sleeper = tmp_path / "sleeper"
    sleeper.write_text(SLEEPER.format(python=sys.executable))
    sleeper.chmod(0o755)
    make_job(tmp_path, job={"name": f"busy-{uuid.uuid4().hex[:8]}", "python": str(sleeper)},
             slurm={"extra": {"hold": True}})  # held: pending until released
    run_dir = tmp_path / "runs" / "busy"
    ids = []
    try:
        first = submit_cli("job.toml", "--set", f"job.run_dir={run_dir}", cwd=tmp_path)
        assert first.returncode == 0, first.stdout + first.stderr
        ids.append(job_id_of(first.stdout))
        assert wait_for_state(ids[0], {"PENDING"}) == "PENDING"
        script = (run_dir / "job.sbatch").read_bytes()
        before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

        second = submit_cli("job.toml", "--set", f"job.run_dir={run_dir}", cwd=tmp_path)
        assert second.returncode == 2, second.stdout + second.stderr
        assert "Traceback" not in second.stderr and second.stderr.count("\n") == 1
        assert "key 'job.run_dir'" in second.stderr and f"job {ids[0]}" in second.stderr
        assert "PENDING" in second.stderr and "--force" in second.stderr and str(run_dir) in second.stderr
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
        assert (run_dir / "job.sbatch").read_bytes() == script

        # running (when the node is free: another session's jobs may keep it pending) is no different
        subprocess.run(["scontrol", "release", ids[0]], check=True, capture_output=True)
        state = wait_for_state(ids[0], {"RUNNING"}, timeout=30)
        third = submit_cli("job.toml", "--set", f"job.run_dir={run_dir}", cwd=tmp_path)
        assert third.returncode == 2 and f"job {ids[0]}" in third.stderr and state in third.stderr, third.stderr
        assert (run_dir / "job.sbatch").read_bytes() == script

        forced = submit_cli("job.toml", "--set", f"job.run_dir={run_dir}", "--force", cwd=tmp_path)
        assert forced.returncode == 0, forced.stdout + forced.stderr
        ids.append(job_id_of(forced.stdout))
        assert ids[1] != ids[0]
        assert [json.loads(line)["job_id"] for line in (run_dir / "jobs.jsonl").read_text().splitlines()] == ids

        subprocess.run(["scancel", *ids], check=True, capture_output=True)
        for job_id in ids:
            assert wait_for_state(job_id, {"", "CANCELLED"}) in ("", "CANCELLED")
        after = submit_cli("job.toml", "--set", f"job.run_dir={run_dir}", cwd=tmp_path)
        assert after.returncode == 0, after.stdout + after.stderr
        ids.append(job_id_of(after.stdout))
    finally:
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True)


CRASHER = """#!/bin/bash
# Stands in for the interpreter of the ranks: a rank that leaves on the cancel's SIGTERM with the given
# status instead of checkpointing: 1, a failure (a crash in its handler, a container runtime killing it),
# or 0, as if it had finished.
[ "$1 $2 $3" = "-u -m bridge_hpc.rank" ] || exec {python} "$@"
# the trap first, then the word that it started: a SIGTERM after the word meets the trap, on any load
trap 'exit {status}' TERM
echo started > "$BRIDGE_RUN_DIR/rank.$SLURM_PROCID"
sleep 600 &
wait
"""


@pytest.mark.parametrize("rank_status", [1, 0], ids=["ranks-fail", "ranks-exit-0"])
def test_a_cancel_is_final_even_when_the_ranks_fail_on_it(slurm_cluster, tmp_path: Path, rank_status):
    """Plain scancel while ranks that leave on SIGTERM without a checkpoint run: the batch script's
    retry-on-failure path must not requeue a job the user cancelled (it asks Slurm why the job stops, as
    the ranks do), and ranks that exit 0 on it do not make the cancel a "done"."""
    crasher = tmp_path / "crasher"
    crasher.write_text(CRASHER.format(python=sys.executable, status=rank_status))
    crasher.chmod(0o755)
    make_job(tmp_path, job={"name": f"cancel-{uuid.uuid4().hex[:8]}", "python": str(crasher)},
             slurm={"retries_without_progress": 5})
    run_dir = tmp_path / "runs" / "cancelled"
    result = submit_cli("job.toml", "--set", f"job.run_dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = job_id_of(result.stdout)
    try:
        deadline = time.monotonic() + 60
        started = [run_dir / "rank.0", run_dir / "rank.1"]  # both ranks' traps are set
        while not all(p.exists() for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(p.exists() for p in started), "the ranks did not start"
        subprocess.run(["scancel", job_id], check=True, capture_output=True)
        assert sacct_state(job_id, timeout=60) == "CANCELLED"
        time.sleep(3)  # a requeue would show up as a pending job or a REQUEUED run by now
        assert live_state(job_id) in ("", "CANCELLED"), live_state(job_id)
        runs = sacct_runs(job_id)
        assert runs and all(r == "CANCELLED" for r in runs), runs
        log = (run_dir / "logs" / f"{job_id}_0_log.out").read_text()
        assert "not requeueing" in log and "cancelled" in log and f"requeueing {job_id} (restart" not in log, log
        assert "bridge_hpc: done" not in log, log
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)


def test_dry_run_submits_nothing(slurm_cluster, tmp_path: Path):
    make_job(tmp_path, job={"name": f"dry-{uuid.uuid4().hex[:8]}"})
    name = toml.loads((tmp_path / "job.toml").read_text())["job"]["name"]
    result = submit_cli("job.toml", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0
    queued = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobName", "--name", name, "-S", "now-1hour"],
                            capture_output=True, text=True)
    assert queued.returncode == 0 and queued.stdout.strip() == ""
    assert not (tmp_path / "runs").exists()


def test_two_nodes_one_rank_each(slurm_cluster_2nodes, tmp_path: Path):
    make_job(tmp_path, slurm={"nodes": 2, "ntasks_per_node": 1})
    result = submit_cli("job.toml", "--wait", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = ranks(tmp_path / "runs" / "launch-test")
    assert sorted((r["SLURM_PROCID"], r["SLURM_NODEID"]) for r in seen) == [("0", "0"), ("1", "1")]
    assert len({r["SLURMD_NODENAME"] for r in seen}) == 2
