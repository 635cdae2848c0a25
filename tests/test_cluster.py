"""Real tests of ``bridge-cluster``: a live Slurm cluster on this machine, no mocks."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from bridge_test_helpers import sacct_state

from bridge_hpc.cli.cluster import main as cluster_main
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.local_slurm.cluster import LocalCluster, release_requeued
from bridge_hpc.local_slurm.conf import MARKER, check_managed


def sh(*argv: str, timeout: float = 120) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(argv)}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# ------------------------------------------------------------------------------ no Slurm needed


def test_check_managed_refuses_foreign_file(tmp_path):
    foreign = tmp_path / "slurm.conf"
    foreign.write_text("ClusterName=production\n")
    with pytest.raises(ConfigError, match="not managed by bridge-cluster"):
        check_managed(foreign)
    ours = tmp_path / "ours.conf"
    ours.write_text(MARKER + "\nClusterName=bridge\n")
    check_managed(ours)  # ours: fine
    check_managed(tmp_path / "absent.conf")  # absent: fine


def test_cli_bad_input_exits_2(capsys):
    assert cluster_main(["up", "--nodes", "0"]) == 2
    assert cluster_main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "--nodes" in err and "Traceback" not in err


@pytest.mark.skipif(os.geteuid() != 0, reason="up needs root")
def test_up_refuses_foreign_slurm_conf(tmp_path):
    """up() checks slurm.conf before starting anything; pointed at a foreign file it refuses."""
    cluster = LocalCluster(str(tmp_path / "state"), quiet=True)
    foreign = tmp_path / "slurm.conf"
    foreign.write_text("ClusterName=production\n")
    cluster.slurm_conf = foreign
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        cluster.up(1)
    assert foreign.read_text() == "ClusterName=production\n"
    assert not (tmp_path / "state" / "pids").exists()


# ------------------------------------------------------------------------------ live cluster


@pytest.mark.slurm
def test_sbatch_two_ranks_and_sacct(slurm_cluster, tmp_path):
    script = write_script(tmp_path / "job.sh", "srun bash -c 'echo rank=$SLURM_PROCID of $SLURM_NTASKS'\n")
    out = tmp_path / "job.out"
    job_id = sh("sbatch", "--parsable", "--wait", "-n", "2", "-o", str(out), str(script)).strip().split(";")[0]
    lines = out.read_text().splitlines()
    assert sorted(lines) == ["rank=0 of 2", "rank=1 of 2"], lines
    assert sacct_state(job_id) == "COMPLETED"


@pytest.mark.slurm
def test_status_reports_live_daemons(slurm_cluster, capsys):
    st = slurm_cluster.status()
    assert st["up"] and st["configured_nodes"] == 1
    for name in ("munged", "mariadbd", "slurmdbd", "slurmctld"):
        assert st["daemons"][name]["alive"], (name, st)
        os.kill(st["daemons"][name]["pid"], 0)
    assert len(st["nodes"]) == 1 and all(s in ("idle", "mixed", "allocated") for s in st["nodes"].values()), st
    assert cluster_main(["status"]) == 0
    printed = capsys.readouterr().out
    assert "slurmctld" in printed and "PARTITION" in printed


@pytest.mark.slurm
def test_preemption_signals_debug_job(slurm_cluster, tmp_path):
    """A running `debug` job gets SIGTERM when an `urgent` job needs its CPUs."""
    mark = tmp_path / "mark"
    task = (
        f'trap "echo TERM rank=$SLURM_PROCID >> {mark}; exit 0" TERM; '
        f"echo started >> {mark}; while true; do sleep 0.1; done"
    )
    script = write_script(tmp_path / "victim.sh", f"srun bash -c '{task}'\n")
    victim = sh("sbatch", "--parsable", "-p", "debug", "-n", "2", "-o", str(tmp_path / "victim.out"),
                str(script)).strip().split(";")[0]
    try:
        wait_for(lambda: mark.exists() and mark.read_text().count("started") == 2, 60, "the debug job to run")
        t0 = time.monotonic()
        urgent = sh("sbatch", "--parsable", "--wait", "-p", "urgent", "-n", "2", "-o", str(tmp_path / "urgent.out"),
                    "--wrap", "echo urgent ran").strip().split(";")[0]
        assert time.monotonic() - t0 < 25, "urgent job waited for the grace time instead of preempting"
        assert "TERM rank=" in mark.read_text(), mark.read_text()
        assert (tmp_path / "urgent.out").read_text().strip() == "urgent ran"
        assert sacct_state(urgent) == "COMPLETED"
    finally:
        subprocess.run(["scancel", victim], capture_output=True)


@pytest.mark.slurm
def test_requeue_and_release(slurm_cluster, tmp_path):
    """A job that requeues itself comes back with the same id once release_requeued() lifts the hold."""
    out = tmp_path / "requeue.out"
    script = write_script(
        tmp_path / "requeue.sh",
        'echo "restart=${SLURM_RESTART_COUNT:-0}"\n'
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then scontrol requeue $SLURM_JOB_ID; sleep 30; fi\n',
    )
    job_id = sh("sbatch", "--parsable", "--requeue", "--open-mode=append", "-o", str(out),
                str(script)).strip().split(";")[0]
    try:
        wait_for(lambda: sh("squeue", "-h", "-j", job_id, "-o", "%r").strip() == "BeginTime", 120,
                 "the requeued job to be held (Reason=BeginTime)")
        release_requeued(job_id)
        wait_for(lambda: out.exists() and "restart=1" in out.read_text(), 120, "the requeued job to run again")
        assert sacct_state(job_id) == "COMPLETED"
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)


@pytest.mark.slurm
def test_two_nodes_one_task_each(slurm_cluster_2nodes, tmp_path):
    assert set(slurm_cluster_2nodes.node_states()) == {"n1", "n2"}
    script = write_script(
        tmp_path / "job.sh",
        "srun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME $SLURM_NODEID'\n",
    )
    for i, layout in enumerate((["--ntasks-per-node=1"], ["-n", "2"])):
        out = tmp_path / f"job{i}.out"
        job_id = sh("sbatch", "--parsable", "--wait", "-N", "2", *layout, "-o", str(out), str(script))
        lines = sorted(out.read_text().splitlines())
        assert lines == ["0 n1 0", "1 n2 1"], (layout, lines)
        assert sacct_state(job_id.strip().split(";")[0]) == "COMPLETED"


@pytest.mark.slurm
@pytest.mark.slow
def test_down_stops_our_pids_and_up_recovers(slurm_cluster, capsys):
    """down stops exactly the pids it recorded; up handles a stale pid file; a second up is a no-op."""
    before = slurm_cluster.status()
    pids = {name: d["pid"] for name, d in before["daemons"].items() if d["alive"]}
    assert {"mariadbd", "slurmdbd", "slurmctld"} <= set(pids)
    try:
        slurm_cluster.down()
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert not slurm_cluster.is_up()
        # a stale pid file: a process that has exited
        dead = subprocess.Popen(["true"])
        dead.wait()
        (slurm_cluster.pid_dir / "slurmctld.pid").write_text(f"{dead.pid}\n")
    finally:
        slurm_cluster.up(1)
    assert slurm_cluster.is_up(1)
    after = slurm_cluster.status()
    assert after["daemons"]["slurmctld"]["pid"] != dead.pid and after["daemons"]["slurmctld"]["alive"]
    capsys.readouterr()
    t0 = time.monotonic()
    slurm_cluster.up(1)
    assert time.monotonic() - t0 < 2
    assert "already up" in capsys.readouterr().out
