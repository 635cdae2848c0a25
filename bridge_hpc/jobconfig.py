"""Job configs: TOML files, cluster profiles they extend, ``--set`` overrides, typed dataclasses.

A job config is one TOML file per experiment. The launcher owns ``[job]``, ``[slurm]``, ``[env]``,
``[container]``, ``[setup]`` and ``[cluster]`` (the last normally lives in a cluster profile); every
other known section (``[train]``, ``[model]``, ``[checkpoint]``, ...) is carried unchanged to the ranks,
where the training core gives it meaning. Each problem becomes a :class:`ConfigError` naming the file
and the dotted key, so the CLI can print one line and exit 2.

No torch here: this module runs on the login node.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import toml

from bridge_hpc.errors import ConfigError
from bridge_hpc.schema import build_dataclass, did_you_mean

# The launcher's sections; every other known section (bridge_hpc.training.config.SECTIONS, named
# after Megatron Bridge's ConfigContainer fields) is carried to the ranks.
LAUNCHER_SECTIONS = ("job", "slurm", "env", "container", "setup", "cluster")
TOP_LEVEL_KEYS = ("extends",)

_TIME_RE = re.compile(r"^(?:(?P<days>\d+)-)?(?P<h>\d{1,3}):(?P<m>\d{2}):(?P<s>\d{2})$")
_SIGNAL_RE = re.compile(r"^(?:(?P<flags>[BR]):)?(?P<sig>[A-Z][A-Z0-9]*)(?:@(?P<secs>\d+))?$")
_SIGNALS = {"USR1", "USR2", "TERM", "INT", "HUP", "QUIT", "ALRM", "CONT", "URG", "WINCH", "XCPU"}
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_OPTION_RE = re.compile(r"^[a-z][a-z0-9-]*$")


def parse_time_limit(value: str) -> int:
    """``HH:MM:SS`` or ``D-HH:MM:SS`` to seconds; ValueError when it is neither."""
    m = _TIME_RE.match(value)
    if not m or int(m["m"]) >= 60 or int(m["s"]) >= 60:
        raise ValueError(value)
    return ((int(m["days"] or 0) * 24 + int(m["h"])) * 60 + int(m["m"])) * 60 + int(m["s"])


# --------------------------------------------------------------------------- the launcher's sections


DEFAULT_FORWARD_STEP = "bridge_hpc.training.gpt:forward_step"
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass
class JobSection:
    """What the run is called and where everything it writes goes."""

    name: str = ""
    run_dir: str = ""  # default: runs/<name>, relative to the directory bridge-submit runs in
    python: str = "python3"  # interpreter on the compute nodes (after [setup] ran)
    description: str = ""
    # The forward step every rank trains with, Megatron Bridge's signature
    # ``forward_step(state, data_iterator, model) -> (output, loss_func)``: ``"package.module:function"``
    # (importable on the compute nodes) or ``"path/to/file.py:function"`` (relative to the directory
    # bridge-submit runs in, like run_dir; written absolute to resolved.toml).
    forward_step: str = DEFAULT_FORWARD_STEP


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
    signal: str = "USR1@120"
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
    """A fully resolved job: profiles merged, overrides applied, every launcher key typed."""

    path: Path
    job: JobSection
    slurm: SlurmSection
    env: List[EnvVar]
    container: Optional[ContainerSection]
    setup: SetupSection
    cluster: ClusterSection
    training: Dict[str, Dict[str, Any]]  # carried unchanged to the ranks
    raw: Dict[str, Any]  # the merged TOML document, as written to resolved.toml

    @property
    def run_dir(self) -> Path:
        return Path(self.job.run_dir)

    @property
    def num_tasks(self) -> int:
        return self.slurm.nodes * self.slurm.ntasks_per_node

    @property
    def checkpoint_dir(self) -> Path:
        """``[checkpoint] save``, relative to the run folder, or ``<run_dir>/checkpoints``."""
        return resolve_in_run_dir(self.run_dir, self.training.get("checkpoint", {}).get("save"), "checkpoints")

    def secrets(self) -> List[EnvVar]:
        return [v for v in self.env if v.from_shell]


def resolve_in_run_dir(run_dir: Path, value: Optional[str], default: Optional[str] = None) -> Optional[Path]:
    """A path from a training section: relative ones live in the run folder (so a job file and its
    resolved.toml, which sit in different folders, place files identically)."""
    if not isinstance(value, str):
        return run_dir / default if default else None
    path = Path(value).expanduser()
    return path if path.is_absolute() else run_dir / path


# --------------------------------------------------------------------------- loading and merging


def _read_toml(path: Path, referenced_by: Optional[Tuple[Path, str]] = None) -> Dict[str, Any]:
    if not path.is_file():
        if referenced_by:
            raise ConfigError(f"file {str(path)!r} does not exist", path=str(referenced_by[0]), key=referenced_by[1])
        raise ConfigError("file does not exist", path=str(path))
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read file: {err}", path=str(path)) from None
    try:
        return toml.loads(text)
    except toml.TomlDecodeError as err:
        raise ConfigError(f"not valid TOML at line {err.lineno}, column {err.colno}: {err.msg}", path=str(path)) from None


def deep_merge(base: Dict[str, Any], override: Dict[str, Any]) -> Dict[str, Any]:
    """Tables merge key by key; any other value in ``override`` replaces the base's."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_with_profiles(path: Path, chain: Tuple[Path, ...] = ()) -> Tuple[Dict[str, Any], Dict[Tuple[str, ...], Path]]:
    """Read ``path`` after the profiles it ``extends`` (in order); later values win.

    Returns the merged document and, for every leaf key, the file it came from, so that an error in
    an inherited key names the profile, not the job file.
    """
    path = path.resolve()
    doc = _read_toml(path)
    extends = doc.pop("extends", [])
    if isinstance(extends, str):
        extends = [extends]
    if not isinstance(extends, list) or not all(isinstance(e, str) for e in extends):
        raise ConfigError("expected a file name or a list of file names", path=str(path), key="extends")
    merged: Dict[str, Any] = {}
    origin: Dict[Tuple[str, ...], Path] = {}
    for rel in extends:
        parent = (path.parent / rel).resolve()
        if parent in chain or parent == path:
            raise ConfigError(f"profiles extend each other in a cycle through {str(parent)!r}", path=str(path), key="extends")
        if not parent.is_file():
            raise ConfigError(f"profile {rel!r} not found (looked for {str(parent)!r})", path=str(path), key="extends")
        pdoc, porigin = _load_with_profiles(parent, chain + (path,))
        merged = deep_merge(merged, pdoc)
        origin.update(porigin)
    merged = deep_merge(merged, doc)
    for keypath in _leaf_paths(doc):
        origin[keypath] = path
    return merged, origin


