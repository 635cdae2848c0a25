"""``python -m bridge_hpc.run JOB.toml [--set section.key=value ...]``: train the job's GPT with
the forward step ``[job] forward_step`` names (default: Bridge's GPT step,
:func:`bridge_hpc.training.gpt.forward_step`).

The job file's training sections become a :class:`ConfigContainer`; launcher sections are
ignored except ``[job] run_dir`` (relative to the current directory), which places the run:
metrics in ``<run_dir>/metrics.jsonl`` and checkpoints in ``<run_dir>/checkpoints`` unless
``[checkpoint] save`` says otherwise. ``load`` defaults to ``save``, so a requeued job resumes
where it stopped. Works the same under ``srun`` (SLURM_* variables) and ``torchrun``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Callable, List, Optional, Tuple

from bridge_hpc.errors import ConfigError, exits_on_config_error
from bridge_hpc.jobconfig import load_job_config, resolve_in_run_dir
from bridge_hpc.training.config import ConfigContainer


def load_forward_step(spec: str, source: Optional[str] = None) -> Callable:
    """``[job] forward_step`` -> the function: ``"package.module:function"`` is imported;
    ``"/abs/path/file.py:function"`` is loaded from the file, with the file's folder on ``sys.path`` so
    it can import its neighbours. A module that cannot be imported, or has no such function, is a
    :class:`ConfigError` naming the job file ``source`` and the key (the login node cannot check a
    module: importing the user's code may need torch)."""
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            folder = os.path.dirname(os.path.abspath(target))
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module_name = "bridge_user_" + os.path.splitext(os.path.basename(target))[0]
            module_spec = importlib.util.spec_from_file_location(module_name, target)
            if module_spec is None or module_spec.loader is None:
                raise ImportError(f"cannot load {target}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as exc:
        raise ConfigError(f"cannot import {spec!r}: {exc}", path=source,
                          key="job.forward_step") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"{target} has no function {name!r}", path=source, key="job.forward_step")
    return function


def build_config(path: str, overrides: Optional[List[str]] = None) -> ConfigContainer:
    """The training config of a job file (see :func:`build_job`)."""
    return build_job(path, overrides)[0]


def build_job(path: str, overrides: Optional[List[str]] = None) -> Tuple[ConfigContainer, str]:
    """Job file (``extends`` profiles resolved, ``--set`` overrides applied, launcher sections checked)
    -> (ConfigContainer with the run-folder defaults filled in, ``[job] forward_step``).

    Paths follow ``bridge-submit``: ``[job] run_dir`` relative to the current directory (a
    resolved.toml holds it absolute), and relative training paths inside the run folder, so the job
    file and its resolved.toml place every file identically.
    """
    job = load_job_config(path, overrides or ())
    sections = dict(job.training)
    for section, key, default in (("checkpoint", "save", "checkpoints"), ("checkpoint", "load", None),
                                  ("checkpoint", "pretrained_checkpoint", None), ("logger", "tensorboard_dir", None),
                                  ("logger", "metrics_file", "metrics.jsonl")):
        value = resolve_in_run_dir(job.run_dir, sections.get(section, {}).get(key), default)
        if value is not None:
            sections[section] = dict(sections.get(section, {}), **{key: str(value)})
    return ConfigContainer.from_sections(sections, source=path), job.job.forward_step


#: Warnings every rank prints at import on a machine without Apex / Transformer Engine, about
#: fallbacks that are expected there; they bury the job's own messages in ``logs/*.err``.
KNOWN_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"The pynvml package is deprecated",
    r"full scope is deprecated",  # megatron-core 0.16's own default for cuda_graph_scope
)


def quiet_known_warnings() -> None:
    """Silence :data:`KNOWN_WARNINGS` in this process (the ranks' entry point only: a script that
    imports bridge_hpc keeps its own warning filters)."""
    import warnings

    for message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


@exits_on_config_error
def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge_hpc.run", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="job TOML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting (repeatable); VALUE is a TOML value")
    args = parser.parse_args(argv)
    cfg, forward_step_spec = build_job(args.config, args.overrides)
    quiet_known_warnings()
    forward_step = load_forward_step(forward_step_spec, source=args.config)

    import torch.distributed as dist

    from bridge_hpc.training.pretrain import pretrain

    # pretrain brings torch.distributed up itself, after its signal handler is in place: a preemption
    # notice during a slow rendezvous is then recorded, not fatal.
    try:
        pretrain(cfg, forward_step)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
