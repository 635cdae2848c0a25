"""Starting, stopping and watching the local cluster's daemons, each known only by its pid file.

Daemons, in start order: munged (as the munge user), mariadbd (as mysql), slurmdbd, slurmctld, one
``slurmd -N <node>`` per node. Their pid files lie under the state directory (:class:`.conf.StatePaths`).
A daemon is signalled only through the pid its pid file names, and only when ``/proc`` shows that pid
still runs the expected program: never by name, because other Slurm or MariaDB daemons on this machine
(a real cluster, another state dir) are not ours to stop, and a stale pid may have been reused.

Stopping waits until the process has exited (SIGKILL after a grace period), so that a following start
finds its ports free.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from bridge_hpc.local_slurm.conf import (
    ACCOUNT,
    CLUSTER_NAME,
    MYSQL_PORT,
    SLURMCTLD_PORT,
    SLURMDBD_PORT,
    StatePaths,
    chown,
    db_password,
    ensure_munge_key,
)
from bridge_hpc.local_slurm.errors import ClusterError

MUNGE_SOCKET_DIR = Path("/run/munge")  # the clients' default socket lives here
READY_NODE_STATES = {"idle", "mixed", "allocated", "completing"}


# ----------------------------------------------------------------------------------------- processes


def proc_alive(pid: Optional[int], expect: Optional[str] = None) -> bool:
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


def proc_gone(pid: int) -> bool:
    """True when no /proc entry is left (a zombie still counts as present for os.kill(pid, 0))."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap it ourselves if it is our child
    return not Path(f"/proc/{pid}").exists()


def read_pid(path: Path) -> Optional[int]:
    """The pid in a pid file, or None when the file is absent or holds no number."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def wait_gone(pids: Sequence[Optional[int]], timeout: float = 10.0) -> None:
    """Wait until the exited daemons have left the process table (init reaps the zombies)."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if p]
    while left and time.monotonic() < deadline:
        left = [p for p in left if not proc_gone(p)]
        if left:
            time.sleep(0.02)


def exe_of(name: str) -> str:
    """The program daemon ``name`` runs: every ``slurmd-<node>`` is a ``slurmd``."""
    return "slurmd" if name.startswith("slurmd-") else name


def tail(path: Path, lines: int = 15) -> str:
    """The end of a log, indented, for an error message ('' when it cannot be read)."""
    try:
        data = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in data[-lines:])


