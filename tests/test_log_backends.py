"""W&B (offline), MLflow (local store) and Comet (offline) as the ranks use them, read back with each one's
own reader: ``wandb leet inspect --json`` on the ``.wandb`` files, ``MlflowClient.get_metric_history``, the
Comet archives' ``messages.json`` (Comet's offline format, its own constants).

* ``test_resumed_runs_leave_one_run_per_backend_each_step_once`` (~25 s): three runs of a job in their own
  processes, the first failing after training past its checkpoint; every backend holds one run whose steps
  and values are metrics.jsonl's.
* ``test_a_killed_run_loses_nothing_the_next_run_does_not_log`` (~20 s): the same with SIGKILL (W&B, MLflow).
* ``test_a_failing_backend_is_one_warning_and_training_goes_on``: a package missing, a server unreachable;
  ``test_a_backend_that_fails_while_logging_is_off_after_one_warning``: an exception while logging.
* ``test_a_run_that_cannot_be_continued_is_a_new_one_named_with_the_restart_count`` (Comet, MLflow).
* ``test_bridge_loggers_and_the_moe_fanout_join_the_step``: GlobalState's ``wandb_logger`` /
  ``mlflow_logger`` / ``comet_logger`` and ``_MoeMetricFanoutWriter``.
* the defaults import nothing; a Comet key in a Python config is never written; bad keys at submission
  (``test_bad_logger_keys_at_submission_are_one_line_exit_2``, 17 variants).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import signal
import subprocess
import sys
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
from bridge_hpc.rank import build_config
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
if m.backends is not None:  # what the backends hold is checked, not their close deadline: a loaded machine
    m.backends.close(timeout=240)  # once took over the 20 s to end Comet's offline archive (left truncated)
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


# ---------------------------------------------------------------------------------------------
# Failures stop nothing
# ---------------------------------------------------------------------------------------------

#: Comet's package missing (``import comet_ml`` fails) and MLflow's server unreachable (nothing listens on
#: port 1), W&B fine: each failure is one warning line, metrics.jsonl and W&B get every step.
FAILING = """
import sys
import bridge_hpc.rank as rank
_build = rank.build_config
def build_config(*args):  # the config is checked where comet_ml is installed (LoggerConfig.finalize
    cfg = _build(*args)   # refuses a missing package); on the rank it is gone: import comet_ml fails
    sys.modules["comet_ml"] = None
    return cfg
