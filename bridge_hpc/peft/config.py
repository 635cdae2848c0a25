"""The ``[peft]`` section of a job file and the checks of a PEFT config against the model (torch-free).

``[peft] type = "lora"`` (or ``"dora"``) selects the class; its other keys are the class's fields, as
in Python (``LoRA(dim=16, ...)``). A Python config sets ``ConfigContainer.peft`` to an instance.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from bridge_hpc.contracts.errors import ConfigError
from bridge_hpc.contracts.schema import build_dataclass, did_you_mean
from bridge_hpc.peft.base import PEFT, adapter_candidates
from bridge_hpc.peft.dora import DoRA
from bridge_hpc.peft.lora import LoRA

#: ``[peft] type`` -> class.
PEFT_TYPES: Dict[str, type] = {"lora": LoRA, "dora": DoRA}


def peft_from_section(body: Any, error: Callable[[str, str], ConfigError]) -> PEFT:
    """The PEFT of a ``[peft]`` table; ``error(key, message)`` makes the exception (the caller names the file)."""
    if not isinstance(body, dict):
        raise error("peft", f"expected a table [peft], got {body!r}")
    kind = body.get("type")
    if kind not in PEFT_TYPES:
        raise error("peft.type", f"expected one of {', '.join(repr(k) for k in PEFT_TYPES)}, got {kind!r}"
                    f"{did_you_mean(str(kind), list(PEFT_TYPES)) if isinstance(kind, str) else ''}")
    return build_dataclass(PEFT_TYPES[kind], "peft", {k: v for k, v in body.items() if k != "type"}, error)


def peft_type(peft: PEFT) -> str:
    """The ``[peft] type`` name of ``peft`` (its class name, lower case, for a PEFT of another class)."""
    return next((name for name, cls in PEFT_TYPES.items() if type(peft) is cls), type(peft).__name__.lower())


def check_peft(peft: Any, num_layers: int, hidden_size: Optional[int] = None, model: Any = None) -> None:
    """Check ``ConfigContainer.peft`` on its own and against a GPT of ``num_layers`` layers of width
    ``hidden_size``: a PEFT instance, its fields (``peft.<field>``), an adapter rank ``dim`` of at most
    ``hidden_size`` (each adapted layer is ``hidden_size`` wide on one side, so ``B A`` has at most that
    rank: a larger ``dim`` only adds parameters), and every ``target_modules`` entry matching at least one
    layer (a typo would otherwise train nothing there), named as Bridge does; ``model`` (the model config)
    adds a Mixture-of-Experts model's expert layers to those (:func:`adapter_candidates`)."""
    if not isinstance(peft, PEFT):
        raise ConfigError(f"expected a bridge_hpc.peft PEFT (e.g. bridge_hpc.peft.lora.LoRA), got {type(peft).__name__}",
                          key="peft")
    peft.finalize()
    dim = getattr(peft, "dim", None)
    if isinstance(hidden_size, int) and isinstance(dim, int) and dim > hidden_size:
        raise ConfigError(f"is {dim}, above the bound model.hidden_size = {hidden_size}: expected at most {hidden_size} "
                          "(every adapted layer is hidden_size wide on one side, so the update B A has at most that "
                          "rank; a larger dim only adds parameters)", key="peft.dim")
    unmatched = getattr(peft, "unmatched_targets", None)
    if unmatched is not None:
        candidates = adapter_candidates(num_layers, model)
        if not peft.target_modules and not any(peft.match(name, full) for name, full in candidates):
            raise ConfigError(f"excludes every linear layer of the {num_layers}-layer GPT: there would be nothing to "
                              "train", key="peft.exclude_modules")
        experts = [full for name, full in candidates if ".local_experts." in full and peft.match(name, full)]
        if experts and getattr(model, "moe_grouped_gemm", False):
            raise ConfigError(f"is true, and peft.target_modules adapts the experts' layers ({experts[0]}, ...): adapters "
                              "wrap each expert's own linear layers, which the grouped GEMM replaces; set "
                              "model.moe_grouped_gemm = false, or target the attention and shared-expert layers only",
                              key="model.moe_grouped_gemm")
        missing = unmatched(candidates)
        if missing:
            raise ConfigError(f"no linear layer of the {num_layers}-layer GPT matches {', '.join(map(repr, missing))} "
                              "(layer names: linear_qkv, linear_proj, linear_fc1, linear_fc2; full names: "
                              "decoder.layers.<i>.self_attention.linear_qkv, decoder.layers.<i>.mlp.linear_fc1, ...)",
                              key="peft.target_modules")