def run(argv: Sequence[str], timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """subprocess.run with output captured; a timeout (and, with ``check``, a failure) is a ClusterError."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as err:
        raise ClusterError(f"`{' '.join(argv)}` did not finish within {timeout} s") from err
    if check and out.returncode != 0:
        raise ClusterError(
            f"`{' '.join(argv)}` failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()}"
        )
    return out


def munge_works() -> bool:
    """True when a munged answers on the default socket (ours or one the system started)."""
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if enc.returncode != 0:
            return False
        dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=10)
        return dec.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ----------------------------------------------------------------------------------------- nodes


def node_states() -> Dict[str, str]:
    """``{node: state}`` from ``sinfo -N`` (state as Slurm prints it, e.g. ``idle``, ``down*``); {} on error."""
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


def node_ready(state: str) -> bool:
    """True when a node can take jobs: a plain state of :data:`READY_NODE_STATES`, with no flag suffix.

    '*' = not responding, '~' = powered off, '#' = powering up, '!' / '%' = powering down.
    """
    return state in READY_NODE_STATES


# ----------------------------------------------------------------------------------------- daemons


class Daemons:
    """The daemons of the cluster whose state lies in ``paths``; ``say`` reports progress to the user."""

    def __init__(self, paths: StatePaths, say: Callable[[str], None]):
        self.paths = paths
        self.say = say

    # ------------------------------------------------------------------ pid files

    def names(self, configured_nodes: Sequence[str]) -> List[str]:
        """Every daemon of ours: the fixed ones, a slurmd per configured node, and any slurmd with a pid file.

        A slurmd with a pid file but no longer configured (left by an older, larger cluster) is listed
        too, so that ``down`` and ``status`` still see it.
        """
        names = ["munged", "mariadbd", "slurmdbd", "slurmctld"]
        extra = [p.stem for p in self.slurmd_pidfiles()]
        for n in configured_nodes:
            if f"slurmd-{n}" not in extra:
                extra.append(f"slurmd-{n}")
        return names + sorted(extra)

    def pidfile(self, name: str) -> Path:
        return self.paths.pidfile(name)

    def pid_of(self, name: str) -> Optional[int]:
        """The pid of our running daemon ``name``; removes a stale pid file and returns None."""
        path = self.pidfile(name)
        pid = read_pid(path)
        if pid is None:
            return None
        if proc_alive(pid, exe_of(name)):
            return pid
        with contextlib.suppress(OSError):
            path.unlink()
        return None

    def alive(self, name: str) -> bool:
        """Like :meth:`pid_of`, but read-only: a stale pid file is left in place."""
        pid = read_pid(self.pidfile(name))
        return proc_alive(pid, exe_of(name))

    def any_alive(self, configured_nodes: Sequence[str]) -> bool:
        return any(self.alive(n) for n in self.names(configured_nodes))

    def slurmd_pidfiles(self) -> List[Path]:
        if not self.paths.pid_dir.is_dir():
            return []
        return sorted(self.paths.pid_dir.glob("slurmd-*.pid"))

    def make_dirs(self) -> None:
        """Create the state folders; munged and mysql get their own, since they drop root before writing."""
        p = self.paths
        for d in (p.root, p.pid_dir, p.log_dir, p.ctld_state, p.spool_dir, p.mysql_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(p.root, 0o755)  # munge and mysql must reach their folders below it
        os.chmod(p.mysql_dir, 0o755)
        for d, user, mode in ((p.munge_dir, "munge", 0o700), (p.mysql_run, "mysql", 0o755)):
            d.mkdir(parents=True, exist_ok=True)
            chown(d, user)
            os.chmod(d, mode)

    # ------------------------------------------------------------------ start / stop

    def wait_started(self, name: str, log: Path, timeout: float = 20.0) -> int:
        """Wait until ``name`` has written its pid file and runs.

        The command that starts a daemon returns once it has forked, so its exit status alone does not
        say that the daemon came up.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = read_pid(self.pidfile(name))
            if proc_alive(pid, exe_of(name)):
                return pid  # type: ignore[return-value]
            time.sleep(0.05)
        raise ClusterError(f"{name} did not start within {timeout:.0f} s; see {log}:\n{tail(log)}")

    def stop(self, name: str, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM our daemon ``name`` and wait until it has exited (SIGKILL after ``timeout``).

        Returns its pid (or None when it was not running). The exited process may still be a zombie
        for about a second until init reaps it: :func:`wait_gone` waits for that.
        """
        pid = self.pid_of(name)
        if pid is None:
            return None
        exe = exe_of(name)
        self.say(f"stopping {name} (pid {pid})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc_alive(pid, exe):
            time.sleep(0.02)
        if proc_alive(pid, exe):
            self.say(f"{name} (pid {pid}) ignored SIGTERM for {timeout:.0f} s: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and proc_alive(pid, exe):
                time.sleep(0.02)
            if proc_alive(pid, exe):
                raise ClusterError(f"{name} (pid {pid}) is still running after SIGKILL")
        with contextlib.suppress(OSError):
            self.pidfile(name).unlink()
        return pid

    def stop_slurm(self) -> List[Optional[int]]:
        """Cancel all jobs (so no slurmstepd outlives its slurmd), then stop slurmd(s) and slurmctld."""
        if self.alive("slurmctld"):
            out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=15)
            jobs = out.stdout.split() if out.returncode == 0 else []
            if jobs:
                self.say(f"cancelling {len(jobs)} job(s): {' '.join(jobs)}")
                subprocess.run(["scancel", *jobs], capture_output=True, text=True, timeout=30)
                deadline = time.monotonic() + 25
                while time.monotonic() < deadline:
                    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=15)
                    if out.returncode != 0 or not out.stdout.strip():
                        break
                    time.sleep(0.2)
        pids = [self.stop(pidfile.stem) for pidfile in self.slurmd_pidfiles()]
        pids.append(self.stop("slurmctld"))
        return pids

    # ------------------------------------------------------------------ munge

    def start_munge(self) -> None:
        """Start munged unless ours runs or some munged already answers (then that one is used, not stopped)."""
        if self.pid_of("munged") is not None:
            return
        if munge_works():
            self.say("munged: using the one already running (not started by bridge-cluster)")
            return
        ensure_munge_key(self.say)
        MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
        chown(MUNGE_SOCKET_DIR, "munge")
        os.chmod(MUNGE_SOCKET_DIR, 0o755)
        log = self.paths.munge_dir / "munged.log"
        self.say("starting munged")
        cmd = (
            f"/usr/sbin/munged --pid-file={self.pidfile('munged')} --log-file={log} "
            f"--seed-file={self.paths.munge_dir / 'munged.seed'}"
        )
        out = run(["su", "-s", "/bin/sh", "munge", "-c", cmd], check=False)
        if out.returncode != 0:
            raise ClusterError(f"munged failed to start: {(out.stderr or out.stdout).strip()}; see {log}")
        self.wait_started("munged", log)
        deadline = time.monotonic() + 10
        while not munge_works():
            if time.monotonic() > deadline:
                raise ClusterError(f"munged runs but `munge -n | unmunge` fails; see {log}")
            time.sleep(0.05)

    # ------------------------------------------------------------------ MariaDB

    def mysql(self, sql: str) -> None:
        """Run SQL as MariaDB's root, who logs in through the socket (no password to keep)."""
        run(["mariadb", f"--socket={self.paths.mysql_socket}", "-u", "root", "-e", sql], timeout=30)

    def start_mariadb(self) -> None:
        """Start our own mariadbd (data dir created on the first run) and give Slurm its database user."""
        if self.pid_of("mariadbd") is not None:
            return
        p = self.paths
        log = p.mysql_run / "mariadb.log"
        if not (p.mysql_data / "mysql").is_dir():
            self.say(f"initialising the MariaDB data directory {p.mysql_data} (first run only)")
            if p.mysql_data.exists():
                shutil.rmtree(p.mysql_data)
            p.mysql_data.mkdir(parents=True)
            chown(p.mysql_data, "mysql")
            out = run(
                ["mariadb-install-db", "--user=mysql", f"--datadir={p.mysql_data}",
                 "--auth-root-authentication-method=socket", "--skip-test-db"],
                timeout=180, check=False,
            )
            if out.returncode != 0:
                raise ClusterError(f"mariadb-install-db failed: {(out.stderr or out.stdout).strip()[-2000:]}")
        self.say(f"starting mariadbd on 127.0.0.1:{MYSQL_PORT}")
        with contextlib.suppress(OSError):
            p.mysql_socket.unlink()
        argv = [
            "/usr/sbin/mariadbd", "--no-defaults", "--user=mysql", f"--datadir={p.mysql_data}",
            f"--socket={p.mysql_socket}", "--bind-address=127.0.0.1", f"--port={MYSQL_PORT}",
            f"--pid-file={self.pidfile('mariadbd')}", f"--log-error={log}", "--skip-name-resolve",
            "--innodb-buffer-pool-size=128M", "--innodb-lock-wait-timeout=900",
            "--skip-log-bin",
        ]
        # `setsid -f` forks: mariadbd is not our child, so no zombie stays with us when it stops
        with open(p.log_dir / "mariadbd.stdout", "ab") as out:
            subprocess.run(["setsid", "-f", *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=out, check=True)
        self.wait_started("mariadbd", log, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            ping = subprocess.run(
                ["mariadb-admin", f"--socket={p.mysql_socket}", "-u", "root", "ping"],
                capture_output=True, text=True, timeout=10,
            )
            if ping.returncode == 0:
                break
            if time.monotonic() > deadline or not self.alive("mariadbd"):
                raise ClusterError(f"MariaDB does not answer on {p.mysql_socket}; see {log}:\n{tail(log)}")
            time.sleep(0.1)
        pw = db_password(p)
        users = ", ".join(f"'slurm'@'{h}'" for h in ("127.0.0.1", "localhost"))
        sql = ["CREATE DATABASE IF NOT EXISTS slurm_acct_db"]
        for h in ("127.0.0.1", "localhost"):
            sql.append(f"CREATE USER IF NOT EXISTS 'slurm'@'{h}' IDENTIFIED BY '{pw}'")
            sql.append(f"ALTER USER 'slurm'@'{h}' IDENTIFIED BY '{pw}'")
        sql.append(f"GRANT ALL ON slurm_acct_db.* TO {users}")
        self.mysql("; ".join(sql))

    # ------------------------------------------------------------------ slurmdbd

    def start_slurmdbd(self) -> None:
        """Start slurmdbd unless ours runs, then wait until it answers sacctmgr (whoever started it)."""
        log = self.paths.log_dir / "slurmdbd.log"
        if self.pid_of("slurmdbd") is None:
            self.say(f"starting slurmdbd on port {SLURMDBD_PORT}")
            out = run(["slurmdbd"], check=False, timeout=60)
            if out.returncode != 0:
                raise ClusterError(f"slurmdbd failed to start: {(out.stderr or out.stdout).strip()}; see {log}")
            self.wait_started("slurmdbd", log)
        deadline = time.monotonic() + 60  # a fresh database: slurmdbd creates its tables first
        while True:
            out = subprocess.run(
                ["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"],
                capture_output=True, text=True, timeout=30,
            )
            if out.returncode == 0:
                return
            if time.monotonic() > deadline or not self.alive("slurmdbd"):
                raise ClusterError(f"slurmdbd does not answer sacctmgr; see {log}:\n{tail(log)}")
            time.sleep(0.2)

    def register_accounting(self) -> None:
        """Add the cluster, the account and the users (root, $SUDO_USER) to slurmdbd when missing.

        Only what ``sacctmgr list`` does not show yet is added, so every ``up`` can call it.
        """
        def listed(kind: str, fmt: str) -> List[str]:
            out = run(["sacctmgr", "-n", "-P", "list", kind, f"format={fmt}"], timeout=30)
            return [line.strip() for line in out.stdout.splitlines() if line.strip()]

        if CLUSTER_NAME not in listed("cluster", "cluster"):
            self.say(f"sacctmgr: adding cluster {CLUSTER_NAME}")
            run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], timeout=30)
        if ACCOUNT not in listed("account", "account"):
            run(["sacctmgr", "-i", "add", "account", ACCOUNT, f"cluster={CLUSTER_NAME}",
                 "description=bridge-cluster", "organization=bridge"], timeout=30)
        users = {"root"}
        sudo_user = os.environ.get("SUDO_USER")
        if sudo_user:
            users.add(sudo_user)
        present = set(listed("user", "user"))
        for user in sorted(users - present):
            run(["sacctmgr", "-i", "add", "user", user, f"account={ACCOUNT}", f"cluster={CLUSTER_NAME}"],
                timeout=30)

    # ------------------------------------------------------------------ slurmctld / slurmd

    def start_slurmctld(self) -> None:
        """Start slurmctld unless ours runs, and wait until it answers ``scontrol ping``."""
        if self.pid_of("slurmctld") is not None:
            return
        log = self.paths.log_dir / "slurmctld.log"
        self.say(f"starting slurmctld on port {SLURMCTLD_PORT}")
        # -i: ignore state of nodes/jobs that no longer fit the configuration (after a resize)
        out = run(["slurmctld", "-i"], check=False, timeout=60)
        if out.returncode != 0:
            raise ClusterError(f"slurmctld failed to start: {(out.stderr or out.stdout).strip()}; see {log}")
        self.wait_started("slurmctld", log)
        deadline = time.monotonic() + 30
        while subprocess.run(["scontrol", "ping"], capture_output=True, timeout=15).returncode != 0:
            if time.monotonic() > deadline or not self.alive("slurmctld"):
                raise ClusterError(f"slurmctld does not answer `scontrol ping`; see {log}:\n{tail(log)}")
            time.sleep(0.05)

    def start_slurmd(self, node: str) -> None:
        """Start ``slurmd -N node`` unless ours runs; each node has its own spool folder, log and pid file."""
        name = f"slurmd-{node}"
        if self.pid_of(name) is not None:
            return
        (self.paths.spool_dir / node).mkdir(parents=True, exist_ok=True)
        log = self.paths.log_dir / f"slurmd-{node}.log"
        self.say(f"starting slurmd for node {node}")
        out = run(["slurmd", "-N", node], check=False, timeout=60)
        if out.returncode != 0:
            raise ClusterError(f"slurmd -N {node} failed to start: {(out.stderr or out.stdout).strip()}; see {log}")
        self.wait_started(name, log)

    def wait_nodes_ready(self, names: Sequence[str], timeout: float) -> None:
        """Wait until ``sinfo`` lists exactly ``names``, all ready; resume nodes an earlier run left down."""
        deadline = time.monotonic() + timeout
        states: Dict[str, str] = {}
        while time.monotonic() < deadline:
            states = node_states()
            if set(states) == set(names) and all(node_ready(s) for s in states.values()):
                return
            for n in names:  # a node left DOWN by an earlier run: ReturnToService=2 normally clears it
                if states.get(n, "").rstrip("*~#!%$@^-") in ("down", "drained", "draining"):
                    subprocess.run(["scontrol", "update", f"nodename={n}", "state=resume"],
                                   capture_output=True, timeout=15)
            time.sleep(0.1)
        logs = ", ".join(str(self.paths.log_dir / f"slurmd-{n}.log") for n in names)
        shown = ", ".join(f"{n}={states.get(n, 'missing')}" for n in names)
        raise ClusterError(
            f"nodes not idle after {timeout:.0f} s ({shown}); see {self.paths.log_dir / 'slurmctld.log'} and {logs}"
        )
