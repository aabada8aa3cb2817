"""Tensor-parallel plans for attention (``torch_attention``, ``torch_mla``; a linear attention,
``torch_linear_attention``, as attention with a per-head decay), for ``detect_sharding``.

Each attention splits by heads: its query, key and value projections by output features (each rank
its heads; key/value heads fewer than the ranks replicated, one head a rank), the output
projection by input features (an all-reduce after). Which projections those are, and that every
op between them and the attention keeps each head's values to its head, is ``_sharding_heads``'s
walk; this module turns what it finds into decisions (``ColumnShard``, ``RowShard``, ``NormShard``,
``HeadWeightShard``) and the view sizes to divide, or records why a layer stays whole.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import fx

from ...utils.errors import ConfigError
from ..graph_utils import arg
from ._sharding import (ColumnShard, HeadSlice, HeadWeightShard, LinearSplit, NormShard, RowShard, ShardingPlan,
                        is_linear, linear_split, linear_weights, literal_dims, sizes_that_divide, weight_target)
from ._sharding_heads import Cut, OutputGate, consuming_linear, cuts_cover, head_source

aten = torch.ops.aten
ad = torch.ops.autodeploy


def _head_count(node: fx.Node, index: int) -> Optional[int]:
    val = node.args[index].meta.get("val") if isinstance(node.args[index], fx.Node) else None
    return int(val.shape[2]) if val is not None and val.dim() == 4 else None  # bsnd


def _kv_split(heads: int, kv_heads: int, world_size: int, rank: int, name: str) -> Tuple[int, int]:
    """``(parts, index)`` of this rank's key/value heads: its share of them when the world size
    divides them, else the one head its query heads read (replicated on world_size / kv_heads
    ranks); an error listing the world sizes that work otherwise."""
    if heads % world_size == 0 and kv_heads % world_size == 0:
        return world_size, rank
    if heads % world_size == 0 and world_size % kv_heads == 0:
        return kv_heads, rank // (world_size // kv_heads)
    works = [n for n in range(1, 65) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
    raise ConfigError(
        f"attention {name} has {heads} query and {kv_heads} key/value heads, which world_size {world_size} does not "
        f"split (query heads evenly, key/value heads evenly or replicated); world sizes that split them: {works}")


def plan_attention(gm: fx.GraphModule, attn: fx.Node, plan: ShardingPlan) -> bool:
    """Add the decisions for one ``torch_attention`` (or ``torch_linear_attention``: MiniMax's, its
    per-head decay sliced like ALiBi slopes) node; False (nothing added, the reason in
    ``plan.whole_layers``) when its projections are not linears over stored weights (plain or
    quantized, each splittable into whole blocks of its format), or when the ops between them and the
    attention are not ones that keep each head's values to its head (``_sharding_heads``). Per-head
    sinks (GPT-OSS) split with the heads (a stored weight by its rows; computed ones, ALiBi slopes
    and Inkling's relative bias are sliced before the op: ``HeadSlice``); so do norms over all
    heads' features (OLMo-2's q/k norms: ``NormShard``) and a per-head output gate between the op
    and the output projection
    (``output_gate``), also when it is a part of each head of the query projection (Qwen3-Next: one
    column split serves both)."""
    reason = _attention_whole(gm, attn, plan)
    if reason is not None:
        plan.whole_layers[attn.name] = reason
    return reason is None


def _attention_whole(gm: fx.GraphModule, attn: fx.Node, plan: ShardingPlan) -> Optional[str]:
    """``plan_attention``'s work: None when planned, else why the layer stays whole."""
    heads, kv_heads = _head_count(attn, 0), _head_count(attn, 1)
    if heads is None or kv_heads is None:
        return "head counts not static"
    sinks = arg(attn, 7, "sinks") if attn.target == ad.torch_attention.default else None  # GPT-OSS: per query head
    sinks_target = None if sinks is None else weight_target(gm, sinks)
    if sinks_target is not None and len(sinks.users) != 1:
        sinks_target = None  # read elsewhere too: sliced before the op instead
    slices = [HeadSlice(attn.name, i, name, dim) for i, name, dim in _PER_HEAD_INPUTS[attn.target]
              if arg(attn, i, name) is not None and not (name == "sinks" and sinks_target is not None)]
    if any(_dim_size(arg(attn, s.index, s.name), s.dim) != heads for s in slices):
        return "a per-head input (sinks, ALiBi slopes, a relative bias, a decay) whose head dim is not the query heads"
    out_chain: List[fx.Node] = []
    gates: List[OutputGate] = []
    out_norms: List[fx.Node] = []
    out_linear = consuming_linear(attn, out_chain, gates, out_norms)
    shared = [g for g in gates if g.linear is None]  # parts of the query projection's heads
    gates = [g for g in gates if g.linear is not None]
    projections = _projections(gm, attn, shared, heads, kv_heads)
    if isinstance(projections, str):
        return projections
    if out_linear is None or linear_weights(gm, out_linear) is None:
        return "the output does not reach one output projection through layout ops and per-head gates"
    parts, index = _kv_split(heads, kv_heads, plan.world_size, plan.rank, attn.name)
    splits = [linear_split(gm, p.linear, rows=False, parts=parts if p.kv else plan.world_size) for p in projections]
    out_split = linear_split(gm, out_linear, rows=True, parts=plan.world_size)
    gate_splits = _gate_splits(gm, gates, plan)
    if out_split is None or any(s is None for s in splits) or gate_splits is None:
        return f"a quantized projection does not split into whole blocks of its format at world_size {plan.world_size}"
    fused = [p for p in projections if p.cut is not None]
    if fused and (splits[0][2] or not _plan_fused(plan, fused, splits[0][0], splits[0][1], parts, index)):
        return "a fused q/k/v projection whose blocks this world size does not cut evenly"
    _add_projections(plan, attn.name, projections, splits, (heads, kv_heads), (parts, index))  # type: ignore[arg-type]
    weight, bias, extra = out_split
    plan.decisions.append(RowShard(out_linear.name, weight, bias, extra=extra))
    plan.decisions.extend(NormShard(n.name, str(n.args[1].target)) for n in out_norms)
    fix_layouts(plan, out_chain, (heads, int(out_linear.args[0].meta["val"].shape[-1])
                                   if "val" in out_linear.args[0].meta else -1), plan.world_size)
    _add_gates(plan, gates, gate_splits, heads)
    if sinks_target is not None:
        plan.decisions.append(HeadWeightShard(attn.name, sinks_target))
    plan.decisions.extend(slices)
    return None


