"""Megatron Bridge's code runs unchanged (issue 38): Bridge's documented calls, asserting Bridge's behaviour.

1. Validation messages and exception types: Bridge's words inside ours (``key 'x': <Bridge's message>``),
   an exception that is both our ConfigError and the type Bridge raises (ValueError / AssertionError).
2. Logger configuration: ``LoggerConfig.finalize`` as Bridge's (run and experiment names, the backend's
   package, ModuleNotFoundError); MLflow / Comet fields set alone are accepted.
3. Dataset types: ``bridge_hpc.training.config``'s GPT dataset configs are megatron-core
   ``GPTDatasetConfig`` / ``BlendedMegatronDatasetConfig`` subclasses; the job file's torch-free
   descriptions become them on the ranks (``runtime_config_update``); mock + blend is Bridge's TypeError;
   ``GPTFIMDatasetConfig()`` without data is mock data.
4. Signatures: ``training_log(..., pg_collection=None)``, ``_finish_train(global_state, checkpoint_manager)``
   (``_handle_mxfp8_param_buffer_copy(model=)``: tests/test_bridge_config_fields.py).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bridge_test_helpers import TINY

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training import config as C

REPO = str(Path(__file__).resolve().parent.parent)


def _raises(exc_type, call, key: str, bridge_words: str) -> BaseException:
    """``call()`` raises ``exc_type`` (Bridge's type) that is also a ConfigError, whose text is
    ``key '<key>': `` followed by Bridge's own message (``bridge_words`` is its start)."""
    with pytest.raises(exc_type) as err:
        call()
    assert isinstance(err.value, ConfigError), type(err.value).__mro__
    assert str(err.value).startswith(f"key '{key}': {bridge_words}"), str(err.value)
    assert err.value.key == key
    return err.value


# ---------------------------------------------------------------------------------------------
# 1. Bridge's messages and exception types
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("section, values, exc_type, key, words", [
    (C.SchedulerConfig, {"lr_warmup_fraction": 0.1, "lr_warmup_iters": 100}, AssertionError,
     "scheduler.lr_warmup_fraction",
     "Cannot specify lr_warmup_fraction=0.1 with lr_warmup_iters=100 or lr_warmup_samples=0. "
     "Use either lr_warmup_fraction OR lr_warmup_iters OR lr_warmup_samples."),
    (C.SchedulerConfig, {"lr_decay_iters": 100, "lr_decay_samples": 1000}, AssertionError,
     "scheduler.lr_decay_samples", "Cannot mix iteration-based and sample-based scheduler fields. "
     "Found iteration fields: lr_decay_iters=100"),
    (C.SchedulerConfig, {"override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": True},
     AssertionError, "scheduler.override_opt_param_scheduler", "both override and use-checkpoint are set."),
    (C.ProfilingConfig, {"profile_step_start": 10, "profile_step_end": 5}, AssertionError,
     "profiling.profile_step_end", "profile_step_end (5) must be >= profile_step_start (10)"),
    (C.ProfilingConfig, {"profile_step_start": -1, "profile_step_end": 5}, AssertionError,
     "profiling.profile_step_start", "profile_step_start must be >= 0, got -1"),
    (C.ProfilingConfig, {"profile_step_start": -5, "profile_step_end": -1}, AssertionError,
     "profiling.profile_step_start", "profile_step_start must be >= 0, got -5"),
    (C.ProfilingConfig, {"profile_step_start": 0, "profile_step_end": -1}, AssertionError,
     "profiling.profile_step_end", "profile_step_end must be >= 0, got -1"),
    (C.ProfilingConfig, {"use_pytorch_profiler": True, "use_nsys_profiler": True}, AssertionError,
     "profiling.use_nsys_profiler",
     "Exactly one of pytorch or nsys profiler should be enabled, not both, when ProfilingConfig is active."),
    (C.NVRxStragglerDetectionConfig, {"enabled": True, "report_time_interval": 0.0}, ValueError,
     "nvrx_straggler.report_time_interval", "report_time_interval must be positive."),
    (C.NVRxStragglerDetectionConfig, {"enabled": True, "calc_relative_gpu_perf": False,
                                      "calc_individual_gpu_perf": False}, ValueError,
     "nvrx_straggler.calc_relative_gpu_perf", "At least one of calc_relative_gpu_perf or calc_individual_gpu_perf"),
    (C.NVRxStragglerDetectionConfig, {"enabled": True, "gpu_relative_perf_threshold": 1.5}, ValueError,
     "nvrx_straggler.gpu_relative_perf_threshold", "gpu_relative_perf_threshold must be between 0.0 and 1.0."),
    (C.CheckpointConfig, {"load_main_params_from_ckpt": True, "load_optim": True}, AssertionError,
     "checkpoint.load_main_params_from_ckpt", "load_main_params_from_ckpt must be used with load_optim=False"),
    (C.CheckpointConfig, {"ckpt_step": 5000}, ValueError, "checkpoint.ckpt_step",
     "ckpt_step=5000 specified but checkpoint.load is None. Please set checkpoint.load to the base checkpoint "
     "directory."),
    (C.LoggerConfig, {"mlflow_experiment": "exp"}, ValueError, "logger.mlflow_run_name",
     "Set logger.mlflow_run_name when enabling MLFlow logging."),
    (C.LoggerConfig, {"mlflow_experiment": "exp", "mlflow_run_name": ""}, ValueError, "logger.mlflow_run_name",
     "Set logger.mlflow_run_name when enabling MLFlow logging."),
    (C.LoggerConfig, {"comet_project": "proj"}, ValueError, "logger.comet_experiment_name",
     "Set logger.comet_experiment_name when enabling Comet ML logging."),
    (C.LoggerConfig, {"wandb_project": "proj", "wandb_exp_name": ""}, ValueError, "logger.wandb_exp_name",
     "Please specify the wandb experiment name!"),
])
def test_a_section_says_bridges_words_after_the_key_as_bridges_exception(section, values, exc_type, key, words):
    _raises(exc_type, section(**values).finalize, key, words)


def _container(**train):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_seed_config import _python_built

    cfg = _python_built()
    cfg.scheduler.lr_warmup_fraction = None
    for name, value in train.items():
        setattr(cfg.train, name, value)
    return cfg


@pytest.mark.parametrize("train, scheduler, key, words", [
    ({"train_iters": None, "train_samples": 64}, {"lr_decay_iters": 4}, "scheduler.lr_decay_iters",
     "Use lr_decay_samples for sample-based training, not lr_decay_iters"),
    ({"train_iters": None, "train_samples": 64}, {"lr_warmup_iters": 2}, "scheduler.lr_warmup_iters",
     "Use lr_warmup_samples for sample-based training, not lr_warmup_iters"),
    ({"train_iters": None, "train_samples": 64}, {"lr_warmup_fraction": 0.1, "lr_warmup_samples": 8},
     "scheduler.lr_warmup_fraction", "Cannot specify lr_warmup_fraction=0.1"),  # the section's own rule first
    ({}, {"lr_decay_samples": 40}, "scheduler.lr_decay_samples",
     "Use lr_decay_iters for iteration-based training, not lr_decay_samples"),
    ({}, {"lr_warmup_samples": 8}, "scheduler.lr_warmup_samples",
     "Use lr_warmup_iters for iteration-based training, not lr_warmup_samples"),
])
def test_the_sample_based_scheduler_rules_are_bridges(train, scheduler, key, words):
    cfg = _container(**train)
    for name, value in scheduler.items():
        setattr(cfg.scheduler, name, value)

    def update():
        cfg.finalize_sections()
        cfg.validate(world_size=1)

    _raises(AssertionError, update, key, words)


def test_a_job_file_still_gets_one_line_naming_the_file_and_the_key(tmp_path):
    """bridge-submit keeps its form: Bridge's words after the file and the key, exit 2, no traceback."""
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{TINY}"\n[profiling]\nprofile_step_start = -1\n')
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {job}: key 'profiling.profile_step_start': profile_step_start must be >= 0, got -1"]


# ---------------------------------------------------------------------------------------------
# 2. Logger configuration semantics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{"mlflow_tags": {"team": "a"}}, {"mlflow_tracking_uri": "file:///tmp/mlruns"},
                                    {"comet_workspace": "ws"}, {"comet_tags": ["a"]},
                                    {"mlflow_experiment": "e", "mlflow_run_name": "r", "mlflow_description": "d"},
                                    {"comet_project": "p", "comet_experiment_name": "x"}])
