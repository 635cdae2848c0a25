"""``PEFT``: Megatron Bridge's base of parameter-efficient fine-tuning methods (``megatron.bridge.peft.base``).

A PEFT is a config dataclass (importable without torch, so the login node checks it) whose
``__call__(model, training=True)`` freezes every weight of the model and lets :meth:`PEFT.transform`
replace the layers it targets by wrapped ones with trainable adapters. In a run the trainer calls it
in Bridge's pre-wrap hook (:func:`bridge_hpc.training.pretrain.setup_model`): after the pretrained
weights are read into the bare model and before the data-parallel wrapper and the optimizer exist,
so that both see the adapters only (no gradient buffers, no optimizer state for the base).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Set, Tuple

from bridge_hpc.contracts.schema import check as _check
from bridge_hpc.peft.utils import is_adapter_key

#: ``transform``'s signature: (module, its attribute name, the full name of its parent) -> module.
Transform = Callable[[Any, Optional[str], Optional[str]], Any]


def _chunks(model) -> list:
    """The bare model chunks of ``model`` (one module, a list of chunks, or either wrapped in a data-parallel
    wrapper or Float16Module, whose ``module`` attribute holds the model)."""
    chunks = model if isinstance(model, list) else [model]
    out = []
    for chunk in chunks:
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
            chunk = chunk.module
        out.append(chunk)
    return out


def _child_name(parent, name: str, child, index_offset: int = 0) -> str:
    """The name a child has in the full model: a transformer layer counts over the whole model
    (megatron-core's 1-based ``layer_number``), not within this pipeline stage's list, and a local expert
    over all experts (``index_offset``: the first global index this expert-parallel rank holds)."""
    layer_number = getattr(child, "layer_number", None)
    if type(parent).__name__ == "ModuleList" and name.isdigit():
        if isinstance(layer_number, int):
            return str(layer_number - 1)
        return str(int(name) + index_offset)
    return name


def _expert_offset(module, name: str) -> int:
    """For megatron-core's ``SequentialMLP.local_experts``: the global index of this rank's first expert
    (expert-parallel rank x experts per rank), else 0."""
    local = getattr(module, "num_local_experts", None)
    if name != "local_experts" or not isinstance(local, int):
        return 0
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank() * local


def walk(module, func: Transform, prefix: Optional[str] = None, index_offset: int = 0) -> Any:
    """Apply ``func(child, name, prefix)`` to every module below ``module``, depth first (parents before
    their children), putting what it returns in the child's place; a replaced child is not walked into.
    ``prefix`` is the full name of ``module`` in the whole model, whatever the layout: layers counted over
    the pipeline stages, experts over the expert-parallel ranks (so that an adapter seeded by its name
    starts the same at EP1 and EP2)."""
    for name, child in list(module.named_children()):
        new = func(child, name, prefix)
        if new is not child:
            setattr(module, name, new) if not name.isdigit() else module.__setitem__(int(name), new)
            continue
        full = _child_name(module, name, child, index_offset)
        walk(child, func, f"{prefix}.{full}" if prefix else full, _expert_offset(module, name))
    return module


@dataclass
class PEFT(ABC):
    """Bridge's abstract PEFT: subclasses define :meth:`transform` (and their fields)."""

    #: The state keys a checkpoint of the transformed model holds (:meth:`set_params_to_save`).
    params_to_save: Set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    #: The pretrained folder whose weights the adapters apply to, once a run has read it
    #: (:func:`apply_peft`): what its checkpoints record (:mod:`bridge_hpc.peft.checkpoint`).
    base_folder: Optional[str] = field(default=None, init=False, repr=False, compare=False)
    #: Its digest (:func:`bridge_hpc.peft.checkpoint.base_digest`), taken when the run read it.
    base_digest: Optional[str] = field(default=None, init=False, repr=False, compare=False)

    @abstractmethod
    def transform(self, module, name: Optional[str] = None, prefix: Optional[str] = None):
        """The module to put in place of ``module`` (``name`` under the parent whose full name is ``prefix``):
        a wrapped one with adapters, or ``module`` itself."""

    def finalize(self) -> None:  # noqa: B027 - a PEFT of the user's own may have nothing to check
        """Check the fields, naming ``peft.<field>`` (called with the other sections' ``finalize``)."""

    def __call__(self, model, training: bool = True):
        """Freeze ``model`` (a module or a list of pipeline/virtual-stage chunks), wrap the targeted layers
        with adapters and set train/eval mode; returns ``model`` (the same chunks, changed in place)."""
        self.finalize()
        self.freeze_model(model, training=training)
        self._walk_model(model, self.transform)
        if not training:
            self.freeze_model(model, training=False)
        for chunk in _chunks(model):
            chunk.train(mode=training)
        self.set_params_to_save(model)
        return model

    def _walk_model(self, model, func: Transform) -> None:
        for chunk in _chunks(model):
            walk(chunk, func)

    def freeze_model(self, model, training: bool = True) -> None:
        """Freeze every parameter of ``model`` (the base): no gradient, so neither the data-parallel
        wrapper nor the optimizer built afterwards holds anything for it."""
        for chunk in _chunks(model):
            for param in chunk.parameters():
                param.requires_grad = False
            if training:
                chunk.train(mode=True)

    def set_params_to_save(self, model) -> None:
        """Record the state keys a checkpoint holds: the trainable parameters (the adapters)."""
        self.params_to_save = {name for chunk in _chunks(model) for name, param in chunk.named_parameters()
                               if param.requires_grad}

    def adapter_key_filter(self, key) -> bool:
        """Whether a state key is saved in a PEFT checkpoint: a ``(name, parameter)`` pair when trainable, a
        name when recorded by :meth:`set_params_to_save` or an adapter's (``.adapter.`` in it)."""
        if isinstance(key, tuple):
            return bool(key[1].requires_grad)
        return key in self.params_to_save or is_adapter_key(key)


def check_low_rank_fields(peft, section: str) -> None:
    """Refuse, naming ``<section>.<field>``, a bad value of the fields LoRA and DoRA share (Bridge's names)."""
    _check(isinstance(peft.dim, int) and not isinstance(peft.dim, bool) and peft.dim >= 1, f"{section}.dim",
           f"expected an integer >= 1 (the adapters' rank), got {peft.dim!r}")
    _check(isinstance(peft.alpha, (int, float)) and not isinstance(peft.alpha, bool) and peft.alpha > 0,
           f"{section}.alpha", f"expected a number > 0 (the adapters' output is scaled by alpha / dim), got {peft.alpha!r}")
    _check(isinstance(peft.dropout, (int, float)) and not isinstance(peft.dropout, bool) and 0.0 <= peft.dropout < 1.0,
           f"{section}.dropout", f"expected a probability in [0, 1), got {peft.dropout!r}")
    _check(peft.dropout_position in ("pre", "post"), f"{section}.dropout_position",
           f"expected \"pre\" (dropout on the adapter's input) or \"post\" (on its output), got {peft.dropout_position!r}")
    for key in ("lora_A_init_method", "lora_B_init_method"):
        value = getattr(peft, key)
        _check(value in INIT_METHODS, f"{section}.{key}",
               f"expected one of {', '.join(repr(m) for m in INIT_METHODS)}, got {value!r}")


#: Bridge's adapter initializations: xavier normal, normal (std 0.2), kaiming uniform (a = sqrt(5)), zero.
INIT_METHODS = ("xavier", "normal", "kaiming", "zero")


def adapter_candidates(num_layers: int, model: Any = None) -> List[Tuple[str, str]]:
    """``(name, full name)`` of every linear layer of this toolkit's GPT (megatron-core's layer spec) that
    adapters can wrap, for a model of ``num_layers`` layers: what ``target_modules`` is matched against
    before any model is built. ``model`` (the model config), where it is a Mixture-of-Experts one: its MoE
    layers hold, in place of the MLP, each expert's two linear layers
    (``mlp.experts.local_experts.<global expert>.linear_fc1``) and the shared expert's
    (``mlp.shared_experts.linear_fc1``), as megatron-core names them (Bridge's LoRA targets them by the same
    names: ``linear_fc1`` adapts every expert)."""
    pattern = model.moe_layer_pattern() if getattr(model, "is_moe", False) else [0] * num_layers
    experts = getattr(model, "num_moe_experts", None) or 0
    shared = bool(getattr(model, "moe_shared_expert_intermediate_size", None))
    out = []
    for i in range(num_layers):
        out += [(name, f"decoder.layers.{i}.self_attention.{name}") for name in ("linear_qkv", "linear_proj")]
        if not (i < len(pattern) and pattern[i]):
            out += [(name, f"decoder.layers.{i}.mlp.{name}") for name in ("linear_fc1", "linear_fc2")]
            continue
        mlps = [f"experts.local_experts.{e}" for e in range(experts)] + (["shared_experts"] if shared else [])
        out += [(name, f"decoder.layers.{i}.mlp.{mlp}.{name}") for mlp in mlps for name in ("linear_fc1", "linear_fc2")]
    return out


def apply_peft(peft: PEFT, chunks: list, seed: int, base_folder: Optional[str]) -> list:
    """Transform a run's bare model chunks (the pretrained weights read into them from ``base_folder``) with
    ``peft``: what the trainer's pre-wrap step does. The adapters' initial values are drawn from ``seed``
    (``rng.seed``) and each adapter's full name, whatever the parallel layout; the torch random state
    the run goes on with is left as it was. Returns the chunks."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft(chunks, training=True)
    peft.base_folder = base_folder
    peft.base_digest = _digest_taken_once(base_folder) if base_folder else None
    return chunks


def _digest_taken_once(folder: str) -> str:
    """The base's digest, read by rank 0 and sent to the others (it samples the model's files: every
    rank of a large job reading them at once would be a storm on a shared file system). Collective."""
    import torch.distributed as dist

    from bridge_hpc.peft.checkpoint import base_digest

    if not (dist.is_available() and dist.is_initialized()):
        return base_digest(folder)
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = base_digest(folder)
        except OSError as err:  # sent on, so that every rank fails alike instead of waiting for rank 0
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], OSError):
        raise box[0]
    return box[0]
