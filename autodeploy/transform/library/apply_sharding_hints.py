"""``apply_sharding_hints`` (sharding): plan tensor parallelism from the sharding the graph states.

A model written with ``autodeploy.torch_linear_with_hint`` says for each projection how it is
split (``tp_mode``), the smallest output slice a rank may hold (``tp_min_local_shape``) and what
kind of layer it belongs to (``layer_type``). Before, on rank r of n (n = 2 here)::

    q = linear_with_hint(x, Wq, None, "colwise", 16, "attention")      # 4 heads x 16
    k = linear_with_hint(x, Wk, None, "colwise", 16, "attention")      # 2 KV heads x 16
    a = autodeploy.torch_attention(view(q, [b, s, -1, 16]), view(k, ...), ...)
    y = linear_with_hint(reshape(a, [b, s, -1]), Wo, None, "rowwise", 1, "attention")
    g = linear_with_hint(h, Wg, None, "colwise", 1, "mlp") ...
    m = autodeploy.torch_moe(x, sel, w, [E0g, E1g, ...], ...)
    logits = linear_with_hint(z, W_lm, None, "colwise_gather", 1, "lm_head")

After: every hint op is a plain ``aten.linear`` (so the post-load fusions see ordinary linears),
and ``ctx.sharding_plan`` holds the *same* plan objects ``detect_sharding`` produces::

    q = linear(x, Wq)            # ColumnShard(q)
    k = linear(x, Wk)            # ColumnShard(k); parts/index replicate KV heads fewer than ranks
    y = linear(reshape(a), Wo)   # RowShard(o)      -> the executor adds the all-reduce
    m = autodeploy.torch_moe(...)                  # ExpertShard, when "moe" is sharded
    logits = linear(z, W_lm)     # ColumnShard(gather=True) -> the executor adds the all-gather

``sharding_transform_executor`` then applies that plan exactly as it applies a detected one: one
executor, one plan format, two ways to fill it. ``detect_sharding`` skips a graph this transform
planned (``SHARDING_HINTS_META``): the hints are the whole truth, so what they leave whole (a
``"none"`` hint, or a layer type not in ``shard_layers``) is not split behind the model's back.

At world size 1 the hints are only lowered. A column split the world size does not divide is
replicated where ``tp_min_local_shape`` allows it (n / parts ranks share each slice, the way
``detect_sharding`` replicates key/value heads), else a ``ConfigError`` lists the world sizes
that work; so is a row split the world size does not divide.
"""

from typing import Dict, List, Optional, Tuple

import torch
from pydantic import Field
from torch import fx

from ...ops.linear import TP_MODES
from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..graph_utils import arg, get_attr_value
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._sharding import (LAYOUT_OPS, SHARDING_HINTS_META, ColumnShard, RowShard, ShardingPlan, linear_weights,
                        literal_dims)
from .detect_sharding import plan_moe

ad = torch.ops.autodeploy
aten = torch.ops.aten
logger = get_logger(__name__)

HINT_OP = ad.torch_linear_with_hint.default


class ApplyShardingHintsConfig(TransformConfig):
    stage: Stage = Stage.SHARDING
    shard_layers: Optional[List[str]] = Field(
        default=None,
        description="Layer types (the hints' layer_type: attention, mlp, moe, lm_head, ...) to split across ranks; "
        "hinted linears of other types, and MoE layers unless 'moe' is listed, stay whole on every rank. "
        "Unset: every hinted layer.")


def read_hint(node: fx.Node) -> Tuple[str, int, str]:
    """The hint of a ``torch_linear_with_hint`` node (defaults where export dropped them); a
    ``ConfigError`` naming the allowed values for a mode that means nothing."""
    mode = arg(node, 3, "tp_mode", "none")
    min_local = arg(node, 4, "tp_min_local_shape", 1)
    layer_type = arg(node, 5, "layer_type", "")
    if mode not in TP_MODES:
        raise ConfigError(f"{node.name}: sharding hint tp_mode {mode!r} is not one of {list(TP_MODES)}")
    if not isinstance(min_local, int) or min_local < 1:
        raise ConfigError(f"{node.name}: sharding hint tp_min_local_shape must be an int >= 1, got {min_local!r}")
    return mode, min_local, str(layer_type)


def lower_hints(gm: fx.GraphModule) -> List[Tuple[fx.Node, Tuple[str, int, str]]]:
    """Replace every hint op by ``aten.linear`` (same inputs, same value); the new linears, in
    graph order, with the hint each carried."""
    lowered = []
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == HINT_OP]:
        hint = read_hint(node)
        bias = arg(node, 2, "bias")
        with gm.graph.inserting_before(node):
            linear = gm.graph.call_function(aten.linear.default,
                                            (node.args[0], node.args[1]) + ((bias,) if bias is not None else ()))
        linear.meta.update(node.meta)
        node.replace_all_uses_with(linear)
        gm.graph.erase_node(node)
        lowered.append((linear, hint))
    return lowered