def test_mlflow_and_comet_fields_bridge_accepts_are_accepted(values):
    C.LoggerConfig(**values).finalize()


@pytest.mark.parametrize("package, values, key, words", [
    ("mlflow", {"mlflow_experiment": "e", "mlflow_run_name": "r"}, "logger.mlflow_experiment",
     "MLFlow logging is configured, but the 'mlflow' package is not installed. "
     "Install it via pip install mlflow or uv add mlflow"),
    ("mlflow", {"mlflow_tags": {"a": "b"}}, "logger.mlflow_tags", "MLFlow logging is configured"),
    ("comet_ml", {"comet_project": "p", "comet_experiment_name": "x"}, "logger.comet_project",
     "Comet ML logging is configured, but the 'comet_ml' package is not installed. "
     "Install it via pip install comet-ml or uv add comet-ml"),
    ("comet_ml", {"comet_workspace": "ws"}, "logger.comet_workspace", "Comet ML logging is configured"),
])
def test_a_missing_backend_package_is_bridges_module_not_found_error(monkeypatch, package, values, key, words):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: find_spec and import fail
    err = _raises(ModuleNotFoundError, C.LoggerConfig(**values).finalize, key, words)
    assert err.name == package


LOGGERS_ON = ('[logger]\nwandb_project = "p"\nwandb_exp_name = "x"\nmlflow_experiment = "e"\nmlflow_run_name = "r"\n'
              'mlflow_tags = { team = "a" }\ncomet_project = "p"\ncomet_experiment_name = "x"\n')


