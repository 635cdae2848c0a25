"""Megatron Bridge's param mappings (``megatron.bridge.models.conversion.param_mapping``) for the
families here: one class per kind of mapping, holding both directions. Torch-free at module level:
the login node builds them to check a folder's tensor headers (:meth:`MegatronParamMapping.hf_shapes`)
before anything is submitted; only the two conversions, which the ranks and ``bridge-hf`` call, touch
tensors.

A mapping names one megatron-core parameter (its name in the local layer spec, ``{i}`` the layer
counted over the whole model, ``{e}`` the expert counted over the whole layer) and the Hugging Face
tensors it is made of, with the parameter's whole shape (the Hugging Face vocabulary's rows, unpadded):

- :meth:`~MegatronParamMapping.hf_to_megatron`: the rank's part of the parameter (:class:`Shard`)
  from the Hugging Face tensors, given as anything that slices like a tensor (``t[a:b]``,
  ``t[:, a:b]``, ``t[:]``): safetensors' lazy ``get_slice`` on the ranks, so that a rank reads only
  the bytes of its own slice, or a tensor;
- :meth:`~MegatronParamMapping.megatron_to_hf`: the Hugging Face tensors from the whole parameter
  (``bridge-hf export`` reads whole tensors: torch.distributed.checkpoint gathers any saved sharding).

Weights are megatron's ``[out, in]``; GPT-2's Conv1D stores ``[in, out]`` (``transpose``).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

Shape = Tuple[int, ...]


class Shard(NamedTuple):
    """The part of a parameter one rank holds: its rank and the size of the group the parameter is
    split over (tensor-parallel; expert-tensor-parallel for an expert's tensors) and the local shape."""

    rank: int
    size: int
    shape: Shape


class MegatronParamMapping:
    """One megatron-core parameter <-> the Hugging Face tensor(s) it is made of.

    ``hf_param``: one name, or role -> name for a parameter made of several tensors (``q``/``k``/``v``,
    ``gate``/``up``). ``shape``: the parameter's whole shape, unpadded. ``layers``: the layer numbers
    the ``{i}`` template covers (None: every layer; MoE models mix dense and expert layers);
    ``num_experts``: how many values ``{e}`` takes."""

    def __init__(self, megatron_param: str, hf_param: Union[str, Dict[str, str]], shape: Shape,
                 transpose: bool = False, layers: Optional[Tuple[int, ...]] = None, num_experts: int = 0):
        if ("{e}" in megatron_param) != (num_experts > 0):
            raise ValueError(f"{megatron_param}: an expert's template ({{e}}) needs num_experts > 0, and only it")
        self.megatron_param, self.hf_param, self.shape = megatron_param, hf_param, tuple(shape)
        self.transpose, self.layers, self.num_experts = transpose, layers, num_experts

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.megatron_param!r}, {self.hf_param!r})"

    @property
    def is_layer(self) -> bool:
        """Whether the name is a template over the layers (``{i}``)."""
        return "{i}" in self.megatron_param

    @property
    def is_expert(self) -> bool:
        """Whether it is (the template of) one expert's parameter, ``mlp.experts.``: split over the
        expert-tensor-parallel group, and held by the expert-parallel rank that owns the expert (Bridge's
        ``is_expert``; a shared expert is no expert here: megatron-core splits it over the
        tensor-parallel group)."""
        return ".mlp.experts." in self.megatron_param

    def resolve(self, i: Optional[int] = None, e: Optional[int] = None) -> "MegatronParamMapping":
        """The same mapping for layer ``i`` and expert ``e`` (the templates filled in)."""
        out = copy.copy(self)
        fill = lambda name: name.format(i=i, e=e)  # noqa: E731
        out.megatron_param = fill(self.megatron_param)
        out.hf_param = fill(self.hf_param) if isinstance(self.hf_param, str) else {
            k: fill(v) for k, v in self.hf_param.items()}
        return out

    def first_hf_name(self) -> str:
        """The Hugging Face tensor a message about this parameter names."""
        return self.hf_param if isinstance(self.hf_param, str) else next(iter(self.hf_param.values()))

    def hf_shapes(self) -> Dict[str, Shape]:
        """The shape of each Hugging Face tensor the parameter is made of (what a folder's headers must say)."""
        return {self.hf_param: self._hf_shape(self.shape)}

    def _hf_shape(self, shape: Shape) -> Shape:
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    def hf_to_megatron(self, hf_weights: Any, shard: Shard):
        """The rank's part (``shard``) of the parameter from its Hugging Face tensor(s): one sliceable, or
        role -> sliceable for a parameter made of several (Bridge's ``hf_to_megatron``)."""
        raise NotImplementedError

    def megatron_to_hf(self, megatron_weight) -> Dict[str, Any]:
        """The Hugging Face tensors (name -> tensor, in their own layout) from the whole parameter."""
        raise NotImplementedError

    # reading megatron's [out, in] rows and columns from a tensor stored [out, in], or [in, out] (Conv1D)
    def _rows(self, source, start: int, stop: int):
        return source[:, start:stop].t() if self.transpose else source[start:stop]

    def _cols(self, source, start: int, stop: int):
        return source[start:stop, :].t() if self.transpose else source[:, start:stop]

    def _out(self, tensor):
        return (tensor.t() if self.transpose else tensor).contiguous()


