"""Type definitions for forward-step functions: Megatron Bridge's ``forward_step_func_types``.

Bridge users annotate their forward steps with these names (``ForwardStepCallable`` in
``pretrain``/``train``/``train_step`` signatures), so the same names are importable here. They are
typing Protocols and aliases only: what a forward step may look like at run time (which of the four
signatures, whether it wants the ``GlobalState``) is decided once, by
:func:`bridge_hpc.training.utils.train_utils.prepare_forward_step_func`.

The signatures (as Bridge documents them): ``(data_iterator, model)``, ``(state, data_iterator,
model)``, ``(data_iterator, model, return_schedule_plan=False)`` and ``(state, data_iterator, model,
return_schedule_plan=False)``, functions or callable objects; each returns ``(output, loss_func)``,
where ``loss_func(output)`` returns ``(loss, report)`` or ``(loss, num_tokens, report)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, Union, overload

import torch

if TYPE_CHECKING:  # the state module imports the config, which must stay cheap to import
    from bridge_hpc.training.state import GlobalState

#: What a loss function reports for logging: name -> reduced tensor.
LossReduced = dict[str, torch.Tensor]
#: ``(loss, loss_reduced)``: the loss is averaged over micro-batches.
TwoTupleLossReturn = tuple[torch.Tensor, LossReduced]
#: ``(loss, num_tokens, loss_reduced)``: per-token loss, divided by the token count.
ThreeTupleLossReturn = tuple[torch.Tensor, torch.Tensor, LossReduced]
#: Anything, when the loss function is called with ``non_loss_data=True`` (evaluation hooks).
InferenceLossReturn = Any
LossFunctionReturn = Union[TwoTupleLossReturn, ThreeTupleLossReturn, InferenceLossReturn]
#: The loss function a forward step returns (Bridge types it as a ``functools.partial``).
LossFunction = partial


class TwoArgForwardStep(Protocol):
    """``(data_iterator, model) -> (output, loss_func)``: no state, no schedule plan."""

    def __call__(self, data_iterator: Iterable, model: torch.nn.Module) -> tuple[torch.Tensor, LossFunction]: ...


class ThreeArgStateForwardStep(Protocol):
    """``(state, data_iterator, model) -> (output, loss_func)``: the GlobalState is passed first."""

    def __call__(self, state: "GlobalState", data_iterator: Iterable,
                 model: torch.nn.Module) -> tuple[torch.Tensor, LossFunction]: ...


class ThreeArgForwardStep(Protocol):
    """``(data_iterator, model, return_schedule_plan=False) -> (output, loss_func)``."""

    def __call__(self, data_iterator: Iterable, model: torch.nn.Module,
                 return_schedule_plan: bool = False) -> tuple[torch.Tensor, LossFunction]: ...


class FourArgForwardStep(Protocol):
    """``(state, data_iterator, model, return_schedule_plan=False) -> (output, loss_func)``."""

    def __call__(self, state: "GlobalState", data_iterator: Iterable, model: torch.nn.Module,
                 return_schedule_plan: bool = False) -> tuple[torch.Tensor, LossFunction]: ...


class ForwardStepFunctor(Protocol):
    """A callable object whose ``__call__`` has one of the four signatures (state kept between calls)."""

    @overload
    def __call__(self, data_iterator: Iterable, model: torch.nn.Module) -> tuple[torch.Tensor, LossFunction]: ...

    @overload
    def __call__(self, data_iterator: Iterable, model: torch.nn.Module,
                 return_schedule_plan: bool = False) -> tuple[torch.Tensor, LossFunction]: ...

    @overload
    def __call__(self, state: "GlobalState", data_iterator: Iterable,
                 model: torch.nn.Module) -> tuple[torch.Tensor, LossFunction]: ...

    @overload
    def __call__(self, state: "GlobalState", data_iterator: Iterable, model: torch.nn.Module,
                 return_schedule_plan: bool = False) -> tuple[torch.Tensor, LossFunction]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, LossFunction]: ...


#: Any of the four function signatures.
ForwardStepFunc = Union[TwoArgForwardStep, ThreeArgStateForwardStep, ThreeArgForwardStep, FourArgForwardStep]
#: Functions and functors: what ``pretrain``, ``train`` and ``train_step`` accept.
ForwardStepCallable = Union[ForwardStepFunc, ForwardStepFunctor]
