"""The stop signal, end to end: every ``[slurm] signal`` form that bridge-submit accepts makes the
ranks checkpoint and the job requeue on the real local cluster; every form that could not work is
refused at submission, naming the key.

Slurm sends the warning signal from a periodic check (every 30 s in 22.05) once the time left is
below the configured seconds; with a 3-minute limit and ``@140`` it arrives 40 to 70 s into the run:
after the first steps even when two ranks start at once on a loaded 2-core machine (a signal before
the first step leaves nothing to save), and well before the ranks' own end-time rule would stop them
(about 70 s before the end), so what stops each run here is the signal itself.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from bridge_test_helpers import FAULTY_FORWARD_STEP, log_text, sacct_runs, squeue_state, submit, wait_until_gone

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.progress_log import parse_progress
from bridge_hpc.contracts.signals import ALLOWED, parse_slurm_signal
from bridge_hpc.training.checkpoint.checkpointing import complete_iterations

ROOT = Path(__file__).resolve().parent.parent

#: One job per form; every allowed signal plus the batch-only and reservation prefixes.
FORMS = [f"{name}@140" for name in ALLOWED] + ["B:USR2@140", "R:USR1@140"]


def _one_rank_job(run_dir: Path, form: str) -> str:
    # One rank each, so the 2-CPU node runs two of these jobs at once; a floor under the step time
    # so that no run finishes before the warning.
    return submit(run_dir, 5000, ["slurm.ntasks_per_node=1", "slurm.time=00:03:00", f"slurm.signal='{form}'",
                                  "checkpoint.save_interval=1000", f"job.forward_step='{FAULTY_FORWARD_STEP}:forward_step'",
                                  "env.TEST_STEP_SLEEP='0.02'"])


def _requeued(job_id: str) -> bool:
    state = squeue_state(job_id)
    return "REQUEUED" in sacct_runs(job_id) or (state is not None and state[0] == "PENDING" and "BeginTime" in state[1])


@pytest.mark.slurm
@pytest.mark.slow
def test_each_accepted_signal_form_checkpoints_and_requeues(slurm_cluster, tmp_path):
    jobs = {form: (tmp_path / form.replace(":", "_").replace("@", "_"), None) for form in FORMS}
    jobs = {form: (run_dir, _one_rank_job(run_dir, form)) for form, (run_dir, _) in jobs.items()}
    try:
        deadline = time.time() + 900
        pending = dict(jobs)
        while pending and time.time() < deadline:
            for form, (run_dir, job_id) in list(pending.items()):
                if _requeued(job_id):
                    subprocess.run(["scancel", job_id], check=False)
                    del pending[form]
                elif squeue_state(job_id) is None:
                    pytest.fail(f"{form}: job {job_id} ended without a requeue: {sacct_runs(job_id)}\n"
                                f"{log_text(run_dir, job_id)[-3000:]}")
            time.sleep(1)
        assert not pending, f"not requeued in time: {sorted(pending)}"
    finally:
        for _, job_id in jobs.values():
            subprocess.run(["scancel", job_id], check=False)
        wait_until_gone([job_id for _, job_id in jobs.values()])

    for form, (run_dir, job_id) in jobs.items():
        log = log_text(run_dir, job_id)
        stop = parse_slurm_signal(form)
        # the ranks saw the configured signal (not the end-time rule, not SIGTERM from Slurm's kill)
        assert "exiting at iteration" in log and "signal received" in log, (form, log[-3000:])
        if stop.batch_only:
            assert f"batch script got SIG{stop.name}: forwarding it to the ranks" in log, (form, log[-3000:])
        runs = parse_progress(str(run_dir / run_folder.CHECKPOINTS_DIR / run_folder.PROGRESS_FILE))
        end = runs[0].last("Ending job")
        assert end is not None and end.fields["Reason"] == "time_limit" and end.fields["Steps lost"] == "0", (form, end)
        iteration = int(end.fields["Iteration"])
        assert iteration > 0 and iteration in complete_iterations(str(run_dir / run_folder.CHECKPOINTS_DIR)), form
        assert "requeueing" in log, (form, log[-3000:])


@pytest.mark.parametrize("form", ["KILL@60", "STOP@60", "CONT@60", "USR1@99999", "USR1@", "B:", "BB:USR1@60",
                                  "X:USR1@60", "USR1@60\n", "USR1@60 ", "99@60", "$(touch x)@60"])
def test_forms_that_cannot_work_are_refused_naming_the_key(tmp_path, form):
    job = tmp_path / "job.toml"
    job.write_text((ROOT / "configs" / "local-tiny.toml").read_text().replace('extends = "clusters/local.toml"\n', ""))
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run",
                           "--set", f"slurm.signal={form!r}".replace("\n", "\\n")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "key 'slurm.signal'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("form,ranks,traps", [
    ("USR1@120", ("SIGUSR1", "SIGTERM"), ("USR1", "TERM")),
    ("USR2@60", ("SIGUSR2", "SIGTERM"), ("USR2", "TERM")),
    ("TERM@60", ("SIGTERM",), ("TERM",)),
    ("B:HUP@60", ("SIGHUP", "SIGTERM"), ("HUP", "TERM")),
    ("SIGINT", ("SIGINT", "SIGTERM"), ("INT", "TERM")),
    ("12@30", ("SIGUSR2", "SIGTERM"), ("USR2", "TERM")),
])
def test_one_definition_reaches_every_consumer(tmp_path, form, ranks, traps):
    """The sbatch line, the traps, the ranks' handlers and the FT launcher's ignore list all come from
    the one parse of [slurm] signal."""
    from bridge_hpc.jobfile.jobconfig import load_job_config
    from bridge_hpc.launch.render import render_script

    job = tmp_path / "job.toml"
    example = (ROOT / "configs" / "local-tiny-fault-tolerance.toml").read_text()
    job.write_text(example.replace('extends = "clusters/local.toml"\n', ""))
    cfg = load_job_config(job, [f"slurm.signal='{form}'"], cwd=tmp_path)
    stop = parse_slurm_signal(form)
    assert tuple(cfg.training.train.exit_signal) == ranks == stop.rank_signals
    script = render_script(cfg)
    assert f"#SBATCH --signal={stop.sbatch_value}\n" in script
    for name in traps:
        assert f"' {name}\n" in script  # trap '...' NAME
    ignored = ",".join(s for s in ranks if s != "SIGTERM")
    assert f"--bridge-ignore-signals={ignored}" in script
