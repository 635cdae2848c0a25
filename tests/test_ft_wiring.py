"""Fault tolerance wiring without a cluster: [ft] launcher fields, the rendered ft_launcher line, the
in-process restart start-up check, the run's restart count. (End to end: tests/test_ft_slurm.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from bridge_test_helpers import MINIMAL_TRAINING

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.jobfile.jobconfig import load_job_config
from bridge_hpc.launch.render import render_script
from bridge_hpc.training.config import ConfigContainer, InProcessRestartConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("key, value", [("max_restarts", -1), ("step_timeout", 0), ("setup_timeout", -5),
                                        ("workload_check_interval", 0), ("safety_factor", 0.5),
                                        ("min_computed_timeout_s", -1), ("simulated_fault_rank", -2)])
def test_ft_launcher_fields_are_checked(key, value):
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(dict(MINIMAL_TRAINING, ft={key: value}))
    assert err.value.key == f"ft.{key}"


def test_ft_defaults():
    cfg = ConfigContainer.from_sections(dict(MINIMAL_TRAINING, ft={"enable_ft_package": True}))
    assert cfg.ft.max_restarts == 3 and cfg.ft.step_timeout == 180 and cfg.ft.min_computed_timeout_s == 60


def _render(tmp_path, config, *overrides):
    cfg = load_job_config(ROOT / "configs" / config, [f"job.run_dir={tmp_path}", *overrides], cwd=tmp_path)
    script = render_script(cfg)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    return script


def test_ft_job_renders_one_ft_launcher_per_node(tmp_path):
    script = _render(tmp_path, "local-tiny-fault-tolerance.toml", "ft.max_restarts=5", "ft.step_timeout=7.5",
                     "slurm.nodes=2", "job.python='/opt/py $(touch x)/python3'")
    assert "-m bridge_hpc.launch.ft_launch" in script and "bridge_hpc.rank \"$BRIDGE_CONFIG\"" in script
    assert "--ntasks-per-node=1" in script and "--nodes=2" in script and "--nnodes=2" in script
    assert "--nproc-per-node=2" in script and "--max-restarts=5" in script
    assert "--ft-rank-section-timeouts=setup:120,step:7.5,checkpointing:120" in script
    assert "--ft-workload-check-interval=1" in script
    assert "'/opt/py $(touch x)/python3'" in script  # config values are shlex-quoted, never expanded
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1" in script
    assert "-u -m bridge_hpc.rank" not in script


def test_job_without_ft_keeps_the_plain_srun(tmp_path):
    script = _render(tmp_path, "local-tiny.toml")
    assert "-u -m bridge_hpc.rank \"$BRIDGE_CONFIG\" &" in script and "ft_launch" not in script
    script = _render(tmp_path, "local-tiny-fault-tolerance.toml", "ft.enable_ft_package=false")
    assert "ft_launch" not in script


def test_inprocess_restart_gives_a_clear_message_where_unsupported():
    pytest.importorskip("torch")
    from bridge_hpc.training.resilience.inprocess_restart import maybe_wrap_for_inprocess_restart, unsupported_reason

    fn = object()
    assert maybe_wrap_for_inprocess_restart(fn, InProcessRestartConfig(enabled=False)) == (fn, None)
    if unsupported_reason() is None:
        pytest.skip("in-process restart is usable here (CUDA)")
    with pytest.raises(ConfigError) as err:
        maybe_wrap_for_inprocess_restart(fn, InProcessRestartConfig(enabled=True))
    assert err.value.key == "inprocess_restart.enabled" and "not available" in str(err.value)


def test_run_restart_count_counts_every_run_of_the_job(tmp_path):
    pytest.importorskip("megatron.core")
    from bridge_hpc.contracts.progress_log import ProgressLog
    from bridge_hpc.training.pretrain import run_restart_count

    path = str(tmp_path / "progress.txt")
    assert run_restart_count(path, "7", 0, 0) == 0
    log = ProgressLog(path, "7", 2)
    log.starting_job(0)       # allocation 0, first run
    log.restart("fault", 3.0)
    log.starting_job(1)       # allocation 0, in-job restart 1
    # allocation 1 (SLURM_RESTART_COUNT=1, in-job count back to 0): two runs came before it
    assert run_restart_count(path, "7", 1, 0) == 2
    assert run_restart_count(path, "8", 1, 0) == 1  # another job's lines do not count
