"""The GPU benchmarks' verdicts (benchmarks/moe.py, benchmarks/te.py): a run under the profiler
(``--kernels``) carries the profiler's cost in every figure, so no target may be called held or missed
from it; unprofiled runs are judged against their targets."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    """benchmarks/<name>.py under a name of its own; the scripts put benchmarks/ on sys.path and import each
    other by plain names (``te``, ``loop_overhead``): both are undone after, so that no test session sees
    benchmarks/peft.py as ``peft``."""
    path, modules = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location(f"bridge_benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        for added in set(sys.modules) - modules:
            if str(getattr(sys.modules[added], "__file__", "") or "").startswith(str(BENCHMARKS)):
                del sys.modules[added]
    return module


moe = _load("moe")
te = _load("te")


def _run(row: str, tokens_per_s: float, shape: str = "") -> dict:
    return {"row": row, "shape": shape, "status": "ok", "tokens_per_s": tokens_per_s}


@pytest.mark.parametrize("profiled,holds", [(False, True), (True, None)])
def test_moe_verdict_is_withheld_for_profiled_runs(profiled, holds):
    result = {"runs": [_run("bridge-te", 5741.0), _run("bare-te", 4056.0)], "profiled": profiled}
    v = moe.verdict(result)
    assert v["row"] == "bridge-te" and v["figure"] == pytest.approx(5741 / 4056)
    assert v["holds"] is holds
    assert ("why" in v) is profiled


def test_moe_verdict_misses_below_the_target():
    v = moe.verdict({"runs": [_run("bridge-local", 22.6e3), _run("bare-local", 20.2e3)], "profiled": False})
    assert v["holds"] is False and v["figure"] == pytest.approx(22.6 / 20.2)


@pytest.mark.parametrize("profiled", [False, True])
def test_te_verdicts_are_withheld_for_profiled_runs(profiled):
    shape = next(iter(te.TARGET_TE))
    result = {"runs": [_run("bridge-te", 160e3, shape), _run("bare-te", 100e3, shape)], "shapes": {shape: {}},
              "profiled": profiled}
    (target,) = te.verdicts(result)["targets"]
    assert target["figure"] == pytest.approx(1.6)
    assert target["holds"] is (None if profiled else True)
