"""The optimizer: one setup for CPU and GPU, a fused step, and per-parameter overrides.

:func:`setup_optimizer` builds megatron-core's optimizer (``get_megatron_optimizer``) on CUDA and a
torch optimizer behind :class:`TorchOptimizer` on CPU. Both take their parameter groups from one
description, :meth:`OptimizerConfigOverrideProvider.build_config_overrides`: megatron-core's
``dict[ParamKey, ParamGroupOverride]``, passed as ``config_overrides`` on GPU and grouped the same way
(megatron-core's own ``ParamKey.matches`` and ``combine_param_group_overrides``) on CPU. The default
provider (:func:`~bridge_hpc.training.engine.config.default_config_overrides`, torch-free, beside the
``[optimizer]`` section) gives biases and 1-D parameters no weight decay, as Megatron
Bridge does, then applies the ``[[optimizer.overrides]]`` tables of the job file.

Why a step of our own (``optimizer.fused_step``, on by default). Without Apex or Transformer Engine,
megatron-core (0.16 and 0.19 alike) falls back to torch-only code: its ``multi_tensor_applier``
replacements loop over tensors in Python (the L2 norm even builds a CPU tensor from one ``.item()``
per gradient), its copy of the fp32 main params back into the bf16 model params is a Python loop,
and its Adam is torch's ``foreach`` AdamW. Neither version has a flag for a fused or foreach
alternative. On an H100 the 370 M GPT's step took 21.8 ms that way and 8.3 ms with torch's fused
AdamW on the fp32 main params plus foreach norm, clipping and copy-back (``../shared/notes/gpu.md``).
:func:`install_fused_step` makes exactly those changes on the optimizer *instance* (no fork, no
module-level patch, so megatron's own path stays available in the same process):

- the inner ``torch.optim.AdamW``'s param groups get ``fused=True`` (same Adam/AdamW math, one
  kernel for all tensors);
- the ``ChainedOptimizer``'s ``step`` becomes :meth:`FusedStep.step`: megatron's own
  ``prepare_grads`` (grad copy, unscale and inf check), then the gradient norm with
  ``torch._foreach_norm`` over the gradients megatron itself selects for the norm
  (``get_grads_for_grad_norm`` / ``get_main_grads_for_grad_norm``), the clip with
  ``torch._foreach_mul_`` (megatron's coefficient ``clip_grad / (norm + 1e-6)``), megatron's
  ``count_zeros`` when asked, and megatron's own ``step_with_ready_grads``;
- a bf16/fp16 ``Float16OptimizerWithFloat16Params``'s ``_copy_main_params_to_model_params`` becomes
  one ``torch._foreach_copy_``.

Numerics: the same Adam update and the same clipping rule; the sums inside the norm and the fused
kernel's operation order differ in the last bits, so runs agree within rounding, not bitwise, with
megatron's path (``tests/test_gpu_optimizer.py`` states the tolerance). Resume stays bitwise exact:
the kernels are a pure function of the checkpointed state, and a load hook puts back the kernel
choice (``fused``/``foreach``) and the ``step`` counters' device that a checkpoint's param groups
would otherwise override (a checkpoint written by the other path must not switch kernels silently).

On CPU, ``fused_step`` means torch's fused AdamW (torch >= 2.4 has a CPU kernel) and a foreach
gradient norm: 1.1 ms instead of 3.7 ms per step for the tiny GPT of ``configs/local-tiny.toml``
(measured here, one thread); resume is bitwise exact either way (``tests/test_training_resume.py``).
"""

from __future__ import annotations

import logging
import math
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from bridge_hpc.training.config import (
    ConfigContainer,
    OptimizerConfig,
    OptimizerConfigOverrideProvider,
    OptimizerConfigOverrideProviderContext,
)
from bridge_hpc.training.engine.config import STATE_DTYPE_FIELDS, default_config_overrides, dtype_name, param_name

logger = logging.getLogger(__name__)

__all__ = [
    "FusedStep",
    "OptimizerConfigOverrideProvider",
    "OptimizerConfigOverrideProviderContext",
    "TorchOptimizer",
    "default_config_overrides",
    "install_fused_step",
    "installed_fused_step",
    "megatron_optimizer_config",
    "param_name",
    "setup_optimizer",
    "torch_param_groups",
]


# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------


