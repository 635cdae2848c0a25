"""What several test modules (and benchmarks/preemption.py) need: one copy each.

* ports and CLI runners: :func:`free_port`, :func:`submit_cli`;
* Slurm: :func:`squeue_state`, :func:`sacct_runs`, :func:`sacct_state`, and driving real jobs through
  preemptions on the local cluster (:func:`submit`, :func:`drive`, :func:`wait_running_past`);
* what a run left behind: :func:`losses`, :func:`steps_done`, :func:`log_text`, :func:`model_params`;
* the smallest training sections a job config can have (:data:`MINIMAL_TRAINING`).

The preemption runs are the demo's tiny GPT (configs/local-tiny.toml) with 2 ranks; the reference is the
same config trained in one go by torchrun, so any difference in losses or parameters is the
interruption's fault. The module's name is unique so that ``import`` finds it whether pytest puts
``tests/`` or ``benchmarks/`` first on the path.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import toml

from bridge_hpc.contracts.run_folder import CHECKPOINTS_DIR, METRICS_FILE, RunFolder
from bridge_hpc.slurm.query import TERMINAL_STATES
from bridge_hpc.training.checkpoint.worker import WORKER_NAME

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "local-tiny.toml"
#: The tests' tiny GPT job (tests/data/tiny.toml): 2 CPU ranks, run folder ``runs/tiny`` beside the job file.
TINY = ROOT / "tests" / "data" / "tiny.toml"
#: A forward step with faults and delays chosen by environment variables (see its docstring)
FAULTY_FORWARD_STEP = ROOT / "tests" / "data" / "faulty_forward_step.py"

#: The smallest training sections a job config can have: the login node validates them too.
MINIMAL_TRAINING = {
    "train": {"train_iters": 1, "micro_batch_size": 1, "global_batch_size": 1},
    "optimizer": {"lr": 1e-3},
}
MINIMAL_TRAINING_TOML = """
[train]
train_iters = 1
micro_batch_size = 1
global_batch_size = 1

[optimizer]
lr = 1e-3
"""


# ---------------------------------------------------------------------------------------------
# Ports and command lines
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free right now (for a rendezvous or MASTER_PORT), below the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) comes from that range, where any process's next outgoing
    connection may take it before the rendezvous binds it: ``EADDRINUSE`` in a 2-GPU run's TCPStore
    (benchmarks/parallel.py on an H100 host). Below the range only a listener can hold a port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(10000, max(ephemeral_low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_job(directory) -> str:
    """A copy of :data:`TINY` in ``directory`` (created): its run folder is then ``directory/runs/tiny``."""
    os.makedirs(directory, exist_ok=True)
    job = os.path.join(directory, "job.toml")
    shutil.copy(TINY, job)
    return job


def tiny_run_dir(job: str) -> str:
    """The run folder of a :func:`tiny_job` copy: :data:`TINY`'s ``job.run_dir``, relative to the copy."""
    with open(TINY, encoding="utf-8") as f:
        run_dir = toml.load(f)["job"]["run_dir"]
    return os.path.join(os.path.dirname(job), run_dir)


def tiny_checkpoints(job: str) -> str:
    """The checkpoint folder of a :func:`tiny_job` copy."""
    return os.path.join(tiny_run_dir(job), CHECKPOINTS_DIR)


def submit_cli(*args: str, cwd: Path, env=None, timeout: float = 180) -> subprocess.CompletedProcess:
    """``bridge-submit ARGS`` in ``cwd`` as a user runs it (a fresh interpreter), output captured."""
    return subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Slurm
# ---------------------------------------------------------------------------------------------


def squeue_state(job_id: str) -> Optional[tuple]:
    """``(state, reason)`` while Slurm's queue holds the job, else None."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True).stdout.strip()
    return tuple(out.split("|", 1)) if out else None


def sacct_runs(job_id: str) -> List[str]:
    """The state of every run of the job (a requeued job has one line per run), oldest first."""
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "--duplicates", "-o", "State"],
                         capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sacct_state(job_id: str, timeout: float = 30) -> str:
    """The job's final state from sacct, waiting up to ``timeout`` s for it (accounting reaches slurmdbd a
    moment after the job ends)."""
    deadline = time.monotonic() + timeout
    runs: List[str] = []
    while time.monotonic() < deadline:
        runs = sacct_runs(job_id)
        if runs and runs[-1] in TERMINAL_STATES:
            return runs[-1]
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not finished in sacct after {timeout} s (states {runs})")


def wait_until_gone(job_ids: Sequence[str], timeout: float = 120) -> None:
    """Until Slurm's queue holds none of ``job_ids`` (cancelled jobs stay COMPLETING while their ranks
    checkpoint and exit); a test that cancels jobs waits so that their processes do not run on into the
    next test."""
    deadline = time.time() + timeout
    while time.time() < deadline and any(squeue_state(j) is not None for j in job_ids):
        time.sleep(0.5)


def wait_until_no_job_runs(timeout: float = 180) -> None:
    """Until no job runs or completes on the cluster: for tests that compare the ranks' CPU time per step,
    which other jobs' processes on the same cores would distort."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["squeue", "-h", "-t", "RUNNING,COMPLETING,CONFIGURING", "-o", "%i"],
                             capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(0.5)


