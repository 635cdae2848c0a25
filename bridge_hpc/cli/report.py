"""``bridge-report RUN_DIR_OR_PROGRESS_TXT... [--json] [--plot FILE.png]``: runs, throughput and goodput.

Reads the progress log (``progress.txt``) that bridge_hpc, Megatron-LM or Megatron Bridge write in the
checkpoint folder and, in a run folder, metrics.jsonl (loss, tokens/s). Several arguments are compared
side by side: a table each and a comparison of the headline figures; ``--plot`` overlays them in one
figure. Login-node tool: no torch; matplotlib only with ``--plot``.

The folder named is the one reported: paths its resolved.toml records under the folder the job was
submitted into are read under the folder named, where it was moved or copied (one line on stderr says
so). Damage is passed over where the rest can still be reported (:mod:`bridge_hpc.report.run_report`):
one ``note:`` line on stderr for each thing skipped, and exit status 0. An argument that leaves nothing
to report is one ``error:`` line on stderr, and exit status 2 (the other arguments are still reported).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence, Tuple

from bridge_hpc.cli import quiet_stdout
from bridge_hpc.contracts.errors import EXIT_BAD_INPUT, ConfigError, exits_on_config_error
from bridge_hpc.contracts.text import one_line
from bridge_hpc.report.run_report import RunReport, labels_for, read_run_report
from bridge_hpc.report.table import format_report, reports_to_json


def load_run_report(target: str, label: Optional[str] = None) -> RunReport:
    """One argument's report (:func:`bridge_hpc.report.run_report.read_run_report`); ConfigError when
    it leaves nothing to report."""
    return read_run_report(target, label)


def load_run_reports(targets: Sequence[str]) -> Tuple[List[RunReport], List[ConfigError]]:
    """The reports of the arguments that have something to report, and the errors of those that do not."""
    runs, errors = [], []
    for target, label in zip(targets, labels_for(targets)):
        try:
            runs.append(load_run_report(target, label))
        except ConfigError as err:
            errors.append(err)
    return runs, errors


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bridge-report", description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+", metavar="RUN_DIR_OR_PROGRESS_TXT",
                        help="run folders or progress logs; several are compared side by side")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also write the report figure: loss, progress, throughput, goodput (needs matplotlib)")
    return parser.parse_args(argv)


def _say(kind: str, text: str) -> None:
    print(f"{kind}: {one_line(text)}", file=sys.stderr)


@exits_on_config_error
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    runs, errors = load_run_reports(args.targets)
    for run in runs:
        for note in run.notes:
            _say("note", note)
    for err in errors:
        _say("error", err.format())
    if not runs:
        return EXIT_BAD_INPUT
    try:
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
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (| head): nothing more to say, and no traceback
        quiet_stdout()
    return EXIT_BAD_INPUT if errors else 0


if __name__ == "__main__":
    sys.exit(main())
