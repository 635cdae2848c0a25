"""The configuration of the local cluster: what goes into slurm.conf and slurmdbd.conf, and where on disk.

The file texts are built by pure functions of the state directory, the host and the node names, so that
``up`` can compare them with what ``/etc/slurm`` holds and do nothing when they match (rewriting
slurm.conf means restarting slurmctld and slurmd, which cancels every job). Writing is a separate, atomic
step, and only over a file that carries :data:`MARKER`: ``/etc/slurm`` may belong to a real cluster,
and :func:`check_managed` refuses to touch a file bridge-cluster did not write.

Slurm's own state (StateSaveLocation, spool, logs, pid files) lives under the state directory
(:class:`StatePaths`), so job ids keep growing across ``down``/``up`` and ``sacct -j`` never sees two
jobs with one id.
"""

from __future__ import annotations

import os
import pwd
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from bridge_hpc.contracts.errors import ConfigError

MARKER = "# managed by bridge-cluster"
ETC_SLURM = Path("/etc/slurm")
MUNGE_KEY = Path("/etc/munge/munge.key")

CLUSTER_NAME = "bridge"
ACCOUNT = "bridge"
SLURMCTLD_PORT = 6817
SLURMDBD_PORT = 6819
SLURMD_BASE_PORT = 17001  # node i listens on SLURMD_BASE_PORT + i - 1
MYSQL_PORT = 13306  # not MariaDB's default 3306: a system MariaDB may be listening there
CPUS_PER_NODE = 2
REAL_MEMORY_MB = 8000
DEF_MEM_PER_CPU_MB = 1000


@dataclass(frozen=True)
class StatePaths:
    """Where one cluster keeps its state, daemon by daemon, under its state directory ``root``.

    The config files name these paths (pid files, logs, spool) and :mod:`.daemons` finds the daemons by
    them, so both read them from here.
    """

    root: Path

    @property
    def pid_dir(self) -> Path:
        return self.root / "pids"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def ctld_state(self) -> Path:
        return self.root / "slurmctld"

    @property
    def spool_dir(self) -> Path:
        return self.root / "slurmd"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def mysql_dir(self) -> Path:
        return self.root / "mysql"

    @property
    def mysql_data(self) -> Path:
        return self.mysql_dir / "data"

    @property
    def mysql_run(self) -> Path:
        return self.mysql_dir / "run"

    @property
    def mysql_socket(self) -> Path:
        return self.mysql_run / "mariadb.sock"

    @property
    def db_password_file(self) -> Path:
        return self.mysql_dir / "slurm-db-password"

    @property
    def info_file(self) -> Path:
        """What the last ``up`` configured: ``{"nodes", "node_names", "host"}``."""
        return self.root / "cluster.json"

    def pidfile(self, name: str) -> Path:
        """The pid file of daemon ``name`` (``munged``, ``mariadbd``, ``slurmdbd``, ``slurmctld``, ``slurmd-<node>``).

        munged and mariadbd drop root and write their pid file as their own user, so theirs lie in a
        folder that user owns rather than in :attr:`pid_dir`.
        """
        if name == "mariadbd":
            return self.mysql_run / "mariadbd.pid"
        if name == "munged":
            return self.munge_dir / "munged.pid"
        return self.pid_dir / f"{name}.pid"


def node_names(nodes: int, host: str) -> List[str]:
    """One node is named after the host (as on a workstation); several are ``n1..nN``."""
    return [host] if nodes == 1 else [f"n{i}" for i in range(1, nodes + 1)]


