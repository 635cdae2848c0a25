"""Fast by default (issue 30): what a job on GPUs gets for the speed keys it leaves unset, on CPU.

The rules (bridge_hpc.training.engine.speed_defaults) through the job file's loader as bridge-submit and the
ranks run it: what is chosen for which model, layout, data and forward step; that a key the job sets
is never changed and each key turns its part off; the record in resolved.toml and that reading it
back resolves to the same; a job without GPUs keeps today's config; and what a rank settles (no
CUDA: exactly the config of a job without GPUs; no triton; a larger world). The GPU side (losses,
bit-exact resume, the eager fallback of a forward step that cannot be captured) is in
tests/test_gpu_speed_defaults.py.
"""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path

import pytest
import toml
from bridge_test_helpers import ROOT, TINY, submit_cli

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.fast_path import LINE_PREFIX, FastPath
from bridge_hpc.jobfile.jobconfig import dump_resolved, load_job_config
from bridge_hpc.training.engine import speed_defaults as S

GPU = "slurm.gpus_per_node=1"
#: The keys of a dense GPT (the experts' grouped GEMM is a question for MoE models only: never listed here).
KEYS = tuple(c.dotted for c in S.CHOICES if c != S.GROUPED_EXPERTS)
#: The layer implementation is a choice between two, taken where TE's layers are needed or measured
#: faster; the tiny GPT is neither, so every other key is what a plain GPU job gets.
LAYERS = S.TE_LAYERS.dotted
ALL = tuple(k for k in KEYS if k != LAYERS)
#: The value that turns each fast-path key off.
OFF = {"model.bias_activation_fusion": "false", "model.bias_dropout_fusion": "false",
       "model.cross_entropy_loss_fusion": "false", "model.fused_kernels": "false", "model.cuda_graph_impl": '"none"',
       "optimizer.fused_step": "false", "checkpoint.async_save": "false"}


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """The tiny GPT's job file (interval saves on, one task, no GPUs asked for)."""
    path = tmp_path / "job.toml"
    shutil.copy(TINY, path)
    return path


def load(job: Path, *overrides: str):
    return load_job_config(job, [f"job.run_dir={job.parent / 'runs' / 'tiny'}", *overrides], cwd=job.parent)


def reasons(cfg) -> dict:
    return dict(cfg.training.fast_path.not_chosen)


def others(cfg) -> dict:
    """The reasons of the keys other than the layer implementation."""
    return {k: v for k, v in reasons(cfg).items() if k != LAYERS}


def value(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg.training, section), key)


# ------------------------------------------------------------------ what is chosen


MOE_JOB = ROOT / "configs" / "local-tiny-moe.toml"


@pytest.fixture
def moe_job(tmp_path: Path) -> Path:
    path = tmp_path / "moe.toml"
    path.write_text(MOE_JOB.read_text().replace('extends = "clusters/local.toml"\n', ""))
    return path


#: The MoE job on one GPU in bf16 (torch's grouped GEMM on CUDA multiplies bf16).
MOE_ON_GPU = (GPU, "slurm.ntasks_per_node=1", "model.expert_model_parallel_size=1")
BF16 = "mixed_precision.bf16=true"


def test_an_moe_gpu_job_gets_the_experts_as_grouped_gemms(moe_job):
    cfg = load(moe_job, *MOE_ON_GPU, BF16)
    record = cfg.training.fast_path
    assert S.GROUPED_EXPERTS.dotted in record.chosen and S.GROUPED_EXPERTS.dotted in record.set_here
    assert cfg.training.model.moe_grouped_gemm is True and cfg.raw["model"]["moe_grouped_gemm"] is True
    # a job without GPUs keeps the sequential experts
    assert load(moe_job).training.model.moe_grouped_gemm is False


@pytest.mark.parametrize("overrides, reason", [
    ([BF16, 'peft.type="lora"', 'checkpoint.pretrained_checkpoint="base"'], "adapts the experts' own linear layers"),
    ([BF16, "model.moe_grouped_gemm=false"], "model.moe_grouped_gemm = false in the job"),
    ([BF16, "model.expert_tensor_parallel_size=2", "slurm.ntasks_per_node=2"], "expert tensor-parallel size is 2"),
    ([], "the model is not bf16"),
    ([BF16, "model.moe_ffn_hidden_size=60"], "multiples of 8"),
    ([BF16, 'model.transformer_impl="transformer_engine"'], "Transformer Engine's layers"),
])
def test_an_moe_gpu_job_keeps_the_sequential_experts_where_the_grouped_gemm_cannot_run(moe_job, overrides, reason):
    cfg = load(moe_job, *MOE_ON_GPU, *overrides)
    assert cfg.training.model.moe_grouped_gemm is False
    assert reason in reasons(cfg)[S.GROUPED_EXPERTS.dotted]


