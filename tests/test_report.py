"""Progress log writer/parser and bridge-report: throughput arithmetic, goodput, lost steps, CLI."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bridge_test_helpers import Clock

from bridge_hpc.cli.report import main
from bridge_hpc.contracts.progress_log import ProgressLog, parse_progress, parse_time
from bridge_hpc.report.goodput import build_report
from bridge_hpc.report.table import COLUMNS

DATA = Path(__file__).parent / "data" / "progress"
MEGATRON = DATA / "megatron_lm.txt"
BRIDGE = DATA / "bridge_three_runs.txt"
REPO = Path(__file__).resolve().parents[1]
FLOPS_PER_STEP = 8e15  # 8 GPUs


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """The log's stamps are local time; pin the zone so fixtures and the writer agree byte for byte."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def write_three_runs(path):
    """Job 100 on 8 GPUs, requeued twice: preempted (signal), time limit, done. 10 s per step, 50 s
    per save, 20 s per load, 10 s from process start to the Starting job line."""
    t0 = parse_time("2026-03-02 08:00:00")
    c = Clock(t0)

    log = ProgressLog(path, "100", 8, clock=c)
    log.starting_job(restart_count=0, startup_s=10)
    c.at(t0 + 50); log.first_step(1)
    c.at(t0 + 1090); r1a = log.saved_checkpoint(100, 100 * FLOPS_PER_STEP, 100 * 4096 * 1024, save_s=50)
    c.at(t0 + 2140); r1b = log.saved_checkpoint(200, 200 * FLOPS_PER_STEP, 200 * 4096 * 1024, save_s=50)
    c.at(t0 + 2640); log.ending_job("signal", iteration=250, steps_lost=50)

    t1 = t0 + 4000
    log = ProgressLog(path, "100", 8, clock=c.at(t1))  # a requeued job: new process, file read again
    log.starting_job(restart_count=1, startup_s=10)
    c.at(t1 + 20); log.loaded_checkpoint(200, load_s=20, flops_so_far=200 * FLOPS_PER_STEP)
    c.at(t1 + 50); log.first_step(201)
    c.at(t1 + 1090); r2 = log.saved_checkpoint(300, 300 * FLOPS_PER_STEP, 300 * 4096 * 1024, save_s=50)
    c.at(t1 + 1590); log.ending_job("time_limit", iteration=350, steps_lost=50)

    t2 = t0 + 7000
    log = ProgressLog(path, "100", 8, clock=c.at(t2))
    log.starting_job(restart_count=2, startup_s=10)
    c.at(t2 + 20); log.loaded_checkpoint(300, load_s=20, flops_so_far=300 * FLOPS_PER_STEP)
    c.at(t2 + 50); log.first_step(301)
    c.at(t2 + 1090); r3 = log.saved_checkpoint(400, 400 * FLOPS_PER_STEP, 400 * 4096 * 1024, save_s=50)
    c.at(t2 + 1100); log.ending_job("done", iteration=400, steps_lost=0)
    return [r1a, r1b, r2, r3]


@pytest.fixture
def bridge_log(tmp_path):
    path = tmp_path / "checkpoints" / "progress.txt"
    write_three_runs(str(path))
    return path


def test_writer_throughput_by_hand(tmp_path):
    returned = write_three_runs(str(tmp_path / "p.txt"))
    # job: FLOPs since this job's start / (s since process start x 1e12 x 8)
    # cumulative: FLOPs since the first Starting job (t0, 0 FLOPs) / (s since t0 x 1e12 x 8)
    expected = [
        (8e17 / (1100 * 8e12), 8e17 / (1090 * 8e12)),
        (1.6e18 / (2150 * 8e12), 1.6e18 / (2140 * 8e12)),
        (8e17 / (1100 * 8e12), 2.4e18 / (5090 * 8e12)),
        (8e17 / (1100 * 8e12), 3.2e18 / (8090 * 8e12)),
    ]
    assert [x for pair in returned for x in pair] == pytest.approx([x for pair in expected for x in pair])
    saves = [r.of("Saved checkpoint")[-1] for r in parse_progress(str(tmp_path / "p.txt"))]
    assert [s.fields["Cumulative throughput"] for s in saves] == [
        "93.5 TFLOP/s/GPU", "58.9 TFLOP/s/GPU", "49.4 TFLOP/s/GPU"]
    assert [s.fields["Job throughput"] for s in saves] == ["93.0 TFLOP/s/GPU", "90.9 TFLOP/s/GPU", "90.9 TFLOP/s/GPU"]
    assert saves[-1].fields["Floating-point operations"] == "3.20e+18"
    assert saves[-1].fields["Tokens (in billions)"] == "1.68"  # 400 x 4096 x 1024 / 1e9


