"""``python -m bridge_hpc.rank JOB.toml [--set section.key=value ...]``: the rank entry point.

Every rank of a job runs this: the batch script starts it on the run folder's resolved.toml (paths
absolute, ``train.exit_signal`` from ``[slurm] signal``), and it works the same on a job file under
``torchrun``. The job is resolved by :func:`bridge_hpc.jobfile.jobconfig.load_job_config`, the same
function ``bridge-submit`` ran, which builds and checks the training
:class:`~bridge_hpc.training.config.ConfigContainer` once; then the entry point ``[job] entry`` names
(``"pretrain"``, the default, or ``"finetune"``: :func:`bridge_hpc.training.finetune.finetune`) trains
with the forward step ``[job] forward_step`` names (default: Bridge's GPT step,
:func:`bridge_hpc.training.gpt_step.forward_step`).

Exit status: 0 when training stopped as planned (done, or checkpointed with a requeue request), 2 for
bad input (one line naming file and key), 1 for any other failure. A rank leaves without the
process-group and interpreter teardown (:func:`_leave`): a failing one at once, so that it does not
wait for peers stuck in a collective (srun's ``--kill-on-bad-exit``, or ft_launcher, then ends the
others within seconds); a finished one as soon as its outputs are durable.

It stands a floor above the two it joins (docs/layout.md): the job file's loader
(:mod:`bridge_hpc.jobfile`, which reads the training package's torch-free configs) and the training
package (which never imports the loader).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import traceback
from typing import Callable, List, Optional

from bridge_hpc.contracts import signals
from bridge_hpc.contracts.errors import EXIT_BAD_INPUT, ConfigError
from bridge_hpc.jobfile.jobconfig import load_job_config
from bridge_hpc.slurm.job_environment import JobEnvironment
from bridge_hpc.training.checkpoint.read_ahead import start_read_ahead
from bridge_hpc.training.config import ConfigContainer
from bridge_hpc.training.process import compiler_imports, heap, lazy_imports
from bridge_hpc.training.process.bytecode_cache import ensure_bytecode_cache
from bridge_hpc.training.process.signal_recorder import StopSignalRecorder

#: Exit status of a rank that failed for any reason other than bad input.
EXIT_FAILED = 1


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


def load_entry(name: str) -> Callable:
    """``[job] entry`` -> Bridge's entry point: ``pretrain`` or ``finetune`` (the launcher has checked the
    name). Imported here, after the stop-signal recorder is in place, because it imports torch."""
    if name == "finetune":
        from bridge_hpc.training.finetune import finetune

        return finetune
    from bridge_hpc.training.pretrain import pretrain

    return pretrain


def build_config(path: str, overrides: Optional[List[str]] = None) -> ConfigContainer:
    """The training config of a job file or resolved.toml, as the ranks get it."""
    return load_job_config(path, overrides or ()).training


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


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge_hpc.rank", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="job TOML file or a run folder's resolved.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one setting (repeatable); VALUE is a TOML value")
    args = parser.parse_args(argv)
    try:
        job = load_job_config(args.config, args.overrides)
        # Before torch and megatron-core are imported: their bytecode, and the checkpoint the run will
        # load read into the page cache while they are.
        ensure_bytecode_cache(job.job.bytecode_cache)
        start_read_ahead(job.training.checkpoint.load, first_on_node=JobEnvironment.from_env().local_rank == 0)
        if job.training.train.exit_signal_handler:
            # Before torch is imported: a stop signal during those seconds is recorded, not fatal;
            # pretrain's own recorder takes it over.
            StopSignalRecorder(job.training.train.exit_signal).__enter__()
        quiet_known_warnings()
        # Most of a requeued rank's start-up: the collector kept out of it, torch's compiler imported
        # only if a compiled function is called and W&B only if it is used (process.heap,
        # process.compiler_imports, process.lazy_imports).
        lazy_imports.install()
        with heap.imports_uncollected(), compiler_imports.deferred():
            forward_step = load_forward_step(job.job.forward_step, source=args.config)
            entry = load_entry(job.job.entry)
        # This process leaves through os._exit once the entry point returns (_leave): the process group
        # pretrain brings up is left to that, not torn down first.
        from bridge_hpc.training import pretrain as pretrain_module

        pretrain_module.PROCESS_ENDS_ON_RETURN = True
        # The entry point brings torch.distributed up itself, after its signal handler is in place: a
        # preemption notice during a slow rendezvous is then recorded, not fatal.
        try:
            entry(job.training, forward_step)
        except ConfigError as err:
            # Checks on the ranks (validate(), finetune()'s starting point) name a key but no file: it is this one.
            raise (ConfigError(err.message, path=args.config, key=err.key) if err.path is None else err) from None
        if job.training.train.exit_signal_handler:
            # Training has stopped, its last checkpoint durable: a stop signal from now on (Slurm's
            # time-limit warning landing while the process group is torn down) has nothing left to
            # stop. Ignored, not left to the recorders, which Python's finalization resets to the
            # default action: the rank would die of it after a clean end, and the batch script would
            # count a failed run and requeue the job.
            signals.ignore(job.training.train.exit_signal)
    except ConfigError as err:
        print(f"error: {err.format()}", file=sys.stderr, flush=True)
        _leave(EXIT_BAD_INPUT)
    except BaseException as err:  # noqa: BLE001 - any failure ends this rank, and so the job step
        traceback.print_exc()
        print(f"error: rank failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        _leave(EXIT_FAILED)
    return 0


def _leave(status: int) -> None:
    """Exit now, skipping interpreter and process-group teardown. After a failure: a peer blocked in
    a collective would make either wait for the distributed timeout. After a normal end (the entry
    point's own way out): the run's last collective was its exit decision and save, and everything it
    writes is closed and fsynced by then (checkpoint, progress log, metrics, TensorBoard); what is
    left, destroying the process groups and finalizing an interpreter that holds torch, megatron
    and CUDA memory, costs seconds that a preempted job pays inside Slurm's grace time and that
    delay its requeue. Output is flushed first, and the rank's own ``multiprocessing`` children
    still alive are ended (:func:`_end_children`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    _end_children()
    os._exit(status)


def _end_children() -> None:
    """Kill the ``multiprocessing`` children this rank still has: ``os._exit`` skips the finalizers
    that would shut them down, and an orphan lives on holding the job's output open (a library's
    write-results Manager did: a torchrun job never ended on a GPU host). The toolkit's own
    checkpoint worker and Manager are stopped before this; whatever a library started is not."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()


if __name__ == "__main__":
    _leave(main())