def test_the_dry_run_checks_the_logger_packages_without_importing_torch_megatron_or_a_logger(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{TINY}"\n' + LOGGERS_ON)
    code = ("import sys; from bridge_hpc.cli.submit import main\n"
            "assert main(['job.toml', '--dry-run']) == 0\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'megatron', 'nvidia_resiliency_ext', 'wandb', 'mlflow', 'comet_ml')]\n"
            "assert not heavy, heavy\n"
            "import bridge_hpc.training.config as c\n"
            "assert 'megatron' not in sys.modules and c.LoggerConfig and c.DatasetProvider\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# 3. Dataset types: megatron-core's classes on the ranks
# ---------------------------------------------------------------------------------------------


def test_the_dataset_configs_are_megatron_core_subclasses():
    from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig

    from bridge_hpc.training.config import GPTDatasetConfig, GPTFIMDatasetConfig, MockGPTDatasetConfig

    masks = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)  # Bridge requires them
    mock = MockGPTDatasetConfig(seq_length=64, **masks)
    plain = GPTDatasetConfig(seq_length=64, **masks)
    fim = GPTFIMDatasetConfig(fim_rate=0.3, seq_length=64, **masks)
    for cfg in (mock, plain, fim):
        assert isinstance(cfg, MCoreGPTDatasetConfig) and isinstance(cfg, BlendedMegatronDatasetConfig)
        assert isinstance(cfg, GPTDatasetConfig) and cfg.sequence_length == cfg.seq_length == 64
    assert isinstance(mock, GPTDatasetConfig) and isinstance(fim, GPTDatasetConfig)
    mock.finalize()  # megatron-core's deferred validation runs: mock mode, its split matrix
    assert mock.mock and mock.split == "1,1,1" and len(mock.split_matrix) == 3


def test_gpt_fim_dataset_config_without_data_is_mock_data_as_in_bridge():
    from bridge_hpc.training.config import GPTFIMDatasetConfig

    cfg = GPTFIMDatasetConfig(seq_length=32,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    cfg.finalize()
    assert cfg.mock and (cfg.fim_rate, cfg.fim_spm_rate) == (0.5, 0.5) and cfg.split_matrix is not None


@pytest.mark.parametrize("field", ["blend", "blend_per_split"])
def test_a_mock_config_with_a_blend_is_bridges_type_error(field):
    from bridge_hpc.training.config import MockGPTDatasetConfig

    value = (["/data/x"], None) if field == "blend" else [(["/data/x"], None), None, None]
    cfg = MockGPTDatasetConfig(seq_length=64, **{field: value})
    _raises(TypeError, cfg.finalize, f"dataset.{field}", f"got an unexpected keyword argument '{field}'")


def test_the_job_files_description_becomes_megatron_cores_class_on_the_ranks(tmp_path):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig

    from bridge_hpc.rank import build_config
    from bridge_hpc.training.config import MockGPTDatasetConfig, runtime_config_update
    from bridge_hpc.training.datasets import config as described

    cfg = build_config(str(TINY), [f"job.run_dir={tmp_path / 'run'}"])
    assert type(cfg.dataset) is described.MockGPTDatasetConfig  # what the login node checks: torch-free
    before = {f: getattr(cfg.dataset, f) for f in ("seq_length", "random_seed", "num_workers")}
    runtime_config_update(cfg)  # the ranks
    assert type(cfg.dataset) is MockGPTDatasetConfig and isinstance(cfg.dataset, MCoreGPTDatasetConfig)
    assert {f: getattr(cfg.dataset, f) for f in before} == before and cfg.dataset.mock


def test_megatron_cores_own_checks_run_on_the_ranks(tmp_path):
    """The ranks' class runs megatron-core's deferred validation after the description's checks: an
    assertion of megatron-core is a ConfigError (and AssertionError) naming the section, in its words."""
    from bridge_hpc.prepare.shards import prepare_local
    from bridge_hpc.training.config import GPTDatasetConfig, TokenizerConfig

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 5}) + "\n" for i in range(200)))
    tokenizer = TokenizerConfig(tokenizer_type="ByteLevelTokenizer")
    tokenizer.finalize()
    (record,) = prepare_local([str(tmp_path / "docs.jsonl")], str(tmp_path / "docs"), tokenizer, ["text"],
                              append_eod=True, workers=1)
    prefix = record.outputs["text"].prefix
    cfg = GPTDatasetConfig(seq_length=16, data_path=[prefix], path_to_cache=str(tmp_path / "cache"),
                           split="1,0,0", fast_cache_load=True,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    _raises(AssertionError, cfg.finalize, "dataset",
            "megatron-core: --dataloader-fast-cache-load and --data-path cannot be used together")


# ---------------------------------------------------------------------------------------------
# 4. Signatures
# ---------------------------------------------------------------------------------------------


def test_training_log_takes_pg_collection_none():
    from bridge_hpc.training.utils.train_utils import training_log

    param = inspect.signature(training_log).parameters["pg_collection"]
    assert param.default is None and param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_finish_train_takes_bridges_checkpoint_manager_and_finishes_its_async_saves():
    from bridge_hpc.training.state import GlobalState
    from bridge_hpc.training.train import _finish_train

    class CheckpointManager:  # Bridge's protocol: the call _finish_train makes
        def __init__(self):
            self.calls = []

        def finalize_async_saves(self, **kwargs):
            self.calls.append(kwargs)

    state, manager = GlobalState(), CheckpointManager()
    _finish_train(state, manager)
    assert manager.calls == [{"state": state, "blocking": True, "terminate": True}]
    _finish_train(state)  # this loop's own call: its exit decision finished the saves already
    assert len(manager.calls) == 1


MLFLOW_RUN = """
import json, sys, time
from bridge_hpc.rank import build_config
from bridge_hpc.training.state import GlobalState
from bridge_hpc.training.engine.metrics import RunStart
state = GlobalState()
state.cfg = build_config(sys.argv[2], [f"job.run_dir={sys.argv[1]}"] + json.loads(sys.argv[3]))
m = state.metrics
m.open(0, RunStart(restart_count=0, load_s=None, started_at=time.time()))
for step in range(1, 11):
    m.log({"step": step, "loss": 1.0 + step})
m.log_checkpoint_saved(10, 0.1)
print(type(state.mlflow_logger).__name__, flush=True)
state.close()
print("closed", flush=True)
"""


def test_mlflow_starts_bridges_run_with_its_name_tags_and_description(tmp_path):
    """GlobalState's MLflow logger starts the run as Bridge's does (``mlflow.set_experiment``, then
    ``mlflow.start_run(run_name=, tags=, description=)``): MLflow's own store shows each, and the run ends
    finished when the logs close."""
    run_dir = tmp_path / "run"
    on = ['logger.mlflow_experiment="bridge-test"', 'logger.mlflow_run_name="tiny"',
          'logger.mlflow_tags={team="data", size="tiny"}', 'logger.mlflow_description="a tiny run"']
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    proc = subprocess.run([sys.executable, "-c", MLFLOW_RUN, str(run_dir), str(TINY), json.dumps(on)],
                          capture_output=True, text=True, timeout=300, env=dict(env, PYTHONPATH=REPO))
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-4000:]
    from bridge_hpc.contracts.run_folder import LOGGER_RUNS_FILE

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    entry = json.loads((run_dir / LOGGER_RUNS_FILE).read_text())["mlflow"]
    client = MlflowClient(tracking_uri=entry["tracking_uri"])
    run = client.get_run(entry["run_id"])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "bridge-test"
    assert {k: run.data.tags[k] for k in ("team", "size")} == {"team": "data", "size": "tiny"}
    assert run.data.tags["mlflow.note.content"] == "a tiny run"  # MLflow's description
    assert run.data.params["train.train_iters"]  # the config, as params
    assert [m.step for m in client.get_metric_history(run.info.run_id, "lm loss")] == list(range(1, 11))
