"""Config: TOML sections -> ConfigContainer, and bad values fail with ConfigError naming the key."""

import shutil

import pytest
import toml
from bridge_test_helpers import TINY

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.rank import build_config
from bridge_hpc.training.config import ConfigContainer
from bridge_hpc.training.datasets import config as described


def sections(**changes):
    data = toml.load(TINY)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        data.setdefault(section, {})[key] = value
    return data


def test_tiny_builds_and_validates():
    cfg = ConfigContainer.from_sections(sections(checkpoint__save="/tmp/ckpt"), source="tiny.toml")
    cfg.validate(world_size=2)
    assert cfg.checkpoint.load == "/tmp/ckpt"
    assert cfg.train.train_iters == 40 and cfg.model.hidden_size == 64
    assert cfg.model.ffn_hidden_size == 256  # finalize() derived it
    assert cfg.data_parallel_size == 2
    # the job file's loader builds the torch-free description (the ranks' class derives from it)
    assert isinstance(cfg.dataset, described.MockGPTDatasetConfig) and cfg.dataset.vocab_size == 128
    assert cfg.scheduler.lr_decay_iters == 40  # defaults to train_iters
    assert cfg.train.exit_signal == ["SIGUSR1", "SIGTERM"]  # slurm.signal's default, plus SIGTERM


def test_launcher_sections_are_ignored():
    data = sections()
    data.update(slurm={"time": "1:00:00"}, env={"FOO": "1"}, container={"image": "x"}, setup={"run": "true"})
    ConfigContainer.from_sections(data, source="job.toml")


@pytest.mark.parametrize("section,key,value,expect", [
    ("train", "train_itres", 10, "did you mean 'train_iters'"),
    ("checkpoint", "save_intervall", 10, "did you mean 'save_interval'"),
    ("optimizer", "lr", "fast", "expected a number"),
    ("train", "micro_batch_size", 2.5, "expected an integer"),
    ("logger", "log_progress", 1, "expected true or false"),
    ("optimizer", "optimizer", "lamb", "one of 'adam', 'sgd'"),
])
def test_bad_key_or_type_names_the_key(section, key, value, expect):
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(sections(**{f"{section}__{key}": value}), source="job.toml")
    assert err.value.key == f"{section}.{key}"
    assert err.value.path == "job.toml"
    assert expect in str(err.value)


def test_unknown_section_suggests():
    data = sections()
    data["trian"] = {"train_iters": 3}
    with pytest.raises(ConfigError, match="did you mean 'train'") as err:
        ConfigContainer.from_sections(data, source="job.toml")
    assert err.value.key == "trian"


@pytest.mark.parametrize("changes,key", [
    ({"train__global_batch_size": 6}, "train.global_batch_size"),  # 6 % (2 x 2) != 0
    ({"dataset__seq_length": 16}, "dataset.seq_length"),
    ({"optimizer__min_lr": 1.0}, "optimizer.min_lr"),
    ({"model__num_attention_heads": 5}, "model.num_attention_heads"),
    ({"model__tensor_model_parallel_size": 4}, "model.tensor_model_parallel_size"),  # world 2 % 4 != 0
    ({"train__exit_signal": "SIGFOO"}, "train.exit_signal"),
    ({"checkpoint__async_save_max_failures": 0}, "checkpoint.async_save_max_failures"),
    # megatron-core's fusions exist for gelu with its bias, and swiglu
    ({"model__bias_activation_fusion": True, "model__activation_func": "silu"}, "model.bias_activation_fusion"),
    ({"model__bias_activation_fusion": True, "model__add_bias_linear": False}, "model.bias_activation_fusion"),
    # megatron-core's scheduler asserts warm-up < decay steps (decay defaults to train_iters), any style
    ({"train__train_iters": 4, "scheduler__lr_warmup_iters": 4}, "scheduler.lr_warmup_iters"),
    ({"scheduler__lr_decay_style": "constant", "scheduler__lr_decay_iters": 3, "scheduler__lr_warmup_iters": 3},
     "scheduler.lr_warmup_iters"),
])
def test_inconsistent_settings_fail_in_validate(changes, key):
    with pytest.raises(ConfigError) as err:
        cfg = ConfigContainer.from_sections(sections(**changes), source="job.toml")
        cfg.validate(world_size=2)
    assert err.value.key == key


def test_save_interval_without_folder():
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(sections(), source="job.toml").validate(world_size=1)
    assert err.value.key == "checkpoint.save_interval"


def test_missing_lr_is_named():
    data = sections()
    del data["optimizer"]["lr"]
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(data, source="job.toml")
    assert err.value.key == "optimizer.lr"