def column_split(features: int, min_local: int, world_size: int, rank: int, what: str,
                 gather: bool) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """``(parts, index)`` of this rank's output slice (``(None, None)``: the rank's share of
    world_size), or None when the whole projection stays on every rank (one slice at most).

    A slice must keep at least ``min_local`` features: when world_size slices would be narrower,
    the output is cut into ``features // min_local`` slices, each held by world_size / parts
    ranks (the key/value heads of GQA with fewer heads than ranks). A gathered split cannot be
    replicated (the gather would repeat slices)."""
    if features % world_size == 0 and features // world_size >= min_local:
        return None, None
    if features <= min_local and not gather:
        return None  # one slice: the whole projection on every rank
    units = features // min_local if features % min_local == 0 else 0
    if not gather and units and world_size % units == 0:
        return (units, rank // (world_size // units)) if units > 1 else None
    works = [n for n in range(1, 65) if (features % n == 0 and features // n >= min_local)
             or (not gather and units and n % units == 0)]
    raise ConfigError(f"{what} has {features} output features (at least {min_local} a rank), which world_size "
                      f"{world_size} does not split{'' if gather else ' or replicate'}; world sizes that work: {works}")


def _layout_fixes(plan: ShardingPlan, linear: fx.Node, column: bool, divisor: int) -> None:
    """Literal feature/head counts in the views next to a split linear (after a column split, before
    a row split), divided by ``divisor`` like ``detect_sharding``'s; a model that writes -1 has none."""
    chain: List[fx.Node] = []
    node = linear
    if column:
        while len(node.users) == 1 and next(iter(node.users)).target in LAYOUT_OPS:
            node = next(iter(node.users))
            chain.append(node)
    else:
        node = linear.args[0]
        while isinstance(node, fx.Node) and node.target in LAYOUT_OPS and len(node.users) == 1:
            chain.append(node)
            node = node.args[0]
    val = linear.meta.get("val") if column else getattr(linear.args[0], "meta", {}).get("val")
    features = int(val.shape[-1]) if val is not None else -1
    for view in chain:
        shape = view.args[1] if len(view.args) > 1 else None
        head = shape[-1] if isinstance(shape, (list, tuple)) and shape and isinstance(shape[-1], int) else 0
        full = (features, features // head) if head > 0 and features % head == 0 else (features,)
        dims = literal_dims(view, full)
        if dims:
            plan.layout_fixes.setdefault(view.name, {}).update({d: divisor for d in dims})


def plan_hints(gm: fx.GraphModule, lowered: List[Tuple[fx.Node, Tuple[str, int, str]]], plan: ShardingPlan,
               shard_layers: Optional[List[str]]) -> None:
    """Add the plan objects the hints ask for (and, with "moe" sharded, expert parallelism for
    every ``torch_moe``)."""
    wanted = (lambda kind: True) if shard_layers is None else (lambda kind: kind in shard_layers)
    for linear, (mode, min_local, layer_type) in lowered:
        if mode == "none" or not wanted(layer_type):
            continue
        weights = linear_weights(gm, linear)
        what = f"{layer_type or 'hinted'} linear {linear.name}"
        if weights is None:
            raise ConfigError(f"{what} is hinted {mode!r} but its weight or bias is computed in the graph, not a "
                              "stored parameter a rank could load a slice of")
        weight = get_attr_value(gm, linear.args[1])
        what = f"{what} ({weights[0]})"
        if mode == "rowwise":
            features = int(weight.shape[1])
            if features % plan.world_size or features // plan.world_size < min_local:
                works = [n for n in range(1, 65) if features % n == 0 and features // n >= min_local]
                raise ConfigError(f"{what} has {features} input features (at least {min_local} a rank), which "
                                  f"world_size {plan.world_size} does not split; world sizes that work: {works}")
            plan.decisions.append(RowShard(linear.name, *weights))
            _layout_fixes(plan, linear, column=False, divisor=plan.world_size)
            continue
        gather = mode == "colwise_gather"
        split = column_split(int(weight.shape[0]), min_local, plan.world_size, plan.rank, what, gather)
        if split is None:
            logger.info("%s kept whole on every rank: %d output features, at least %d a rank", what,
                        int(weight.shape[0]), min_local)
            continue
        parts, index = split
        plan.decisions.append(ColumnShard(linear.name, *weights, parts=parts, index=index, gather=gather))
        _layout_fixes(plan, linear, column=True, divisor=parts or plan.world_size)
    if wanted("moe"):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target == ad.torch_moe.default:
                plan_moe(gm, node, plan)


@TransformRegistry.register("apply_sharding_hints")
class ApplyShardingHints(BaseTransform):
    config_class = ApplyShardingHintsConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        if not any(n.op == "call_function" and n.target == HINT_OP for n in gm.graph.nodes):
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                 reason="no sharding hints in the graph (detect_sharding decides)")
        cfg: ApplyShardingHintsConfig = self.config  # type: ignore[assignment]
        lowered = lower_hints(gm)
        kinds: Dict[str, int] = {}
        for _, (_, _, layer_type) in lowered:
            kinds[layer_type] = kinds.get(layer_type, 0) + 1
        unknown = sorted(set(cfg.shard_layers or ()) - set(kinds) - {"moe"})
        if unknown:
            logger.warning("apply_sharding_hints.shard_layers names %s, which no hint in the graph has (hinted: %s)",
                           unknown, sorted(kinds))
        gm.meta[SHARDING_HINTS_META] = True
        if ctx.world_size > 1:
            plan = ShardingPlan(world_size=ctx.world_size, rank=ctx.rank)
            plan_hints(gm, lowered, plan, cfg.shard_layers)
            logger.info("sharding plan from the graph's hints for rank %d of %d: %s", ctx.rank, ctx.world_size,
                        plan.summary())
            ctx.sharding_plan = plan
        else:
            logger.info("lowered %d hinted linears (world_size 1: nothing to split)", len(lowered))
        gm.recompile()
        # the lowered linears compute what the hint ops did, with the same shapes
        return TransformInfo(num_matches=len(lowered), is_clean=False, has_valid_shapes=True)
