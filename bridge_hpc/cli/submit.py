"""``bridge-submit CONFIG``: validate a job config, render its sbatch script, submit it with submitit."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional, TextIO

from bridge_hpc.contracts.errors import ConfigError, exits_on_config_error
from bridge_hpc.jobfile.jobconfig import JobConfig, check_secrets_present, dump_resolved, load_job_config
from bridge_hpc.launch.render import render_script
from bridge_hpc.training.engine import low_precision


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bridge-submit",
        description="Validate a TOML job config, render it into an sbatch script and submit it.",
    )
    p.add_argument("config", help="job config (TOML); may extend cluster profiles")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any key, e.g. --set slurm.time=02:00:00 --set train.train_iters=500")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check of a real submit that needs no Slurm (the run folder's too), print the "
                        "rendered script and, on stderr, which checks needed Slurm; write and submit nothing")
    p.add_argument("--force", action="store_true",
                   help="submit even into a run folder that holds a different job (its old files are kept) or "
                        "whose earlier job is still pending or running")
    p.add_argument("--verify-data", action="store_true",
                   help="check every record of the data before submitting, not only a sample: each line of each "
                        "fine-tuning jsonl file the run reads, each entry of each indexed dataset's .idx (shows "
                        "progress on long files)")
    p.add_argument("--wait", action="store_true",
                   help="wait for the job to end, showing a progress bar (state, step, loss, tokens/s, ETA; plain "
                        "lines when stdout is not a terminal)")
    return p


@exits_on_config_error
def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_job_config(args.config, args.overrides)
    overridden = low_precision.precision_overridden(cfg.training) if cfg.training is not None else None
    if overridden:
        print(f"warning: {overridden}", file=sys.stderr)
    if args.verify_data:
        verify_data(cfg)
    if args.dry_run:
        # Every check of a real submit that needs no Slurm, the run folder's too, writing nothing.
        from bridge_hpc.launch.preflight import dry_run

        check_secrets_present(cfg)  # the job would start without it
        script = render_script(cfg)
        unchecked = dry_run(cfg, dump_resolved(cfg), force=args.force)
        sys.stdout.write(script)
        print(unchecked, file=sys.stderr)
        return 0
    from bridge_hpc.launch.submit import SlurmNotFound, submit  # submitit only when submitting

    slurm_hint = "is Slurm installed? `bridge-cluster up` starts a local one"
    try:
        sub = submit(cfg, force=args.force)
    except SlurmNotFound as err:
        print(f"error: cannot submit: {err}; {slurm_hint}", file=sys.stderr)
        return 1
    except OSError as err:
        # The run folder's problems are ConfigErrors naming job.run_dir by now; what is left is
        # running sbatch. Only a missing sbatch earns the hint, never an error about some path.
        missing = shutil.which("sbatch") is None
        print(f"error: cannot run sbatch: {err}{'; ' + slurm_hint if missing else ''}", file=sys.stderr)
        return 1
    except Exception as err:  # submitit wraps sbatch's refusal in its own error types
        if type(err).__name__ not in ("FailedJobError", "FailedSubmissionError", "CalledProcessError"):
            raise
        print(f"error: sbatch refused the job: {str(err).strip()}", file=sys.stderr)
        return 1
    if sub.warning:
        print(f"warning: {sub.warning}", file=sys.stderr)
    print(f"Submitted job {sub.job_id} ({cfg.job.name}, {cfg.num_tasks} ranks on {cfg.slurm.nodes} node(s))")
    print(f"  run folder : {sub.run_dir}")
    print(f"  script     : {sub.script_path}")
    print(f"  config     : {sub.resolved_path}")
    print(f"  log        : {sub.stdout}")
    print(f"  follow     : bridge-status {sub.run_dir} --follow")
    if args.wait:
        from bridge_hpc.cli.watch import watch

        status = watch(Path(sub.run_dir), str(sub.job_id), style="bar")
        print(f"job {sub.job_id} ended: {status.state}")
        return 0 if status.state == "COMPLETED" else 1
    return 0


def verify_data(cfg: JobConfig, stream: Optional[TextIO] = None) -> None:
    """``--verify-data``: every record of the job's data, checked on the login node before anything is
    written or submitted (:meth:`~bridge_hpc.training.config.ConfigContainer.check_data_records`).

    Loading the job already checked a sample; a bad record beyond it would otherwise stop the run only
    on the ranks, after the queue. A problem is a ConfigError naming the job file, the key and the data
    file's line; otherwise one line on ``stream`` (stderr) says what was checked. Progress goes there too.
    """
    stream = stream or sys.stderr
    progress = _Progress(stream)
    try:
        checked = cfg.training.check_data_records(full=True, progress=progress)
    except ConfigError as err:
        raise cfg.error(err.key, err.message) from None
    finally:
        progress.close()
    if checked:
        what = "sequences" if all(path.endswith(".idx") for path, _ in checked) else "records"
        print(f"verified {len(checked)} data file(s): {sum(n for _, n in checked)} {what}, all good", file=stream)


class _Progress:
    """``--verify-data``'s progress on long files: silent for a file checked within a second; then how
    far it is, on one line rewritten in place on a terminal (twice a second) or as lines in a log (every
    ten seconds), and its end once something was shown."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.tty = stream.isatty()
        self.path = ""
        self.started = 0.0
        self.shown: Optional[float] = None  # when this file's progress was last shown
        self.open_line = False

    def __call__(self, path: str, done: int, total: int) -> None:
        now = time.monotonic()
        if path != self.path:
            self.close()
            self.path, self.started, self.shown = path, now, None
        if done < total:
            if now - self.started < 1.0:
                return
            if self.shown is not None and now - self.shown < (0.5 if self.tty else 10.0):
                return
        elif self.shown is None:
            return  # done before anything was shown: nothing to say
        self.shown = now
        text = f"verifying {path}: {100 * done // max(total, 1)}% of {total / 2**20:.0f} MiB"
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
            self.open_line = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End a line left open on a terminal, before the next file's or an error's."""
        if self.open_line:
            self.stream.write("\n")
            self.stream.flush()
            self.open_line = False


if __name__ == "__main__":
    sys.exit(main())
