"""A real Slurm cluster on this machine: ``bridge-cluster up | down | status``.

One node named after the host (``hostname -s``) by default, or nodes ``n1..nN`` (``up(nodes=N)``):
several ``slurmd -N nX`` daemons on 127.0.0.1 with distinct ports, so multi-node launches run for real.
Accounting works as on a production cluster: MariaDB (own data directory and socket under the
state directory, 127.0.0.1 on a non-default port) + slurmdbd, so ``sacct`` answers.

This module is the facade, :class:`LocalCluster`, which puts three parts together in the right order:

* :mod:`.install` -- the Debian packages, installed with apt-get when a binary is missing (needs root
  and a package mirror);
* :mod:`.conf` -- the text of ``/etc/slurm/slurm.conf`` and ``slurmdbd.conf`` (written only when absent
  or marked ``# managed by bridge-cluster``; a foreign file is left alone and ``up`` refuses), the
  state directory's layout, the munge key;
* :mod:`.daemons` -- munged, mariadbd, slurmdbd, slurmctld and a slurmd per node, each known by its pid
  file under the state directory and stopped by that pid only, never by name.

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
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.local_slurm import conf, install
from bridge_hpc.local_slurm.conf import ETC_SLURM, StatePaths
from bridge_hpc.local_slurm.daemons import Daemons, exe_of, munge_works, node_ready, proc_alive, read_pid, wait_gone
from bridge_hpc.local_slurm.daemons import node_states as sinfo_node_states
from bridge_hpc.local_slurm.errors import ClusterError

__all__ = ["DEFAULT_STATE_DIR", "ClusterError", "LocalCluster", "release_requeued", "short_hostname"]

DEFAULT_STATE_DIR = "/var/tmp/bridge-cluster"


def short_hostname() -> str:
    """``hostname -s``: the name a single node gets, and the host every node's slurmd says it runs on."""
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


