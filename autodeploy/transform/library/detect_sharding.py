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
rank keeps its own GQA groups; key/value heads fewer than the ranks are replicated, each rank
holding the one head its query heads read), gated MLPs by their hidden features, one all-reduce
after each block, mixture-of-experts layers split by whole experts (expert parallelism: each
rank routes only the pairs of its experts, an all-reduce sums the ranks' outputs), and the LM
head split by vocabulary with an all-gather of the logits (``shard_lm_head``). What it cannot split stays replicated on every rank, which is correct and
only costs memory: the embedding, the norms, a tied LM head, and any projection it does not
recognise. Head or feature counts that the world size does not split are an error listing the
world sizes that would work. A graph whose model stated its own sharding (``torch_linear_with_hint``)
was planned by ``apply_sharding_hints`` and is skipped here.
"""

from typing import List, Optional, Tuple

import torch
from pydantic import Field
from torch import fx

from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..graph_utils import arg
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._sharding import (SHARDING_HINTS_META, ColumnShard, ExpertShard, RowShard, ShardingPlan, SwigluShard,
                        consuming_linear, linear_weights, literal_dims, producing_linear, sizes_that_divide,
                        weight_target)

ad = torch.ops.autodeploy
aten = torch.ops.aten
logger = get_logger(__name__)


class DetectShardingConfig(TransformConfig):
    stage: Stage = Stage.SHARDING
    shard_lm_head: bool = Field(
        default=True,
        description="Vocab-parallel LM head: each rank computes its slice of the vocabulary and an all-gather joins "
        "them (1/world_size of the head's weight per rank). Off keeps the whole head on every rank. A head tied to "
        "the embedding is always kept whole.")


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
    """Add the decisions for one ``torch_attention`` node; False (nothing added) when its
    projections are not plain linears over stored weights, or when it carries ALiBi slopes (one
    per query head: splitting the heads would need the slopes split with them, not done yet, so
    such an attention stays whole on every rank rather than reading another rank's slopes)."""
    if arg(attn, 10, "alibi_slopes") is not None:
        return False
    chains: List[List[fx.Node]] = [[], [], []]
    projections = []
    for i in range(3):
        linear = producing_linear(attn.args[i], chains[i])
        weights = linear_weights(gm, linear) if linear is not None else None
        if weights is None:
            return False
        projections.append((linear, weights))
    out_chain: List[fx.Node] = []
    out_linear = consuming_linear(attn, out_chain)
    out_weights = linear_weights(gm, out_linear) if out_linear is not None else None
    heads, kv_heads = _head_count(attn, 0), _head_count(attn, 1)
    if out_weights is None or heads is None or kv_heads is None:
        return False
    parts, index = _kv_split(heads, kv_heads, plan.world_size, plan.rank, attn.name)
    for i, (linear, (weight, bias)) in enumerate(projections):
        kv = i > 0 and parts != plan.world_size
        plan.decisions.append(ColumnShard(linear.name, weight, bias, parts if kv else None, index if kv else None))
        count = kv_heads if i > 0 else heads
        features = int(linear.meta["val"].shape[-1]) if "val" in linear.meta else -1
        _fix_layouts(plan, chains[i], (count, features), parts if i > 0 else plan.world_size)
    plan.decisions.append(RowShard(out_linear.name, *out_weights))
    _fix_layouts(plan, out_chain, (heads, int(out_linear.args[0].meta["val"].shape[-1])
                                   if "val" in out_linear.args[0].meta else -1), plan.world_size)
    return True


def _fix_layouts(plan: ShardingPlan, chain: List[fx.Node], full: Tuple[int, ...], divisor: int) -> None:
    """Literal head/feature counts in the views of one projection's chain, divided by ``divisor``."""
    for node in chain:
        dims = literal_dims(node, full)
        if dims:
            plan.layout_fixes.setdefault(node.name, {}).update({d: divisor for d in dims})


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


def plan_moe(gm: fx.GraphModule, node: fx.Node, plan: ShardingPlan) -> bool:
    """Expert parallelism for one ``torch_moe`` (per-expert weight lists): each rank keeps a
    contiguous block of whole experts. Experts the world size does not divide stay replicated
    (logged): tensor parallelism inside the experts is not built."""
    lists = [node.args[i] for i in range(3, 9)]
    experts = len(lists[0])
    targets = [[weight_target(gm, a) for a in group] for group in lists if group]
    if any(t is None for group in targets for t in group):
        return False
    if experts % plan.world_size:
        logger.info("MoE %s kept whole on every rank: %d experts, world_size %d (world sizes that split them: %s)",
                    node.name, experts, plan.world_size, sizes_that_divide([experts]))
        return False
    per_rank = experts // plan.world_size
    start, end = plan.rank * per_rank, (plan.rank + 1) * per_rank
    dropped = tuple(t for group in targets for e, t in enumerate(group) if not start <= e < end)
    plan.decisions.append(ExpertShard(node.name, start, end, dropped))  # type: ignore[arg-type]
    return True


def plan_lm_head(gm: fx.GraphModule, plan: ShardingPlan) -> bool:
    """The vocab-parallel LM head: the linear that produces the logits (through single-input ops
    such as a soft-cap) split by vocabulary rows, its slices all-gathered. Left whole: a head tied
    to the embedding (the lookup needs every row), or a vocabulary the world size does not divide."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    node = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target != aten.linear.default:
        inputs = node.all_input_nodes
        node = inputs[0] if len(inputs) == 1 else None
    if not isinstance(node, fx.Node) or node.target != aten.linear.default:
        return False
    weights = linear_weights(gm, node)
    if weights is None:
        return False
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == weights[0] for _ in n.users]
    vocab = int(node.meta["val"].shape[-1]) if "val" in node.meta else 0
    if len(readers) != 1 or vocab % plan.world_size:
        logger.info("LM head kept whole on every rank: %s", "tied to the embedding" if len(readers) != 1 else
                    f"vocabulary {vocab} not divisible by world_size {plan.world_size}")
        return False
    plan.decisions.append(ColumnShard(node.name, weights[0], weights[1], gather=True))
    return True


def detect(gm: fx.GraphModule, world_size: int, rank: int, lm_head: bool = True) -> ShardingPlan:
    plan = ShardingPlan(world_size=world_size, rank=rank)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == ad.torch_attention.default:
            plan_attention(gm, node, plan)
        elif node.target == ad.torch_swiglu_mlp.default:
            plan_swiglu(gm, node, plan)
        elif node.target == ad.torch_moe.default:
            plan_moe(gm, node, plan)
    if lm_head:
        plan_lm_head(gm, plan)
    return plan


@TransformRegistry.register("detect_sharding")
class DetectSharding(BaseTransform):
    config_class = DetectShardingConfig
    run_after = ("apply_sharding_hints",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        if ctx.world_size == 1:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                 reason="not needed: world_size 1")
        if gm.meta.get(SHARDING_HINTS_META):
            # one path: the model's hints already produced this graph's plan (the same objects)
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                 reason="planned from the graph's sharding hints (apply_sharding_hints)")
        cfg: DetectShardingConfig = self.config  # type: ignore[assignment]
        plan = detect(gm, ctx.world_size, ctx.rank, lm_head=cfg.shard_lm_head)
        logger.info("sharding plan for rank %d of %d: %s", ctx.rank, ctx.world_size, plan.summary())
        ctx.sharding_plan = plan
        return TransformInfo(num_matches=len(plan.decisions), is_clean=True, has_valid_shapes=True)