def setup_optimizer(cfg: ConfigContainer, model: List[torch.nn.Module]):
    """megatron-core's optimizer on GPU, a torch AdamW/SGD behind :class:`TorchOptimizer` on CPU.

    Parameter groups come from ``cfg.optimizer_config_override_provider`` on both (see the module
    docstring); ``cfg.optimizer.fused_step`` picks the fused step.
    """
    o = cfg.optimizer
    context = OptimizerConfigOverrideProviderContext(scheduler_config=cfg.scheduler, optimizer_config=o, model=model)
    overrides = cfg.optimizer_config_override_provider.build_config_overrides(context)
    if torch.cuda.is_available():
        from megatron.core.optimizer import get_megatron_optimizer

        optimizer = get_megatron_optimizer(megatron_optimizer_config(o), model, config_overrides=overrides)
        if o.fused_step:
            install_fused_step(optimizer)
        else:
            _keep_kernel_choice_on_load(optimizer, fused=False)
        return optimizer
    check_cpu_optimizer(o)
    groups = torch_param_groups(model, o, overrides)
    params = [p for g in groups for p in g["params"]]
    fused = {"fused": True} if o.fused_step else {}
    if o.optimizer == "adam":
        # megatron-core's choice too: decoupled weight decay is AdamW, else Adam with L2 in the gradient.
        adam = torch.optim.AdamW if o.decoupled_weight_decay else torch.optim.Adam
        inner = adam(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                     weight_decay=o.weight_decay, **fused)
    else:
        inner = torch.optim.SGD(groups, lr=o.lr, momentum=o.sgd_momentum, weight_decay=o.weight_decay, **fused)
    _pin_kernels_on_load(inner, fused=o.fused_step)
    return TorchOptimizer(inner, params, o.clip_grad, foreach=True if o.fused_step else None,
                          count_zeros=o.log_num_zeros_in_grad, expert_group=_expert_group(params))


def _expert_group(params: List[torch.nn.Parameter]):
    """The group over which this rank's expert parameters differ from other ranks' (expert
    parallelism), whose squared gradient norms a clipping norm sums; None without it."""
    from bridge_hpc.training.engine import moe

    if not any(moe.is_expert_param(p) for p in params):
        return None
    group = moe.expert_sq_norm_group()
    return group if torch.distributed.get_world_size(group) > 1 else None


def check_cpu_optimizer(o: OptimizerConfig) -> None:
    """Refuse, naming the key, what the CPU optimizer (torch's) cannot do: fp16 loss scaling (there is
    no fp16 training on CPU) and megatron-core's precision-aware optimizer (Transformer Engine, CUDA)."""
    from bridge_hpc.contracts.schema import check_left_at_default

    why = "needs a GPU: on CPU the optimizer is torch's, with no fp16 loss scaler"
    check_left_at_default(o, "optimizer", {
        **{name: why for name in ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                                  "hysteresis")},
        "use_precision_aware_optimizer": "needs a GPU with Transformer Engine's FusedAdam",
    })