class DirectMapping(MegatronParamMapping):
    """One Hugging Face tensor is the parameter, whole on every rank: norms, q/k norms, learned
    positions, the row-parallel layers' biases, the MoE router and shared-expert gate (Bridge's
    ``DirectMapping`` / ``ReplicatedMapping``)."""

    def hf_to_megatron(self, hf_weights, shard: Shard):
        return hf_weights[:]

    def megatron_to_hf(self, megatron_weight):
        return {self.hf_param: megatron_weight.contiguous()}


class ColumnParallelMapping(MegatronParamMapping):
    """Split over the ranks along the output dimension (rows of ``[out, in]``, or a bias's elements)."""

    def hf_to_megatron(self, hf_weights, shard: Shard):
        n = shard.shape[0]
        return self._rows(hf_weights, shard.rank * n, (shard.rank + 1) * n)

    def megatron_to_hf(self, megatron_weight):
        return {self.hf_param: self._out(megatron_weight)}


class RowParallelMapping(ColumnParallelMapping):
    """Split over the ranks along the input dimension (columns of ``[out, in]``): ``linear_proj``,
    ``linear_fc2``."""

    def hf_to_megatron(self, hf_weights, shard: Shard):
        n = shard.shape[1]
        return self._cols(hf_weights, shard.rank * n, (shard.rank + 1) * n)


class VocabMapping(ColumnParallelMapping):
    """The embedding or untied output layer: split by rows over the ranks, the rows past the Hugging
    Face vocabulary (megatron's padding to ``make_vocab_size_divisible_by``) zeros; the export drops
    them again."""

    def hf_to_megatron(self, hf_weights, shard: Shard):
        n, vocab = shard.shape[0], self.shape[0]
        start, stop = shard.rank * n, min((shard.rank + 1) * n, vocab)
        if stop <= start:  # a rank of padding rows only
            return hf_weights[0:1].new_zeros(shard.shape)
        part = self._rows(hf_weights, start, stop)
        out = part.new_zeros(shard.shape)
        out[: stop - start] = part
        return out

    def megatron_to_hf(self, megatron_weight):
        return {self.hf_param: self._out(megatron_weight[: self.shape[0]])}


class _Delegating(MegatronParamMapping):
    """A mapping that does what ``inner``, a mapping of the same names, does (and says more about it)."""

    inner: MegatronParamMapping

    def resolve(self, i=None, e=None):
        out = super().resolve(i, e)
        out.inner = self.inner.resolve(i, e)
        return out

    def hf_shapes(self):
        return self.inner.hf_shapes()

    def hf_to_megatron(self, hf_weights, shard: Shard):
        return self.inner.hf_to_megatron(hf_weights, shard)

    def megatron_to_hf(self, megatron_weight):
        return self.inner.megatron_to_hf(megatron_weight)


