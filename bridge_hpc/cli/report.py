"""``bridge-report RUN_DIR_OR_PROGRESS_TXT... [--json] [--plot FILE.png]``: runs, throughput and goodput.

Reads the progress log (``progress.txt``) that bridge_hpc, Megatron-LM or Megatron Bridge write in the
checkpoint folder and, in a run folder, metrics.jsonl (loss, tokens/s). Several arguments are compared
side by side: a table each and a comparison of the headline figures; ``--plot`` overlays them in one
figure. Login-node tool: no torch; matplotlib only with ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Sequence

from bridge_hpc.contracts.errors import ConfigError, exits_on_config_error
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.report.goodput import CPU, GPU
from bridge_hpc.report.run_report import RunReport, labels_for, read_run_report
from bridge_hpc.report.table import format_report, reports_to_json


def requested_device(slurm) -> str:
    """"gpu" when the job asked Slurm for GPUs (``[slurm] gpus_per_node``, or a GPU option passed
    through ``[slurm] extra`` such as ``gres = "gpu:8"``), else "cpu": ranks get what Slurm allocates."""
    if slurm.gpus_per_node > 0:
        return GPU
    asked = " ".join(f"{key}={value}" for key, value in slurm.extra.items()).lower()
    return GPU if "gpu" in asked else CPU


def load_run_report(target: str, label: Optional[str] = None) -> RunReport:
    """One argument's report. A run folder's resolved.toml, loaded as the ranks load it, says where its
    metrics.jsonl is and what it asked Slurm for (the device where the progress log does not name it);
    a resolved.toml this version cannot load is passed over (the log and the default paths remain)."""
    metrics, device = None, None
    resolved = RunFolder(target).resolved_config
    if os.path.isdir(target) and os.path.isfile(resolved):
        from bridge_hpc.launch.jobconfig import load_job_config  # lazy: only run folders need it

        try:
            job = load_job_config(resolved)
        except ConfigError:
            job = None
        if job is not None:
            device = requested_device(job.slurm)
            if job.training is not None and job.training.logger.metrics_file:
                metrics = job.training.logger.metrics_file
    return read_run_report(target, label, metrics, device)


def load_run_reports(targets: Sequence[str]) -> List[RunReport]:
    return [load_run_report(t, label) for t, label in zip(targets, labels_for(targets))]


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bridge-report", description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", metavar="RUN_DIR_OR_PROGRESS_TXT",
                        help="run folders or progress logs; several are compared side by side")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also write the report figure: loss, progress, throughput, goodput (needs matplotlib)")
    return parser.parse_args(argv)


@exits_on_config_error
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    runs = load_run_reports(args.targets)
    if args.plot:
        try:
            from bridge_hpc.report.plot import build_figure, save_figure
        except ImportError:
            raise ConfigError("needs matplotlib (pip install 'bridge_hpc[report]')", key="--plot") from None
        try:
            save_figure(build_figure(runs), args.plot)
        except OSError as err:
            raise ConfigError(f"cannot write: {err.strerror or err}", path=args.plot) from None
    if args.json:
        json.dump(reports_to_json(runs), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
