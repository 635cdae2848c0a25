"""The config seed page's names (bridge.training.config): runtime_config_update, mimo_runtime_config_update,
TensorInspectConfig and GPTFIMDatasetConfig.

runtime_config_update is checked on a container built in Python (nothing finalized yet) with numbers
worked out by hand, and through pretrain on one gloo rank. Fill-in-the-middle is checked on a real
indexed dataset prepared with the byte-level tokenizer: every complete segment of a FIM sample must be
its plain segment rearranged, with the three sentinel tokens, and reassemble into it exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import List

import numpy as np
import pytest
from bridge_test_helpers import TINY, single_rank_world
from warm_ranks import run_module

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training.comm_overlap import CommOverlapConfig
from bridge_hpc.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    GPTDatasetConfig,
    GPTFIMDatasetConfig,
    GPTModelConfig,
    LoggerConfig,
    MockGPTDatasetConfig,
    OptimizerConfig,
    SchedulerConfig,
    TensorInspectConfig,
    TokenizerConfig,
    TrainingConfig,
    mimo_runtime_config_update,
    runtime_config_update,
)
from bridge_hpc.training.mixed_precision import MixedPrecisionConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 32
FIM_SPECIALS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
# Byte-level ids (bridge_hpc.training.tokenizers): bytes 0-255, <eod> 256, <pad> 257, then the special
# tokens in order: <fim_prefix> 258, <fim_middle> 259, <fim_suffix> 260, <fim_pad> 261.
EOD, PAD, PREFIX, MIDDLE, SUFFIX = 256, 257, 258, 259, 260


@pytest.fixture(scope="module")
def single_rank():
    """A gloo world of one with megatron's model-parallel state, as pretrain has it."""
    yield from single_rank_world()


# ---------------------------------------------------------------------------------------------
# runtime_config_update
# ---------------------------------------------------------------------------------------------


def _python_built(**optimizer) -> ConfigContainer:
    """A container as a Bridge user builds it in Python: no section finalized."""
    return ConfigContainer(
        train=TrainingConfig(train_iters=8, micro_batch_size=2, global_batch_size=16, eval_interval=None),
        model=GPTModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=SEQ),
        optimizer=OptimizerConfig(**{"lr": 1e-3, "weight_decay": 0.05, **optimizer}),
        scheduler=SchedulerConfig(lr_warmup_fraction=0.25),
        dataset=MockGPTDatasetConfig(seq_length=SEQ, num_workers=0, reset_position_ids=False,
                                     reset_attention_mask=False, eod_mask_loss=False),
        logger=LoggerConfig(),
        checkpoint=CheckpointConfig(save="/tmp/x/checkpoints"),
    )


def test_runtime_config_update_finalizes_and_cross_checks_a_python_built_container(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = _python_built(use_distributed_optimizer=True)
    assert not cfg.sections_finalized and cfg.optimizer.min_lr is None and cfg.checkpoint.load is None
    runtime_config_update(cfg)
    assert cfg.sections_finalized
    # deferred finalize(): defaults that depend on other fields of the same section
    assert cfg.optimizer.min_lr == 0.0 and cfg.checkpoint.load == "/tmp/x/checkpoints"
    assert cfg.model.ffn_hidden_size == 4 * 32 and cfg.model.num_query_groups == 4
    assert cfg.train.exit_signal  # the default stop signals were filled in
    # world 4 / model-parallel 1 = data-parallel 4; 16 = 2 micro x 4 ranks x 2 micro-batches
    assert cfg.data_parallel_size == 4
    # the distributed optimizer is turned on on the DDP side too
    assert cfg.ddp.use_distributed_optimizer and cfg.optimizer.use_distributed_optimizer
    # scheduler: decay over train_iters (8), warm-up 0.25 x 8 = 2 iterations, weight decay constant 0.05
    assert cfg.scheduler.lr_decay_iters == 8 and cfg.scheduler.lr_decay_steps == 8 * 16
    assert cfg.scheduler.lr_warmup_steps == 2 * 16  # counted in samples, as megatron-core's scheduler counts
    assert cfg.scheduler.start_weight_decay == cfg.scheduler.end_weight_decay == 0.05
    assert cfg.dataset.vocab_size == cfg.model.vocab_size == 128
    # a second call finalizes nothing again but follows the world: 2 ranks -> data-parallel 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg.optimizer.min_lr = 5e-4
    runtime_config_update(cfg)
    assert cfg.data_parallel_size == 2 and cfg.optimizer.min_lr == 5e-4


def test_runtime_config_update_syncs_the_distributed_optimizer_from_ddp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = _python_built()
    cfg.ddp = DistributedDataParallelConfig(use_distributed_optimizer=True)
    runtime_config_update(cfg)
    assert cfg.optimizer.use_distributed_optimizer and cfg.ddp.use_distributed_optimizer
    plain = _python_built()
    runtime_config_update(plain)
    assert not plain.optimizer.use_distributed_optimizer and not plain.ddp.use_distributed_optimizer


@pytest.mark.parametrize("world, change, key", [
    ("3", {}, "train.global_batch_size"),  # 16 is not a multiple of 2 x 3
    ("1", {"bf16": True}, "optimizer.bf16"),  # optimizer bf16, model fp32
    ("1", {"lr": None}, "optimizer.lr"),  # a finalize() check, reached through the update
])
def test_runtime_config_update_names_the_key(monkeypatch, world, change, key):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ConfigError) as err:
        runtime_config_update(_python_built(**change))
    assert err.value.key == key