class LocalCluster:
    """A Slurm cluster of ``nodes`` nodes on this machine, with its state under ``state_dir``.

    ``slurm_conf`` and ``slurmdbd_conf`` are plain attributes (``/etc/slurm/...``) so that a test can
    point them elsewhere; everything else lies under ``state_dir`` (see :class:`.conf.StatePaths`).
    """

    def __init__(self, state_dir: Optional[str] = None, *, quiet: bool = False):
        self.state_dir = Path(state_dir or os.environ.get("BRIDGE_CLUSTER_DIR") or DEFAULT_STATE_DIR).resolve()
        self.quiet = quiet
        self.paths = StatePaths(self.state_dir)
        self.daemons = Daemons(self.paths, self._say)
        self.slurm_conf = ETC_SLURM / "slurm.conf"
        self.slurmdbd_conf = ETC_SLURM / "slurmdbd.conf"

    @property
    def pid_dir(self) -> Path:
        return self.paths.pid_dir

    @property
    def log_dir(self) -> Path:
        return self.paths.log_dir

    @property
    def info_file(self) -> Path:
        return self.paths.info_file

    # ------------------------------------------------------------------ public API

    def up(self, nodes: int = 1, timeout: float = 90.0) -> None:
        """Start (or reconfigure to) a cluster of ``nodes`` nodes and wait until all are idle.

        A no-op when that cluster already runs with exactly the slurm.conf this call would write.
        Otherwise only what differs is restarted: a new slurm.conf restarts slurmctld and the slurmds
        (cancelling every job), a new slurmdbd.conf restarts slurmdbd; munged and mariadbd are only
        started when not running.
        """
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise ConfigError(f"--nodes must be a whole number >= 1, got {nodes!r}", key="nodes")
        if nodes > 64:
            raise ConfigError(f"--nodes {nodes} is more than this one machine can host (at most 64)", key="nodes")
        self._require_root("up")
        t0 = time.monotonic()
        install.ensure_packages(self._say)
        d = self.daemons
        with self._lock():
            host = short_hostname()
            names = self.node_names(nodes, host)
            slurm_conf = conf.slurm_conf_text(self.paths, host, names)
            if self.is_up(nodes) and conf.read_or_none(self.slurm_conf) == slurm_conf:
                self._say(f"already up: {self._node_word(nodes)}, state in {self.state_dir}")
                return
            self._check_conf_files()
            d.make_dirs()
            dbd_conf = conf.slurmdbd_conf_text(self.paths, conf.db_password(self.paths))

            # a different node count (or host, or state dir): stop slurmctld/slurmd before rewriting
            current = conf.read_or_none(self.slurm_conf)
            if current != slurm_conf and (d.alive("slurmctld") or d.slurmd_pidfiles()):
                self._say(f"reconfiguring for {self._node_word(nodes)}: stopping slurmctld and slurmd")
                d.stop_slurm()
            if current != slurm_conf:
                self._write_conf(self.slurm_conf, slurm_conf, 0o644)

            d.start_munge()
            d.start_mariadb()
            current_dbd = conf.read_or_none(self.slurmdbd_conf)
            if current_dbd != dbd_conf:
                if d.alive("slurmdbd"):
                    d.stop("slurmdbd")
                self._write_conf(self.slurmdbd_conf, dbd_conf, 0o600)
            d.start_slurmdbd()
            d.register_accounting()
            d.start_slurmctld()
            # slurmd of nodes that are no longer configured (an older, larger cluster)
            for pidfile in d.slurmd_pidfiles():
                node = pidfile.stem[len("slurmd-"):]
                if node not in names:
                    d.stop(f"slurmd-{node}")
            for name in names:
                d.start_slurmd(name)
            self.info_file.write_text(json.dumps({"nodes": nodes, "node_names": names, "host": host}) + "\n")
            d.wait_nodes_ready(names, timeout)
        self._say(f"up: {self._node_word(nodes)} ({', '.join(names)}) in {time.monotonic() - t0:.1f} s")

    def down(self) -> None:
        """Stop the daemons this tool started (by their pid files) and wait until they are gone."""
        self._require_root("down")
        d = self.daemons
        with self._lock():
            known = [n for n in self._daemon_names() if d.pid_of(n) is not None]
            if not known:
                self._say("already down: no daemon of ours is running")
                return
            pids = d.stop_slurm()
            for name in ("slurmdbd", "mariadbd", "munged"):
                pids.append(d.stop(name))
            wait_gone(pids)
        self._say("down: all daemons stopped")

    def status(self) -> dict:
        """``{'daemons': {name: {'pid', 'alive', 'pidfile'}}, 'nodes': {node: state}, 'up': bool, ...}``."""
        info = self._info()
        daemons: Dict[str, dict] = {}
        for name in self._daemon_names():
            pidfile = self.daemons.pidfile(name)
            pid = read_pid(pidfile)
            daemons[name] = {
                "pid": pid,
                "alive": proc_alive(pid, exe_of(name)),
                "pidfile": str(pidfile),
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
        if not all(self.daemons.alive(d) for d in wanted):
            return False
        if not (self.daemons.alive("munged") or munge_works()):
            return False  # a munged we did not start serves as well
        states = self.node_states()
        return set(states) == set(names) and all(node_ready(s) for s in states.values())

    # ------------------------------------------------------------------ small public helpers

    def configured_nodes(self) -> Optional[int]:
        """The node count the last ``up`` configured (None before the first ``up``)."""
        return self._info().get("nodes")

    @staticmethod
    def node_names(nodes: int, host: str) -> List[str]:
        return conf.node_names(nodes, host)

    def node_states(self) -> Dict[str, str]:
        """``{node: state}`` from ``sinfo -N`` (state as Slurm prints it, e.g. ``idle``, ``down*``)."""
        return sinfo_node_states()

    # ------------------------------------------------------------------ internals

    def _configured_node_names(self) -> List[str]:
        return self._info().get("node_names") or []

    def _daemon_names(self) -> List[str]:
        return self.daemons.names(self._configured_node_names())

    def _any_alive(self) -> bool:
        return self.daemons.any_alive(self._configured_node_names())

    def _check_conf_files(self) -> None:
        """Refuse a foreign /etc/slurm file, or ours while another state dir's daemons still hold the ports."""
        for path in (self.slurm_conf, self.slurmdbd_conf):
            conf.check_managed(path)
        if self.slurm_conf.exists():
            for other in conf.state_dirs_named(self.slurm_conf.read_text()):
                if other != self.state_dir and LocalCluster(str(other), quiet=True)._any_alive():
                    raise ConfigError(
                        f"a bridge-cluster with state dir {other} is running; "
                        f"run `bridge-cluster down --state-dir {other}` first"
                    )

    def _write_conf(self, path: Path, text: str, mode: int) -> None:
        conf.write_conf(path, text, mode)
        self._say(f"wrote {path}")

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

    @staticmethod
    def _node_word(nodes: int) -> str:
        return f"{nodes} node" + ("" if nodes == 1 else "s")

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(f"bridge-cluster: {msg}", flush=True)
