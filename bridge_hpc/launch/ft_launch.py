"""The command line that starts the ranks under nvidia-resiliency-ext's ``ft_launcher``.

For a job with ``[ft] enable_ft_package = true`` the batch script starts ONE launcher per node
(``srun --ntasks-per-node=1``); each launcher starts ``nproc_per_node`` ranks, one rank monitor per
rank, and restarts all ranks of the job in place (``--max-restarts``) when a rank dies or a monitor
finds it hung. The launchers meet at a c10d rendezvous on the first node of the allocation.

Typical use in the sbatch template (shell variables stay unexpanded until the batch script runs)::

    argv = srun_prefix(nnodes=2, cpus_per_node=16) + ft_launcher_argv(
        ["-m", "bridge_hpc.rank", "$BRIDGE_CONFIG"], python="python3", nnodes=2, nproc_per_node=8,
        rdzv_endpoint="${BRIDGE_RDZV_HOST}:${BRIDGE_RDZV_PORT}", rdzv_id="$SLURM_JOB_ID",
        max_restarts=3)
    line = shell_join(argv)      # $VARS double-quoted (expanded), everything else single-quoted

Flag names are the installed package's (``ft_launcher --help``, 0.4.1) in the spelling that later
versions keep: ``--ft-<field-with-dashes>`` (e.g. ``--ft-rank-section-timeouts``). 0.4.1 marks the
``--ft-param-<field>`` aliases and ``--ignore-missing-fault-tol-cfg`` "deprecated, to be removed in
v0.5", and current releases have dropped them, so neither is used: timeouts are always passed,
which is also what makes the launcher accept the FT configuration without a YAML file.

In section mode the launcher is given heartbeat timeouts too (0.4.1 cannot take 'null' for them);
the ranks switch those off on their monitor when they choose sections
(:meth:`bridge_hpc.training.resilience.fault_tolerance.FaultTolerance.setup`), since a monitor that never sees a
heartbeat would otherwise kill its rank ``initial_heartbeat`` seconds after start.

No torch (the training config module is torch-free): imported by the login-node renderer.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

from bridge_hpc.contracts import signals
from bridge_hpc.training.config import FaultToleranceConfig  # torch-free

LAUNCHER_MODULE = "nvidia_resiliency_ext.fault_tolerance.launcher"
WRAPPER_MODULE = "bridge_hpc.launch.ft_launch"  # ``python -m bridge_hpc.launch.ft_launch <launcher args>``: see main()


#: The FT config's own defaults: the launcher's timeouts default to them, never to a copy.
_FT_DEFAULTS = FaultToleranceConfig()


@dataclass
class FTLaunchTimeouts:
    """Timeouts given to the rank monitors (seconds; None = no limit).

    Defaults are ``[ft]``'s (:class:`~bridge_hpc.training.config.FaultToleranceConfig`: Megatron-LM's
    and NeMo's for the section API, the package's for heartbeats); :meth:`from_config` takes a job's
    ``[ft]``. With ``[ft] calc_ft_timeouts = true`` the ranks replace them by computed values once
    observed. ``workload_check_interval`` is how often a monitor looks at its rank: detection comes
    at most that long after the timeout.
    """

    setup: Optional[float] = _FT_DEFAULTS.setup_timeout
    step: Optional[float] = _FT_DEFAULTS.step_timeout
    checkpointing: Optional[float] = _FT_DEFAULTS.checkpointing_timeout
    out_of_section: Optional[float] = _FT_DEFAULTS.rank_out_of_section_timeout
    initial_heartbeat: Optional[float] = _FT_DEFAULTS.initial_rank_heartbeat_timeout
    heartbeat: Optional[float] = _FT_DEFAULTS.rank_heartbeat_timeout
    workload_check_interval: float = _FT_DEFAULTS.workload_check_interval
    safety_factor: float = _FT_DEFAULTS.safety_factor
    use_sections: bool = True  # False: heartbeats only (no section timeouts given to the launcher)
    extra: Dict[str, str] = field(default_factory=dict)  # other --ft-<name> values, by field name

    @classmethod
    def from_config(cls, ft: FaultToleranceConfig) -> "FTLaunchTimeouts":
        return cls(setup=ft.setup_timeout, step=ft.step_timeout, checkpointing=ft.checkpointing_timeout,
                   out_of_section=ft.rank_out_of_section_timeout,
                   initial_heartbeat=ft.initial_rank_heartbeat_timeout, heartbeat=ft.rank_heartbeat_timeout,
                   workload_check_interval=ft.workload_check_interval, safety_factor=ft.safety_factor)

    def params(self) -> List[str]:
        """The ``--ft-*`` timeout arguments. A None float timeout is left out (the package default:
        none for out-of-section, 60/45 min for heartbeats: 0.4.1 cannot take 'null' for those)."""

        def num(value: Optional[float]) -> str:
            return "null" if value is None else f"{float(value):g}"

        out: List[str] = []
        if self.use_sections:
            sections = f"setup:{num(self.setup)},step:{num(self.step)},checkpointing:{num(self.checkpointing)}"
            out.append(f"--ft-rank-section-timeouts={sections}")
            if self.out_of_section is not None:
                out.append(f"--ft-rank-out-of-section-timeout={num(self.out_of_section)}")
        if self.initial_heartbeat is not None:
            out.append(f"--ft-initial-rank-heartbeat-timeout={num(self.initial_heartbeat)}")
        if self.heartbeat is not None:
            out.append(f"--ft-rank-heartbeat-timeout={num(self.heartbeat)}")
        out += [
            f"--ft-workload-check-interval={float(self.workload_check_interval):g}",
            f"--ft-safety-factor={float(self.safety_factor):g}",
        ]
        out += [f"--ft-{key.replace('_', '-')}={value}" for key, value in sorted(self.extra.items())]
        return out


def ft_launcher_argv(
    entry: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    rdzv_endpoint: str,
    rdzv_id: str,
    max_restarts: int = 3,
    timeouts: Optional[FTLaunchTimeouts] = None,
    python: Optional[str] = None,
    workers_stop_timeout: Optional[float] = 15.0,
    term_timeout: Optional[float] = None,
    monitor_interval: Optional[float] = None,
    log_dir: Optional[str] = None,
    extra_args: Sequence[str] = (),
    stop_signal: Optional[signals.StopSignal] = None,
) -> List[str]:
    """argv of one node's launcher.

    Args:
        entry: what each rank runs: ``["-m", "pkg.module", args...]`` or ``["script.py", args...]``.
        nnodes: nodes of the job (a fixed size: ``--nnodes=N``).
        nproc_per_node: ranks per node (``slurm.ntasks_per_node``, usually GPUs per node).
        rdzv_endpoint: ``host:port`` of the rendezvous, on the first node (:func:`rdzv_endpoint_from_slurm`).
        rdzv_id: the same on every node and unique per job (the Slurm job id).
        max_restarts: in-job restarts of the whole worker group before the launcher gives up.
        timeouts: rank-monitor timeouts (:class:`FTLaunchTimeouts`).
        python: interpreter to run the launcher with (so the ranks use the same interpreter), through
            this module's :func:`main` (``python -m bridge_hpc.launch.ft_launch``), which makes the launcher
            survive SIGUSR1; None runs the ``ft_launcher`` console script as it is.
        workers_stop_timeout: seconds between SIGTERM and SIGKILL when the launcher stops the
            surviving ranks for a restart (ranks blocked in a collective only die by SIGKILL).
        term_timeout: seconds between forwarding a received SIGTERM to the ranks and SIGKILL
            (launcher default 1800); keep it below Slurm's KillWait so ranks can save.
        monitor_interval: how often the launcher polls its ranks (launcher default 0.1 s).
        log_dir: per-rank log folder of the launcher (``--log-dir``).
        extra_args: more launcher options, inserted before ``entry``.
        stop_signal: the job's stop signal (default ``[slurm] signal``'s default); through
            :func:`main` the launcher ignores its warning signal, which the ranks handle.
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError("nnodes and nproc_per_node must be >= 1")
    if ":" not in rdzv_endpoint:
        raise ValueError(f"rdzv_endpoint must be host:port, got {rdzv_endpoint!r}")
    if not entry:
        raise ValueError("entry must name a script or '-m module'")
    stop_signal = stop_signal or signals.parse_slurm_signal(signals.DEFAULT_SLURM_SIGNAL)
    ignore = f"{IGNORE_OPTION}={','.join(stop_signal.warning_signals)}"
    argv = [python, "-m", WRAPPER_MODULE, ignore] if python else ["ft_launcher"]
    argv += [
        f"--nnodes={int(nnodes)}",
        f"--nproc-per-node={int(nproc_per_node)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--max-restarts={int(max_restarts)}",
    ]
    if workers_stop_timeout is not None:
        argv.append(f"--workers-stop-timeout={int(workers_stop_timeout)}")
    if term_timeout is not None:
        argv.append(f"--term-timeout={int(term_timeout)}")
    if monitor_interval is not None:
        argv.append(f"--monitor-interval={float(monitor_interval):g}")
    if log_dir:
        argv.append(f"--log-dir={log_dir}")
    argv += (timeouts or FTLaunchTimeouts()).params()
    argv += list(extra_args)
    entry = list(entry)
    if entry[0] == "-m":  # ft_launcher's own flag for "run a module"
        argv += ["--module", *entry[1:]]
    else:
        argv += entry
    return argv