def _add_projections(plan: ShardingPlan, attn: str, projections: List["_Projection"], splits: List[LinearSplit],
                     counts: Tuple[int, int], kv_shard: Tuple[int, int]) -> None:
    """The column splits of an attention's projections (a fused one's were added by ``_plan_fused``),
    their norms over all heads, and the head counts in their views."""
    (heads, kv_heads), (parts, index) = counts, kv_shard
    for p, (weight, bias, extra) in zip(projections, splits):
        shard = (parts, index) if p.kv and parts != plan.world_size else (None, None)
        if p.cut is None:
            plan.decisions.append(ColumnShard(p.linear.name, weight, bias, *shard, extra=extra))
        plan.decisions.extend(NormShard(n.name, str(n.args[1].target), *shard, group=attn) for n in p.norms)
        features = p.cut.end - p.cut.start if p.cut is not None else (
            int(p.linear.meta["val"].shape[-1]) if "val" in p.linear.meta else -1)
        fix_layouts(plan, p.chain, (kv_heads if p.kv else heads, features), parts if p.kv else plan.world_size)


# per-head inputs beside q/k/v, by op: (argument position, keyword, head dim); a linear attention's
# per-head decay ``g [b, s, heads]`` (MiniMax's, from its slopes) is sliced like ALiBi slopes
_PER_HEAD_INPUTS = {ad.torch_attention.default: ((7, "sinks", 0), (10, "alibi_slopes", 0), (13, "rel_logits", 2)),
                    ad.torch_linear_attention.default: ((3, "g", 2),)}


def _dim_size(node: object, dim: int) -> Optional[int]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(value.shape[dim]) if isinstance(value, torch.Tensor) and value.dim() > dim else None


@dataclass
class _Projection:
    """A linear whose output features are split by heads for one attention: its layout nodes, the
    norms over all heads on the way, and whether its heads are the key/value heads."""

    linear: fx.Node
    chain: List[fx.Node]
    norms: List[fx.Node]
    kv: bool
    cut: Optional[Cut] = None  # its block of a fused projection's features (``_fused_projections``)