class AutoMapping(_Delegating):
    """The split chosen from the megatron-core layer the parameter belongs to, as Bridge's
    ``AutoMapping`` chooses it from the module's type: the vocabulary's layers by rows, padded;
    ``linear_qkv`` / ``linear_fc1`` (and their biases) column-parallel; ``linear_proj`` / ``linear_fc2``
    weights row-parallel; everything else (norms, row-parallel biases, positions, router) whole."""

    _BY_SUFFIX = (("word_embeddings.weight", VocabMapping), ("output_layer.weight", VocabMapping),
                  ("linear_qkv.weight", ColumnParallelMapping), ("linear_qkv.bias", ColumnParallelMapping),
                  ("linear_fc1.weight", ColumnParallelMapping), ("linear_fc1.bias", ColumnParallelMapping),
                  ("linear_proj.weight", RowParallelMapping), ("linear_fc2.weight", RowParallelMapping))

    def __init__(self, megatron_param: str, hf_param: str, shape: Shape, transpose: bool = False,
                 layers: Optional[Tuple[int, ...]] = None, num_experts: int = 0):
        super().__init__(megatron_param, hf_param, shape, transpose, layers, num_experts)
        kind = next((cls for suffix, cls in self._BY_SUFFIX if megatron_param.endswith(suffix)), DirectMapping)
        if kind is DirectMapping and transpose:
            raise ValueError(f"{megatron_param}: a tensor copied whole is not transposed")
        self.inner = kind(megatron_param, hf_param, shape, transpose, layers, num_experts)