def _leaf_paths(doc: Dict[str, Any], prefix: Tuple[str, ...] = ()) -> List[Tuple[str, ...]]:
    out = []
    for key, value in doc.items():
        if isinstance(value, dict) and value:
            out.extend(_leaf_paths(value, prefix + (key,)))
        else:
            out.append(prefix + (key,))
    return out


def parse_override(text: str) -> Tuple[List[str], Any]:
    """``section.key=value`` -> (["section", "key"], value). The value is read as a TOML value when it
    is one (numbers, booleans, quoted strings, arrays), else taken as a plain string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(_ENV_NAME_RE.match(p) or re.match(r"^[A-Za-z0-9_-]+$", p) for p in parts):
        raise ConfigError(f"--set {text!r}: expected a dotted key such as train.train_iters")
    try:
        value = toml.loads(f"v = {raw}")["v"]
    except toml.TomlDecodeError:
        value = raw
    if isinstance(value, (datetime.date, datetime.time)):
        value = raw  # slurm.time=02:00:00 means the string, not a TOML time of day
    return parts, value


# --------------------------------------------------------------------------- typed sections


@dataclass
class _Where:
    """Maps a dotted key to the file it was set in (the job file, a profile or the command line)."""

    path: Path
    origin: Dict[Tuple[str, ...], Path]
    overridden: Tuple[Tuple[str, ...], ...]

    def file_of(self, dotted: str) -> str:
        parts = tuple(dotted.split("."))
        for n in range(len(parts), 0, -1):
            if parts[:n] in self.overridden:
                return f"{self.path} (--set {'.'.join(parts[:n])})"
            if parts[:n] in self.origin:
                return str(self.origin[parts[:n]])
        return str(self.path)

    def error(self, dotted: str, message: str) -> ConfigError:
        return ConfigError(message, path=self.file_of(dotted), key=dotted)


def _no_control_chars(value: Any, dotted: str, where: _Where) -> None:
    """Newlines would end an ``#SBATCH`` line and start a shell line: refuse them outright."""
    if isinstance(value, str) and any(ord(c) < 32 and c != "\t" for c in value):
        raise where.error(dotted, "must not contain newlines or control characters")
    if isinstance(value, list):
        for v in value:
            _no_control_chars(v, dotted, where)
    if isinstance(value, dict):
        for k, v in value.items():
            _no_control_chars(v, f"{dotted}.{k}", where)


