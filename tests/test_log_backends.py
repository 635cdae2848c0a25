"""W&B (offline), MLflow (local store) and Comet (offline) as the ranks use them, read back with each one's
own reader: ``wandb leet inspect --json`` on the ``.wandb`` files, ``MlflowClient.get_metric_history``, the
Comet archives' ``messages.json`` (Comet's offline format, its own constants).

* ``test_resumed_runs_leave_one_run_per_backend_each_step_once`` (~25 s): three runs of a job in their own
  processes, the first failing after training past its checkpoint; every backend holds one run whose steps
  and values are metrics.jsonl's.
* ``test_a_killed_run_loses_nothing_the_next_run_does_not_log`` (~20 s): the same with SIGKILL (W&B, MLflow).
* ``test_a_failing_backend_is_one_warning_and_training_goes_on``: a package missing, a server unreachable.
* ``test_bridge_loggers_and_the_moe_fanout_join_the_step``: GlobalState's ``wandb_logger`` /
  ``mlflow_logger`` / ``comet_logger`` and ``_MoeMetricFanoutWriter``.
* the defaults import nothing; a Comet key in a Python config is never written; bad keys at submission.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from bridge_test_helpers import TINY

from bridge_hpc.contracts.run_folder import COMET_DIR, LOGGER_RUNS_FILE, METRICS_FILE, WANDB_DIR
from bridge_hpc.training.engine.metrics import read_metrics

REPO = str(Path(__file__).resolve().parent.parent)
ALL_ON = ['logger.wandb_project="bridge-test"', 'logger.wandb_exp_name="tiny"', 'logger.mlflow_experiment="bridge-test"',
          'logger.mlflow_run_name="tiny"', 'logger.comet_project="bridge-test"', 'logger.comet_experiment_name="tiny"']
Series = Dict[int, float]


def backend_env(**extra: str) -> Dict[str, str]:
    """The environment of a rank with every backend offline and no network: W&B offline, no Comet key."""
    env = {k: v for k, v in os.environ.items() if k not in ("COMET_API_KEY", "WANDB_API_KEY", "SLURM_JOB_ID")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=REPO, **extra)
    return env


# ---------------------------------------------------------------------------------------------
# Each backend's own reader
# ---------------------------------------------------------------------------------------------


def wandb_history(run_dir: Path, tag: str = "lm loss") -> List[Tuple[str, Series]]:
    """Per ``.wandb`` file of the run folder (one per run of the job, in start order): its run id and
    step -> ``tag`` of its history records, read by ``wandb leet inspect --json`` (wandb's reader)."""
    out = []
    for path in sorted(glob.glob(str(run_dir / WANDB_DIR / "wandb" / "offline-run-*" / "run-*.wandb"))):
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path], capture_output=True,
                              text=True, timeout=120, env=backend_env())
        assert proc.returncode == 0, proc.stderr
        run_id, points = None, {}
        for line in proc.stdout.splitlines():
            record = json.loads(line)
            if record.get("type") == "run":
                run_id = record["run"]["run_id"]
            elif record.get("type") == "history":
                item = record["history"]["item"]
                if tag in item:
                    assert item["_step"] not in points, f"{path}: step {item['_step']} twice"
                    points[item["_step"]] = item[tag]
        out.append((run_id, points))
    return out