def srun_prefix(nnodes: int, cpus_per_node: Optional[int] = None, extra: Sequence[str] = ()) -> List[str]:
    """``srun`` options for one launcher per node; the launcher task gets all CPUs of its node
    (``cpus_per_node`` = ntasks_per_node x cpus_per_task), as it runs every rank of the node."""
    argv = ["srun", "--label", "--kill-on-bad-exit=1", f"--nodes={int(nnodes)}", f"--ntasks={int(nnodes)}",
            "--ntasks-per-node=1"]
    if cpus_per_node:
        argv.append(f"--cpus-per-task={int(cpus_per_node)}")
    return argv + list(extra)


def rdzv_port_for_job(job_id: Optional[str], base: int = 30000, span: int = 20000) -> int:
    """A rendezvous port derived from the job id, so concurrent jobs on one node stay apart (a
    different range from :class:`bridge_hpc.slurm.job_environment.JobEnvironment`'s MASTER_PORT)."""
    digits = "".join(c for c in str(job_id or "") if c.isdigit())
    return base + (int(digits) % span if digits else 0)


def rdzv_endpoint_from_slurm(env: Optional[Mapping[str, str]] = None, port: Optional[int] = None) -> str:
    """``<first node of the allocation>:<port>`` from ``SLURM_JOB_NODELIST`` (inside the job)."""
    from bridge_hpc.slurm.job_environment import expand_nodelist

    env = os.environ if env is None else env
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", "") or env.get("SLURM_NODELIST", ""))
    host = nodes[0] if nodes else "127.0.0.1"
    return f"{host}:{port if port is not None else rdzv_port_for_job(env.get('SLURM_JOB_ID'))}"