rank.build_config = build_config
exec(compile(open(sys.argv.pop(1)).read(), "run", "exec"))
"""


def test_a_failing_backend_is_one_warning_and_training_goes_on(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    run_dir = tmp_path / "run"
    on = ALL_ON + ['logger.mlflow_tracking_uri="http://127.0.0.1:1"']
    proc = subprocess.run([sys.executable, "-c", FAILING, str(script), str(run_dir), "0", "30", "0", "close", str(TINY),
                           json.dumps(on)], capture_output=True, text=True, timeout=300,
                          env=backend_env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0"))
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-4000:]
    warnings = [line for line in proc.stderr.splitlines() if "logging is off for the rest of this run" in line]
    assert len(warnings) == 2, proc.stderr[-4000:]
    comet, = [w for w in warnings if "Comet logging" in w]
    assert "ModuleNotFoundError: import of comet_ml" in comet and "pip install 'bridge_hpc[loggers]'" in comet
    mlflow, = [w for w in warnings if "MLflow logging" in w]
    assert "127.0.0.1:1" in mlflow and "its start failed" in mlflow
    assert "Traceback" not in proc.stderr
    assert sorted(read_metrics(str(run_dir / METRICS_FILE))) == list(range(1, 31))
    (_, points), = wandb_history(run_dir)
    assert sorted(points) == list(range(1, 31))
    runs = json.loads((run_dir / LOGGER_RUNS_FILE).read_text())
    assert set(runs) == {"wandb"} and not (run_dir / COMET_DIR).exists()


def test_a_backend_that_fails_while_logging_is_off_after_one_warning(tmp_path, caplog):
    """Any exception in a backend's send (here W&B's own run, finished behind its back twice: the restart
    of its writer is tried once) is one warning; later steps of the run are dropped silently."""
    from bridge_hpc.training.utils import log_backends as lb

    class Broken(lb._Backend):
        name = "wandb"
        sends = 0

        def start(self):
            return {"id": "x"}

        def send(self, records):
            Broken.sends += 1
            raise RuntimeError("connection lost\nsecond line")

        def recover(self, err):
            return True

        def finish(self):
            raise AssertionError("a failed backend is not closed")

    cfg = _config(tmp_path, ['logger.wandb_project="p"'])
    backends = lb.LogBackends(cfg)
    real = lb._CLASSES["wandb"]
    lb._CLASSES["wandb"] = Broken
    try:
        with caplog.at_level(logging.WARNING, logger="bridge_hpc"):
            backends.open(0, 0)
            for step in range(1, 31):
                backends.add(step, {"lm loss": 1.0})
                if step % 10 == 0:
                    backends.commit(step)
            backends.close()
    finally:
        lb._CLASSES["wandb"] = real
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert messages == ["W&B logging is off for the rest of this run: logging failed (RuntimeError: connection lost "
                        "second line); training goes on"]
    assert Broken.sends == 2  # the first send and its one retry; nothing after


# ---------------------------------------------------------------------------------------------
# GlobalState's loggers, the MoE fan-out, the defaults, secrets
# ---------------------------------------------------------------------------------------------


def _config(tmp_path, extra: List[str]):
    from bridge_hpc.rank import build_config

    return build_config(str(TINY), [f"job.run_dir={tmp_path / 'run'}"] + extra)


LOGGERS = """
import json, sys, time, torch
from bridge_hpc.rank import build_config
from bridge_hpc.training.state import GlobalState
from bridge_hpc.training.engine.metrics import RunStart
from bridge_hpc.training.utils.train_utils import _build_moe_metric_writer, _MoeMetricFanoutWriter
state = GlobalState()
state.cfg = build_config(sys.argv[2], [f"job.run_dir={sys.argv[1]}", "logger.tensorboard_dir=''"] + json.loads(sys.argv[3]))
assert state.wandb_logger is None and state.mlflow_logger is None and state.comet_logger is None  # not open yet
m = state.metrics
m.open(0, RunStart(restart_count=0, load_s=None, started_at=time.time()))
wb, ml, cm = state.wandb_logger, state.mlflow_logger, state.comet_logger
writer = _build_moe_metric_writer(state.tensorboard_logger, cm, ml)
assert isinstance(writer, _MoeMetricFanoutWriter)
for step in range(1, 11):
    wb.log({"custom/wandb": step * 2.0}, step)           # a forward step's own series, Bridge's call
    ml.log_metrics({"custom/mlflow": step * 3.0}, step=step)
    cm.log_metric("custom/comet", step * 4.0, step=step)
    writer.add_scalar("moe/load_balancing_loss", torch.tensor(step / 10), step)  # megatron-core's MoE helper
    m.log({"step": step, "loss": 1.0 + step})
m.log_checkpoint_saved(10, 0.1)
assert wb.run.id == json.load(open(sys.argv[1] + "/logger_runs.json"))["wandb"]["id"]  # the module's own attributes
assert cm.get_key() == json.load(open(sys.argv[1] + "/logger_runs.json"))["comet"]["key"]
ml.set_tag("note", "from the fluent API")
state.close()
print("closed", flush=True)
"""


@pytest.mark.slow
def test_bridge_loggers_and_the_moe_fanout_join_the_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", LOGGERS, str(run_dir), str(TINY), json.dumps(ALL_ON)],
                          capture_output=True, text=True, timeout=300, env=backend_env())
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-4000:]
    steps = list(range(1, 11))
    (_, wandb_own), = wandb_history(run_dir, "custom/wandb")
    assert wandb_own == {s: s * 2.0 for s in steps}
    (_, loss), = wandb_history(run_dir, "lm loss")
    assert loss == {s: 1.0 + s for s in steps}
    assert sorted(mlflow_history(run_dir, "custom/mlflow")[1]) == [(s, s * 3.0) for s in steps]
    assert sorted(mlflow_history(run_dir, "moe/load_balancing_loss")[1]) == [(s, pytest.approx(s / 10)) for s in steps]
    (_, comet_own), = comet_archives(run_dir, "custom/comet")
    assert sorted(comet_own) == [(s, s * 4.0) for s in steps]
    (_, moe), = comet_archives(run_dir, "moe/load_balancing_loss")
    assert sorted(moe) == [(s, pytest.approx(s / 10)) for s in steps]
    from mlflow.tracking import MlflowClient

    entry = json.loads((run_dir / LOGGER_RUNS_FILE).read_text())["mlflow"]
    assert MlflowClient(tracking_uri=entry["tracking_uri"]).get_run(entry["run_id"]).data.tags["note"] == \
        "from the fluent API"


DEFAULTS = """
import sys, time
import bridge_hpc.training.pretrain  # everything a rank imports (megatron-core imports wandb itself when installed)
from bridge_hpc.rank import build_config
from bridge_hpc.training.state import GlobalState
from bridge_hpc.training.engine.metrics import RunStart
state = GlobalState()
state.cfg = build_config(sys.argv[2], [f"job.run_dir={sys.argv[1]}"])
before = set(sys.modules)
m = state.metrics
m.open(0, RunStart(restart_count=0, load_s=None, started_at=time.time()))
for step in range(1, 21):
    m.log({"step": step, "loss": 1.0})
    if step % 10 == 0:
        m.log_checkpoint_saved(step, 0.1)
