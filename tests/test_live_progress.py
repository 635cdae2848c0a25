"""Live progress: ``bridge-status RUN_DIR --follow`` and ``bridge-submit --wait``.

In a real terminal (tmux, on a private socket) the status is one screen redrawn in place and the
submit's wait is one progress-bar line; through a pipe both print plain lines without control codes.
The Slurm test runs the demo config on the local cluster; the others check the pieces on their own.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bridge_test_helpers import CONFIG, FAULTY_FORWARD_STEP, ROOT, overrides, wait_until_gone

from bridge_hpc.report.live import (
    LiveDisplay,
    LiveStatus,
    MetricsTail,
    bar_line,
    format_duration,
    format_rate,
    screen_lines,
)

CONTROL = re.compile(r"[\x1b\r]")
#: Steps of the Slurm test's run: the demo model takes ~40 ms a step, so this runs for ~40 s.
STEPS = 1000
#: the step the job waits at until the test lets it go on (TEST_HOLD of tests/data/faulty_forward_step.py)
HOLD_AT = 400


def status(step, state="RUNNING", restarts=0, loss=2.5):
    return LiveStatus(job_id="42", state=state, restarts=restarts, step=step, train_iters=200, loss=loss,
                      tokens_per_s=12345.0, eta_s=95.0, allocation_left_s=3725.0)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_units_fit_the_values():
    assert [format_duration(s) for s in (None, 4.4, 125, 3 * 3600 + 7 * 60, 2 * 86400 + 4 * 3600)] == \
        ["-", "4s", "2m 05s", "3h 07m", "2d 04h"]
    assert [format_rate(r) for r in (None, 850, 12345, 1.25e6)] == ["-", "850", "12.3k", "1.25M"]


def test_screen_and_bar_show_state_step_loss_rate_eta_and_allocation():
    text = "\n".join(screen_lines(status(50, restarts=1), Path("runs/x")))
    for phrase in ("RUNNING", "restarts         1", "50/200", "25.0 %", "2.5000", "12.3k", "1m 35s", "1h 02m"):
        assert phrase in text, (phrase, text)
    line = bar_line(status(50), 120)
    drawn = re.match(r"\[(#*)(-*)\]", line)
    assert drawn and len(line) <= 120, line
    assert len(drawn.group(1)) == round(0.25 * (len(drawn.group(1)) + len(drawn.group(2)))), line  # 50 of 200
    assert "50/200" in line and "ETA 1m 35s" in line and "alloc left 1h 02m" in line
    assert len(bar_line(status(50), 40)) <= 40  # a narrow terminal drops the bar, not the figures' start


def test_plain_output_has_no_control_codes_and_prints_on_state_changes_and_at_most_every_interval():
    out = io.StringIO()
    display = LiveDisplay(Path("runs/x"), "screen", stream=out, interval=3600)
    display.show(status(None, state="PENDING", loss=None))
    display.show(status(1))        # state changed: printed
    display.show(status(2))        # only the step moved, within the interval: not printed
    display.show(status(2, state="PENDING"))  # requeued: printed
    display.show(status(200, state="COMPLETED"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert not CONTROL.search(out.getvalue())
    assert ["PENDING" in lines[0], "step 1/200" in lines[1], "PENDING" in lines[2], "COMPLETED" in lines[3]] == [True] * 4


def test_a_terminal_gets_the_screen_redrawn_over_itself():
    out = _Terminal()
    display = LiveDisplay(Path("runs/x"), "screen", stream=out)
    display.show(status(1))
    first = out.getvalue()
    display.show(status(2))
    second = out.getvalue()[len(first):]
    n = len(screen_lines(status(1), Path("runs/x")))
    assert not first.startswith("\x1b[") or first.startswith("\x1b[K")  # nothing to go back over yet
    assert second.startswith(f"\x1b[{n}F") and second.count("\n") == n  # back to the top, same lines again


def test_metrics_tail_follows_appends_a_torn_line_and_a_resume_rewrite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    tail.poll()  # no file yet
    assert not tail.records
    with open(path, "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "loss": float(step)}) + "\n")
        f.write('{"step": 6, "lo')  # rank 0 is mid-write
    tail.poll()
    assert [r["step"] for r in tail.records] == [1, 2, 3, 4, 5]
    with open(path, "a") as f:
        f.write('ss": 6.0}\n')
    tail.poll()
    assert tail.records[-1] == {"step": 6, "loss": 6.0}
    # a resume from step 3 rewrites the file (os.replace) without the lost steps, then goes on
    tmp = tmp_path / "metrics.tmp"
    tmp.write_text("".join(json.dumps({"step": s, "loss": -float(s)}) + "\n" for s in (1, 2, 3, 4)))
    os.replace(tmp, path)
    tail.poll()
    assert [(r["step"], r["loss"]) for r in tail.records] == [(1, -1.0), (2, -2.0), (3, -3.0), (4, -4.0)]


# ---------------------------------------------------------------------------------------------
# On the local cluster, in a real terminal and through a pipe
# ---------------------------------------------------------------------------------------------


class Tmux:
    """A tmux server of our own (a socket in the test's folder), so that stopping it stops nothing else."""

    def __init__(self, folder: Path):
        self.socket = str(folder / "tmux.sock")

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def start(self, name: str, command: str) -> None:
        # the pane stays after the command ends, so its last screen can still be read
        self("new-session", "-d", "-s", name, "-x", "110", "-y", "30", command + "; sleep 600")

    def screen(self, name: str) -> str:
        return self("capture-pane", "-p", "-t", name)

    def stop(self) -> None:
        pid = subprocess.run(["tmux", "-S", self.socket, "display-message", "-p", "#{pid}"], capture_output=True,
                             text=True).stdout.strip()
        if pid.isdigit():
            os.kill(int(pid), 15)


def wait_for_screen(tmux: Tmux, name: str, predicate, timeout: float, what: str) -> str:
    deadline = time.time() + timeout
    screen = ""
    while time.time() < deadline:
        screen = tmux.screen(name)
        if predicate(screen):
            return screen
        time.sleep(0.3)
    raise AssertionError(f"{what} within {timeout} s; the screen:\n{screen}")


def shown_step(screen: str) -> int:
    found = re.search(rf"\b(\d+)/{STEPS}\b", screen)
    return int(found.group(1)) if found else -1


@pytest.mark.slurm
@pytest.mark.skipif(subprocess.run(["which", "tmux"], capture_output=True).returncode != 0, reason="needs tmux")
def test_follow_redraws_one_screen_in_a_terminal_and_prints_plain_lines_through_a_pipe(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    tmux = Tmux(tmp_path)
    submit_args = [sys.executable, "-m", "bridge_hpc.cli.submit", str(CONFIG), "--wait"]
    # the ranks wait at step HOLD_AT until the test has seen the status screen with a step: a job that
    # cannot end before bridge-status is up, however loaded the machine
    gate = tmp_path / "go"
    for item in overrides(run_dir, STEPS, [f"checkpoint.save_interval={STEPS // 2}",
                                           f"job.forward_step='{FAULTY_FORWARD_STEP}:forward_step'",
                                           f"env.TEST_HOLD='{HOLD_AT}:{gate}'"]):
        submit_args += ["--set", item]
    env = f"cd {shlex.quote(str(ROOT))} && COLUMNS=110"
    piped = None
    job_id = None
    try:
        # bridge-submit --wait in a terminal: a progress bar on one line, redrawn
        tmux.start("submit", f"{env} {shlex.join(submit_args)}")
        first = wait_for_screen(tmux, "submit", lambda s: "Submitted job" in s, 120, "the job to be submitted")
        job_id = re.search(r"Submitted job (\d+)", first).group(1)
        bar_screen = wait_for_screen(tmux, "submit", lambda s: 0 < shown_step(s) < STEPS and "tok/s" in s, 240,
                                     "a progress bar with the step")
        bar_lines = [line for line in bar_screen.splitlines() if "tok/s" in line]
        assert len(bar_lines) == 1 and re.match(r"\[[#-]+\] +\d+/%d " % STEPS, bar_lines[0]), bar_screen

        # bridge-status --follow in a terminal: one screen, updated in place
        status_cmd = shlex.join([sys.executable, "-m", "bridge_hpc.cli.status", str(run_dir), "--follow"])
        tmux.start("status", f"{env} {status_cmd}")
        piped = subprocess.Popen(shlex.split(status_cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=ROOT)
        screen1 = wait_for_screen(tmux, "status", lambda s: 0 < shown_step(s) < STEPS and "ETA" in s, 120,
                                  "the status screen with a step")
        gate.touch()
        screen2 = wait_for_screen(tmux, "status", lambda s: shown_step(s) > shown_step(screen1), 120,
                                  "the step on the status screen to move")
        for screen in (screen1, screen2):
            assert screen.count("bridge-status") == 1 and screen.count("ETA") == 1, screen  # redrawn, not scrolled
            assert re.search(r"loss\s+\d+\.\d{4}", screen) and re.search(r"ETA\s+\d+[smh]", screen), screen
            assert re.search(r"tokens/s\s+[\d.]+k?", screen) and "RUNNING" in screen, screen
        final = wait_for_screen(tmux, "status", lambda s: "ended: COMPLETED" in s, 300, "the job to complete")
        assert final.count("bridge-status") == 1 and f"{STEPS}/{STEPS}" in final, final
        done = wait_for_screen(tmux, "submit", lambda s: "ended: COMPLETED" in s, 60, "bridge-submit --wait to end")
        assert len([line for line in done.splitlines() if "tok/s" in line]) == 1, done

        out, err = piped.communicate(timeout=120)
        assert piped.returncode == 0, err
        assert not CONTROL.search(out), repr(out[:500])
        lines = [line for line in out.splitlines() if f"job {job_id} " in line and " step " in line]
        assert any("RUNNING" in line for line in lines) and f"step {STEPS}/{STEPS}" in lines[-1], out
        assert out.rstrip().endswith(f"job {job_id} ended: COMPLETED"), out
    finally:
        if piped is not None and piped.poll() is None:
            piped.kill()
        tmux.stop()
        if job_id:
            subprocess.run(["scancel", job_id], capture_output=True)
            wait_until_gone([job_id])