def test_a_gpu_job_gets_every_fast_setting_it_leaves_unset(job):
    cfg = load(job, GPU)
    record = cfg.training.fast_path
    measured = S.layers_measured_faster(cfg.training.model)
    assert record.chosen == ALL and record.not_chosen == ((LAYERS, measured),)
    assert set(record.set_here) == set(ALL) - {"optimizer.fused_step"}  # on by its own default already
    m = cfg.training.model
    assert (m.bias_activation_fusion, m.bias_dropout_fusion, m.cross_entropy_loss_fusion, m.fused_kernels) == (True,) * 4
    assert m.cuda_graph_impl == "full_iteration" and cfg.training.checkpoint.async_save is True
    assert record.line() == LINE_PREFIX + "chosen " + ", ".join(ALL) + f"; not chosen: {LAYERS} ({measured})"
    # resolved.toml holds the values themselves and the record
    assert cfg.raw["model"]["cuda_graph_impl"] == "full_iteration" and cfg.raw["checkpoint"]["async_save"] is True
    assert FastPath.from_toml(cfg.raw["job"]["fast_path"]) == record


def test_a_job_without_gpus_keeps_todays_config(job):
    cfg = load(job)
    plain = toml.load(TINY)
    for choice in S.CHOICES:
        assert choice.key not in plain.get(choice.section, {})
        assert value(cfg, choice.dotted) == S.field_default(type(getattr(cfg.training, choice.section)), choice.key)
    assert cfg.training.fast_path.set_here == ()
    assert reasons(cfg) == {k: S.NO_GPUS for k in KEYS if k != "optimizer.fused_step"}
    assert cfg.raw["model"].keys() == plain["model"].keys()
    # keys with the same reason share it in the line
    assert cfg.training.fast_path.line().count(S.NO_GPUS) == 1


@pytest.mark.parametrize("dotted", ALL)
def test_each_key_the_job_sets_turns_its_part_off_and_nothing_else(job, dotted):
    cfg = load(job, GPU, f"{dotted}={OFF[dotted]}")
    assert value(cfg, dotted) == toml.loads(f"v = {OFF[dotted]}")["v"]
    assert others(cfg) == {dotted: f"{dotted} = {OFF[dotted]} in the job"}
    assert cfg.training.fast_path.chosen == tuple(k for k in ALL if k != dotted)
    assert dotted not in cfg.training.fast_path.set_here


def test_a_key_set_to_its_fast_value_is_the_jobs_own(job):
    cfg = load(job, GPU, "model.fused_kernels=true")
    assert "model.fused_kernels" in cfg.training.fast_path.chosen
    assert "model.fused_kernels" not in cfg.training.fast_path.set_here


@pytest.mark.parametrize("overrides, key, why", [
    (('model.activation_func="silu"',), "model.bias_activation_fusion", "fuses gelu or swiglu only"),
    (("model.add_bias_linear=false",), "model.bias_activation_fusion", "needs model.add_bias_linear = true"),
    (("model.hidden_size=16512", "model.num_attention_heads=4", 'model.transformer_impl="local"'), "model.fused_kernels",
     "rows of up to 16384"),
    (("model.tensor_model_parallel_size=2", "slurm.ntasks_per_node=2"), "model.cuda_graph_impl",
     "data parallelism only"),
    (("model.pipeline_model_parallel_size=2", "slurm.ntasks_per_node=2"), "model.cuda_graph_impl",
     "data parallelism only"),
    (("model.cuda_graph_warmup_steps=0",), "model.cuda_graph_impl", "must be an integer >= 1"),
    (("ddp.use_distributed_optimizer=true", "ddp.overlap_param_gather=true"), "model.cuda_graph_impl",
     "ddp.overlap_param_gather is on"),
    (("ddp.use_distributed_optimizer=true", "comm_overlap.tp_comm_overlap=false", "slurm.ntasks_per_node=2"),
     "model.cuda_graph_impl", "ddp.overlap_param_gather is on"),
])
def test_what_the_model_and_layout_do_not_allow_stays_off_with_the_reason(job, overrides, key, why):
    cfg = load(job, GPU, *overrides)
    assert list(others(cfg)) == [key] and why in reasons(cfg)[key], reasons(cfg)
    assert value(cfg, key) == S.field_default(type(cfg.training.model), key.split(".")[1])
    assert key in cfg.training.fast_path.line()


