"""Fault tolerance (nvidia-resiliency-ext) on CPU: ft_launcher with 2 gloo ranks of a tiny loop
(tests/data/ft_worker.py) that uses bridge_hpc.training.resilience.fault_tolerance.FaultTolerance; and the CPU
straggler detector (tests/data/straggler_worker.py).

Every process is started in its own session and stopped by its own PID / process group id."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from bridge_test_helpers import free_port, signal_tree

from bridge_hpc.launch import ft_launch
from bridge_hpc.launch.ft_launch import FTLaunchTimeouts, ft_launcher_argv, shell_join
from bridge_hpc.training.config import FaultToleranceConfig

pytest.importorskip("nvidia_resiliency_ext.fault_tolerance")

DATA = Path(__file__).parent / "data"
WORKER = DATA / "ft_worker.py"
STRAGGLER_WORKER = DATA / "straggler_worker.py"
REPO = Path(__file__).resolve().parent.parent

CHECK = 0.5  # --ft-workload-check-interval of these tests
MARGIN = 5.0  # generous: detection is judged on a shared, loaded 2-core machine (CI), where a process can stall for seconds


def worker_env(**extra) -> Dict[str, str]:
    """The environment of the processes we start: this checkout first on PYTHONPATH (kept, not replaced)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process we started and every process below it, by PID (a launcher puts each rank in a
    session of its own, so its process group would miss them)."""
    signal_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class Run:
    def __init__(self, out: Path, rc: int, log: str, seconds: float):
        self.out, self.rc, self.log, self.seconds = out, rc, log, seconds

    def starts(self, rank: int) -> List[dict]:
        path = self.out / f"start_rank{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def steps(self, rank: int) -> List[tuple]:
        path = self.out / f"steps_rank{rank}.txt"
        rows = []
        for line in path.read_text().splitlines():
            r, it, t = line.split()
            rows.append((int(r), int(it), float(t)))
        return rows

    def done(self, rank: int) -> dict:
        return json.loads((self.out / f"done_rank{rank}.json").read_text())

    def log_times(self, pattern: str) -> List[float]:
        """Epoch times of launcher / monitor log lines matching ``pattern``."""
        out = []
        for line in self.log.splitlines():
            m = re.match(r"\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]?", line)
            if m and re.search(pattern, line):
                out.append(time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000)
        return out

    def fault_time(self) -> Optional[float]:
        m = re.search(r"SIMULATED FAULT \S+ rank \d+ iteration \d+ at ([\d.]+)", self.log)
        return float(m.group(1)) if m else None


def run_ft(out: Path, worker_args: List[str], timeouts: FTLaunchTimeouts, max_restarts: int = 2,
           limit: float = 55.0) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    argv = ft_launcher_argv(
        [str(WORKER), "--out", str(out), *worker_args], python=sys.executable, nnodes=1, nproc_per_node=2,
        rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id=f"t{os.getpid()}", max_restarts=max_restarts,
        timeouts=timeouts, workers_stop_timeout=3, monitor_interval=0.2,
    )
    env = worker_env()
    env.pop("SLURM_JOB_ID", None)
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(REPO), start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _stop(proc)
        log = proc.stdout.read() if proc.stdout else ""
        pytest.fail(f"ft_launcher did not finish in {limit} s:\n{log[-4000:]}")
    finally:
        _stop(proc)
    (out / "launcher.log").write_text(log)
    return Run(out, proc.returncode, log, time.time() - t0)


def fast_timeouts(**kw) -> FTLaunchTimeouts:
    base = dict(setup=30, step=3, checkpointing=30, out_of_section=10, initial_heartbeat=30, heartbeat=3,
                workload_check_interval=CHECK)
    base.update(kw)
    return FTLaunchTimeouts(**base)


# -- the launcher command line ----------------------------------------------------------------------


def test_argv_is_accepted_by_installed_ft_launcher():
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    argv = ft_launcher_argv(["-m", "bridge_hpc.rank", "cfg.toml"], python="python3", nnodes=4, nproc_per_node=8,
                            rdzv_endpoint="node001:31234", rdzv_id="4242", max_restarts=3, term_timeout=60,
                            log_dir="/tmp/ftlogs")
    assert argv[:4] == ["python3", "-m", ft_launch.WRAPPER_MODULE, f"{ft_launch.IGNORE_OPTION}=SIGUSR1"]
    args = get_args_parser().parse_args(argv[4:])  # the wrapper takes its own option first
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("4", "8", 3)
    assert args.rdzv_endpoint == "node001:31234" and args.rdzv_id == "4242" and args.rdzv_backend == "c10d"
    assert args.module and args.training_script == "bridge_hpc.rank" and args.training_script_args == ["cfg.toml"]
    assert args.ft_rank_section_timeouts == "setup:600,step:180,checkpointing:420"
    assert float(args.ft_rank_out_of_section_timeout) == 300.0
    assert float(args.ft_rank_heartbeat_timeout) == 2700.0
    assert not any(a.startswith("--ft-param") or a.startswith("--ignore-missing") for a in argv)


def test_shell_join_and_slurm_endpoint():
    argv = ft_launch.srun_prefix(2, cpus_per_node=16) + ft_launcher_argv(
        ["-m", "bridge_hpc.rank", "$BRIDGE_CONFIG"], nnodes=2, nproc_per_node=8,
        rdzv_endpoint="${BRIDGE_RDZV_HOST}:${BRIDGE_RDZV_PORT}", rdzv_id="$SLURM_JOB_ID")
    line = shell_join(argv)
    assert '"--rdzv-endpoint=${BRIDGE_RDZV_HOST}:${BRIDGE_RDZV_PORT}"' in line
    assert "--ntasks-per-node=1" in line and '"$BRIDGE_CONFIG"' in line
    out = subprocess.run(["bash", "-c", "printf '%s\\n' " + line],
                         env={"BRIDGE_RDZV_HOST": "n1", "BRIDGE_RDZV_PORT": "3", "SLURM_JOB_ID": "7",
                              "BRIDGE_CONFIG": "a b.toml", "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert "--rdzv-endpoint=n1:3" in out and "--rdzv-id=7" in out and "a b.toml" in out
    env = {"SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "123"}
    assert ft_launch.rdzv_endpoint_from_slurm(env) == f"gpu07:{ft_launch.rdzv_port_for_job('123')}"


# -- the rank side without a launcher ---------------------------------------------------------------


def test_inactive_without_launcher_and_state_round_trip(monkeypatch, tmp_path):
    from bridge_hpc.training.resilience.fault_tolerance import FaultTolerance

    monkeypatch.delenv("FT_RANK_MONITOR_IPC_SOCKET", raising=False)
    ft = FaultTolerance(FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=True), str(tmp_path))
    assert ft.setup() is False and not ft.active
    ft.step_start(0)
    ft.maybe_simulate_fault(0)
    ft.step_end(0)
    with ft.checkpointing():
        pass
    state = {"current_timeouts": {"section": {"section": {"setup": 12.0, "step": 3.5, "checkpointing": 9.0},
                                              "out_of_section": 4.0, "calculated_sections": ["step"],
                                              "is_out_of_section_calculated": True}}}
    ft.load_state_dict(state)
    assert ft.state_dict() == state
    ft.shutdown()
    assert FaultTolerance(None).setup() is False


# -- in-job restarts under ft_launcher --------------------------------------------------------------


@pytest.mark.parametrize("fault", ["rank_hung", "rank_killed"])
def test_fault_is_detected_and_workers_restart(tmp_path, fault):
    step_timeout = 3.0
    run = run_ft(tmp_path / fault, ["--steps", "70", "--step-time", "0.05", "--save-interval", "10",
                                    "--fault", fault, "--fault-rank", "1", "--fault-delay", "3"],
                 fast_timeouts(step=step_timeout))
    assert run.rc == 0, run.log[-4000:]
    fault_at = run.fault_time()
    assert fault_at is not None, run.log[-4000:]
    # the launcher's decision to restart (the same words in 0.4.1 and 0.7.0): the monitor killed the
    # hung rank, or the killed rank is gone; the launcher polls every 0.2 s
    detected = run.log_times(r"attempts left; will restart worker group")
    assert detected, run.log[-4000:]
    latency = min(detected) - fault_at
    if fault == "rank_hung":
        # the monitor checks every CHECK s; log stamps have ms resolution
        assert step_timeout - 0.05 <= latency <= step_timeout + CHECK + MARGIN, latency
    else:
        assert latency <= 1.0 + MARGIN, latency  # the launcher sees the dead worker at once
    for rank in (0, 1):
        starts = run.starts(rank)
        assert [s["restart"] for s in starts] == [0, 1], starts
        assert starts[1]["iteration"] > 0  # resumed from the "checkpoint"
        assert starts[1]["lost_s"] is not None and starts[1]["lost_s"] > 0
        assert run.done(rank)["iteration"] == 70 and run.done(rank)["restart_count"] == 1
        first_after = min(t for r, _, t in run.steps(rank) if r == 1)
        assert first_after > min(detected)
    print(f"{fault}: detection {latency:.2f} s after the fault; first step after restart "
          f"{first_after - min(detected):.2f} s after detection; run {run.seconds:.1f} s")


@pytest.mark.parametrize("mode", ["sections", "heartbeats"])
def test_long_checkpoint_and_slow_first_step_are_not_hangs(tmp_path, mode):
    # step / heartbeat timeout 2 s; a first step (warm-up) of 4 s, under the set-up allowance; a save
    # of 4 s inside checkpointing(): no restart
    timeouts = fast_timeouts(step=2, heartbeat=2, use_sections=mode == "sections")
    run = run_ft(tmp_path / mode, ["--steps", "12", "--step-time", "0.05", "--first-step-time", "4",
                                   "--save-interval", "6", "--save-time", "4"], timeouts, max_restarts=1)
    assert run.rc == 0, run.log[-4000:]
    assert "will restart worker group" not in run.log and "FT timeout elapsed" not in run.log
    for rank in (0, 1):
        starts = run.starts(rank)
        assert [s["restart"] for s in starts] == [0] and starts[0]["mode"] == mode
        assert run.done(rank)["iteration"] == 12
    if mode == "sections":  # the heartbeat timeouts were switched off on the monitor
        hb = run.starts(0)[0]["timeouts"]["heartbeat"]
        assert hb["initial"] is None and hb["subsequent"] is None


def test_computed_timeouts_survive_a_requeue(tmp_path):
    out = tmp_path / "calc"
    timeouts = fast_timeouts(step=30, safety_factor=20)
    common = ["--step-time", "0.2", "--save-interval", "6", "--save-time", "0.3", "--calc-timeouts",
              "--min-iters", "5"]
    first = run_ft(out, ["--steps", "12", *common], timeouts, max_restarts=0)
    assert first.rc == 0, first.log[-4000:]
    saved = json.loads((out / "ckpt" / "ft_state.json").read_text())["current_timeouts"]["section"]
    assert set(saved["calculated_sections"]) == {"step", "checkpointing"}
    assert saved["is_out_of_section_calculated"]
    assert 20 * 0.2 <= saved["section"]["step"] <= 20 * 1.5
    assert saved["section"]["setup"] == 30.0  # not computed: this run loaded no checkpoint
    # the checkpoint of iteration 12 holds the timeouts of that moment (before shutdown merged in
    # the out-of-section timeout and the step timeout again, by EMA)
    in_ckpt = json.loads((out / "ckpt" / "meta.json").read_text())["fault_tolerance"]["current_timeouts"]
    assert "step" in in_ckpt["section"]["calculated_sections"]
    assert 20 * 0.2 <= in_ckpt["section"]["section"]["step"] <= 20 * 1.5

    # "requeue": a new launcher run (restart count 0) in the same folder, resuming at iteration 12
    second = run_ft(out, ["--steps", "16", *common], timeouts, max_restarts=0)
    assert second.rc == 0, second.log[-4000:]
    start = [s for s in second.starts(0) if s["iteration"] == 12][0]["timeouts"]
    assert start["section"]["step"] == pytest.approx(saved["section"]["step"])
    assert start["section"]["checkpointing"] == pytest.approx(saved["section"]["checkpointing"])
    assert start["out_of_section"] == pytest.approx(saved["out_of_section"])
    after = json.loads((out / "ckpt" / "ft_state.json").read_text())["current_timeouts"]["section"]
    assert "setup" in after["calculated_sections"]  # a run that loaded a checkpoint times its set-up
    # computed timeouts never go below the floor (the worker's --min-timeout, default 1 s)
    assert min(after["section"].values()) >= 1.0 and after["out_of_section"] >= 1.0


# -- straggler detection on CPU ---------------------------------------------------------------------


def test_steptime_individual_score_is_against_the_usual_step_not_the_luckiest():
    # one rank, steps timed by a scripted clock, a report every 4 steps: one lucky fast window must not
    # make every later window of a healthy rank look slow; one slow window alone (a spike) is only
    # suspected; a slow-down that lasts two reports is flagged
    from bridge_hpc.training.config import NVRxStragglerDetectionConfig
    from bridge_hpc.training.resilience.straggler import STEPTIME_CONFIRM_REPORTS, StragglerDetector

    assert STEPTIME_CONFIRM_REPORTS == 2
    det = StragglerDetector(NVRxStragglerDetectionConfig(enabled=True), backend="steptime", interval_steps=4)
    det.setup()
    window_means = [1.0, 1.05, 0.95, 0.5, 1.0, 2.0, 1.1, 1.0, 2.0, 2.0]
    ticks = iter([t for mean in window_means for _ in range(4) for t in (0.0, mean)])
    det._clock = lambda: next(ticks)
    flagged, suspected, scores = [], [], []
    for window in range(len(window_means)):
        for step in range(4):
            det.step_start()
            det.step_end()
            det.check(window * 4 + step)
        scores.append(det.last_report.gpu_individual_perf_scores[0])
        flagged.append(det.last_report.flagged_ranks)
        suspected.append(det.last_report.suspected_ranks)
    assert flagged == [[]] * 9 + [[0]], scores
    assert suspected == [[]] * 5 + [[0]] + [[]] * 2 + [[0], []], scores
    # 1.0 before 3 earlier reports; then median of the earlier windows / this window, at most 1.0:
    # window 4: median(1.0, 1.05, 0.95, 0.5) = 0.975; window 6: median of six = 1.0, / 1.1
    assert scores == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.975, 0.5, 1 / 1.1, 1.0, 0.5, 0.5])
    det.shutdown()


def test_steptime_flags_the_slow_rank_not_the_ranks_waiting_for_it():
    # rank 0's view of 2 ranks (the all_gather scripted): rank 1 becomes 4x slower; rank 0's own
    # steps look 1.5x slower too (its share of the waiting), below the individual threshold alone
    from bridge_hpc.training.config import NVRxStragglerDetectionConfig
    from bridge_hpc.training.resilience.straggler import StragglerDetector

    det = StragglerDetector(NVRxStragglerDetectionConfig(enabled=True), backend="steptime", interval_steps=1)
    det.setup()
    det._world = 2
    mine = [1.0, 1.0, 1.0, 1.5, 1.5]
    other_means, other_scores = iter([1.0, 1.0, 1.0, 4.0, 4.0]), iter([1.0, 1.0, 1.0, 0.25, 0.25])
    ticks = iter([t for mean in mine for t in (0.0, mean)])
    det._clock = lambda: next(ticks)
    gathered = []

    def all_gather(value):
        gathered.append(value)
        return [value, next(other_means) if len(gathered) % 2 else next(other_scores)]

    det._all_gather = all_gather
    for step in range(len(mine)):
        det.step_start()
        det.step_end()
        det.check(step)
        if step == 3:  # the first slow report: suspected, not flagged
            assert det.last_report.flagged_ranks == [] and det.last_report.suspected_ranks == [1]
    report = det.last_report
    assert report.gpu_individual_perf_scores == {0: pytest.approx(1 / 1.5), 1: 0.25}
    assert report.stragglers == {"straggler_gpus_relative": {1}, "straggler_gpus_individual": {1}}
    assert report.flagged_ranks == [1]
    det.shutdown()


def test_cpu_straggler_detector_flags_slow_rank(tmp_path):
    port = free_port()
    procs = []
    env = worker_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        for rank in (0, 1):
            procs.append(subprocess.Popen(
                [sys.executable, str(STRAGGLER_WORKER), "--out", str(tmp_path), "--steps", "40",
                 "--slow-rank", "1", "--slow-from", "15", "--interval", "5"],
                env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        logs = [p.communicate(timeout=50)[0] for p in procs]
    finally:
        for p in procs:
            _stop(p)
    assert all(p.returncode == 0 for p in procs), logs
    results = [json.loads((tmp_path / f"straggler_rank{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        reports = res["reports"]
        assert reports[0]["flagged_ranks"] == []  # before rank 1 slows down
        last = reports[-1]
        assert last["flagged_ranks"] == [1]
        assert last["stragglers"]["straggler_gpus_relative"] == [1]
        assert last["stragglers"]["straggler_gpus_individual"] == [1]
        assert last["gpu_relative_perf_scores"]["1"] < 0.7 and last["gpu_relative_perf_scores"]["0"] == 1.0
        assert last["backend"] == "steptime"
        assert [r["iteration"] for r in reports] == [4, 9, 14, 19, 24]
        assert [r["suspected_ranks"] for r in reports] == [[], [], [], [1], []]
    # stop_if_detected: both ranks stop at the same iteration, the second report after the slow-down
    # (the first suspects rank 1, the second confirms it)
    assert results[0]["stopped_at"] == results[1]["stopped_at"] == 24


# -- under Slurm: one launcher per node started by srun ---------------------------------------------


@pytest.mark.slurm
def test_launcher_under_srun_survives_usr1(slurm_cluster, tmp_path):
    """The batch-script shape the lead renders: srun (1 task per node) + ft_launcher (2 ranks), the
    rendezvous on the allocation's first node; Slurm's USR1 reaches the ranks and the launcher lives."""
    argv = ft_launch.srun_prefix(1, cpus_per_node=2) + ft_launcher_argv(
        [str(DATA / "ft_signal_worker.py"), str(tmp_path)], python=sys.executable, nnodes=1,
        nproc_per_node=2, rdzv_endpoint="${BRIDGE_RDZV_HOST}:${BRIDGE_RDZV_PORT}", rdzv_id="$SLURM_JOB_ID",
        max_restarts=2, timeouts=FTLaunchTimeouts(initial_heartbeat=100, heartbeat=100))
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=1 --ntasks-per-node=2 --time=5 --output={tmp_path}/job.out
export PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}}
endpoint=$({sys.executable} -c 'from bridge_hpc.launch.ft_launch import rdzv_endpoint_from_slurm as r; print(r())')
export BRIDGE_RDZV_HOST=${{endpoint%:*}} BRIDGE_RDZV_PORT=${{endpoint##*:}}
{shell_join(argv)}
echo "srun status $?"
""")
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                         check=True).stdout.strip().split(";")[0]
    try:
        deadline = time.time() + 45
        while time.time() < deadline and not all((tmp_path / f"ready_rank{r}").exists() for r in (0, 1)):
            time.sleep(0.2)
        assert all((tmp_path / f"ready_rank{r}").exists() for r in (0, 1)), (tmp_path / "job.out").read_text()
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        while time.time() < deadline and subprocess.run(["squeue", "-h", "-j", job], capture_output=True,
                                                        text=True).stdout.strip():
            time.sleep(0.3)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    out = (tmp_path / "job.out").read_text()
    assert "srun status 0" in out, out[-3000:]
    for rank in (0, 1):
        restart, when = (tmp_path / f"signal_rank{rank}.txt").read_text().split()
        assert restart == "0" and when != "none"
