"""Render a :class:`JobConfig` into an sbatch script through the jinja2 templates in ``templates/``.

Two quoting rules, one per reader of the script:
- shell lines: every config value goes through ``q`` (``shlex.quote``), so ``x$(touch /tmp/p)``,
  backticks and quotes stay inert;
- ``#SBATCH`` lines are read by sbatch's own tokenizer, not by a shell: ``sbatch_arg`` writes a
  value bare when it is plain, else in double quotes with ``"`` and ``\\`` escaped.
Control characters should never get this far: the config loader and every command-line tool refuse
them, naming the key or flag. Both filters refuse them too (:func:`script_text`), so that a value
from a path no check covers still cannot end a line of the script and start a command.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
import shlex
from typing import Optional, Sequence

import jinja2

from bridge_hpc import __version__
from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import EXIT_BAD_INPUT, ConfigError
from bridge_hpc.contracts.requeue import REQUEUE_FILE_ENV
from bridge_hpc.contracts.text import has_control_chars
from bridge_hpc.jobfile.jobconfig import JobConfig
from bridge_hpc.slurm.job_environment import INHERITED_RENDEZVOUS_VARIABLES
from bridge_hpc.slurm.query import STOP_CAUSE_COMMAND

_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def script_text(value: object) -> str:
    """``str(value)``; a ConfigError (exit 2, nothing written) when it holds a control character."""
    text = str(value)
    if has_control_chars(text):
        raise ConfigError(f"refusing to write {text!r} into a batch script: it holds a newline or another "
                          "control character")
    return text


def sbatch_arg(value: object) -> str:
    text = script_text(value)
    if _PLAIN.fullmatch(text):  # fullmatch: "$" would also match before a final newline
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _environment() -> jinja2.Environment:
    # templates/ is installed as the package bridge_hpc.templates (setup.cfg maps it), in wheels and
    # in editable installs alike; ask the import system where it is rather than guessing a path.
    folder = str(importlib.resources.files("bridge_hpc.templates"))
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        bytecode_cache=_bytecode_cache(),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(script_text(v))
    env.filters["sbatch_arg"] = sbatch_arg
    return env


def _bytecode_cache():
    """Compiled templates cached per user: compiling them is most of a dry run's render time.
    jinja2 keys the cache on each template's source, so an edited template is recompiled."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "bridge_hpc", f"jinja2-{__version__}")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    return jinja2.FileSystemBytecodeCache(folder)


#: The module every rank runs (``python -m``), given the run folder's resolved.toml.
RANK_ENTRY_MODULE = "bridge_hpc.rank"
#: What the batch script runs to read the requeue request (``python -m``; see contracts/requeue.py).
REQUEUE_READER_MODULE = "bridge_hpc.contracts.requeue"
#: What the batch script runs to learn why Slurm stops the job before it requeues (a cancel is final).
SLURM_QUERY_MODULE = "bridge_hpc.slurm.query"

#: Shell variables of the batch script that the ft_launcher line refers to (expanded when it runs).
RDZV_ENDPOINT = "${BRIDGE_RDZV_HOST}:${BRIDGE_RDZV_PORT}"
_SCRIPT_WORDS = ("$BRIDGE_CONFIG", f"--rdzv-endpoint={RDZV_ENDPOINT}", "--rdzv-id=$SLURM_JOB_ID")


