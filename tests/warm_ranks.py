"""The ranks of a job on this machine, started from a warm interpreter instead of torchrun.

Most of a tiny CPU run is its start-up: torchrun, then each rank, imports torch and megatron-core
(seconds of CPU a process) before a few milliseconds of steps. :func:`run_ranks` starts the ranks as
children of a multiprocessing *forkserver* that imported those packages once (``PRELOAD``): each child
is a fork of that clean, single-threaded server, gets the rank's environment as torchrun gives it
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, and
``OMP_NUM_THREADS=1`` as torchrun sets for several ranks a node), its working folder and its own output
file, and runs ``bridge_hpc.rank.main(argv)``, the entry point the batch script and torchrun start. What
the rank does from there is the real thing: its job file, torch.distributed over gloo, checkpoints.

A test's own script runs so too (``script``: as ``torchrun SCRIPT ARGV`` runs it, ``__main__`` with
its folder first on ``sys.path``); :func:`start_ranks` returns at once, for a test that kills the
ranks. A test that watches torchrun itself keeps torchrun.

:func:`run_module` does the same for one process started directly: ``python -m MODULE ARGS`` (a
tool such as ``bridge-hf``, or one rank of ``bridge_hpc.rank`` as srun starts a task), run as ``-m``
runs it (``runpy``, as ``__main__``), with its exit status and output as :func:`subprocess.run` gives
them; :func:`run_functions`, a test's own function on each rank (``run_gloo_ranks``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

#: What the server imports once: the packages every rank imports (megatron-core's models and
#: optimizer, torch.distributed's checkpointing), none of the toolkit's own modules (those read the
#: rank's environment as they are imported, and are quick).
PRELOAD = ["torch", "torch.distributed.checkpoint", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.dist_checkpointing", "safetensors.torch"]

_context: Optional[multiprocessing.context.BaseContext] = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _enter(env: Dict[str, str], cwd: str, stdout: str, stderr: str, stdin: str = os.devnull) -> None:
    """A forked child's process as a fresh one started with them: its standard files, environment and folder."""
    for path, target, flags in ((stdin, 0, os.O_RDONLY), (stdout, 1, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (stderr, 2, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        fd = os.open(path, flags, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _as_main(run: Callable[[], Any]) -> int:
    """The exit status the interpreter gives a main program that ``run`` runs: ``SystemExit``'s code (a
    message: printed, 1), 1 after an exception's traceback on stderr, else 0."""
    try:
        run()
    except SystemExit as leaving:
        if leaving.code is None or isinstance(leaving.code, int):
            return leaving.code or 0
        print(leaving.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback on stderr, status 1
        traceback.print_exc()
        return 1
    return 0


def _leave(status: int) -> None:
    """Out as the interpreter leaves (its exit functions, flushed output), without the multiprocessing
    child's own ending."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _rank(env: Dict[str, str], cwd: str, argv: List[str], stdout: str, stderr: str,
          script: Optional[str] = None) -> None:
    """One rank in a forked child: its environment, folder and output files, then the entry point (or
    ``script`` as ``python SCRIPT ARGV`` runs it); the process ends with its status (the entry point
    itself leaves through ``os._exit``)."""
    _enter(env, cwd, stdout, stderr)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # as the variable does in a fresh process
    if script is not None:
        sys.argv = [script, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python puts a script's folder first
        _leave(_as_main(lambda: runpy.run_path(script, run_name="__main__")))
    from bridge_hpc import rank

    status = rank.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)


class Ranks:
    """What :func:`run_ranks` gives back, as :func:`subprocess.run` gives a torchrun's: the first failing
    rank's status (else 0), the ranks' stdout and stderr one after another; and each rank's status and
    the seconds the run took."""

    def __init__(self, returncodes: List[int], stdouts: List[str], stderrs: List[str], seconds: float):
        self.returncodes = returncodes
        self.returncode = next((code for code in returncodes if code != 0), 0)
        self.stdout = "".join(stdouts)
        self.stderr = "".join(stderrs)
        self.seconds = seconds

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class StartedRanks:
    """The ranks :func:`start_ranks` started, as a :class:`subprocess.Popen` of torchrun is used: their
    PIDs, whether they are done, a wait, a kill."""

    def __init__(self, processes: list, files: List[tuple], logs: str, start: float):
        self.processes = processes
        self._files = files
        self._logs = logs
        self._start = start

    @property
    def pids(self) -> List[int]:
        return [process.pid for process in self.processes]

    def poll(self) -> Optional[int]:
        """None while a rank runs, else the first failing rank's status (0 if none failed)."""
        if any(process.is_alive() for process in self.processes):
            return None
        return next((p.exitcode for p in self.processes if p.exitcode != 0), 0)

    def kill(self) -> None:
        """SIGKILL every rank and every process below them (checkpoint workers and theirs) by PID, all
        found first, as a node's loss ends a job; then reap the ranks."""
        from bridge_test_helpers import signal_trees

        signal_trees(self.pids, signal.SIGKILL)
        for process in self.processes:
            process.join()

    def wait(self, timeout: float = 300) -> Ranks:
        """Waits for every rank; ranks still running after ``timeout`` are killed (status -9). The
        ranks' outputs, read once they ended."""
        deadline = self._start + timeout
        try:
            for process in self.processes:
                process.join(max(deadline - time.monotonic(), 0))
        finally:
            if any(process.is_alive() for process in self.processes):
                self.kill()
        outputs = []
        for out, err in self._files:
            texts = []
            for path in (out, err):
                try:
                    with open(path, errors="replace") as f:
                        texts.append(f.read())
                except FileNotFoundError:
                    texts.append("")
            outputs.append(texts)
        shutil.rmtree(self._logs, ignore_errors=True)
        return Ranks([process.exitcode for process in self.processes], [o for o, _ in outputs],
                     [e for _, e in outputs], time.monotonic() - self._start)


def start_ranks(argv: Sequence[str], cwd: str, nprocs: int = 2, env: Optional[Dict[str, str]] = None,
                port: Optional[int] = None, script: Optional[str] = None) -> StartedRanks:
    """``python -m bridge_hpc.rank ARGV`` (or ``python SCRIPT ARGV``) as ``nprocs`` ranks of one job on
    this machine, as torchrun starts them, from the warm server, in ``cwd``; returns at once."""
    from bridge_test_helpers import free_port

    context = _forkserver()
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    port = port or free_port()
    logs = tempfile.mkdtemp(prefix="warm-ranks-")
    files = [(os.path.join(logs, f"rank{r}.out"), os.path.join(logs, f"rank{r}.err")) for r in range(nprocs)]
    started = StartedRanks([], files, logs, time.monotonic())
    try:
        for r in range(nprocs):
            rank_env = dict(base, RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(r),
                            LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            process = context.Process(target=_rank, args=(rank_env, str(cwd), [str(a) for a in argv], *files[r], script))
            process.start()
            started.processes.append(process)
    except BaseException:
        started.kill()
        raise
    return started


def run_ranks(argv: Sequence[str], cwd: str, nprocs: int = 2, env: Optional[Dict[str, str]] = None,
              timeout: float = 300, port: Optional[int] = None, script: Optional[str] = None) -> Ranks:
    """:func:`start_ranks`, then waits for all of them. Ranks still running after ``timeout`` are killed
    by their PIDs, with the processes they started, and the result says so (status -9)."""
    return start_ranks(argv, cwd, nprocs, env, port, script).wait(timeout)


def run_job(config, overrides: Sequence[str], cwd, nprocs: int = 2, env: Optional[Dict[str, str]] = None,
            timeout: float = 300) -> Ranks:
    """:func:`run_ranks` of ``python -m bridge_hpc.rank CONFIG --set ITEM ...``; fails the test with the
    output's tail unless every rank exits 0."""
    argv = [str(config)]
    for item in overrides:
        argv += ["--set", item]
    done = run_ranks(argv, cwd=str(cwd), nprocs=nprocs, env=env, timeout=timeout)
    assert done.returncode == 0, (f"ranks {done.returncodes}" + (" (killed: timed out)" if -9 in done.returncodes
                                                                  else "") + "\n" + done.stdout[-3000:] + done.stderr[-6000:])
    return done


def _module(env: Dict[str, str], cwd: str, module: str, argv: List[str], stdout: str, stderr: str, stdin: str) -> None:
    """``python -m MODULE ARGV`` in a forked child: ``runpy`` as ``-m`` runs it, ending as the
    interpreter ends."""
    _enter(env, cwd, stdout, stderr, stdin)
    sys.argv = [module, *argv]
    _leave(_as_main(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)))


def run_module(module: str, args: Sequence[str], cwd=None, env: Optional[Dict[str, str]] = None,
               timeout: Optional[float] = None, input: Optional[str] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", MODULE, *ARGS], cwd=..., env=..., input=..., timeout=...,
    capture_output=True, text=True)``, from the warm server: the same result (``returncode``, ``stdout``,
    ``stderr``), or :class:`subprocess.TimeoutExpired` after killing the child and what it started by PID."""
    from bridge_test_helpers import signal_trees

    argv = [str(a) for a in args]
    logs = tempfile.mkdtemp(prefix="warm-module-")
    out, err, stdin = (os.path.join(logs, name) for name in ("out", "err", "in"))
    with open(stdin, "w") as f:
        f.write(input or "")
    process = _forkserver().Process(target=_module, args=(dict(os.environ if env is None else env),
                                                          str(cwd or os.getcwd()), module, argv, out, err, stdin))
    try:
        process.start()
        process.join(timeout)
        if process.is_alive():
            signal_trees([process.pid], signal.SIGKILL)
            process.join()
            raise subprocess.TimeoutExpired([sys.executable, "-m", module, *argv], timeout)
        with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
            return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], process.exitcode,
                                               f_out.read(), f_err.read())
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _function_rank(env: Dict[str, str], cwd: str, stdout: str, stderr: str, dump_after_s: float,
                   fn: Callable, rank: int, args: tuple) -> None:
    """``fn(rank, *args)`` in a forked child with the test's environment; its threads' stacks go to
    stderr after ``dump_after_s`` (a hang shows where it is); its status as a main program's, out
    through ``os._exit``."""
    _enter(env, cwd, stdout, stderr)
    import faulthandler

    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    faulthandler.dump_traceback_later(dump_after_s, exit=False)
    status = _as_main(lambda: fn(rank, *args))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no teardown: run_gloo_ranks says why


def run_functions(fn: Callable, args: Sequence[Any], nprocs: int, timeout: float) -> Ranks:
    """``fn(rank, *args)`` for each rank in a child of the warm server (``fn`` a module-level function,
    as for a spawned process), with this process's environment and folder; waits for all. A rank still
    running after ``timeout`` is killed with what it started (status -9), its stacks dumped 15 s before."""
    context = _forkserver()
    logs = tempfile.mkdtemp(prefix="warm-functions-")
    files = [(os.path.join(logs, f"rank{r}.out"), os.path.join(logs, f"rank{r}.err")) for r in range(nprocs)]
    started = StartedRanks([], files, logs, time.monotonic())
    try:
        for r in range(nprocs):
            process = context.Process(target=_function_rank, args=(dict(os.environ), os.getcwd(), *files[r],
                                                                   max(timeout - 15, 1), fn, r, tuple(args)))
            process.start()
            started.processes.append(process)
    except BaseException:
        started.kill()
        raise
    return started.wait(timeout)
