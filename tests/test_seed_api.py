"""Every public ``bridge.training.*`` name documented on Megatron Bridge's seed pages imports from the
matching ``bridge_hpc.training.*`` module (the list is the pages', copied here: the tests never read
``../shared``), and the functions whose signatures users call positionally keep Bridge's parameters."""

from __future__ import annotations

import importlib
import inspect

import pytest

SEED_NAMES = [
    "training.comm_overlap.CommOverlapConfig",
    "training.config",
    "training.config.CheckpointConfig",
    "training.config.ConfigContainer",
    "training.config.DataloaderConfig",
    "training.config.DatasetBuildContext",
    "training.config.DatasetProvider",
    "training.config.DistributedDataParallelConfig",
    "training.config.DistributedInitConfig",
    "training.config.FaultToleranceConfig",
    "training.config.FinetuningDatasetConfig",
    "training.config.GPTDatasetConfig",
    "training.config.GPTFIMDatasetConfig",
    "training.config.InProcessRestartConfig",
    "training.config.LoggerConfig",
    "training.config.MockGPTDatasetConfig",
    "training.config.NVRxStragglerDetectionConfig",
    "training.config.OptimizerConfig",
    "training.config.OptimizerConfigOverrideProvider",
    "training.config.OptimizerConfigOverrideProviderContext",
    "training.config.ProfilingConfig",
    "training.config.RerunStateMachineConfig",
    "training.config.SchedulerConfig",
    "training.config.StragglerDetectionConfig",
    "training.config.TensorInspectConfig",
    "training.config.TrainingConfig",
    "training.config.mimo_runtime_config_update",
    "training.config.runtime_config_update",
    "training.finetune.finetune",
    "training.forward_step_func_types.ForwardStepCallable",
    "training.gpt_step.forward_step",
    "training.losses.masked_token_loss",
    "training.mixed_precision.MixedPrecisionConfig",
    "training.pretrain",
    "training.pretrain.pretrain",
    "training.profiling.TNvtxContext",
    "training.state.GlobalState",
    "training.state.TrainState",
    "training.tokenizers.config.TokenizerConfig",
    "training.tokenizers.tokenizer.MegatronTokenizer",
    "training.train",
    "training.train.checkpoint_and_decide_exit",
    "training.train.compute_throughputs_and_append_to_progress_log",
    "training.train.disable_forward_pre_hook",
    "training.train.enable_forward_pre_hook",
    "training.train.get_start_time_from_progress_log",
    "training.train.post_training_step_callbacks",
    "training.train.save_checkpoint_and_time",
    "training.train.should_disable_forward_pre_hook",
    "training.train.train",
    "training.train.train_step",
    "training.utils.train_utils",
    "training.utils.train_utils.LinearForLastLayer",
    "training.utils.train_utils.MEMORY_KEYS",
    "training.utils.train_utils.ModelHook",
    "training.utils.train_utils.ModelList",
    "training.utils.train_utils.calc_dtensor_params_l2_norm",
    "training.utils.train_utils.calc_params_l2_norm",
    "training.utils.train_utils.create_value_head_hook",
    "training.utils.train_utils.freeze_moe_router",
    "training.utils.train_utils.logger",
    "training.utils.train_utils.logical_and_across_model_parallel_group",
    "training.utils.train_utils.make_value_model",
    "training.utils.train_utils.maybe_inject_state",
    "training.utils.train_utils.needs_global_state_injection",
    "training.utils.train_utils.prepare_forward_step_func",
    "training.utils.train_utils.reduce_max_memory_across_pp_group",
    "training.utils.train_utils.reduce_max_stat_across_model_parallel_group",
    "training.utils.train_utils.report_l2_norm_grad",
    "training.utils.train_utils.report_memory",
    "training.utils.train_utils.report_runtime",
    "training.utils.train_utils.report_throughput",
    "training.utils.train_utils.start_memory_history_recording",
    "training.utils.train_utils.training_log",
    # private helpers the pages document
    "training.config._get_key_config_values",
    "training.config._get_mcore_transformer_parent",
    "training.config._get_non_default_values",
    "training.train._finish_train",
    "training.train._handle_mxfp8_param_buffer_copy",
    "training.utils.train_utils._MoeMetricFanoutWriter",
    "training.utils.train_utils._build_moe_metric_writer",
    "training.utils.train_utils._ensure_model_list",
    "training.utils.train_utils._freeze_parameter_if_present",
]

#: Functions called positionally by Bridge users' code: Bridge's parameter names, in order.
SIGNATURES = {
    "training.pretrain.pretrain": ["config", "forward_step_func"],
    "training.finetune.finetune": ["config", "forward_step_func"],
    "training.train.get_start_time_from_progress_log": ["cfg"],
    "training.train.compute_throughputs_and_append_to_progress_log": ["state", "num_floating_point_operations_so_far"],
    "training.train.should_disable_forward_pre_hook": ["use_megatron_fsdp", "use_distributed_optimizer",
                                                       "overlap_param_gather"],
    "training.train.enable_forward_pre_hook": ["model"],
    "training.train.disable_forward_pre_hook": ["model", "param_sync"],
    "training.config.runtime_config_update": ["cfg"],
    "training.config._get_non_default_values": ["config_obj", "mcore_class"],
    "training.config._get_key_config_values": ["config_obj"],
    "training.config._get_mcore_transformer_parent": ["model_config"],
    "training.train._finish_train": ["global_state"],
    "training.train._handle_mxfp8_param_buffer_copy": ["optimizer", "reuse_grad_buf_for_mxfp8_param_ag",
                                                        "overlap_param_gather"],
    "training.utils.train_utils._build_moe_metric_writer": ["tb_writer", "comet_logger", "mlflow_logger"],
    "training.utils.train_utils.training_log": [
        "loss_dict", "total_loss_dict", "learning_rate", "decoupled_learning_rate", "loss_scale", "report_memory_flag",
        "skipped_iter", "grad_norm", "params_norm", "num_zeros_in_grad", "config", "global_state", "history_wct",
        "model", "pg_collection", "log_max_attention_logit", "loaded_iteration", "seq_length"],
}


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("bridge_hpc." + ".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


@pytest.mark.parametrize("name", SEED_NAMES)
def test_seed_name_imports_from_the_matching_module(name):
    assert _resolve(name) is not None


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_seed_function_keeps_bridges_parameters(name):
    params = list(inspect.signature(_resolve(name)).parameters)
    assert params[: len(SIGNATURES[name])] == SIGNATURES[name], params