def _build_env(data: Any, where: _Where) -> List[EnvVar]:
    if not isinstance(data, dict):
        raise where.error("env", "expected a table of NAME = value")
    out = []
    for name, value in data.items():
        if not _ENV_NAME_RE.match(name):
            raise where.error(f"env.{name}", "not a valid environment variable name")
        if isinstance(value, dict):
            unknown = set(value) - {"from_shell"}
            if unknown or not isinstance(value.get("from_shell"), str) or not _ENV_NAME_RE.match(value["from_shell"]):
                raise where.error(f"env.{name}", "expected a string, or { from_shell = \"VARIABLE\" } naming a variable of the submitting shell")
            out.append(EnvVar(name=name, from_shell=value["from_shell"]))
        elif isinstance(value, (str, int, float, bool)):
            text = str(value).lower() if isinstance(value, bool) else str(value)
            out.append(EnvVar(name=name, value=text))
        else:
            raise where.error(f"env.{name}", f"expected a string, number, boolean or {{ from_shell = \"VARIABLE\" }}, got {value!r}")
    return out


def _validate_slurm(s: SlurmSection, c: ClusterSection, where: _Where) -> None:
    try:
        limit = parse_time_limit(s.time)
    except ValueError:
        raise where.error("slurm.time", f"expected HH:MM:SS or D-HH:MM:SS, got {s.time!r}") from None
    if limit <= 0:
        raise where.error("slurm.time", "must be longer than 0 seconds")
    m = _SIGNAL_RE.match(s.signal)
    if not m or m["sig"].removeprefix("SIG") not in _SIGNALS:
        raise where.error("slurm.signal", f"expected SIG@seconds such as USR1@120 (signals: {', '.join(sorted(_SIGNALS))}), got {s.signal!r}")
    if m["secs"] is not None and int(m["secs"]) >= limit:
        raise where.error("slurm.signal", f"the warning ({m['secs']} s before the end) must come after the job starts: slurm.time is {s.time}")
    for key in ("nodes", "ntasks_per_node"):
        if getattr(s, key) < 1:
            raise where.error(f"slurm.{key}", "must be at least 1")
    for key in ("cpus_per_task", "gpus_per_node", "max_restarts", "retries_without_progress"):
        value = getattr(s, key)
        if value is not None and value < 0:
            raise where.error(f"slurm.{key}", "must not be negative")
    for key in s.extra:
        if not _SBATCH_OPTION_RE.match(key):
            raise where.error(f"slurm.extra.{key}", "expected a long sbatch option name such as 'reservation'")
        if key in _OWNED_OPTIONS:
            raise where.error(f"slurm.extra.{key}", f"set by bridge_hpc itself{'' if key not in _FIELD_OPTIONS else f'; use slurm.{_FIELD_OPTIONS[key]}'}")
    # Contradictions against the cluster profile.
    if c.partitions and s.partition is not None and s.partition not in c.partitions:
        raise where.error("slurm.partition", f"{s.partition!r} is not a partition of cluster {c.name or '(profile)'}: {', '.join(c.partitions)}{did_you_mean(s.partition, c.partitions)}")
    if c.gpus_per_node is not None and s.gpus_per_node > c.gpus_per_node:
        have = "has no GPUs" if c.gpus_per_node == 0 else f"has {c.gpus_per_node} GPUs per node"
        raise where.error("slurm.gpus_per_node", f"asks for {s.gpus_per_node} GPUs per node but the cluster profile (cluster.gpus_per_node) {have}")
    if c.cpus_per_node is not None and s.ntasks_per_node * (s.cpus_per_task or 1) > c.cpus_per_node:
        raise where.error("slurm.ntasks_per_node", f"{s.ntasks_per_node} tasks x {s.cpus_per_task or 1} CPUs exceed the {c.cpus_per_node} CPUs per node of the cluster profile")
    if c.max_time is not None:
        try:
            max_s = parse_time_limit(c.max_time)
        except ValueError:
            raise where.error("cluster.max_time", f"expected HH:MM:SS or D-HH:MM:SS, got {c.max_time!r}") from None
        if limit > max_s:
            raise where.error("slurm.time", f"{s.time} exceeds the cluster's maximum {c.max_time}")


