"""Megatron Bridge's configs construct, validate and log as Bridge's do (issue 49): each test is a behaviour
that Bridge's own unit tests (``tests/unit_tests/training``) or its documented API state.

1. Dataset configs: a FIM fragment rate without ``fim_split_sample`` is built; a finalized mock config holds
   no blend; the masking switches must be defined, checked again on every finalize (a job file gets false).
2. ``ProfilingConfig``: a one-step window (``profile_step_end == profile_step_start``).
3. ``SchedulerConfig.max_steps``; ``CheckpointConfig(ckpt_step=..., load=...)``, which a run loads.
4. ``LoggerConfig.finalize`` imports the backend's package (Bridge's check); a job file's loader looks it up.
5. ``GlobalState``'s W&B / MLflow / Comet properties: the last rank only, a missing run name is a ValueError.
6. ``training_log`` hands each of those loggers the step's scalars and timers with Bridge's calls; the run's
   own backends keep what they have already once.
7. ``pretrain``'s process group: the caller's stays up, its own is torn down (aborted when the run fails),
   except after a failed attempt under the in-process restart wrapper, which cleans up itself.
"""

from __future__ import annotations

import copy
import os
import sys
import types

import pytest
import torch
from bridge_test_helpers import TINY, free_port, single_rank_world, tiny_checkpoints, tiny_job
from warm_ranks import run_job

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
    return run_job(job, ["train.eval_interval=0", *overrides], cwd=os.path.dirname(job),
                   env={**os.environ, **(env or {})}).output


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


# ---------------------------------------------------------------------------------------------
# 6. training_log and GlobalState's loggers
# ---------------------------------------------------------------------------------------------


class _Logger:
    """A stand-in for a backend's logger: records the calls training_log makes on it."""

    def __init__(self, method: str):
        self.calls = []
        setattr(self, method, lambda *args, **kwargs: self.calls.append((method, args, kwargs)))


class _Records:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)


def test_training_log_hands_each_logger_the_steps_scalars_and_timers_as_bridge_does(tmp_path):
    from bridge_hpc.rank import build_config
    from bridge_hpc.training.state import GlobalState
    from bridge_hpc.training.utils.train_utils import training_log

    loggers = {"wandb": _Logger("log"), "mlflow": _Logger("log_metrics"), "comet": _Logger("log_metrics")}

    class State(GlobalState):
        wandb_logger = property(lambda self: loggers["wandb"])
        mlflow_logger = property(lambda self: loggers["mlflow"])
        comet_logger = property(lambda self: loggers["comet"])

    cfg = build_config(str(TINY), [f"job.run_dir={tmp_path / 'run'}", "logger.log_interval=2",
                                   "logger.tensorboard_log_interval=1", "logger.timing_log_level=1",
                                   "logger.log_timers_to_tensorboard=true", "logger.log_loss_scale_to_tensorboard=true",
                                   "logger.log_world_size_to_tensorboard=true"])
    state = State()
    state.cfg = cfg
    records = _Records()
    for step in (1, 2):
        state.train_state.step, state.train_state.consumed_train_samples = step, 8 * step
        timer = state.timers("forward-backward", 1)
        timer.start()
        timer.stop()
        training_log({"lm loss": torch.tensor(2.5)}, {}, 1e-3, None, 4.0, False, 0, 0.5, 7.0, 3, cfg, state,
                     [0.0, 1.0 * step], None, step_time_s=1.0, metrics=records)

    timer_ms = records.records[1]["forward-backward-time"]
    assert timer_ms > 0
    every_step = {"lm loss": 2.5, "learning-rate": 1e-3, "grad-norm": 0.5, "num-zeros": 3, "iteration-time": 1.0}
    log_step = {"batch-size": cfg.train.global_batch_size, "loss-scale": 4.0, "world-size": 1, "params-norm": 7.0,
                "forward-backward-time": timer_ms}
    for name, logger in loggers.items():
        by_step = {}
        for method, args, kwargs in logger.calls:
            if name == "wandb":  # Bridge: wandb_writer.log(metrics, iteration)
                assert method == "log" and len(args) == 2 and not kwargs
                metrics, step = args
            else:  # Bridge: mlflow_logger / comet_logger.log_metrics(metrics, step=iteration)
                assert method == "log_metrics" and len(args) == 1 and set(kwargs) == {"step"}
                metrics, step = args[0], kwargs["step"]
            by_step.setdefault(step, {}).update(metrics)
        assert sorted(by_step) == [1, 2], name
        assert by_step[1].items() >= {**every_step, "samples vs steps": 8}.items(), name
        assert not set(log_step) & set(by_step[1]), name  # the log step's scalars on log steps only
        assert by_step[2].items() >= {**every_step, **log_step, "samples vs steps": 16}.items(), name


def test_the_runs_own_backend_keeps_a_value_its_step_has_already_once():
    from bridge_hpc.training.utils.log_backends import LogBackends

    cfg = _python_built()
    cfg.logger.wandb_project, cfg.logger.wandb_exp_name = "p", "e"
    backends = LogBackends(cfg, home="/nonexistent")  # not opened: nothing starts, steps only collect
    backends.add(3, {"lm loss": 2.5, "learning-rate": 1e-3})  # the record, through the run's metrics
    backends.add(3, {"lm loss": 2.5, "learning-rate": 1e-3, "custom": 1.0}, only="wandb")  # wandb_logger.log
    assert backends._pending[3] == {None: {"lm loss": 2.5, "learning-rate": 1e-3}, "wandb": {"custom": 1.0}}
    backends.add(3, {"lm loss": 9.0}, only="wandb")  # a value of its own still wins for that backend
    assert backends._pending[3]["wandb"] == {"custom": 1.0, "lm loss": 9.0}


