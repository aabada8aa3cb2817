"""``match_repeat_kv`` (pattern_matcher): drop the GQA expansion in front of ``torch_attention``.

Before (HF ``repeat_kv`` on bnsd k and v, then the layout swap to bsnd)::

    k_rep = reshape(expand(unsqueeze(k, 2), [b, n_kv, r, s, d]), [b, n_kv * r, s, d])
    o = autodeploy.torch_attention(q, transpose(k_rep, 1, 2), transpose(v_rep, 1, 2), ...)

After (``torch_attention`` handles GQA natively)::

    o = autodeploy.torch_attention(q, transpose(k, 1, 2), transpose(v, 1, 2), ...)

Only an expansion that repeats each kv head ``r`` times in place (``repeat_interleave``
order) is removed, and only when k and v use the same factor; a tiling expansion (``repeat``
order) is a different head assignment and stays.
"""

from typing import Any, Optional, Tuple

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph_utils import arg, eliminate_dead_code, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._attention_utils import is_transpose_12, swap_12

aten = torch.ops.aten


def _same(a: Any, b: Any) -> bool:
    return statically_known_true(a == b)


def peel_repeat_kv(node: Any, head_dim: int) -> Optional[Tuple[fx.Node, int]]:
    """``(base, repeats)`` if ``node`` is ``base`` with each head repeated along ``head_dim``."""
    if not is_op(node, (aten.reshape, aten.view, aten._unsafe_view)):
        return None
    expand = node.args[0]
    if not is_op(expand, aten.expand):
        return None
    unsq = expand.args[0]
    if not is_op(unsq, aten.unsqueeze):
        return None
    base = unsq.args[0]
    bv, ev, ov = base.meta.get("val"), expand.meta.get("val"), node.meta.get("val")
    if bv is None or ev is None or ov is None or bv.dim() != ov.dim():
        return None
    if arg(unsq, 1, "dim") % (bv.dim() + 1) != head_dim + 1:
        return None
    repeats = ev.shape[head_dim + 1]
    if not isinstance(repeats, int):
        return None
    for d in range(bv.dim()):
        expected = bv.shape[d] * repeats if d == head_dim else bv.shape[d]
        if not _same(ov.shape[d], expected):
            return None
    return base, repeats


def _unexpanded(node: Any) -> Optional[Tuple[fx.Node, int, bool]]:
    """For a bsnd k/v input: ``(bnsd_or_bsnd_base, repeats, transposed)``."""
    if is_transpose_12(node):
        found = peel_repeat_kv(node.args[0], head_dim=1)
        return (found[0], found[1], True) if found else None
    found = peel_repeat_kv(node, head_dim=2)
    return (found[0], found[1], False) if found else None


class MatchRepeatKVConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("match_repeat_kv")
class MatchRepeatKV(BaseTransform):
    config_class = MatchRepeatKVConfig
    run_after = ("match_sdpa_attention", "match_eager_attention")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = 0
        graph = gm.graph
        for node in list(graph.nodes):
            if not is_op(node, torch.ops.autodeploy.torch_attention):
                continue
            k_found, v_found = _unexpanded(node.args[1]), _unexpanded(node.args[2])
            if k_found is None or v_found is None or k_found[1] != v_found[1] or k_found[2] != v_found[2]:
                continue
            new_kv = []
            for base, _, transposed in (k_found, v_found):
                if transposed:
                    with graph.inserting_before(node):
                        base = swap_12(graph, base)
                new_kv.append(base)
            node.args = (node.args[0], new_kv[0], new_kv[1], *node.args[3:])
            count += 1
        if count:
            eliminate_dead_code(gm)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