# sbatch options the template writes itself; slurm.extra may not set them.
_FIELD_OPTIONS = {
    "partition": "partition", "account": "account", "qos": "qos", "nodes": "nodes", "ntasks-per-node": "ntasks_per_node",
    "cpus-per-task": "cpus_per_task", "gpus-per-node": "gpus_per_node", "mem": "mem", "time": "time", "signal": "signal",
    "requeue": "requeue", "no-requeue": "requeue", "constraint": "constraint", "exclusive": "exclusive",
    "dependency": "dependency", "array": "array", "mail-user": "mail_user", "mail-type": "mail_type", "job-name": "job.name",
}
_OWNED_OPTIONS = set(_FIELD_OPTIONS) | {"output", "error", "open-mode", "chdir", "export", "ntasks", "wrap"}


def load_job_config(path: Union[str, Path], overrides: Sequence[str] = (), cwd: Optional[Path] = None) -> JobConfig:
    """Load, merge, override and validate a job config. Raises ConfigError on any bad input."""
    path = Path(path)
    doc, origin = _load_with_profiles(path)
    overridden = []
    for item in overrides:
        parts, value = parse_override(item)
        patch: Any = value
        for part in reversed(parts):
            patch = {part: patch}
        doc = deep_merge(doc, patch)
        overridden.append(tuple(parts))
    where = _Where(path=path, origin=origin, overridden=tuple(overridden))

    from bridge_hpc.training.config import SECTIONS as TRAINING_SECTIONS  # torch-free

    known = LAUNCHER_SECTIONS + tuple(TRAINING_SECTIONS)
    for key, value in doc.items():
        if key not in known:
            raise where.error(key, f"unknown section{did_you_mean(key, known)}; known sections: {', '.join(known)}")
        if not isinstance(value, dict):
            raise where.error(key, f"expected a table [{key}], got {value!r}")
        _no_control_chars(value, key, where)

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
    _validate_slurm(slurm, cluster, where)

    base = cwd or Path.cwd()
    run_dir = Path(job.run_dir or f"runs/{job.name}").expanduser()
    job.run_dir = str(run_dir if run_dir.is_absolute() else (base / run_dir).resolve())
    job.forward_step = _resolve_forward_step(job.forward_step, base, where)
    resolved = dict(doc)
    resolved["job"] = dict(doc.get("job", {}), name=job.name, run_dir=job.run_dir)
    if job.forward_step != DEFAULT_FORWARD_STEP:
        resolved["job"]["forward_step"] = job.forward_step
    training = {k: v for k, v in doc.items() if k in TRAINING_SECTIONS}
    _check_training_sections(training, where)
    return JobConfig(
        path=path, job=job, slurm=slurm, env=env, container=container, setup=setup,
        cluster=cluster, training=training, raw=resolved,
    )


def _resolve_forward_step(spec: str, base: Path, where: "_Where") -> str:
    """Check ``[job] forward_step`` without importing it (the login node has no torch): the form, and
    for a file that it exists; a file's path comes back absolute."""
    target, sep, function = spec.rpartition(":")
    expected = "expected 'package.module:function' or 'path/to/file.py:function'"
    if not sep or not target or not function.isidentifier():
        raise where.error("job.forward_step", f"{expected}, got {spec!r}")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        path = path if path.is_absolute() else (base / path).resolve()
        if not path.is_file():
            raise where.error("job.forward_step", f"{expected}; the file {path} does not exist")
        return f"{path}:{function}"
    if not _DOTTED.match(target):
        raise where.error("job.forward_step", f"{expected}, got {spec!r}")
    return spec


def _check_training_sections(training: Dict[str, Any], where: "_Where") -> None:
    """Type-check the ranks' sections now, so a typo fails at submission and not after the queue wait.
    Cross-section checks that need the world size still happen on the ranks."""
    from bridge_hpc.training.config import ConfigContainer

    try:
        ConfigContainer.from_sections(training, source=str(where.path))
    except ConfigError as err:
        raise where.error(err.key, err.message) if err.key else err from None


def check_secrets_present(cfg: JobConfig, environ: Optional[Dict[str, str]] = None) -> None:
    """A secret named in [env] must exist in the submitting shell, or the job would start without it."""
    environ = os.environ if environ is None else environ
    for var in cfg.secrets():
        if var.from_shell not in environ:
            raise ConfigError(
                f"names the submitting shell's variable {var.from_shell}, which is not set", path=str(cfg.path), key=f"env.{var.name}"
            )


def dump_resolved(cfg: JobConfig) -> str:
    """The resolved config as TOML text: what the ranks read and what reproduces the run."""
    header = (
        "# Resolved by bridge-submit from {}: profiles merged and overrides applied.\n"
        "# Submitting this file again reproduces the run.\n".format(cfg.path)
    )
    return header + toml.dumps(cfg.raw)
