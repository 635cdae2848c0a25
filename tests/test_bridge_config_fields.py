"""Every documented field of Megatron Bridge's config classes exists with its documented default, a
config that spells every field out at its default builds and finalizes, and the fields this trainer
cannot act on are refused by name with any other value (issue 27)."""

from __future__ import annotations

import dataclasses

import pytest

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.training import config as C

#: Megatron-LM's megatron.training config fields (the bases Bridge's page names; not installable here)
#: and Bridge's own, per class: the documented names every class must have.
DOCUMENTED = {
    C.RNGConfig: "seed te_rng_tracker inference_rng_tracker data_parallel_random_init",
    C.ProfilingConfig: "use_nsys_profiler profile_step_start profile_step_end use_pytorch_profiler "
                       "pytorch_profiler_collect_shapes pytorch_profiler_collect_callstack "
                       "pytorch_profiler_collect_chakra profile_ranks record_memory_history memory_snapshot_path "
                       "record_shapes nvtx_ranges",
    C.DistributedInitConfig: "distributed_backend distributed_timeout_minutes align_grad_reduce local_rank "
                             "lazy_mpu_init use_megatron_fsdp use_torch_fsdp2 nccl_communicator_config_path "
                             "use_tp_pp_dp_mapping use_gloo_process_groups use_sharp sharp_enabled_group "
                             "high_priority_stream_groups distributed_timeout_seconds_after_init "
                             "flight_recorder_dump_path flight_recorder_trace_buffer_size "
                             "flight_recorder_dump_on_timeout flight_recorder_include_stack_trace "
                             "flight_recorder_include_only_active flight_recorder_extra_dump_on_exec disable_jit_fuser "
                             "enable_megatron_core_experimental external_gpu_device_mapping use_decentralized_pg",
    C.ValidationConfig: "eval_iters eval_interval start_eval_at_iter eval_global_batch_size eval_micro_batch_size "
                        "skip_train test_mode full_validation multiple_validation_sets validation_set_names",
    C.SchedulerConfig: "lr_decay_style lr_wsd_decay_style lr_decay_iters lr_decay_samples lr_wsd_decay_iters "
                       "lr_wsd_decay_samples lr_warmup_fraction lr_warmup_iters lr_warmup_samples lr_warmup_init "
                       "lr_decay_steps lr_warmup_steps override_opt_param_scheduler use_checkpoint_opt_param_scheduler "
                       "start_weight_decay end_weight_decay weight_decay_incr_style no_weight_decay_cond_type "
                       "wd_incr_steps wsd_decay_steps",
    C.TrainingConfig: "micro_batch_size global_batch_size rampup_batch_size step_batch_size_schedule "
                      "decrease_batch_size_if_needed empty_unused_memory_level "
                      "check_weight_hash_across_dp_replicas_interval gpu_sniff_test_interval train_sync_interval "
                      "train_iters train_samples exit_interval exit_duration_in_mins exit_signal_handler exit_signal "
                      "exit_signal_handler_for_dataloader exit_signal_handler_for_training manual_gc "
                      "manual_gc_interval manual_gc_eval iterations_to_skip check_optimizer_step_success "
                      "skip_sync_grad_norm_across_mp eval_iters eval_interval skip_train",
    C.LoggerConfig: "log_interval log_params_norm log_throughput log_throughput_to_tensorboard throughput_window_size "
                    "log_progress timing_log_level timing_log_option tensorboard_dir tensorboard_log_interval "
                    "tensorboard_queue_size log_timers_to_tensorboard log_loss_scale_to_tensorboard "
                    "log_validation_ppl_to_tensorboard log_memory_to_tensorboard memory_keys log_memory_interval "
                    "log_device_memory_used log_l2_norm_grad_to_tensorboard log_num_zeros_in_grad "
                    "log_max_attention_logit log_runtime_to_tensorboard runtime_time_unit barrier_with_L1_time "
                    "log_world_size_to_tensorboard wandb_project wandb_exp_name wandb_save_dir wandb_entity "
                    "logging_level filter_warnings modules_to_filter set_level_for_all_loggers log_energy "
                    "save_config_filepath moe_routing_trace_path moe_routing_trace_max_training_iters "
                    "moe_routing_trace_capture_logits moe_routing_trace_capture_hidden_states "
                    "moe_routing_trace_dump_weights skip_train_metrics_log mlflow_experiment mlflow_run_name "
                    "mlflow_tracking_uri mlflow_tags comet_project comet_experiment_name comet_workspace "
                    "comet_api_key comet_tags",
    C.CheckpointConfig: "save save_interval save_params_interval save_activations_interval "
                        "save_tokens_per_expert_interval save_wgrads_interval save_dgrads_interval "
                        "save_retain_interval most_recent_k save_optim save_rng load load_optim "
                        "load_main_params_from_ckpt load_rng non_persistent_save_interval non_persistent_ckpt_type "
                        "non_persistent_global_ckpt_dir non_persistent_local_ckpt_dir non_persistent_local_ckpt_algo "
                        "finetune pretrained_checkpoint ckpt_step use_checkpoint_args use_mp_args_from_checkpoint_args "
                        "use_tokenizer_model_from_checkpoint_args exit_on_missing_checkpoint ckpt_format "
                        "auto_detect_ckpt_format ckpt_convert_format ckpt_convert_save "
                        "ckpt_convert_update_legacy_dist_opt_format fully_parallel_save async_save async_strategy "
                        "use_persistent_ckpt_worker async_ckpt_cpu_priority async_ckpt_io_priority "
                        "async_ckpt_use_cpu_shm fully_parallel_load ckpt_fully_parallel_load_exchange_algo "
                        "ckpt_fully_parallel_save_process_group ckpt_fully_parallel_load_process_group "
                        "ckpt_fully_parallel_save_replicate_local ckpt_fully_parallel_load_replicate_local "
                        "ckpt_assume_constant_structure ckpt_load_validate_sharding_integrity "
                        "strict_fsdp_dtensor_load dist_ckpt_strictness dist_ckpt_save_pre_mcore_014 "
                        "dist_ckpt_optim_fully_reshardable distrib_optim_fully_reshardable_mem_efficient "
                        "save_tokenizer_assets replication replication_jump replication_factor verify_integrity "
                        "storage_writers_per_rank async_write_results_mp_mode custom_manager_class",
}


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


