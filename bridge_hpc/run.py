"""``python -m bridge_hpc.run JOB.toml [--set section.key=value ...]``: train the job's GPT.

The job file's training sections become a :class:`ConfigContainer`; launcher sections are
ignored except ``[job] run_dir`` (relative to the job file's folder), which places the run:
metrics in ``<run_dir>/metrics.jsonl`` and checkpoints in ``<run_dir>/checkpoints`` unless
``[checkpoint] save`` says otherwise. ``load`` defaults to ``save``, so a requeued job resumes
where it stopped. Works the same under ``srun`` (SLURM_* variables) and ``torchrun``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from bridge_hpc.errors import exits_on_config_error
from bridge_hpc.jobconfig import load_config_dict
from bridge_hpc.training.config import ConfigContainer


def build_config(path: str, overrides: Optional[List[str]] = None) -> ConfigContainer:
    """Job file (``extends`` profiles resolved, ``--set`` overrides applied) -> ConfigContainer
    (each section checked) with the run-folder defaults filled in."""
    sections = load_config_dict(path, overrides or ())
    base = os.path.dirname(os.path.abspath(path))
    run_dir = sections.get("job", {}).get("run_dir")
    if run_dir is not None:
        run_dir = os.path.normpath(os.path.join(base, run_dir))
        sections.setdefault("checkpoint", {}).setdefault("save", os.path.join(run_dir, "checkpoints"))
        sections.setdefault("logger", {}).setdefault("metrics_file", os.path.join(run_dir, "metrics.jsonl"))
    for section, key in (("checkpoint", "save"), ("checkpoint", "load"), ("checkpoint", "pretrained_checkpoint"),
                         ("logger", "tensorboard_dir"), ("logger", "metrics_file")):
        value = sections.get(section, {}).get(key)
        if isinstance(value, str):
            sections[section][key] = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    return ConfigContainer.from_sections(sections, source=path)


@exits_on_config_error
def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge_hpc.run", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="job TOML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting (repeatable); VALUE is a TOML value")
    args = parser.parse_args(argv)
    cfg = build_config(args.config, args.overrides)

    import torch.distributed as dist

    from bridge_hpc.training.gpt import forward_step
    from bridge_hpc.training.pretrain import initialize_distributed, pretrain

    initialize_distributed(cfg.dist)
    try:
        pretrain(cfg, forward_step)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