def megatron_optimizer_config(o: OptimizerConfig):
    """megatron-core's ``OptimizerConfig`` for our section: every field of megatron-core's class that the
    section has (all of them; it declares megatron-core's fields), dtype names turned into torch dtypes.
    ``params_dtype`` left unset follows ``bf16``/``fp16``; bridge_hpc's own fields (``fused_step``,
    ``overrides``) are not megatron-core's and stay behind."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    values = {f.name: getattr(o, f.name) for f in dataclasses.fields(MegatronOptimizerConfig)
              if f.init and hasattr(o, f.name)}
    implied = torch.bfloat16 if o.bf16 else torch.float16 if o.fp16 else torch.float32
    values["params_dtype"] = implied if o.params_dtype in (None, "float32", torch.float32) else torch_dtype(o.params_dtype)
    for key in STATE_DTYPE_FIELDS:
        values[key] = torch_dtype(values[key])
    return MegatronOptimizerConfig(**values)


def torch_dtype(value) -> torch.dtype:
    """A dtype given by name (job file) or as a torch dtype (Python config)."""
    return getattr(torch, dtype_name(value, "optimizer"))


# ---------------------------------------------------------------------------------------------
# Per-parameter overrides
# ---------------------------------------------------------------------------------------------


def torch_param_groups(model: Sequence[torch.nn.Module], o: OptimizerConfig,
                       overrides: Optional[Dict[Any, Any]]) -> List[Dict[str, Any]]:
    """The CPU optimizer's parameter groups from megatron-core's ``config_overrides``, grouped as
    ``get_megatron_optimizer`` groups them: each parameter's matching overrides combined, parameters
    with equal results in one group, the group without overrides first (its lr is the one logged),
    ``None`` meaning megatron's standard overrides. Each group carries the keys megatron's scheduler
    reads (``max_lr``, ``min_lr``, ``wd_mult``, ...)."""
    from megatron.core.optimizer_param_scheduler import combine_param_group_overrides, param_group_override_to_tuple

    if overrides is None:
        from megatron.core.optimizer import get_standard_config_overrides

        overrides = get_standard_config_overrides(megatron_optimizer_config(o))
    by_key: Dict[Any, List[torch.nn.Parameter]] = {}
    for chunk in model:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            hits = [value for key, value in overrides.items() if key.matches(param, name)]
            combined = combine_param_group_overrides(hits) if hits else None
            by_key.setdefault(param_group_override_to_tuple(combined), []).append(param)
    groups = []
    for key in sorted(by_key, key=lambda k: (k is not None, k or ())):
        override = dict(key) if key else {}
        groups.append({"params": by_key[key], "wd_mult": 1.0, "lr_mult": 1.0, "max_lr": o.lr, "min_lr": o.min_lr,
                       "default_config": not any("lr" in k for k in override), **override})
    return groups


# ---------------------------------------------------------------------------------------------
# CPU: a torch optimizer behind megatron's interface
# ---------------------------------------------------------------------------------------------


class TorchOptimizer:
    """A torch optimizer behind the part of megatron's optimizer interface the loop uses.

    ``step()`` clips and returns ``(update_successful, grad_norm, num_zeros_in_grad)``; a
    non-finite gradient norm skips the update, as megatron's optimizer does. ``foreach`` is passed to
    ``clip_grad_norm_`` (None: torch's default, a per-tensor loop on CPU). With expert parallelism
    (``expert_group``) the norm is the whole model's: the expert parameters' squared norms are summed over
    the ranks that hold different experts, as megatron-core's optimizer sums them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: List[torch.nn.Parameter], clip_grad: float,
                 foreach: Optional[bool] = None, count_zeros: bool = False, expert_group=None):
        self.optimizer = optimizer
        self.params = params
        self.clip_grad = clip_grad
        self.foreach = foreach
        self.count_zeros = count_zeros
        self.expert_group = expert_group

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def get_loss_scale(self) -> torch.Tensor:
        """megatron's interface: no loss scaling on CPU (there is no fp16 training there)."""
        return torch.tensor(1.0)

    def step(self):
        # Counted before clipping, as megatron-core counts them (``optimizer.log_num_zeros_in_grad``).
        zeros = self._num_zeros_in_grad() if self.count_zeros else None
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        if self.expert_group is None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=self.foreach))
        else:
            grad_norm = self._clip_with_experts(max_norm)
        if not math.isfinite(grad_norm):
            return False, grad_norm, zeros
        self.optimizer.step()
        return True, grad_norm, zeros

    def _clip_with_experts(self, max_norm: float) -> float:
        from bridge_hpc.training.engine.moe import is_expert_param

        grads = [p.grad for p in self.params if p.grad is not None]
        experts = [p.grad for p in self.params if p.grad is not None and is_expert_param(p)]
        shared = [p.grad for p in self.params if p.grad is not None and not is_expert_param(p)]
        squares = torch.stack([torch.nn.utils.get_total_norm(part, foreach=self.foreach) ** 2 if part
                               else torch.zeros(()) for part in (shared, experts)])
        torch.distributed.all_reduce(squares[1:], group=self.expert_group)
        norm = squares.sum().sqrt()
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=self.foreach)
        return float(norm)

    def _num_zeros_in_grad(self) -> int:
        """Gradient elements equal to zero, over every parameter this rank updates; summed over the
        data-parallel ranks' (equal, all-reduced) gradients it would count them again, so it is not."""
        return int(sum(int((p.grad == 0).sum()) for p in self.params if p.grad is not None))

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)


# ---------------------------------------------------------------------------------------------
# Kernel choice that survives a checkpoint load
# ---------------------------------------------------------------------------------------------