def test_writer_output_is_the_fixture_and_megatron_readable(bridge_log):
    text = bridge_log.read_text()
    assert text == BRIDGE.read_text()  # format drift would break users' parsers: update deliberately
    # Megatron's own reader indexes tokens by position: FLOPs are token 7 of a Saved checkpoint line.
    for line in text.splitlines():
        tokens = line.split("\t")
        assert int(tokens[2].split(": ")[1]) == 8
        if tokens[3] == "Saved checkpoint":
            assert tokens[4].startswith("Iteration: ") and tokens[7].startswith("Floating-point operations: ")
            assert tokens[-1].startswith("Save seconds: ")


@pytest.mark.parametrize("world, base_time, base_flops", [
    # same world size as the last lines: first 16-GPU Starting job (16:00) and the last Saved
    # checkpoint before it; 8-GPU lines before that do not count
    (16, "2026-03-01 16:00:00", 1.30e19),
    # a new world size: this Starting job line is the baseline, with the last *Saved* checkpoint
    # (2.16e19 at 17:00) — the later async line (2.38e19) is not known to be durable, as in Megatron
    (32, "2026-03-01 18:00:00", 2.16e19),
    # back to 8 GPUs: the 16-GPU lines restarted the search, so the 8-GPU jobs of 10:00 do not count
    (8, "2026-03-01 18:00:00", 2.16e19),
])
def test_writer_appends_to_megatron_log(tmp_path, world, base_time, base_flops):
    path = tmp_path / "progress.txt"
    path.write_text(MEGATRON.read_text())  # ends with a truncated line
    clock = Clock(parse_time("2026-03-01 18:00:00"))
    log = ProgressLog(str(path), "5004", world, clock=clock)
    log.starting_job(restart_count=0)
    clock.at(parse_time(base_time) + 7200)
    _, cum = log.saved_checkpoint(6000, base_flops + 7200 * world * 1e12 * 100, 0)
    assert cum == pytest.approx(100.0)
    lines = path.read_text().split("\n")
    assert lines[-4] == "2026-03-01 17:10:00\tJob ID: 5003\t# GPUs: 16\tSaved checkpoint\tIteration: 60"
    assert lines[-3] == f"2026-03-01 18:00:00\tJob ID: 5004\t# GPUs: {world}\tStarting job\tRestart count: 0"
    runs = parse_progress(str(path))
    assert [(r.job_id, r.world_size) for r in runs][-2:] == [("5003", 16), ("5004", world)]


def test_megatron_log_report():
    runs = parse_progress(str(MEGATRON))
    assert [(r.job_id, r.world_size, r.restart_count) for r in runs] == [
        ("5001", 8, None), ("5002", 8, None), ("5003", 16, None)]
    assert runs[2].last("Something new").fields == {"Foo": "bar"}
    report = build_report(runs)
    rows = report.rows
    assert [r.steps for r in rows] == [2000, 1000, 2500]
    assert [r.first_iteration for r in rows] == [0, 2000, 3000]
    assert [r.job_throughput for r in rows] == [150.0, 150.0, 121.0]
    assert [r.saves for r in rows] == [2, 1, 3]
    assert all(r.reason is None and r.lost_steps is None and r.startup_s is None and r.loads is None for r in rows)
    # steps from saves only: run 1 3600 s/1000, run 3 2100 s/1500; run 2 has one save -> pooled
    assert [r.step_s for r in rows] == pytest.approx([3.6, (3600 + 2100) / 2500, 1.4])
    t = report.totals
    assert t["cumulative_throughput"] == 121.0
    assert t["allocated_s"] == 7200 + 3600 + 3900
    assert t["between_allocations_s"] == 7200 + 3600
    assert t["complete"] is False


