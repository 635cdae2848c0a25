"""Render a :class:`JobConfig` into an sbatch script through the jinja2 templates in ``templates/``.

Two quoting rules, one per reader of the script:
- shell lines: every config value goes through ``q`` (``shlex.quote``), so ``x$(touch /tmp/p)``,
  backticks and quotes stay inert;
- ``#SBATCH`` lines are read by sbatch's own tokenizer, not by a shell: ``sbatch_arg`` writes a
  value bare when it is plain, else in double quotes with ``"`` and ``\\`` escaped.
Control characters never get this far: the config loader refuses them.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import jinja2

from bridge_hpc import __version__
from bridge_hpc.jobconfig import JobConfig

_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def sbatch_arg(value: object) -> str:
    text = str(value)
    if _PLAIN.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("bridge_hpc", "templates") if _packaged() else jinja2.FileSystemLoader(_source_templates()),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    env.filters["sbatch_arg"] = sbatch_arg
    return env


def _packaged() -> bool:
    """Installed (or editable) packages expose templates/ as ``bridge_hpc.templates``."""
    try:
        import bridge_hpc.templates  # noqa: F401
    except ImportError:
        return False
    return True


def _source_templates() -> str:
    return str(Path(__file__).resolve().parent.parent / "templates")


def run_files(cfg: JobConfig) -> dict:
    """Where a run keeps what bridge-submit writes; the one definition of the run folder's layout."""
    run_dir = cfg.run_dir
    return {
        "script": run_dir / "job.sbatch",
        "resolved": run_dir / "resolved.toml",
        "logs": run_dir / "logs",
        "jobs": run_dir / "jobs.jsonl",
    }


def log_pattern(cfg: JobConfig) -> str:
    """sbatch output pattern without its suffix; matches submitit's ``%j_%t_log`` so it can find logs."""
    job_part = "%A_%a" if cfg.slurm.array else "%j"
    return str(run_files(cfg)["logs"] / f"{job_part}_0_log")


def render_script(cfg: JobConfig) -> str:
    template = _environment().get_template("job.sbatch.j2")
    return template.render(
        cfg=cfg,
        version=__version__,
        resolved_path=str(run_files(cfg)["resolved"]),
        log_pattern=log_pattern(cfg),
        checkpoint_dir=str(cfg.checkpoint_dir),
    )
