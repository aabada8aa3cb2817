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

Linears are ``aten.linear`` or one of the quantized linears (``torch_quant_*_linear``): a
:class:`LinearLayout` says which of the op's tensors split with the output features (a column
shard) or the input features (a row shard), and the block or group a split must not cut (a
fine-grained FP8 tile, an NVFP4 or int4 group). Per-tensor scales are whole on every rank; they
are the same numbers on every slice.

Why a plan and not a rewrite in one pass: the same objects are what a model's own sharding hints
produce (``apply_sharding_hints``, from ``torch_linear_with_hint``), so there is one executor.
Nodes are named, not held, so a plan can be logged and compared.
"""

import operator
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import fx

from ...ops.quant import linear as _quant_linear  # noqa: F401  (registers the quantized linears)
from ..graph_utils import get_attr_value

aten = torch.ops.aten
ad = torch.ops.autodeploy

# Ops between a projection and the attention op (or after it) that only change the layout of
# each token's features: heads split or merged, axes swapped.
LAYOUT_OPS = (aten.view.default, aten.reshape.default, aten.transpose.int, aten.contiguous.default,
              aten.clone.default, aten._unsafe_view.default)


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
    along ``dim``."""

    dim: int
    index: int
    parts: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.shape[self.dim]
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
    """A stored weight an attention op reads itself, split by heads with the op's query heads:
    ``torch_mla``'s ``kv_b_proj`` weight, ``[heads * (d_nope + d_v), L]``, rows head by head."""

    node: str  # the op reading it
    weight: str  # get_attr target
    dim: int = 0


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


Decision = Union[ColumnShard, RowShard, SwigluShard, ExpertShard, ExpertTensorShard, HeadWeightShard,
                 EmbeddingShard]


@dataclass
class ShardingPlan:
    world_size: int
    rank: int
    decisions: List[Decision] = field(default_factory=list)
    # view/reshape nodes whose literal sizes count heads or features of a sharded projection
    # (node name -> {index of the size in its shape argument: what it is divided by})
    layout_fixes: Dict[str, Dict[int, int]] = field(default_factory=dict)
    # attention ops (torch_attention, torch_mla) left whole on every rank: each rank runs all their heads
    whole_attention: List[str] = field(default_factory=list)

    def summary(self) -> str:
        kinds: Dict[str, int] = {}
        for d in self.decisions:
            kinds[type(d).__name__] = kinds.get(type(d).__name__, 0) + 1
        return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "nothing"


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


def producing_linear(node: fx.Node, path: List[fx.Node]) -> Optional[fx.Node]:
    """The linear (``aten.linear`` or quantized) an attention input comes from, through layout ops, per-head norms and
    RoPE (whose q output comes from its first input and k output from its second); ``path`` collects the
    layout nodes passed. None when the chain is anything else, or when a node on it has another
    reader (that reader would get this rank's slice instead of the whole tensor)."""
    while isinstance(node, fx.Node):
        if len(node.users) != 1 and (is_linear(node) or node.target in LAYOUT_OPS):
            return None  # another reader would see this rank's slice only: leave the projection whole
        if is_linear(node):
            return node
        if node.target in LAYOUT_OPS:
            path.append(node)
            node = node.args[0]
            continue
        if node.target == ad.torch_rmsnorm.default and _per_head(node):  # Qwen3's q/k norms
            node = node.args[0]
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            rope = node.args[0]
            if rope.op == "call_function" and rope.target in ROPE_OPS and node.args[1] in (0, 1):
                node = rope.args[node.args[1]]
                continue
        return None
    return None


# Ops that cut the last (per-head feature) dim into parts, read through getitem: their dim argument's index
_SPLITS = {aten.split_with_sizes.default: 2, aten.split.Tensor: 2, aten.chunk.default: 2}


def head_source(starts: Sequence[fx.Node], sink: Union[fx.Node, Collection[fx.Node]]
                ) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """The one linear that the per-head inputs ``starts`` of ``sink`` (one node, or several: an
    attention and the activation of an output gate computed from the same projection) are computed
    from, through ops that keep each head's values to that head (layout ops; slices, splits, chunks
    and concatenations of the last, per-head feature dim; RoPE; per-head norms), and the layout
    nodes on the way. MLA's query takes this shape: ``q_b_proj`` -> heads -> split into a nope and a
    rope part -> RoPE on one -> concatenated -> sliced again into ``q_nope`` and ``q_pe``; Qwen3-Next's
    query and output gate are the two halves of each head of ``q_proj``. None when anything else is
    on the way, when the inputs come from several linears, or when a value on the way has a reader
    outside it (which would see this rank's heads only)."""
    sinks = {sink} if isinstance(sink, fx.Node) else set(sink)
    visited: set = set()
    passthrough: set = set()  # multi-output ops entered through one output (RoPE: q or k)
    linears: List[fx.Node] = []
    stack = list(starts)
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node):
            return None
        if node in visited:
            continue
        visited.add(node)
        if is_linear(node):
            linears.append(node)
            continue
        target = node.target
        if target in LAYOUT_OPS:
            stack.append(node.args[0])
        elif target == ad.torch_rmsnorm.default and _per_head(node):
            stack.append(node.args[0])
        elif target == aten.slice.Tensor and _head_features(node.args[0], node.args[1]):
            stack.append(node.args[0])
        elif target == aten.cat.default and _head_features(node.args[0][0], node.args[1] if len(node.args) > 1 else 0):
            stack.extend(node.args[0])
        elif target is operator.getitem and isinstance(node.args[0], fx.Node):
            source, index = node.args
            if source.target in ROPE_OPS and index in (0, 1):
                passthrough.add(source)
                stack.append(source.args[index])
            elif source.target in _SPLITS and _head_features(source.args[0], _arg(source, _SPLITS[source.target], 0)):
                visited.add(source)
                stack.append(source.args[0])
            else:
                return None
        else:
            return None
    if len(set(linears)) != 1:
        return None
    if any(u not in visited and u not in sinks and u not in passthrough for n in visited for u in n.users):
        return None
    return linears[0], [n for n in visited if n.target in LAYOUT_OPS]


