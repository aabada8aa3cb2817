"""``match_eager_attention`` (pattern_matcher): HF's eager attention math -> ``torch_attention``.

Before (bnsd; optional pieces in brackets)::

    s = matmul(q, transpose(k, 2, 3)) [* scale | / d]  (also in place: s /= d)
    [s = tanh(s / cap) * cap]                       # Gemma-2 soft-capping
    [s = s + mask]
    p = softmax(s, -1 [, f32]) [-> to(q.dtype)] [-> dropout(p=0 / train=False)]
    o = matmul(p, v)                                # [b, n, s, d]

After::

    o_bsnd = autodeploy.torch_attention(q_bsnd, k_bsnd, v_bsnd, mask|None, 0.0, causal, scale, None, window, cap)

Intermediate results must have no other users (a graph that also returns the probabilities
keeps its eager math). A softmax over another dim, or a real dropout, is left alone.
"""

from typing import Any, Optional, Tuple

import torch
from torch import fx

from ..graph_utils import arg, eliminate_dead_code, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._attention_utils import all_rank4, emit_attention_bnsd, read_mask

aten = torch.ops.aten
CASTS = (aten.to, aten._to_copy, torch.ops.prims.convert_element_type)


def _only_user(node: Any, user: fx.Node) -> bool:
    return isinstance(node, fx.Node) and list(node.users) == [user]


def _last_dim(node: fx.Node, dim: int) -> bool:
    v = node.meta.get("val")
    return v is not None and dim % v.dim() == v.dim() - 1


def _peel_probs(p: Any, consumer: fx.Node) -> Optional[fx.Node]:
    """Walk back from the second matmul's input through dropout/cast to the softmax."""
    while isinstance(p, fx.Node) and _only_user(p, consumer):
        if is_op(p, aten.dropout):
            if arg(p, 1, "p", 0.0) != 0.0 and arg(p, 2, "train", False):
                return None
        elif is_op(p, CASTS):
            pass
        elif is_op(p, (aten.softmax.int, aten._softmax)):
            return p if _last_dim(p.args[0], arg(p, 1, "dim")) else None
        else:
            return None
        consumer, p = p, p.args[0]
    return None


def _scale_of(node: fx.Node, allow_inplace: bool = False) -> Tuple[fx.Node, Optional[float]]:
    """``(inner, scale)`` for ``inner * c`` / ``inner / c`` with a Python number c. The in-place
    forms (Falcon's ``scores /= sqrt(d)``) count, where allowed, when ``inner`` has no other
    reader, so the mutation is invisible (not for q: the mutated q would still be read)."""
    other = arg(node, 1, "other") if isinstance(node, fx.Node) else None
    if not isinstance(other, (int, float)):
        return node, None
    inner, c = node.args[0], float(other)
    if is_op(node, (aten.mul_, aten.div_)) and not (allow_inplace and _only_user(inner, node)):
        return node, None
    if is_op(node, (aten.mul, aten.mul_)):
        return inner, c
    if is_op(node, (aten.div, aten.div_)) and c != 0:
        return inner, 1.0 / c
    return node, None


def _peel_softcap(s: fx.Node) -> Tuple[fx.Node, Optional[float]]:
    """``tanh(x / cap) * cap`` -> ``(x, cap)``."""
    if is_op(s, aten.mul) and isinstance(s.args[1], (int, float)) and is_op(s.args[0], aten.tanh):
        inner = s.args[0].args[0]
        if is_op(inner, aten.div) and inner.args[1] == s.args[1] and _only_user(inner, s.args[0]):
            return inner.args[0], float(s.args[1])
    return s, None


def _is_kt(node: Any) -> bool:
    if not is_op(node, aten.transpose.int):
        return False
    v = node.args[0].meta.get("val")
    rank = v.dim() if v is not None else 4
    return {arg(node, 1, "dim0") % rank, arg(node, 2, "dim1") % rank} == {rank - 2, rank - 1}


def match_eager(o: fx.Node) -> Optional[dict]:
    """The pieces of an eager attention ending at ``o = matmul(probs, v)``, or None."""
    probs, v = o.args
    softmax = _peel_probs(probs, o)
    if softmax is None:
        return None
    s = softmax.args[0]
    mask = None
    if is_op(s, aten.add) and _only_user(s, softmax):
        lhs, rhs = s.args
        for scores, candidate in ((lhs, rhs), (rhs, lhs)):
            if isinstance(scores, fx.Node) and _only_user(scores, s) and not is_op(scores, aten.add):
                s, mask = scores, candidate
                break
    elif not _only_user(s, softmax):
        return None
    s, cap = _peel_softcap(s)
    scaled = s
    s, scale = _scale_of(s, allow_inplace=True)
    inplace = [scaled] if scale is not None and is_op(scaled, (aten.mul_, aten.div_)) else []
    if not is_op(s, aten.matmul) or not _is_kt(s.args[1]) or len(s.users) != 1:
        return None
    q, k = s.args[0], s.args[1].args[0]
    if not all_rank4(q, k, v):
        return None
    if scale is None:
        q, scale = _scale_of(q)  # some models scale q before the product
        scale = 1.0 if scale is None else scale
    return {"q": q, "k": k, "v": v, "mask": mask, "scale": scale, "logit_cap": cap, "inplace": inplace}


class MatchEagerConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("match_eager_attention")
class MatchEagerAttention(BaseTransform):
    config_class = MatchEagerConfig
    run_after = ("cleanup_noop_cast", "cleanup_noop_slice", "cleanup_noop_view")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = 0
        inplace: list = []
        for node in reversed(list(gm.graph.nodes)):
            if node._erased or not is_op(node, aten.matmul) or len(node.args) != 2:
                continue
            found = match_eager(node)
            if found is None:
                continue
            mask, is_causal, window = read_mask(found["mask"])
            emit_attention_bnsd(
                gm.graph, node, found["q"], found["k"], found["v"],
                mask=mask, is_causal=is_causal, scale=found["scale"], sliding_window=window,
                logit_cap=found["logit_cap"],
            )
            gm.graph.erase_node(node)
            count += 1
            inplace.extend(found["inplace"])
        if count:
            eliminate_dead_code(gm)
            # DCE keeps mutating ops: an in-place scale nobody reads any more goes by hand
            for scaled in inplace:
                if not scaled.users:
                    gm.graph.erase_node(scaled)
            eliminate_dead_code(gm)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
