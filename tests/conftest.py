"""Shared pytest fixtures: a REAL local Slurm cluster (see ``bridge_hpc/local_slurm/``).

Fixtures
--------
``slurm_cluster`` (session)
    A 1-node cluster (node named after ``hostname -s``), brought up if needed. Returns the
    :class:`bridge_hpc.local_slurm.cluster.LocalCluster`. ``sbatch``/``squeue``/``sacct``/``scontrol`` then just work.
``slurm_cluster_2nodes`` (module)
    The cluster reconfigured to nodes ``n1`` and ``n2`` (both this machine, 127.0.0.1) for the tests of
    one module; afterwards the node count it had before is restored.
``one_rank`` (function)
    torch.distributed's environment for a world of one, for tests that run ``pretrain`` in-process.
``slurm_cluster_nodes`` (function)
    A factory: ``cluster = slurm_cluster_nodes(3)``; the previous node count is restored after the test.

Mark tests that use them ``@pytest.mark.slurm``. Set ``BRIDGE_SKIP_SLURM=1`` to skip those tests on a
machine that cannot run Slurm (the fixtures otherwise install the Debian packages, as root).

Ownership: the cluster is stopped at the end of the session ONLY if this session started it and no
other live pytest session that uses it is registered (``<state_dir>/users/<pid>``). A cluster that was
already up is left up. Reconfiguring the node count restarts slurmctld/slurmd and cancels running jobs,
so avoid running 2-node tests while another session runs jobs on the 1-node cluster.

``release_requeued(job_id)`` (from ``bridge_hpc.local_slurm.cluster``) releases a requeued job at once instead of
Slurm's ~120 s BeginTime hold.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Callable, Optional

import pytest
from bridge_test_helpers import LAYERS_ENV, free_port

from bridge_hpc.contracts.requeue import REQUEUE_FILE_ENV
from bridge_hpc.local_slurm.cluster import LocalCluster

#: The fixtures that reach the local cluster: a test that asks for one is a Slurm test even unmarked.
SLURM_FIXTURES = frozenset({"slurm_cluster", "slurm_cluster_2nodes", "slurm_cluster_nodes", "_slurm_session"})
#: ``--layers``' choices: megatron-core's two layer implementations.
LAYERS = ("local", "transformer_engine")
#: Tests (a file, or file::test) that do not apply on Transformer Engine's layers with the tiny GPT, and why:
#: each needs the whole-step CUDA graph, which the loader refuses on TE's layers below hidden size 1024
#: (speed_defaults; the tiny GPT's is 64).
_NO_TE_GRAPH = ("the whole-step CUDA graph on Transformer Engine's layers is refused below hidden size 1024, and "
                "the tiny GPT's is 64")
NOT_ON_TE = {"test_gpu_cuda_graph.py": _NO_TE_GRAPH,
             "test_gpu_speed_defaults.py::test_the_default_path_trains_as_the_plain_path_within_bf16": _NO_TE_GRAPH,
             "test_gpu_speed_defaults.py::test_a_run_stopped_and_resumed_on_the_default_path_is_bit_exact": _NO_TE_GRAPH,
             "test_gpu_speed_defaults.py::test_a_forward_step_that_cannot_be_captured_falls_back_to_eager_once_and_exactly":
                 _NO_TE_GRAPH,
             "test_gpu_peft.py::test_adapters_train_on_the_default_path_as_on_the_plain_path": _NO_TE_GRAPH}
#: ``--part``'s choices: every test, the Slurm tests only, or every other test.
PARTS = ("all", "slurm", "rest")


def uses_slurm(item) -> bool:
    return "slurm" in item.keywords or bool(SLURM_FIXTURES & set(getattr(item, "fixturenames", ())))


def pytest_configure(config):
    """Ctrl-C as at a terminal: a shell without job control starts a background command (``make test &``
    from a script) with SIGINT ignored, and the ignore is inherited by every process the tests start, so
    no tool there could be interrupted (Python keeps an inherited SIG_IGN). The tests of Ctrl-C need the
    default: Python's KeyboardInterrupt here, and SIGINT's default action in the tools they start."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if config.getoption("layers"):
        os.environ[LAYERS_ENV] = config.getoption("layers")


def pytest_addoption(parser):
    parser.addoption("--part", choices=PARTS, default="all",
                     help="run only the Slurm tests, or only the others (scripts/run_tests.py runs both at once)")
    parser.addoption("--layers", choices=LAYERS, default=None,
                     help="GPU tests: every rank a test starts builds these layers (model.transformer_impl) unless "
                          "the test names its own (tests/bridge_test_helpers.py's with_test_layers)")


