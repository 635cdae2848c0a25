"""``bridge-report RUN_DIR_OR_PROGRESS_TXT [--json] [--plot FILE.png]``: runs, throughput and goodput.

Reads the progress log (``progress.txt``) that bridge_hpc, Megatron-LM or Megatron Bridge write in the
checkpoint folder. Login-node tool: no torch; matplotlib only with ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError, exits_on_config_error
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.report.goodput import build_report, format_table, plot, to_json
from bridge_hpc.report.progress import parse_progress


def _read_toml(path: str) -> dict:
    """tomllib on Python >= 3.11, the ``toml`` package (an install requirement) before."""
    try:
        import tomllib

        with open(path, "rb") as f:
            return tomllib.load(f)
    except ImportError:
        import toml

        return toml.load(path)


def find_progress_log(target: str) -> str:
    """The progress log for a file or a run directory.

    In a run directory: where its resolved.toml says the job checkpointed (``[checkpoint] save``,
    absolute there), else the default checkpoint folder, else ``progress.txt`` in the folder itself
    or the only one found below it (a checkpoint folder of Megatron-LM or Bridge). Raises ConfigError
    naming the path when there is none (or several).
    """
    if not os.path.exists(target):
        raise ConfigError("no such file or directory", path=target)
    if os.path.isfile(target):
        return target
    folder = RunFolder(target)
    candidates = []
    if os.path.isfile(folder.resolved_config):
        try:
            save = (_read_toml(folder.resolved_config).get("checkpoint") or {}).get("save")
        except (ValueError, OSError, RecursionError) as err:  # tomllib's and toml's decode errors are ValueErrors
            raise ConfigError(f"cannot read: {err}", path=folder.resolved_config) from None
        if isinstance(save, str) and save:
            # absolute, since resolved.toml records it so (a relative one is taken from the run folder)
            candidates.append(RunFolder(target, os.path.join(target, save)).progress_log())
    candidates += [folder.progress_log(), os.path.join(target, run_folder.PROGRESS_FILE)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    found = sorted(
        os.path.join(root, run_folder.PROGRESS_FILE) for root, _, files in os.walk(target)
        if run_folder.PROGRESS_FILE in files
    )
    if len(found) == 1:
        return found[0]
    if found:
        raise ConfigError(f"several progress logs, name one: {', '.join(found)}", path=target)
    raise ConfigError(f"no {run_folder.PROGRESS_FILE} found (looked in {run_folder.CHECKPOINTS_DIR}/, "
                      f"{run_folder.RESOLVED_CONFIG}'s [checkpoint] save and below)", path=target)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bridge-report", description=__doc__.splitlines()[0])
    parser.add_argument("target", metavar="RUN_DIR_OR_PROGRESS_TXT")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="also write a plot (needs matplotlib)")
    return parser.parse_args(argv)


@exits_on_config_error
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    path = find_progress_log(args.target)
    try:
        runs = parse_progress(path)
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror}", path=path) from None
    if not runs:
        raise ConfigError("no 'Starting job' line: not a progress log, or no run has started", path=path)
    report = build_report(runs)
    if args.plot:
        try:
            plot(report, args.plot)
        except ImportError:
            raise ConfigError("needs matplotlib (pip install 'bridge_hpc[report]')", key="--plot") from None
        except OSError as err:
            raise ConfigError(f"cannot write: {err.strerror}", path=args.plot) from None
    if args.json:
        json.dump(to_json(report), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