def test_swiglu_fuses_its_activation(job):
    cfg = load(job, GPU, 'model.activation_func="swiglu"', "model.add_bias_linear=false")
    assert cfg.training.model.bias_activation_fusion is True and others(cfg) == {}


def test_the_data_parallel_overlap_blocks_the_graph_only_where_it_turns_on(job):
    overlap = ("ddp.use_distributed_optimizer=true", "comm_overlap.tp_comm_overlap=false")
    one = load(job, GPU, *overlap)  # one data-parallel rank: comm_overlap leaves the all-gather off
    assert one.training.model.cuda_graph_impl == "full_iteration"
    off = load(job, GPU, *overlap, "slurm.ntasks_per_node=2", "comm_overlap.overlap_param_gather=false")
    assert off.training.model.cuda_graph_impl == "full_iteration"
    model_parallel = load(job, GPU, *overlap, "slurm.ntasks_per_node=2", "model.tensor_model_parallel_size=2")
    assert "ddp.overlap_param_gather" not in reasons(model_parallel)["model.cuda_graph_impl"]  # TP2: no DP overlap


def test_without_interval_saves_async_save_is_not_chosen(job):
    doc = toml.load(job)
    del doc["checkpoint"]["save_interval"]
    job.write_text(toml.dumps(doc))
    cfg = load(job, GPU)
    assert others(cfg) == {"checkpoint.async_save": "no interval saves (checkpoint.save_interval is unset)"}
    assert cfg.training.checkpoint.async_save is False


def test_fine_tuning_data_keeps_eager_steps(job, tmp_path):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "training.jsonl").write_text('{"input": "a b", "output": "c"}\n' * 8)
    doc = toml.load(job)
    doc["dataset"] = {"dataset_root": str(tmp_path / "sft"), "seq_length": 32}
    doc["tokenizer"] = {"tokenizer_type": "ByteLevelTokenizer"}
    doc["train"]["eval_interval"] = 0
    job.write_text(toml.dumps(doc))
    cfg = load(job, GPU)
    assert others(cfg) == {"model.cuda_graph_impl": S.FINETUNING_SHAPES}


def test_a_user_forward_step_gets_the_same_choices(job, tmp_path):
    """Whether a forward step can be captured is known only when it is: the graph is chosen, and a
    capture that fails falls back to eager steps on the ranks (tests/test_gpu_speed_defaults.py)."""
    (tmp_path / "my_step.py").write_text("def forward_step(state, data_iterator, model):\n    raise NotImplementedError\n")
    default = load(job, GPU)
    user = load(job, GPU, f'job.forward_step="{tmp_path / "my_step.py"}:forward_step"')
    assert user.job.forward_step.endswith("my_step.py:forward_step")
    assert user.training.fast_path == default.training.fast_path


# ------------------------------------------------------------------ resolved.toml, read back


def test_resolved_toml_reads_back_to_the_same_config_and_record(job, tmp_path):
    for overrides in ((GPU,), (GPU, 'model.activation_func="silu"', "checkpoint.async_save=false"), ()):
        first = load(job, *overrides)
        resolved = tmp_path / "resolved.toml"
        resolved.write_text(dump_resolved(first))
        again = load_job_config(resolved)
        assert again.raw == first.raw and again.training.fast_path == first.training.fast_path
        assert again.training.to_dict() == first.training.to_dict()
        resolved.write_text(dump_resolved(again))
        assert load_job_config(resolved).raw == first.raw


def test_resolved_toml_submitted_again_without_gpus_drops_what_the_fast_path_set(job, tmp_path):
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(dump_resolved(load(job, GPU)))
    cpu = load_job_config(resolved, ["slurm.gpus_per_node=0"])
    assert cpu.training.to_dict() == load(job).training.to_dict()