class GatedMLPMapping(MegatronParamMapping):
    """The gated MLP's ``linear_fc1`` = ``[gate; up]`` from ``gate_proj`` and ``up_proj`` (Mixtral's
    ``w1``, ``w3``): each rank holds its gate rows, then its up rows. ``shape``: ``[2 * ffn, hidden]``."""

    def __init__(self, megatron_param: str, gate: str, up: str, shape: Shape,
                 layers: Optional[Tuple[int, ...]] = None, num_experts: int = 0):
        super().__init__(megatron_param, {"gate": gate, "up": up}, shape, layers=layers, num_experts=num_experts)

    def hf_shapes(self):
        half = (self.shape[0] // 2, *self.shape[1:])
        return {name: half for name in self.hf_param.values()}

    def hf_to_megatron(self, hf_weights, shard: Shard):
        import torch

        n = shard.shape[0] // 2
        return torch.cat([hf_weights[role][shard.rank * n:(shard.rank + 1) * n] for role in ("gate", "up")])

    def megatron_to_hf(self, megatron_weight):
        gate, up = megatron_weight.chunk(2, dim=0)
        return {self.hf_param["gate"]: gate.contiguous(), self.hf_param["up"]: up.contiguous()}


class QKVMapping(MegatronParamMapping):
    """megatron-core's fused ``linear_qkv`` (weight, or bias with ``hidden=None``) from separate
    ``q_proj``, ``k_proj``, ``v_proj``: per query group, that group's query heads, then its key head,
    then its value head (``[q_g0.., k_g0, v_g0, q_g1.., ...]``); a rank holds whole groups."""

    def __init__(self, megatron_param: str, q: str, k: str, v: str, heads: int, groups: int, head_dim: int,
                 hidden: Optional[int] = None, layers: Optional[Tuple[int, ...]] = None):
        self.heads, self.groups, self.head_dim = heads, groups, head_dim
        rest = () if hidden is None else (hidden,)
        super().__init__(megatron_param, {"q": q, "k": k, "v": v}, ((heads + 2 * groups) * head_dim, *rest),
                         layers=layers)

    def _part_rows(self) -> Tuple[int, int, int]:
        d = self.head_dim
        return self.heads * d, self.groups * d, self.groups * d

    def hf_shapes(self):
        rest = self.shape[1:]
        return {name: (rows, *rest) for name, rows in zip(self.hf_param.values(), self._part_rows())}

    def _sources(self, hf_weights):
        """``(source, row offset)`` of q, k and v."""
        return [(hf_weights[role], 0) for role in ("q", "k", "v")]

    def hf_to_megatron(self, hf_weights, shard: Shard):
        import torch

        d, per_group = self.head_dim, self.heads // self.groups
        local = self.groups // shard.size
        g0 = shard.rank * local
        (q, q0), (k, k0), (v, v0) = self._sources(hf_weights)
        qs = self._rows(q, q0 + g0 * per_group * d, q0 + (g0 + local) * per_group * d)
        ks = self._rows(k, k0 + g0 * d, k0 + (g0 + local) * d)
        vs = self._rows(v, v0 + g0 * d, v0 + (g0 + local) * d)
        rest = qs.shape[1:]
        fused = torch.cat([qs.reshape(local, per_group * d, *rest), ks.reshape(local, d, *rest),
                           vs.reshape(local, d, *rest)], dim=1)
        return fused.reshape(local * (per_group + 2) * d, *rest)

    def _split(self, megatron_weight):
        d, per_group = self.head_dim, self.heads // self.groups
        rest = megatron_weight.shape[1:]
        grouped = megatron_weight.reshape(self.groups, (per_group + 2) * d, *rest)
        return (grouped[:, : per_group * d].reshape(self.heads * d, *rest),
                grouped[:, per_group * d: (per_group + 1) * d].reshape(self.groups * d, *rest),
                grouped[:, (per_group + 1) * d:].reshape(self.groups * d, *rest))

    def megatron_to_hf(self, megatron_weight):
        return {self.hf_param[role]: part.contiguous() for role, part in zip("qkv", self._split(megatron_weight))}


class ConcatenatedQKVMapping(QKVMapping):
    """``linear_qkv`` from one Hugging Face tensor holding q, k and v one after the other along the
    output dimension (GPT-2's ``c_attn``, a Conv1D: ``transpose``; Bridge's ``ConcatenatedQKVMapping``)."""

    def __init__(self, megatron_param: str, hf_param: str, heads: int, groups: int, head_dim: int,
                 hidden: Optional[int] = None, transpose: bool = False, layers: Optional[Tuple[int, ...]] = None):
        super().__init__(megatron_param, hf_param, hf_param, hf_param, heads, groups, head_dim, hidden, layers)
        self.hf_param, self.transpose = hf_param, transpose

    def hf_shapes(self):
        return {self.hf_param: self._hf_shape(self.shape)}

    def _sources(self, hf_weights):
        q_rows, k_rows, _ = self._part_rows()
        return [(hf_weights, 0), (hf_weights, q_rows), (hf_weights, q_rows + k_rows)]

    def megatron_to_hf(self, megatron_weight):
        import torch

        return {self.hf_param: self._out(torch.cat(self._split(megatron_weight)))}


class ExpertMapping(_Delegating):
    """One expert's tensor, for every expert of a layer: ``inner`` (a gated ``linear_fc1`` or a
    row-parallel ``linear_fc2`` whose templates hold ``{e}``) for each of ``num_experts`` experts, one
    Hugging Face tensor (or gate/up pair) per expert <-> that expert's megatron-core tensor
    (``mlp.experts.local_experts.{e}``, the SequentialMLP of the local spec).

    ``{e}`` is the global expert number: with expert parallelism a rank holds experts
    ``ep_rank * n_local`` to ``ep_rank * n_local + n_local - 1`` as ``local_experts.0`` to ``n_local - 1``
    (:meth:`global_expert`), and each of them split over the expert-tensor-parallel group."""

    def __init__(self, inner: MegatronParamMapping):
        if "{e}" not in inner.megatron_param:
            raise ValueError(f"{inner.megatron_param}: an expert's mapping holds {{e}}")
        super().__init__(inner.megatron_param, inner.hf_param, inner.shape, inner.transpose, inner.layers,
                         inner.num_experts)
        self.inner = inner

    @staticmethod
    def global_expert(local: int, ep_rank: int, ep_size: int, num_experts: int) -> int:
        """The global number of the rank's ``local_experts.<local>`` (megatron-core's SequentialMLP:
        ``num_experts / ep_size`` consecutive experts a rank)."""
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split over {ep_size} expert-parallel ranks")
        return ep_rank * (num_experts // ep_size) + local