def _projections(gm: fx.GraphModule, attn: fx.Node, shared: List[OutputGate], heads: int,
                 kv_heads: int) -> Union[List[_Projection], str]:
    """The query, key and value projections of ``attn`` (and the query heads' shared output gate),
    or one projection computing all three head by head (GPT-NeoX's ``[heads, 3 * d]`` and
    Persimmon's ``[heads, 3, d]`` layouts: a split by heads gives each rank its heads' q, k and v
    alike); else why not."""
    norms: List[List[fx.Node]] = [[], [], []]
    found = [head_source([attn.args[0], *(g.start for g in shared)], {attn, *(g.activation for g in shared)}, heads,
                         norms[0]),
             head_source([attn.args[1]], attn, kv_heads, norms[1]), head_source([attn.args[2]], attn, kv_heads)]
    if all(f is not None and linear_weights(gm, f[0]) is not None for f in found):
        return [_Projection(f[0], f[1], n, i > 0) for i, (f, n) in enumerate(zip(found, norms))]  # type: ignore[index]
    joint: List[fx.Node] = []
    one = head_source([*attn.args[:3], *(g.start for g in shared)], {attn, *(g.activation for g in shared)}, heads,
                      joint) if heads == kv_heads else None
    if one is not None and linear_weights(gm, one[0]) is not None:
        return [_Projection(one[0], one[1], joint, False)]
    fused = _fused_projections(gm, attn, shared, heads, kv_heads)
    if fused is not None:
        return fused  # its blocks, or why they do not split
    name = next(n for f, n in zip(found, ("query", "key", "value")) if f is None or linear_weights(gm, f[0]) is None)
    return f"the {name} is not one projection's heads through ops that keep each head's values to its head"


def _fused_projections(gm: fx.GraphModule, attn: fx.Node, shared: List[OutputGate], heads: int,
                       kv_heads: int) -> Union[List[_Projection], str, None]:
    """q, k and v as three blocks of one projection's features (Phi-3's ``qkv_proj`` sliced into
    ``[q | k | v]``, DBRX's ``Wqkv`` split): each walk ends at its block's cut, all three at the same
    float linear, whose output nothing else reads, and the blocks cover its features exactly. None
    when the layout is not that; why not when it is but cannot split (a quantized projection)."""
    cuts: List[List[Cut]] = [[], [], []]
    norms: List[List[fx.Node]] = [[], [], []]
    found = [head_source([attn.args[0], *(g.start for g in shared)], {attn, *(g.activation for g in shared)}, heads,
                         norms[0], cuts[0]),
             head_source([attn.args[1]], attn, kv_heads, norms[1], cuts[1]),
             head_source([attn.args[2]], attn, kv_heads, None, cuts[2])]
    if any(f is None for f in found) or any(len(c) != 1 for c in cuts):
        return None
    linear = cuts[0][0].linear
    if is_linear(linear) and linear.target != aten.linear.default:
        return "a quantized fused q/k/v projection (its blocks with their scales are not split yet)"
    if not cuts_cover([c[0] for c in cuts]) or linear_weights(gm, linear) is None:
        return None
    return [_Projection(linear, f[1], n, i > 0, c[0])  # type: ignore[index]
            for i, (f, n, c) in enumerate(zip(found, norms, cuts))]


def _plan_fused(plan: ShardingPlan, projections: List[_Projection], weight: str, bias: Optional[str],
                parts: int, index: int) -> bool:
    """One ``ColumnShard`` with blocks for a fused q/k/v projection: q's block split over all ranks,
    k's and v's like the key/value heads (``plan_fused_blocks``)."""
    return plan_fused_blocks(plan, [(p.cut, parts, index) if p.kv else (p.cut, plan.world_size, plan.rank)
                                    for p in projections], weight, bias)  # type: ignore[misc]


