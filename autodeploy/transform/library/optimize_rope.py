"""``optimize_rope`` (post_load_fusion): cos/sin tables computed once, RoPE in the attention layout.

Before (every forward recomputes the tables; q/k are transposed to bnsd and back)::

    cos, sin = <rotary subgraph>(position_ids)              # matmul, cat, cos, sin, ...
    q2, k2 = autodeploy.torch_rope_with_explicit_cos_sin(transpose(q, 1, 2), transpose(k, 1, 2), cos, sin, 1)
    attention(transpose(q2, 1, 2), transpose(k2, 1, 2), ...)

After::

    cos = aten.embedding(cos_table, position_ids); sin = aten.embedding(sin_table, position_ids)
    q2, k2 = autodeploy.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)     # bsnd, no transposes
    attention(q2, k2, ...)

The tables are the model's own rotary subgraph evaluated once for positions
``[0, max_position)`` at build time, so any RoPE scaling the model uses is kept exactly. Tables
that depend on anything but ``position_ids`` (e.g. dynamic NTK scaling on the sequence length)
are left alone, as is a RoPE whose outputs are used in bnsd layout.
"""

import operator
from typing import Dict, List, Optional, Set, Tuple

import torch
from pydantic import Field
from torch import fx

from ..graph_utils import arg, get_attr_value, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._attention_utils import is_transpose_12

aten = torch.ops.aten
ROPE = (torch.ops.autodeploy.torch_rope_with_explicit_cos_sin, torch.ops.autodeploy.torch_rope_with_qk_interleaving)


def _ancestors(node: fx.Node) -> Set[fx.Node]:
    seen: Set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for inp in n.all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                stack.append(inp)
    return seen


def _table_source(node: fx.Node, position_ids: fx.Node) -> bool:
    """True if ``node`` is computed from ``position_ids`` and constants only."""
    inputs = {n for n in _ancestors(node) | {node} if n.op == "placeholder"}
    return inputs == {position_ids}


def _evaluate(gm: fx.GraphModule, targets: List[fx.Node], position_ids: fx.Node, positions: torch.Tensor) -> List[torch.Tensor]:
    """Run the subgraph that produces ``targets`` with ``position_ids = positions``."""
    needed = set().union(*(_ancestors(t) for t in targets)) | set(targets)
    env: Dict[fx.Node, object] = {position_ids: positions}
    for node in gm.graph.nodes:
        if node not in needed or node in env:
            continue
        if node.op == "get_attr":
            env[node] = get_attr_value(gm, node)
        elif node.op == "call_function":
            args = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            env[node] = node.target(*args, **kwargs)
        else:
            raise RuntimeError(f"unexpected node {node.format_node()} in the rotary subgraph")
    return [env[t] for t in targets]


class OptimizeRopeConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    requires_shape_prop: bool = True
    expect_mem_change: bool = True  # the tables: max_position x head_dim x 2
    max_position: Optional[int] = Field(
        default=None, description="Table length; default: the deployment's max_seq_len (positions beyond it fail)."
    )


@TransformRegistry.register("optimize_rope")
class OptimizeRope(BaseTransform):
    config_class = OptimizeRopeConfig
    requires = ("load_weights",)
    run_after = ("match_rope_pattern",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: OptimizeRopeConfig = self.config  # type: ignore[assignment]
        graph = gm.graph
        position_ids = next((n for n in graph.nodes if n.op == "placeholder" and n.name == "position_ids"), None)
        ropes = [n for n in graph.nodes if is_op(n, ROPE)]
        if position_ids is None or not ropes:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason="no RoPE op in the model")
        count = self._cache_tables(gm, ropes, position_ids, cfg.max_position or ctx.max_seq_len)
        count += sum(self._to_bsnd(graph, node) for node in ropes)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)

    @staticmethod
    def _cache_tables(gm: fx.GraphModule, ropes: List[fx.Node], position_ids: fx.Node, max_position: int) -> int:
        """Replace each distinct (cos, sin) pair by lookups into tables computed now."""
        graph = gm.graph
        pairs: Dict[Tuple[fx.Node, fx.Node], List[fx.Node]] = {}
        for node in ropes:
            cos, sin = node.args[2], node.args[3]
            if _table_source(cos, position_ids) and _table_source(sin, position_ids):
                pairs.setdefault((cos, sin), []).append(node)
        count = 0
        for i, ((cos, sin), users) in enumerate(pairs.items()):
            cos_v = cos.meta["val"]
            if cos_v.dim() != 3 or cos_v.shape[0] != position_ids.meta["val"].shape[0]:
                continue  # tables shaped [b, s, d] per position
            device = position_ids.meta["val"].device
            positions = torch.arange(max_position, device=device)[None]
            with torch.no_grad():
                cos_t, sin_t = _evaluate(gm, [cos, sin], position_ids, positions)
            names = []
            for kind, table in (("cos", cos_t), ("sin", sin_t)):
                name = f"rope_{kind}_table_{i}"
                gm.register_buffer(name, table[0].contiguous(), persistent=False)
                names.append(name)
            anchor = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(anchor):
                lookups = []
                for name in names:
                    table = graph.get_attr(name)
                    lookups.append(graph.call_function(aten.embedding.default, (table, position_ids)))
            for node in users:
                node.replace_input_with(cos, lookups[0])
                node.replace_input_with(sin, lookups[1])
            count += 1
        return count

    @staticmethod
    def _to_bsnd(graph: fx.Graph, node: fx.Node) -> int:
        """``rope(transpose(q), transpose(k), ..., 1)`` whose outputs are only transposed back
        -> ``rope(q, k, ..., 2)``."""
        q, k = node.args[0], node.args[1]
        if arg(node, 4, "unsqueeze_dim", 1) != 1 or not (is_transpose_12(q) and is_transpose_12(k)):
            return 0
        getitems = list(node.users)
        if not all(is_op(g, operator.getitem) for g in getitems):
            return 0
        if not all(u and all(is_transpose_12(t) for t in u) for u in (list(g.users) for g in getitems)):
            return 0
        node.args = (q.args[0], k.args[0], node.args[2], node.args[3], 2)
        for g in getitems:
            for t in list(g.users):
                t.replace_all_uses_with(g)
                graph.erase_node(t)
        for t in (q, k):
            if not t.users:
                graph.erase_node(t)
        return 1
