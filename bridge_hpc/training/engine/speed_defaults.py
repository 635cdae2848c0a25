"""Fast by default: a job on GPUs gets the fastest settings its model and layout allow, unasked.

Megatron Bridge's config classes keep megatron-core's defaults (unfused, eager steps, synchronous
saves: tests/test_bridge_config_fields.py), which suit a script but leave a GPU job at 1.09x a bare
loop where 1.4x is there (issue 30). So the job file's loader resolves, once, each fast-path key
(:data:`CHOICES`) that the job file, its profiles and its ``--set`` overrides leave unset:

- on a job that asks for no GPUs (``[slurm] gpus_per_node = 0``) nothing changes;
- on a job on GPUs a key left unset gets its fast value where the model, the layout and the data
  allow it (:func:`refusal`), else it stays at its default with the reason recorded;
- a key the job sets, to anything (``false`` and ``"none"`` too), is never changed.

The record (:class:`~bridge_hpc.contracts.fast_path.FastPath`) goes into resolved.toml as
``[job] fast_path`` and onto the ranks' ``ConfigContainer.fast_path``. The ranks read resolved.toml
with the same loader: the keys the record says were set here count as unset again, so a second
resolution gives the same sections and the same record. On the ranks, :func:`settle_on_rank` turns
back off what a rank cannot run (no CUDA: a CPU rank trains exactly as before; no triton; a world
whose data-parallel overlap the graph cannot hold) and returns the line rank 0 logs. Whether the
forward step can be captured is known only when it is captured: ``engine/cuda_graphs.py`` then falls
back to eager steps. docs/gpu-speed.md has the table.

Torch-free: bridge-submit runs it on the login node; the ranks pass in what only they can tell.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.fast_path import FastPath
from bridge_hpc.contracts.schema import field_default
from bridge_hpc.peft.config import check_peft
from bridge_hpc.training.config import ConfigContainer, FinetuningDatasetConfig
from bridge_hpc.training.engine import low_precision
from bridge_hpc.training.mixed_precision import runs_in_bf16


@dataclass(frozen=True)
class Choice:
    """One fast-path key and its fast value."""

    section: str
    key: str
    fast: Any

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.key}"


#: Transformer Engine's layers: taken where the job needs them (FP8/FP4, sequence or context
#: parallelism) and where they measured faster than the local layers with the toolkit's fused kernels
#: (:func:`layers_measured_faster`); first, because the fused kernels are for the local layers only.
TE_LAYERS = Choice("model", "transformer_impl", low_precision.TE)
FUSIONS = (Choice("model", "bias_activation_fusion", True), Choice("model", "bias_dropout_fusion", True),
           Choice("model", "cross_entropy_loss_fusion", True))
FUSED_KERNELS = Choice("model", "fused_kernels", True)
#: An MoE model's experts as grouped GEMMs (TE's grouped linear, or torch's over the local layers'
#: sequential experts): the sequential experts launch two GEMMs per expert each way from the host.
GROUPED_EXPERTS = Choice("model", "moe_grouped_gemm", True)
CUDA_GRAPH = Choice("model", "cuda_graph_impl", "full_iteration")
FUSED_STEP = Choice("optimizer", "fused_step", True)
ASYNC_SAVE = Choice("checkpoint", "async_save", True)
#: Every fast-path key, in the order the log line names them. ``optimizer.fused_step`` is on by its
#: own default already; it is listed so that the line and the record say when a job turned it off.
CHOICES = (TE_LAYERS,) + FUSIONS + (FUSED_KERNELS, GROUPED_EXPERTS, CUDA_GRAPH, FUSED_STEP, ASYNC_SAVE)
_BY_KEY = {c.dotted: c for c in CHOICES}

NO_GPUS = "the job asks for no GPUs ([slurm] gpus_per_node = 0)"
NO_CUDA = "this rank has no CUDA"
NO_TRITON = "this rank's torch has no triton"
NO_TE = "this rank has no transformer_engine package"
MOE_NOT_MEASURED = ("an MoE model: Transformer Engine's layers have not been measured against the local ones for "
                    "MoE yet")
PEFT_ON_TE = ("adapters on Transformer Engine's layers measured slower: LoRA there at 0.77x full fine-tuning, on the "
              "local layers' fused LoRA 1.03-1.09x (1.3 B GPT, one H200, 2026-12-02/03, benchmarks/README.md)")
FP8_GRAPH = ("FP8 steps are not captured: Transformer Engine's FP8 scaling state needs TE's own graph capture "
             "(te.make_graphed_callables), which the whole-step graph does not use")

#: Hidden sizes at which benchmarks/te.py measured Transformer Engine's layers (bf16, whole-step graph)
#: against the local layers with the fused kernels, one H200 (benchmarks/README.md): the hidden size of
#: a shape -> whether TE's were faster. A model takes the answer of the nearest measured hidden size.
#: One H200, 2026-12-02, each pair in one call: 370 M (hidden 1024) 177.9k vs 168.0k tokens/s, 1.3 B (2048)
#: 56.5k vs 53.7k, 8 x 4096 38.5k vs 37.7k. Below the smallest size nothing was measured: the local layers.
MEASURED_TE_FASTER = {1024: True, 2048: True, 4096: True}


def layers_measured_faster(model: Any) -> Optional[str]:
    """None where Transformer Engine's layers measured faster at the model's shape, else why not."""
    smallest = min(MEASURED_TE_FASTER)
    if model.hidden_size < smallest:
        return (f"Transformer Engine's layers were measured against the local ones from hidden size {smallest} up "
                "(benchmarks/te.py), not at this model's")
    nearest = min(MEASURED_TE_FASTER, key=lambda h: (abs(h - model.hidden_size), h))
    if MEASURED_TE_FASTER[nearest]:
        return None
    return (f"the local layers with the fused kernels measured at least as fast at hidden size {nearest} "
            "(benchmarks/te.py)")


def needs_te_layers(cfg: ConfigContainer) -> Optional[str]:
    """The key of what only Transformer Engine's layers run (FP8/FP4, sequence or context parallelism),
    or None; ``[mixed_precision]`` counts as the ranks will apply it."""
    m, mp = cfg.model, cfg.mixed_precision
    if mp is not None and not isinstance(mp, str):
        for name in ("fp8", "fp4"):
            if getattr(mp, name):
                return f"mixed_precision.{name}"
    for name, on in (("fp8", m.fp8), ("fp4", m.fp4), ("sequence_parallel", m.sequence_parallel),
                     ("context_parallel_size", m.context_parallel_size > 1)):
        if on:
            return f"model.{name}"
    return None
FINETUNING_SHAPES = ("fine-tuning batches are padded to their longest sample, so their shape changes from step to "
                     "step and a replay cannot follow")


def _section(cfg: ConfigContainer, name: str) -> Any:
    return {"model": cfg.model, "optimizer": cfg.optimizer, "checkpoint": cfg.checkpoint}[name]


def _finalize_refuses(section: Any, key: str, value: Any) -> Optional[str]:
    """What the section's own ``finalize`` says against ``key = value``, or None: the limits of each
    setting are defined once, where the section checks them."""
    try:
        dataclasses.replace(section, **{key: value}).finalize()
    except ConfigError as err:
        return err.message
    return None


def param_gather_overlapped(cfg: ConfigContainer, world_size: int) -> bool:
    """Whether ``ddp.overlap_param_gather`` will be on on ranks in a world of ``world_size``: set in
    ``[ddp]``, or turned on by ``[comm_overlap]`` (``CommOverlapConfig.setup``: with the distributed
    optimizer of either section, above one data-parallel rank, unless it says false)."""
    if cfg.ddp.overlap_param_gather:
        return True
    overlap = cfg.comm_overlap
    if overlap is None or not (cfg.ddp.use_distributed_optimizer or cfg.optimizer.use_distributed_optimizer):
        return False
    if overlap.overlap_param_gather is not None:
        return overlap.overlap_param_gather
    return world_size // cfg.model.model_parallel_size > 1


def applies(choice: Choice, cfg: ConfigContainer) -> bool:
    """Whether ``choice`` is a question for this model at all (the experts' GEMMs only for an MoE model):
    a key that does not apply is neither chosen nor listed."""
    return choice != GROUPED_EXPERTS or getattr(cfg.model, "num_moe_experts", None) is not None


#: Why an MoE job on Transformer Engine's layers keeps its experts as they are.
TE_GROUPED_NOT_MEASURED = ("on Transformer Engine's layers the grouped experts are TE's grouped linear, measured "
                           "host-bound (bridge-te 0.839x the bare loop, benchmarks/README.md), whose parameters "
                           "(experts.linear_fc1.weight<e>) the Hugging Face mapping does not read")


def _grouped_experts_refusal(cfg: ConfigContainer) -> Optional[str]:
    m = cfg.model
    if m.transformer_impl == low_precision.TE:
        return TE_GROUPED_NOT_MEASURED
    why = m.local_grouped_experts_refusal(gpus=True, bf16=runs_in_bf16(m, cfg.mixed_precision))
    if why is not None:
        return f"on the local layers it {why}"
    if cfg.peft is not None:
        try:
            check_peft(cfg.peft, m.num_layers, m.hidden_size, model=dataclasses.replace(m, moe_grouped_gemm=True))
        except ConfigError as err:
            if err.key == GROUPED_EXPERTS.dotted:
                return "peft.target_modules adapts the experts' own linear layers, which the grouped GEMM replaces"
    return None


def refusal(choice: Choice, cfg: ConfigContainer, world_size: int) -> Optional[str]:
    """Why ``choice``'s fast value cannot run with ``cfg`` in a world of ``world_size`` ranks, or None."""
    if choice == GROUPED_EXPERTS:  # the model's own checks with what a GPU job adds (bf16, adapters, TE)
        return _grouped_experts_refusal(cfg)
    if choice == CUDA_GRAPH and (cfg.model.low_precision or needs_te_layers(cfg) in
                                 ("mixed_precision.fp8", "mixed_precision.fp4")):
        return FP8_GRAPH
    why = _finalize_refuses(_section(cfg, choice.section), choice.key, choice.fast)
    if choice == TE_LAYERS and why is None:
        if needs_te_layers(cfg):
            return None
        if cfg.peft is not None:
            return PEFT_ON_TE
        if getattr(cfg.model, "num_moe_experts", None) is not None:
            return MOE_NOT_MEASURED
        return layers_measured_faster(cfg.model)
    if why is not None or choice != CUDA_GRAPH:
        if choice == ASYNC_SAVE and why is None and cfg.checkpoint.save_interval is None:
            return "no interval saves (checkpoint.save_interval is unset)"
        return why
    if isinstance(cfg.dataset, FinetuningDatasetConfig):
        return FINETUNING_SHAPES
    if param_gather_overlapped(cfg, world_size):
        return ("ddp.overlap_param_gather is on (by [ddp] or [comm_overlap]): its forward pre-hooks wait for "
                "all-gathers started outside the graph")
    return None


def _previous(table: Dict[str, Any]) -> Optional[FastPath]:
    if not table:
        return None
    try:
        return FastPath.from_toml(table)
    except ValueError as err:
        raise ConfigError(str(err), key="job.fast_path") from None


def resolve(sections: Dict[str, Any], previous: Dict[str, Any], gpus: bool, world_size: int,
            source: str) -> Tuple[Dict[str, Any], ConfigContainer, FastPath]:
    """The training sections with the fast path filled in, their ConfigContainer and the record.

    ``sections``: the job's training sections as resolved.toml holds them (not changed); ``previous``:
    its ``[job] fast_path`` table (empty in a job file); ``gpus``: whether the job asks for GPUs;
    ``world_size``: the ranks it asks for. Raises ConfigError for a config that is wrong on its own
    (the same errors the plain build gives)."""
    sections = {name: dict(body) if isinstance(body, dict) else body for name, body in sections.items()}
    record = _previous(previous)
    for dotted in record.set_here if record else ():
        choice = _BY_KEY.get(dotted)
        body = sections.get(choice.section) if choice else None
        if isinstance(body, dict) and choice.key in body and body[choice.key] == choice.fast:
            del body[choice.key]  # set by an earlier resolution, not by the job: resolved again
    set_here, reasons = [], {}
    if gpus and _takes_te_layers(sections, source):
        sections.setdefault("model", {})[TE_LAYERS.key] = TE_LAYERS.fast
        set_here.append(TE_LAYERS.dotted)
    cfg = ConfigContainer.from_sections(sections, source=source)
    for choice in CHOICES if gpus else ():
        if not applies(choice, cfg):
            continue
        body = sections.get(choice.section)
        if isinstance(body, dict) and choice.key in body or getattr(_section(cfg, choice.section), choice.key) == choice.fast:
            continue
        why = refusal(choice, cfg, world_size)
        if why is None:
            sections.setdefault(choice.section, {})[choice.key] = choice.fast
            setattr(_section(cfg, choice.section), choice.key, choice.fast)  # later choices see it
            set_here.append(choice.dotted)
        else:
            reasons[choice.dotted] = why
    if set_here:
        cfg = ConfigContainer.from_sections(sections, source=source)
    cfg.fast_path = _record(cfg, sections, gpus, tuple(set_here), reasons)
    return sections, cfg, cfg.fast_path


def _takes_te_layers(sections: Dict[str, Any], source: str) -> bool:
    """Whether a job that leaves ``model.transformer_impl`` unset asks for what only Transformer Engine's
    layers run. Asked of the sections with TE's layers in place, since with the local ones the model's
    own checks refuse those keys; a config that is wrong either way is left to the plain build."""
    model = sections.get("model", {})
    if not isinstance(model, dict) or TE_LAYERS.key in model:
        return False
    try:
        probe = ConfigContainer.from_sections(dict(sections, model=dict(model, **{TE_LAYERS.key: TE_LAYERS.fast})),
                                              source=source)
    except ConfigError:
        return False
    return needs_te_layers(probe) is not None


def _record(cfg: ConfigContainer, sections: Dict[str, Any], gpus: bool, set_here: Tuple[str, ...],
            reasons: Dict[str, str]) -> FastPath:
    chosen, not_chosen = [], []
    for choice in CHOICES:
        if not applies(choice, cfg):
            continue
        value = getattr(_section(cfg, choice.section), choice.key)
        body = sections.get(choice.section)
        if value == choice.fast:
            chosen.append(choice.dotted)
        elif choice.dotted in reasons:
            not_chosen.append((choice.dotted, reasons[choice.dotted]))
        elif isinstance(body, dict) and choice.key in body:
            not_chosen.append((choice.dotted, f"{choice.dotted} = {json.dumps(value)} in the job"))
        else:
            not_chosen.append((choice.dotted, NO_GPUS))
    return FastPath(gpus, tuple(chosen), set_here, tuple(not_chosen))


def settle_on_rank(cfg: ConfigContainer, on_cuda: bool, has_triton: bool, world_size: int,
                   has_te: bool = True) -> Optional[str]:
    """On a rank, before the model is built: turn back off each key the resolution set that this rank
    cannot run (to the field's default, what the job would have had without the fast path), update
    ``cfg.fast_path`` and return the line rank 0 logs; None for a config that was not resolved from a
    job file (built in Python: it keeps the values it was given).

    ``on_cuda``: the rank has a CUDA device; ``has_triton``: the triton package is importable;
    ``has_te``: the transformer_engine package is;
    ``world_size``: the world the rank is in (a job file run under torchrun may differ from its
    ``[slurm]`` request, and ``[comm_overlap]``'s overlaps depend on it)."""
    record = cfg.fast_path
    if record is None:
        return None
    back_off = {}
    for dotted in record.set_here:
        choice = _BY_KEY[dotted]
        if not on_cuda:
            back_off[dotted] = NO_CUDA
        elif choice == FUSED_KERNELS and not has_triton:
            back_off[dotted] = NO_TRITON
        elif choice == TE_LAYERS and not has_te and needs_te_layers(cfg) is None:
            back_off[dotted] = NO_TE  # (what needs TE fails at the model build, naming its key)
        elif choice == CUDA_GRAPH and param_gather_overlapped(cfg, world_size):
            back_off[dotted] = refusal(choice, cfg, world_size)
    for dotted in back_off:
        choice = _BY_KEY[dotted]
        section = _section(cfg, choice.section)
        setattr(section, choice.key, field_default(type(section), choice.key))
    if back_off:
        why = dict(record.not_chosen, **back_off)
        record = FastPath(record.gpus, tuple(k for k in record.chosen if k not in back_off),
                          tuple(k for k in record.set_here if k not in back_off),
                          tuple((c.dotted, why[c.dotted]) for c in CHOICES if c.dotted in why))
        cfg.fast_path = record
    return record.line()
