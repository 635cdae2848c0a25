"""A logging backend that never answers (issue 36, item 10): an MLflow server that accepts connections
and never replies was one warning at the end of the run, saying the last steps "may be missing" when none
had been logged. Now it is said while the run goes on, and the last warning says what was logged.

In-process, as the logging rank runs :class:`LogBackends`; the server is a socket that accepts and never
answers. The early warning is waited for as an event (the test shortens the patience, a module constant).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from bridge_test_helpers import TINY

from bridge_hpc.training.utils import log_backends as lb

pytest.importorskip("mlflow")

#: How long a test waits for a warning that must come (the backend thread imports mlflow first).
WAIT_S = 120


def _config(tmp_path, extra):
    from bridge_hpc.rank import build_config

    return build_config(str(TINY), [f"job.run_dir={tmp_path / 'run'}"] + extra)


def _wait_for(caplog, words):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = [r.getMessage() for r in caplog.records if words in r.getMessage()]
        if found:
            return found
        time.sleep(0.05)
    pytest.fail(f"no warning with {words!r} in {WAIT_S} s: {[r.getMessage() for r in caplog.records]}")


@pytest.fixture
def silent_server():
    """``http://127.0.0.1:PORT`` of a server that accepts every connection and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


def test_a_silent_mlflow_server_is_warned_early_and_the_end_says_nothing_was_logged(tmp_path, caplog, monkeypatch,
                                                                                     silent_server):
    monkeypatch.setattr(lb, "START_PATIENCE_S", 0.5)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")  # silent for the whole test, as the server
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = _config(tmp_path, ['logger.mlflow_experiment="bridge-test"', 'logger.mlflow_run_name="tiny"',
                               f'logger.mlflow_tracking_uri="{silent_server}"'])
    backends = lb.LogBackends(cfg)
    with caplog.at_level(logging.WARNING, logger="bridge_hpc"):
        backends.open(0, 0)
        for step in range(1, 21):
            backends.add(step, {"lm loss": 1.0})
            if step % 10 == 0:
                backends.commit(step)
        early, = _wait_for(caplog, "has not answered")  # while the run goes on, before the close
        assert silent_server in early and "nothing of this run is logged to it yet" in early, early
        backends.close(timeout=1.0)
    last = [r.getMessage() for r in caplog.records if "did not close" in r.getMessage()]
    assert last == [f"MLflow did not close within 1 s: its run never started (no answer at {silent_server}): no step "
                    "of this run was logged to it"], last
    assert not any("may be missing" in r.getMessage() for r in caplog.records)


def test_a_backend_that_stalls_after_logging_says_which_steps_it_has(tmp_path, caplog, monkeypatch):
    """Started, took steps 1-10, then stalled on 11-20: the close says exactly that. The close waits
    until the sender is inside the stalled send (its thread sends in order, so 1-10 are done): on a
    loaded machine the thread may not have sent anything within the close's second."""
    release, stalled = threading.Event(), threading.Event()

    class Stalling(lb._Backend):
        name = "wandb"

        def start(self):
            return {"id": "x"}

        def send(self, records):
            if records[0][0] > 10:
                stalled.set()
                release.wait()

        def finish(self):
            pass

    monkeypatch.setitem(lb._CLASSES, "wandb", Stalling)
    backends = lb.LogBackends(_config(tmp_path, ['logger.wandb_project="p"']))
    try:
        with caplog.at_level(logging.WARNING, logger="bridge_hpc"):
            backends.open(0, 0)
            for step in range(1, 21):
                backends.add(step, {"lm loss": 1.0})
                if step % 10 == 0:
                    backends.commit(step)
            assert stalled.wait(120), "the sender never reached steps 11-20"
            backends.close(timeout=1.0)
    finally:
        release.set()
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert messages == ["W&B did not close within 1 s: steps through 10 of this run were logged to it, steps 11 to "
                        "20 were not"], messages


def test_a_backend_left_behind_by_the_close_says_nothing_more(tmp_path, caplog, monkeypatch):
    """A start that fails after the close gave up on it (the silent server of the test above dropping its
    connections later): the close's warning stays the last word on it; its failure is not logged, in
    this run's log or in whatever the process does next."""
    release = threading.Event()

    class LateFailure(lb._Backend):
        name = "wandb"

        def start(self):
            release.wait()
            raise ConnectionError("the server went away")

        def send(self, records):
            pass

        def finish(self):
            pass

    monkeypatch.setitem(lb._CLASSES, "wandb", LateFailure)
    backends = lb.LogBackends(_config(tmp_path, ['logger.wandb_project="p"']))
    with caplog.at_level(logging.WARNING, logger="bridge_hpc"):
        backends.open(0, 0)
        thread = backends._threads["wandb"]
        backends.close(timeout=0.5)
        release.set()
        thread.join(120)  # the thread has done all it would do after its start failed
        assert not thread.is_alive()
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [m for m in messages if "did not close" in m] == [messages[-1]] and len(messages) == 1, messages
