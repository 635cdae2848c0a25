"""Issue 36, item 5: ``bridge-submit --dry-run`` runs every check of a real submit that needs no Slurm.

It exited 0 for a job that the real submit refuses with exit 2 (``run folder already holds a different
job``). Now the dry run refuses what the real submit refuses without asking Slurm (the run folder: a
different job in it, one that cannot be created or written), with the same message, leaves nothing
behind, and says on stderr, in one line, which checks needed Slurm and were not run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bridge_test_helpers import MINIMAL_TRAINING_TOML, submit_cli


def slurm_shims(folder: Path) -> Path:
    """``sbatch`` that records each call and answers with the next job id (4242, 4243, ...); ``squeue``
    that records each call and reports nothing running; ``srun`` that does nothing."""
    folder.mkdir()
    (folder / "sbatch").write_text(
        '#!/bin/bash\nhere=$(dirname "$0")\necho "$@" >> "$here/sbatch.calls"\n'
        'id=$(cat "$here/next_id" 2>/dev/null || echo 4242)\necho $((id + 1)) > "$here/next_id"\n'
        'echo "Submitted batch job $id"\n')
    (folder / "squeue").write_text('#!/bin/bash\necho "$@" >> "$(dirname "$0")/squeue.calls"\nexit 0\n')
    (folder / "srun").write_text("#!/bin/bash\nexit 0\n")
    for tool in ("sbatch", "squeue", "srun"):
        (folder / tool).chmod(0o755)
    return folder


def calls(shims: Path, tool: str) -> list:
    path = shims / f"{tool}.calls"
    return path.read_text().splitlines() if path.exists() else []


def folder_state(folder: Path) -> dict:
    """Every file and folder under ``folder`` with its bytes (None for a folder)."""
    return {p: (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


@pytest.fixture
def submitted(tmp_path: Path):
    """A job submitted for real (sbatch shimmed) into runs/job: (its folder, the env with the shims)."""
    shims = slurm_shims(tmp_path / "shims")
    (tmp_path / "job.toml").write_text(MINIMAL_TRAINING_TOML)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")
    first = submit_cli("job.toml", cwd=tmp_path, env=env)
    assert first.returncode == 0 and first.stdout.startswith("Submitted job 4242"), first.stdout + first.stderr
    return tmp_path / "runs" / "job", env, shims


def test_dry_run_refuses_a_run_folder_that_holds_a_different_job(tmp_path: Path, submitted):
    run_dir, env, shims = submitted
    before = folder_state(run_dir)
    other = ["--set", "train.train_iters=2"]
    real = submit_cli("job.toml", *other, cwd=tmp_path, env=env)
    assert real.returncode == 2 and "already holds a different job" in real.stderr, real.stdout + real.stderr
    dry = submit_cli("job.toml", *other, "--dry-run", cwd=tmp_path, env=env)
    assert dry.returncode == 2, dry.stdout + dry.stderr
    assert dry.stderr == real.stderr  # the same one line: file, key job.run_dir, --force
    assert "Traceback" not in dry.stderr and dry.stderr.count("\n") == 1 and dry.stdout == ""
    assert folder_state(run_dir) == before and len(calls(shims, "sbatch")) == 1
    # --force lets both through, as it lets the real submit; the dry run still writes nothing
    forced = submit_cli("job.toml", *other, "--dry-run", "--force", cwd=tmp_path, env=env)
    assert forced.returncode == 0 and forced.stdout.startswith("#!/bin/bash\n"), forced.stderr
    # the same job again (to continue it) is no different job
    again = submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr
    assert folder_state(run_dir) == before and len(calls(shims, "sbatch")) == 1


@pytest.mark.parametrize("where", ["/etc/passwd/x", "/proc/bridge-test/run", "a-file/x", "new/parents/" + "n" * 300])
def test_dry_run_refuses_a_run_folder_that_cannot_be_created(tmp_path: Path, where: str):
    """What the real submit refuses when it makes the run folder, the dry run refuses with the same line;
    neither leaves a folder behind (a name too long for the file system comes after its parents)."""
    (tmp_path / "a-file").write_text("not a folder\n")
    run_dir = where if where.startswith("/") else str(tmp_path / where)
    (tmp_path / "job.toml").write_text(f'[job]\nrun_dir = "{run_dir}"\n' + MINIMAL_TRAINING_TOML)
    env = dict(os.environ, PATH=f"{slurm_shims(tmp_path / 'shims')}:{os.environ['PATH']}")
    real = submit_cli("job.toml", cwd=tmp_path, env=env)
    dry = submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=env)
    assert real.returncode == 2 and "key 'job.run_dir'" in real.stderr, real.stdout + real.stderr
    assert dry.returncode == 2 and dry.stderr == real.stderr and dry.stdout == "", dry.stdout + dry.stderr
    assert not (tmp_path / "new").exists() and not (tmp_path / "runs").exists()


def test_dry_run_says_which_checks_needed_slurm(tmp_path: Path, submitted):
    """One line on stderr (the script alone on stdout): sbatch's own checks of the request were not run,
    nor, for a run folder with jobs, whether they are still live (squeue: the dry run never asks it)."""
    run_dir, env, shims = submitted
    dry = submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=env)
    assert dry.returncode == 0 and dry.stdout.startswith("#!/bin/bash\n"), dry.stderr
    assert dry.stderr.count("\n") == 1 and "need Slurm" in dry.stderr, dry.stderr
    assert "partition, account, qos" in dry.stderr and "job 4242 is still pending or running" in dry.stderr
    assert calls(shims, "squeue") == []
    # --force skips the busy check in a real submit: nothing to say about it
    forced = submit_cli("job.toml", "--dry-run", "--force", cwd=tmp_path, env=env)
    assert forced.returncode == 0 and "4242" not in forced.stderr and "need Slurm" in forced.stderr
    # a fresh run folder: no job to ask about, and the folder the check made is gone again
    fresh = submit_cli("job.toml", "--dry-run", "--set", "job.run_dir=runs/new/deeper", cwd=tmp_path, env=env)
    assert fresh.returncode == 0 and "pending or running" not in fresh.stderr, fresh.stderr
    assert not (tmp_path / "runs" / "new").exists()
    # without Slurm on PATH the line says so
    empty = tmp_path / "empty-path"
    empty.mkdir()
    bare = submit_cli("job.toml", "--dry-run", cwd=tmp_path, env=dict(env, PATH=str(empty)))
    assert bare.returncode == 0 and "sbatch and srun not found on PATH" in bare.stderr, bare.stderr