def test_a_value_changed_in_resolved_toml_is_the_jobs_own(job, tmp_path):
    doc = toml.loads(dump_resolved(load(job, GPU)))
    doc["model"]["fused_kernels"] = False  # the record says the fast path set it; the file now says false
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(toml.dumps(doc))
    cfg = load_job_config(resolved)
    assert cfg.training.model.fused_kernels is False
    assert others(cfg) == {"model.fused_kernels": "model.fused_kernels = false in the job"}


def test_a_malformed_record_is_one_clear_error(job):
    doc = toml.load(job)
    doc["job"]["fast_path"] = {"chosen": "all"}
    job.write_text(toml.dumps(doc))
    with pytest.raises(ConfigError) as err:
        load(job, GPU)
    assert err.value.key == "job.fast_path" and str(job) in err.value.format()
    result = submit_cli("job.toml", "--dry-run", cwd=job.parent)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "key 'job.fast_path'" in result.stderr


# ------------------------------------------------------------------ on the ranks


def test_a_cpu_rank_of_a_gpu_job_runs_the_config_of_a_job_without_gpus(job):
    cfg = load(job, GPU).training
    line = S.settle_on_rank(cfg, on_cuda=False, has_triton=True, world_size=1)
    assert cfg.to_dict() == load(job).training.to_dict()
    assert cfg.fast_path.chosen == ("optimizer.fused_step",) and cfg.fast_path.set_here == ()
    assert line == cfg.fast_path.line() and f"({S.NO_CUDA})" in line
    assert S.settle_on_rank(cfg, on_cuda=False, has_triton=True, world_size=1) == line  # a second run: the same


def test_a_rank_without_triton_runs_without_the_fused_kernels_only(job):
    cfg = load(job, GPU).training
    S.settle_on_rank(cfg, on_cuda=True, has_triton=False, world_size=1)
    assert cfg.model.fused_kernels is False and cfg.model.cuda_graph_impl == "full_iteration"
    assert {k: v for k, v in cfg.fast_path.not_chosen if k != LAYERS} == {"model.fused_kernels": S.NO_TRITON}
    explicit = load(job, GPU, "model.fused_kernels=true").training  # asked for: the rank's own check refuses it
    S.settle_on_rank(explicit, on_cuda=True, has_triton=False, world_size=1)
    assert explicit.model.fused_kernels is True


def test_a_rank_in_a_larger_world_drops_the_graph_its_overlap_cannot_hold(job):
    cfg = load(job, GPU, "ddp.use_distributed_optimizer=true", "comm_overlap.tp_comm_overlap=false").training
    assert cfg.model.cuda_graph_impl == "full_iteration"  # [slurm] asks for one task
    S.settle_on_rank(cfg, on_cuda=True, has_triton=True, world_size=2)  # torchrun started two
    assert cfg.model.cuda_graph_impl == "none"
    assert "ddp.overlap_param_gather is on" in dict(cfg.fast_path.not_chosen)["model.cuda_graph_impl"]


def test_a_config_built_in_python_is_left_as_given(job):
    from bridge_hpc.training.config import ConfigContainer

    cfg = ConfigContainer.from_sections(copy.deepcopy(toml.load(job)))
    before = cfg.to_dict()
    assert S.settle_on_rank(cfg, on_cuda=False, has_triton=False, world_size=1) is None
    assert cfg.to_dict() == before


def test_a_gpu_job_trains_on_a_cpu_rank_as_before_and_says_so(job, one_rank, caplog):
    """pretrain on a CPU rank: the fast path's choices go back off before anything is built (the CUDA
    graph and the fused kernels would refuse a CPU rank) and rank 0 logs the line once."""
    from bridge_hpc.training.gpt_step import forward_step
    from bridge_hpc.training.pretrain import pretrain

    cfg = load(job, GPU, "train.train_iters=2", "train.eval_interval=0", "checkpoint.save_interval=2",
               "scheduler.lr_warmup_iters=1").training
    with caplog.at_level(logging.INFO, logger="bridge_hpc"):
        pretrain(cfg, forward_step)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(LINE_PREFIX)]
    assert lines == [cfg.fast_path.line()] and S.NO_CUDA in lines[0]
    assert cfg.model.cuda_graph_impl == "none" and cfg.checkpoint.async_save is False


# ------------------------------------------------------------------ the layer implementation