def slurm_conf_text(paths: StatePaths, host: str, names: Sequence[str]) -> str:
    """The whole ``/etc/slurm/slurm.conf`` for nodes ``names``, all on ``host`` at 127.0.0.1."""
    lines = [
        MARKER,
        f"# state-dir: {paths.root}",
        "# Written by `bridge-cluster up` (bridge_hpc/local_slurm/); `bridge-cluster down` leaves it.",
        f"ClusterName={CLUSTER_NAME}",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={SLURMCTLD_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"StateSaveLocation={paths.ctld_state}",
        f"SlurmdSpoolDir={paths.spool_dir}/%n",
        f"SlurmctldPidFile={paths.pidfile('slurmctld')}",
        f"SlurmdPidFile={paths.pid_dir}/slurmd-%n.pid",
        f"SlurmctldLogFile={paths.log_dir}/slurmctld.log",
        f"SlurmdLogFile={paths.log_dir}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        f"DefMemPerCPU={DEF_MEM_PER_CPU_MB}",
        # several nodes share this machine's cores: trust the configured CPUs/memory
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "JobRequeue=1",
        "KillWait=10",
        "MinJobAge=30",
        "InactiveLimit=0",
        "MailProg=/bin/true",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=1,bf_interval=1",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "JobAcctGatherType=jobacct_gather/linux",
        "JobAcctGatherFrequency=30",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=localhost",
        f"AccountingStoragePort={SLURMDBD_PORT}",
        "",
    ]
    for i, name in enumerate(names):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={SLURMD_BASE_PORT + i} "
            f"CPUs={CPUS_PER_NODE} RealMemory={REAL_MEMORY_MB} State=UNKNOWN"
        )
    lines += [
        "PartitionName=debug Nodes=ALL Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=30 "
        "MaxTime=INFINITE State=UP",
        "PartitionName=urgent Nodes=ALL PriorityTier=10 MaxTime=INFINITE State=UP",
        "",
    ]
    return "\n".join(lines)


def slurmdbd_conf_text(paths: StatePaths, db_password: str) -> str:
    """The whole ``/etc/slurm/slurmdbd.conf``: slurmdbd on localhost, storing into our MariaDB."""
    return "\n".join([
        MARKER,
        f"# state-dir: {paths.root}",
        "AuthType=auth/munge",
        "DbdHost=localhost",
        f"DbdPort={SLURMDBD_PORT}",
        "SlurmUser=root",
        f"PidFile={paths.pidfile('slurmdbd')}",
        f"LogFile={paths.log_dir}/slurmdbd.log",
        "DebugLevel=info",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={MYSQL_PORT}",
        "StorageUser=slurm",
        f"StoragePass={db_password}",
        "StorageLoc=slurm_acct_db",
        "",
    ])


def state_dirs_named(text: str) -> List[Path]:
    """The state directories a config text of ours names in its ``# state-dir:`` line.

    ``up`` uses it to notice that /etc/slurm was written for another state dir whose daemons may still
    hold the ports.
    """
    prefix = "# state-dir: "
    return [Path(line[len(prefix):].strip()) for line in text.splitlines() if line.startswith(prefix)]


def check_managed(path: Path) -> None:
    """Raise ConfigError when ``path`` exists and was not written by bridge-cluster."""
    path = Path(path)
    if not path.exists():
        return
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise ConfigError(f"cannot read it ({err}); bridge-cluster will not overwrite it", path=str(path)) from err
    if MARKER not in text:
        raise ConfigError(
            f"exists and is not managed by bridge-cluster (no '{MARKER}' line); refusing to overwrite "
            "a foreign Slurm configuration. Move it away or use that cluster instead.",
            path=str(path),
        )


def read_or_none(path: Path) -> Optional[str]:
    """The file's text, or None when it cannot be read (absent): compared with the wanted text."""
    try:
        return path.read_text()
    except OSError:
        return None


def write_conf(path: Path, text: str, mode: int) -> None:
    """Replace ``path`` atomically, so a daemon starting meanwhile never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".bridge-tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def chown(path: Path, user: str) -> None:
    """Give ``path`` to ``user`` (and that user's group): munged and mariadbd run as their own users."""
    pw = pwd.getpwnam(user)
    os.chown(path, pw.pw_uid, pw.pw_gid)


def db_password(paths: StatePaths) -> str:
    """The MariaDB password of Slurm's database user, made once per state dir and kept (mode 0600).

    slurmdbd.conf carries it and MariaDB's user is (re)set to it at every start, so the two agree.
    """
    path = paths.db_password_file
    if not path.exists():
        path.write_text(secrets.token_hex(16) + "\n")
        os.chmod(path, 0o600)
    return path.read_text().strip()


def ensure_munge_key(say: Callable[[str], None], key: Path = MUNGE_KEY) -> None:
    """Create the munge key when absent and make it readable by the munge user only.

    The key is machine-wide (``/etc/munge``), not per state dir: the munge clients (sbatch, slurmd, ...)
    find munged through its default socket, and munged reads this default key. An existing key is kept,
    as other munge users on this machine may rely on it. munged refuses a key that others can read or
    write, hence the owner and mode 0400 are set every time.
    """
    if not key.exists():
        say(f"creating munge key {key}")
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(secrets.token_bytes(1024))
    chown(key.parent, "munge")
    chown(key, "munge")
    os.chmod(key, 0o400)