state.close()
new = set(sys.modules) - before
print(sorted(n for n in new if n.split(".")[0] in ("wandb", "mlflow", "comet_ml", "bridge_hpc")),
      "bridge_hpc.training.utils.log_backends" in sys.modules)
print(m.backends, state.wandb_logger, state.mlflow_logger, state.comet_logger)
"""


def test_the_defaults_import_no_backend_and_start_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-c", DEFAULTS, str(tmp_path / "run"), str(TINY)], capture_output=True,
                          text=True, timeout=300, env=backend_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["[] False", "None None None None"]
    assert not (tmp_path / "run" / LOGGER_RUNS_FILE).exists()


def test_a_comet_key_in_a_python_config_is_used_and_never_written(tmp_path, caplog):
    from bridge_hpc.training.config import ConfigContainer
    from bridge_hpc.training.state import GlobalState
    from bridge_hpc.training.utils.log_backends import comet_api_key, config_for_backends

    cfg = _config(tmp_path, ['logger.comet_project="c"', 'logger.comet_experiment_name="x"'])
    cfg.logger.comet_api_key = "sk-PYTHON-SECRET-42"
    state = GlobalState()
    state.cfg = cfg
    assert cfg.logger.comet_api_key is None and comet_api_key(cfg.logger) == "sk-PYTHON-SECRET-42"
    state.__init__()  # an in-process restart's fresh state, same config: the key is still there for Comet
    state.cfg = cfg
    assert comet_api_key(cfg.logger) == "sk-PYTHON-SECRET-42"
    with caplog.at_level(logging.INFO, logger="bridge_hpc"):
        cfg.log_non_default_values()
    dumped = json.dumps(cfg.to_dict(), default=str) + json.dumps(config_for_backends(cfg)) + caplog.text
    assert "SECRET" not in dumped
    assert isinstance(cfg, ConfigContainer)


@pytest.mark.parametrize("text, key", [
    ('[logger]\ncomet_api_key = "sk-SECRET-1"\n', "logger.comet_api_key"),
    ("[logger]\ncomet_api_key = 123456789012345678901234567890\n", "logger.comet_api_key"),
    ('[logger]\ncomet_api_key = "sk-SECRET-\\u0007\\n$(rm -rf ~)"\n', "logger.comet_api_key"),
    ('[logger]\ncomet_api_key = ["sk-SECRET-2"]\n', "logger.comet_api_key"),
    ('[logger]\ncomet_api_key = { key = "sk-SECRET-3" }\n', "logger.comet_api_key"),
    ('[logger]\ncomet_api_key = ""\n', "logger.comet_api_key"),
    ("[logger]\nwandb_project = 5\n", "logger.wandb_project"),
    ('[logger]\nwandb_project = ""\n', "logger.wandb_project"),
    ('[logger]\nwandb_project = ["a", "b"]\n', "logger.wandb_project"),
    ('[logger]\nwandb_exp_name = "x"\n', "logger.wandb_exp_name"),
    ('[logger]\nwandb_project = "p"\nwandb_entity = "  "\n', "logger.wandb_entity"),
    ('[logger]\nmlflow_experiment = "e"\nmlflow_tags = "a=b"\n', "logger.mlflow_tags"),
    ('[logger]\nmlflow_experiment = "e"\nmlflow_tracking_uri = "\\n"\n', "logger.mlflow_tracking_uri"),
    ('[logger]\nmlflow_experiment = "e"\n', "logger.mlflow_run_name"),  # Bridge's rule (issue 38)
    ('[logger]\ncomet_project = "c"\ncomet_tags = { a = 1 }\n', "logger.comet_tags"),
    ('[logger]\ncomet_project = "c"\n', "logger.comet_experiment_name"),  # Bridge's rule (issue 38)
    ('[logger]\ncomet_project = "c$(id)\\u001b[2J"\n', "logger.comet_project"),
])
def test_bad_logger_keys_at_submission_are_one_line_exit_2(tmp_path, text, key):
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{TINY}"\n' + text)
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and f"'{key}'" in proc.stderr, proc.stderr
    assert "SECRET" not in proc.stderr and "rm -rf" not in proc.stderr


def test_a_comet_key_given_by_set_or_a_profile_is_refused_naming_where(tmp_path):
    profile = tmp_path / "profile.toml"
    profile.write_text('[logger]\ncomet_api_key = "sk-SECRET-9"\n')
    job = tmp_path / "job.toml"
    job.write_text(f'extends = ["{TINY}", "{profile}"]\n')
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2 and str(profile) in proc.stderr and "SECRET" not in proc.stderr, proc.stderr
    assert 'COMET_API_KEY = { from_shell = "COMET_API_KEY" }' in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(TINY), "--dry-run", "--set",
                           'logger.comet_api_key="sk-SECRET-8"'], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2 and "(--set logger.comet_api_key)" in proc.stderr and "SECRET" not in proc.stderr


def test_a_run_that_cannot_be_continued_is_a_new_one_named_with_the_restart_count(tmp_path):
    """Comet cannot continue an online experiment offline (nor the reverse), MLflow a run of another store:
    a new experiment / run named ``<name> (restart N)``, which later runs of the job continue."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old = {"comet": {"key": "f" * 32, "offline": False, "logged_through": 20},  # an online experiment before
           "mlflow": {"run_id": "0" * 32, "tracking_uri": "file:///elsewhere", "logged_through": 20}}
    (run_dir / LOGGER_RUNS_FILE).write_text(json.dumps(old))
    on = ['logger.mlflow_experiment="bridge-test"', 'logger.mlflow_run_name="tiny"',
          'logger.comet_project="bridge-test"', 'logger.comet_experiment_name="tiny"']
    run_of_job(run_dir, 20, 30, 3, on=on)
    run_of_job(run_dir, 30, 40, 4, on=on)
    runs = json.loads((run_dir / LOGGER_RUNS_FILE).read_text())
    assert runs["comet"]["key"] != "f" * 32 and runs["comet"]["offline"] is True
    assert runs["mlflow"]["run_id"] != "0" * 32 and runs["mlflow"]["logged_through"] == 40
    from comet_ml.config import OFFLINE_EXPERIMENT_MESSAGES_JSON_FILE_NAME

    names = []
    for path in glob.glob(str(run_dir / COMET_DIR / "*.zip")):
        with zipfile.ZipFile(path) as archive:
            for line in archive.read(OFFLINE_EXPERIMENT_MESSAGES_JSON_FILE_NAME).decode().splitlines():
                payload = json.loads(line)["payload"]
                if payload.get("key") == "Name":
                    names.append(payload["value"])
    assert names == ["tiny (restart 3)"]  # set once, by the run that created it; run 4 continued it
    assert sorted(p for _, pts in comet_archives(run_dir) for p in pts) == [(s, 40.0 + s / 100) for s in range(21, 31)] + \
        [(s, 50.0 + s / 100) for s in range(31, 41)]
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=runs["mlflow"]["tracking_uri"])
    assert client.get_run(runs["mlflow"]["run_id"]).info.run_name == "tiny (restart 3)"
    assert [m.step for m in client.get_metric_history(runs["mlflow"]["run_id"], "lm loss")] == list(range(21, 41))