def _pin_kernels_on_load(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Keep this optimizer's kernel choice across ``load_state_dict``.

    torch's ``load_state_dict`` replaces each param group by the saved one, ``fused``/``foreach``
    flags included, and puts the ``step`` counters on the device the *saved* flags imply. A checkpoint
    written by the other path would thus switch kernels silently (or hand the fused kernel a CPU
    counter). Done with torch's public load post-hook."""
    flags = [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups]
    if fused:
        flags = [(True, False)] * len(flags)

    def restore(opt: torch.optim.Optimizer) -> None:
        for group, (fused_flag, foreach_flag) in zip(opt.param_groups, flags):
            group["fused"], group["foreach"] = fused_flag, foreach_flag
            for param in group["params"]:
                state = opt.state.get(param)
                if not state or "step" not in state:
                    continue
                step = state["step"]
                device = param.device if fused_flag or group.get("capturable") else torch.device("cpu")
                if not torch.is_tensor(step) or step.device != device or step.dtype != torch.float32:
                    state["step"] = torch.as_tensor(step, dtype=torch.float32).to(device)

    restore(optimizer)
    optimizer.register_load_state_dict_post_hook(restore)


def _inner_torch_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [m.optimizer for m in chained if isinstance(getattr(m, "optimizer", None), torch.optim.Optimizer)]


def _keep_kernel_choice_on_load(optimizer, fused: bool) -> None:
    """Pin torch's own Adam/AdamW/SGD (megatron's fallback); Apex's or TE's fused Adam is left alone.
    Only Adam goes fused on GPU: SGD keeps megatron's construction."""
    for inner in _inner_torch_optimizers(optimizer):
        if type(inner) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
            _pin_kernels_on_load(inner, fused=fused and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)))


# ---------------------------------------------------------------------------------------------
# GPU: the fused step on megatron-core's optimizer
# ---------------------------------------------------------------------------------------------


def install_fused_step(optimizer) -> Optional["FusedStep"]:
    """Give a megatron-core optimizer (as ``get_megatron_optimizer`` returns it) the fused step.

    The inner torch Adam/AdamW optimizers run fused in every case. The step itself is replaced only
    where it is megatron's plain sequence (a ``ChainedOptimizer`` whose optimizers share one
    gradient-statistics group, no precision-aware optimizer, no Megatron-FSDP, no separately clipped
    gradient-norm groups); otherwise megatron's own step stays, and this is logged. Returns the
    installed :class:`FusedStep`, or None."""
    _keep_kernel_choice_on_load(optimizer, fused=True)
    reason = _why_not_fused_step(optimizer)
    if reason is not None:
        logger.warning("optimizer.fused_step: fused AdamW only; megatron-core's own step kept (%s)", reason)
        return None
    fused = FusedStep(optimizer)
    optimizer.step = fused.step  # an instance attribute: shadows ChainedOptimizer.step for this object only
    for inner in optimizer.chained_optimizers:
        if hasattr(inner, "float16_groups") and hasattr(inner, "fp32_from_float16_groups"):
            _install_foreach_copy_back(inner)
    return fused


def _why_not_fused_step(optimizer) -> Optional[str]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return f"{type(optimizer).__name__} is not a ChainedOptimizer"
    config = optimizer.config
    if config.use_precision_aware_optimizer:
        return "use_precision_aware_optimizer"
    if math.isfinite(vars(config).get("grad_norm_skip_threshold", math.inf)):  # megatron-core >= 0.19: on
        return "grad_norm_skip_threshold"
    if any(getattr(getattr(m, "ddp_config", None), "use_megatron_fsdp", False) for m in chained):
        return "Megatron-FSDP"
    groups = {id(m.get_grad_stats_parallel_group()) for m in chained}
    if len(groups) > 1:
        return "the chained optimizers reduce gradient statistics over different groups"
    from megatron.core.optimizer import optimizer as megatron_optimizer_module

    attr = vars(megatron_optimizer_module).get("GRAD_NORM_GROUP_ATTR")  # megatron-core >= 0.19
    if attr is not None and any(getattr(p, attr, None) is not None for m in chained for p in m.get_parameters()):
        return "parameters in separately clipped gradient-norm groups"
    return None


def _install_foreach_copy_back(inner) -> None:
    """One ``torch._foreach_copy_`` for the fp32 main params -> bf16/fp16 model params copy that
    megatron-core does in a Python loop without Apex/TE (same rounding: a dtype-converting copy)."""
    model_params = [p for group in inner.float16_groups for p in group]
    main_params = [p for group in inner.fp32_from_float16_groups for p in group]

    def copy_main_params_to_model_params(self) -> None:
        if model_params:
            torch._foreach_copy_(model_params, main_params)

    inner._copy_main_params_to_model_params = types.MethodType(copy_main_params_to_model_params, inner)


