"""Megatron Bridge's configs construct, validate and log as Bridge's do (issue 49): each test is a behaviour
that Bridge's own unit tests (``tests/unit_tests/training``) or its documented API state.

1. Dataset configs: a FIM fragment rate without ``fim_split_sample`` is built; a finalized mock config holds
   no blend; the masking switches must be defined, checked again on every finalize (a job file gets false).
2. ``ProfilingConfig``: a one-step window (``profile_step_end == profile_step_start``).
3. ``SchedulerConfig.max_steps``; ``CheckpointConfig(ckpt_step=..., load=...)``, which a run loads.
4. ``LoggerConfig.finalize`` imports the backend's package (Bridge's check); a job file's loader looks it up.
5. ``GlobalState``'s W&B / MLflow / Comet properties: the last rank only, a missing run name is a ValueError.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from bridge_test_helpers import free_port, tiny_checkpoints, tiny_job

from bridge_hpc.contracts.errors import ConfigError, MissingPackageError
from bridge_hpc.training import config as C

sys.path.insert(0, os.path.dirname(__file__))
from test_seed_config import _python_built  # noqa: E402

MASKS = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}


# ---------------------------------------------------------------------------------------------
# 1. Dataset configs
# ---------------------------------------------------------------------------------------------


def test_a_fim_config_with_a_fragment_rate_and_no_split_sample_is_built_as_in_bridge():
    cfg = C.GPTFIMDatasetConfig(random_seed=1234, seq_length=512, fim_rate=0.1, fim_fragment_rate=0.5,
                                fim_no_prefix="test", **MASKS)
    cfg.finalize()
    assert cfg.fim_fragment_rate == 0.5 and cfg.fim_split_sample is None and cfg.mock


def test_a_finalized_mock_config_holds_no_blend_as_in_bridge():
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig

    cfg = C.MockGPTDatasetConfig(random_seed=1234, seq_length=512, **MASKS)
    cfg.finalize()
    assert isinstance(cfg, MCoreGPTDatasetConfig) and cfg.mock
    assert cfg.blend is None and cfg.blend_per_split is None
    assert "blend" not in cfg.__dict__ and "blend_per_split" not in cfg.__dict__
    cfg.finalize()  # again: still none
    assert "blend" not in cfg.__dict__ and cfg.blend is None


def test_a_gpt_dataset_config_finalizes_idempotently_and_checks_again_on_every_finalize():
    """Bridge's TestRerunConfigValidation.test_gptdataset_config."""
    cfg = C.GPTDatasetConfig(random_seed=1234, seq_length=1024, **MASKS)
    assert cfg == copy.deepcopy(cfg)
    cfg.finalize()
    after = copy.deepcopy(cfg)
    cfg.finalize()
    assert cfg == after
    cfg.random_seed = 2468
    cfg.finalize()
    cfg.reset_position_ids = None
    with pytest.raises(AssertionError, match="reset_position_ids must be defined.") as err:
        cfg.finalize()
    assert isinstance(err.value, ConfigError) and err.value.key == "dataset.reset_position_ids"


@pytest.mark.parametrize("cls", ["GPTDatasetConfig", "MockGPTDatasetConfig", "GPTFIMDatasetConfig"])
@pytest.mark.parametrize("key", sorted(MASKS))
def test_each_masking_switch_must_be_defined_in_python(cls, key):
    cfg = getattr(C, cls)(seq_length=64, **{**MASKS, key: None})
    with pytest.raises(AssertionError, match=f"{key} must be defined."):
        cfg.finalize()


def test_a_job_file_leaving_the_masking_switches_out_gets_false():
    cfg = C.ConfigContainer.from_sections({"model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
                                                     "seq_length": 16},
                                           "train": {"train_iters": 2, "micro_batch_size": 1, "global_batch_size": 1},
                                           "optimizer": {"lr": 1e-3},
                                           "dataset": {"seq_length": 16, "reset_position_ids": True}})
    assert (cfg.dataset.reset_position_ids, cfg.dataset.reset_attention_mask, cfg.dataset.eod_mask_loss) == (
        True, False, False)