def pytest_collection_modifyitems(config, items):
    """Skip the Slurm tests under ``BRIDGE_SKIP_SLURM``; keep only ``--part``'s tests.

    ``make test`` runs two parts side by side (``scripts/run_tests.py``): the Slurm tests in one pytest, in
    order, since they share one cluster of 2 CPUs (a job of 2 ranks fills it), reconfigure its node count
    (which cancels running jobs) and read its queue; about half of their time the cores idle while they wait
    for Slurm (time limits, signals, requeues), which the other pytest fills with the rest.
    """
    part = config.getoption("part")
    slurm = {id(item) for item in items if uses_slurm(item)}
    if part != "all":
        keep = [item for item in items if (id(item) in slurm) == (part == "slurm")]
        config.hook.pytest_deselected(items=[item for item in items if (id(item) in slurm) != (part == "slurm")])
        items[:] = keep
    if config.getoption("layers") == "transformer_engine":
        for item in items:
            why = NOT_ON_TE.get(item.path.name) or NOT_ON_TE.get(f"{item.path.name}::{item.originalname}")
            if why:
                item.add_marker(pytest.mark.skip(reason=why))
    if os.environ.get("BRIDGE_SKIP_SLURM") not in (None, "", "0"):
        skip = pytest.mark.skip(reason="BRIDGE_SKIP_SLURM is set")
        for item in items:
            if id(item) in slurm:
                item.add_marker(skip)


class _SessionCluster:
    """Brings the shared cluster up on first use and remembers whether this session started it."""

    def __init__(self) -> None:
        self.cluster = LocalCluster()
        self.started_here = False
        self._registered: Optional[Path] = None

    def nodes_now(self) -> Optional[int]:
        """The node count of the running cluster, or None when it is down."""
        return self.cluster.configured_nodes() if self.cluster.is_up() else None

    def ensure(self, nodes: int) -> LocalCluster:
        self._register()
        if not self.cluster.is_up(nodes):
            was_down = self.nodes_now() is None
            self.cluster.up(nodes)
            self.started_here = self.started_here or was_down
        return self.cluster

    def _register(self) -> None:
        if self._registered is None:
            users = self.cluster.state_dir / "users"
            users.mkdir(parents=True, exist_ok=True)
            self._registered = users / str(os.getpid())
            self._registered.touch()

    def finish(self) -> None:
        if self._registered is None:
            return
        self._registered.unlink(missing_ok=True)
        others = [p for p in self._registered.parent.iterdir() if p.name.isdigit() and _pid_runs(int(p.name))]
        if self.started_here and not others:
            self.cluster.down()


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="session")
def _slurm_session():
    session = _SessionCluster()
    yield session
    session.finish()


@pytest.fixture(scope="session")
def slurm_cluster(_slurm_session) -> LocalCluster:
    """The local 1-node Slurm cluster (started if needed)."""
    return _slurm_session.ensure(1)


def _restore(session: _SessionCluster, before: Optional[int]) -> None:
    if before is not None and session.nodes_now() != before:
        session.cluster.up(before)


@pytest.fixture(scope="module")
def slurm_cluster_2nodes(_slurm_session):
    """The local cluster with 2 nodes (n1, n2) for this module; the previous node count comes back after."""
    before = _slurm_session.nodes_now()
    yield _slurm_session.ensure(2)
    _restore(_slurm_session, before)


@pytest.fixture
def slurm_cluster_nodes(_slurm_session) -> Callable[[int], LocalCluster]:
    """Factory: ``slurm_cluster_nodes(n)`` (re)configures the local cluster for n nodes."""
    before = _slurm_session.nodes_now()

    def make(nodes: int) -> LocalCluster:
        return _slurm_session.ensure(nodes)

    yield make
    _restore(_slurm_session, before)


@pytest.fixture
def one_rank(monkeypatch, tmp_path):
    """torch.distributed's environment for a world of one (pretrain brings the group up), a requeue
    request file, and the process group torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(REQUEUE_FILE_ENV, str(tmp_path / "requeue.json"))
    yield tmp_path / "requeue.json"
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 2600 KiB tmpfs: the first checkpoint of the tiny model (about 1.6 MB) fits, a second does not.
    Skips where a tmpfs cannot be mounted (it needs root); unmounted afterwards."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