def ft_launch_command(cfg: JobConfig) -> Optional[str]:
    """With ``[ft] enable_ft_package = true``: the ``srun`` line that starts one ft_launcher per node
    (``python -m bridge_hpc.launch.ft_launch``), each running ``ntasks_per_node`` ranks of
    the rank entry with the ``[ft]`` timeouts and ``max_restarts``; None otherwise.

    Every word from the config goes through ``shlex.quote``; only the script's own variables
    (``$BRIDGE_CONFIG``, the rendezvous endpoint, the job id) stay expandable."""
    ft = cfg.training.ft
    if ft is None or not ft.enable_ft_package:
        return None
    from bridge_hpc.launch.ft_launch import FTLaunchTimeouts, ft_launcher_argv, shell_quote, srun_prefix

    s = cfg.slurm
    container = []
    if cfg.container:
        container.append(f"--container-image={cfg.container.image}")
        if cfg.container.mounts:
            container.append(f"--container-mounts={','.join(cfg.container.mounts)}")
        if cfg.container.workdir:
            container.append(f"--container-workdir={cfg.container.workdir}")
    argv = srun_prefix(s.nodes, cpus_per_node=s.ntasks_per_node * (s.cpus_per_task or 1), extra=container)
    argv += ft_launcher_argv(["-m", RANK_ENTRY_MODULE, "$BRIDGE_CONFIG"], python=cfg.job.python, nnodes=s.nodes,
                             nproc_per_node=s.ntasks_per_node, rdzv_endpoint=RDZV_ENDPOINT,
                             rdzv_id="$SLURM_JOB_ID", max_restarts=ft.max_restarts,
                             timeouts=FTLaunchTimeouts.from_config(ft), stop_signal=cfg.stop_signal)
    words = [shell_quote(w) if w in _SCRIPT_WORDS else shlex.quote(w) for w in argv]
    return " \\\n    ".join(" ".join(words[i:i + 4]) for i in range(0, len(words), 4))


def render_script(cfg: JobConfig) -> str:
    """The batch script. Every file name, the stop signal and the modules it runs come from Python
    (:mod:`bridge_hpc.contracts`); the templates never spell them."""
    template = _environment().get_template("job.sbatch.j2")
    folder = cfg.run_folder
    return template.render(
        cfg=cfg,
        version=__version__,
        folder=folder,
        run_folder=run_folder,
        log_pattern=folder.log_pattern(array=bool(cfg.slurm.array)),
        stop_signal=cfg.stop_signal,
        requeue_file_env=REQUEUE_FILE_ENV,
        rank_entry=RANK_ENTRY_MODULE,
        requeue_reader=REQUEUE_READER_MODULE,
        stop_cause=f"{SLURM_QUERY_MODULE} {STOP_CAUSE_COMMAND}",
        ft_launch=ft_launch_command(cfg),
        exit_bad_input=EXIT_BAD_INPUT,
        inherited_rendezvous=INHERITED_RENDEZVOUS_VARIABLES,
    )


def render_prepare_script(cfg: JobConfig, *, step: str, step_module: str, step_args: Sequence[str],
                          folder: str, tasks: Optional[int], cpus_per_task: int,
                          dependency: Optional[str] = None) -> str:
    """A ``bridge-prepare-data --slurm`` script from the job config's profile, partition, ``[setup]``,
    ``[env]`` and ``[container]``, through the same header, setup and env parts as the training script.

    ``step`` is ``"shard"`` (an array job of ``tasks`` tasks, ``0-(tasks-1)``) or ``"finish"`` (one
    task, after ``dependency``). Each runs ``python -m step_module *step_args`` once, in the batch
    step: tokenizing is one process per task (``cpus_per_task`` CPUs for its workers), so the job's
    node, task and GPU counts are replaced, and its own array and dependency too. Logs go to
    ``folder``'s logs/ (the run-folder contract's names, ``%A_%a`` for array tasks) and the script
    does not export ``BRIDGE_RUN_DIR``/``BRIDGE_CONFIG``: there is no training run folder.
    """
    if step not in ("shard", "finish"):
        raise ValueError(f"step must be 'shard' or 'finish', got {step!r}")
    array = step == "shard"
    slurm = dataclasses.replace(
        cfg.slurm, nodes=1, ntasks_per_node=1, cpus_per_task=cpus_per_task, gpus_per_node=0, requeue=True,
        exclusive=False, array=f"0-{tasks - 1}" if array and tasks else None, dependency=dependency)
    job = dataclasses.replace(cfg.job, name=f"{cfg.job.name}-prepare-data" + ("" if array else "-finish"))
    prepare_cfg = dataclasses.replace(cfg, slurm=slurm, job=job)
    template = _environment().get_template("prepare_data.sbatch.j2")
    return template.render(
        cfg=prepare_cfg,
        version=__version__,
        step=step,
        step_module=step_module,
        step_args=list(step_args),
        log_pattern=run_folder.RunFolder(folder).log_pattern(array=array),
        stop_signal=cfg.stop_signal,
        run_exports=False,
    )