@pytest.mark.parametrize("overrides, needs", [
    (("mixed_precision.fp8=\"hybrid\"",), "mixed_precision.fp8"),
    (("model.fp8=\"e4m3\"",), "model.fp8"),
    (("model.sequence_parallel=true", "model.tensor_model_parallel_size=2", "slurm.ntasks_per_node=2"),
     "model.sequence_parallel"),
])
def test_what_only_transformer_engine_runs_takes_its_layers(job, overrides, needs):
    cfg = load(job, GPU, "model.bf16=true", "optimizer.bf16=true", *overrides)
    m = cfg.training.model
    assert m.transformer_impl == "transformer_engine" and S.needs_te_layers(cfg.training) == needs
    assert LAYERS in cfg.training.fast_path.chosen and LAYERS in cfg.training.fast_path.set_here
    assert m.fused_kernels is True  # its cross entropy (TE's layers fuse their norms and biases themselves)
    if "fp8" in needs:  # FP8 steps stay eager, said so
        assert m.cuda_graph_impl == "none" and reasons(cfg)["model.cuda_graph_impl"] == S.FP8_GRAPH
    # resolved.toml read back (as the ranks do) resolves to the same
    resolved = job.parent / "resolved.toml"
    resolved.write_text(dump_resolved(cfg))
    assert load_job_config(resolved, cwd=job.parent).training.fast_path == cfg.training.fast_path


def test_a_shape_where_te_measured_faster_takes_its_layers_and_a_rank_without_te_backs_off(job, monkeypatch):
    monkeypatch.setattr(S, "MEASURED_TE_FASTER", {1024: False, 4096: True})
    small = load(job, GPU).training
    assert small.model.transformer_impl == "local" and "hidden size 1024" in dict(small.fast_path.not_chosen)[LAYERS]
    big = load(job, GPU, "model.hidden_size=3072", "model.ffn_hidden_size=12288").training
    assert big.model.transformer_impl == "transformer_engine" and big.model.fused_kernels is True
    S.settle_on_rank(big, on_cuda=True, has_triton=True, world_size=1, has_te=False)
    assert big.model.transformer_impl == "local" and dict(big.fast_path.not_chosen)[LAYERS] == S.NO_TE
    fp8 = load(job, GPU, "model.bf16=true", "optimizer.bf16=true", "mixed_precision.fp8=\"hybrid\"").training
    S.settle_on_rank(fp8, on_cuda=True, has_triton=True, world_size=1, has_te=False)
    assert fp8.model.transformer_impl == "transformer_engine"  # needed: the rank's own check refuses FP8 instead


def test_a_peft_job_keeps_the_local_layers_unless_it_asks(job, monkeypatch):
    monkeypatch.setattr(S, "MEASURED_TE_FASTER", {64: True})
    assert load(job, GPU).training.model.transformer_impl == "transformer_engine"
    base = job.parent / "base"
    base.mkdir()
    peft = load(job, GPU, "peft.type=lora", f"checkpoint.pretrained_checkpoint={base}").training
    assert peft.model.transformer_impl == "local" and dict(peft.fast_path.not_chosen)[LAYERS] == S.PEFT_ON_TE


def test_a_job_that_sets_the_layers_keeps_them(job):
    with pytest.raises(ConfigError, match="model.sequence_parallel"):  # local asked for: SP is refused, not switched
        load(job, GPU, 'model.transformer_impl="local"', "model.sequence_parallel=true",
             "model.tensor_model_parallel_size=2", "slurm.ntasks_per_node=2")
    te = load(job, GPU, 'model.transformer_impl="transformer_engine"').training
    assert te.model.transformer_impl == "transformer_engine" and LAYERS not in te.fast_path.set_here


def test_the_precision_the_ranks_will_run_is_mixed_precisions_where_set():
    """``[mixed_precision]`` overwrites every precision field of the model on the ranks, bf16 = false too,
    so the login node's bf16 question reads it first (the grouped experts multiply bf16 on GPUs)."""
    from types import SimpleNamespace

    from bridge_hpc.training.mixed_precision import runs_in_bf16

    assert runs_in_bf16(SimpleNamespace(bf16=True), "fp16_mixed") is False
    assert runs_in_bf16(SimpleNamespace(bf16=False), "bf16_mixed") is True
    assert runs_in_bf16(SimpleNamespace(bf16=True), None) is True