def mlflow_history(run_dir: Path, tag: str = "lm loss") -> Tuple[List[str], List[Tuple[int, float]]]:
    """(run ids in the store, [(step, value)] of the job's run), read by ``MlflowClient``."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    entry = json.loads((run_dir / LOGGER_RUNS_FILE).read_text())["mlflow"]
    client = MlflowClient(tracking_uri=entry["tracking_uri"])
    experiment = client.get_experiment_by_name(entry["experiment"])
    run_ids = [r.info.run_id for r in client.search_runs([experiment.experiment_id])]
    return run_ids, [(m.step, m.value) for m in client.get_metric_history(entry["run_id"], tag)]


def comet_archives(run_dir: Path, tag: str = "lm loss") -> List[Tuple[dict, List[Tuple[int, float]]]]:
    """Per offline archive (``comet upload`` order: the one that creates the experiment first): its
    experiment.json and [(step, value)] of ``tag`` from its messages.json."""
    from comet_ml.config import OFFLINE_EXPERIMENT_JSON_FILE_NAME, OFFLINE_EXPERIMENT_MESSAGES_JSON_FILE_NAME
    from comet_ml.messages import MetricMessage

    out = []
    for path in glob.glob(str(run_dir / COMET_DIR / "*.zip")):
        with zipfile.ZipFile(path) as archive:
            meta = json.loads(archive.read(OFFLINE_EXPERIMENT_JSON_FILE_NAME))
            lines = archive.read(OFFLINE_EXPERIMENT_MESSAGES_JSON_FILE_NAME).decode().splitlines()
        points = []
        for line in lines:
            message = json.loads(line)
            metric = message["payload"].get(MetricMessage.metric_key) if message["type"] == MetricMessage.type else None
            if metric and metric["metricName"] == tag:
                points.append((metric["step"], metric["metricValue"]))
        out.append((meta, points))
    return sorted(out, key=lambda a: (a[0]["resume_strategy"] != "create", a[0]["start_time"]))


def assert_one_run_each_step_once(run_dir: Path, steps: List[int]) -> Series:
    """Every backend holds one run of the job whose ``lm loss`` is metrics.jsonl's at every step, once.
    Returns metrics.jsonl's losses."""
    metrics = {s: r["loss"] for s, r in read_metrics(str(run_dir / METRICS_FILE)).items()}
    assert sorted(metrics) == steps
    runs = json.loads((run_dir / LOGGER_RUNS_FILE).read_text())

    segments = wandb_history(run_dir)
    assert {run_id for run_id, _ in segments} == {runs["wandb"]["id"]}  # one W&B run, one file per run of the job
    got: Series = {}
    for _, points in segments:
        assert not set(points) & set(got), "a step in two runs' files"
        got.update(points)
    assert got == metrics

    run_ids, history = mlflow_history(run_dir)
    assert run_ids == [runs["mlflow"]["run_id"]]
    assert sorted(history) == sorted(metrics.items())  # each step once (MLflow would keep a second value)

    archives = comet_archives(run_dir)
    assert {meta["offline_id"] for meta, _ in archives} == {runs["comet"]["key"]}  # one experiment
    assert [meta["resume_strategy"] for meta, _ in archives] == ["create"] + ["get"] * (len(archives) - 1)
    points = [p for _, pts in archives for p in pts]
    assert sorted(points) == sorted(metrics.items())
    return metrics


# ---------------------------------------------------------------------------------------------
# Runs of a job, as MetricsLogger drives the backends on the last rank
# ---------------------------------------------------------------------------------------------

#: One run of a job: MetricsLogger opened at RESUME with every backend on, steps RESUME+1..UPTO whose loss
#: says which run wrote it, a checkpoint "saved" every 10 steps. END: "close" (the loop's end, or a failure:
#: pretrain closes the logs in its finally), or "hang" (wait to be killed, once every backend has what was
#: committed and W&B has written it).
RUN = """
import json, os, sys, time
from bridge_hpc.training.run import build_config
from bridge_hpc.training.state import GlobalState
from bridge_hpc.training.engine.metrics import RunStart
run_dir, resume, upto, run, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
state = GlobalState()
state.cfg = build_config(sys.argv[6], [f"job.run_dir={run_dir}"] + json.loads(sys.argv[7]))
m = state.metrics
m.open(resume, RunStart(restart_count=run, load_s=0.25 if resume else None, started_at=time.time() - 1.0))
saved = resume
for step in range(resume + 1, upto + 1):
    m.log({"step": step, "loss": 10.0 * (run + 1) + step / 100, "lr": 1e-3 * step})
    if step % 10 == 0:
        m.log_checkpoint_saved(step, 0.5)
        saved = step
if end == "hang":
    path = os.path.join(run_dir, "logger_runs.json")
    while True:
        runs = json.load(open(path)) if os.path.exists(path) else {}
        if runs and all(r.get("logged_through") == saved for r in runs.values()):
            break
        time.sleep(0.1)
    time.sleep(2.0)  # W&B writes its file every second
    print("committed", saved, flush=True)
    time.sleep(600)
state.close()
print("closed", flush=True)
"""