def test_megatron_table_shows_unknowns(capsys):
    assert main([str(MEGATRON)]) == 0
    out = capsys.readouterr().out
    first = re.split(r"\s{2,}", out.splitlines()[1])
    # Megatron's log says "# GPUs" and nothing of the kind: gpu, kind unknown
    assert first[:3] == ["5001", "?", "8 gpu"] and first[5] == "?"
    assert "upper bound" in out


def test_bridge_goodput_and_lost_steps(bridge_log):
    report = build_report(parse_progress(str(bridge_log)))
    rows = report.rows
    assert [(r.restart, r.reason) for r in rows] == [(0, "signal"), (1, "time_limit"), (2, "done")]
    assert [r.steps for r in rows] == [250, 150, 100]
    assert [r.step_s for r in rows] == pytest.approx([10.0, 10.0, 10.0])
    assert [r.lost_steps for r in rows] == [50, 50, 0]
    assert [r.lost_s for r in rows] == pytest.approx([500, 500, 0])
    assert [r.startup_s for r in rows] == pytest.approx([60, 40, 40])  # load (20 s) counted apart
    assert [(r.loads, r.load_s) for r in rows] == [(0, 0.0), (1, 20.0), (1, 20.0)]
    assert [(r.saves, r.save_s) for r in rows] == [(2, 100.0), (1, 50.0), (1, 50.0)]
    assert [r.duration_s for r in rows] == pytest.approx([2650, 1600, 1110])
    t = report.totals
    assert t["allocated_s"] == pytest.approx(5360)
    assert t["training_s"] == pytest.approx(1990 + 990 + 1000)
    assert t["goodput"] == pytest.approx(3980 / 5360)
    assert t["lost_s"] == pytest.approx({"start-up": 140, "checkpoint save": 200, "checkpoint load": 40,
                                         "lost work": 1000, "in-job restart": 0})
    assert t["between_allocations_s"] == pytest.approx(1350 + 1400)
    assert (t["steps"], t["lost_steps"], t["cumulative_throughput"]) == (500, 100, 49.4)
    assert t["complete"] is True


def test_in_job_restart_and_unknown_loss(tmp_path):
    path = str(tmp_path / "p.txt")
    t = parse_time("2026-03-03 00:00:00")
    c = Clock(t)
    log = ProgressLog(path, "7", 8, clock=c)
    log.starting_job(0, startup_s=0)
    c.at(t + 10); log.first_step(1)
    c.at(t + 1010); log.saved_checkpoint(100, 100 * FLOPS_PER_STEP, 0, save_s=10)
    c.at(t + 1370); log.restart("fault", lost_s=60)  # fault at t+1310, 30 steps after the save
    c.at(t + 1400); log.starting_job(1, startup_s=0)
    c.at(t + 1420); log.loaded_checkpoint(100, 20, 100 * FLOPS_PER_STEP)
    c.at(t + 1440); log.first_step(101)
    c.at(t + 2440); log.saved_checkpoint(200, 200 * FLOPS_PER_STEP, 0, save_s=10)
    c.at(t + 2450); log.ending_job("done", 200, 0)
    report = build_report(parse_progress(path))
    a, b = report.rows
    assert (a.reason, a.end, a.lost_s, a.lost_steps) == ("fault", t + 1310, 300, 30)
    assert (b.restart, b.in_job_restart) == (1, True)
    assert report.totals["lost_s"]["in-job restart"] == 90
    assert report.totals["allocated_s"] == 2450 and report.totals["between_allocations_s"] == 0
    assert report.totals["goodput"] == pytest.approx((1310 - 10 - 10 - 300 + 1050 - 20 - 20 - 10) / 2450)