# Shell rendering ---------------------------------------------------------------------------------

_VAR = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def shell_quote(word: str) -> str:
    """Quote one word; ``$NAME``/``${NAME}`` in it stay expandable (double quotes), nothing else does."""
    if not _VAR.search(word):
        return shlex.quote(word)
    escaped = re.sub(r'(["\\`])', r"\\\1", word)
    escaped = re.sub(r"\$(?!\{?[A-Za-z_])", r"\\$", escaped)
    return f'"{escaped}"'


def shell_join(argv: Sequence[str]) -> str:
    return " ".join(shell_quote(word) for word in argv)


# The launcher process -----------------------------------------------------------------------------


#: The wrapper's own first argument: the signals the launcher ignores (comma-separated Python names).
IGNORE_OPTION = "--bridge-ignore-signals"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m bridge_hpc.launch.ft_launch --bridge-ignore-signals=SIGUSR1 <ft_launcher arguments>``.

    Slurm's warning signal (``--signal=USR1@<s>``, ``scancel --signal=USR1``) reaches every process of
    the step. ft_launcher handles SIGTERM/SIGINT/SIGHUP/SIGQUIT (it forwards them to the ranks) but
    not USR1/USR2, whose default action kills it; srun then ends the step and the ranks die in the
    middle of the checkpoint they were saving because of that very signal. Here the launcher ignores
    the job's warning signal (the ranks, which got it from Slurm directly, install their own handler,
    overriding the inherited "ignore"), then runs ft_launcher's own ``main``.
    """
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0].startswith(IGNORE_OPTION + "="):
        names = [n for n in args.pop(0).split("=", 1)[1].split(",") if n]
        signals.ignore(n for n in names if n not in signals.FT_LAUNCHER_FORWARDS)
    from nvidia_resiliency_ext.fault_tolerance.launcher import main as launcher_main

    sys.argv = ["ft_launcher", *args]
    launcher_main()


if __name__ == "__main__":
    main()
