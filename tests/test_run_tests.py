"""``make test``'s runner (``scripts/run_tests.py``): the Slurm tests and the rest as two pytest runs side by
side, each test in exactly one of them, and an exit status that hides no failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from run_tests import NO_TESTS_COLLECTED, ProgressCount, overall_status  # noqa: E402

#: a Slurm test (marked, and asking for the cluster) and two others, selected by name
SELECTION = ["tests/test_cluster.py", "tests/test_job_environment.py", "-k",
             "status_reports_live_daemons or check_managed_refuses or set_master_port_is_kept"]


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/run_tests.py", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, **env})


def test_the_status_is_the_first_failure_and_an_empty_part_passes_beside_one_that_ran():
    assert overall_status([0, 0]) == 0
    assert overall_status([0, NO_TESTS_COLLECTED]) == 0
    assert overall_status([NO_TESTS_COLLECTED, 1]) == 1
    assert overall_status([2, 1]) == 2
    assert overall_status([NO_TESTS_COLLECTED, NO_TESTS_COLLECTED]) == NO_TESTS_COLLECTED


def test_each_test_runs_in_exactly_one_part():
    done = _run("-v", *SELECTION, BRIDGE_SKIP_SLURM="1")
    assert done.returncode == 0, done.stdout[-3000:]
    lines = done.stdout.splitlines()
    slurm = [line for line in lines if line.startswith("[slurm]") and "::" in line]
    rest = [line for line in lines if line.startswith("[rest]") and "::" in line]
    assert len(slurm) == 1 and "test_status_reports_live_daemons SKIPPED" in slurm[0], slurm
    assert len(rest) == 2 and all("PASSED" in line for line in rest), rest
    assert {"test_check_managed_refuses_foreign_file", "test_a_set_master_port_is_kept"} == {
        line.split("::")[1].split()[0] for line in rest}
    assert "run_tests: exit status 0" in done.stdout


def test_a_run_that_cannot_start_fails_with_pytests_status():
    bad = _run("tests/test_job_environment.py::test_no_such_test", BRIDGE_SKIP_SLURM="1")
    assert bad.returncode == 4, bad.stdout[-2000:]  # pytest's usage error, from both parts
    assert "run_tests: exit status 4" in bad.stdout


def test_the_progress_count_reads_results_at_line_starts_until_the_summary():
    count = ProgressCount()
    for piece in ["..F", ".s [ 6%]\n", "....E", "x [ 12%]\n", "collected 3 items. F\n",
                  "=== short test summary info ===\n", "FAILED tests/test_a.py::test_b\n", "...\n"]:
        count.feed(piece)
    assert (count.finished, count.failed) == (11, 2)  # not the "F" after words, nothing after the summary


def test_each_parts_failures_are_named_again_at_the_end(tmp_path):
    """A CI log shows its last lines only: the failed tests of both parts are among them."""
    (tmp_path / "conftest.py").write_text(
        "def pytest_addoption(parser):\n    parser.addoption('--part')\n\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    items[:] = [i for i in items if config.getoption('--part') in i.name]\n")
    (tmp_path / "test_parts.py").write_text(
        "def test_slurm_fails():\n    assert False\n\n"
        "def test_rest_fails():\n    assert False\n\n"
        "def test_rest_passes():\n    pass\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_tests.py"), "-q", "-p", "no:cacheprovider",
                           "test_parts.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})
    assert done.returncode == 1, done.stdout[-2000:]
    tail = done.stdout.splitlines()[-5:]
    assert tail[0] == "run_tests: slurm part: FAILED test_parts.py::test_slurm_fails - assert False", tail
    assert tail[1] == "run_tests: rest part: FAILED test_parts.py::test_rest_fails - assert False", tail
    assert tail[2].startswith("run_tests: slurm part exit status 1"), tail
