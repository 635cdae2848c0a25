"""``bridge-submit CONFIG``: validate a job config, render its sbatch script, submit it with submitit."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import List, Optional

from bridge_hpc.contracts.errors import exits_on_config_error
from bridge_hpc.launch.jobconfig import check_secrets_present, load_job_config
from bridge_hpc.launch.render import render_script


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bridge-submit",
        description="Validate a TOML job config, render it into an sbatch script and submit it.",
    )
    p.add_argument("config", help="job config (TOML); may extend cluster profiles")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any key, e.g. --set slurm.time=02:00:00 --set train.train_iters=500")
    p.add_argument("--dry-run", action="store_true", help="print the rendered script; write and submit nothing")
    p.add_argument("--force", action="store_true",
                   help="submit even into a run folder that holds a different job (its old files are kept) or "
                        "whose earlier job is still pending or running")
    p.add_argument("--wait", action="store_true",
                   help="wait for the job to end, showing a progress bar (state, step, loss, tokens/s, ETA; plain "
                        "lines when stdout is not a terminal)")
    return p


@exits_on_config_error
def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_job_config(args.config, args.overrides)
    if args.dry_run:
        check_secrets_present(cfg)  # as a real submit would: the job would start without it
        sys.stdout.write(render_script(cfg))
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


if __name__ == "__main__":
    sys.exit(main())
