"""FP8/FP4 on Transformer Engine's layers (issue 46), what CPUs can check: the fields, the recipes, the
refusals at submission and on a rank, and a checkpoint's per-layer state across the two layouts.

* Bridge's ``[mixed_precision]`` FP8 fields and recipes are accepted where TE's layers run and written
  into ``[model]``'s megatron-core fields; each thing that cannot run is one line naming the key, exit 2,
  nothing written: FP8 on a job without GPUs, on the local layers, a recipe the cluster's card cannot
  run (MXFP8 on Hopper), FP8 weights without the distributed optimizer, an unknown value or card;
* a rank without CUDA (or without TE) refuses FP8 naming the key, exit 2 (the sbatch script does not
  requeue that status);
* loading across layouts: the ``_extra_state`` entries a checkpoint lacks are taken out of the request,
  the others kept (real DCP files, megatron-core's ShardedObject keys).
The GPU side (FP8 training, SIGUSR1 resume bit for bit, LoRA, export) is tests/test_gpu_te.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import toml
from bridge_test_helpers import TINY, submit_cli
from warm_ranks import run_ranks

from bridge_hpc.contracts.errors import EXIT_BAD_INPUT, ConfigError
from bridge_hpc.jobfile.jobconfig import dump_resolved, load_job_config
from bridge_hpc.training import mixed_precision as mp
from bridge_hpc.training.config import GPTModelConfig
from bridge_hpc.training.engine import low_precision

ROOT = Path(__file__).resolve().parent.parent
TE = 'model.transformer_impl="transformer_engine"'
GPU = ("slurm.gpus_per_node=1", "model.bf16=true", "optimizer.bf16=true")


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    doc = toml.load(TINY)
    doc["job"]["run_dir"] = str(tmp_path / "runs" / "tiny")
    path.write_text(toml.dumps(doc))
    return path


def _submit(job: Path, *overrides: str):
    args = [str(job), "--dry-run"]
    for item in overrides:
        args += ["--set", item]
    return submit_cli(*args, cwd=job.parent)


# ------------------------------------------------------------------ the fields and recipes


def test_bridges_fp8_recipes_carry_bridges_values_and_keep_fp8_param_in_step():
    delayed = mp.get_mixed_precision_config("bf16_with_fp8_delayed_scaling_mixed")
    assert (delayed.bf16, delayed.fp8, delayed.fp8_recipe, delayed.fp8_amax_history_len,
            delayed.fp8_amax_compute_algo, delayed.fp8_param_gather, delayed.fp8_param) == \
        (True, "hybrid", "delayed", 1024, "max", True, True)
    current = mp.get_mixed_precision_config("bf16-with-fp8-current-scaling-mixed")  # NeMo2's hyphens too
    assert (current.fp8_recipe, current.first_last_layers_bf16, current.num_layers_at_start_in_bf16,
            current.num_layers_at_end_in_bf16) == ("tensorwise", True, 1, 1)
    assert mp.get_mixed_precision_config("bf16_with_mxfp8_mixed").reuse_grad_buf_for_mxfp8_param_ag is True
    assert mp.get_mixed_precision_config("bf16_with_fp8_subchannel_scaling_mixed").fp8_recipe == "blockwise"
    cfg = mp.MixedPrecisionConfig(fp8="hybrid")
    cfg.fp8_param = True
    assert cfg.fp8_param_gather is True  # Bridge's __setattr__: one setting, two names
    with pytest.raises(ConfigError, match="mixed_precision"):
        mp.get_mixed_precision_config("bf16_with_fp9_mixed")


def test_setup_writes_fp8_into_the_model_and_checks_it_against_the_layers():
    model = GPTModelConfig(bf16=True, transformer_impl="transformer_engine", num_layers=4)
    model.finalize()
    recipe = mp.bf16_with_fp8_current_scaling_mixed()
    recipe.fp8_param_gather = False
    recipe.setup(model)
    assert (model.fp8, model.fp8_recipe, model.first_last_layers_bf16, model.low_precision) == \
        ("hybrid", "tensorwise", True, "fp8")
    local = GPTModelConfig(bf16=True)
    local.finalize()
    with pytest.raises(ConfigError) as err:
        mp.MixedPrecisionConfig(bf16=True, fp8="e4m3").setup(local)
    assert err.value.key == "mixed_precision.fp8" and "transformer_engine" in err.value.message
    for bad in (dict(fp8="e5m2"), dict(fp8="hybrid", fp8_recipe="bogus"), dict(fp8="hybrid", fp4="e2m1")):
        with pytest.raises(ConfigError, match="mixed_precision.fp"):
            mp.MixedPrecisionConfig(bf16=True, **bad).finalize()


def test_the_cards_table_says_what_each_generation_runs():
    model = dataclasses.replace(GPTModelConfig(transformer_impl="transformer_engine"), fp8="hybrid")
    for recipe, hopper_runs in (("delayed", True), ("tensorwise", True), ("blockwise", True), ("mxfp8", False)):
        model.fp8_recipe = recipe
        assert (model.card_refusal((9, 0), "H100") is None) == hopper_runs, recipe
        assert model.card_refusal((10, 0), "B200") is None
    model.fp8_recipe = "delayed"
    refused = model.card_refusal((8, 0), "A100")
    assert refused.key == "model.fp8" and "A100 (Ampere" in refused.message
    nvfp4 = dataclasses.replace(GPTModelConfig(transformer_impl="transformer_engine"), fp4="e2m1")
    assert nvfp4.card_refusal((9, 0), "H200").key == "model.fp4_recipe"


# ------------------------------------------------------------------ at submission


@pytest.mark.parametrize("overrides, key, words", [
    (('mixed_precision.fp8="hybrid"', "slurm.gpus_per_node=0", TE), "slurm.gpus_per_node",
     "mixed_precision.fp8 asks for FP8"),
    (('mixed_precision.fp8="hybrid"', 'model.transformer_impl="local"') + GPU, "mixed_precision.fp8",
     "Transformer Engine's layers only"),
    (('mixed_precision.fp8="hybrid"', 'mixed_precision.fp8_recipe="mxfp8"', 'cluster.gpu_model="H100"', TE) + GPU,
     "mixed_precision.fp8_recipe", "H100 (Hopper"),
    (('mixed_precision.fp8="hybrid"', "mixed_precision.fp8_param_gather=true", TE) + GPU,
     "mixed_precision.fp8_param_gather", "distributed optimizer"),
    (('mixed_precision.fp8="$(touch pwned)"', TE) + GPU, "mixed_precision.fp8", "expected one of"),
    (('model.fp8="hybrid\\nx"', TE) + GPU, "model.fp8", "control characters"),
    (('cluster.gpu_model="H100; touch pwned"', 'mixed_precision.fp8="hybrid"', TE) + GPU, "cluster.gpu_model",
     "unknown GPU model"),
    (('mixed_precision.fp4="e2m1"', 'cluster.gpu_model="H200"', TE) + GPU, "mixed_precision.fp4_recipe",
     "Blackwell"),
    (("ddp.keep_fp8_transpose_cache=true",) + GPU, "ddp.keep_fp8_transpose_cache", "fp8_param_gather"),
])
def test_what_cannot_run_is_one_line_naming_the_key_and_nothing_is_written(job, overrides, key, words):
    done = _submit(job, *overrides)
    assert done.returncode == EXIT_BAD_INPUT and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"key '{key}'" in errors[0] and words in errors[0], done.stderr
    assert not (job.parent / "runs").exists() and not (job.parent / "pwned").exists()


def test_an_fp8_job_on_te_layers_is_accepted_with_its_fields_in_resolved_toml(job):
    cfg = load_job_config(job, [*GPU, 'mixed_precision.fp8="hybrid"', 'mixed_precision.fp8_recipe="delayed"',
                                'cluster.gpu_model="H200"'], cwd=job.parent)
    assert cfg.training.model.transformer_impl == "transformer_engine"  # the fast path took TE's layers
    resolved = toml.loads(dump_resolved(cfg))
    assert resolved["mixed_precision"]["fp8"] == "hybrid" and resolved["model"]["transformer_impl"] == "transformer_engine"
    assert "FP8 steps are not captured" in cfg.training.fast_path.line()


def test_a_mixed_precision_table_that_turns_a_bf16_model_to_fp32_is_said_before_the_queue(job):
    """Bridge's rule, kept: ``[mixed_precision]`` writes bf16 = false (its default) over ``model.bf16``; a
    table of FP8 fields alone trains in fp32, and bridge-submit says so in one warning line."""
    fp8 = ('mixed_precision.fp8="hybrid"', 'mixed_precision.fp8_recipe="delayed"')
    done = _submit(job, *GPU, *fp8)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "over model.bf16 = true" in warnings[0] and "fp32 with FP8" in warnings[0], warnings
    cfg = load_job_config(job, [*GPU, *fp8], cwd=job.parent).training
    model = dataclasses.replace(cfg.model)
    cfg.mixed_precision.setup(model)  # what the ranks do: the warning's claim
    assert (model.bf16, model.fp8) == (False, "hybrid")
    for kept in (("mixed_precision.bf16=true",), ()):  # bf16 said, or no FP8 table at all
        done = _submit(job, *GPU, *(fp8 + kept if kept else ()))
        assert done.returncode == 0 and "warning:" not in done.stderr, done.stderr[-3000:]


def test_the_example_fp8_job_is_accepted_and_mxfp8_is_refused_on_its_h100_profile(tmp_path):
    example = ROOT / "configs" / "gpt-8x4096-h100-fp8.toml"
    done = submit_cli(str(example), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0 and "warning:" not in done.stderr, done.stderr[-3000:]  # bf16 with FP8
    done = submit_cli(str(example), "--dry-run", "--set", 'mixed_precision.fp8_recipe="mxfp8"', cwd=tmp_path)
    assert done.returncode == EXIT_BAD_INPUT and "mixed_precision.fp8_recipe" in done.stderr


# ------------------------------------------------------------------ on a rank


def test_a_rank_without_cuda_refuses_fp8_naming_the_key_exit_2(job):
    cfg = load_job_config(job, [*GPU, TE, 'mixed_precision.fp8="hybrid"'], cwd=job.parent)
    resolved = job.parent / "resolved.toml"
    resolved.write_text(dump_resolved(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(CUDA_VISIBLE_DEVICES="")
    done = run_ranks([str(resolved)], cwd=str(job.parent), nprocs=1, env=env, timeout=300)
    out = done.output
    assert "key 'mixed_precision.fp8'" in out and "this rank has no CUDA" in out, out[-3000:]
    assert done.returncode == EXIT_BAD_INPUT, out[-3000:]


# ------------------------------------------------------------------ across layouts


def test_loading_takes_out_the_extra_state_a_checkpoint_lacks_and_keeps_the_rest(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from bridge_hpc.training.checkpoint.megatron import _extra_state_absent_from

    kept = ShardedObject("decoder.layers.self_attention.linear_qkv._extra_state", None, (2,), (0,))
    lacking = ShardedObject("decoder.layers.self_attention.core_attention._extra_state", None, (2,), (1,))
    other = ShardedObject("decoder.final_layernorm._extra_state", None, (1,), (0,))  # saved under its key's folder
    dcp.save({kept.unique_key: torch.zeros(1), "decoder.layers.self_attention.linear_qkv.weight": torch.ones(2),
              f"{other.key}/shard_0_1": torch.zeros(1)}, checkpoint_id=str(tmp_path), no_dist=True)
    sharded = {"model": {"decoder.layers.0.self_attention.linear_qkv._extra_state": kept,
                         "decoder.layers.1.self_attention.core_attention._extra_state": lacking,
                         "decoder.final_layernorm._extra_state": other,
                         "decoder.layers.0.self_attention.linear_qkv.weight": "a tensor"}}
    absent = _extra_state_absent_from(sharded, str(tmp_path))
    assert absent == ["decoder.layers.1.self_attention.core_attention._extra_state"]
    assert set(sharded["model"]) == {"decoder.layers.0.self_attention.linear_qkv._extra_state",
                                     "decoder.final_layernorm._extra_state",
                                     "decoder.layers.0.self_attention.linear_qkv.weight"}


def test_the_mapping_names_te_norms_once_for_both_layouts():
    from bridge_hpc.training.hf import mapping

    for te_name, local in (("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
                           ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias")):
        assert mapping.canonical(f"decoder.layers.3.{te_name}") == f"decoder.layers.3.{local}"
        assert mapping.canonical(f"decoder.layers.3.{local}") == f"decoder.layers.3.{local}"


def test_gpu_capabilities_of_the_known_models_are_the_ones_the_ranks_compare():
    assert low_precision.gpu_model_capability("h100") == (9, 0) == low_precision.GPU_CAPABILITY["H200"]
    with pytest.raises(ConfigError, match="cluster.gpu_model"):
        low_precision.gpu_model_capability("RTX 9090")
