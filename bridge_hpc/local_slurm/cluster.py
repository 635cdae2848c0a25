"""A real Slurm cluster on this machine: ``bridge-cluster up | down | status``.

One node named after the host (``hostname -s``) by default, or nodes ``n1..nN`` (``up(nodes=N)``):
several ``slurmd -N nX`` daemons on 127.0.0.1 with distinct ports, so multi-node launches run for real.
Accounting works as on a production cluster: MariaDB (own data directory and socket under the
state directory, 127.0.0.1 on a non-default port) + slurmdbd, so ``sacct`` answers.

Daemons started here, in order: munged (as the munge user), mariadbd (as mysql), slurmdbd,
slurmctld, one slurmd per node. Each is known by its pid file under ``<state_dir>/pids`` and is
stopped by that pid only — never by name. ``/etc/slurm/slurm.conf`` and ``slurmdbd.conf`` are written
only when absent or marked ``# managed by bridge-cluster``; a foreign file is left alone and ``up``
refuses. Slurm's own state (StateSaveLocation, spool, logs) lives under the state directory, so job
ids keep growing across ``down``/``up`` and ``sacct -j`` never sees two jobs with one id.

The Debian packages are installed with apt-get when missing (needs root and a package mirror).

Python use::

    from bridge_hpc.local_slurm.cluster import LocalCluster, release_requeued
    c = LocalCluster()          # $BRIDGE_CLUSTER_DIR or /var/tmp/bridge-cluster
    c.up(nodes=2)               # idempotent; waits until every node is idle
    c.status()                  # {'daemons': {...pid/alive...}, 'nodes': {'n1': 'idle', ...}, ...}
    c.down()                    # stops exactly the daemons it started, waits for them to exit
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from bridge_hpc.contracts.errors import ConfigError

MARKER = "# managed by bridge-cluster"
ETC_SLURM = Path("/etc/slurm")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_SOCKET_DIR = Path("/run/munge")  # the clients' default socket lives here

APT_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "slurmdbd", "mariadb-server"]
# binaries that prove the packages are there
REQUIRED_BINARIES = [
    "slurmctld", "slurmd", "slurmdbd", "sbatch", "squeue", "sinfo", "scontrol", "sacct", "sacctmgr",
    "munged", "munge", "unmunge", "mariadbd", "mariadb-install-db", "mariadb", "mariadb-admin",
]

CLUSTER_NAME = "bridge"
ACCOUNT = "bridge"
SLURMCTLD_PORT = 6817
SLURMDBD_PORT = 6819
SLURMD_BASE_PORT = 17001  # node i listens on SLURMD_BASE_PORT + i - 1
MYSQL_PORT = 13306
CPUS_PER_NODE = 2
REAL_MEMORY_MB = 8000
DEF_MEM_PER_CPU_MB = 1000

DEFAULT_STATE_DIR = "/var/tmp/bridge-cluster"
READY_NODE_STATES = {"idle", "mixed", "allocated", "completing"}


class ClusterError(RuntimeError):
    """A daemon failed to start or stop, or a package could not be installed (CLI exit status 1)."""


# ----------------------------------------------------------------------------------------- helpers


def short_hostname() -> str:
    out = subprocess.run(["hostname", "-s"], capture_output=True, text=True)
    name = out.stdout.strip()
    if out.returncode != 0 or not name:
        raise ClusterError(f"`hostname -s` failed: {out.stderr.strip()}")
    return name


def release_requeued(job_id) -> None:
    """Let a requeued job start now: Slurm holds it pending (Reason=BeginTime) for ~120 s otherwise.

    Not within the second of the requeue, though: slurmd refuses to launch a job whose credential it
    revoked in the same second ("Job credential revoked") and the run fails. A requeue resets the
    job's SubmitTime, so wait until two seconds past it.
    """
    show = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True).stdout
    submitted = next((f.split("=", 1)[1] for f in show.split() if f.startswith("SubmitTime=")), "")
    try:
        wait = time.mktime(time.strptime(submitted, "%Y-%m-%dT%H:%M:%S")) + 2.0 - time.time()
    except ValueError:
        wait = 0.0
    if wait > 0:
        time.sleep(min(wait, 5.0))
    out = subprocess.run(
        ["scontrol", "update", f"jobid={job_id}", "StartTime=now"], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise ClusterError(
            f"scontrol update jobid={job_id} StartTime=now failed: {(out.stderr or out.stdout).strip()}"
        )


def check_managed(path: Path) -> None:
    """Raise ConfigError when ``path`` exists and was not written by bridge-cluster."""
    path = Path(path)
    if not path.exists():
        return
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise ConfigError(f"cannot read it ({err}); bridge-cluster will not overwrite it", path=str(path))
    if MARKER not in text:
        raise ConfigError(
            f"exists and is not managed by bridge-cluster (no '{MARKER}' line); refusing to overwrite "
            "a foreign Slurm configuration. Move it away or use that cluster instead.",
            path=str(path),
        )


def _proc_alive(pid: Optional[int], expect: Optional[str] = None) -> bool:
    """True when ``pid`` runs (not a zombie) and, if given, its executable is named ``expect``."""
    if not pid or pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # state is the field after the ')' that closes the command name
    state = stat.rsplit(")", 1)[1].split()[0]
    if state in ("Z", "X"):
        return False
    if expect:
        names = set()
        with contextlib.suppress(OSError):
            names.add(os.path.basename(os.readlink(f"/proc/{pid}/exe")).split(" ")[0])
        with contextlib.suppress(OSError):
            names.add(Path(f"/proc/{pid}/comm").read_text().strip())
        if names and expect not in names:
            return False  # pid reused by another program: a stale pid file
    return True


def _proc_gone(pid: int) -> bool:
    """True when no /proc entry is left (a zombie still counts as present for os.kill(pid, 0))."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap it ourselves if it is our child
    return not Path(f"/proc/{pid}").exists()


