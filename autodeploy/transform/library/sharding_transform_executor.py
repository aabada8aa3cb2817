"""``sharding_transform_executor`` (sharding): apply ``ctx.sharding_plan`` to this rank's graph.

Before (``detect_sharding`` planned a column shard for ``Wq`` and a row shard for ``Wo``)::

    q = linear(x, Wq)                        # Wq [H*D, hidden] on meta
    y = linear(a, Wo, bo)                    # Wo [hidden, H*D]
    m = autodeploy.torch_swiglu_mlp(h, Wg, Wu, Wd)

After, on rank r of n::

    q = linear(x, Wq)                        # Wq [H*D/n, hidden]: rows r*H*D/n ... of the checkpoint's
    y = add(autodeploy.torch_dist_all_reduce(linear(a, Wo)), bo)      # Wo [hidden, H*D/n]
    m = autodeploy.torch_dist_all_reduce(autodeploy.torch_swiglu_mlp(h, Wg, Wu, Wd))  # Wg/Wu rows, Wd columns

A quantized linear's block or group scales (``extra``) split with its weight, its per-tensor
scales stay whole. Expert parallelism (``ExpertShard``) keeps this rank's block of experts in the
``torch_moe`` lists and routes the other pairs nowhere::

    mine = (sel >= e0) & (sel < e1)
    m = autodeploy.torch_dist_all_reduce(autodeploy.torch_moe(x, where(mine, sel - e0, -1),
                                                               where(mine, w, 0), gates[e0:e1], ...))

(``torch_moe_fused`` the same, its stacked ``[E, ...]`` tensors holding rows ``e0:e1``.)

The embedding table (``EmbeddingShard``) keeps this rank's rows; ids outside them are zeroed and an
all-reduce joins the ranks' rows::

    mine = (ids >= r0) & (ids < r1)
    e = autodeploy.torch_dist_all_reduce(where(mine[..., None], embedding(W[r0:r1], where(mine, ids - r0, 0)), 0))

Experts the world size does not divide (``ExpertTensorShard``) are split inside: each rank keeps
every expert's slice of the hidden features, the down biases on rank 0 only::

    m = autodeploy.torch_dist_all_reduce(autodeploy.torch_moe(x, sel, w, [Wg_e rows], [Wu_e rows], [Wd_e cols], ...))

Parameters are still on the meta device here: each is replaced by one of its shard's shape, and
``ctx.weight_shards`` tells ``load_weights`` which slice of the checkpoint tensor this rank reads
(so a rank holds 1/n of the sharded weights, never the whole tensor). View/reshape sizes that
count heads or features of a sharded projection (``layout_fixes``) are divided by n (by the
key/value head count where those heads are replicated: one head a rank); ``-1`` and symbolic
sizes need nothing. The vocab-parallel LM head is a column shard whose slices an
``torch_dist_all_gather`` joins, so every rank holds all the logits::

    logits = autodeploy.torch_dist_all_gather(linear(h, W_lm), -1)     # W_lm [vocab/n, hidden]

A norm over all heads' features between a split projection and its attention (``NormShard``,
OLMo-2's q/k norms) keeps its slice of the weight and sums its squares over the ranks::

    q = autodeploy.torch_dist_rmsnorm(linear(x, Wq), w_q[r*H*D/n ...], eps)

and an attention's query and key norms share one all-reduce::

    q, k = autodeploy.torch_dist_rmsnorm_pair(linear(x, Wq), w_q[...], eps, linear(x, Wk), w_k[...], eps)

A fused ``[q | k | v]`` projection (``ColumnShard.blocks``) keeps this rank's part of each block,
and the slices or split sizes that cut it take this rank's smaller blocks (``arg_fixes``)::

    qkv = linear(x, W[q_r | k_r | v_r]);  q = qkv[..., 0:Q/n];  k = qkv[..., Q/n:Q/n + K/n]; ...

State layers split the same way (a Mamba2 layer's ``in_proj`` by its five blocks, its conv by three,
per-head tensors by ``HeadWeightShard``); a mean over features split across ranks (a Mamba2 gated norm
with one group: ``FeatureMeanShard``) becomes the ranks' means averaged::

    ms = autodeploy.torch_dist_all_reduce(mean(g_r ** 2, -1, keepdim=True)) / n
"""

