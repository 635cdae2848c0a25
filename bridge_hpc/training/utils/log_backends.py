"""W&B, MLflow and Comet: every scalar TensorBoard gets, each step once, one run across requeues.

On when ``[logger]`` names them (``wandb_project``, ``mlflow_experiment``, ``comet_project``), on the last
rank (the one that writes TensorBoard), through :class:`LogBackends`, which
:class:`~bridge_hpc.training.engine.metrics.MetricsLogger` feeds with what it gives TensorBoard (its tags,
its steps, ``tensorboard_log_interval``). A backend's package is imported only when it is on, in a thread of
its own, so the loop never waits for an import, a server or a disk: it hands over finished steps.

**One run across requeues.** ``RUN/logger_runs.json`` (:data:`~bridge_hpc.contracts.run_folder.LOGGER_RUNS_FILE`,
beside ``metrics.jsonl``) keeps the W&B run id, the MLflow run id and the Comet experiment key; every later
run of the job, a Slurm requeue or an in-job restart, continues them: W&B with ``resume="allow"`` and that
id, MLflow by logging into that run, Comet with ``ExistingExperiment`` / ``ExistingOfflineExperiment``. A
Comet experiment that cannot be continued (first offline, now online, or deleted) is followed by a new one
named ``<name> (restart N)``, whose key later runs continue.

**Each step once.** A run that dies after its last checkpoint has trained steps that the next run trains
again (metrics.jsonl truncates them, TensorBoard purges them). W&B drops a step logged below its current
step (the first value would stay), MLflow keeps both values (``get_metric_history`` returns the step
twice), Comet plots both. So a step goes to the backends only once it can no longer be trained again: when
the checkpoint at or after it is saved (:meth:`LogBackends.commit`, called where the save is durable; for a
background save, where it is finalized). Until then the step waits in memory; a run that dies loses only
steps the next run trains and logs again, with the values it keeps (those of metrics.jsonl). The cost: a
backend shows a step once its checkpoint is saved, up to ``checkpoint.save_interval`` steps later than
TensorBoard. Without ``checkpoint.save`` nothing is trained twice and each step goes out at once.
``logged_through`` in logger_runs.json, the last step each backend got, guards the rare run that resumes
from an older checkpoint than the newest (a damaged one skipped): the steps it trains again up to there are
not sent a second time (the backend keeps the first run's values of them).

**A backend that fails stops nothing.** A package missing, a server unreachable, any exception while
logging: one warning line naming the backend, and it is off for the rest of this run (the next run of the
job tries again). W&B's writer process (``wandb-core``) exits on SIGTERM without writing what it holds: it
is asked to write every second, and when it is found gone at a checkpoint a new one is started in its place
(same run) and that checkpoint's steps are sent again. At the end, what is committed is sent and every run
is closed (``run.finish()``, the MLflow run terminated, ``experiment.end()``), for at most
:data:`CLOSE_TIMEOUT_S` seconds in all.

Secrets: the API keys come from the environment (``[env]`` ``from_shell``): ``WANDB_API_KEY``,
``COMET_API_KEY``; ``logger.comet_api_key`` set in Python is taken out of the config before anything logs
or saves it (:func:`take_secret`), and no backend's copy of the config holds it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from bridge_hpc.contracts import run_folder

logger = logging.getLogger(__name__)

#: The backends, in the order they start, and how messages name them.
BACKENDS = ("wandb", "mlflow", "comet")
LABELS = {"wandb": "W&B", "mlflow": "MLflow", "comet": "Comet"}
#: ``[logger]`` field that turns each on.
SWITCHES = {"wandb": "wandb_project", "mlflow": "mlflow_experiment", "comet": "comet_project"}
#: Seconds :meth:`LogBackends.close` waits for the backends to take the last steps and close their runs.
CLOSE_TIMEOUT_S = 20.0
#: Seconds after which a backend whose run has not started (a server that accepts and never answers) is
#: one warning, while the run goes on, rather than only at the end.
START_PATIENCE_S = 60.0
#: Seconds between W&B's writes of its ``.wandb`` file (its default is 15): what a SIGTERM can lose.
WANDB_FLUSH_INTERVAL_S = 1.0
#: Steps waiting for their checkpoint beyond which the oldest go out anyway (a run without interval saves).
MAX_PENDING_STEPS = 50_000
#: What replaces a secret in the config a backend records.
REDACTED = "<redacted>"
#: Config fields that hold secrets: never sent to a backend, never logged or saved.
SECRET_FIELDS = (("logger", "comet_api_key"),)
_SECRET_ATTR = "_bridge_hpc_comet_api_key"


def enabled(logger_cfg: Any) -> List[str]:
    """The backends ``logger_cfg`` (a LoggerConfig) turns on, in :data:`BACKENDS` order."""
    return [name for name in BACKENDS if getattr(logger_cfg, SWITCHES[name], None)]


def take_secret(cfg: Any) -> None:
    """Move ``logger.comet_api_key`` out of the config into a private attribute of its logger section, which
    :meth:`ConfigContainer.to_dict` (checkpoints' run_config.json) and the non-default-values log line do not
    read. Idempotent; the Comet backend reads it back with :func:`comet_api_key`."""
    section = getattr(cfg, "logger", None)
    if section is not None and getattr(section, "comet_api_key", None):
        object.__setattr__(section, _SECRET_ATTR, section.comet_api_key)
        section.comet_api_key = None


def comet_api_key(logger_cfg: Any) -> Optional[str]:
    """The Comet API key a Python config gave (see :func:`take_secret`), else None."""
    key = getattr(logger_cfg, _SECRET_ATTR, None) or getattr(logger_cfg, "comet_api_key", None)
    return key.strip() if isinstance(key, str) and key.strip() else None


def backend_home(cfg: Any) -> str:
    """Where the backends keep their files and ``logger_runs.json``: the folder of ``logger.metrics_file`` (a
    job's run folder), else ``checkpoint.save`` (Megatron Bridge's place for W&B), else the working folder."""
    metrics_file = getattr(cfg.logger, "metrics_file", None)
    if metrics_file:
        return os.path.dirname(os.path.abspath(metrics_file))
    if getattr(cfg.checkpoint, "save", None):
        return os.path.abspath(cfg.checkpoint.save)
    return os.getcwd()


def config_for_backends(cfg: Any) -> Dict[str, Any]:
    """The config as plain JSON data for a backend to record, secrets replaced by :data:`REDACTED`."""
    data = json.loads(json.dumps(cfg.to_dict(), default=str))
    for section, key in SECRET_FIELDS:
        if isinstance(data.get(section), dict) and data[section].get(key) is not None:
            data[section][key] = REDACTED
    return data


def flatten(data: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (MLflow's params are flat)."""
    out: Dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def sanitize_mlflow_metrics(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """Metric names MLflow accepts (Megatron Bridge's rule): ``@`` -> ``_at_``, one ``/`` at most kept (the
    first; later ones become ``_``), any other character outside ``[\\w.\\- :/]`` -> ``_``."""
    out = {}
    for key, value in metrics.items():
        name = re.sub(r"/+", "/", str(key).replace("@", "_at_"))
        if "/" in name:
            first, rest = name.split("/", 1)
            name = first + "/" + rest.replace("/", "_")
        out[_MLFLOW_BAD.sub("_", name)] = value
    return out


_MISSING = object()


def _same(kept: Any, value: Any) -> bool:
    """Whether ``value`` is the number ``kept`` is (Python numbers only: a tensor is not compared)."""
    return (isinstance(kept, (int, float)) and isinstance(value, (int, float))
            and type(kept) is type(value) and kept == value)


def _scalar(value: Any) -> Optional[float]:
    """A finite-or-not float of a number (0-d tensors and numpy scalars included); None for anything else."""
    if isinstance(value, bool) or value is None:
        return None
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (RuntimeError, ValueError):
            return None
    return float(value) if isinstance(value, (int, float)) else None


def _one_line(err: BaseException, logger_cfg: Any = None) -> str:
    """``err`` as one line of at most ~300 characters, without any API key it may quote."""
    text = " ".join(str(err).split())
    for secret in (os.environ.get("WANDB_API_KEY"), os.environ.get("COMET_API_KEY"),
                   comet_api_key(logger_cfg) if logger_cfg is not None else None):
        if secret and len(secret.strip()) >= 4:
            text = text.replace(secret.strip(), REDACTED)
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


# ---------------------------------------------------------------------------------------------
# The run state file
# ---------------------------------------------------------------------------------------------


def read_runs(home: str) -> Dict[str, Dict[str, Any]]:
    """``logger_runs.json`` of ``home`` ({} when missing or unreadable: the backends start new runs)."""
    try:
        with open(os.path.join(home, run_folder.LOGGER_RUNS_FILE), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_runs(home: str, runs: Dict[str, Dict[str, Any]]) -> None:
    path = os.path.join(home, run_folder.LOGGER_RUNS_FILE)
    os.makedirs(home, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(runs, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# The backends
# ---------------------------------------------------------------------------------------------

Record = Tuple[int, Dict[str, Any]]


class _Backend:
    """One backend's run: ``start`` (import, create or continue) returns what logger_runs.json keeps;
    ``send`` logs finished steps in order; ``finish`` closes the run. Each runs in the sender thread."""

    name = ""

    def __init__(self, cfg: Any, home: str, saved: Optional[Dict[str, Any]], restart_count: int):
        self.cfg, self.log = cfg, cfg.logger
        self.home = home
        self.saved = saved or {}
        self.restart_count = restart_count
        #: What GlobalState hands out (the wandb module, the mlflow module, the Comet Experiment).
        self.handle: Any = None
        #: Held while the sender thread writes, and by a call of the rank's thread that reads the run back
        #: (MLflow's file store reads a metric file that its writer has created but not yet filled as
        #: malformed).
        self.lock = threading.Lock()

    def start(self) -> Dict[str, Any]:
        raise NotImplementedError

    def send(self, records: List[Record]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def recover(self, err: BaseException) -> bool:
        """After ``send`` failed: put the backend back in order if it can (then the send is retried once)."""
        return False


class WandbBackend(_Backend):
    name = "wandb"
    #: What :meth:`recover` may have to send again: the batches sent to the current writer process in the
    #: last KEEP_S seconds (a stop signal comes this long at most before the exit checkpoint's batch finds
    #: the process gone), and the last KEEP_BATCHES in any case.
    KEEP_S, KEEP_BATCHES = 120.0, 2

    def start(self) -> Dict[str, Any]:
        import wandb

        self.wandb = wandb
        run_id = self.saved.get("id") or uuid.uuid4().hex[:16]
        save_dir = self.log.wandb_save_dir or os.path.join(self.home, run_folder.WANDB_DIR)
        os.makedirs(save_dir, exist_ok=True)
        self._init_kwargs = dict(project=self.log.wandb_project, entity=self.log.wandb_entity,
                                 name=self.log.wandb_exp_name, dir=save_dir, id=run_id, resume="allow",
                                 config=config_for_backends(self.cfg), settings=self._settings())
        try:
            self.run = wandb.init(**self._init_kwargs)
        except Exception as err:  # noqa: BLE001 - wandb-core can fail to come up once (seen: exit code 128)
            logger.info("W&B did not start (%s): trying once more", _one_line(err, self.log))
            try:
                wandb.teardown()
            except Exception:  # noqa: BLE001
                pass
            self.run = wandb.init(**self._init_kwargs)
        self.handle = wandb
        self._recent: List[Tuple[float, List[Record]]] = []
        return {"id": run_id, "project": self.log.wandb_project, "dir": save_dir}

    def _settings(self):
        fields = getattr(self.wandb.Settings, "model_fields", {})
        extra = {"x_transaction_log_flush_interval": WANDB_FLUSH_INTERVAL_S} \
            if "x_transaction_log_flush_interval" in fields else {}
        return self.wandb.Settings(**extra)

    def send(self, records: List[Record]) -> None:
        now = time.monotonic()
        self._recent = [(t, batch) for i, (t, batch) in enumerate(self._recent)
                        if now - t < self.KEEP_S or i >= len(self._recent) - self.KEEP_BATCHES] + [(now, records)]
        for step, values in records:
            self.run.log(values, step=step, commit=True)

    def recover(self, err: BaseException) -> bool:
        """wandb-core is gone (it exits on SIGTERM, which Slurm sends every process of a preempted job, and
        drops what it has not written): start a new one on the same run, and send again what the old one
        had not written: the steps of the recent batches (see :attr:`KEEP_S`) past the last one in its
        ``.wandb`` file, as ``wandb leet inspect`` reads it (all of them when it cannot be read). The batch
        that failed is sent again by the caller."""
        old_file = getattr(self.run.settings, "sync_file", None)
        for stop in (self.run.finish, self.wandb.teardown):  # the old run, then the connection to its process
            try:
                stop()
            except Exception:  # noqa: BLE001 - the process is gone already
                pass
        durable = _wandb_last_step(old_file) if old_file else None
        recent = [r for _, batch in self._recent[:-1] for r in batch if durable is None or r[0] > durable]
        self._recent = self._recent[-1:]
        self.run = self.wandb.init(**self._init_kwargs)
        logger.warning("W&B's writer process (wandb-core) was gone, most likely stopped by SIGTERM: a new one "
                       "continues run %s%s", self._init_kwargs["id"],
                       f"; steps {recent[0][0]}-{recent[-1][0]} sent again" if recent else "")
        for step, values in recent:
            self.run.log(values, step=step, commit=True)
        return True

    def finish(self) -> None:
        self.run.finish()


def _wandb_last_step(path: str) -> Optional[int]:
    """The last history step in the ``.wandb`` file ``path`` (``wandb leet inspect --json``, W&B's own
    reader), 0 for none; None when it cannot be read."""
    import subprocess
    import sys

    try:
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    last = 0
    for line in proc.stdout.splitlines():
        if '"history"' in line:
            try:
                record = json.loads(line)
                last = max(last, int(record["history"]["item"]["_step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return last


class MlflowBackend(_Backend):
    name = "mlflow"
    #: MLflow's limits: metrics and params per log_batch call, characters of a param value.
    BATCH, PARAMS, PARAM_CHARS = 1000, 100, 6000

    def start(self) -> Dict[str, Any]:
        # MLflow 3 refuses its file store unless asked: the run folder's store is what this toolkit offers
        # by default. An unreachable server would take MLflow's default retries four minutes to give up on.
        # (A job's own setting of these variables, in [env], wins.)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        import mlflow
        from mlflow.entities import Metric, Param, RunStatus
        from mlflow.tracking import MlflowClient

        self.mlflow, self.Metric = mlflow, Metric
        uri = self.log.mlflow_tracking_uri or "file://" + os.path.join(self.home, run_folder.MLFLOW_DIR)
        client = self.client = MlflowClient(tracking_uri=uri)
        run_id = self.saved.get("run_id") if self.saved.get("tracking_uri") == uri else None
        if run_id is not None:
            try:
                client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            except Exception as err:  # noqa: BLE001 - deleted, or another store: a new run, said so
                logger.warning("MLflow run %s cannot be continued (%s): starting a new one", run_id, _one_line(err))
                run_id = None
        if run_id is None:
            # Bridge's calls: the tracking URI, the experiment, then the run with its name, tags and
            # description (it stays this thread's active run; the rank's thread continues it by id)
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment(self.log.mlflow_experiment)
            name = self.log.mlflow_run_name
            if name and self.saved.get("run_id"):
                name = f"{name} (restart {self.restart_count})"
            tags = {str(k): str(v) for k, v in (self.log.mlflow_tags or {}).items()}
            run_id = mlflow.start_run(run_name=name, tags=tags or None,
                                      description=self.log.mlflow_description).info.run_id
            params = [Param(_MLFLOW_BAD.sub("_", key)[:250], str(value)[: self.PARAM_CHARS])
                      for key, value in flatten(config_for_backends(self.cfg)).items()]
            try:
                for i in range(0, len(params), self.PARAMS):
                    client.log_batch(run_id, params=params[i:i + self.PARAMS])
            except Exception as err:  # noqa: BLE001 - the config is a record; the metrics matter more
                logger.warning("MLflow: the config was not recorded as params (%s)", _one_line(err))
        self.run_id = run_id
        mlflow.set_tracking_uri(uri)  # for the fluent calls GlobalState.mlflow_logger passes on
        self.handle = mlflow
        return {"run_id": run_id, "tracking_uri": uri, "experiment": self.log.mlflow_experiment}

    def send(self, records: List[Record]) -> None:
        now = int(time.time() * 1000)
        metrics = []
        for step, values in records:
            for key, value in sanitize_mlflow_metrics(values).items():
                number = _scalar(value)
                if number is not None and math.isfinite(number):
                    metrics.append(self.Metric(key, number, now, step))
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self.BATCH])

    def finish(self) -> None:
        active = self.mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            self.mlflow.end_run()  # the run this thread started (Bridge's start_run)
        else:
            self.client.set_terminated(self.run_id)


class CometBackend(_Backend):
    name = "comet"

    def start(self) -> Dict[str, Any]:
        key = comet_api_key(self.log) or os.environ.get("COMET_API_KEY", "").strip() or None
        if key is None:
            # Offline means no network: comet_ml's import would start its own error reporting (Sentry).
            os.environ.setdefault("COMET_ERROR_TRACKING_ENABLE", "false")
        import comet_ml

        if key is None:
            try:
                key = comet_ml.config.get_config("comet.api_key") or None
            except Exception:  # noqa: BLE001 - no comet configuration at all: offline
                key = None
        offline = key is None
        # Bridge's settings (no automatic metrics: every series comes from here), less the copies of the
        # source tree and its uncommitted changes that each run of the job would add, and the end summary.
        common = dict(project_name=self.log.comet_project, workspace=self.log.comet_workspace,
                      auto_metric_logging=False, log_code=False, log_git_patch=False, display_summary_level=0)
        if offline:
            common["offline_directory"] = os.path.join(self.home, run_folder.COMET_DIR)
            os.makedirs(common["offline_directory"], exist_ok=True)
        else:
            common["api_key"] = key
        experiment = None
        previous = self.saved.get("key")
        if previous and self.saved.get("offline") == offline:
            try:
                cls = comet_ml.ExistingOfflineExperiment if offline else comet_ml.ExistingExperiment
                experiment = cls(experiment_key=previous, **common)
            except Exception as err:  # noqa: BLE001 - a new experiment instead, named with the restart
                logger.warning("Comet experiment %s cannot be continued (%s): starting a new one", previous,
                               _one_line(err, self.log))
        if experiment is None:
            cls = comet_ml.OfflineExperiment if offline else comet_ml.Experiment
            experiment = cls(experiment_key=uuid.uuid4().hex, **common)
            name = self.log.comet_experiment_name
            if previous:
                name = f"{name or 'experiment'} (restart {self.restart_count})"
            if name:
                experiment.set_name(name)
            if self.log.comet_tags:
                experiment.add_tags(list(self.log.comet_tags))
            experiment.log_parameters(config_for_backends(self.cfg))
        self.experiment = self.handle = experiment
        return {"key": experiment.get_key(), "offline": offline, "project": self.log.comet_project}

    def send(self, records: List[Record]) -> None:
        for step, values in records:
            numbers = {key: _scalar(value) for key, value in values.items()}
            self.experiment.log_metrics({k: v for k, v in numbers.items() if v is not None}, step=step)

    def finish(self) -> None:
        self.experiment.end()


_CLASSES: Dict[str, Callable[..., _Backend]] = {"wandb": WandbBackend, "mlflow": MlflowBackend, "comet": CometBackend}


# ---------------------------------------------------------------------------------------------
# What the loop talks to
# ---------------------------------------------------------------------------------------------


class LogBackends:
    """The enabled backends of one run on the logging rank: steps collected, committed at checkpoints, sent
    by one thread per backend (a slow or unreachable one holds up no other). Built on every rank (it imports
    nothing); only :meth:`open` on the logging rank starts anything.

    ``add(step, values, only=None)`` merges scalars into a step (``only``: one backend's own values, from
    :class:`_Handle`); ``commit(step)`` sends every collected step up to ``step``; ``close()`` sends what is
    committed, drops the rest and closes the runs. ``live``: no checkpoints, so every step is committed as
    soon as the next one starts.
    """

    def __init__(self, cfg: Any, home: Optional[str] = None):
        self.cfg = cfg
        self.names = enabled(cfg.logger)
        self.home = home or backend_home(cfg)
        self.live = not getattr(cfg.checkpoint, "save", None)
        self._pending: Dict[int, Dict[Optional[str], Dict[str, Any]]] = {}
        self._backends: Dict[str, _Backend] = {}
        self._failed: Dict[str, str] = {}
        #: Backends whose thread close() gave up on: its warning was the last word on them.
        self._abandoned: set = set()
        self._runs: Dict[str, Dict[str, Any]] = {}
        self._runs_lock = threading.Lock()
        self._queues: Dict[str, "queue.Queue[Optional[Tuple[Callable[..., None], tuple]]]"] = {}
        self._threads: Dict[str, threading.Thread] = {}
        self._started: Dict[str, threading.Event] = {name: threading.Event() for name in self.names}
        self._resume_step = 0
        self.last_step = 0
        self._committed = 0

    # --- the loop's side -----------------------------------------------------------------------

    def open(self, resume_step: int, restart_count: int) -> None:
        """Start the backends' runs (each in its thread) for a run that resumes at ``resume_step``."""
        self._resume_step = self.last_step = self._committed = resume_step
        self._runs = read_runs(self.home)
        for name in self.names:
            self._queues[name] = queue.Queue()
            thread = threading.Thread(target=self._serve, args=(name,), name=f"bridge_hpc-{name}", daemon=True)
            self._threads[name] = thread
            thread.start()
            self._queues[name].put((self._start, (name, restart_count)))
            watch = threading.Timer(START_PATIENCE_S, self._not_started, (name,))
            watch.daemon = True
            watch.start()

    def add(self, step: int, values: Dict[str, Any], only: Optional[str] = None) -> None:
        if not values or (only is not None and only not in self.names):
            return
        parts = self._pending.setdefault(step, {})
        if only is not None and None in parts:
            # A backend's own values that the step has for every backend already (training_log hands
            # GlobalState's loggers the scalars its record brought here) are not kept a second time.
            common = parts[None]
            values = {key: value for key, value in values.items() if not _same(common.get(key, _MISSING), value)}
            if not values:
                return
        parts.setdefault(only, {}).update(values)
        self.last_step = max(self.last_step, step)
        if len(self._pending) > MAX_PENDING_STEPS:
            self.commit(min(self._pending))

    def commit(self, step: int) -> None:
        """Steps up to ``step`` can no longer be trained again (their checkpoint is saved): send them."""
        self._committed = max(self._committed, step)
        ready = sorted(s for s in self._pending if s <= step)
        if ready and self._threads:
            items = [(s, self._pending.pop(s)) for s in ready]
            for name in self.names:
                if name not in self._failed:
                    self._queues[name].put((self._send, (name, items)))

    def step_done(self, step: int) -> None:
        """Step ``step`` is logged; without checkpoints the one before it is final."""
        if self.live:
            self.commit(step - 1)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is committed (everything, without checkpoints), drop the steps the next run trains
        again, close the runs; wait at most ``timeout`` seconds for all of it."""
        if not self._threads:
            return
        self.commit(self.last_step if self.live else max(self._committed, self._resume_step))
        if self._pending:
            logger.debug("log backends: %d steps after the last checkpoint dropped (the next run trains them)",
                         len(self._pending))
        self._pending.clear()
        began = time.monotonic()
        for name in self.names:
            self._queues[name].put((self._finish, (name,)))
            self._queues[name].put(None)
        late = []
        for name, thread in self._threads.items():
            thread.join(max(0.0, timeout - (time.monotonic() - began)))
            if thread.is_alive():
                late.append(name)
        self._abandoned.update(late)
        for name in late:
            logger.warning("%s did not close within %.0f s: %s", LABELS[name], timeout, self._logged(name))
        logger.debug("log backends closed in %.2f s", time.monotonic() - began)
        self._threads.clear()

    def handle(self, name: str) -> Optional["_Handle"]:
        """What GlobalState hands out for backend ``name`` (None while it is off, failed or not open)."""
        if name not in self._threads or name in self._failed:
            return None
        return _Handle(self, name)

    def backend(self, name: str, wait: float = 0.0) -> Optional[_Backend]:
        """The started backend ``name`` (waiting up to ``wait`` s for its start), else None."""
        if wait and name in self._started:
            self._started[name].wait(wait)
        return None if name in self._failed else self._backends.get(name)

    def _where(self, name: str) -> str:
        uri = getattr(self.cfg.logger, "mlflow_tracking_uri", None) if name == "mlflow" else None
        return f" at {uri}" if uri else ""

    def _logged(self, name: str) -> str:
        """What of this run backend ``name`` holds, in words (for a warning)."""
        if not self._started[name].is_set():
            return f"its run never started (no answer{self._where(name)}): no step of this run was logged to it"
        through = (self._runs.get(name) or {}).get("logged_through", 0)
        if through <= self._resume_step:
            return "no step of this run was logged to it"
        return (f"steps through {through} of this run were logged to it"
                + (f", steps {through + 1} to {self.last_step} were not" if self.last_step > through else ""))

    def _not_started(self, name: str) -> None:
        """Called once, :data:`START_PATIENCE_S` after :meth:`open`: a backend still starting is said now."""
        if not self._started[name].is_set() and name not in self._failed and self._threads:
            logger.warning("%s has not answered for %.0f s (the start of its run%s): nothing of this run is logged to "
                           "it yet; its steps wait and go out when it answers; training goes on", LABELS[name],
                           START_PATIENCE_S, self._where(name))

    # --- each backend's thread -----------------------------------------------------------------

    def _serve(self, name: str) -> None:
        jobs = self._queues[name]
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001 - a bug here must not end the rank either
                self._fail(name, "its logger", err)

    def _fail(self, name: str, what: str, err: BaseException) -> None:
        if name in self._failed or name in self._abandoned:  # a thread left behind by close() stays quiet
            return
        self._failed[name] = _one_line(err, self.cfg.logger)
        hint = ""
        if isinstance(err, ImportError):
            hint = f" (pip install 'bridge_hpc[loggers]', or unset logger.{SWITCHES[name]})"
        logger.warning("%s logging is off for the rest of this run: %s failed (%s)%s; training goes on",
                       LABELS[name], what, self._failed[name], hint)

    def _start(self, name: str, restart_count: int) -> None:
        try:
            saved = self._runs.get(name) or {}
            backend = _CLASSES[name](self.cfg, self.home, saved, restart_count)
            try:
                entry = backend.start()
            except BaseException as err:  # noqa: BLE001 - SystemExit from a library included
                self._fail(name, "its start", err)
                return
            same = all(saved.get(k) == v for k, v in entry.items() if k in ("id", "run_id", "key"))
            with self._runs_lock:
                self._runs[name] = dict(entry, logged_through=saved.get("logged_through", 0) if same else 0)
            self._backends[name] = backend
            self._save_runs()
        finally:
            self._started[name].set()

    def _send(self, name: str, items: List[Tuple[int, Dict[Optional[str], Dict[str, Any]]]]) -> None:
        backend = self._backends.get(name)
        if backend is None or name in self._failed:
            return
        through = self._runs[name].get("logged_through", 0)
        records = [(step, {**parts.get(None, {}), **parts.get(name, {})}) for step, parts in items if step > through]
        records = [(step, values) for step, values in records if values]
        if not records:
            return
        try:
            with backend.lock:
                backend.send(records)
        except BaseException as err:  # noqa: BLE001
            try:
                if not backend.recover(err):
                    raise
                with backend.lock:
                    backend.send(records)
            except BaseException as again:  # noqa: BLE001
                self._fail(name, "logging", again)
                return
        with self._runs_lock:
            self._runs[name]["logged_through"] = records[-1][0]
        self._save_runs()

    def _finish(self, name: str) -> None:
        backend = self._backends.get(name)
        if backend is None or name in self._failed:
            return
        try:
            with backend.lock:
                backend.finish()
        except BaseException as err:  # noqa: BLE001
            self._fail(name, "closing its run", err)

    def _save_runs(self) -> None:
        with self._runs_lock:
            runs = {name: dict(entry) for name, entry in self._runs.items()}
            try:
                _write_runs(self.home, runs)
            except OSError as err:
                logger.warning("log backends: cannot write %s (%s): a requeued run will start new runs",
                               os.path.join(self.home, run_folder.LOGGER_RUNS_FILE), _one_line(err))


class _Handle:
    """``GlobalState.wandb_logger`` / ``mlflow_logger`` / ``comet_logger``: the wandb module, the mlflow
    module or the Comet Experiment, except that their metric calls join the step's record, so that what a
    forward step or megatron-core's MoE helpers log goes out with it, each step once:
    ``wandb_logger.log(dict, step)``, ``mlflow_logger.log_metrics(dict, step=)`` /
    ``log_metric(key, value, step=)``, ``comet_logger.log_metrics(dict, step=)`` /
    ``log_metric(name, value, step=)``. A call without a step joins the newest step. Anything else is the
    real object's (waiting for its start up to 60 s)."""

    def __init__(self, backends: LogBackends, name: str):
        object.__setattr__(self, "_backends", backends)
        object.__setattr__(self, "_name", name)

    def _add(self, values: Dict[str, Any], step: Optional[int]) -> None:
        self._backends.add(self._backends.last_step if step is None else int(step), dict(values), only=self._name)

    def log(self, data: Dict[str, Any], step: Optional[int] = None, commit: Any = None, sync: Any = None) -> None:
        if self._name != "wandb":
            return self.__getattr__("log")(data, step=step)
        self._add(data, step)

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        if self._name == "wandb":
            raise AttributeError("wandb has no log_metrics")
        prefix = kwargs.get("prefix")
        self._add({f"{prefix}_{k}" if prefix else k: v for k, v in metrics.items()}, step)

    def log_metric(self, key: str, value: Any, step: Optional[int] = None, **kwargs: Any) -> None:
        if self._name == "wandb":
            raise AttributeError("wandb has no log_metric")
        self._add({key: value}, step)

    def __getattr__(self, attr: str) -> Any:
        backend = self._backends.backend(self._name, wait=60.0)
        if backend is None or backend.handle is None:
            raise AttributeError(f"{LABELS[self._name]} is not running, so it has no {attr!r}")
        if self._name == "mlflow" and backend.handle.active_run() is None:
            with backend.lock:  # start_run reads the run back, metric files included
                backend.handle.start_run(run_id=backend.run_id)  # the fluent API's run, in this thread
        return getattr(backend.handle, attr)

    def __repr__(self) -> str:
        return f"<{LABELS[self._name]} logger of bridge_hpc (each step once; see log_backends)>"