def run_of_job(run_dir: Path, resume: int, upto: int, run: int, end: str = "close", on: List[str] = ALL_ON,
               env=None) -> subprocess.CompletedProcess:
    """One run of the job in its own process (see :data:`RUN`); ``end="hang"``: SIGKILLed once committed."""
    args = [sys.executable, "-c", RUN, str(run_dir), str(resume), str(upto), str(run), end, str(TINY), json.dumps(on)]
    if end == "hang":
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env or backend_env())
        try:
            line = proc.stdout.readline()
            assert line.split() == ["committed", str(upto // 10 * 10)], line + proc.stderr.read()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        return subprocess.CompletedProcess(args, -signal.SIGKILL, "", "")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env or backend_env())
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def owner_loss(owner, steps) -> Series:
    """What metrics.jsonl keeps: step -> the loss of the run that owns it (:data:`RUN`'s losses)."""
    return {s: 10.0 * (owner(s) + 1) + s / 100 for s in steps}


@pytest.mark.slow
def test_resumed_runs_leave_one_run_per_backend_each_step_once(tmp_path):
    run_dir = tmp_path / "run"
    # run 0 trains to 27, its last checkpoint at 20, and fails (its logs are closed on the way out): 21-27
    # are trained again by run 1, which stops at 45 after its checkpoint at 40; run 2 resumes at 40.
    first = run_of_job(run_dir, 0, 27, 0)
    assert "logging is off" not in first.stderr, first.stderr[-3000:]
    run_of_job(run_dir, 20, 45, 1)
    run_of_job(run_dir, 40, 50, 2)
    metrics = assert_one_run_each_step_once(run_dir, list(range(1, 51)))
    assert metrics == owner_loss(lambda s: 0 if s <= 20 else 1 if s <= 40 else 2, range(1, 51))
    # the goodput scalars too, each run's at its first step
    restarts: Series = {}
    for _, points in wandb_history(run_dir, "goodput/restarts"):
        restarts.update(points)
    assert restarts == {1: 0, 21: 1, 41: 2}
    assert sorted(mlflow_history(run_dir, "goodput/lost-steps")[1]) == [(1, 0.0), (21, 7.0), (41, 5.0)]
    saves = sorted(p for _, pts in comet_archives(run_dir, "save-checkpoint-time") for p in pts)
    assert saves == [(s, 0.5) for s in (10, 20, 30, 40, 50)]


@pytest.mark.slow
def test_a_killed_run_loses_nothing_the_next_run_does_not_log(tmp_path):
    """SIGKILL after the checkpoint at 20 (steps to 27): W&B (its writer outlives the rank and has written
    its file) and MLflow (written as sent) hold 1-20 of it, the next run sends 21 on. Comet is left out:
    its offline archive is written when its run closes, so a killed process leaves none (docs/logging.md)."""
    run_dir = tmp_path / "run"
    on = ALL_ON[:4]  # W&B and MLflow
    run_of_job(run_dir, 0, 27, 0, end="hang", on=on)
    run_of_job(run_dir, 20, 40, 1, on=on)
    metrics = {s: r["loss"] for s, r in read_metrics(str(run_dir / METRICS_FILE)).items()}
    assert metrics == owner_loss(lambda s: 0 if s <= 20 else 1, range(1, 41))
    got: Series = {}
    for _, points in wandb_history(run_dir):
        assert not set(points) & set(got)
        got.update(points)
    assert got == metrics
    assert sorted(mlflow_history(run_dir)[1]) == sorted(metrics.items())