# ---------------------------------------------------------------------------------------------
# 2. Profiling
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("start, end", [(10, 10), (0, 0), (0, 5), (10, 20)])
def test_a_profiling_window_may_be_one_step(start, end):
    C.ProfilingConfig(profile_step_start=start, profile_step_end=end).finalize()


def test_the_one_step_nsys_window_opens_before_that_step():
    from bridge_hpc.training.train import _window_start

    assert _window_start(C.ProfilingConfig(profile_step_start=10, profile_step_end=10)) == 9
    assert _window_start(C.ProfilingConfig(profile_step_start=10, profile_step_end=12)) == 10


# ---------------------------------------------------------------------------------------------
# 3. Scheduler and checkpoint
# ---------------------------------------------------------------------------------------------


def _validated(train_iters=8, **scheduler):
    cfg = _python_built()
    cfg.dataset = C.MockGPTDatasetConfig(seq_length=cfg.model.seq_length, num_workers=0, **MASKS)
    cfg.scheduler = C.SchedulerConfig(**scheduler)
    cfg.train.train_iters = train_iters
    cfg.finalize_sections()
    cfg.validate(world_size=1)
    return cfg.scheduler


def test_max_steps_gives_a_short_run_the_schedule_of_the_full_run():
    full = _validated(train_iters=80, lr_warmup_iters=4)
    short = _validated(train_iters=8, lr_warmup_iters=4, max_steps=80)
    for name in ("lr_decay_iters", "lr_decay_steps", "lr_warmup_steps", "wd_incr_steps"):
        assert getattr(short, name) == getattr(full, name), name
    assert short.lr_decay_iters == 80 and short.wd_incr_steps == 80 * 16
    assert _validated(train_iters=8, max_steps=80, lr_decay_iters=40).lr_decay_iters == 40  # the full run's own


@pytest.mark.parametrize("max_steps", [0, -3])
def test_max_steps_must_be_positive(max_steps):
    with pytest.raises(ValueError, match=f"scheduler.max_steps must be positive, got {max_steps}.") as err:
        C.SchedulerConfig(max_steps=max_steps).finalize()
    assert err.value.key == "scheduler.max_steps"


def test_max_steps_below_train_iters_is_bridges_value_error():
    with pytest.raises(ValueError, match=r"scheduler.max_steps \(4\) must be greater than or equal to "
                                         r"train.train_iters \(8\)."):
        _validated(train_iters=8, max_steps=4)


def test_max_steps_with_sample_based_training_is_bridges_assertion():
    cfg = _python_built()
    cfg.dataset = C.MockGPTDatasetConfig(seq_length=cfg.model.seq_length, num_workers=0, **MASKS)
    cfg.scheduler = C.SchedulerConfig(max_steps=100)
    cfg.train.train_iters, cfg.train.train_samples = None, 128
    cfg.finalize_sections()
    with pytest.raises(AssertionError, match="scheduler.max_steps is only supported for iteration-based training; "
                                             "use sample-based scheduler fields with train_samples"):
        cfg.validate(world_size=1)


def test_ckpt_step_with_load_passes_as_in_bridge():
    cfg = C.CheckpointConfig(ckpt_format="torch_dist", ckpt_step=5000, load="/checkpoints")
    cfg.finalize()
    assert cfg.ckpt_step == 5000 and cfg.load == "/checkpoints"