def plan_fused_blocks(plan: ShardingPlan, cuts: List[Tuple[Cut, int, int]], weight: str, bias: Optional[str]) -> bool:
    """One ``ColumnShard`` with blocks for a projection whose output is cut into blocks (each cut with
    the ``parts`` and ``index`` of its split), and the cuts' new bounds (each rank's blocks are
    smaller); False (nothing added) when an equal split or chunk would not cut this rank's blocks."""
    ordered = sorted(cuts, key=lambda c: c[0].start)
    blocks = tuple((cut.end - cut.start, parts, index) for cut, parts, index in ordered)
    local = [n // k for n, k, _ in blocks]
    split = ordered[0][0].split
    fixes: Dict[str, Dict[int, object]] = {}
    if split is None:
        for (cut, _, _), start, size in zip(ordered, (sum(local[:i]) for i in range(len(local))), local):
            fixes[cut.node.name] = {2: start, 3: start + size}
    elif split.target == aten.split_with_sizes.default:
        fixes[split.name] = {1: local}
    elif len(set(local)) != 1:
        return False  # an equal split or chunk of blocks this rank holds in unequal sizes
    elif split.target == aten.split.Tensor:
        fixes[split.name] = {1: local[0]}
    plan.arg_fixes.update(fixes)
    plan.decisions.append(ColumnShard(ordered[0][0].linear.name, weight, bias, blocks=blocks))
    return True


def _gate_splits(gm: fx.GraphModule, gates: List[OutputGate], plan: ShardingPlan) -> Optional[List[LinearSplit]]:
    """Each output gate's column split, or None when one does not split."""
    splits = [linear_split(gm, g.linear, rows=False, parts=plan.world_size) for g in gates]
    return None if any(s is None for s in splits) else splits  # type: ignore[return-value]


def _add_gates(plan: ShardingPlan, gates: List[OutputGate], splits: List[LinearSplit], heads: int) -> None:
    """Output gates split by output features with the heads, their views' head counts divided."""
    for gate, (weight, bias, extra) in zip(gates, splits):
        plan.decisions.append(ColumnShard(gate.linear.name, weight, bias, extra=extra))
        features = int(gate.linear.meta["val"].shape[-1]) if "val" in gate.linear.meta else -1
        fix_layouts(plan, gate.chain, (heads, features), plan.world_size)


def plan_mla(gm: fx.GraphModule, mla: fx.Node, plan: ShardingPlan) -> bool:
    """Split one ``torch_mla`` by heads: the query projection (``q_b_proj`` or ``q_proj``) by output
    features, ``kv_b_proj``'s weight (read by the op itself) by its per-head rows, the output
    projection by input features. The latent and the shared roped key (``kv_a_proj``) are the same
    for every head and stay whole, so each rank caches the whole latent (the MLA cache is per token,
    not per head) and attends with its own heads. Per-head sinks (HY-V4) go with their heads; sinks
    that are not a stored weight read by this op alone leave the layer whole. So does a per-head output
    gate (HY-V4, ``output_gate``). False (nothing added, the reason in ``plan.whole_layers``) for
    a layer it leaves whole."""
    reason = _mla_whole(gm, mla, plan)
    if reason is not None:
        plan.whole_layers[mla.name] = reason
    return reason is None


def _mla_whole(gm: fx.GraphModule, mla: fx.Node, plan: ShardingPlan) -> Optional[str]:
    """``plan_mla``'s work: None when planned, else why the layer stays whole."""
    heads = _head_count(mla, 0)
    kv_b = mla.args[4]
    kv_b_target = weight_target(gm, kv_b)
    sinks = arg(mla, 8, "sinks")
    sinks_target = None if sinks is None else weight_target(gm, sinks)
    if sinks is not None and (sinks_target is None or len(sinks.users) != 1):
        return "sinks that are not a stored weight of this layer alone"
    found = head_source([mla.args[0], mla.args[1]], mla, heads)
    out_chain: List[fx.Node] = []
    gates: List[OutputGate] = []
    out_linear = consuming_linear(mla, out_chain, gates)
    if any(g.linear is None for g in gates):
        return "an output gate that is not its own projection's output"
    if heads is None or kv_b_target is None or len(kv_b.users) != 1:
        return "kv_b_proj is not a stored weight of this layer alone"
    if found is None:
        return "the query is not one projection's heads through ops that keep each head's values to its head"
    if out_linear is None:
        return "the output does not reach one output projection through layout ops and per-head gates"
    if heads % plan.world_size:
        raise ConfigError(f"MLA attention {mla.name} has {heads} heads, which world_size {plan.world_size} does not "
                          f"divide; world sizes that split them: {sizes_that_divide([heads])}")
    q_linear, chain = found
    q_split = linear_split(gm, q_linear, rows=False, parts=plan.world_size)
    out_split = linear_split(gm, out_linear, rows=True, parts=plan.world_size)
    gate_splits = _gate_splits(gm, gates, plan)
    if q_split is None or out_split is None or gate_splits is None:
        return f"a quantized projection does not split into whole blocks of its format at world_size {plan.world_size}"
    plan.decisions.append(ColumnShard(q_linear.name, q_split[0], q_split[1], extra=q_split[2]))
    plan.decisions.append(HeadWeightShard(mla.name, kv_b_target))
    if sinks_target is not None:
        plan.decisions.append(HeadWeightShard(mla.name, sinks_target))
    plan.decisions.append(RowShard(out_linear.name, *out_split))
    q_features = int(q_linear.meta["val"].shape[-1]) if "val" in q_linear.meta else -1
    fix_layouts(plan, chain, (heads, q_features), plan.world_size)
    out_features = int(out_linear.args[0].meta["val"].shape[-1]) if "val" in out_linear.args[0].meta else -1
    fix_layouts(plan, out_chain, (heads, out_features), plan.world_size)
    _add_gates(plan, gates, gate_splits, heads)
    return None


def fix_layouts(plan: ShardingPlan, chain: List[fx.Node], full: Tuple[int, ...], divisor: int) -> None:
    """Literal head/feature counts in the views of one projection's chain, divided by ``divisor``."""
    for node in chain:
        dims = literal_dims(node, full)
        if dims:
            plan.layout_fixes.setdefault(node.name, {}).update({d: divisor for d in dims})