def test_run_dir_defaults_and_overrides(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    job = tmp_path / "configs" / "job.toml"
    shutil.copy(TINY, job)
    monkeypatch.chdir(tmp_path)  # run_dir is relative to where the job is launched, as in bridge-submit
    cfg = build_config(str(job), ["train.train_iters=7", "logger.log_interval=1",
                                  'train.exit_signal=["SIGUSR1", "SIGTERM", "SIGINT"]'])
    run_dir = tmp_path / "runs" / "tiny"
    assert cfg.checkpoint.save == str(run_dir / "checkpoints")
    assert cfg.checkpoint.load == cfg.checkpoint.save  # a requeued job resumes by itself
    assert cfg.logger.metrics_file == str(run_dir / "metrics.jsonl")
    assert cfg.train.train_iters == 7 and cfg.logger.log_interval == 1
    assert cfg.train.exit_signal == ["SIGUSR1", "SIGTERM", "SIGINT"]
    with pytest.raises(ConfigError) as err:  # slurm.signal (default USR1) would find no handler
        build_config(str(job), ["train.exit_signal=SIGTERM"])
    assert err.value.key == "train.exit_signal" and "SIGUSR1" in err.value.message
    with pytest.raises(ConfigError) as err:
        build_config(str(job), ["train.train_iters=many"])
    assert err.value.key == "train.train_iters"
    # relative training paths live in the run folder, whichever file (job or resolved.toml) is read
    cfg = build_config(str(job), ["checkpoint.save=ckpt"])
    assert cfg.checkpoint.save == str(run_dir / "ckpt")


# --- TensorBoard: on by default in the run folder, "" turns it off, bad values exit 2 (~2 s) -------------


def _resolved_tensorboard(tmp_path, *overrides):
    """What bridge-submit writes to resolved.toml, and what the ranks build from that file."""
    from bridge_hpc.jobfile.jobconfig import dump_resolved, load_job_config

    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    text = dump_resolved(load_job_config(job, list(overrides), cwd=tmp_path))
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(text)
    return toml.loads(text)["logger"].get("tensorboard_dir"), build_config(str(resolved)).logger.tensorboard_dir


def test_tensorboard_is_on_by_default_in_the_run_folder(tmp_path):
    from bridge_hpc.contracts.run_folder import RunFolder

    written, on_the_ranks = _resolved_tensorboard(tmp_path)
    assert written == on_the_ranks == RunFolder(str(tmp_path / "runs" / "tiny")).tensorboard
    assert on_the_ranks.endswith("/runs/tiny/tensorboard")
    written, on_the_ranks = _resolved_tensorboard(tmp_path, 'logger.tensorboard_dir="tb"')
    assert written == on_the_ranks == str(tmp_path / "runs" / "tiny" / "tb")


@pytest.mark.parametrize("off", ['logger.tensorboard_dir=""', "logger.tensorboard_dir="])
def test_an_empty_tensorboard_dir_turns_tensorboard_off(tmp_path, off):
    written, on_the_ranks = _resolved_tensorboard(tmp_path, off)
    assert written == ""  # kept in resolved.toml, so the ranks see "off" too
    assert on_the_ranks is None  # one spelling of "off" (Bridge's None) from there on


@pytest.mark.parametrize("value", ["false", "0", '"  "', '" tb"', '["tb"]'])
def test_a_bad_tensorboard_dir_exits_2_naming_the_key(tmp_path, value):
    import subprocess
    import sys

    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run",
                           "--set", f"logger.tensorboard_dir={value}"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "logger.tensorboard_dir" in proc.stderr and 'or "" to turn TensorBoard off' in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_a_bad_tensorboard_dir_built_in_python_names_the_key():
    from bridge_hpc.training.config import LoggerConfig

    with pytest.raises(ConfigError) as err:
        LoggerConfig(tensorboard_dir="   ").finalize()
    assert err.value.key == "logger.tensorboard_dir"
    cfg = LoggerConfig(tensorboard_dir="")
    cfg.finalize()
    assert cfg.tensorboard_dir is None


def test_fusions_reach_megatron_cores_transformer_config():
    from bridge_hpc.training.engine.model import transformer_config

    cfg = ConfigContainer.from_sections(sections(model__bias_activation_fusion=True, model__bias_dropout_fusion=True,
                                                 model__cross_entropy_loss_fusion=True), source="job.toml")
    tc = transformer_config(cfg.model)
    assert (tc.bias_activation_fusion, tc.bias_dropout_fusion, tc.cross_entropy_loss_fusion) == (True, True, True)
    assert tc.cross_entropy_fusion_impl == "native"
    plain = transformer_config(ConfigContainer.from_sections(sections(), source="job.toml").model)
    assert (plain.bias_activation_fusion, plain.bias_dropout_fusion, plain.cross_entropy_loss_fusion) == (False, False, False)
