"""``bridge-prepare-data --slurm``: the plan an array job follows, and what its tasks and final step do.

The login node writes one :class:`Plan` (``plan.json``) into the Slurm folder beside the output
(:func:`slurm_folder`: ``<output-prefix>.slurm/``, which also holds the rendered scripts and ``logs/``).
Array task *i* prepares ``plan.inputs[i]`` (:func:`run_shard_task`) and nothing else, so a preempted
or requeued task redoes only its own shard, and one whose shard record is up to date skips it. The
final step (:func:`finish`), submitted after the array, collects every shard's record, verifies the
files against them, writes the manifest and the ``[dataset]`` snippet (:data:`SNIPPET_FILE`).

Nothing here reads Slurm's variables or submits: the caller (``bridge_hpc.cli.prepare_data``) passes
the task index, so this module stays on the data side of the package (contracts and the torch-free
training config only).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, TextIO, Tuple

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.run_folder import RunFolder
from bridge_hpc.prepare import shards as prepare
from bridge_hpc.prepare.prefix_lock import TASK_LOCK_WAIT_S, hold_prefix
from bridge_hpc.training.config import TokenizerConfig

#: The Slurm folder is ``<output-prefix>`` + this suffix: beside the data it makes, so that two
#: preparations of different prefixes never share plans, scripts or logs.
SLURM_FOLDER_SUFFIX = ".slurm"
#: The plan the array tasks and the final step read (JSON, :class:`Plan`).
PLAN_FILE = "plan.json"
#: The rendered scripts: the array job (one task per input) and the final step.
SHARDS_SCRIPT = "shards.sbatch"
FINISH_SCRIPT = "finish.sbatch"
#: The ``[dataset]`` lines the final step writes once every shard checked out.
SNIPPET_FILE = "data_path.toml"
#: Seconds between a task's progress lines in its log.
LOG_INTERVAL_S = 5.0


class ShardsMissing(Exception):
    """The final step found shards without a finished record: their tasks failed or were cancelled."""


@dataclass
class Plan:
    """Everything a task needs, fixed at submission: inputs in task order and the shard settings.

    ``tokenizer`` is a finalized :class:`TokenizerConfig` as a dict; ``inputs`` are absolute paths.
    """

    output_prefix: str
    inputs: List[str]
    tokenizer: Dict[str, Any]
    json_keys: List[str]
    append_eod: bool
    workers: int
    on_bad_line: str
    verify: bool = False

    def tokenizer_config(self) -> TokenizerConfig:
        cfg = TokenizerConfig(**self.tokenizer)
        cfg.finalize()
        return cfg

    def settings(self) -> Dict[str, Any]:
        return prepare.settings_of(self.tokenizer_config(), self.json_keys, self.append_eod)

    def save(self, path: Path) -> None:
        prepare._write_json_atomically(path, dataclasses.asdict(self))

    @classmethod
    def load(cls, path: Path) -> "Plan":
        """The plan at ``path``; a missing or unreadable one is a ConfigError naming it."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"not a readable prepare-data plan ({err})", path=str(path)) from None


def slurm_folder(output_prefix: str) -> Path:
    """Where a Slurm run for ``output_prefix`` keeps its plan, scripts and logs."""
    return Path(str(Path(output_prefix).absolute()) + SLURM_FOLDER_SUFFIX)