def _last_dim(value: object, dim: object) -> bool:
    """``dim`` names the last dim of ``value``'s tensor (the per-head features)."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(dim, int) and val is not None and dim in (-1, val.dim() - 1)


def _head_features(value: object, dim: object) -> bool:
    """``dim`` is the per-head feature dim of a ``[b, s, heads, d]`` (or ``[b, heads, s, d]``) value: a
    cut there keeps each head's values to its head. On ``[b, s, heads * d]`` it would not: a fused
    ``[q | gate]`` projection chunked before its view into heads has all of q in its first half of
    features, which a split by ranks would hand to the first ranks alone."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return _last_dim(value, dim) and val is not None and val.dim() == 4


def _per_head(norm: fx.Node) -> bool:
    """A norm over each head's features alone (input ``[b, s, heads, head_dim]``): it commutes with a
    split by heads. A norm over all heads' features (OLMo-2's q/k norms) does not."""
    val = norm.args[0].meta.get("val") if isinstance(norm.args[0], fx.Node) else None
    return val is not None and val.dim() == 4 and len(norm.users) == 1


# Gate activations of a per-head attention output gate (HY-V4: ``o * sigmoid(gate_proj(x))``)
GATE_ACTIVATIONS = (aten.sigmoid.default,)


def _static_dims(node: fx.Node, first: int) -> Optional[Tuple[int, ...]]:
    """The dims of ``node``'s value from ``first`` on, when all of them are plain ints."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() <= first:
        return None
    dims = tuple(value.shape[first:])
    return dims if all(type(d) is int for d in dims) else None


@dataclass
class OutputGate:
    """A per-head output gate on the way from an attention op to its output projection: its
    activation, the activation's input, and the gate's own linear (split by output features with
    the heads) with the layout nodes between them; ``linear`` None when the gate is not a linear's
    output through layout ops alone (Qwen3-Next's: a half of each head of the query projection,
    which ``head_source`` follows together with the query)."""

    activation: fx.Node
    start: fx.Node
    linear: Optional[fx.Node]
    chain: List[fx.Node]


def output_gate(node: fx.Node, mul: fx.Node) -> Optional[OutputGate]:
    """The gate when ``mul`` multiplies ``node`` (an attention output, ``[b, s, heads, d]`` or
    ``[b, s, heads * d]``) by ``sigmoid(...)`` of the same shape: each head's output by its own head's
    gate values. None for anything else (a gate broadcast over the heads is not split with them)."""
    if mul.target != aten.mul.Tensor or len(mul.args) != 2 or mul.kwargs:
        return None
    other = mul.args[1] if mul.args[0] is node else mul.args[0] if mul.args[1] is node else None
    if not isinstance(other, fx.Node) or other is node or other.target not in GATE_ACTIVATIONS:
        return None
    heads = _static_dims(node, 2)
    if len(other.users) != 1 or heads is None or _static_dims(other, 2) != heads or _static_dims(mul, 2) != heads:
        return None
    chain: List[fx.Node] = []
    linear = producing_linear(other.args[0], chain)
    return OutputGate(other, other.args[0], linear, chain if linear is not None else [])


def consuming_linear(node: fx.Node, path: List[fx.Node], gates: Optional[List[OutputGate]] = None) -> Optional[fx.Node]:
    """The linear the attention output feeds, through single-user layout ops (and, when ``gates``
    collects them, per-head output gates: ``output_gate``)."""
    while len(node.users) == 1:
        (user,) = node.users
        if is_linear(user) and user.args[0] is node:
            return user
        gate = output_gate(node, user) if gates is not None else None
        if gate is not None:
            gates.append(gate)  # type: ignore[union-attr]
            node = user
            continue
        if user.target not in LAYOUT_OPS:
            return None
        path.append(user)
        node = user
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
    # the last entry of a head split is the head size, never sharded
    last = len(shape) - 1
    return [i for i, s in enumerate(shape) if isinstance(s, int) and s in full and not (i == last and len(shape) == 4)]
