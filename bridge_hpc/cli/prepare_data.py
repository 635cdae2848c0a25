"""``bridge-prepare-data``: jsonl / jsonl.gz text to megatron-core indexed datasets, one shard per file.

The flags are those of Megatron-LM's ``tools/preprocess_data.py`` that users already know (``--input``,
``--output-prefix``, ``--tokenizer-type``, ``--tokenizer-model``, ``--json-keys``, ``--append-eod``,
``--workers``); ``--input`` takes several files or globs. Runs here with ``--workers`` processes; the
work itself is :mod:`bridge_hpc.prepare.shards`. Bad input: one message naming the file (and line or key),
exit status 2, no traceback.

With ``--slurm JOB.toml`` it submits instead: an sbatch array job with one task per input file, then a
final step that depends on it (``afterany``, so that it runs even when a task failed and can say which),
both rendered from the job config's profile, partition, ``[setup]``, ``[env]`` and ``[container]``
(:func:`bridge_hpc.launch.render.render_prepare_script`). The plan, the scripts and the logs live in
``<output-prefix>.slurm/`` (:mod:`bridge_hpc.prepare.slurm_plan`), with ``jobs.jsonl``: while a job listed
there is unfinished, the prefix is in use (:mod:`bridge_hpc.prepare.prefix_lock`). The batch scripts run
this same module as ``--slurm-step shard|finish PLAN``: the array task's index comes from
:func:`bridge_hpc.slurm.job_environment.array_task_index`.

Ctrl-C (or SIGTERM) stops a run within seconds: the workers are stopped, no temporary file is left,
no shard is half published, and the command exits with status 130 after one line.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from bridge_hpc.contracts import run_folder
from bridge_hpc.contracts.errors import ConfigError, exits_on_config_error
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.contracts.text import has_control_chars, one_line
from bridge_hpc.prepare import prefix_lock, slurm_plan
from bridge_hpc.prepare import shards as prepare
from bridge_hpc.slurm.job_environment import array_task_index
from bridge_hpc.slurm.query import unfinished_jobs
from bridge_hpc.training.config import TokenizerConfig

#: What the batch scripts run (``python -m``): this module, in its step mode.
STEP_MODULE = "bridge_hpc.cli.prepare_data"
#: The first argument that selects step mode (the batch scripts' command line, not the user's).
STEP_FLAG = "--slurm-step"
#: Seconds between two looks at Slurm while ``--wait`` waits.
WAIT_POLL_S = 2.0
#: The exit status of a run stopped by Ctrl-C or SIGTERM (the shell's 128 + SIGINT).
EXIT_INTERRUPTED = 130

#: TokenizerConfig key -> the flag that sets it, so a bad value is blamed on what the user typed.
_FLAGS = {"tokenizer_type": "--tokenizer-type", "tokenizer_model": "--tokenizer-model", "vocab_size": "--vocab-size",
          "vocab_file": "--vocab-file", "merge_file": "--merge-file", "tiktoken_pattern": "--tiktoken-pattern"}
_TYPES = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "TikTokenizer",
          "NullTokenizer", "ByteLevelTokenizer")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bridge-prepare-data", description=__doc__.split("\n\n")[0])
    group = p.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_GLOB",
                       help="jsonl or jsonl.gz files (or quoted globs); each becomes one shard")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each line (default: text)")
    group.add_argument("--on-bad-line", choices=("fail", "skip"), default="fail",
                       help="a line that is not JSON or lacks a key: fail naming file:line (default) or skip it")
    group = p.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=_TYPES)
    group.add_argument("--tokenizer-model", help="local tokenizer file or folder (nothing is downloaded)")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer / TikTokenizer vocabulary size")
    group.add_argument("--vocab-file", help="HuggingFaceTokenizer vocabulary file")
    group.add_argument("--merge-file", help="HuggingFaceTokenizer BPE merges file")
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"))
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    group = p.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="path prefix: shards are <prefix>_<shard>_<key>_document.bin/.idx, plus "
                            "<prefix>_<shard>.shard.json and <prefix>.manifest.json")
    group = p.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="tokenizer processes on this machine, or per array task with --slurm (default 1); "
                            "capped by the CPUs this process may use and by the size of the largest input")
    group.add_argument("--verify", action="store_true",
                       help="read every byte of the shards a re-run keeps (by default: their sizes and a sample "
                            "digest, every byte where a file's time changed); a damaged shard is rebuilt")
    group.add_argument("--slurm", metavar="JOB.toml",
                       help="submit an sbatch array job (one task per input file) plus a final step, using this "
                            "job config's profile, partition, [setup], [env] and [container]")
    group.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="with --slurm: override a key of the job config, as bridge-submit --set")
    group.add_argument("--wait", action="store_true",
                       help="with --slurm: wait for the final step and print the [dataset] snippet")
    return p


def tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    """The finalized TokenizerConfig the flags describe; a bad value names its flag."""
    cfg = TokenizerConfig(tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                          vocab_size=args.vocab_size, vocab_file=args.vocab_file, merge_file=args.merge_file,
                          tiktoken_pattern=args.tiktoken_pattern)
    try:
        cfg.finalize()
    except ConfigError as err:
        field = (err.key or "").rpartition(".")[2]
        raise ConfigError(err.message, key=_FLAGS.get(field, err.key)) from None
    return cfg


def check_output_prefix(prefix: str, slurm: bool) -> None:
    """Refuse an output prefix that would break a line of a batch script or an sbatch file pattern."""
    if not prefix.strip():
        raise ConfigError("expected a path prefix, got an empty string", key="--output-prefix")
    if has_control_chars(prefix):
        raise ConfigError(f"must not contain newlines or control characters, got {prefix!r}", key="--output-prefix")
    if slurm and run_folder.LOG_PATTERN_CHARS.search(str(Path(prefix).absolute())):
        raise ConfigError(f"must not contain '%' or '\\' with --slurm (sbatch reads them as patterns in the names "
                          f"of the log files it writes beside the prefix), got {str(Path(prefix).absolute())!r}",
                          key="--output-prefix")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (``kill``, Slurm's time limit) ends the run as Ctrl-C does: through the same clean-up."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def slurm_jobs_of(output_prefix: str) -> Dict[str, str]:
    """``{job id: state}`` of the prefix's --slurm jobs that Slurm has not finished."""
    from bridge_hpc.launch.submit import submitted_job_ids

    return unfinished_jobs(submitted_job_ids(slurm_plan.slurm_folder(output_prefix)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        with sigterm_as_interrupt():
            return run(argv)
    except KeyboardInterrupt:
        print("[prepare-data] interrupted: no shard was left half written; finished shards are kept, and the "
              "same command goes on from them", file=sys.stderr)
        # Everything is cleaned up; what is left is the interpreter's own teardown, whose garbage
        # collections over torch's and megatron-core's objects took 2-15 s on a loaded 2-core node
        # (0.3-0.5 s with them frozen). Frozen objects are skipped by every later collection.
        gc.freeze()
        return EXIT_INTERRUPTED


@exits_on_config_error
def run(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [STEP_FLAG]:
        return slurm_step(argv[1:])
    args = parser().parse_args(argv)
    if args.workers < 1:
        raise ConfigError("must be >= 1", key="--workers")
    if not args.slurm and (args.wait or args.set):
        raise ConfigError("only with --slurm JOB.toml", key="--wait" if args.wait else "--set")
    check_output_prefix(args.output_prefix, slurm=bool(args.slurm))
    cfg = tokenizer_config(args)
    keys: List[str] = list(dict.fromkeys(args.json_keys))
    if args.slurm:
        return submit_slurm(args, cfg, keys)
    paths = prepare.expand_inputs(args.input)
    workers, reduced = prepare.worker_count(args.workers, paths)
    if reduced:
        print(f"[prepare-data] {reduced}", file=sys.stderr)
    prefix = str(Path(args.output_prefix).absolute())
    records = prepare.prepare_local([str(p) for p in paths], prefix, cfg, keys, args.append_eod, workers,
                                    args.on_bad_line, prepare.Progress(sys.stderr), verify=args.verify,
                                    unfinished_jobs=lambda: slurm_jobs_of(prefix))
    documents = sum(r.documents for r in records)
    tokens = sum(r.tokens for r in records)
    print(f"[prepare-data] {len(records)} shard(s), {documents} documents, {tokens} tokens; manifest "
          f"{prepare.manifest_path(prefix)}", file=sys.stderr)
    print(prepare.data_path_snippet(records, keys))
    return 0


def submit_slurm(args: argparse.Namespace, tokenizer_cfg: TokenizerConfig, keys: List[str]) -> int:
    """Write the plan, render both scripts, submit the array job and the final step after it.

    Everything that can be refused (the job config and its secrets, the inputs, a prefix in use or
    holding other input's shards) is checked before the first sbatch, holding the prefix so that no
    other preparation starts in between; the job ids go to the Slurm folder's ``jobs.jsonl``, which
    keeps the prefix in use until they end. With ``--wait``: block until both jobs end, then print
    the snippet (status 0), or each unfinished shard's task, state and error line (status 1).
    """
    from bridge_hpc.jobfile.jobconfig import check_secrets_present, load_job_config
    from bridge_hpc.launch.render import render_prepare_script
    from bridge_hpc.launch.submit import TemplateExecutor, record_jobs

    job = load_job_config(args.slurm, overrides=args.set, training=False)
    check_secrets_present(job)
    cpus = job.cluster.cpus_per_node
    if cpus is not None and args.workers > cpus:
        raise ConfigError(f"{args.workers} workers per task exceed the {cpus} CPUs per node of the job config's "
                          "cluster profile (cluster.cpus_per_node)", key="--workers")
    paths = prepare.expand_inputs(args.input)
    workers, reduced = prepare.worker_count(args.workers, paths, cpus=args.workers)
    if reduced:
        print(f"[prepare-data] {reduced}", file=sys.stderr)
    prefix = str(Path(args.output_prefix).absolute())
    with prefix_lock.hold_prefix(prefix, "submit", unfinished_jobs=lambda: slurm_jobs_of(prefix)):
        plan, current = slurm_plan.make_plan([str(p) for p in paths], prefix, tokenizer_cfg, keys, args.append_eod,
                                             workers, args.on_bad_line, verify=args.verify)
        folder = slurm_plan.slurm_folder(plan.output_prefix)
        logs = Path(RunFolder(str(folder)).logs)
        plan_path = folder / slurm_plan.PLAN_FILE
        snippet_path = folder / slurm_plan.SNIPPET_FILE
        try:
            logs.mkdir(parents=True, exist_ok=True)
            plan.save(plan_path)
            snippet_path.unlink(missing_ok=True)  # a snippet left from an earlier run must not pass for this one's
        except OSError as err:
            raise ConfigError(f"cannot write the Slurm folder {folder}: {err.strerror or err}",
                              key="--output-prefix") from None

        def script(step: str, dependency: Optional[str]) -> str:
            text = render_prepare_script(job, step=step, step_module=STEP_MODULE,
                                         step_args=[STEP_FLAG, step, str(plan_path)], folder=str(folder),
                                         tasks=len(plan.inputs), cpus_per_task=workers, dependency=dependency)
            name = slurm_plan.SHARDS_SCRIPT if step == "shard" else slurm_plan.FINISH_SCRIPT
            (folder / name).write_text(text)
            return text

        array_id = TemplateExecutor(folder=logs, script=script("shard", None), num_tasks=1).submit_script().job_id
        try:
            finish_id = TemplateExecutor(folder=logs, script=script("finish", f"afterany:{array_id}"),
                                         num_tasks=1).submit_script().job_id
        except BaseException:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(["scancel", str(array_id)], capture_output=True, timeout=30)
            raise
        try:
            record_jobs(Path(RunFolder(str(folder)).jobs_log), [array_id, finish_id], str(job.path))
        except OSError as err:  # submitted: say what is missing rather than fail
            print(f"[prepare-data] warning: jobs {array_id} and {finish_id} were submitted, but "
                  f"{RunFolder(str(folder)).jobs_log} could not be written ({err.strerror or err}): the prefix is not "
                  "marked in use while they run", file=sys.stderr)
    up_to_date = f" ({len(current)} already up to date: their tasks only check them)" if current else ""
    print(f"[prepare-data] submitted array job {array_id}: {len(plan.inputs)} task(s), one per input{up_to_date}; "
          f"final step job {finish_id} after it", file=sys.stderr)
    print(f"[prepare-data] logs: {logs}; the [dataset] snippet will be in {snippet_path} and the manifest in "
          f"{prepare.manifest_path(plan.output_prefix)}", file=sys.stderr)
    if not args.wait:
        return 0
    while unfinished_jobs([str(array_id), str(finish_id)]):
        time.sleep(WAIT_POLL_S)
    if not snippet_path.is_file():
        print(f"[prepare-data] the final step (job {finish_id}) did not finish the dataset:", file=sys.stderr)
        for line in failed_tasks(plan, logs, str(array_id)):
            print(f"[prepare-data]   {line}", file=sys.stderr)
        print(f"[prepare-data] the final step's own log: {RunFolder(str(folder)).stderr(str(finish_id))}",
              file=sys.stderr)
        return 1
    print(snippet_path.read_text(), end="")
    return 0


def failed_tasks(plan: slurm_plan.Plan, logs: Path, array_id: str) -> List[str]:
    """One line per input whose shard did not check out: its task, Slurm's state, and the task's own
    error line (the last ``error:`` line of its log), so that a user sees why without opening logs."""
    from bridge_hpc.slurm.query import job_runs

    settings = plan.settings()
    lines = []
    for index, source in enumerate(plan.inputs):
        if prepare.check_shard(plan.output_prefix, Path(source), settings).record is not None:
            continue
        task = f"{array_id}_{index}"
        runs = job_runs(task)
        state = runs[-1].state if runs else "UNKNOWN"
        log = Path(RunFolder(str(logs.parent)).stderr(task))
        try:
            errors = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("error:")]
        except OSError:
            errors = []
        why = errors[-1] if errors else f"no error line in {log}"
        lines.append(one_line(f"task {index} ({prepare.shard_name(Path(source))}, {source}): {state}: {why}"))
    return lines


def slurm_step(argv: Sequence[str]) -> int:
    """What the batch scripts run: ``shard PLAN`` in an array task, ``finish PLAN`` in the final step."""
    p = argparse.ArgumentParser(prog=f"{STEP_MODULE} {STEP_FLAG}")
    p.add_argument("step", choices=("shard", "finish"))
    p.add_argument("plan", type=Path)
    args = p.parse_args(argv)
    plan = slurm_plan.Plan.load(args.plan)
    if args.step == "shard":
        index = array_task_index()
        if index is None:
            raise ConfigError("the shard step runs as a Slurm array task (SLURM_ARRAY_TASK_ID is not set)",
                              key=STEP_FLAG)
        slurm_plan.run_shard_task(plan, index, sys.stderr, label=str(index))
        return 0
    try:
        records, snippet, manifest = slurm_plan.finish(plan)
    except slurm_plan.ShardsMissing as err:
        print(f"[prepare-data] {err}", file=sys.stderr)
        return 1
    documents = sum(r.documents for r in records)
    tokens = sum(r.tokens for r in records)
    print(f"[prepare-data] {len(records)} shard(s) checked, {documents} documents, {tokens} tokens; manifest "
          f"{manifest}", file=sys.stderr)
    print(snippet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