@pytest.mark.parametrize("cls", list(DOCUMENTED), ids=lambda c: c.__name__)
def test_every_documented_field_exists(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    missing = set(DOCUMENTED[cls].split()) - names
    assert not missing, f"{cls.__name__} lacks {sorted(missing)}"


#: What a section needs besides its defaults before ``finalize`` (fields without a usable default).
REQUIRED = {C.TrainingConfig: {"train_iters": 4, "micro_batch_size": 1, "global_batch_size": 2},
            C.OptimizerConfig: {"lr": 1e-3}}


@pytest.mark.parametrize("cls", [*DOCUMENTED, C.OptimizerConfig, C.DistributedDataParallelConfig],
                         ids=lambda c: c.__name__)
def test_a_config_with_every_field_spelled_out_at_its_default_builds_and_finalizes(cls):
    values = {**_defaults(cls), **REQUIRED.get(cls, {})}
    section = cls(**values)
    section.finalize()
    for name, value in values.items():
        if name not in ("logging_level", "load", "exit_signal", "min_lr", "overrides"):  # finalize fills these
            assert getattr(section, name) == value, name


#: The config page's other classes: every field at its default builds; finalize runs where the class
#: needs nothing else (indexed FIM data and fine-tuning data need their files).
OTHER_CLASSES = [C.RerunStateMachineConfig, C.DataloaderConfig, C.GPTDatasetConfig, C.MockGPTDatasetConfig,
                 C.TensorInspectConfig, C.FaultToleranceConfig, C.StragglerDetectionConfig,
                 C.NVRxStragglerDetectionConfig, C.InProcessRestartConfig, C.GPTFIMDatasetConfig,
                 C.FinetuningDatasetConfig]


@pytest.mark.parametrize("cls", OTHER_CLASSES, ids=lambda c: c.__name__)
def test_the_other_config_classes_build_with_every_field_at_its_default(cls):
    values = _defaults(cls)
    section = cls(**values)
    for name, value in values.items():
        assert getattr(section, name) == value, name
    if cls is C.FinetuningDatasetConfig:
        with pytest.raises(ValueError, match="dataset.dataset_root"):
            section.finalize()
    elif issubclass(cls, C.GPTDatasetConfig):  # Bridge's: the masking switches have no default
        with pytest.raises(AssertionError, match="reset_position_ids must be defined."):
            section.finalize()
        cls(**{**values, "reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}).finalize()
    else:
        section.finalize()
        assert cls is not C.GPTFIMDatasetConfig or section.mock  # Bridge's: no data path is mock data (issue 38)


@pytest.mark.parametrize("ours, theirs", [("OptimizerConfig", "megatron.core.optimizer"),
                                          ("DistributedDataParallelConfig", "megatron.core.distributed")])
def test_every_megatron_core_field_is_declared_with_megatron_cores_default(ours, theirs):
    import importlib

    mcore = getattr(importlib.import_module(theirs), ours)
    mine = _defaults(getattr(C, ours))
    for name, default in _defaults(mcore).items():
        assert name in mine, f"{ours} lacks megatron-core's {name}"
        if "dtype" in name:  # a torch dtype in megatron-core, its name here (no torch on the login node)
            assert f"torch.{mine[name]}" == str(default), name
        else:
            assert mine[name] == default, name


def test_the_optimizer_section_becomes_megatron_cores_config_field_for_field():
    import torch

    from bridge_hpc.training.engine.optimizer import megatron_optimizer_config

    o = C.OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=1024.0, min_loss_scale=2.0, loss_scale_window=50,
                          hysteresis=3, decoupled_lr=5e-4, decoupled_min_lr=1e-5, log_num_zeros_in_grad=True,
                          decoupled_weight_decay=False)
    o.finalize()
    m = megatron_optimizer_config(o)
    assert (m.initial_loss_scale, m.min_loss_scale, m.loss_scale_window, m.hysteresis) == (1024.0, 2.0, 50, 3)
    assert (m.decoupled_lr, m.decoupled_min_lr, m.log_num_zeros_in_grad) == (5e-4, 1e-5, True)
    assert m.params_dtype == torch.float16 and m.exp_avg_dtype == torch.float32 and not m.decoupled_weight_decay


@pytest.mark.parametrize("cls, values, key", [
    (C.OptimizerConfig, {"lr": 1e-3, "muon_momentum": 0.9}, "optimizer.muon_momentum"),
    (C.OptimizerConfig, {"lr": 1e-3, "exp_avg_dtype": "bfloat16"}, "optimizer.exp_avg_dtype"),
    (C.OptimizerConfig, {"lr": 1e-3, "exp_avg_dtype": "int3"}, "optimizer.exp_avg_dtype"),
    (C.DistributedDataParallelConfig, {"use_megatron_fsdp": True}, "ddp.use_megatron_fsdp"),
    (C.DistributedInitConfig, {"use_torch_fsdp2": True}, "dist.use_torch_fsdp2"),
    (C.TrainingConfig, {"train_iters": 4, "micro_batch_size": 1, "global_batch_size": 2,
                        "rampup_batch_size": [1, 1, 8]}, "train.rampup_batch_size"),
    (C.CheckpointConfig, {"non_persistent_ckpt_type": "local"}, "checkpoint.non_persistent_ckpt_type"),
    (C.CheckpointConfig, {"ckpt_step": 20}, "checkpoint.ckpt_step"),
    (C.LoggerConfig, {"moe_routing_trace_path": "/tmp/t"}, "logger.moe_routing_trace_path"),
    (C.LoggerConfig, {"wandb_exp_name": "x"}, "logger.wandb_exp_name"),
    (C.RNGConfig, {"inference_rng_tracker": True}, "rng.inference_rng_tracker"),
    (C.SchedulerConfig, {"start_weight_decay": -0.1}, "scheduler.start_weight_decay"),
])
def test_what_cannot_be_acted_on_is_refused_by_name_and_is_a_value_error(cls, values, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
        cls(**values).finalize()
    assert isinstance(err.value, ConfigError) and isinstance(err.value, AssertionError)


def test_flight_recorder_settings_become_torchs_variables():
    from bridge_hpc.training.pretrain import flight_recorder_env

    assert flight_recorder_env(C.DistributedInitConfig()) == {}
    env = flight_recorder_env(C.DistributedInitConfig(flight_recorder_dump_path="/tmp/fr",
                                                      flight_recorder_trace_buffer_size=64,
                                                      flight_recorder_include_stack_trace=True))
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/tmp/fr" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "64"
    assert env["TORCH_INCLUDE_STACK_TRACE"] == "1" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_decoupled_lr_and_qk_layernorm_decay_reach_the_parameter_groups():
    import torch

    from bridge_hpc.training.engine.config import OptimizerConfigOverrideProviderContext, default_config_overrides

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Linear(2, 2)
            self.embedding.weight.is_embedding_or_output_parameter = True
            self.q_layernorm = torch.nn.LayerNorm(2)
            self.dense = torch.nn.Linear(2, 2)

    o = C.OptimizerConfig(lr=1e-3, decoupled_lr=1e-2, apply_wd_to_qk_layernorm=True)
    o.finalize()
    model = Tiny()
    overrides = default_config_overrides(OptimizerConfigOverrideProviderContext(C.SchedulerConfig(), o, [model]))
    by_name = {name: value for key, value in overrides.items() for name in key.name}
    assert by_name["embedding.weight"]["max_lr"] == 1e-2
    assert "q_layernorm.weight" not in by_name  # decayed like a matrix
    assert by_name["dense.bias"]["wd_mult"] == 0.0
    o.apply_wd_to_qk_layernorm = False
    overrides = default_config_overrides(OptimizerConfigOverrideProviderContext(C.SchedulerConfig(), o, [model]))
    assert any("q_layernorm.weight" in key.name for key in overrides)


def test_config_error_is_caught_as_bridge_documents():
    cfg = C.TrainingConfig(train_iters=-1, micro_batch_size=1, global_batch_size=1)
    with pytest.raises(ValueError):
        cfg.finalize()
    with pytest.raises(AssertionError):
        cfg.finalize()


def test_bridges_private_helpers_compare_with_megatron_core_defaults():
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.transformer import TransformerConfig

    o = C.OptimizerConfig(lr=1e-3, hysteresis=4, exp_avg_dtype="float32")
    assert C._get_non_default_values(o, MegatronOptimizerConfig) == {"lr": (1e-3, None), "hysteresis": (4, 2)}
    assert C._get_key_config_values(C.RNGConfig(seed=7)) == {
        "seed": 7, "te_rng_tracker": False, "inference_rng_tracker": False, "data_parallel_random_init": False}
    assert "nccl_communicator_config_path" not in C._get_key_config_values(C.DistributedInitConfig())  # None left out
    model = C.GPTModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert C._get_mcore_transformer_parent(model) is TransformerConfig


def test_handle_mxfp8_param_buffer_copy_copies_only_when_both_flags_are_on():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from bridge_hpc.training.train import _handle_mxfp8_param_buffer_copy

    class Recording(DistributedOptimizer):  # counts the copies instead of touching buffers
        def __init__(self):
            self.copies = 0

        def _copy_main_params_to_param_buffer(self):
            self.copies += 1

    class Chained:  # megatron-core's ChainedOptimizer shape: its inner optimizers
        def __init__(self, *inner):
            self.chained_optimizers = list(inner)

    class Chunk:  # megatron-core DDP's record of its forward pre-hooks (empty while they are off)
        def __init__(self, hooks):
            self.remove_forward_pre_hook_handles = hooks

    inner = Recording()
    chained = Chained(inner, object())
    _handle_mxfp8_param_buffer_copy(chained, False, True)  # the documented signature
    _handle_mxfp8_param_buffer_copy(chained, True, False)
    assert inner.copies == 0
    _handle_mxfp8_param_buffer_copy(chained, True, True)
    assert inner.copies == 1


def test_handle_mxfp8_param_buffer_copy_takes_bridges_model_and_skips_while_the_hooks_are_off():
    """Bridge's newer signature ``(optimizer, model, reuse_grad_buf_for_mxfp8_param_ag, overlap_param_gather)``,
    by keyword and in order: no copy while ``model[0]``'s forward pre-hooks are off (issue 38)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from bridge_hpc.training.train import _handle_mxfp8_param_buffer_copy

    class Recording(DistributedOptimizer):
        def __init__(self):
            self.copies = 0

        def _copy_main_params_to_param_buffer(self):
            self.copies += 1

    class Chunk:  # megatron-core DDP's record of its forward pre-hooks (empty while they are off)
        def __init__(self, hooks):
            self.remove_forward_pre_hook_handles = hooks

    inner = Recording()
    hooked, unhooked = [Chunk({"p": object()})], [Chunk({})]
    _handle_mxfp8_param_buffer_copy(optimizer=inner, model=unhooked, reuse_grad_buf_for_mxfp8_param_ag=True,
                                    overlap_param_gather=True)
    _handle_mxfp8_param_buffer_copy(inner, unhooked, True, True)
    _handle_mxfp8_param_buffer_copy(inner, hooked, True, False)
    assert inner.copies == 0
    _handle_mxfp8_param_buffer_copy(optimizer=inner, model=hooked, reuse_grad_buf_for_mxfp8_param_ag=True,
                                    overlap_param_gather=True)
    _handle_mxfp8_param_buffer_copy(inner, hooked, True, True)
    assert inner.copies == 2


# ---------------------------------------------------------------------------------------------
# The refused fields are the documented ones
# ---------------------------------------------------------------------------------------------

SECTIONS = [("rng", C.RNGConfig), ("dist", C.DistributedInitConfig), ("ddp", C.DistributedDataParallelConfig),
            ("train", C.TrainingConfig), ("checkpoint", C.CheckpointConfig), ("logger", C.LoggerConfig),
            ("validation", C.ValidationConfig), ("profiling", C.ProfilingConfig), ("optimizer", C.OptimizerConfig),
            ("scheduler", C.SchedulerConfig), ("dataset", C.MockGPTDatasetConfig)]


def _another_value(default, annotation):
    """A value of the field's type other than its default."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 3
    if isinstance(default, str):
        return default + "x"
    if isinstance(default, (list, tuple)):
        return ["x"]
    text = str(annotation)
    for name, value in (("bool", True), ("int", 5), ("float", 0.5), ("List", ["x"]), ("Dict", {"a": "b"})):
        if name in text:
            return value
    return "x"


def _refused_fields():
    """``(section, field)`` of every field that refuses a value other than its default."""
    for section, cls in SECTIONS:
        for name, default in _defaults(cls).items():
            annotation = next(f.type for f in dataclasses.fields(cls) if f.name == name)
            # (load_main_params_from_ckpt with load_optim = true is Bridge's own error first, issue 38)
            alone = {"load_optim": False} if name == "load_main_params_from_ckpt" else {}
            values = {**REQUIRED.get(cls, {}), **alone, name: _another_value(default, annotation)}
            try:
                cls(**values).finalize()
            except ConfigError as err:
                if err.key == f"{section}.{name}" and "left at its default" in err.message:
                    yield section, name


def test_every_refused_field_is_in_the_documented_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "training-api.md").read_text()
    table = doc.split("## Config fields refused, and why", 1)[1]
    rows = {line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `[")}
    refused = list(_refused_fields())
    assert len(refused) > 50  # the probe finds them (FSDP, FP8, Muon, ...)
    for section, name in refused:
        assert any(row.startswith(f"| `[{section}]`") and f"`{name}`" in row for row in rows), (section, name)
    documented = {(row.split("`")[1].strip("[]"), name.strip("`")) for row in rows
                  for name in row.split(" ", 2)[2].split(", ")}
    assert documented <= set(refused), documented - set(refused)  # nothing listed that is accepted


@pytest.mark.parametrize("change, key", [
    (lambda cfg: setattr(cfg.scheduler, "lr_decay_iters", 0), "scheduler.lr_decay_iters"),
    (lambda cfg: setattr(cfg.model, "context_parallel_size", 3), "model.seq_length"),
    (lambda cfg: (setattr(cfg.checkpoint, "async_save", True), setattr(cfg.checkpoint, "save", None)),
     "checkpoint.async_save"),
])
def test_bridges_cross_checks_are_made(change, key):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_seed_config import _python_built

    cfg = _python_built()
    change(cfg)
    cfg.scheduler.lr_warmup_fraction = None
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        cfg.finalize_sections()
        cfg.validate(world_size=3 if cfg.model.context_parallel_size == 3 else 1)