def _train(job: str, *overrides: str, env=None) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "bridge_hpc.rank", job, "--set", "train.eval_interval=0"]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=os.path.dirname(job), capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def test_ckpt_step_loads_that_iteration_in_the_first_run_and_a_requeue_resumes_from_the_newest(tmp_path):
    job = tiny_job(tmp_path)
    _train(job, "checkpoint.save_interval=5", "train.train_iters=20", "checkpoint.most_recent_k=-1")
    root = tiny_checkpoints(job)
    out = _train(job, "checkpoint.save_interval=5", "train.train_iters=20", "checkpoint.ckpt_step=10",
                 "checkpoint.most_recent_k=-1", f"checkpoint.load={root}", env={"SLURM_RESTART_COUNT": "0"})
    assert "iter_0000010 (iteration 10)" in out, out[-3000:]
    requeued = _train(job, "checkpoint.save_interval=5", "train.train_iters=20", "checkpoint.ckpt_step=10",
                      f"checkpoint.load={root}", env={"SLURM_RESTART_COUNT": "1"})
    assert "iter_0000020 (iteration 20)" in requeued, requeued[-3000:]


# ---------------------------------------------------------------------------------------------
# 4. Logger packages
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def broken_comet(tmp_path, monkeypatch):
    """A ``comet_ml`` that is installed (found) but whose import fails with a ModuleNotFoundError."""
    package = tmp_path / "site" / "comet_ml"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "comet_ml", raising=False)
    return package


def test_finalize_imports_the_comet_package_as_bridge_does(broken_comet):
    cfg = C.LoggerConfig(comet_project="my_project", comet_experiment_name="my_experiment")
    with pytest.raises(ModuleNotFoundError, match="comet_ml") as err:
        cfg.finalize()
    assert isinstance(err.value, MissingPackageError) and err.value.key == "logger.comet_project"
    assert isinstance(err.value.__cause__, ModuleNotFoundError)


def test_the_job_file_loader_looks_the_package_up_without_importing_it(broken_comet):
    with C.packages_looked_up():
        C.LoggerConfig(comet_project="my_project", comet_experiment_name="my_experiment").finalize()
    assert "comet_ml" not in sys.modules


# ---------------------------------------------------------------------------------------------
# 5. GlobalState's logger properties
# ---------------------------------------------------------------------------------------------


def _state(monkeypatch, rank: int, world: int, **logger):
    from bridge_hpc.training.state import GlobalState

    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    state = GlobalState()
    state.cfg = _python_built()
    for name, value in logger.items():
        setattr(state.cfg.logger, name, value)
    return state


@pytest.mark.parametrize("prop, logger", [
    ("wandb_logger", {"wandb_project": "p", "wandb_exp_name": ""}),
    ("mlflow_logger", {"mlflow_experiment": "e", "mlflow_run_name": ""}),
    ("comet_logger", {"comet_project": "p", "comet_experiment_name": None}),
])
def test_a_logger_property_is_none_off_the_last_rank(monkeypatch, prop, logger):
    assert getattr(_state(monkeypatch, 0, 4, **logger), prop) is None


@pytest.mark.parametrize("prop, logger, words", [
    ("wandb_logger", {"wandb_project": "p", "wandb_exp_name": ""}, "Please specify the wandb experiment name!"),
    ("mlflow_logger", {"mlflow_experiment": "e", "mlflow_run_name": ""},
     "Please specify the mlflow_run_name for MLFlow logging!"),
    ("comet_logger", {"comet_project": "p", "comet_experiment_name": ""},
     "Please specify the comet_experiment_name for Comet ML logging!"),
    ("comet_logger", {"comet_project": "p", "comet_experiment_name": None},
     "Please specify the comet_experiment_name for Comet ML logging!"),
])
def test_a_missing_run_name_on_the_last_rank_is_bridges_value_error(monkeypatch, prop, logger, words):
    state = _state(monkeypatch, 3, 4, **logger)
    with pytest.raises(ValueError, match=words):
        getattr(state, prop)


@pytest.mark.parametrize("prop", ["wandb_logger", "mlflow_logger", "comet_logger"])
def test_a_logger_property_is_none_without_a_config_or_with_its_backend_off(monkeypatch, prop):
    from bridge_hpc.training.state import GlobalState

    assert getattr(GlobalState(), prop) is None
    assert getattr(_state(monkeypatch, 3, 4), prop) is None
