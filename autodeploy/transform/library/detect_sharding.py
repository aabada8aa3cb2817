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
holding the one head its query heads read), gated MLPs by their hidden features
(``torch_swiglu_mlp``, and any ``down(f(gate(x), up(x)))`` with an element-wise ``f``: GeGLU,
relu², quantized gate/up/down), one all-reduce after each block, mixture-of-experts layers split
by whole experts (expert parallelism: each rank routes only the pairs of its experts, an
all-reduce sums the ranks' outputs; quantized experts too, with their scales; stacked experts by
rows of their ``[E, ...]`` tensors) or, when the world
size does not divide the float experts (fewer experts than ranks), inside every expert by its
hidden features, the embedding table split by vocabulary rows with an all-reduce of the looked-up
rows (``shard_embedding``), and the LM head split by vocabulary with an all-gather of the logits
(``shard_lm_head``; a head tied to the embedding shares the embedding's slice). Quantized linears
(FP8, fine-grained FP8, NVFP4, int4, int8) split like float ones, their block or group scales with
them, where the split keeps whole blocks (a fine-grained FP8 linear whose 128-wide tiles a rank
would cut stays whole). MLA attention (``torch_mla``) is split by heads too: the query projection
and ``kv_b_proj``'s per-head rows, the output projection by input features; the latent and the
shared roped key stay whole (each rank caches the whole latent). State layers split by heads or
channels with their convolution channels and state: Gated DeltaNet (Qwen3.5, Qwen3-Next:
``_sharding_state``), Mamba2 and Mamba (Bamba, Falcon-H1, Nemotron-H, Granite-4, Zamba2, Jamba, ...)
and LFM2's gated short convolution (``_sharding_mamba``). Between a
projection and its attention the planner follows only ops it proves head-local (``_sharding_heads``:
layout ops, RoPE matched or written out, per-head norms, element-wise ops with operands shared by
the heads); a norm
over all heads' features splits as ``torch_dist_rmsnorm`` (``NormShard``), a fused q/k/v projection
by heads (laid out head by head) or block by block (``[q | k | v]``: ``ColumnShard.blocks``, the
cuts' bounds in ``arg_fixes``). What it cannot split stays replicated on every rank, which is
correct and only costs memory and speed: the norms, quantized experts the world size does not
divide, any projection it does not recognise, and attention or a state layer it cannot prove
head-local (its reason in ``ShardingPlan.whole_layers``, rank 0 warns).
Head or feature counts that the world size does not split are an error listing the world sizes
that would work. A graph whose model stated its own sharding (``torch_linear_with_hint``) was
planned by ``apply_sharding_hints`` and is skipped here.
"""

from typing import List, Optional, Set, Tuple

import torch
from pydantic import Field
from torch import fx

from ...ops.quant.moe import quant_moe_ops, stacked_quant_moe_ops
from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..graph_utils import get_attr_value
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._sharding import (SHARDING_HINTS_META, ColumnShard, EmbeddingShard, ExpertShard, ExpertTensorShard, NormShard,
                        ELEMENTWISE, RowShard, ShardingPlan, SwigluShard, is_linear, linear_split, linear_weights,
                        sizes_that_divide, stored_target, weight_target)
from ._sharding_attention import plan_attention, plan_fused_blocks, plan_mla
from ._sharding_heads import Cut, all_features_norm, block_cut, cuts_cover
from ._sharding_mamba import plan_mamba, plan_mamba2, plan_short_conv
from ._sharding_state import plan_gated_delta_rule

ad = torch.ops.autodeploy
aten = torch.ops.aten
logger = get_logger(__name__)
QUANT_MOE_OPS = frozenset(quant_moe_ops())
STACKED_QUANT_MOE_OPS = frozenset(stacked_quant_moe_ops())



class DetectShardingConfig(TransformConfig):
    stage: Stage = Stage.SHARDING
    shard_lm_head: bool = Field(
        default=True,
        description="Vocab-parallel LM head: each rank computes its slice of the vocabulary and an all-gather joins "
        "them (1/world_size of the head's weight per rank). Off keeps the whole head on every rank. A head tied to "
        "the embedding is split only with the embedding (shard_embedding), sharing its slice.")
    shard_embedding: bool = Field(
        default=True,
        description="Vocab-parallel embedding: each rank holds 1/world_size of the table's rows and looks up the ids "
        "in its range; one all-reduce per step joins the rows (on CPU/gloo ~1 ms at 2 ranks). Off keeps the whole "
        "table on every rank (and a tied LM head whole with it).")


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
    """Expert parallelism for one ``torch_moe`` or per-expert quantized MoE op (per-expert lists of
    weights, biases and scales): each rank keeps a contiguous block of whole experts. Float experts
    the world size does not divide (fewer experts than ranks, say) are split inside instead: tensor
    parallelism over each expert's hidden features. Quantized ones are then kept whole (logged):
    splitting inside them would cut their scale blocks, which is not built."""
    groups = [list(a) for a in node.args[3:] if isinstance(a, (list, tuple))]
    experts = len(node.args[5])  # the down projections: every MoE op's sixth argument
    targets = [[stored_target(gm, a) for a in group] for group in groups]
    if not experts or any(t is None for group in targets for t in group):
        return False
    if experts % plan.world_size:
        if node.target != ad.torch_moe.default:
            logger.warning("quantized MoE %s kept whole on every rank: %d experts, world_size %d (world sizes that "
                           "split them: %s)", node.name, experts, plan.world_size, sizes_that_divide([experts]))
            return False
        return _plan_moe_inside(gm, node, groups, targets, plan)  # type: ignore[arg-type]
    per_rank = experts // plan.world_size
    start, end = plan.rank * per_rank, (plan.rank + 1) * per_rank
    dropped = tuple(t for group in targets for e, t in enumerate(group) if not start <= e < end)
    plan.decisions.append(ExpertShard(node.name, start, end, dropped))  # type: ignore[arg-type]
    return True


def plan_stacked_moe(gm: fx.GraphModule, node: fx.Node, plan: ShardingPlan) -> bool:
    """Expert parallelism for one ``torch_moe_fused`` or stacked quantized MoE op over stored
    stacked tensors (``[E, ...]`` weights, biases, scales): each rank keeps a contiguous block of
    experts, its rows of each tensor.
    Stacked weights written as ops on parameters (GPT-OSS's transposed, interleaved layout) or
    experts the world size does not divide stay whole on every rank (logged): correct, only
    memory."""
    slots = [a for a in node.args[3:] if isinstance(a, fx.Node)]  # weights, biases, a quantized format's scales
    targets = [stored_target(gm, a) for a in slots]
    if any(t is None for t in targets):
        logger.info("MoE %s kept whole on every rank: its stacked weights are computed in the graph", node.name)
        return False
    experts = int(get_attr_value(gm, slots[0]).shape[0])
    if experts % plan.world_size:
        logger.info("MoE %s kept whole on every rank: %d experts, world_size %d (world sizes that split them: %s)",
                    node.name, experts, plan.world_size, sizes_that_divide([experts]))
        return False
    per_rank = experts // plan.world_size
    start, end = plan.rank * per_rank, (plan.rank + 1) * per_rank
    plan.decisions.append(ExpertShard(node.name, start, end, (), tuple(targets)))  # type: ignore[arg-type]
    return True


def _plan_moe_inside(gm: fx.GraphModule, node: fx.Node, groups: List[List[fx.Node]], targets: List[List[str]],
                     plan: ShardingPlan) -> bool:
    """``ExpertTensorShard`` for a ``torch_moe`` whose experts the world size does not divide: each
    expert's hidden features (its down weight's columns) split across all ranks; an error listing
    the world sizes that work when it does not divide those either."""
    down = get_attr_value(gm, groups[2][0]) if groups[2] else None
    hidden = int(down.shape[1]) if down is not None and down.dim() == 2 else 0
    experts = len(groups[2])
    if not hidden:
        return False
    if hidden % plan.world_size:
        works = sorted(set(sizes_that_divide([experts])) | set(sizes_that_divide([hidden])))
        raise ConfigError(f"MoE {node.name} has {experts} experts of {hidden} hidden features each, which world_size "
                          f"{plan.world_size} splits neither by whole experts nor inside them; world sizes that split "
                          f"them: {works}")
    gate, up, down_t, gate_b, up_b, down_b = (tuple(t) for t in targets)
    plan.decisions.append(ExpertTensorShard(node.name, gate, up, down_t, gate_b, up_b, down_b))
    return True


def plan_mlp(gm: fx.GraphModule, down: fx.Node, plan: ShardingPlan, taken: Set[str]) -> bool:
    """Megatron's MLP split for any ``down(f(a(x), b(x), ...))`` whose inner function ``f`` is
    element-wise over the hidden features (SiLU/GELU gating, squared ReLU, casts, scalar
    arithmetic) and whose leaves ``a, b, ...`` are linears, plain or quantized, that nothing else
    reads: the leaves split by output features, ``down`` by input features, one all-reduce. Covers
    the MLPs ``torch_swiglu_mlp`` does not (quantized gate/up/down, GeGLU, relu² MLPs). Anything
    else on the way (a reduction, a tensor that is not per feature, another reader) leaves it
    whole."""
    if down.name in taken or not is_linear(down) or not isinstance(down.args[0], fx.Node):
        return False
    x_val = down.args[0].meta.get("val")
    if x_val is None:
        return False
    features = int(x_val.shape[-1])
    inner, leaves, cuts = _elementwise_region(gm, down.args[0], features)
    if cuts:
        return _plan_fused_mlp(gm, down, inner, cuts, plan, taken)
    if not inner or not leaves or any(leaf.name in taken for leaf in leaves):
        return False
    region = set(inner) | set(leaves)
    if any(u not in region and u is not down for n in region for u in n.users):
        return False  # another reader would see this rank's slice only
    splits = [linear_split(gm, leaf, rows=False, parts=plan.world_size) for leaf in leaves]
    down_split = linear_split(gm, down, rows=True, parts=plan.world_size)
    if down_split is None or any(s is None for s in splits):
        logger.info("MLP %s kept whole on every rank: %d features do not split into whole blocks at world_size %d",
                    down.name, features, plan.world_size)
        return False
    for leaf, (weight, bias, extra) in zip(leaves, splits):  # type: ignore[misc]
        plan.decisions.append(ColumnShard(leaf.name, weight, bias, extra=extra))
    plan.decisions.append(RowShard(down.name, down_split[0], down_split[1], extra=down_split[2]))
    _add_norms(plan, inner)
    taken.update([down.name, *(leaf.name for leaf in leaves)])
    return True


def _plan_fused_mlp(gm: fx.GraphModule, down: fx.Node, inner: List[fx.Node], cuts: List[Cut], plan: ShardingPlan,
                    taken: Set[str]) -> bool:
    """An MLP whose gate and up are two blocks of one projection (Phi-3's ``gate_up_proj`` chunked
    into ``[gate | up]``): the projection split block by block (``plan_fused_blocks``), down by its
    input features."""
    linear = cuts[0].linear
    width = int(down.args[0].meta["val"].shape[-1])
    if not inner or linear.name in taken or not cuts_cover(cuts) or any(c.end - c.start != width for c in cuts):
        return False
    region = set(inner) | {c.node for c in cuts}
    if any(u not in region and u is not down for n in region for u in n.users):
        return False
    split = linear_split(gm, linear, rows=False, parts=plan.world_size)
    down_split = linear_split(gm, down, rows=True, parts=plan.world_size)
    if split is None or split[2] or down_split is None:
        return False
    if not plan_fused_blocks(plan, [(c, plan.world_size, plan.rank) for c in cuts], split[0], split[1]):
        return False
    plan.decisions.append(RowShard(down.name, down_split[0], down_split[1], extra=down_split[2]))
    _add_norms(plan, inner)
    taken.update([down.name, linear.name])
    return True


def _one_element(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and all(type(d) is int for d in value.shape) and value.numel() == 1


def _add_norms(plan: ShardingPlan, inner: List[fx.Node]) -> None:
    """The norms over all hidden features inside a split MLP (``_elementwise_region`` lets only
    those in): each rank's slice of the weight, squares summed over ranks."""
    plan.decisions.extend(NormShard(n.name, str(n.args[1].target)) for n in inner
                          if n.target == ad.torch_rmsnorm.default)


def _elementwise_region(gm: fx.GraphModule, start: fx.Node, features: int
                        ) -> Tuple[List[fx.Node], List[fx.Node], List[Cut]]:
    """The element-wise nodes between ``start`` and the linears it is computed from (``inner``,
    ``leaves``), every value ``features`` wide, and the blocks cut out of a wider projection on the
    way (``cuts``: a fused ``[gate | up]``); empty lists when anything else is on the way."""
    inner: List[fx.Node] = []
    leaves: List[fx.Node] = []
    cuts: List[Cut] = []
    stack, seen = [start], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        value = node.meta.get("val")
        if value is None or value.dim() == 0 or int(value.shape[-1]) != features:
            return [], [], []
        if is_linear(node):
            leaves.append(node)
            continue
        cut = block_cut(node)
        if cut is not None:
            cuts.append(cut)
            continue
        if all_features_norm(node):  # BitNet's ffn_sub_norm: its weight splits with the features (NormShard)
            inner.append(node)
            stack.append(node.args[0])
            continue
        if node.op != "call_function" or node.target not in ELEMENTWISE:
            return [], [], []
        inner.append(node)
        for a in (*node.args, *node.kwargs.values()):
            if not isinstance(a, fx.Node):
                continue  # a Python scalar, a dtype
            if a.op == "get_attr" and getattr(get_attr_value(gm, a), "numel", lambda: 0)() == 1:
                continue  # a scalar tensor constant: the same on every slice
            if _one_element(a):
                continue  # a computed scalar (xIELU's ``beta + softplus(alpha)``): one value for every feature; one
                # computed from this region's values would be a reader outside it, which plan_mlp refuses
            stack.append(a)
    if cuts and leaves:
        return [], [], []  # a fused projection beside separate ones: not followed
    return inner, leaves, cuts


def plan_lm_head(gm: fx.GraphModule, plan: ShardingPlan, embeddings: Set[str] = frozenset()) -> bool:
    """The vocab-parallel LM head: the linear that produces the logits (through single-input ops
    such as a soft-cap) split by vocabulary rows, its slices all-gathered. A head tied to the
    embedding is split only when that embedding is (its target in ``embeddings``): both then read
    the same slice of the one table. Left whole: a tied head whose embedding stays whole, or a
    vocabulary the world size does not divide."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    node = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    while isinstance(node, fx.Node) and node.op == "call_function" and not is_linear(node):
        inputs = node.all_input_nodes
        node = inputs[0] if len(inputs) == 1 else None
    if not isinstance(node, fx.Node) or not is_linear(node):
        return False
    weights = linear_weights(gm, node)
    if weights is None:
        return False
    readers = [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == weights[0] for u in n.users]
    tied = len(readers) != 1
    vocab = int(node.meta["val"].shape[-1]) if "val" in node.meta else 0
    if tied and weights[0] not in embeddings or vocab % plan.world_size:
        logger.info("LM head kept whole on every rank: %s", "tied to an embedding kept whole" if tied else
                    f"vocabulary {vocab} not divisible by world_size {plan.world_size}")
        return False
    split = linear_split(gm, node, rows=False, parts=plan.world_size)
    if split is None:
        logger.info("LM head kept whole on every rank: its quantized weight does not split into whole blocks")
        return False
    plan.decisions.append(ColumnShard(node.name, split[0], split[1], gather=True, extra=split[2]))
    return True


def plan_embedding(gm: fx.GraphModule, node: fx.Node, plan: ShardingPlan) -> bool:
    """The vocab-parallel embedding for one ``aten.embedding`` of a stored table whose rows the
    world size divides (else it stays whole, logged)."""
    target = weight_target(gm, node.args[0])
    if target is None:
        return False
    vocab = int(get_attr_value(gm, node.args[0]).shape[0])
    if vocab % plan.world_size:
        logger.info("embedding %s kept whole on every rank: %d rows, world_size %d", target, vocab, plan.world_size)
        return False
    rows = vocab // plan.world_size
    plan.decisions.append(EmbeddingShard(node.name, target, plan.rank * rows, (plan.rank + 1) * rows))
    return True


# state-layer ops -> their planner (None when planned, else why the layer stays whole)
_STATE_PLANNERS = {ad.torch_gated_delta_rule.default: plan_gated_delta_rule,
                   ad.torch_gated_delta_rule_channelwise.default: plan_gated_delta_rule,
                   ad.torch_ssm.default: plan_mamba2, ad.torch_ssm_mamba1.default: plan_mamba}
# state ops whose layers stay replicated on every rank (correct; listed in the warning so it says so)
_UNPLANNED_STATE_OPS = (ad.torch_delta_rule.default, ad.torch_wkv.default, ad.torch_mlstm.default,
                        ad.torch_diagonal_recurrence.default, ad.torch_cca_conv.default)


def detect(gm: fx.GraphModule, world_size: int, rank: int, lm_head: bool = True,
           embedding: bool = True) -> ShardingPlan:
    plan = ShardingPlan(world_size=world_size, rank=rank)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (ad.torch_attention.default, ad.torch_linear_attention.default):
            plan_attention(gm, node, plan)
        elif node.target == ad.torch_swiglu_mlp.default:
            plan_swiglu(gm, node, plan)
        elif node.target == ad.torch_moe.default or node.target in QUANT_MOE_OPS:
            plan_moe(gm, node, plan)
        elif node.target == ad.torch_moe_fused.default or node.target in STACKED_QUANT_MOE_OPS:
            plan_stacked_moe(gm, node, plan)
        elif node.target == ad.torch_mla.default:
            plan_mla(gm, node, plan)
        elif node.target in _STATE_PLANNERS:
            reason = _STATE_PLANNERS[node.target](gm, node, plan)
            if reason is not None:
                plan.whole_layers[node.name] = reason
        elif node.target in _UNPLANNED_STATE_OPS:
            plan.whole_layers[node.name] = f"no tensor-parallel plan for {node.target.name()} yet"
        elif node.target == ad.torch_causal_conv1d.default:
            plan_short_conv(gm, node, plan)  # LFM2's; a Mamba or Gated DeltaNet conv is its layer's planner's
        elif node.target == aten.embedding.default and embedding:
            plan_embedding(gm, node, plan)
    if lm_head:
        plan_lm_head(gm, plan, {d.weight for d in plan.decisions if isinstance(d, EmbeddingShard)})
    taken = {d.node for d in plan.decisions}
    for node in list(gm.graph.nodes):
        if is_linear(node):
            plan_mlp(gm, node, plan, taken)
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
        plan = detect(gm, ctx.world_size, ctx.rank, lm_head=cfg.shard_lm_head, embedding=cfg.shard_embedding)
        logger.info("sharding plan for rank %d of %d: %s", ctx.rank, ctx.world_size, plan.summary())
        if plan.whole_layers and ctx.rank == 0:
            first, why = next(iter(plan.whole_layers.items()))
            logger.warning("%d attention or state layer(s) stay whole on every rank (each rank computes all their "
                           "heads: the same answer, without the speed-up or memory saving of a split), starting with "
                           "%s: %s",
                           len(plan.whole_layers), first, why)
        ctx.sharding_plan = plan
        return TransformInfo(num_matches=len(plan.decisions), is_clean=True, has_valid_shapes=True)