def _read_pid(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        data = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in data[-lines:])


def _chown(path: Path, user: str) -> None:
    pw = pwd.getpwnam(user)
    os.chown(path, pw.pw_uid, pw.pw_gid)


def _run(argv: Sequence[str], timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as err:
        raise ClusterError(f"`{' '.join(argv)}` did not finish within {timeout} s") from err
    if check and out.returncode != 0:
        raise ClusterError(
            f"`{' '.join(argv)}` failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()}"
        )
    return out


# ----------------------------------------------------------------------------------------- cluster


class LocalCluster:
    """A Slurm cluster of ``nodes`` nodes on this machine, with its state under ``state_dir``."""

    def __init__(self, state_dir: Optional[str] = None, *, quiet: bool = False):
        self.state_dir = Path(state_dir or os.environ.get("BRIDGE_CLUSTER_DIR") or DEFAULT_STATE_DIR).resolve()
        self.quiet = quiet
        self.pid_dir = self.state_dir / "pids"
        self.log_dir = self.state_dir / "log"
        self.ctld_state = self.state_dir / "slurmctld"
        self.spool_dir = self.state_dir / "slurmd"
        self.munge_dir = self.state_dir / "munge"
        self.mysql_dir = self.state_dir / "mysql"
        self.mysql_data = self.mysql_dir / "data"
        self.mysql_run = self.mysql_dir / "run"
        self.mysql_socket = self.mysql_run / "mariadb.sock"
        self.info_file = self.state_dir / "cluster.json"
        self.slurm_conf = ETC_SLURM / "slurm.conf"
        self.slurmdbd_conf = ETC_SLURM / "slurmdbd.conf"

    # ------------------------------------------------------------------ public API

    def up(self, nodes: int = 1, timeout: float = 90.0) -> None:
        """Start (or reconfigure to) a cluster of ``nodes`` nodes and wait until all are idle."""
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise ConfigError(f"--nodes must be a whole number >= 1, got {nodes!r}", key="nodes")
        if nodes > 64:
            raise ConfigError(f"--nodes {nodes} is more than this one machine can host (at most 64)", key="nodes")
        self._require_root("up")
        t0 = time.monotonic()
        self._ensure_packages()
        with self._lock():
            host = short_hostname()
            names = self.node_names(nodes, host)
            slurm_conf = self._slurm_conf_text(host, names)
            if self.is_up(nodes) and self._read(self.slurm_conf) == slurm_conf:
                self._say(f"already up: {self._node_word(nodes)}, state in {self.state_dir}")
                return
            self._check_conf_files()
            self._make_dirs()
            dbd_conf = self._slurmdbd_conf_text()

            # a different node count (or host, or state dir): stop slurmctld/slurmd before rewriting
            current = self._read(self.slurm_conf)
            if current != slurm_conf and (self._alive("slurmctld") or self._slurmd_pidfiles()):
                self._say(f"reconfiguring for {self._node_word(nodes)}: stopping slurmctld and slurmd")
                self._stop_slurm()
            if current != slurm_conf:
                self._write_conf(self.slurm_conf, slurm_conf, 0o644)

            self._start_munge()
            self._start_mariadb()
            current_dbd = self._read(self.slurmdbd_conf)
            if current_dbd != dbd_conf:
                if self._alive("slurmdbd"):
                    self._stop_daemon("slurmdbd")
                self._write_conf(self.slurmdbd_conf, dbd_conf, 0o600)
            self._start_slurmdbd()
            self._register_accounting()
            self._start_slurmctld()
            # slurmd of nodes that are no longer configured (an older, larger cluster)
            for pidfile in self._slurmd_pidfiles():
                node = pidfile.stem[len("slurmd-"):]
                if node not in names:
                    self._stop_daemon(f"slurmd-{node}")
            for name in names:
                self._start_slurmd(name)
            self.info_file.write_text(json.dumps({"nodes": nodes, "node_names": names, "host": host}) + "\n")
            self._wait_nodes_ready(names, timeout)
        self._say(f"up: {self._node_word(nodes)} ({', '.join(names)}) in {time.monotonic() - t0:.1f} s")

    def down(self) -> None:
        """Stop the daemons this tool started (by their pid files) and wait until they are gone."""
        self._require_root("down")
        with self._lock():
            known = [n for n in self._daemon_names() if self._pid_of(n) is not None]
            if not known:
                self._say("already down: no daemon of ours is running")
                return
            pids = self._stop_slurm()
            for name in ("slurmdbd", "mariadbd", "munged"):
                pids.append(self._stop_daemon(name))
            self._wait_gone(pids)
        self._say("down: all daemons stopped")

    def status(self) -> dict:
        """``{'daemons': {name: {'pid', 'alive', 'pidfile'}}, 'nodes': {node: state}, 'up': bool, ...}``."""
        info = self._info()
        daemons: Dict[str, dict] = {}
        for name in self._daemon_names():
            pid = _read_pid(self._pidfile(name))
            daemons[name] = {
                "pid": pid,
                "alive": _proc_alive(pid, self._exe(name)),
                "pidfile": str(self._pidfile(name)),
            }
        nodes = self.node_states() if daemons.get("slurmctld", {}).get("alive") else {}
        return {
            "state_dir": str(self.state_dir),
            "configured_nodes": info.get("nodes"),
            "daemons": daemons,
            "nodes": nodes,
            "up": self.is_up(),
        }

    def is_up(self, nodes: Optional[int] = None) -> bool:
        """True when every daemon of ours runs and all configured nodes answer (``nodes`` must match)."""
        info = self._info()
        names = info.get("node_names")
        if not names or (nodes is not None and info.get("nodes") != nodes):
            return False
        if nodes is not None and names != self.node_names(nodes, info.get("host") or ""):
            return False
        if not self.slurm_conf.exists() or str(self.state_dir) not in self.slurm_conf.read_text(errors="replace"):
            return False  # /etc/slurm/slurm.conf now belongs to another state dir or was replaced
        wanted = ["mariadbd", "slurmdbd", "slurmctld"] + [f"slurmd-{n}" for n in names]
        if not all(self._alive(d) for d in wanted):
            return False
        if not (self._alive("munged") or self._munge_works()):
            return False
        states = self.node_states()
        return set(states) == set(names) and all(self._ready(s) for s in states.values())

    # ------------------------------------------------------------------ small public helpers

    def configured_nodes(self) -> Optional[int]:
        """The node count the last ``up`` configured (None before the first ``up``)."""
        return self._info().get("nodes")

    @staticmethod
    def node_names(nodes: int, host: str) -> List[str]:
        return [host] if nodes == 1 else [f"n{i}" for i in range(1, nodes + 1)]

    def node_states(self) -> Dict[str, str]:
        """``{node: state}`` from ``sinfo -N`` (state as Slurm prints it, e.g. ``idle``, ``down*``)."""
        try:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=15
            )
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if out.returncode != 0:
            return {}
        states: Dict[str, str] = {}
        for line in out.stdout.splitlines():  # a node appears once per partition
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    # ------------------------------------------------------------------ daemons

    def _daemon_names(self) -> List[str]:
        names = ["munged", "mariadbd", "slurmdbd", "slurmctld"]
        configured = self._info().get("node_names") or []
        extra = [p.stem for p in self._slurmd_pidfiles()]
        for n in configured:
            if f"slurmd-{n}" not in extra:
                extra.append(f"slurmd-{n}")
        return names + sorted(extra)

    def _pidfile(self, name: str) -> Path:
        if name == "mariadbd":
            return self.mysql_run / "mariadbd.pid"  # written by mariadbd as the mysql user
        if name == "munged":
            return self.munge_dir / "munged.pid"  # written by munged as the munge user
        return self.pid_dir / f"{name}.pid"

    @staticmethod
    def _exe(name: str) -> str:
        return "slurmd" if name.startswith("slurmd-") else name

    def _pid_of(self, name: str) -> Optional[int]:
        """The pid of our running daemon ``name``; removes a stale pid file and returns None."""
        path = self._pidfile(name)
        pid = _read_pid(path)
        if pid is None:
            return None
        if _proc_alive(pid, self._exe(name)):
            return pid
        with contextlib.suppress(OSError):
            path.unlink()
        return None

    def _alive(self, name: str) -> bool:
        pid = _read_pid(self._pidfile(name))
        return _proc_alive(pid, self._exe(name))

    def _slurmd_pidfiles(self) -> List[Path]:
        if not self.pid_dir.is_dir():
            return []
        return sorted(self.pid_dir.glob("slurmd-*.pid"))

    def _wait_started(self, name: str, log: Path, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = _read_pid(self._pidfile(name))
            if _proc_alive(pid, self._exe(name)):
                return pid  # type: ignore[return-value]
            time.sleep(0.05)
        raise ClusterError(f"{name} did not start within {timeout:.0f} s; see {log}:\n{_tail(log)}")

    def _stop_daemon(self, name: str, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM our daemon ``name`` and wait until it has exited (SIGKILL after ``timeout``).

        Returns its pid (or None when it was not running). The exited process may still be a zombie
        for about a second until init reaps it: :meth:`_wait_gone` waits for that.
        """
        pid = self._pid_of(name)
        if pid is None:
            return None
        exe = self._exe(name)
        self._say(f"stopping {name} (pid {pid})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _proc_alive(pid, exe):
            time.sleep(0.02)
        if _proc_alive(pid, exe):
            self._say(f"{name} (pid {pid}) ignored SIGTERM for {timeout:.0f} s: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _proc_alive(pid, exe):
                time.sleep(0.02)
            if _proc_alive(pid, exe):
                raise ClusterError(f"{name} (pid {pid}) is still running after SIGKILL")
        with contextlib.suppress(OSError):
            self._pidfile(name).unlink()
        return pid

    @staticmethod
    def _wait_gone(pids: Sequence[Optional[int]], timeout: float = 10.0) -> None:
        """Wait until the exited daemons have left the process table (init reaps the zombies)."""
        deadline = time.monotonic() + timeout
        left = [p for p in pids if p]
        while left and time.monotonic() < deadline:
            left = [p for p in left if not _proc_gone(p)]
            if left:
                time.sleep(0.02)

    def _stop_slurm(self) -> List[Optional[int]]:
        """Cancel all jobs (so no slurmstepd outlives its slurmd), then stop slurmd(s) and slurmctld."""
        if self._alive("slurmctld"):
            out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=15)
            jobs = out.stdout.split() if out.returncode == 0 else []
            if jobs:
                self._say(f"cancelling {len(jobs)} job(s): {' '.join(jobs)}")
                subprocess.run(["scancel", *jobs], capture_output=True, text=True, timeout=30)
                deadline = time.monotonic() + 25
                while time.monotonic() < deadline:
                    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=15)
                    if out.returncode != 0 or not out.stdout.strip():
                        break
                    time.sleep(0.2)
        pids = [self._stop_daemon(pidfile.stem) for pidfile in self._slurmd_pidfiles()]
        pids.append(self._stop_daemon("slurmctld"))
        return pids

    # ---------------------------------------------------------------- munge

    def _munge_works(self) -> bool:
        try:
            enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
            if enc.returncode != 0:
                return False
            dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=10)
            return dec.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _start_munge(self) -> None:
        if self._pid_of("munged") is not None:
            return
        if self._munge_works():
            self._say("munged: using the one already running (not started by bridge-cluster)")
            return
        if not MUNGE_KEY.exists():
            self._say(f"creating munge key {MUNGE_KEY}")
            MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
            MUNGE_KEY.write_bytes(secrets.token_bytes(1024))
        _chown(MUNGE_KEY.parent, "munge")
        _chown(MUNGE_KEY, "munge")
        os.chmod(MUNGE_KEY, 0o400)
        MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
        _chown(MUNGE_SOCKET_DIR, "munge")
        os.chmod(MUNGE_SOCKET_DIR, 0o755)
        log = self.munge_dir / "munged.log"
        self._say("starting munged")
        cmd = (
            f"/usr/sbin/munged --pid-file={self._pidfile('munged')} --log-file={log} "
            f"--seed-file={self.munge_dir / 'munged.seed'}"
        )
        out = _run(["su", "-s", "/bin/sh", "munge", "-c", cmd], check=False)
        if out.returncode != 0:
            raise ClusterError(f"munged failed to start: {(out.stderr or out.stdout).strip()}; see {log}")
        self._wait_started("munged", log)
        deadline = time.monotonic() + 10
        while not self._munge_works():
            if time.monotonic() > deadline:
                raise ClusterError(f"munged runs but `munge -n | unmunge` fails; see {log}")
            time.sleep(0.05)

    # ---------------------------------------------------------------- MariaDB

    def _mysql(self, sql: str) -> None:
        _run(["mariadb", f"--socket={self.mysql_socket}", "-u", "root", "-e", sql], timeout=30)

    def _db_password(self) -> str:
        path = self.mysql_dir / "slurm-db-password"
        if not path.exists():
            path.write_text(secrets.token_hex(16) + "\n")
            os.chmod(path, 0o600)
        return path.read_text().strip()

    def _start_mariadb(self) -> None:
        if self._pid_of("mariadbd") is not None:
            return
        log = self.mysql_run / "mariadb.log"
        if not (self.mysql_data / "mysql").is_dir():
            self._say(f"initialising the MariaDB data directory {self.mysql_data} (first run only)")
            if self.mysql_data.exists():
                shutil.rmtree(self.mysql_data)
            self.mysql_data.mkdir(parents=True)
            _chown(self.mysql_data, "mysql")
            out = _run(
                ["mariadb-install-db", "--user=mysql", f"--datadir={self.mysql_data}",
                 "--auth-root-authentication-method=socket", "--skip-test-db"],
                timeout=180, check=False,
            )
            if out.returncode != 0:
                raise ClusterError(f"mariadb-install-db failed: {(out.stderr or out.stdout).strip()[-2000:]}")
        self._say(f"starting mariadbd on 127.0.0.1:{MYSQL_PORT}")
        with contextlib.suppress(OSError):
            self.mysql_socket.unlink()
        argv = [
            "/usr/sbin/mariadbd", "--no-defaults", "--user=mysql", f"--datadir={self.mysql_data}",
            f"--socket={self.mysql_socket}", "--bind-address=127.0.0.1", f"--port={MYSQL_PORT}",
            f"--pid-file={self._pidfile('mariadbd')}", f"--log-error={log}", "--skip-name-resolve",
            "--innodb-buffer-pool-size=128M", "--innodb-lock-wait-timeout=900",
            "--skip-log-bin",
        ]
        # `setsid -f` forks: mariadbd is not our child, so no zombie stays with us when it stops
        with open(self.log_dir / "mariadbd.stdout", "ab") as out:
            subprocess.run(["setsid", "-f", *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=out, check=True)
        self._wait_started("mariadbd", log, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            ping = subprocess.run(
                ["mariadb-admin", f"--socket={self.mysql_socket}", "-u", "root", "ping"],
                capture_output=True, text=True, timeout=10,
            )
            if ping.returncode == 0:
                break
            if time.monotonic() > deadline or not self._alive("mariadbd"):
                raise ClusterError(f"MariaDB does not answer on {self.mysql_socket}; see {log}:\n{_tail(log)}")
            time.sleep(0.1)
        pw = self._db_password()
        users = ", ".join(f"'slurm'@'{h}'" for h in ("127.0.0.1", "localhost"))
        sql = ["CREATE DATABASE IF NOT EXISTS slurm_acct_db"]
        for h in ("127.0.0.1", "localhost"):
            sql.append(f"CREATE USER IF NOT EXISTS 'slurm'@'{h}' IDENTIFIED BY '{pw}'")
            sql.append(f"ALTER USER 'slurm'@'{h}' IDENTIFIED BY '{pw}'")
        sql.append(f"GRANT ALL ON slurm_acct_db.* TO {users}")
        self._mysql("; ".join(sql))

    # ---------------------------------------------------------------- slurmdbd

    def _start_slurmdbd(self) -> None:
        log = self.log_dir / "slurmdbd.log"
        if self._pid_of("slurmdbd") is None:
            self._say(f"starting slurmdbd on port {SLURMDBD_PORT}")
            out = _run(["slurmdbd"], check=False, timeout=60)
            if out.returncode != 0:
                raise ClusterError(f"slurmdbd failed to start: {(out.stderr or out.stdout).strip()}; see {log}")
            self._wait_started("slurmdbd", log)
        deadline = time.monotonic() + 60  # a fresh database: slurmdbd creates its tables first
        while True:
            out = subprocess.run(
                ["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"],
                capture_output=True, text=True, timeout=30,
            )
            if out.returncode == 0:
                return
            if time.monotonic() > deadline or not self._alive("slurmdbd"):
                raise ClusterError(f"slurmdbd does not answer sacctmgr; see {log}:\n{_tail(log)}")
            time.sleep(0.2)

    def _register_accounting(self) -> None:
        def listed(kind: str, fmt: str) -> List[str]:
            out = _run(["sacctmgr", "-n", "-P", "list", kind, f"format={fmt}"], timeout=30)
            return [line.strip() for line in out.stdout.splitlines() if line.strip()]

        if CLUSTER_NAME not in listed("cluster", "cluster"):
            self._say(f"sacctmgr: adding cluster {CLUSTER_NAME}")
            _run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], timeout=30)
        if ACCOUNT not in listed("account", "account"):
            _run(["sacctmgr", "-i", "add", "account", ACCOUNT, f"cluster={CLUSTER_NAME}",
                  "description=bridge-cluster", "organization=bridge"], timeout=30)
        users = {"root"}
        sudo_user = os.environ.get("SUDO_USER")
        if sudo_user:
            users.add(sudo_user)
        present = set(listed("user", "user"))
        for user in sorted(users - present):
            _run(["sacctmgr", "-i", "add", "user", user, f"account={ACCOUNT}", f"cluster={CLUSTER_NAME}"],
                 timeout=30)

    # ---------------------------------------------------------------- slurmctld / slurmd

    def _start_slurmctld(self) -> None:
        if self._pid_of("slurmctld") is not None:
            return
        log = self.log_dir / "slurmctld.log"
        self._say(f"starting slurmctld on port {SLURMCTLD_PORT}")
        # -i: ignore state of nodes/jobs that no longer fit the configuration (after a resize)
        out = _run(["slurmctld", "-i"], check=False, timeout=60)
        if out.returncode != 0:
            raise ClusterError(f"slurmctld failed to start: {(out.stderr or out.stdout).strip()}; see {log}")
        self._wait_started("slurmctld", log)
        deadline = time.monotonic() + 30
        while subprocess.run(["scontrol", "ping"], capture_output=True, timeout=15).returncode != 0:
            if time.monotonic() > deadline or not self._alive("slurmctld"):
                raise ClusterError(f"slurmctld does not answer `scontrol ping`; see {log}:\n{_tail(log)}")
            time.sleep(0.05)

    def _start_slurmd(self, node: str) -> None:
        name = f"slurmd-{node}"
        if self._pid_of(name) is not None:
            return
        (self.spool_dir / node).mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"slurmd-{node}.log"
        self._say(f"starting slurmd for node {node}")
        out = _run(["slurmd", "-N", node], check=False, timeout=60)
        if out.returncode != 0:
            raise ClusterError(f"slurmd -N {node} failed to start: {(out.stderr or out.stdout).strip()}; see {log}")
        self._wait_started(name, log)

    @staticmethod
    def _ready(state: str) -> bool:
        # '*' = not responding, '~' = powered off, '#' = powering up, '!' / '%' = powering down
        return state in READY_NODE_STATES

    def _wait_nodes_ready(self, names: List[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: Dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if set(states) == set(names) and all(self._ready(s) for s in states.values()):
                return
            for n in names:  # a node left DOWN by an earlier run: ReturnToService=2 normally clears it
                if states.get(n, "").rstrip("*~#!%$@^-") in ("down", "drained", "draining"):
                    subprocess.run(["scontrol", "update", f"nodename={n}", "state=resume"],
                                   capture_output=True, timeout=15)
            time.sleep(0.1)
        logs = ", ".join(str(self.log_dir / f"slurmd-{n}.log") for n in names)
        shown = ", ".join(f"{n}={states.get(n, 'missing')}" for n in names)
        raise ClusterError(
            f"nodes not idle after {timeout:.0f} s ({shown}); see {self.log_dir / 'slurmctld.log'} and {logs}"
        )

    # ---------------------------------------------------------------- configuration files

    def _slurm_conf_text(self, host: str, names: List[str]) -> str:
        sd = self.state_dir
        lines = [
            MARKER,
            f"# state-dir: {sd}",
            "# Written by `bridge-cluster up` (bridge_hpc/local_slurm/); `bridge-cluster down` leaves it.",
            f"ClusterName={CLUSTER_NAME}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={SLURMCTLD_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"StateSaveLocation={self.ctld_state}",
            f"SlurmdSpoolDir={self.spool_dir}/%n",
            f"SlurmctldPidFile={self._pidfile('slurmctld')}",
            f"SlurmdPidFile={self.pid_dir}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.log_dir}/slurmctld.log",
            f"SlurmdLogFile={self.log_dir}/slurmd-%n.log",
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

    def _slurmdbd_conf_text(self) -> str:
        return "\n".join([
            MARKER,
            f"# state-dir: {self.state_dir}",
            "AuthType=auth/munge",
            "DbdHost=localhost",
            f"DbdPort={SLURMDBD_PORT}",
            "SlurmUser=root",
            f"PidFile={self._pidfile('slurmdbd')}",
            f"LogFile={self.log_dir}/slurmdbd.log",
            "DebugLevel=info",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={MYSQL_PORT}",
            "StorageUser=slurm",
            f"StoragePass={self._db_password()}",
            "StorageLoc=slurm_acct_db",
            "",
        ])

    def _check_conf_files(self) -> None:
        for path in (self.slurm_conf, self.slurmdbd_conf):
            check_managed(path)
        # ours, but written for another state dir whose daemons still run: ports would clash
        if self.slurm_conf.exists():
            for line in self.slurm_conf.read_text().splitlines():
                if line.startswith("# state-dir: "):
                    other = Path(line[len("# state-dir: "):].strip())
                    if other != self.state_dir and LocalCluster(str(other), quiet=True)._any_alive():
                        raise ConfigError(
                            f"a bridge-cluster with state dir {other} is running; "
                            f"run `bridge-cluster down --state-dir {other}` first"
                        )

    def _any_alive(self) -> bool:
        return any(self._alive(n) for n in self._daemon_names())

    def _write_conf(self, path: Path, text: str, mode: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".bridge-tmp")
        tmp.write_text(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        self._say(f"wrote {path}")

    # ---------------------------------------------------------------- plumbing

    def _make_dirs(self) -> None:
        for d in (self.state_dir, self.pid_dir, self.log_dir, self.ctld_state, self.spool_dir, self.mysql_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o755)  # munge and mysql must reach their folders below it
        os.chmod(self.mysql_dir, 0o755)
        for d, user, mode in ((self.munge_dir, "munge", 0o700), (self.mysql_run, "mysql", 0o755)):
            d.mkdir(parents=True, exist_ok=True)
            _chown(d, user)
            os.chmod(d, mode)

    @staticmethod
    def _read(path: Path) -> Optional[str]:
        try:
            return path.read_text()
        except OSError:
            return None

    def _info(self) -> dict:
        try:
            return json.loads(self.info_file.read_text())
        except (OSError, ValueError):
            return {}

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """One up/down at a time (several test sessions may share the machine)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @staticmethod
    def _require_root(what: str) -> None:
        if os.geteuid() != 0:
            raise ConfigError(
                f"`bridge-cluster {what}` must run as root: it writes /etc/slurm and starts system daemons"
            )

    def _ensure_packages(self) -> None:
        missing = [b for b in REQUIRED_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
        if not missing:
            return
        if shutil.which("apt-get") is None:
            raise ClusterError(
                f"Slurm is not installed (missing: {', '.join(missing)}) and apt-get is not available; "
                f"install {' '.join(APT_PACKAGES)} by hand"
            )
        self._say(f"missing {', '.join(missing)}: installing {' '.join(APT_PACKAGES)} with apt-get (about a minute)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for argv in (["apt-get", "update"], ["apt-get", "install", "-y", *APT_PACKAGES]):
            self._say("$ " + " ".join(argv))
            sys.stdout.flush()
            rc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL).returncode  # apt shows progress
            if rc != 0:
                raise ClusterError(f"`{' '.join(argv)}` failed with exit status {rc}")
        still = [b for b in REQUIRED_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
        if still:
            raise ClusterError(f"after apt-get install these are still missing: {', '.join(still)}")

    @staticmethod
    def _node_word(nodes: int) -> str:
        return f"{nodes} node" + ("" if nodes == 1 else "s")

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(f"bridge-cluster: {msg}", flush=True)