# ---------------------------------------------------------------------------------------------
# 7. pretrain's process group, and the in-process restart wrapper's clean-up
# ---------------------------------------------------------------------------------------------


def _tiny_config(tmp_path, *overrides: str):
    from bridge_hpc.rank import build_config

    return build_config(str(TINY), [f"job.run_dir={tmp_path / 'run'}", "train.eval_interval=0", *overrides])


@pytest.mark.parametrize("owner", ["in-process wrapper", "pretrain", "caller"])
def test_when_set_up_raises_the_wrapper_keeps_the_process_group_clean_up(one_rank, tmp_path, monkeypatch, owner):
    """Bridge's ``test_inprocess_restart_wrapper_retains_cleanup_ownership_when_setup_raises`` and its
    neighbours, on a real gloo group: set-up fails once the process group and megatron-core's groups are up.
    Under the in-process wrapper (its CallWrapper stood in for, as Bridge's test does) the wrapped
    ``_pretrain`` leaves both to the wrapper, whose abort and finalize clean up; a plain pretrain aborts
    the group it brought up; a caller's group stays up."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bridge_hpc.training import pretrain as P
    from bridge_hpc.training.gpt_step import forward_step
    from bridge_hpc.training.state import GlobalState

    def set_up_fails(cfg):
        raise RuntimeError("set-up failed")

    monkeypatch.setattr(P, "setup_model", set_up_fails)
    cfg = _tiny_config(tmp_path)
    if owner == "caller":
        dist.init_process_group("gloo", rank=0, world_size=1)
    state = GlobalState()
    state.cfg = cfg
    with pytest.raises(RuntimeError, match="set-up failed"):
        if owner == "in-process wrapper":
            P._pretrain(state, forward_step, store=dist.HashStore(), inprocess_call_wrapper=types.SimpleNamespace(iteration=1))
        else:
            P.pretrain(cfg, forward_step)
    assert dist.is_initialized() is (owner != "pretrain")
    assert parallel_state.model_parallel_is_initialized() is (owner != "pretrain")
    if owner == "in-process wrapper":
        assert isinstance(state.restart_store, dist.PrefixStore)  # the attempt's prefix of the wrapper's store
        dist.barrier()  # the group was left as it was: usable until the wrapper aborts it


def test_the_in_process_wrappers_finalize_drops_megatron_cores_groups(monkeypatch):
    """Bridge's wrapper finalizes a failed attempt (``destroy_state``) after its abort destroyed the process
    groups: megatron-core forgets them, so the next attempt sets them up on its own group. The package is
    stood in for (no in-process restart runs); megatron-core's groups are real, on a gloo group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bridge_hpc.training.resilience import inprocess_restart

    wrapper_kwargs = {}

    class Wrapper:
        def __init__(self, **kwargs):
            wrapper_kwargs.update(kwargs)

        def __call__(self, fn):
            return fn

    class ThreadedFinalize:
        def __init__(self, timeout, fn, args=(), kwargs=None):
            self.fn = fn

        def __call__(self, state):
            self.fn()
            return state

    def compose(*parts):
        def composed(state):
            for part in reversed(parts):
                state = part(state)
            return state
        return composed

    fake = types.SimpleNamespace(
        Wrapper=Wrapper, CallWrapper=type("CallWrapper", (), {}), Compose=compose,
        finalize=types.SimpleNamespace(ThreadedFinalize=ThreadedFinalize),
        abort=types.SimpleNamespace(AbortTorchDistributed=lambda: (lambda state: state)),
        health_check=types.SimpleNamespace(CudaHealthCheck=lambda timeout: None, FaultCounter=lambda **kw: None),
        initialize=types.SimpleNamespace(RetryController=lambda **kw: None))
    package = types.ModuleType("nvidia_resiliency_ext")
    package.inprocess = fake
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext", package)
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext.inprocess", fake)
    monkeypatch.setattr(inprocess_restart, "check_supported", lambda: None)
    world = single_rank_world()
    next(world)
    try:
        monkeypatch.setenv("MASTER_PORT", str(free_port() - 1))  # the coordination store's port (+1) is free
        wrapped, store = inprocess_restart.maybe_wrap_for_inprocess_restart(lambda **kw: None,
                                                                            C.InProcessRestartConfig(enabled=True))
        assert isinstance(store, dist.TCPStore)
        assert parallel_state.model_parallel_is_initialized()
        wrapper_kwargs["finalize"]("frozen state")
        assert not parallel_state.model_parallel_is_initialized()
        assert dist.is_initialized()  # the process group itself is the abort's (AbortTorchDistributed)
    finally:
        world.close()


@pytest.mark.parametrize("owner", ["pretrain", "caller", "the rank's exit"])
def test_a_run_tears_down_the_process_group_it_brought_up_and_leaves_a_callers(one_rank, tmp_path, monkeypatch,
                                                                               owner):
    """Bridge's ``_maybe_destroy_process_group``: after a normal end pretrain destroys (after a barrier) the
    group it brought up, not one that was up before it; ``python -m bridge_hpc.rank``, which leaves through
    os._exit right after, leaves it to the process's end."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bridge_hpc.training import pretrain as P
    from bridge_hpc.training.gpt_step import forward_step

    if owner == "caller":
        dist.init_process_group("gloo", rank=0, world_size=1)
    monkeypatch.setattr(P, "PROCESS_ENDS_ON_RETURN", owner == "the rank's exit")
    P.pretrain(_tiny_config(tmp_path, "train.train_iters=2", "checkpoint.save_interval=2", "scheduler.lr_warmup_iters=1"),
               forward_step)
    assert dist.is_initialized() is (owner != "pretrain")
    assert parallel_state.model_parallel_is_initialized() is (owner != "pretrain")