def test_json_matches_table(bridge_log, capsys):
    assert main([str(bridge_log.parent.parent)]) == 0  # a run dir: finds checkpoints/progress.txt
    table = capsys.readouterr().out
    assert main([str(bridge_log), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    lines = table.splitlines()
    header = re.split(r"\s{2,}", lines[0].strip())
    assert header == [h for h, _, _ in COLUMNS]
    for line, run in zip(lines[1:4], data["runs"]):
        cells = dict(zip(header, re.split(r"\s{2,}", line.strip())))
        for title, attr, fmt in COLUMNS:
            value = run[attr]
            if value is None:
                assert cells[title] == "?"
            elif fmt == "t":
                assert cells[title] == value  # JSON carries the same local stamp
            elif fmt == "s":
                assert cells[title] == str(value)
            elif fmt == "gpu" and run["device"] == "cpu":
                assert cells[title] == "-"
            else:
                assert float(cells[title]) == pytest.approx(value, abs=0.05), title
    assert lines[4] == ""
    assert f"goodput {100 * data['totals']['goodput']:.1f}%" in table
    assert "goodput 74.3%" in table
    assert re.search(r"^lost work\s+1000\.0\s+18\.7%$", table, re.M)
    assert "between allocations (queue wait, not allocated) 2750.0 s" in table


def test_plot_writes_png(bridge_log, tmp_path, capsys):
    out = tmp_path / "report.png"
    assert main([str(bridge_log), "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_finds_log_through_resolved_toml(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "ckpt").mkdir(parents=True)
    (run_dir / "ckpt" / "progress.txt").write_text(MEGATRON.read_text())
    (run_dir / "other").mkdir()
    (run_dir / "other" / "progress.txt").write_text("")  # would be ambiguous without resolved.toml
    (run_dir / "resolved.toml").write_text('[checkpoint]\nsave = "ckpt"\n')
    assert main([str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["runs"] == 3


def test_run_dir_without_log_is_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(tmp_path) in err and "progress.txt" in err


def test_cli_module_missing_file_exit_2_and_stays_light(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    missing = tmp_path / "nope" / "progress.txt"
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.report", str(missing)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {missing}: no such file or directory"]
    probe = ("import sys; from bridge_hpc.cli.report import main; rc = main([sys.argv[1]]); "
             "heavy = {'torch', 'megatron', 'nvidia_resiliency_ext', 'matplotlib'} & set(sys.modules); "
             "assert rc == 0 and not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", probe, str(MEGATRON)], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------------
# Devices, tokens/s, validation loss, several arguments, the figure (synthetic logs; see
# test_report_plots.py for the figures of real runs on the local cluster)


@pytest.mark.parametrize("name, kind", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA GH200 480GB", "GH200"), ("AMD Instinct MI300X", "MI300X"), ("cpu", "cpu"), (None, None),
])
def test_device_kind(name, kind):
    from bridge_hpc.report.goodput import device_kind

    assert device_kind(name) == kind


@pytest.mark.parametrize("span, unit", [(0.5, "s"), (119, "s"), (120, "min"), (7199, "min"), (7200, "h"), (9e5, "h")])
def test_time_unit_by_span(span, unit):
    from bridge_hpc.report.units import time_unit

    assert time_unit(span)[0] == unit


@pytest.mark.parametrize("value, text", [(0.5, "0.50"), (850, "850"), (9625.2, "9.63k"), (11895.9, "11.9k"),
                                         (125_400, "125k"), (1_254_000, "1.25M")])
def test_rates_scaled(value, text):
    from bridge_hpc.report.units import format_rate

    assert format_rate(value) == text


def test_device_recorded_in_starting_job_names_the_devices(tmp_path, capsys):
    path = tmp_path / "progress.txt"
    clock = Clock(parse_time("2026-03-04 00:00:00"))
    log = ProgressLog(str(path), "9", 8, clock=clock)
    log.starting_job(0, startup_s=5, device="NVIDIA H100 80GB\tHBM3")  # a tab would split the field
    clock.at(clock.t + 10); log.first_step(1)
    clock.at(clock.t + 100); log.saved_checkpoint(10, 10 * FLOPS_PER_STEP, 0, save_s=1)
    clock.at(clock.t + 1); log.ending_job("done", 10, 0)
    line = path.read_text().splitlines()[0]
    assert line.endswith("\tStarting job\tRestart count: 0\tSeconds since process start: 5.0\tDevice: NVIDIA H100 80GB HBM3")
    (run,) = parse_progress(str(path))
    assert run.device == "NVIDIA H100 80GB HBM3"
    assert main([str(path)]) == 0
    row = re.split(r"\s{2,}", capsys.readouterr().out.splitlines()[1])
    assert row[2] == "8 H100"
    assert row[8] == f"{8e16 / (115 * 8e12):.1f}"  # TFLOP/s/GPU shown for GPUs: 10 steps in 115 s since process start


def write_run_folder(run_dir: Path, gpus_per_node: int = 0, world: int = 2) -> Path:
    """A run folder as bridge-submit and the ranks leave it: resolved.toml, one run in the progress log
    (steps 1-20, checkpoint at 20), metrics.jsonl with known rates, and the job's stdout log."""
    from bridge_test_helpers import MINIMAL_TRAINING_TOML

    run_dir.mkdir(parents=True)
    (run_dir / "resolved.toml").write_text(
        f'[job]\nrun_dir = "{run_dir}"\n[slurm]\ngpus_per_node = {gpus_per_node}\nntasks_per_node = {world}\n'
        + MINIMAL_TRAINING_TOML)
    clock = Clock(parse_time("2026-03-05 00:00:00"))
    log = ProgressLog(str(run_dir / "checkpoints" / "progress.txt"), "42", world, clock=clock)
    log.starting_job(0, startup_s=2)
    clock.at(clock.t + 3); log.first_step(1)
    clock.at(clock.t + 20); log.saved_checkpoint(20, 20 * 1e9, 0, save_s=0.5)
    clock.at(clock.t + 1); log.ending_job("done", 20, 0)
    # 1000 tokens a step; step 1 (warm-up) slow; steps 2-10 at 0.1 s, 11-20 at 0.4 s
    records = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000 / dt, "step_time_s": dt}
               for s, dt in [(1, 2.0)] + [(s, 0.1) for s in range(2, 11)] + [(s, 0.4) for s in range(11, 21)]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 21, "lo')
    logs = run_dir / "logs"
    logs.mkdir()
    (logs / "42_0_log.out").write_text(
        "0: validation loss at iteration 10 | lm loss value: 4.500000E+00 | lm loss PPL: 9.0E+01\n"
        "0: validation loss at iteration 20 | lm loss value: 4.250000E+00 | lm loss PPL: 7.0E+01\n")
    return run_dir


def test_run_folder_tokens_per_s_devices_and_validation(tmp_path, capsys):
    from bridge_hpc.cli.report import load_run_report

    run = load_run_report(str(write_run_folder(tmp_path / "cpu")))
    (row,) = run.report.rows
    # steps 2-20 (step 1 is start-up): 19 000 tokens in 0.9 + 4.0 s; not the mean of the rates (5.5k)
    assert row.tokens_per_s == pytest.approx(19_000 / 4.9)
    assert (row.device, row.devices, row.has_gpus) == ("cpu", "2 cpu", False)
    assert run.curves.steps == list(range(1, 21))  # the torn last line is skipped
    assert run.curves.validation == {10: 4.5, 20: 4.25}
    assert run.report.totals["final_loss"] == pytest.approx(3.0)
    assert run.report.totals["final_validation_loss"] == 4.25
    assert main([str(tmp_path / "cpu")]) == 0
    out = capsys.readouterr().out
    row_cells = re.split(r"\s{2,}", out.splitlines()[1])
    assert row_cells[2] == "2 cpu" and row_cells[7] == "3.88k" and row_cells[8] == "-"
    assert "tokens/s 3.88k" in out and "TFLOP/s/GPU" not in out.split("\n\n")[1]

    gpu = load_run_report(str(write_run_folder(tmp_path / "gpu", gpus_per_node=4, world=4)))
    assert gpu.report.rows[0].devices == "4 gpu"  # the Slurm request, where the log does not name the device


def test_validation_loss_from_metrics_records_first(tmp_path):
    from bridge_hpc.cli.report import load_run_report
    from bridge_hpc.contracts.metrics_file import VALIDATION_LOSS

    run_dir = write_run_folder(tmp_path / "run")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]
    lines[14] = json.dumps(dict(json.loads(lines[14]), **{VALIDATION_LOSS: 3.5}))  # step 15
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run = load_run_report(str(run_dir))
    assert run.curves.validation == {15: 3.5}  # the job log's lines are not mixed in
    assert run.curves.validation_sources == [str(run_dir / "metrics.jsonl")]


def test_damaged_metrics_line_is_passed_over_counted_and_said(tmp_path, capsys):
    """Issue 25 item 11: one damaged line in the middle of metrics.jsonl no longer refuses the report."""
    run_dir = write_run_folder(tmp_path / "run")
    text = (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]  # without the torn last line
    text[3] = "not json"  # step 4
    (run_dir / "metrics.jsonl").write_text("\n".join(text) + "\n")
    assert main([str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"note: {run_dir / 'metrics.jsonl'}: skipped 1 of 20 lines (4) that are not complete JSON records"]
    assert "tokens/s 3.75k" in captured.out and "goodput 78.8%" in captured.out
    from bridge_hpc.cli.report import load_run_report

    run = load_run_report(str(run_dir))
    assert run.curves.steps == [s for s in range(1, 21) if s != 4]
    assert run.report.rows[0].tokens_per_s == pytest.approx(18_000 / 4.8)  # steps 2-20 less 4: 0.8 + 4.0 s


def test_several_run_folders_side_by_side(tmp_path, bridge_log, capsys):
    a = write_run_folder(tmp_path / "a")
    b = write_run_folder(tmp_path / "b", gpus_per_node=4, world=4)
    assert main([str(a), str(b), str(bridge_log)]) == 0
    out = capsys.readouterr().out
    comparison = out.split("comparison\n")[1].splitlines()
    header = re.split(r"\s{2,}", comparison[0])
    assert header == ["run", "devices", "runs", "steps", "goodput", "tokens/s", "TFLOP/s/GPU", "final step",
                      "final loss", "validation loss"]
    rows = [dict(zip(header, re.split(r"\s{2,}", line))) for line in comparison[1:]]
    assert [r["run"] for r in rows] == ["a", "b", str(bridge_log)]
    assert [r["devices"] for r in rows] == ["2 cpu", "4 gpu", "8 ?"]
    assert [r["tokens/s"] for r in rows] == ["3.88k", "3.88k", "?"]
    assert [r["TFLOP/s/GPU"] for r in rows] == ["-", "0.0", "49.4"]
    assert [r["goodput"] for r in rows][2] == "74.3%"
    assert [r["final loss"] for r in rows] == ["3.0000", "3.0000", "?"]
    assert [r["validation loss"] for r in rows] == ["4.2500", "4.2500", "?"]
    assert out.startswith(f"a: {a / 'checkpoints' / 'progress.txt'}\njob  restart  devices")

    assert main([str(a), str(b), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)["reports"]
    assert [r["label"] for r in reports] == ["a", "b"]
    assert reports[1]["runs"][0]["devices"] == "4 gpu"
    assert reports[0]["totals"]["tokens_per_s"] == pytest.approx(19_000 / 4.9)


def _texts(ax) -> list:
    return [t.get_text() for t in ax.texts]


def _container_widths(ax) -> dict:
    return {c.get_label(): sum(p.get_width() for p in c.patches) for c in ax.containers}


def test_figure_of_three_runs_on_gpus(bridge_log):
    """The synthetic 8-GPU job of three runs: hours on the time axes, the queue waits shaded, TFLOP/s/GPU on
    a second axis, the goodput segments adding up to the allocated time."""
    from bridge_hpc.cli.report import load_run_report
    from bridge_hpc.report.plot import LOSS_LABEL, QUEUE_WAIT, TFLOPS_LABEL, build_figure

    run = load_run_report(str(bridge_log))
    fig = build_figure([run])
    loss, progress, throughput, goodput, tflops = fig.axes  # the four panels, then the TFLOP/s twin
    assert loss.get_ylabel() == LOSS_LABEL and loss.get_xlabel() == "step"
    # no metrics.jsonl; the requeues resumed from the checkpoints at 200 and 300
    markers = [line.get_xdata()[0] for line in loss.lines if line.get_linestyle() == ":"]
    assert markers == [200, 300] and len(loss.lines) == 2
    assert _texts(loss) == [" requeue 100/1: step 200", " requeue 100/2: step 300", "no metrics.jsonl: no loss curve"]

    assert progress.get_xlabel() == "wall time since first start (h)"  # 8110 s
    assert [len(line.get_xdata()) for line in progress.lines] == [5, 4, 4]  # start, first step, saves, end
    assert progress.lines[2].get_xdata()[-1] == pytest.approx(8110 / 3600)
    shaded = [p for p in progress.patches if p.get_label() == QUEUE_WAIT]
    spans = sorted((p.get_x(), p.get_x() + p.get_width()) for p in shaded)
    assert [s for pair in spans for s in pair] == pytest.approx([2650 / 3600, 4000 / 3600, 5600 / 3600, 7000 / 3600])

    assert tflops.get_ylabel() == TFLOPS_LABEL
    assert [p.get_height() for p in tflops.patches] == [93.0, 90.9, 90.9]
    assert _texts(throughput) == ["no metrics.jsonl: no tokens/s"]

    widths = _container_widths(goodput)  # 5360 s allocated: minutes
    allocated = run.report.totals["allocated_s"]
    assert goodput.get_xlabel() == "time (min)"
    assert sum(w for label, w in widths.items() if label != QUEUE_WAIT) == pytest.approx(allocated / 60)
    assert widths == pytest.approx({"training 74.3%": 3980 / 60, "start-up 2.6%": 140 / 60,
                                    "checkpoint save 3.7%": 200 / 60, "checkpoint load 0.7%": 40 / 60,
                                    "lost work 18.7%": 1000 / 60, "in-job restart 0.0%": 0.0,
                                    QUEUE_WAIT: 2750 / 60})


def test_figure_shades_an_in_job_restart(tmp_path):
    from bridge_hpc.cli.report import load_run_report
    from bridge_hpc.report.plot import IN_JOB_RESTART, build_figure

    path = str(tmp_path / "p.txt")
    t = parse_time("2026-03-03 00:00:00")
    c = Clock(t)
    log = ProgressLog(path, "7", 8, clock=c)
    log.starting_job(0, startup_s=0, device="cpu")
    c.at(t + 10); log.first_step(1)
    c.at(t + 30); log.saved_checkpoint(100, 100 * FLOPS_PER_STEP, 0, save_s=1)
    c.at(t + 50); log.restart("fault", lost_s=6)  # fault at t+44
    c.at(t + 60); log.starting_job(1, startup_s=0, device="cpu")
    c.at(t + 62); log.loaded_checkpoint(100, 2, 100 * FLOPS_PER_STEP)
    c.at(t + 64); log.first_step(101)
    c.at(t + 90); log.saved_checkpoint(200, 200 * FLOPS_PER_STEP, 0, save_s=1)
    c.at(t + 91); log.ending_job("done", 200, 0)
    run = load_run_report(path)
    fig = build_figure([run])
    loss, progress, throughput, goodput = fig.axes  # CPU ranks: no TFLOP/s/GPU axis
    assert _texts(loss)[0] == f" {IN_JOB_RESTART} 7/1: step 100"
    (shade,) = progress.patches
    assert (shade.get_label(), shade.get_x(), shade.get_width()) == (IN_JOB_RESTART, 44, 16)
    assert progress.get_xlabel() == "wall time since first start (s)"
    widths = _container_widths(goodput)
    assert widths["in-job restart 17.6%"] == 16 and sum(widths.values()) == pytest.approx(91)


# --------------------------------------------------------------------------------------------------
# Honest goodput and damaged progress logs (issue 25; tests/test_report_damage.py has the real runs)


def test_time_without_a_training_step_is_never_training(tmp_path):
    """A requeued job whose first run died in start-up (killed: no line after Starting job) and whose
    second trained: only the second's time is training; a run of no time and no step is 0 %, not "?"."""
    t0 = parse_time("2026-03-01 00:00:00")
    c = Clock(t0)
    path = str(tmp_path / "progress.txt")
    ProgressLog(path, "5", 2, clock=c).starting_job(0, startup_s=3)
    log = ProgressLog(path, "5", 2, clock=c.at(t0 + 200))  # the requeued run
    log.starting_job(1, startup_s=10)
    c.at(t0 + 220); log.first_step(1)
    c.at(t0 + 320); log.saved_checkpoint(10, 10 * FLOPS_PER_STEP, 0, save_s=5)
    c.at(t0 + 321); log.ending_job("done", 10, 0)
    report = build_report(parse_progress(path))
    first, second = report.rows
    assert (first.steps, first.training_s, first.startup_s, first.duration_s) == (0, 0.0, 3.0, 3.0)
    assert second.training_s == 131 - 30 - 5
    assert report.totals["goodput"] == pytest.approx(96 / 134)
    assert sum(sec for _, sec in report.goodput_segments()) == pytest.approx(report.totals["allocated_s"])

    zero = str(tmp_path / "zero.txt")
    ProgressLog(zero, "6", 1, clock=Clock(t0)).starting_job(0)
    ProgressLog(zero, "6", 1, clock=Clock(t0)).ending_job("error", 0, 0)
    report = build_report(parse_progress(zero))
    assert report.totals["allocated_s"] == 0 and report.totals["goodput"] == 0.0


def test_a_lost_starting_job_line_never_joins_two_runs(tmp_path):
    """A damaged ``Starting job`` line: the lines of its run are passed over (and counted), not added to
    the run before, which would count the time between the two as that run's."""
    from bridge_hpc.contracts.progress_log import read_progress

    t0 = parse_time("2026-03-01 00:00:00")
    path = tmp_path / "progress.txt"
    for restart in range(3):
        begin = t0 + 1000 * restart
        c = Clock(begin)
        log = ProgressLog(str(path), "8", 2, clock=c)
        log.starting_job(restart, startup_s=1)
        c.at(begin + 5); log.first_step(restart * 10 + 1)
        c.at(begin + 100); log.saved_checkpoint(restart * 10 + 10, 0, 0, save_s=1)
        c.at(begin + 101); log.ending_job("time_limit" if restart < 2 else "done", restart * 10 + 10, 0)
    lines = path.read_bytes().split(b"\n")
    lines[4] = lines[4][:20] + b"\xff" + lines[4][21:]  # the second run's Starting job: not UTF-8
    path.write_bytes(b"\n".join(lines))
    read = read_progress(str(path))
    assert [r.restart_count for r in read.runs] == [0, 2] and read.skipped == [5, 6, 7, 8] and read.lines == 12
    report = build_report(read.runs)
    assert [(r.duration_s, r.reason) for r in report.rows] == [(102, "time_limit"), (102, "done")]
    assert report.totals["training_s"] == 2 * (102 - 6 - 1)


def test_an_in_job_restart_after_the_failed_runs_ending_line_is_charged_to_that_run(tmp_path):
    """Fault tolerance's next attempt writes ``Restart`` for the run that failed, before its own
    ``Starting job``; when the failed run wrote its ``Ending job`` first (rank 0 alive when another rank
    was killed), the ``Restart`` line is still that run's: the report shows an in-job restart."""
    from bridge_hpc.contracts.progress_log import RESTART, read_progress

    t0 = parse_time("2026-03-01 00:00:00")
    path = tmp_path / "progress.txt"
    c = Clock(t0)
    log = ProgressLog(str(path), "8", 2, clock=c)
    log.starting_job(0, startup_s=1)
    c.at(t0 + 5); log.first_step(1)
    c.at(t0 + 50); log.saved_checkpoint(10, 0, 0, save_s=1)
    c.at(t0 + 60); log.ending_job("fault", 12, 2)
    c.at(t0 + 70); log.restart("fault", 15.0)
    c.at(t0 + 75); log.starting_job(1, startup_s=1)
    c.at(t0 + 80); log.first_step(11)
    c.at(t0 + 120); log.ending_job("done", 20, 0)
    read = read_progress(str(path))
    assert [r.restart_count for r in read.runs] == [0, 1] and read.skipped == []
    restart = read.runs[0].last(RESTART)
    assert restart is not None and restart.fields["Cause"] == "fault"
    rows = build_report(read.runs).rows
    assert [r.reason for r in rows] == ["fault", "done"] and rows[1].in_job_restart
    # One Restart line per run: a second one after it belongs to no run, and is passed over and counted.
    restart_line = path.read_text().splitlines()[4]
    with open(path, "a") as f:
        f.write(restart_line + "\n" + restart_line + "\n")
    again = read_progress(str(path))
    assert len(again.runs[1].of(RESTART)) == 1 and again.skipped == [10]
