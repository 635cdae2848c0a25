"""nvidia-resiliency-ext paths that only exist with CUDA: the CUPTI straggler detector and in-process
restart. Skipped without a GPU (CI has none); run on the device machine:
``python -m pytest -q tests/test_gpu_resiliency.py``. The CPU counterparts are tested on the local cluster
(tests/test_straggler_slurm.py, tests/test_ft_slurm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bridge_test_helpers import direct_rank_env, free_port, losses

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WORKER = Path(__file__).resolve().parent / "data" / "gpu_resiliency_worker.py"


def run_worker(mode: str, out: Path, timeout: float = 300) -> dict:
    env = direct_rank_env()
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(out)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


def test_nvrx_straggler_backend_reports_kernel_scores(tmp_path):
    from bridge_hpc.training.resilience.straggler import nvrx_straggler_module

    if nvrx_straggler_module() is None:
        pytest.skip("the installed nvidia-resiliency-ext has no straggler module")
    result = run_worker("straggler", tmp_path)
    assert result["backend"] == "nvrx"
    assert result["reports"], result
    last = result["reports"][-1]
    assert last["backend"] == "nvrx" and "0" in last["gpu_individual_perf_scores"]
    assert 0 < last["gpu_individual_perf_scores"]["0"] <= 1.5
    print(f"nvrx straggler: {len(result['reports'])} reports in {result['steps']} steps; last {last}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nvrx_straggler_flags_the_rank_on_a_shared_gpu(tmp_path):
    """2 ranks, one GPU each; a second process keeps GPU 1 busy, so rank 1's kernels run slower. The
    first report must flag rank 1 (relative score) and both ranks must stop at the same iteration."""
    from bridge_hpc.training.resilience.straggler import nvrx_straggler_module

    if nvrx_straggler_module() is None:
        pytest.skip("the installed nvidia-resiliency-ext has no straggler module")
    port = free_port()
    base = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    hog = subprocess.Popen([sys.executable, str(WORKER), "gpu_hog", str(tmp_path / "hog")],
                           env=dict(base, LOCAL_RANK="1"), start_new_session=True)
    ranks = []
    try:
        (tmp_path / "hog").mkdir()
        deadline = time.time() + 120
        while not (tmp_path / "hog" / "hog_ready").exists():
            assert hog.poll() is None and time.time() < deadline, "the GPU hog did not start"
            time.sleep(0.2)
        for rank in (0, 1):
            ranks.append(subprocess.Popen([sys.executable, str(WORKER), "straggler_pair", str(tmp_path / f"r{rank}")],
                                          env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=240)[0] for p in ranks]
    finally:
        for p in ranks + [hog]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in ranks), logs
    results = [json.loads((tmp_path / f"r{rank}" / "result.json").read_text()) for rank in (0, 1)]
    assert results[0]["backend"] == results[1]["backend"] == "nvrx"
    assert results[0]["stopped_at"] is not None and results[0]["stopped_at"] == results[1]["stopped_at"]
    report = results[0]["reports"][-1]  # complete on rank 0 (nvrx gathers there)
    assert report["flagged_ranks"] == [1], report
    assert report["stragglers"]["straggler_gpus_relative"] == [1]
    assert report["gpu_relative_perf_scores"]["1"] < 0.7 <= report["gpu_relative_perf_scores"]["0"]
    print(f"nvrx straggler, GPU 1 shared with a busy process: {report}; stopped at {results[0]['stopped_at']}")


def test_inprocess_restart_resumes_in_the_same_process(tmp_path):
    from bridge_hpc.training.resilience.inprocess_restart import unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        pytest.skip(reason)
    reference = tmp_path / "reference"
    run_worker("reference", reference)
    faulty = tmp_path / "inprocess"
    result = run_worker("inprocess", faulty)
    assert result["faults"] == 1
    got, want = losses(faulty), losses(reference)
    assert sorted(got) == list(range(1, 21))
    assert (faulty / "checkpoints" / "iter_0000020").is_dir()
    from bridge_hpc.contracts.progress_log import parse_progress

    runs = parse_progress(str(faulty / "checkpoints" / "progress.txt"))
    assert len(runs) == 2 and int(runs[1].last("Loaded checkpoint").fields["Iteration"]) == 10
    assert [r.restart_count for r in runs] == [0, 1]
    restart = runs[0].last("Restart")  # charged to the failed attempt, as for ft_launcher's restarts
    assert restart is not None and restart.fields["Cause"] == "fault"
    assert 0 <= restart.number("Lost seconds") < 60
    same = [step for step in got if got[step] == want[step]]
    print(f"in-process restart: resumed at 10, finished 20; {len(same)}/20 losses bitwise equal to the reference")
    assert got == want