import operator
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from ..graph_utils import arg
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_from_config import GRAPH_IGNORED_TENSORS
from ._sharding import (ColumnShard, EmbeddingShard, ExpertShard, ExpertTensorShard, FeatureMeanShard, HeadSlice,
                        HeadWeightShard, NormShard, RowShard, ShardingPlan, SwigluShard, WeightShard)

ad = torch.ops.autodeploy
aten = torch.ops.aten


class ShardingExecutorConfig(TransformConfig):
    stage: Stage = Stage.SHARDING


def _shard_param(gm: fx.GraphModule, target: str, dim: int, plan: ShardingPlan,
                 shards: Dict[str, WeightShard], parts: Optional[int] = None, index: Optional[int] = None,
                 blocks: Tuple[Tuple[int, int, int], ...] = ()) -> None:
    """Replace the (meta) tensor at ``target`` by one of this rank's shard shape, and record the
    slice load_weights reads: part ``index`` of ``parts`` (default: the rank's of world_size), or
    its part of each of ``blocks`` (``WeightShard``).
    Every other name of the same tensor (a tied embedding and LM head) gets the new one too, so
    the loader's tied groups hold one slice, not a slice and the whole table."""
    parts = plan.world_size if parts is None else parts
    index = plan.rank if index is None else index
    if target in shards:
        return  # shared by two users (tied): split once
    *path, leaf = target.split(".")
    old = getattr(gm.get_submodule(".".join(path)) if path else gm, leaf)
    shape = list(old.shape)
    shape[dim] = sum(n // p for n, p, _ in blocks) if blocks else shape[dim] // parts
    new = torch.empty(shape, dtype=old.dtype, device=old.device)
    aliases = [name for name, t in (*gm.named_parameters(remove_duplicate=False),
                                    *gm.named_buffers(remove_duplicate=False)) if t is old]
    is_param = isinstance(old, nn.Parameter)
    replacement = nn.Parameter(new, requires_grad=False) if is_param else new
    for name in aliases or [target]:
        *path, leaf = name.split(".")
        owner: nn.Module = gm.get_submodule(".".join(path)) if path else gm
        if is_param:
            owner.register_parameter(leaf, replacement)  # type: ignore[arg-type]
        else:
            owner.register_buffer(leaf, replacement)
        shards[name] = WeightShard(dim=dim, index=index, parts=parts, blocks=blocks)


def _all_reduce_after(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    with gm.graph.inserting_after(node):
        reduced = gm.graph.call_function(ad.torch_dist_all_reduce.default, (node,))
    node.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
    return reduced


def _keep_local_experts(gm: fx.GraphModule, node: fx.Node, shard: ExpertShard, plan: ShardingPlan,
                        shards: Dict[str, WeightShard]) -> None:
    """``torch_moe`` (or a per-expert quantized MoE op, or ``torch_moe_fused``) over this rank's
    experts only: local expert ids, the other ranks' pairs sent nowhere (id -1, weight 0: the MoE
    ops skip them), the other experts' tensors dropped from the module and the checkpoint list
    (stacked tensors: this rank's rows loaded), an all-reduce after."""
    graph = gm.graph
    sel, weights = node.args[1], node.args[2]
    with graph.inserting_before(node):
        mine = graph.call_function(aten.bitwise_and.Tensor, (graph.call_function(aten.ge.Scalar, (sel, shard.start)),
                                                             graph.call_function(aten.lt.Scalar, (sel, shard.end))))
        local = graph.call_function(aten.where.ScalarOther,
                                    (mine, graph.call_function(aten.sub.Tensor, (sel, shard.start)), -1))
        kept = graph.call_function(aten.where.ScalarOther, (mine, weights, 0.0))
    # every per-expert list (weights, biases, a quantized format's scales) keeps this rank's block
    node.args = (node.args[0], local, kept, *[list(a)[shard.start:shard.end] if isinstance(a, (list, tuple)) else a
                                              for a in node.args[3:]])
    for target in shard.stacked:  # experts [start, end) are this rank's part of dim 0
        _shard_param(gm, target, 0, plan, shards)
    _all_reduce_after(gm, node)
    _drop(gm, shard.dropped)


def _split_inside_experts(gm: fx.GraphModule, node: fx.Node, shard: ExpertTensorShard, plan: ShardingPlan,
                          shards: Dict[str, WeightShard]) -> None:
    """Every expert's slice of the hidden features on this rank: gate/up rows (and their biases),
    down columns; the down biases only on rank 0, so the all-reduce after the op adds them once."""
    for target in (*shard.gate, *shard.up, *shard.gate_bias, *shard.up_bias):
        _shard_param(gm, target, 0, plan, shards)
    for target in shard.down:
        _shard_param(gm, target, 1, plan, shards)
    if shard.down_bias and plan.rank != 0:
        node.args = (*node.args[:8], [], *node.args[9:])
        _drop(gm, shard.down_bias)
    _all_reduce_after(gm, node)


def _lookup_local_rows(gm: fx.GraphModule, node: fx.Node, shard: EmbeddingShard) -> None:
    """``embedding(W, ids)`` over this rank's rows ``[start, end)``: ids elsewhere read row 0 and
    are zeroed, an all-reduce sums the ranks' rows (each id is in exactly one rank's range)."""
    graph = gm.graph
    ids = node.args[1]
    with graph.inserting_before(node):
        mine = graph.call_function(aten.bitwise_and.Tensor, (graph.call_function(aten.ge.Scalar, (ids, shard.start)),
                                                             graph.call_function(aten.lt.Scalar, (ids, shard.end))))
        local = graph.call_function(aten.where.ScalarOther,
                                    (mine, graph.call_function(aten.sub.Tensor, (ids, shard.start)), 0))
    node.args = (node.args[0], local, *node.args[2:])
    with graph.inserting_after(node):
        keep = graph.call_function(aten.unsqueeze.default, (mine, -1))
    with graph.inserting_after(keep):
        zeroed = graph.call_function(aten.where.ScalarOther, (keep, node, 0.0))
    node.replace_all_uses_with(zeroed, delete_user_cb=lambda user: user is not zeroed)
    _all_reduce_after(gm, zeroed)


def _slice_heads(gm: fx.GraphModule, node: fx.Node, shard: HeadSlice, plan: ShardingPlan) -> None:
    """The op reads this rank's heads of a per-head input computed in the graph (``HeadSlice``)."""
    value = arg(node, shard.index, shard.name)
    heads = value.meta["val"].shape[shard.dim] // plan.world_size
    with gm.graph.inserting_before(node):
        mine = gm.graph.call_function(aten.slice.Tensor, (value, shard.dim, plan.rank * heads,
                                                          (plan.rank + 1) * heads))
    if len(node.args) > shard.index:
        node.args = (*node.args[:shard.index], mine, *node.args[shard.index + 1:])
    else:
        node.kwargs = {**node.kwargs, shard.name: mine}


def _pair_norms(gm: fx.GraphModule, plan: ShardingPlan, nodes: Dict[str, fx.Node]) -> None:
    """The query and key norms of one attention (two ``NormShard`` of a group) as one
    ``torch_dist_rmsnorm_pair``: one all-reduce a layer instead of two. It takes the later norm's
    place, so only where every reader of the earlier one comes after that (else they stay apart)."""
    groups: Dict[str, list] = {}
    for d in plan.decisions:
        if isinstance(d, NormShard) and d.group is not None:
            groups.setdefault(d.group, []).append(nodes[d.node])
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for pair in groups.values():
        if len(pair) != 2:
            continue
        first, second = sorted(pair, key=order.__getitem__)
        same_tokens = first.args[0].meta["val"].shape[:-1] == second.args[0].meta["val"].shape[:-1]
        positional = all(len(n.args) == 3 and not n.kwargs for n in pair)  # (x, weight, eps)
        if any(order[u] < order[second] for u in first.users) or not same_tokens or not positional:
            continue
        with gm.graph.inserting_before(second):
            both = gm.graph.call_function(ad.torch_dist_rmsnorm_pair.default, (*first.args, *second.args))
            outs = [gm.graph.call_function(operator.getitem, (both, i)) for i in range(2)]
        for node, out in zip((first, second), outs):
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)


def _drop(gm: fx.GraphModule, targets: Sequence[str]) -> None:
    """Remove tensors this rank does not hold from the module, their unused ``get_attr`` nodes from
    the graph, and account for their checkpoint tensors (not loaded, not reported unused)."""
    ignored = gm.meta.setdefault(GRAPH_IGNORED_TENSORS, [])
    for target in targets:
        *path, leaf = target.split(".")
        owner: nn.Module = gm.get_submodule(".".join(path)) if path else gm
        delattr(owner, leaf)
        ignored.append(target)
    for get_attr in [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in set(targets)]:
        if not get_attr.users:
            gm.graph.erase_node(get_attr)


def execute(gm: fx.GraphModule, plan: ShardingPlan) -> Dict[str, WeightShard]:
    nodes = {n.name: n for n in gm.graph.nodes}
    shards: Dict[str, WeightShard] = {}
    for decision in plan.decisions:
        node = nodes[decision.node]
        if isinstance(decision, ColumnShard):
            _shard_param(gm, decision.weight, 0, plan, shards, decision.parts, decision.index, decision.blocks)
            if decision.bias is not None:
                _shard_param(gm, decision.bias, 0, plan, shards, decision.parts, decision.index, decision.blocks)
            for target, dim in decision.extra:  # a quantized linear's block/group scales
                _shard_param(gm, target, dim, plan, shards, decision.parts, decision.index)
            if decision.gather:
                with gm.graph.inserting_after(node):
                    gathered = gm.graph.call_function(ad.torch_dist_all_gather.default, (node, -1))
                node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
        elif isinstance(decision, RowShard):
            _shard_param(gm, decision.weight, 1, plan, shards)
            for target, dim in decision.extra:
                _shard_param(gm, target, dim, plan, shards)
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if node.target == aten.linear.default:
                node.args, node.kwargs = (node.args[0], node.args[1]), {}
            else:  # a quantized linear: its scales follow the bias argument
                node.args = (*node.args[:2], None, *node.args[3:])
            reduced = _all_reduce_after(gm, node)
            if bias is not None:  # added once, after the partial sums are summed
                with gm.graph.inserting_after(reduced):
                    biased = gm.graph.call_function(aten.add.Tensor, (reduced, bias))
                reduced.replace_all_uses_with(biased, delete_user_cb=lambda user: user is not biased)
        elif isinstance(decision, SwigluShard):
            _shard_param(gm, decision.gate, 0, plan, shards)
            _shard_param(gm, decision.up, 0, plan, shards)
            _shard_param(gm, decision.down, 1, plan, shards)
            _all_reduce_after(gm, node)
        elif isinstance(decision, ExpertShard):
            _keep_local_experts(gm, node, decision, plan, shards)
        elif isinstance(decision, ExpertTensorShard):
            _split_inside_experts(gm, node, decision, plan, shards)
        elif isinstance(decision, HeadWeightShard):  # torch_mla's kv_b_proj, A_log, ...: this rank's heads' rows
            _shard_param(gm, decision.weight, decision.dim, plan, shards, blocks=decision.blocks)
        elif isinstance(decision, FeatureMeanShard):  # the mean over all ranks' equal slices
            reduced = _all_reduce_after(gm, node)
            with gm.graph.inserting_after(reduced):
                mean = gm.graph.call_function(aten.div.Scalar, (reduced, plan.world_size))
            reduced.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not mean)
        elif isinstance(decision, HeadSlice):
            _slice_heads(gm, node, decision, plan)
        elif isinstance(decision, NormShard):  # a norm over all heads: its slice, squares summed over ranks
            _shard_param(gm, decision.weight, 0, plan, shards, decision.parts, decision.index)
            node.target = ad.torch_dist_rmsnorm.default
        elif isinstance(decision, EmbeddingShard):
            _shard_param(gm, decision.weight, 0, plan, shards)
            _lookup_local_rows(gm, node, decision)
    _pair_norms(gm, plan, nodes)
    for name, divisors in plan.layout_fixes.items():
        node = nodes[name]
        shape = list(node.args[1])
        for i, divisor in divisors.items():
            shape[i] //= divisor
        node.args = (node.args[0], shape, *node.args[2:])
    for name, values in plan.arg_fixes.items():  # a fused projection's cuts: this rank's block bounds
        args = list(nodes[name].args)
        for i, value in values.items():
            args[i] = value
        nodes[name].args = tuple(args)
    gm.graph.lint()
    gm.recompile()
    return shards


@TransformRegistry.register("sharding_transform_executor")
class ShardingTransformExecutor(BaseTransform):
    config_class = ShardingExecutorConfig
    run_after = ("apply_sharding_hints", "detect_sharding")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        plan = ctx.sharding_plan
        if ctx.world_size == 1 or plan is None:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                 reason="not needed: world_size 1" if ctx.world_size == 1 else "no sharding plan")
        ctx.weight_shards.update(execute(gm, plan))
        # every sharded tensor's shape changed: the next transform that reads shapes propagates them
        return TransformInfo(num_matches=len(plan.decisions), is_clean=False, has_valid_shapes=False)
