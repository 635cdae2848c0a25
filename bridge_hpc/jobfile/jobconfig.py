"""Job configs: TOML files, cluster profiles they extend, ``--set`` overrides, typed dataclasses.

A job config is one TOML file per experiment. The launcher owns ``[job]``, ``[slurm]``, ``[env]``,
``[container]``, ``[setup]`` and ``[cluster]`` (the last normally lives in a cluster profile); every
other known section (``[train]``, ``[model]``, ``[checkpoint]``, ...) is carried unchanged to the ranks,
where the training core gives it meaning. Each problem becomes a :class:`ConfigError` naming the file
and the dotted key, so the CLI can print one line and exit 2.

This module types and checks the launcher's sections and puts a job together
(:func:`load_job_config`); the files are read, merged and overridden in
:mod:`bridge_hpc.jobfile.sources`, and the ranks' sections resolved (absolute paths, the stop
signal, the Hugging Face and base-checkpoint checks) in :mod:`bridge_hpc.jobfile.training_sections`.

No torch here: this module runs on the login node.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import toml

from bridge_hpc.contracts import bytecode_cache, fast_path, run_folder, signals
from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import LAUNCHER_SECTIONS, build_dataclass, did_you_mean
from bridge_hpc.contracts.text import has_control_chars
from bridge_hpc.jobfile.sources import (  # noqa: F401 - the public ones re-exported (launch.preflight reads TOML)
    _KEY_NOT_PRINTABLE,
    _NO_CONTROL,
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    MAX_PROFILES,
    TomlError,
    _bad_key,
    _expanduser,
    _is_file,
    _load_with_profiles,
    _resolve,
    _Where,
    deep_merge,
    parse_override,
    parse_toml,
)
from bridge_hpc.jobfile.training_sections import _resolved_training_sections
from bridge_hpc.training.config import SECTIONS as TRAINING_SECTIONS  # torch-free
from bridge_hpc.training.config import ConfigContainer
from bridge_hpc.training.engine import low_precision, speed_defaults
from bridge_hpc.training.mixed_precision import runs_in_bf16

# Every pattern below is applied with fullmatch: ``$`` would also match before a final newline, and a
# name ending in a newline would end an ``#SBATCH`` line and start a shell line.
_TIME_RE = re.compile(r"(?:(?P<days>[0-9]+)-)?(?P<h>[0-9]{1,3}):(?P<m>[0-9]{2}):(?P<s>[0-9]{2})")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SBATCH_OPTION_RE = re.compile(r"[a-z][a-z0-9-]*")
#: [env] names a job may not set: what Slurm sets for each job and the batch script and the ranks
#: read (an exported SLURM_RESTART_COUNT of ``a[$(cmd)]`` would run cmd in the script's arithmetic),
#: bridge_hpc's own BRIDGE_* variables, and the shell's start-up and parsing variables (BASH_ENV,
#: ENV, SHELLOPTS, PS4, ... are expanded or sourced by every bash the job starts).
_RESERVED_ENV_RE = re.compile(
    r"SLURM_(JOB|ARRAY|STEP|TASK)[A-Z0-9_]*|SLURMD_[A-Z0-9_]*|BRIDGE_[A-Za-z0-9_]*|BASH_[A-Za-z0-9_]*"
    r"|SLURM_(RESTART_COUNT|PROCID|LOCALID|NODEID|NNODES|NODELIST|NTASKS|NPROCS|CLUSTER_NAME|SUBMIT_DIR|SUBMIT_HOST)"
    r"|ENV|SHELLOPTS|BASHOPTS|IFS|PS1|PS2|PS3|PS4|PROMPT_COMMAND|GLOBIGNORE"
)
#: [env] names that hold secrets (patterns: ``*`` stands for any text; matched regardless of case).
#: Their value must come from the submitting shell, ``NAME = { from_shell = "NAME" }``: a literal would be
#: written into job.sbatch and resolved.toml. A cluster profile adds its own (``[cluster]
#: secret_env_names``). A TOML boolean is no secret (``HF_HUB_DISABLE_IMPLICIT_TOKEN = true``).
SECRET_ENV_NAMES = ("*_API_KEY", "*_TOKEN", "API_KEY", "WANDB_API_KEY", "HF_TOKEN", "MLFLOW_TRACKING_TOKEN",
                    "COMET_API_KEY")
#: Keys of the ranks' sections that hold a secret, whatever their value, and the [env] variable that
#: passes it instead.
_SECRET_KEYS = {("logger", "comet_api_key"): "COMET_API_KEY"}
#: What ``[cluster] secret_env_names`` may hold: variable names, ``*`` standing for any text.
_SECRET_NAME_RE = re.compile(r"[A-Za-z0-9_*]+")
#: TOML integers are 64-bit signed; the readers return larger ones without complaint.
_INT64 = (-(1 << 63), (1 << 63) - 1)


def parse_time_limit(value: str) -> int:
    """``HH:MM:SS`` or ``D-HH:MM:SS`` to seconds; ValueError when it is neither."""
    m = _TIME_RE.fullmatch(value) if isinstance(value, str) else None
    if not m or int(m["m"]) >= 60 or int(m["s"]) >= 60:
        raise ValueError(value)
    return ((int(m["days"] or 0) * 24 + int(m["h"])) * 60 + int(m["m"])) * 60 + int(m["s"])


# --------------------------------------------------------------------------- the launcher's sections


DEFAULT_FORWARD_STEP = "bridge_hpc.training.gpt_step:forward_step"
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass
class JobSection:
    """What the run is called and where everything it writes goes."""

    name: str = ""
    # default: runs/<name> ('%' and '\\' in the name become '_'), relative to the directory bridge-submit runs in
    run_dir: str = ""
    python: str = "python3"  # interpreter on the compute nodes (after [setup] ran)
    description: str = ""
    # The forward step every rank trains with, Megatron Bridge's signature
    # ``forward_step(state, data_iterator, model) -> (output, loss_func)``: ``"package.module:function"``
    # (importable on the compute nodes) or ``"path/to/file.py:function"`` (relative to the directory
    # bridge-submit runs in, like run_dir; written absolute to resolved.toml).
    forward_step: str = DEFAULT_FORWARD_STEP
    # Megatron Bridge's entry point the ranks run: pretrain(config, forward_step) or finetune(config,
    # forward_step) (starts from [checkpoint] pretrained_checkpoint: weights only, iteration 0).
    entry: Literal["pretrain", "finetune"] = "pretrain"
    # Where the ranks keep compiled modules when the installed torch / megatron-core have none and
    # Python would not write them (read-only install, PYTHONDONTWRITEBYTECODE): "auto"
    # ($XDG_CACHE_HOME/bridge_hpc/pycache), "off", or an absolute folder. See
    # bridge_hpc.training.process.bytecode_cache.
    bytecode_cache: str = "auto"
    # What the fast path chose for a job on GPUs: written by bridge-submit into resolved.toml and read
    # back by the ranks (bridge_hpc.training.engine.speed_defaults); a job file leaves it out.
    fast_path: Dict[str, Any] = field(default_factory=dict)


@dataclass
class SlurmSection:
    """sbatch options. ``extra`` passes any other long option through, e.g. ``{reservation = "x"}``."""

    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    nodes: int = 1
    ntasks_per_node: int = 1
    cpus_per_task: Optional[int] = None
    gpus_per_node: int = 0
    mem: Optional[str] = None
    time: str = "01:00:00"
    signal: str = signals.DEFAULT_SLURM_SIGNAL
    requeue: bool = True
    max_restarts: int = 20  # requeues after signals and time limits
    retries_without_progress: int = 2  # requeues after failures that saved no checkpoint (crash loops)
    # After a stop for stragglers ([nvrx_straggler] stop_if_detected), keep the next run off their
    # nodes (ExcNodeList), unless the partition would be left with too few nodes for the job.
    exclude_straggler_nodes: bool = True
    constraint: Optional[str] = None
    exclusive: bool = False
    dependency: Optional[str] = None
    array: Optional[str] = None
    mail_user: Optional[str] = None
    mail_type: Optional[str] = None
    extra: Dict[str, Union[str, int, bool]] = field(default_factory=dict)


@dataclass
class ContainerSection:
    """A pyxis/enroot container the ranks run in (srun --container-image)."""

    image: Optional[str] = None
    mounts: List[str] = field(default_factory=list)
    workdir: Optional[str] = None
    env_file: Optional[str] = None


@dataclass
class SetupSection:
    """What the batch script does before starting ranks: load modules, activate a venv."""

    modules: List[str] = field(default_factory=list)
    venv: Optional[str] = None
    conda_env: Optional[str] = None
    source: List[str] = field(default_factory=list)  # files to source, e.g. a site's env script


@dataclass
class ClusterSection:
    """Facts about the cluster, normally in a profile; used to reject contradictory requests."""

    name: str = ""
    partitions: List[str] = field(default_factory=list)
    gpus_per_node: Optional[int] = None
    cpus_per_node: Optional[int] = None
    max_time: Optional[str] = None
    # The mean time between failures of one node, in hours: the prior of ``[checkpoint] save_interval =
    # "auto"`` until a run has its own history (bridge_hpc.contracts.save_interval).
    node_mtbf_hours: Optional[float] = None
    # The site's own secret [env] names, on top of SECRET_ENV_NAMES (``*`` for any text): a literal
    # value for one is refused; it must be ``{ from_shell = "NAME" }``.
    secret_env_names: List[str] = field(default_factory=list)
    # The nodes' GPU model ("H100", "H200", "B200" ...): FP8/FP4 recipes the card cannot run are refused
    # at submission (bridge_hpc.training.engine.low_precision), not on the ranks after the queue.
    gpu_model: Optional[str] = None


@dataclass(frozen=True)
class EnvVar:
    """An exported variable: a literal ``value``, or ``from_shell`` naming a submitting-shell variable.

    A ``from_shell`` variable is a secret by convention: its value travels through Slurm's
    environment propagation and is never written into the script or the resolved config.
    """

    name: str
    value: Optional[str] = None
    from_shell: Optional[str] = None


@dataclass
class JobConfig:
    """A fully resolved job: profiles merged, overrides applied, every key typed and checked.

    ``training`` is the :class:`~bridge_hpc.training.config.ConfigContainer` of the ranks, built and
    checked here once; its paths are absolute and ``train.exit_signal`` is the stop signal's list.
    It is None only for a job file loaded for its Slurm side alone (``load_job_config(...,
    training=False)``: ``bridge-prepare-data --slurm`` reuses a profile, partition and ``[setup]``).
    ``raw`` is the same document as TOML data: what resolved.toml holds and the ranks read back.
    """

    path: Path
    job: JobSection
    slurm: SlurmSection
    env: List[EnvVar]
    container: Optional[ContainerSection]
    setup: SetupSection
    cluster: ClusterSection
    training: Optional[ConfigContainer]
    raw: Dict[str, Any]
    stop_signal: signals.StopSignal
    #: Which file set which key (the job file, a profile, a --set), for errors found after loading.
    where: Optional["_Where"] = field(default=None, repr=False, compare=False)

    def error(self, key: str, message: str) -> ConfigError:
        """A ConfigError naming ``key`` and the file that set it."""
        if self.where is not None:
            return self.where.error(key, message)
        return ConfigError(message, path=str(self.path), key=key)

    @property
    def run_dir(self) -> Path:
        return Path(self.job.run_dir)

    @property
    def run_folder(self) -> run_folder.RunFolder:
        return run_folder.RunFolder(self.job.run_dir, self.training.checkpoint.save)

    @property
    def num_tasks(self) -> int:
        return self.slurm.nodes * self.slurm.ntasks_per_node

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.run_folder.checkpoint_dir)

    def secrets(self) -> List[EnvVar]:
        return [v for v in self.env if v.from_shell]


# --------------------------------------------------------------------------- typed sections


def _no_control_chars(value: Any, parts: Tuple[str, ...], where: _Where) -> None:
    """Newlines would end an ``#SBATCH`` line and start a shell line: refuse them outright. Integers
    beyond TOML's 64 bits (the readers take them; nothing downstream can) and numbers that are not
    finite (nan compares false with every bound a check sets) are refused here too."""
    dotted = ".".join(parts)
    if isinstance(value, str) and has_control_chars(value):
        raise where.error(dotted, _NO_CONTROL, parts)
    if isinstance(value, int) and not isinstance(value, bool) and not _INT64[0] <= value <= _INT64[1]:
        raise where.error(dotted, f"expected a 64-bit integer, got {value}", parts)
    if isinstance(value, float) and not math.isfinite(value):
        raise where.error(dotted, f"expected a finite number, got {value}", parts)
    if isinstance(value, list):
        for v in value:
            _no_control_chars(v, parts, where)
    if isinstance(value, dict):
        for k, v in value.items():
            if _bad_key(k):
                raise where.error(f"{dotted}.{k!r}", _KEY_NOT_PRINTABLE, parts + (k,))
            _no_control_chars(v, parts + (k,), where)


def _refuse_written_secrets(doc: Dict[str, Any], where: _Where) -> None:
    """A secret written in a job file, a profile or a ``--set`` would be kept in job.sbatch, resolved.toml
    or every checkpoint: a key that holds one (``logger.comet_api_key``) is refused whatever its value, and
    an [env] variable whose name is a secret's (:data:`SECRET_ENV_NAMES`, ``[cluster] secret_env_names``)
    unless it is ``{ from_shell = "NAME" }``. The messages name the key, never the value."""
    for (section, key), variable in _SECRET_KEYS.items():
        body = doc.get(section)
        if isinstance(body, dict) and key in body:
            raise where.error(f"{section}.{key}", "an API key may not be written in a job file (it would be kept in "
                              "resolved.toml and in every checkpoint): remove it and pass the key from your shell "
                              f'through [env]: {variable} = {{ from_shell = "{variable}" }}', (section, key))
    cluster = doc.get("cluster")
    site = cluster.get("secret_env_names", []) if isinstance(cluster, dict) else []
    if not isinstance(site, list) or not all(isinstance(n, str) and _SECRET_NAME_RE.fullmatch(n) for n in site):
        raise where.error("cluster.secret_env_names", "expected a list of environment variable names, '*' standing "
                          'for any text, such as ["MY_SITE_TOKEN", "*_PASSWORD"]')
    patterns = [(p, "bridge_hpc's secret names") for p in SECRET_ENV_NAMES]
    patterns += [(p, "cluster.secret_env_names") for p in site]
    env = doc.get("env")
    for name, value in (env.items() if isinstance(env, dict) else ()):  # not a table: _build_env names it
        if isinstance(value, (dict, bool)) or not _ENV_NAME_RE.fullmatch(name):
            continue  # { from_shell = ... } (or a table _build_env refuses), no secret, or a name refused later
        for pattern, source in patterns:
            if fnmatch.fnmatchcase(name.upper(), pattern.upper()):
                raise where.error(f"env.{name}", f"a secret may not be written in a job file: {name} matches "
                                  f"{pattern!r} ({source}) and its value would be kept in job.sbatch and "
                                  f'resolved.toml; expected {name} = {{ from_shell = "{name}" }}, which passes the '
                                  f"submitting shell's {name} by name")


def _build_env(data: Any, where: _Where) -> List[EnvVar]:
    if not isinstance(data, dict):
        raise where.error("env", "expected a table of NAME = value")
    out = []
    for name, value in data.items():
        if not _ENV_NAME_RE.fullmatch(name):
            raise where.error(f"env.{name}", "not a valid environment variable name")
        if _RESERVED_ENV_RE.fullmatch(name):
            raise where.error(f"env.{name}", "set by Slurm, bridge_hpc or the shell for every job; a job may not set it")
        if isinstance(value, dict):
            unknown = set(value) - {"from_shell"}
            if unknown or not isinstance(value.get("from_shell"), str) or not _ENV_NAME_RE.fullmatch(value["from_shell"]):
                raise where.error(f"env.{name}", "expected a string, or { from_shell = \"VARIABLE\" } naming a variable "
                                  "of the submitting shell")
            out.append(EnvVar(name=name, from_shell=value["from_shell"]))
        elif isinstance(value, (str, int, float, bool)):
            text = str(value).lower() if isinstance(value, bool) else str(value)
            out.append(EnvVar(name=name, value=text))
        else:
            raise where.error(f"env.{name}", "expected a string, number, boolean or { from_shell = \"VARIABLE\" }, "
                              f"got {value!r}")
    return out


def _validate_slurm(s: SlurmSection, c: ClusterSection, where: _Where) -> signals.StopSignal:
    """Check the [slurm] section against itself and the cluster profile; the parsed stop signal."""
    try:
        limit = parse_time_limit(s.time)
    except ValueError:
        raise where.error("slurm.time", f"expected HH:MM:SS or D-HH:MM:SS, got {s.time!r}") from None
    if limit <= 0:
        raise where.error("slurm.time", "must be longer than 0 seconds")
    try:
        stop = signals.parse_slurm_signal(s.signal)
    except ValueError as err:
        raise where.error("slurm.signal", str(err)) from None
    if stop.seconds is not None and stop.seconds >= limit:
        raise where.error("slurm.signal", f"the warning ({stop.seconds} s before the end) must come after the job starts: "
                          f"slurm.time is {s.time}")
    for key in ("nodes", "ntasks_per_node"):
        if getattr(s, key) < 1:
            raise where.error(f"slurm.{key}", "must be at least 1")
    for key in ("cpus_per_task", "gpus_per_node", "max_restarts", "retries_without_progress"):
        value = getattr(s, key)
        if value is not None and value < 0:
            raise where.error(f"slurm.{key}", "must not be negative")
    for key in ("nodes", "ntasks_per_node", "cpus_per_task", "gpus_per_node", "max_restarts", "retries_without_progress"):
        value = getattr(s, key)
        if value is not None and value > _SLURM_INT_MAX:
            raise where.error(f"slurm.{key}", f"must be at most {_SLURM_INT_MAX}, got {value}")
    for key in s.extra:
        if not _SBATCH_OPTION_RE.fullmatch(key):
            raise where.error(f"slurm.extra.{key}", "expected a long sbatch option name such as 'reservation'")
        if key in _OWNED_OPTIONS:
            use = f"; use slurm.{_FIELD_OPTIONS[key]}" if key in _FIELD_OPTIONS else ""
            raise where.error(f"slurm.extra.{key}", f"set by bridge_hpc itself{use}")
    if c.node_mtbf_hours is not None and not (0 < c.node_mtbf_hours < float("inf")):
        raise where.error("cluster.node_mtbf_hours", "expected a positive number of hours (the mean time between "
                          f"failures of one node), got {c.node_mtbf_hours!r}")
    # Contradictions against the cluster profile.
    if c.partitions and s.partition is not None and s.partition not in c.partitions:
        raise where.error("slurm.partition", f"{s.partition!r} is not a partition of cluster {c.name or '(profile)'}: "
                          f"{', '.join(c.partitions)}{did_you_mean(s.partition, c.partitions)}")
    if c.gpus_per_node is not None and s.gpus_per_node > c.gpus_per_node:
        have = "has no GPUs" if c.gpus_per_node == 0 else f"has {c.gpus_per_node} GPUs per node"
        raise where.error("slurm.gpus_per_node", f"asks for {s.gpus_per_node} GPUs per node but the cluster profile "
                          f"(cluster.gpus_per_node) {have}")
    if c.cpus_per_node is not None and s.ntasks_per_node * (s.cpus_per_task or 1) > c.cpus_per_node:
        raise where.error("slurm.ntasks_per_node", f"{s.ntasks_per_node} tasks x {s.cpus_per_task or 1} CPUs exceed the "
                          f"{c.cpus_per_node} CPUs per node of the cluster profile")
    if c.max_time is not None:
        try:
            max_s = parse_time_limit(c.max_time)
        except ValueError:
            raise where.error("cluster.max_time", f"expected HH:MM:SS or D-HH:MM:SS, got {c.max_time!r}") from None
        if limit > max_s:
            raise where.error("slurm.time", f"{s.time} exceeds the cluster's maximum {c.max_time}")
    return stop


#: Slurm keeps counts in 32 bits (and the batch script compares restarts in bash arithmetic).
_SLURM_INT_MAX = (1 << 31) - 1

# sbatch options the template writes itself; slurm.extra may not set them.
_FIELD_OPTIONS = {
    "partition": "partition", "account": "account", "qos": "qos", "nodes": "nodes", "ntasks-per-node": "ntasks_per_node",
    "cpus-per-task": "cpus_per_task", "gpus-per-node": "gpus_per_node", "mem": "mem", "time": "time", "signal": "signal",
    "requeue": "requeue", "no-requeue": "requeue", "constraint": "constraint", "exclusive": "exclusive",
    "dependency": "dependency", "array": "array", "mail-user": "mail_user", "mail-type": "mail_type", "job-name": "job.name",
}
_OWNED_OPTIONS = set(_FIELD_OPTIONS) | {"output", "error", "open-mode", "chdir", "export", "ntasks", "wrap"}


def load_job_config(path: Union[str, Path], overrides: Sequence[str] = (), cwd: Optional[Path] = None,
                    training: bool = True) -> JobConfig:
    """Load, merge, override and validate a job config. Raises ConfigError on any bad input.

    With ``training=False`` the training sections are optional: a file that has none gives a
    JobConfig whose ``training`` is None (a job that runs something other than training, on the same
    profile); sections that are present are still checked in full.

    This is the one place a job is resolved: ``bridge-submit`` calls it on the job file and the ranks
    on the resolved.toml it wrote (whose paths are absolute already, so they resolve to themselves)."""
    path = Path(path)
    if has_control_chars(str(path)):
        raise ConfigError(f"a file name {_NO_CONTROL}", path=repr(str(path)))
    doc, origin = _load_with_profiles(path.absolute())
    overridden = []
    for item in overrides:
        try:
            parts, value = parse_override(item)
        except ConfigError as err:
            raise ConfigError(err.message, path=f"{path} (--set)", key=err.key) from None
        patch: Any = value
        for part in reversed(parts):
            patch = {part: patch}
        doc = deep_merge(doc, patch)
        overridden.append(tuple(parts))
    where = _Where(path=path, origin=origin, overridden=tuple(overridden))

    known = LAUNCHER_SECTIONS + tuple(TRAINING_SECTIONS)
    _refuse_written_secrets(doc, where)  # first, so that no other check echoes a secret's value
    for key, value in doc.items():
        if _bad_key(key):
            raise where.error(repr(key), _KEY_NOT_PRINTABLE, (key,))
        if key not in known:
            raise where.error(key, f"unknown section{did_you_mean(key, known)}; known sections: {', '.join(known)}")
        if key == "mixed_precision" and isinstance(value, str):
            continue  # Bridge's recipe name (mixed_precision = "bf16_mixed"): checked with the training sections
        if not isinstance(value, dict):
            raise where.error(key, f"expected a table [{key}], got {value!r}")
        _no_control_chars(value, (key,), where)

    job = build_dataclass(JobSection, "job", doc.get("job", {}), where.error)
    if not job.name:
        job.name = path.stem
    slurm = build_dataclass(SlurmSection, "slurm", doc.get("slurm", {}), where.error)
    cluster = build_dataclass(ClusterSection, "cluster", doc.get("cluster", {}), where.error)
    setup = build_dataclass(SetupSection, "setup", doc.get("setup", {}), where.error)
    container = build_dataclass(ContainerSection, "container", doc["container"], where.error) if "container" in doc else None
    if container is not None and not container.image:
        raise where.error("container.image", "a [container] section needs an image")
    env = _build_env(doc.get("env", {}), where)
    stop_signal = _validate_slurm(slurm, cluster, where)

    base = cwd or Path.cwd()
    try:
        run_dir = _expanduser(job.run_dir or f"runs/{run_folder.LOG_PATTERN_CHARS.sub('_', job.name)}")
    except ValueError as err:
        raise where.error("job.run_dir", str(err)) from None
    if not str(job.run_dir or "x").strip():
        raise where.error("job.run_dir", "expected a folder name, got an empty string")
    given = job.run_dir
    try:
        job.run_dir = str(run_dir if run_dir.is_absolute() else _resolve(base / run_dir))
    except ValueError as err:
        raise where.error("job.run_dir", str(err)) from None
    if run_folder.LOG_PATTERN_CHARS.search(job.run_dir):
        # sbatch reads the log file names (--output, in the run folder) as patterns: %j is the job id,
        # and a backslash turns every pattern off (and is dropped), so logs would land elsewhere.
        what = repr(given) if given else f"the folder bridge-submit runs in: {job.run_dir!r}"
        raise where.error("job.run_dir", "expected a folder name without '%' or '\\' (sbatch reads them as patterns "
                          f"in the names of the log files it writes there), got {what}")
    job.forward_step = _resolve_forward_step(job.forward_step, base, where)
    if bytecode_cache.problem(job.bytecode_cache):
        raise where.error("job.bytecode_cache", bytecode_cache.problem(job.bytecode_cache))
    resolved = dict(doc)
    resolved["job"] = dict(doc.get("job", {}), name=job.name, run_dir=job.run_dir)
    if job.forward_step != DEFAULT_FORWARD_STEP:
        resolved["job"]["forward_step"] = job.forward_step
    sections = _resolved_training_sections(doc, job.run_dir, base, stop_signal, where)
    resolved["job"].pop(fast_path.TOML_KEY, None)
    container_cfg = None
    if training or any(key in doc for key in TRAINING_SECTIONS):
        try:  # the fast path for the keys a job on GPUs leaves unset, recorded in resolved.toml
            sections, container_cfg, record = speed_defaults.resolve(
                sections, job.fast_path, slurm.gpus_per_node > 0, slurm.nodes * slurm.ntasks_per_node, str(path))
        except ConfigError as err:
            raise (where.error(err.key, err.message) if err.key else err) from None
        resolved["job"][fast_path.TOML_KEY] = record.to_toml()
        try:
            low_precision.check_before_queue(container_cfg, slurm.gpus_per_node > 0, cluster.gpu_model)
            container_cfg.model.check_moe_kernels(slurm.gpus_per_node > 0, bf16=runs_in_bf16(
                container_cfg.model, container_cfg.mixed_precision))
            container_cfg.model.check_expert_world(slurm.nodes * slurm.ntasks_per_node)  # the experts tile the job
        except ConfigError as err:
            raise where.error(err.key, err.message) from None
    if container_cfg is not None:  # the prior of save_interval = "auto": the cluster's, over this job's nodes
        container_cfg.checkpoint.node_mtbf_hours = cluster.node_mtbf_hours
        container_cfg.checkpoint.nodes = slurm.nodes
    resolved.update(sections)
    return JobConfig(
        path=path, job=job, slurm=slurm, env=env, container=container, setup=setup,
        cluster=cluster, training=container_cfg, raw=resolved, stop_signal=stop_signal, where=where,
    )


def _resolve_forward_step(spec: str, base: Path, where: "_Where") -> str:
    """Check ``[job] forward_step`` without importing it (the login node has no torch): the form, and
    for a file that it exists; a file's path comes back absolute."""
    target, sep, function = spec.rpartition(":")
    expected = "expected 'package.module:function' or 'path/to/file.py:function'"
    if not sep or not target or not function.isidentifier():
        raise where.error("job.forward_step", f"{expected}, got {spec!r}")
    if target.endswith(".py"):
        try:
            path = _expanduser(target)
        except ValueError as err:
            raise where.error("job.forward_step", str(err)) from None
        try:
            path = path if path.is_absolute() else _resolve(base / path)
            exists = _is_file(path)
        except ValueError as err:
            raise where.error("job.forward_step", str(err)) from None
        if not exists:
            raise where.error("job.forward_step", f"{expected}; the file {path} does not exist")
        return f"{path}:{function}"
    if not _DOTTED.fullmatch(target):
        raise where.error("job.forward_step", f"{expected}, got {spec!r}")
    return spec


def check_secrets_present(cfg: JobConfig, environ: Optional[Dict[str, str]] = None) -> None:
    """A secret named in [env] must exist in the submitting shell, or the job would start without it."""
    environ = os.environ if environ is None else environ
    for var in cfg.secrets():
        if var.from_shell not in environ:
            raise cfg.error(f"env.{var.name}", f"names the submitting shell's variable {var.from_shell}, which is not set "
                            f"(export {var.from_shell} before submitting; its value is never written to the script)")


def dump_resolved(cfg: JobConfig) -> str:
    """The resolved config as TOML text: what the ranks read and what reproduces the run."""
    header = (
        "# Resolved by bridge-submit from {}: profiles merged and overrides applied.\n"
        "# Submitting this file again reproduces the run.\n".format(cfg.path)
    )
    return header + toml.dumps(cfg.raw)