class FusedStep:
    """megatron-core ``ChainedOptimizer.step`` with foreach gradient norm and clipping (see the module
    docstring). Returns what megatron's step returns: ``(update_successful, grad_norm, num_zeros)``."""

    def __init__(self, chained):
        self.chained = chained
        self.optimizers = list(chained.chained_optimizers)
        self.params = [p for m in self.optimizers for p in m.get_parameters()]
        self.clip_grad = chained.config.clip_grad
        self.group = self.optimizers[0].get_grad_stats_parallel_group() if self.optimizers else None
        self._norm_params: Optional[List[torch.Tensor]] = None
        self._params_with_grad = -1
        self._queued: Optional[Tuple[bool, Optional[torch.Tensor]]] = None

    @torch.no_grad()
    def queue_grad_norm(self) -> None:
        """Queue the step's work up to its one host read, the gradient norm: megatron's
        ``prepare_grads`` and the norm's kernels and all-reduce. The next :meth:`step` uses them. Why:
        the loop checks the step's losses on the host before the optimizer step (a synchronization);
        queued before those checks, this work runs while the host waits instead of after, on an idle
        GPU. Nothing here touches the weights, so a step the checks abandon changes nothing."""
        self._queued = self._prepare_and_norm()

    def _prepare_and_norm(self) -> Tuple[bool, Optional[torch.Tensor]]:
        if hasattr(self.chained, "grad_norms_by_group"):  # megatron-core >= 0.19 resets it each step
            self.chained.grad_norms_by_group = {}
        if self.chained.prepare_grads():  # found inf/nan (fp16 loss scaling)
            return True, None
        return False, self.grad_norm_squared()

    @torch.no_grad()
    def step(self):
        queued, self._queued = self._queued, None
        found_inf, norm_squared = queued if queued is not None else self._prepare_and_norm()
        if found_inf:
            return False, None, None
        grad_norm = norm_squared.item() ** 0.5
        if self.clip_grad > 0.0:
            self.clip(grad_norm)
        config = self.chained.config
        num_zeros = self.chained.count_zeros() if config.log_num_zeros_in_grad else None
        return self.chained.step_with_ready_grads(), grad_norm, num_zeros

    def grads_for_norm(self) -> List[torch.Tensor]:
        """The gradients megatron counts in the norm (not shared, not tensor-parallel duplicates),
        asked of megatron once and again only when the set of parameters with a gradient changes:
        its filter costs microseconds per parameter, which adds up to milliseconds per step."""
        with_grad = sum(1 for p in self.params if p.grad is not None)
        if self._norm_params is None or with_grad != self._params_with_grad:
            by_id = {id(p.grad): p for p in self.params if p.grad is not None}
            grads = [g for m in self.optimizers for g in _megatron_grads_for_norm(m)]
            self._norm_params = [by_id[id(g)] for g in grads]
            self._params_with_grad = with_grad
        return [p.grad for p in self._norm_params if p.grad is not None]

    def grad_norm(self) -> float:
        """L2 norm of the gradients over the gradient-statistics group, as megatron's
        ``get_grad_norm_fp32`` computes it (norm of per-tensor norms, squared, summed over ranks),
        with ``torch._foreach_norm`` instead of a Python loop and one ``.item()`` instead of one per
        tensor."""
        return self.grad_norm_squared().item() ** 0.5

    def grad_norm_squared(self) -> torch.Tensor:
        """The square of :meth:`grad_norm`, on the device (nothing read on the host)."""
        grads = self.grads_for_norm()
        device = torch.device("cuda", torch.cuda.current_device())
        if grads:
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0) ** 2
        else:
            total = torch.zeros((), dtype=torch.float32, device=device)
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return total

    def clip(self, grad_norm: float) -> None:
        """megatron's ``clip_grad_by_total_norm_fp32``: scale every gradient by
        ``clip_grad / (norm + 1e-6)`` when that is below 1, in one foreach multiply."""
        coeff = self.clip_grad / (grad_norm + 1.0e-6)
        if coeff < 1.0:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coeff)


def installed_fused_step(optimizer) -> Optional[FusedStep]:
    """The :class:`FusedStep` :func:`install_fused_step` gave ``optimizer`` (whose ``step`` is then that
    object's method), or None."""
    owner = getattr(optimizer.step, "__self__", None)
    return owner if isinstance(owner, FusedStep) else None


def _megatron_grads_for_norm(optimizer) -> List[torch.Tensor]:
    # megatron-core 0.19 renamed get_main_grads_for_grad_norm to get_grads_for_grad_norm.
    method = getattr(optimizer, "get_grads_for_grad_norm", None) or optimizer.get_main_grads_for_grad_norm
    return method()