def make_plan(inputs: Sequence[str], output_prefix: str, tokenizer_cfg: TokenizerConfig, json_keys: Sequence[str],
              append_eod: bool, workers: int, on_bad_line: str, verify: bool = False) -> Tuple[Plan, List[str]]:
    """The plan for ``inputs`` and the names of the shards already up to date.

    The caller holds the prefix. Every existing record is checked here, on the login node, so that
    a prefix that would overwrite shards made from other input is refused before anything is
    submitted (as in a local run). Up-to-date shards still get their task: it checks the shard again
    and exits, and the plan's task index stays the input's position.
    """
    output_prefix = str(Path(output_prefix).absolute())
    paths = prepare.expand_inputs(inputs)
    prepare.check_output_names(output_prefix, paths, json_keys)
    settings = prepare.settings_of(tokenizer_cfg, json_keys, append_eod)
    current = [check.record.name for check in (prepare.check_shard(output_prefix, p, settings, verify) for p in paths)
               if check.record is not None]
    plan = Plan(output_prefix=output_prefix, inputs=[str(p) for p in paths],
                tokenizer=dataclasses.asdict(tokenizer_cfg), json_keys=list(json_keys), append_eod=append_eod,
                workers=workers, on_bad_line=on_bad_line, verify=verify)
    return plan, current


def run_shard_task(plan: Plan, index: int, stream: TextIO, label: str = "") -> prepare.ShardRecord:
    """Array task ``index``: prepare ``plan.inputs[index]`` unless its shard checks out.

    Holds the prefix shared (the other tasks write other shards). Writes plain progress lines
    (documents, tokens/s) to ``stream``, the task's log; ``label`` (the array task's id) starts each
    of the task's own lines so that logs read on their own.
    """
    if not 0 <= index < len(plan.inputs):
        raise ConfigError(f"array task {index} has no input: the plan lists {len(plan.inputs)}",
                          path=str(slurm_folder(plan.output_prefix) / PLAN_FILE))
    path = Path(plan.inputs[index])
    tokenizer_cfg = plan.tokenizer_config()
    progress = prepare.Progress(stream, interval=LOG_INTERVAL_S)
    with hold_prefix(plan.output_prefix, f"task {index}", shared=True, warn=stream, wait_s=TASK_LOCK_WAIT_S):
        check = prepare.check_shard(plan.output_prefix, path, plan.settings(), plan.verify)
        return prepare.keep_or_prepare(path, check, plan.output_prefix, tokenizer_cfg, plan.json_keys, plan.append_eod,
                                       plan.workers, plan.on_bad_line, progress,
                                       label=f"[prepare-data] task {label}: " if label else "[prepare-data] ")


def finish(plan: Plan) -> Tuple[List[prepare.ShardRecord], str, Path]:
    """The final step: every shard's record, checked; the manifest; the snippet (also written to
    :data:`SNIPPET_FILE`). Returns (records, snippet, manifest path).

    Raises :class:`ShardsMissing` naming each input whose shard has no up-to-date record (its task
    failed or was cancelled; re-running ``bridge-prepare-data --slurm`` redoes only those), and
    ConfigError when a finished shard's files disagree with its record.
    """
    settings = plan.settings()
    with hold_prefix(plan.output_prefix, "finish", shared=True, wait_s=TASK_LOCK_WAIT_S):
        records, missing = [], []
        for index, source in enumerate(plan.inputs):
            record = prepare.check_shard(plan.output_prefix, Path(source), settings).record
            if record is not None:
                records.append(record)
            else:
                missing.append(f"{prepare.shard_name(Path(source))} (task {index}, {source})")
        if missing:
            raise ShardsMissing(f"{len(missing)} of {len(plan.inputs)} shard(s) not finished: {', '.join(missing)}; "
                                "each task's error is the last 'error:' line of its log in "
                                f"{RunFolder(str(slurm_folder(plan.output_prefix))).logs}. Fix what it names (a task "
                                "that failed on its input fails again), then run the same bridge-prepare-data --slurm "
                                "command: it redoes only those")
        prepare.check_shards(records)
        manifest = prepare.write_manifest(plan.output_prefix, records, settings)
    snippet = prepare.data_path_snippet(records, plan.json_keys)
    snippet_path = slurm_folder(plan.output_prefix) / SNIPPET_FILE
    tmp = snippet_path.with_name(snippet_path.name + f".tmp{os.getpid()}")
    tmp.write_text(snippet + "\n")
    os.replace(tmp, snippet_path)
    return records, snippet, manifest