def overrides(run_dir: Path, train_iters: int, extra: Sequence[str] = ()) -> List[str]:
    base = [f"job.run_dir={run_dir}", f"train.train_iters={train_iters}", "logger.log_interval=10",
            "train.eval_interval=50", "checkpoint.save_interval=25", "checkpoint.most_recent_k=3"]
    return base + list(extra)


def reference_run(run_dir: Path, train_iters: int, config: Path = CONFIG, extra: Sequence[str] = ()) -> Path:
    """The uninterrupted run: 2 ranks on this machine (:func:`warm_ranks.run_ranks`, as torchrun starts
    them), same config (``extra``: more ``--set`` items, which win)."""
    from warm_ranks import run_ranks

    args = [str(config)]
    for item in overrides(run_dir, train_iters, extra):
        args += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("SLURM_JOB_ID", None)
    done = run_ranks(args, cwd=os.getcwd(), env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def submit(run_dir: Path, train_iters: int, extra: Sequence[str] = ()) -> str:
    """Submit the demo config into ``run_dir``; returns the job id."""
    args = [str(CONFIG)]
    for item in overrides(run_dir, train_iters, extra):
        args += ["--set", item]
    proc = submit_cli(*args, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()[2]


def release_when_held(job_id: str) -> None:
    """Slurm holds a requeued job ~120 s (Reason=BeginTime); a test has no time for that."""
    from bridge_hpc.local_slurm.cluster import release_requeued

    state = squeue_state(job_id)
    if state and state[0] == "PENDING" and "BeginTime" in state[1]:
        release_requeued(job_id)


def drive(job_id: str, timeout: float = 900, on_tick: Optional[Callable[[], None]] = None) -> str:
    """Release requeue holds until the job is done; returns its final state."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = squeue_state(job_id)
        if state is None:
            runs = sacct_runs(job_id)
            if runs and runs[-1] in TERMINAL_STATES:
                return runs[-1]
        else:
            release_when_held(job_id)
        if on_tick:
            on_tick()
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise TimeoutError(f"job {job_id} did not finish in {timeout} s")


def wait_running_past(job_id: str, run_dir: Path, step: int, timeout: float = 300) -> None:
    """Until the job runs and has logged ``step`` (releasing a requeue hold on the way)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = squeue_state(job_id)
        if state is None:
            raise AssertionError(f"job {job_id} ended before step {step}: {sacct_runs(job_id)}")
        release_when_held(job_id)
        if state[0] == "RUNNING" and steps_done(run_dir) >= step:
            return
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} did not reach step {step}")


# ---------------------------------------------------------------------------------------------
# What a run left behind
# ---------------------------------------------------------------------------------------------


def _metrics(run_dir: Path) -> List[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    # a line being written right now is incomplete: skip it
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def steps_done(run_dir: Path) -> int:
    """The newest step in the run's metrics.jsonl (0 before the first)."""
    return max((r["step"] for r in _metrics(run_dir)), default=0)


def losses(run_dir: Path) -> Dict[int, float]:
    """Step → training loss from metrics.jsonl; a step logged twice fails the test (a resume that
    repeated or duplicated work)."""
    out: Dict[int, float] = {}
    for r in _metrics(run_dir):
        assert r["step"] not in out, f"step {r['step']} logged twice"
        out[r["step"]] = r["loss"]
    return out


def log_text(run_dir: Path, job_id: str) -> str:
    """The job's stdout and stderr logs, joined."""
    folder = RunFolder(str(run_dir))
    parts = [Path(p).read_text() for p in (folder.stdout(job_id), folder.stderr(job_id)) if os.path.exists(p)]
    return "\n".join(parts)


#: Lines of a job's log that tell its story across runs: the batch script's own words, Slurm's errors,
#: the ranks' failures and their checkpoint loads and ends.
_STORY = re.compile(r"bridge_hpc: |slurmstepd|srun: error|Traceback|Error|Loaded checkpoint|Ending job|"
                    r"requeue|SIMULATED FAULT|will restart worker group")


def job_story(run_dir: Path, job_id: str, limit: int = 6000) -> str:
    """What a failed assertion about a job should show: every run's Slurm record (state, exit code,
    reason, times) and the log lines of :data:`_STORY` of every run, not only the last run's tail."""
    records = subprocess.run(["sacct", "-j", job_id, "-X", "-P", "--duplicates",
                              "-o", "State,ExitCode,Reason,Start,End,NodeList"],
                             capture_output=True, text=True).stdout
    lines = [line for line in log_text(run_dir, job_id).splitlines() if _STORY.search(line)]
    story = "\n".join(lines)
    return f"sacct:\n{records}\nlog ({len(lines)} lines of note):\n{story[-limit:]}"


def model_params(checkpoint_dir: str, scratch: str) -> dict:
    """The model tensors of a DCP checkpoint folder, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(scratch, f"{os.path.basename(checkpoint_dir)}_{random.random()}.pt")
    dcp_to_torch_save(checkpoint_dir, out)
    state = torch.load(out, weights_only=False)
    return dict(state["model"])


def assert_bitwise_equal(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- processes a test started, stopped by PID ----------------------------------------------------


def descendants(pid: int) -> list:
    """Every process below ``pid`` (from /proc): torchrun's ranks, their checkpoint workers and
    helpers, so a test stops exactly the processes it started (torchrun puts each rank in a session
    of its own, so a process-group kill would miss them)."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_tree(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid`` and every process below it, by PID (as Slurm signals a job step's
    processes); one that has ended meanwhile is skipped."""
    signal_trees([pid], signum)


def signal_trees(pids: Sequence[int], signum: int) -> None:
    """:func:`signal_tree` of several processes at once: every process below them is found before the
    first is signalled (a rank killed first cannot leave its workers to be found under another parent)."""
    for target in [found for pid in pids for found in (pid, *descendants(pid))]:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process below it, by PID, and reap it."""
    import signal

    signal_tree(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


# -- a gloo world of one, in the test's own process -------------------------------------------------

_RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def single_rank_world(backend: str = "gloo"):
    """A generator for a pytest fixture: a world of one (``backend``: gloo, or nccl on GPU 0) with
    megatron-core's model-parallel state (TP = PP = 1), as pretrain has it; the rank variables are
    restored afterwards."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    saved = {k: os.environ.get(k) for k in _RANK_VARIABLES}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def processes_in(folder) -> List[int]:
    """Processes whose working directory is under ``folder`` (ranks and everything they started)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
            except OSError:
                continue
            if cwd == str(folder) or cwd.startswith(f"{folder}/"):
                found.append(int(entry))
    return found


def assert_no_process_left(folder, grace_s: float = 10.0) -> None:
    """Nothing a run started outlives it: checkpoint workers die with their rank, the processes a
    worker forks die with it, the write-results Manager ends within a second of its rank."""
    deadline = time.time() + grace_s
    while processes_in(folder) and time.time() < deadline:
        time.sleep(0.2)
    left = processes_in(folder)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


def worker_of_rank(root_pid: int, rank: int) -> Optional[int]:
    """The checkpoint worker (``bridge-ckpt``) whose parent is the given rank, among the processes
    under ``root_pid`` (torchrun's, or the rank's own when it was started directly)."""
    for pid in descendants(root_pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != WORKER_NAME:
                    continue
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{parent}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        except (OSError, ValueError, IndexError):
            continue
    return None


def evict_from_page_cache(paths: Sequence[str]) -> None:
    """Drop the files' pages from the page cache (written back first), as a job that starts on
    another node finds them: ``POSIX_FADV_DONTNEED``, no privileges needed."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def direct_rank_env(rank: int = 0, world_size: int = 1, port: Optional[int] = None) -> Dict[str, str]:
    """The environment of one rank of a job on this machine started directly, as srun starts a task
    (no launcher between a signal and the rank): torch.distributed's variables (``port``: the
    rendezvous port all ranks share; a free one for a world of one), and no Slurm job variables."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()))
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    return env


#: How long a test's spawned gloo ranks may take before they are killed and the test fails.
GLOO_RANKS_TIMEOUT_S = 300.0


def run_gloo_ranks(fn: Callable, *args, nprocs: int = 2, timeout: float = GLOO_RANKS_TIMEOUT_S) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes (the test's own gloo world), forked from
    tests/warm_ranks.py's warm server; a rank that fails fails the test with its traceback, and ranks
    still running after ``timeout`` are killed (by their PIDs) and fail it with their stacks. Each leaves
    through ``os._exit``, as the toolkit's ranks leave (``run._leave``): a rank that had returned
    normally once hung in the interpreter's teardown after ``destroy_process_group`` (a futex, CI of
    2026-11-26), and the test waited forever."""
    from warm_ranks import run_functions

    done = run_functions(fn, args, nprocs, timeout)
    if -9 in done.returncodes:
        raise AssertionError(f"the {nprocs} gloo ranks did not end in {timeout:.0f} s:\n{done.stderr[-8000:]}")
    failed = [(rank, code) for rank, code in enumerate(done.returncodes) if code != 0]
    assert not failed, f"ranks failed (rank, status): {failed}\n{done.stdout[-2000:]}{done.stderr[-8000:]}"


# -- one rank of a job file on this machine's GPU (tests/test_gpu_*) ---------------------------------


#: One interpreter running a CLI's ``main`` on several argument lists, as its console script does
#: (``sys.exit(main(argv))``), each with its own working folder, stdout and stderr (an exception that
#: escapes ``main`` prints its traceback there, as the interpreter would, with status 1).
_CLI_CASES_DRIVER = r"""
import contextlib, importlib, io, json, os, sys, traceback
main = importlib.import_module(sys.argv[1]).main
results = []
for case in json.loads(sys.stdin.read()):
    os.chdir(case["cwd"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(case["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"returncode": code or 0, "stdout": out.getvalue(), "stderr": err.getvalue()})
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""


def run_cli_cases(module: str, cases: Sequence[Tuple[Sequence[str], Path]], timeout: float = 600) -> List[
        subprocess.CompletedProcess]:
    """``python -m module ARGV`` for each ``(argv, cwd)`` of ``cases``, in one fresh interpreter rather than
    one each (the CLIs import torch and megatron-core: seconds a start): for the bad-input tests, whose
    every case ends at its check. Each result as :func:`subprocess.run` gives it."""
    import tempfile

    payload = json.dumps([{"argv": [str(a) for a in argv], "cwd": str(cwd)} for argv, cwd in cases])
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        proc = subprocess.run([sys.executable, "-c", _CLI_CASES_DRIVER, module, results], input=payload,
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0 and os.path.exists(results), proc.stdout[-2000:] + proc.stderr[-4000:]
        with open(results) as f:
            done = json.load(f)
    return [subprocess.CompletedProcess([module, *argv], r["returncode"], r["stdout"], r["stderr"])
            for (argv, _), r in zip(cases, done)]


#: ``pytest --layers=...`` (tests/conftest.py) puts the layer implementation here for the GPU tests' ranks.
LAYERS_ENV = "BRIDGE_TEST_LAYERS"


def with_test_layers(overrides) -> list:
    """``overrides`` after ``model.transformer_impl`` = ``pytest --layers``'s choice, so that every GPU
    test's rank runs on those layers (a rank uses the GPU wherever there is one); a test that names the
    layers itself keeps its own."""
    overrides = list(overrides)
    layers = os.environ.get(LAYERS_ENV)
    if not layers or any(item.startswith("model.transformer_impl=") for item in overrides):
        return overrides
    return [f'model.transformer_impl="{layers}"'] + overrides


def set_args(job: str, overrides) -> list:
    """The rank entry's arguments: the job file, then ``--set KEY=VALUE`` for each override
    (:func:`with_test_layers`' first)."""
    args = [job]
    for item in with_test_layers(overrides):
        args += ["--set", item]
    return args


def run_one_gpu_rank(job: str, *overrides: str, timeout_s: float = 240) -> str:
    """Run ``job`` as one rank under torchrun (a free rendezvous port), in the job's folder; its output
    (stdout and stderr). Fails the test with the output's tail on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
           "-m", "bridge_hpc.rank", *set_args(job, overrides)]
    proc = subprocess.run(cmd, cwd=os.path.dirname(job), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


class Clock:
    """A clock a test sets: ``ProgressLog(..., clock=Clock(t))``, ``clock.at(t)`` for the next record."""

    def __init__(self, t):
        self.t = float(t)

    def __call__(self):
        return self.t

    def at(self, t):
        self.t = float(t)
        return self
