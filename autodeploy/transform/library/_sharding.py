"""Tensor-parallel sharding plans: what ``detect_sharding`` finds and
``sharding_transform_executor`` applies.

A plan is a list of decisions over graph nodes, each a plain dataclass:

* ``ColumnShard``: a linear's output features are split across ranks (weight rows, bias); each
  rank computes its slice of the output (its attention heads, its part of the MLP's hidden
  layer) and no communication follows; or, for the vocab-parallel LM head, an all-gather
  joins the slices. Key/value heads fewer than the ranks are replicated: each rank holds the one
  head its query heads read.
* ``RowShard``: a linear's input features are split (weight columns); each rank's output is a
  partial sum that ``torch_dist_all_reduce`` completes (the bias, if any, is added once after).
* ``SwigluShard``: ``torch_swiglu_mlp`` with gate and up split by rows and down by columns: one
  all-reduce after the op.
* ``ExpertShard``: expert parallelism; each rank holds ``num_experts / world_size`` whole experts
  of a ``torch_moe`` (its per-expert tensors) or a ``torch_moe_fused`` (its rows of the stacked
  tensors), computes the (token, expert) pairs routed to them, and one all-reduce sums the
  ranks' partial outputs.
* ``EmbeddingShard``: the embedding table split by vocabulary rows, one all-reduce after the lookup.
* ``ExpertTensorShard``: tensor parallelism inside the experts, for a ``torch_moe`` whose experts
  the world size does not divide (fewer experts than ranks): every rank holds every expert's
  slice of the hidden features (gate/up rows, down columns), one all-reduce after.
* ``HeadSlice``: an attention's per-head input computed in the graph (ALiBi slopes, a relative
  bias), sliced to this rank's heads right before the op.
* ``NormShard``: an RMSNorm over all heads' features between a projection and its attention
  (OLMo-2's q/k norms), its weight split with the heads and its mean of squares summed over ranks.
* ``FeatureMeanShard``: a mean over features split across ranks (a Mamba2 layer's gated norm written
  out over all its features): the ranks' means averaged by an all-reduce.

Linears are ``aten.linear`` or one of the quantized linears (``torch_quant_*_linear``): a
:class:`LinearLayout` says which of the op's tensors split with the output features (a column
shard) or the input features (a row shard), and the block or group a split must not cut (a
fine-grained FP8 tile, an NVFP4 or int4 group). Per-tensor scales are whole on every rank; they
are the same numbers on every slice.

Why a plan and not a rewrite in one pass: the same objects are what a model's own sharding hints
produce (``apply_sharding_hints``, from ``torch_linear_with_hint``), so there is one executor.
Nodes are named, not held, so a plan can be logged and compared.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import fx

from ...ops.quant import linear as _quant_linear  # noqa: F401  (registers the quantized linears)
from ..graph_utils import get_attr_value

aten = torch.ops.aten
ad = torch.ops.autodeploy

# Ops between a projection and the attention op (or after it) that only change the layout of
# each token's features: heads split or merged, axes swapped.
LAYOUT_OPS = (aten.view.default, aten.reshape.default, aten.transpose.int, aten.permute.default,
              aten.flatten.using_ints, aten.contiguous.default, aten.clone.default, aten._unsafe_view.default)


# Element-wise ops (each output element reads the same element of every operand, broadcast): a
# split of their per-feature or per-head inputs is the same split of their output. One set for
# every walk of the planner (an MLP's activation, the ops between a projection and its attention,
# a state layer's gates); each walk adds its own rule for the other operands.
ELEMENTWISE = frozenset({
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default,
    aten.erf.default, aten.exp.default, aten.expm1.default, aten.softplus.default, aten.abs.default,
    aten.neg.default, aten.square.default, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default,
    aten.reciprocal.default, aten.log.default, aten.log1p.default, aten.mul.Tensor, aten.mul.Scalar,
    aten.add.Tensor, aten.add.Scalar,
    aten.sub.Tensor, aten.sub.Scalar, aten.div.Tensor, aten.div.Scalar, aten.clamp.default,
    aten.clamp_min.default, aten.minimum.default, aten.maximum.default, aten.min.other, aten.max.other,
    aten.where.self, aten.gt.Scalar, aten.ge.Scalar, aten.lt.Scalar, aten.le.Scalar, aten._to_copy.default,
    aten.to.dtype, aten.clone.default, aten.dropout.default,
})

# gm.meta key set by apply_sharding_hints on a graph whose own hints planned its sharding: the
# hints are the whole truth for that graph (what they leave whole stays whole), so detect_sharding
# leaves it alone.
SHARDING_HINTS_META = "autodeploy_sharding_hints"

# RoPE ops rotate q (output 0, from input 0) and k (output 1, from input 1) head by head
ROPE_OPS = (ad.torch_rope_with_explicit_cos_sin.default, ad.torch_rope_with_qk_interleaving.default,
            ad.torch_rope_with_complex_freqs.default)


@dataclass(frozen=True)
class WeightShard:
    """The slice of a checkpoint tensor one rank loads: part ``index`` of ``parts`` equal parts
    along ``dim``; or, with ``blocks`` (a fused projection's ``[q | k | v]`` rows), the tensor cut
    into blocks of the given sizes along ``dim``, and part ``index`` of ``parts`` of each block, per
    block, concatenated."""

    dim: int
    index: int
    parts: int
    blocks: Tuple[Tuple[int, int, int], ...] = ()  # (size, parts, index) of each block, in order

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.shape[self.dim]
        if self.blocks:
            if sum(b[0] for b in self.blocks) != size or any(b[0] % b[1] for b in self.blocks):
                raise ValueError(f"a tensor of shape {tuple(tensor.shape)} cannot be cut into blocks "
                                 f"{[b[0] for b in self.blocks]} split {[b[1] for b in self.blocks]} ways along dim "
                                 f"{self.dim}")
            starts = [sum(b[0] for b in self.blocks[:i]) for i in range(len(self.blocks))]
            return torch.cat([tensor.narrow(self.dim, start + i * (n // parts), n // parts)
                              for start, (n, parts, i) in zip(starts, self.blocks)], dim=self.dim)
        if size % self.parts:
            raise ValueError(f"a tensor of shape {tuple(tensor.shape)} cannot be split into {self.parts} equal parts "
                             f"along dim {self.dim}")
        step = size // self.parts
        return tensor.narrow(self.dim, self.index * step, step)


@dataclass(frozen=True)
class LinearLayout:
    """Where a linear op keeps its tensors (argument indices) and how they split."""

    column: Tuple[Tuple[int, int], ...]  # (argument, dim) split with the output features, the weight first
    row: Tuple[Tuple[int, int], ...]  # (argument, dim) split with the input features, the weight first
    whole: Tuple[int, ...] = ()  # per-tensor scales: one element, the same on every rank
    # the (output, input) feature granularity a split must keep whole (block or group size)
    granularity: Callable[[fx.Node], Tuple[int, int]] = lambda node: (1, 1)


_QUANT = {
    "fp8": LinearLayout(column=((1, 0),), row=((1, 1),), whole=(3, 4)),
    "finegrained_fp8": LinearLayout(column=((1, 0), (3, 0)), row=((1, 1), (3, 1)),
                                    granularity=lambda n: (int(_arg(n, 4, 128)), int(_arg(n, 5, 128)))),
    "nvfp4": LinearLayout(column=((1, 0), (4, 0)), row=((1, 1), (4, 1)), whole=(3, 5), granularity=lambda n: (1, 16)),
    "int4": LinearLayout(column=((1, 0), (3, 0), (4, 0)), row=((1, 1), (3, 1), (4, 1)),
                         granularity=lambda n: (1, int(_arg(n, 5, 1)))),
    "int8": LinearLayout(column=((1, 0), (3, 0)), row=((1, 1),)),
}
_FLOAT = LinearLayout(column=((1, 0),), row=((1, 1),))
LINEAR_LAYOUTS: Dict[object, LinearLayout] = {
    aten.linear.default: _FLOAT,
    **{getattr(ad, f"torch_quant_{name}_linear").default: layout for name, layout in _QUANT.items()},
}


def _arg(node: fx.Node, index: int, default: object) -> object:
    return node.args[index] if len(node.args) > index else default


def is_linear(node: object) -> bool:
    """An ``aten.linear`` or a quantized linear the sharding can split."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in LINEAR_LAYOUTS


@dataclass(frozen=True)
class ColumnShard:
    node: str  # the aten.linear node
    weight: str  # get_attr target
    bias: Optional[str] = None
    # the output features in ``parts`` equal slices, this rank taking slice ``index``: by default
    # world_size and rank; key/value heads fewer than the ranks are split into their head count,
    # each slice (one head) held by world_size / heads ranks
    parts: Optional[int] = None
    index: Optional[int] = None
    # all_gather the ranks' slices after the linear (the vocab-parallel LM head: every rank then
    # holds all the logits)
    gather: bool = False
    # a quantized linear's other tensors split with the weight's rows: (get_attr target, dim)
    extra: Tuple[Tuple[str, int], ...] = ()
    # a fused projection (Phi-3's ``qkv_proj``): its output features in blocks (q, k, v), each
    # split on its own, ``(size, parts, index)`` in order; ``parts``/``index`` above are then unused
    blocks: Tuple[Tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class RowShard:
    node: str
    weight: str
    bias: Optional[str] = None
    # a quantized linear's other tensors split with the weight's columns: (get_attr target, dim)
    extra: Tuple[Tuple[str, int], ...] = ()


@dataclass(frozen=True)
class SwigluShard:
    node: str  # the torch_swiglu_mlp node
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class ExpertShard:
    """Expert parallelism for one ``torch_moe`` or ``torch_moe_fused``: this rank keeps experts
    ``[start, end)`` (their weights only are loaded), the routing sends every other (token,
    expert) pair nowhere on this rank (index -1, weight 0), and an all-reduce sums the ranks'
    partial outputs. Per-expert tensors of the other ranks are dropped; stacked ones keep rows
    ``[start, end)``."""

    node: str  # the MoE node
    start: int
    end: int
    dropped: Tuple[str, ...]  # get_attr targets of the other ranks' experts
    stacked: Tuple[str, ...] = ()  # get_attr targets of stacked [E, ...] tensors, split along dim 0


@dataclass(frozen=True)
class ExpertTensorShard:
    """Tensor parallelism inside every expert of one ``torch_moe``: each rank keeps its slice of
    each expert's hidden features (gate/up weight rows and biases, down weight columns); the down
    biases stay on rank 0 only, so the all-reduce after the op adds them once."""

    node: str  # the torch_moe node
    gate: Tuple[str, ...]  # get_attr targets, one per expert (empty for an ungated activation)
    up: Tuple[str, ...]
    down: Tuple[str, ...]
    gate_bias: Tuple[str, ...] = ()
    up_bias: Tuple[str, ...] = ()
    down_bias: Tuple[str, ...] = ()


@dataclass(frozen=True)
class HeadWeightShard:
    """A stored tensor an op reads itself (not through a linear), split with the op's heads or
    channels: ``torch_mla``'s ``kv_b_proj`` weight, ``[heads * (d_nope + d_v), L]``, rows head by
    head; a state layer's per-head ``A_log``, ``D``, ``dt_bias``; Mamba's ``dt_proj`` weight (a
    matmul's rows). With ``blocks``, cut as ``WeightShard.blocks`` (Falcon-H1's ``mup_vector`` over
    the fused ``[z | x | B | C | dt]`` features)."""

    node: str  # the op reading it
    weight: str  # get_attr target
    dim: int = 0
    blocks: Tuple[Tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class HeadSlice:
    """A per-head tensor an attention op reads that is computed in the graph (ALiBi slopes ``[n]``,
    Inkling's relative logits ``[b, s, n, R]``): the op reads this rank's heads of it, sliced along
    ``dim`` right before the op (computed whole on every rank, so it costs its computation, not
    correctness)."""

    node: str  # the attention op
    index: int  # its argument position
    name: str  # its keyword name
    dim: int


@dataclass(frozen=True)
class EmbeddingShard:
    """A vocab-parallel embedding: this rank holds rows ``[start, end)`` of the table, looks up the
    ids in that range (the others read row 0 and are zeroed), and an all-reduce sums the ranks'
    rows, so every rank gets every token's embedding. An LM head tied to the table shares the slice
    (its own ``ColumnShard`` with ``gather``)."""

    node: str  # the aten.embedding node
    weight: str
    start: int
    end: int


@dataclass(frozen=True)
class NormShard:
    """An RMSNorm over all heads' features of a projection split by heads (OLMo-2's q/k norms): its
    weight splits with the projection's output features (``parts``/``index`` as its ``ColumnShard``'s),
    and the op becomes ``torch_dist_rmsnorm``, whose mean of squares is a sum over the ranks."""

    node: str  # the torch_rmsnorm node
    weight: str
    parts: Optional[int] = None
    index: Optional[int] = None
    # the attention whose query/key this norm is on: the two norms of one attention share an
    # all-reduce (``torch_dist_rmsnorm_pair``)
    group: Optional[str] = None


@dataclass(frozen=True)
class FeatureMeanShard:
    """A mean over the last dim of a value whose features are split across ranks in equal slices (a
    norm written out over all of a Mamba2 layer's features, its gated RMSNorm with one group): each
    rank's mean over its slice, all-reduced and divided by the world size, is the whole mean."""

    node: str  # the aten.mean.dim node


Decision = Union[ColumnShard, RowShard, SwigluShard, ExpertShard, ExpertTensorShard, HeadWeightShard,
                 EmbeddingShard, NormShard, HeadSlice, FeatureMeanShard]


@dataclass
class ShardingPlan:
    world_size: int
    rank: int
    decisions: List[Decision] = field(default_factory=list)
    # view/reshape nodes whose literal sizes count heads or features of a sharded projection
    # (node name -> {index of the size in its shape argument: what it is divided by})
    layout_fixes: Dict[str, Dict[int, int]] = field(default_factory=dict)
    # attention ops (torch_attention, torch_mla) and state-layer ops (Gated DeltaNet, Mamba, Mamba2)
    # left whole on every rank (each rank runs all their heads): node name -> why
    whole_layers: Dict[str, str] = field(default_factory=dict)
    # arguments to replace on nodes that cut a fused projection's output into its blocks (slice
    # bounds, split sizes: each rank's blocks are smaller): node name -> {argument index: value}
    arg_fixes: Dict[str, Dict[int, object]] = field(default_factory=dict)

    def summary(self) -> str:
        kinds: Dict[str, int] = {}
        for d in self.decisions:
            kinds[type(d).__name__] = kinds.get(type(d).__name__, 0) + 1
        return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "nothing"


def stored_target(gm: fx.GraphModule, node: object) -> Optional[str]:
    """The get_attr target of a stored tensor argument (any shape: a quantized expert's scalar
    input scale too), or None (a computed value)."""
    if isinstance(node, fx.Node) and node.op == "get_attr" and isinstance(get_attr_value(gm, node), torch.Tensor):
        return str(node.target)
    return None


def weight_target(gm: fx.GraphModule, node: object) -> Optional[str]:
    """The get_attr target of a float weight argument, or None (a computed weight)."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = get_attr_value(gm, node)
        if isinstance(value, torch.Tensor) and value.dim() in (1, 2):
            return str(node.target)
    return None


def linear_weights(gm: fx.GraphModule, linear: fx.Node) -> Optional[Tuple[str, Optional[str]]]:
    """``(weight, bias)`` get_attr targets of a linear (bias None when it has none), or None when
    the weight or bias is computed rather than stored (nothing to split at load time)."""
    weight = weight_target(gm, linear.args[1])
    bias_arg = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    bias = weight_target(gm, bias_arg) if bias_arg is not None else None
    if weight is None or (bias_arg is not None and bias is None):
        return None
    return weight, bias


LinearSplit = Tuple[str, Optional[str], Tuple[Tuple[str, int], ...]]


def linear_split(gm: fx.GraphModule, linear: fx.Node, rows: bool, parts: int) -> Optional[LinearSplit]:
    """``(weight, bias, extra)`` for splitting ``linear`` into ``parts`` along its output features
    (``rows`` False: a column shard) or its input features (``rows`` True: a row shard), with
    ``extra`` the quantized format's other tensors that split with it. None when the linear cannot
    be split that way: a computed weight, a feature count ``parts`` does not divide into whole
    blocks or groups of its format, or a scale that is not one number per tensor."""
    layout = LINEAR_LAYOUTS.get(linear.target)
    weights = linear_weights(gm, linear) if layout is not None else None
    if layout is None or weights is None:
        return None
    weight_value = get_attr_value(gm, linear.args[1])
    n = int(weight_value.shape[0])
    x_val = linear.args[0].meta.get("val") if isinstance(linear.args[0], fx.Node) else None
    k = int(x_val.shape[-1]) if x_val is not None else (int(weight_value.shape[1]) if layout is _FLOAT else -1)
    block_n, block_k = layout.granularity(linear)
    features, block = (k, block_k) if rows else (n, block_n)
    if features <= 0 or features % parts or (features // parts) % block:
        return None
    extra = []
    for index, dim in (layout.row if rows else layout.column)[1:]:
        target = _tensor_target(gm, linear, index)
        value = get_attr_value(gm, linear.args[index]) if target is not None else None
        if value is None or value.shape[dim] % parts:
            return None
        extra.append((target, dim))
    for index in layout.whole:
        value = get_attr_value(gm, linear.args[index]) if _tensor_target(gm, linear, index) else None
        if value is None or value.numel() != 1:
            return None  # a per-row scale (after a GEMM fusion): not split here
    return weights[0], weights[1], tuple(extra)


def _tensor_target(gm: fx.GraphModule, node: fx.Node, index: int) -> Optional[str]:
    value = node.args[index] if len(node.args) > index else None
    if isinstance(value, fx.Node) and value.op == "get_attr" and isinstance(get_attr_value(gm, value), torch.Tensor):
        return str(value.target)
    return None


def sizes_that_divide(counts: Sequence[int], upto: int = 64) -> List[int]:
    """World sizes that split every count evenly (for an error message)."""
    return [n for n in range(1, upto + 1) if all(c % n == 0 for c in counts)]


def literal_dims(node: fx.Node, full: Tuple[int, ...]) -> List[int]:
    """Indices of the view/reshape shape argument whose literal value is one of ``full`` (a head
    count or a feature count of a sharded projection), which must be divided on each rank. ``-1``
    and symbolic sizes follow the tensor by themselves."""
    shape = node.args[1] if len(node.args) > 1 else None
    if node.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return []
    if not isinstance(shape, (list, tuple)):
        return []
    found = [i for i, s in enumerate(shape) if isinstance(s, int) and s in full]
    if len(shape) < 4:  # [b, s, heads * d]: the merged features
        return found
    # a view into heads ([b, s, heads, d], [b, s, heads, d / 2, 2]): its heads dim comes first; the
    # entries after it are per-head sizes that may equal the head count by chance (never the last)
    return [i for i in found if i != len(shape) - 1][:1]