def test_runtime_config_update_applies_a_mixed_precision_recipe_name(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = _python_built()
    cfg.mixed_precision = "bf16-mixed"  # Bridge accepts either spelling
    cfg.ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=False)
    runtime_config_update(cfg)
    assert isinstance(cfg.mixed_precision, MixedPrecisionConfig) and cfg.mixed_precision.bf16
    assert (cfg.model.bf16, cfg.optimizer.bf16, cfg.model.fp16, cfg.optimizer.fp16) == (True, True, False, False)
    assert cfg.ddp.grad_reduce_in_fp32  # the recipe reduces gradients in fp32
    fp16 = _python_built()
    fp16.mixed_precision = MixedPrecisionConfig(fp16=True, grad_reduce_in_fp32=False)
    runtime_config_update(fp16)
    assert (fp16.model.fp16, fp16.optimizer.fp16, fp16.model.bf16, fp16.ddp.grad_reduce_in_fp32) == (True, True, False, False)


@pytest.mark.parametrize("mixed_precision, key", [
    ("fp8_mixed", "mixed_precision"),  # no such recipe (in Bridge neither)
    (MixedPrecisionConfig(bf16=True, fp8="hybrid"), "mixed_precision.fp8"),
    (MixedPrecisionConfig(bf16=True, params_dtype="float16"), "mixed_precision.params_dtype"),
    (MixedPrecisionConfig(bf16=True, fp16=True), "mixed_precision.bf16"),
])
def test_runtime_config_update_refuses_precision_it_cannot_run(monkeypatch, mixed_precision, key):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = _python_built()
    cfg.mixed_precision = mixed_precision
    with pytest.raises(ConfigError) as err:
        runtime_config_update(cfg)
    assert err.value.key == key
    assert not cfg.model.bf16 and not cfg.model.fp16  # nothing half-applied


def test_comm_overlap_sets_the_data_parallel_overlaps_with_the_distributed_optimizer(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _python_built(use_distributed_optimizer=True)  # turned on in ddp by the update
    cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False)
    runtime_config_update(cfg)
    assert cfg.comm_overlap.data_parallel_size == 2
    # Bridge's defaults above one data-parallel rank: both overlaps on, 128 MiB buckets
    assert cfg.ddp.overlap_grad_reduce and cfg.ddp.overlap_param_gather
    assert cfg.ddp.bucket_size == 128 * 1024 * 1024
    # a value the user sets wins
    mine = _python_built(use_distributed_optimizer=True)
    mine.comm_overlap = CommOverlapConfig(tp_comm_overlap=False, overlap_param_gather=False, bucket_size=10**6)
    runtime_config_update(mine)
    assert mine.ddp.overlap_grad_reduce and not mine.ddp.overlap_param_gather and mine.ddp.bucket_size == 10**6
    # one data-parallel rank: nothing to overlap
    monkeypatch.setenv("WORLD_SIZE", "1")
    single = _python_built(use_distributed_optimizer=True)
    single.comm_overlap = CommOverlapConfig(tp_comm_overlap=False)
    runtime_config_update(single)
    assert not single.ddp.overlap_grad_reduce and not single.ddp.overlap_param_gather


def test_comm_overlap_param_gather_without_the_distributed_optimizer_names_the_key(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _python_built()
    cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False, overlap_param_gather=True)
    with pytest.raises(ConfigError) as err:
        runtime_config_update(cfg)
    assert err.value.key == "comm_overlap.overlap_param_gather"
    plain = _python_built()
    plain.comm_overlap = CommOverlapConfig(tp_comm_overlap=False)
    runtime_config_update(plain)  # without the distributed optimizer the overlaps stay off
    assert not plain.ddp.overlap_grad_reduce and not plain.ddp.overlap_param_gather


def test_job_file_mixed_precision_recipe_and_comm_overlap_reach_the_ranks(tmp_path, monkeypatch):
    """``mixed_precision = "bf16_mixed"`` and ``[comm_overlap]`` in TOML: the recipe is recorded as its
    fields (resolved.toml says what ran) and the ranks' update applies both."""
    import toml

    from bridge_hpc.jobfile.jobconfig import load_job_config

    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{TINY}"\nmixed_precision = "bf16_mixed"\n\n[optimizer]\nuse_distributed_optimizer = true\n'
                   "\n[comm_overlap]\ntp_comm_overlap = false\nbucket_size = 4000000\n")
    loaded = load_job_config(str(job))
    recorded = toml.loads(toml.dumps(loaded.raw))["mixed_precision"]  # what resolved.toml holds
    assert recorded == {"bf16": True, "params_dtype": "bfloat16", "pipeline_dtype": "bfloat16"}
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = loaded.training
    runtime_config_update(cfg)
    assert cfg.model.bf16 and cfg.optimizer.bf16 and cfg.ddp.grad_reduce_in_fp32
    assert cfg.ddp.overlap_grad_reduce and cfg.ddp.overlap_param_gather and cfg.ddp.bucket_size == 4000000


