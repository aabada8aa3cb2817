"""``detect_sharding`` (sharding): find how to split the model across ``world_size`` ranks.

Before (one rank, any world size)::

    q = view(linear(x, Wq)); k = view(linear(x, Wk)); v = view(linear(x, Wv))
    a = autodeploy.torch_attention(rope(q), rope(k), v, ...)
    y = linear(reshape(a), Wo)
    m = autodeploy.torch_swiglu_mlp(h, Wgate, Wup, Wdown)

After: the graph is unchanged; ``ctx.sharding_plan`` holds, for each attention, ``ColumnShard``
for the q/k/v projections (each rank its heads) and ``RowShard`` for the output projection, and a
``SwigluShard`` for each gated MLP (``_sharding``). ``sharding_transform_executor`` applies it.

The heuristic is Megatron's: attention split by heads (query and key/value heads alike, so each
rank keeps its own GQA groups), gated MLPs by their hidden features, one all-reduce after each
block. What it cannot split stays replicated on every rank, which is correct and only costs
memory: the embedding, the norms, the LM head, and any projection it does not recognise. Head or
feature counts that the world size does not divide are an error listing the world sizes that
would work (replicating key/value heads across ranks is not built yet).
"""

from typing import List, Optional

import torch
from torch import fx

from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._sharding import (ColumnShard, RowShard, ShardingPlan, SwigluShard, consuming_linear, literal_dims,
                        producing_linear, sizes_that_divide, weight_target)

ad = torch.ops.autodeploy
logger = get_logger(__name__)


class DetectShardingConfig(TransformConfig):
    stage: Stage = Stage.SHARDING


def _linear_weights(gm: fx.GraphModule, linear: fx.Node):
    weight = weight_target(gm, linear.args[1])
    bias_arg = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    bias = weight_target(gm, bias_arg) if bias_arg is not None else None
    if weight is None or (bias_arg is not None and bias is None):
        return None
    return weight, bias


def _head_count(node: fx.Node, index: int) -> Optional[int]:
    val = node.args[index].meta.get("val") if isinstance(node.args[index], fx.Node) else None
    return int(val.shape[2]) if val is not None and val.dim() == 4 else None  # bsnd


def plan_attention(gm: fx.GraphModule, attn: fx.Node, plan: ShardingPlan) -> bool:
    """Add the decisions for one ``torch_attention`` node; False (nothing added) when its
    projections are not plain linears over stored weights."""
    layouts: List[fx.Node] = []
    projections = []
    for i in range(3):
        linear = producing_linear(attn.args[i], layouts)
        weights = _linear_weights(gm, linear) if linear is not None else None
        if weights is None:
            return False
        projections.append((linear, weights))
    out_linear = consuming_linear(attn, layouts)
    out_weights = _linear_weights(gm, out_linear) if out_linear is not None else None
    if out_weights is None:
        return False
    heads = [h for h in (_head_count(attn, 0), _head_count(attn, 1)) if h is not None]
    if any(h % plan.world_size for h in heads):
        raise ConfigError(
            f"attention {attn.name} has {heads[0]} query and {heads[-1]} key/value heads, which world_size "
            f"{plan.world_size} does not divide; world sizes that split them: "
            f"{sizes_that_divide(heads)} (replicating key/value heads across ranks is not supported yet)")
    for linear, (weight, bias) in projections:
        plan.decisions.append(ColumnShard(linear.name, weight, bias))
    plan.decisions.append(RowShard(out_linear.name, *out_weights))
    full = tuple(set(heads) | {int(n.meta["val"].shape[-1]) for n, _ in projections if "val" in n.meta})
    for node in layouts:
        dims = literal_dims(node, full)
        if dims:
            plan.layout_fixes[node.name] = dims
    return True


def plan_swiglu(gm: fx.GraphModule, node: fx.Node, plan: ShardingPlan) -> bool:
    if len(node.args) > 4 and any(a is not None for a in node.args[4:]) or node.kwargs:
        return False  # biases: not split yet
    targets = [weight_target(gm, a) for a in node.args[1:4]]
    if any(t is None for t in targets):
        return False
    hidden = int(node.args[1].meta["val"].shape[0]) if "val" in node.args[1].meta else 0
    if hidden % plan.world_size:
        raise ConfigError(f"MLP {node.name} has {hidden} hidden features, which world_size {plan.world_size} does "
                          f"not divide; world sizes that split them: {sizes_that_divide([hidden])}")
    plan.decisions.append(SwigluShard(node.name, *targets))  # type: ignore[arg-type]
    return True


def detect(gm: fx.GraphModule, world_size: int, rank: int) -> ShardingPlan:
    plan = ShardingPlan(world_size=world_size, rank=rank)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == ad.torch_attention.default:
            plan_attention(gm, node, plan)
        elif node.target == ad.torch_swiglu_mlp.default:
            plan_swiglu(gm, node, plan)
    return plan


@TransformRegistry.register("detect_sharding")
class DetectSharding(BaseTransform):
    config_class = DetectShardingConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        if ctx.world_size == 1:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                 reason="not needed: world_size 1")
        plan = detect(gm, ctx.world_size, ctx.rank)
        logger.info("sharding plan for rank %d of %d: %s", ctx.rank, ctx.world_size, plan.summary())
        ctx.sharding_plan = plan
        return TransformInfo(num_matches=len(plan.decisions), is_clean=True, has_valid_shapes=True)
