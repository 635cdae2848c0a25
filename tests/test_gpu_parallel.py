"""Model parallelism on 2 GPUs (skipped with fewer): benchmarks/parallel.py's runs on a small GPT.

TP2 and PP2 train from the same weights as DP2 and follow its loss curve; SIGUSR1 under TP2, then
resume: losses bitwise equal to the uninterrupted TP2 run; the TP2 checkpoint (weights and
distributed-optimizer state, fully reshardable) resumes at TP1 x DP2 and follows TP2's curve. The
~1.3 B figures come from the same script without ``--tiny`` (README, performance section).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")


def test_tp2_and_pp2_follow_dp2_resume_exactly_and_a_tp2_checkpoint_loads_at_dp2(tmp_path):
    out = tmp_path / "parallel.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parallel.py"), "--tiny", "--steps", "12",
                           "--warmup", "2", "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    tolerance = r["loss_tolerance"]
    for name in ("tp2", "pp2"):
        assert r["runs"][name]["loss_vs_dp"]["max_rel_diff"] <= tolerance, r["runs"][name]
    resume = r["tp2_usr1_resume"]
    assert 1 <= resume["stopped_at"] < 12 and resume["bitwise_equal"], resume
    cross = r["tp2_checkpoint_at_dp2"]
    assert cross["loaded_iteration"] == resume["stopped_at"] and cross["max_rel_diff"] <= tolerance, cross
    for run in r["runs"].values():
        assert run["tokens_per_s"] > 0 and run["peak_gb_per_gpu"] and 0 < run["mfu"] < 1