def _refused_at_submission(tmp_path, text: str, key: str) -> str:
    """``bridge-submit --dry-run`` of the tiny job plus ``text``: exit 2, one message naming the file and
    ``key``, no traceback, nothing on stdout. Returns stderr."""
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{TINY}"\n' + text)
    proc = subprocess.run([sys.executable, "-m", "bridge_hpc.cli.submit", str(job), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert f"{job}" in proc.stderr and f"'{key}'" in proc.stderr, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("text, key", [
    ('mixed_precision = "fp8_mixed"\n', "mixed_precision"),
    ('[mixed_precision]\nbf16 = true\nfp8 = "hybrid"\n', "mixed_precision.fp8"),
    ("[comm_overlap]\nbucket_size = 0\n", "comm_overlap.tp_comm_overlap"),  # Bridge's required field
    ("[comm_overlap]\ntp_comm_overlap = false\nbucket_size = 0\n", "comm_overlap.bucket_size"),
])
def test_bad_precision_or_overlap_in_a_job_file_is_exit_2_naming_file_and_key(tmp_path, text, key):
    _refused_at_submission(tmp_path, text, key)


# ---------------------------------------------------------------------------------------------
# DistributedInitConfig and StragglerDetectionConfig
# ---------------------------------------------------------------------------------------------


def test_distributed_init_config_has_bridge_fields_and_lazy_init_is_lazy_mpu_init():
    from bridge_hpc.training.config import DistributedInitConfig

    cfg = DistributedInitConfig()
    assert (cfg.external_gpu_device_mapping, cfg.enable_megatron_core_experimental, cfg.use_decentralized_pg,
            cfg.lazy_init) == (False, False, False, False)
    cfg.finalize()
    cfg.lazy_init = True  # Bridge's property writes megatron's field
    assert cfg.lazy_mpu_init is True and cfg.lazy_init is True
    with pytest.raises(ConfigError) as err:
        cfg.finalize()
    assert err.value.key == "dist.lazy_mpu_init"


@pytest.mark.parametrize("text, key, words", [
    ("[dist]\nuse_decentralized_pg = true\n", "dist.use_decentralized_pg", "ProcessGroupCollection"),
    ("[dist]\nlazy_mpu_init = true\n", "dist.lazy_mpu_init", "external manager"),
    ("[straggler]\nlog_straggler = true\n", "straggler.log_straggler", "[nvrx_straggler] enabled = true"),
])
def test_dist_and_straggler_settings_this_trainer_cannot_honour_are_exit_2(tmp_path, text, key, words):
    assert words in _refused_at_submission(tmp_path, text, key)


@pytest.mark.parametrize("text, key", [
    ('[ddp]\nparam_name_patterns_for_fp32_local_accumulation = ["*.bias"]\n',
     "ddp.param_name_patterns_for_fp32_local_accumulation"),
    ("[dataset]\ntrust_remote_code = true\n", "dataset.trust_remote_code"),
    ("[checkpoint]\nuse_persistent_ckpt_worker = false\n", "checkpoint.use_persistent_ckpt_worker"),
    ('[checkpoint]\nasync_strategy = "mcore"\n', "checkpoint.async_strategy"),
    ('[checkpoint]\nasync_write_results_mp_mode = "spawn"\n', "checkpoint.async_write_results_mp_mode"),
    ("[checkpoint]\nstrict_fsdp_dtensor_load = true\n", "checkpoint.strict_fsdp_dtensor_load"),
    ('[checkpoint]\ncustom_manager_class = "my.Manager"\n', "checkpoint.custom_manager_class"),
    ("[checkpoint]\nstorage_writers_per_rank = 0\n", "checkpoint.storage_writers_per_rank"),
    ('[logger]\ncomet_api_key = "sk-SECRET-123"\n', "logger.comet_api_key"),  # COMET_API_KEY via [env] instead
    ("[validation]\nfull_validation = true\n", "validation.full_validation"),
    ("[validation]\neval_interval = 5\n\n[train]\neval_interval = 7\n", "validation.eval_interval"),
])
def test_bridge_fields_this_trainer_cannot_honour_are_exit_2_naming_the_key(tmp_path, text, key):
    """Bridge's documented fields exist with Bridge's names; a value this trainer cannot act on is one
    clear error, never silently ignored, and a secret in one is never echoed."""
    assert "SECRET" not in _refused_at_submission(tmp_path, text, key)


def test_validation_section_is_the_home_of_eval_settings_and_train_keeps_the_old_spelling():
    from bridge_hpc.training.config import ValidationConfig

    assert dataclasses.asdict(ValidationConfig()) == {  # megatron's ValidationConfig defaults
        "eval_iters": 100, "eval_interval": None, "start_eval_at_iter": None, "eval_global_batch_size": None,
        "eval_micro_batch_size": None, "skip_train": False, "test_mode": False, "full_validation": False,
        "multiple_validation_sets": False, "validation_set_names": None}
    old = _python_built()
    old.train.eval_interval, old.train.eval_iters = 4, 3  # Bridge's deprecated spelling
    old.finalize_sections()
    assert (old.validation.eval_interval, old.validation.eval_iters, old.validation.skip_train) == (4, 3, False)
    assert (old.train.eval_interval, old.train.eval_iters, old.train.skip_train) == (4, 3, False)
    new = _python_built()
    new.validation = ValidationConfig(eval_interval=2, eval_iters=1, skip_train=True)
    new.finalize_sections()
    assert (new.train.eval_interval, new.train.eval_iters, new.train.skip_train) == (2, 1, True)
    plain = _python_built()  # neither: megatron's defaults, no evaluation while training
    plain.train.eval_interval = None
    plain.finalize_sections()
    assert (plain.validation.eval_interval, plain.validation.eval_iters) == (None, 100)


@pytest.mark.parametrize("spelling", ["train", "validation"])
def test_an_eval_setting_error_names_the_key_as_the_config_spelled_it(monkeypatch, spelling):
    from bridge_hpc.training.config import ValidationConfig

    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = _python_built()
    if spelling == "train":
        cfg.train.eval_interval, cfg.train.eval_iters = 5, 0
    else:
        cfg.validation = ValidationConfig(eval_interval=5, eval_iters=0)
    cfg.finalize_sections()
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert err.value.key == f"{spelling}.eval_iters" and f"{spelling}.eval_interval" in err.value.message


def test_post_init_is_deferred_to_finalize_as_in_bridge():
    """Bridge's DDP, optimizer and GPT dataset configs compute nothing at construction (their
    ``__post_init__``): a field changed afterwards still counts when ``finalize()`` derives the rest."""
    opt = OptimizerConfig(lr=1e-3)
    opt.__post_init__()
    assert opt.min_lr is None  # nothing derived yet
    opt.lr = 2e-3
    opt.finalize()
    assert opt.min_lr == 0.0 and opt.lr == 2e-3
    ddp = DistributedDataParallelConfig()
    before = dataclasses.asdict(ddp)
    ddp.__post_init__()
    assert dataclasses.asdict(ddp) == before
    data = GPTDatasetConfig(seq_length=SEQ)
    data.__post_init__()
    assert data.blend is None and data.data_path is None


def test_a_peft_that_is_no_peft_class_is_refused_naming_it():
    cfg = _python_built()
    cfg.peft = object()
    with pytest.raises(ConfigError) as err:
        cfg.finalize_sections()
    assert err.value.key == "peft"


def test_log_non_default_values_names_each_changed_field_with_its_default(caplog):
    import logging

    cfg = _python_built()
    cfg.finalize_sections()
    with caplog.at_level(logging.INFO, logger="bridge_hpc.training.config"):
        cfg.log_non_default_values()
    lines = {r.getMessage().split(" ")[1]: r.getMessage() for r in caplog.records}
    assert "train_iters = 8 (default None)" in lines["[train]"]
    assert "global_batch_size = 16 (default None)" in lines["[train]"]
    assert "weight_decay = 0.05 (default 0.01)" in lines["[optimizer]"]
    assert "lr_warmup_fraction = 0.25 (default None)" in lines["[scheduler]"]
    assert "[ddp]" not in lines and "[rng]" not in lines  # untouched sections: no line
    assert "hidden_size = 32 (default" in lines["[model]"] and "num_layers = 1 (default" in lines["[model]"]
    cfg.profiling.profile_ranks = list(range(1000))  # a long value (4890 characters) is cut, saying how long
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bridge_hpc.training.config"):
        cfg.log_non_default_values()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config [profiling]")]
    assert "profile_ranks = [0, 1, 2, " in line and "... (4890 chars) (default [0])" in line and len(line) < 400


def test_enable_megatron_core_experimental_sets_megatron_cores_flag(single_rank):
    from megatron.core.config import is_experimental_enabled

    from bridge_hpc.training.config import DistributedInitConfig
    from bridge_hpc.training.pretrain import initialize_distributed

    try:
        initialize_distributed(DistributedInitConfig(enable_megatron_core_experimental=True))
        assert is_experimental_enabled()
    finally:
        initialize_distributed(DistributedInitConfig())
    assert not is_experimental_enabled()


def test_pretrain_goes_through_runtime_config_update(single_rank, tmp_path):
    """Before runtime_config_update, optimizer.use_distributed_optimizer without ddp's was refused;
    now pretrain syncs the two and trains."""
    from bridge_hpc.rank import build_config
    from bridge_hpc.training.engine.metrics import read_metrics
    from bridge_hpc.training.gpt_step import forward_step
    from bridge_hpc.training.pretrain import pretrain

    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    cfg = build_config(str(job), [f"job.run_dir={tmp_path / 'run'}", "train.train_iters=2", "train.global_batch_size=4",
                                  "train.eval_interval=0", "checkpoint.save_interval=2",
                                  "scheduler.lr_warmup_iters=1", "optimizer.use_distributed_optimizer=true"])
    assert not cfg.ddp.use_distributed_optimizer
    pretrain(cfg, forward_step)
    assert cfg.ddp.use_distributed_optimizer and cfg.data_parallel_size == 1
    assert sorted(read_metrics(cfg.logger.metrics_file)) == [1, 2]


def test_skip_train_metrics_log_writes_no_step_log_but_trains_and_saves(single_rank, tmp_path, capsys):
    from bridge_hpc.rank import build_config
    from bridge_hpc.training.gpt_step import forward_step
    from bridge_hpc.training.pretrain import pretrain

    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    cfg = build_config(str(job), [f"job.run_dir={tmp_path / 'run'}", "train.train_iters=2", "train.global_batch_size=4",
                                  "train.eval_interval=0", "checkpoint.save_interval=2", "scheduler.lr_warmup_iters=1",
                                  "logger.log_interval=1", "logger.skip_train_metrics_log=true"])
    pretrain(cfg, forward_step)
    out = capsys.readouterr().out
    assert "iteration        1/" not in out and "lm loss" not in out  # no console step line
    metrics = Path(cfg.logger.metrics_file)
    assert not metrics.exists() or metrics.read_text().strip() == ""
    assert (Path(cfg.checkpoint.save) / "iter_0000002").is_dir()  # trained and saved all the same


# ---------------------------------------------------------------------------------------------
# DatasetProvider, DatasetBuildContext and MegatronTokenizer
# ---------------------------------------------------------------------------------------------


def test_a_custom_dataset_provider_gets_the_run_sizes_and_tokenizer_and_is_trained_on(single_rank, tmp_path):
    """Bridge's DatasetProvider example (a user's own source): build_datasets gets a DatasetBuildContext
    with megatron's sample counts and the run's tokenizer, returns (train, valid, test) with None for a
    split it does not have, and the run trains on exactly its samples, in order."""
    from bridge_hpc.rank import build_config
    from bridge_hpc.training.config import DatasetBuildContext, DatasetProvider
    from bridge_hpc.training.datasets.builders import MockGPTDataset
    from bridge_hpc.training.engine.metrics import read_metrics
    from bridge_hpc.training.gpt_step import forward_step
    from bridge_hpc.training.pretrain import pretrain
    from bridge_hpc.training.tokenizers.tokenizer import MegatronTokenizer  # noqa: F401 - the type the page names

    read: List[int] = []

    class Recorded(MockGPTDataset):
        def __getitem__(self, index):
            read.append(int(index))
            return super().__getitem__(index)

    @dataclasses.dataclass
    class MyDatasetConfig(DatasetProvider):
        seq_length: int = SEQ
        contexts: list = dataclasses.field(default_factory=list)

        def build_datasets(self, context: DatasetBuildContext):
            self.contexts.append(context)
            return Recorded(context.train_samples, self.seq_length, 128, 7, "train"), None, None

    job = tmp_path / "job.toml"
    shutil.copy(TINY, job)
    cfg = build_config(str(job), [f"job.run_dir={tmp_path / 'run'}", "train.train_iters=3", "train.global_batch_size=4",
                                  "train.eval_interval=2", "train.eval_iters=1", "checkpoint.save_interval=3",
                                  "scheduler.lr_warmup_iters=1", "tokenizer.tokenizer_type=NullTokenizer",
                                  "tokenizer.vocab_size=127"])
    provider = cfg.dataset = MyDatasetConfig(num_workers=0, pin_memory=False)
    pretrain(cfg, forward_step)
    [context] = provider.contexts
    # megatron's counts: 3 steps x 4; evaluations at steps 2 and (train_iters // 2 + 1 =) 2 of them x 1 x 4; 1 x 4
    assert (context.train_samples, context.valid_samples, context.test_samples) == (12, 8, 4)
    assert context.tokenizer.vocab_size == 128 and context.tokenizer.eod == 127  # NullTokenizer(127): ids 0-127
    assert read == list(range(12))  # one rank, 3 global batches of 4: every sample once, in order
    assert sorted(read_metrics(cfg.logger.metrics_file)) == [1, 2, 3]


def test_megatron_tokenizer_is_megatron_cores_and_builds_the_configured_tokenizer():
    import megatron.core.tokenizers

    from bridge_hpc.training.tokenizers import build_tokenizer
    from bridge_hpc.training.tokenizers.tokenizer import MegatronTokenizer

    assert MegatronTokenizer is megatron.core.tokenizers.MegatronTokenizer  # as Bridge's module re-exports it
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer"))
    ids = tokenizer.tokenize("hé")
    assert ids == [104, 195, 169] and tokenizer.detokenize(ids) == "hé"  # UTF-8 bytes, by hand
    assert tokenizer.vocab_size == 258 and tokenizer.eod == 256  # 256 bytes, then <eod> and <pad>


# ---------------------------------------------------------------------------------------------
# mimo_runtime_config_update
# ---------------------------------------------------------------------------------------------


def test_mimo_runtime_config_update_refuses_gpt_models_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = _python_built(use_distributed_optimizer=True)
    before = dataclasses.asdict(cfg)
    with pytest.raises(ConfigError) as err:
        mimo_runtime_config_update(cfg)
    assert err.value.key == "model"
    assert "runtime_config_update(cfg)" in err.value.message and "MimoModelProvider" in err.value.message
    assert dataclasses.asdict(cfg) == before and not cfg.sections_finalized


def test_mimo_runtime_config_update_says_there_are_no_mimo_models():
    cfg = _python_built()

    class MimoModelProvider:  # what a Bridge MIMO recipe would put in cfg.model
        pass

    cfg.model = MimoModelProvider()
    with pytest.raises(ConfigError) as err:
        mimo_runtime_config_update(cfg)
    assert err.value.key == "model" and "has no MIMO models" in err.value.message


# ---------------------------------------------------------------------------------------------
# TensorInspectConfig
# ---------------------------------------------------------------------------------------------


def _tiny_sections(**extra) -> dict:
    import tomllib

    with open(TINY, "rb") as f:
        doc = tomllib.load(f)
    doc.update(extra)
    return doc


def test_tensor_inspect_section_is_accepted_and_checked_while_disabled():
    section = {"enabled": False, "features": {"LogTensorStats": {"enabled": True, "stats": ["max"]}},
               "feature_dirs": ["/opt/features"], "log_dir": "inspect", "init_training_step": 5}
    cfg = ConfigContainer.from_sections(_tiny_sections(tensor_inspect=section), source="job.toml")
    assert cfg.tensor_inspect == TensorInspectConfig(**section)
    assert ConfigContainer.from_sections(_tiny_sections(), source="job.toml").tensor_inspect is None
    for bad, key in (({"init_training_step": -1}, "tensor_inspect.init_training_step"),
                     ({"feature_dirs": "/opt/features"}, "tensor_inspect.feature_dirs"),
                     ({"features": ""}, "tensor_inspect.features"),
                     ({"enable": True}, "tensor_inspect.enable")):
        with pytest.raises(ConfigError) as err:
            ConfigContainer.from_sections(_tiny_sections(tensor_inspect=bad), source="job.toml")
        assert (err.value.path, err.value.key) == ("job.toml", key)
    with pytest.raises(ConfigError, match="did you mean 'enabled'"):
        ConfigContainer.from_sections(_tiny_sections(tensor_inspect={"enable": True}), source="job.toml")


def test_tensor_inspect_enabled_is_one_clear_error_and_exit_2(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(Path(TINY).read_text() + "\n[tensor_inspect]\nenabled = true\n")
    proc = run_module("bridge_hpc.rank", [str(job)], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert f"{job}: key 'tensor_inspect.enabled': tensor inspection is not available" in lines[0]
    assert "nvdlfw_inspect" in lines[0]


# ---------------------------------------------------------------------------------------------
# GPTFIMDatasetConfig: config
# ---------------------------------------------------------------------------------------------


def _short_docs() -> List[str]:
    """Documents of 2-14 bytes: a 33-token sample then holds several whole segments to check."""
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    return [" ".join(words[(i * 7 + j) % 10][: 1 + (i + j) % 5] for j in range(1 + i % 3)) for i in range(240)]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    """One indexed dataset prepared with the byte-level tokenizer (bridge_hpc's prepare step)."""
    from bridge_hpc.prepare.shards import prepare_local

    folder = tmp_path_factory.mktemp("fim_corpus")
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _short_docs()))
    tok_cfg = TokenizerConfig(tokenizer_type="ByteLevelTokenizer")
    tok_cfg.finalize()
    (record,) = prepare_local([str(folder / "docs.jsonl")], str(folder / "docs"), tok_cfg, ["text"],
                              append_eod=True, workers=1)
    return record.outputs["text"].prefix


def _sections(tmp_path: Path, dataset: dict, specials=FIM_SPECIALS) -> dict:
    return {
        "train": {"train_iters": 4, "micro_batch_size": 2, "global_batch_size": 4, "eval_interval": 0,
                  "eval_iters": 0},
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": SEQ},
        "optimizer": {"lr": 1e-3},
        "dataset": {"num_workers": 0, "pin_memory": False, "split": "1", **dataset},
        "checkpoint": {"save": str(tmp_path / "run" / "checkpoints")},
        "tokenizer": {"tokenizer_type": "ByteLevelTokenizer", "special_tokens": list(specials)},
    }


def test_fim_keys_select_gpt_fim_dataset_config_with_megatron_lm_defaults(tmp_path, prefix):
    cfg = ConfigContainer.from_sections(_sections(tmp_path, {"data_path": [prefix], "fim_rate": 1.0}),
                                        source="job.toml")
    from bridge_hpc.training.datasets import config as described  # the job file's: torch-free descriptions

    assert type(cfg.dataset) is described.GPTFIMDatasetConfig and issubclass(GPTFIMDatasetConfig, type(cfg.dataset))
    assert (cfg.dataset.fim_rate, cfg.dataset.fim_spm_rate) == (1.0, 0.5)
    assert cfg.dataset.fim_extra_tokens == {"prefix": "<fim_prefix>", "middle": "<fim_middle>",
                                            "suffix": "<fim_suffix>", "pad": "<fim_pad>"}
    assert cfg.dataset.blend == ([prefix], None)
    plain = ConfigContainer.from_sections(_sections(tmp_path, {"data_path": [prefix]}), source="job.toml")
    assert type(plain.dataset) is described.GPTDatasetConfig and issubclass(GPTDatasetConfig, type(plain.dataset))
    # Bridge's signature: the fim_* parameters first, GPTDatasetConfig's as keywords
    direct = GPTFIMDatasetConfig(0.3, 0.0, {"eod": "<eod>"}, data_path=[prefix], split="1", seq_length=SEQ,
                                 reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    direct.finalize()
    assert (direct.fim_rate, direct.fim_spm_rate, direct.fim_extra_tokens["eod"]) == (0.3, 0.0, "<eod>")


@pytest.mark.parametrize("fim, key, words", [
    ({"fim_rate": 1.5}, "dataset.fim_rate", "probability in [0, 1]"),
    ({"fim_extra_tokens": {"prefx": "<p>"}}, "dataset.fim_extra_tokens.prefx", "did you mean 'prefix'"),
    ({"fim_extra_tokens": {"prefix": "<x>", "middle": "<x>"}}, "dataset.fim_extra_tokens", "three different"),
    ({"fim_split_sample": "<file>"}, "dataset.fim_fragment_rate", "must be set"),
    ({"fim_rate": "high"}, "dataset.fim_rate", "expected a number"),
])
def test_fim_config_errors_name_file_and_key(tmp_path, prefix, fim, key, words):
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_sections(tmp_path, {"data_path": [prefix], **fim}), source="job.toml")
    assert (err.value.path, err.value.key) == ("job.toml", key) and words in err.value.message


def test_fim_without_data_path_reports_the_missing_data_path(tmp_path):
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_sections(_sections(tmp_path, {"fim_rate": 0.5}), source="job.toml")
    assert err.value.key == "dataset.data_path"


def test_job_loader_makes_fim_dataset_prefixes_absolute(tmp_path, prefix):
    from bridge_hpc.jobfile.jobconfig import load_job_config

    local = tmp_path / "data"
    local.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, local / ("docs" + ext))
    job = tmp_path / "job.toml"
    job.write_text(Path(TINY).read_text().replace("[dataset]\n", '[dataset]\ndata_path = ["data/docs"]\nsplit = "1"\n'
                                                                  "fim_rate = 0.9\n")
                   + '\n[tokenizer]\ntokenizer_type = "ByteLevelTokenizer"\n'
                     'special_tokens = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]\n')
    loaded = load_job_config(job, (), cwd=tmp_path)
    assert isinstance(loaded.training.dataset, GPTFIMDatasetConfig.__mro__[1])  # the torch-free description
    assert loaded.raw["dataset"]["data_path"] == [str(local / "docs")]
    assert loaded.training.dataset.blend == ([str(local / "docs")], None)


# ---------------------------------------------------------------------------------------------
# GPTFIMDatasetConfig: samples of a real indexed dataset
# ---------------------------------------------------------------------------------------------


def _built(tmp_path: Path, dataset: dict, specials=FIM_SPECIALS):
    from bridge_hpc.training.datasets.builders import build_datasets
    from bridge_hpc.training.tokenizers import build_tokenizer_for

    cfg = ConfigContainer.from_sections(_sections(tmp_path, dataset, specials), source="job.toml")
    tokenizer = build_tokenizer_for(cfg)
    runtime_config_update(cfg)
    train, valid, test = build_datasets(cfg.dataset, cfg, tokenizer)
    assert valid is None and test is None
    return train


def _plain(dataset, index: int) -> np.ndarray:
    """The sample megatron-core's GPTDataset reads at ``index``, before FIM."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    return GPTDataset._query_document_sample_shuffle_indices(dataset, index)[0]


def _segments(tokens: np.ndarray) -> List[List[int]]:
    out, current = [], []
    for t in tokens.tolist():
        if t == EOD:
            out.append(current)
            current = []
        else:
            current.append(t)
    return out + [current]


def _check_fim_sample(plain: np.ndarray, fim: np.ndarray, spm: bool) -> int:
    """Every complete FIM segment is its plain segment cut in three around the sentinels; returns how many."""
    assert len(fim) == len(plain) == SEQ + 1
    plain_segments, fim_segments = _segments(plain), _segments(fim)
    complete = fim_segments[:-1]  # the last one is cut off at the sample's end
    for original, segment in zip(plain_segments, complete):
        if not original:
            assert segment == []
            continue
        assert Counter(segment) == Counter(original + [PREFIX, MIDDLE, SUFFIX])  # a permutation + sentinels
        m = segment.index(MIDDLE)
        if spm:  # <prefix> <suffix> suffix <middle> prefix middle
            assert segment[:2] == [PREFIX, SUFFIX]
            assert segment[m + 1:] + segment[2:m] == original
        else:  # <prefix> prefix <suffix> suffix <middle> middle
            s = segment.index(SUFFIX)
            assert segment[0] == PREFIX and s < m
            assert segment[1:s] + segment[m + 1:] + segment[s + 1:m] == original
    if fim_segments[-1]:
        assert fim_segments[-1][0] == PREFIX
    return len(complete)


@pytest.mark.parametrize("spm", [False, True], ids=["psm", "spm"])
def test_fim_rate_1_rearranges_every_segment_around_the_sentinels(single_rank, tmp_path, prefix, spm):
    from bridge_hpc.training.datasets.fim import GPTFIMDataset

    train = _built(tmp_path, {"data_path": [prefix], "fim_rate": 1.0, "fim_spm_rate": 1.0 if spm else 0.0})
    assert isinstance(train, GPTFIMDataset) and len(train) >= 16
    checked = 0
    for i in range(16):
        fim = train._query_document_sample_shuffle_indices(i)[0]
        checked += _check_fim_sample(_plain(train, i), fim, spm)
        sample = train[i]  # what the loop gets: tokens/labels are the FIM sequence shifted by one
        assert sample["tokens"].tolist() == fim[:-1].tolist() and sample["labels"].tolist() == fim[1:].tolist()
    assert checked >= 16  # short documents: every sample has whole segments to check


def test_fim_rate_0_gives_the_plain_samples(single_rank, tmp_path, prefix):
    fim = _built(tmp_path / "fim", {"data_path": [prefix], "fim_rate": 0.0})
    plain = _built(tmp_path / "plain", {"data_path": [prefix]}, specials=())
    assert type(plain).__name__ == "GPTDataset" and len(fim) == len(plain)
    for i in range(len(plain)):
        a, b = fim[i], plain[i]
        assert a.keys() == b.keys() and all(a[k].tolist() == b[k].tolist() for k in a)


def test_fim_samples_are_a_function_of_seed_and_index(single_rank, tmp_path, prefix):
    dataset = {"data_path": [prefix], "fim_rate": 0.5, "fim_spm_rate": 0.5}
    first = _built(tmp_path / "a", dataset)
    again = _built(tmp_path / "b", dataset)
    n = len(first)
    forward = [first[i]["tokens"].tolist() for i in range(n)]
    backward = [again[i]["tokens"].tolist() for i in reversed(range(n))][::-1]  # another reading order
    assert forward == backward
    # rate 0.5: some samples were rearranged and some were not
    changed = sum(forward[i] != _plain(first, i)[:-1].tolist() for i in range(n))
    assert 0 < changed < n
    reseeded = _built(tmp_path / "c", {**dataset, "random_seed": 99})
    assert [reseeded[i]["tokens"].tolist() for i in range(n)] != forward


def test_fim_sentinels_missing_from_the_tokenizer_name_the_key(single_rank, tmp_path, prefix):
    with pytest.raises(ConfigError) as err:
        _built(tmp_path, {"data_path": [prefix], "fim_rate": 1.0}, specials=())
    assert err.value.key == "dataset.fim_extra_tokens.prefix" and "special_tokens" in err.value.message


# ---------------------------------------------------------------------------------------------
# apply_fim on hand-made samples: split fragments, exempt prefixes, padding
# ---------------------------------------------------------------------------------------------


def _settings(**kw):
    from bridge_hpc.training.datasets.fim import FIMSettings

    base = dict(rate=1.0, spm_rate=0.0, prefix_id=PREFIX, middle_id=MIDDLE, suffix_id=SUFFIX, eod_id=EOD)
    return FIMSettings(**{**base, **kw})


def _text(tokens) -> str:
    return bytes(int(t) for t in tokens if t < 256).decode()


def test_apply_fim_fragments_no_prefix_and_padding():
    from bridge_hpc.training.datasets.fim import apply_fim

    rng = np.random.default_rng(0)
    nl = ord("\n")
    sample = np.array(list(b"ab\ncd") + [EOD] + list(b"e\nfg") + [PAD, PAD])
    # split at newlines (both segments have one), fragments never rearranged: unchanged
    out = apply_fim(sample, _settings(split_id=nl, fragment_rate=0.0), rng, _text, pad_id=PAD)
    assert out.tolist() == sample.tolist()
    # every segment starts with the exempt text: unchanged
    out = apply_fim(np.array(list(b"#!x") + [EOD] + list(b"#!yz")), _settings(no_prefix="#!"), rng, _text)
    assert out.tolist() == list(b"#!x") + [EOD] + list(b"#!yz")
    # a segment without the split token is rearranged as a whole (Megatron-LM's rule)
    out = apply_fim(np.array(list(b"abc")), _settings(split_id=nl, fragment_rate=0.0), rng, _text).tolist()
    assert len(out) == 3 and out[0] == PREFIX  # cut back to the sample's length
    # fragments rearranged one by one, the split token kept in place, padding kept at the end
    out = apply_fim(sample, _settings(split_id=nl, fragment_rate=1.0), rng, _text, pad_id=PAD).tolist()
    assert len(out) == len(sample) and out[-2:] == [PAD, PAD] and nl in out and PREFIX in out
    first = out[:out.index(nl)]
    assert Counter(first) == Counter(list(b"ab") + [PREFIX, MIDDLE, SUFFIX])
