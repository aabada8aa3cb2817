"""``fuse_rope_into_trtllm_attention`` (cache_init): the RoPE in front of a cached attention op moves into it.

Before (after ``optimize_rope``: bsnd, cos/sin rows looked up in tables computed once)::

    r = autodeploy.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)
    o = autodeploy.sdpa_cached_attention_with_cache(getitem(r, 0), getitem(r, 1), v, ..., k_cache_0, v_cache_0, ...)

After (no RoPE node; the op ropes q, and k before writing it to the cache)::

    o = autodeploy.sdpa_cached_attention_with_cache(q, k, v, ..., rope_cos=cos, rope_sin=sin,
                                                    rope_style=ROPE_ROTATE_HALF, rotary_dim=0)

Also taken: the RoPE still in ``bnsd`` (its outputs transposed back for the op), and partial
rotary (Phi-3 style: the first ``rotary_dim`` features of each head roped, the rest passed
through and concatenated back), where the fusion also drops the slices, the concatenation and
its copy of q and k::

    r = rope(slice(T_q, -1, 0, rd), slice(T_k, -1, 0, rd), cos, sin, 1)          # T_q = transpose(q, 1, 2)
    q2 = transpose(cat([getitem(r, 0), slice(T_q, -1, rd, end)], -1), 1, 2)      # (k2 alike)
    ->  cached(q, k, v, ..., rope_cos=cos, rope_sin=sin, rope_style=..., rotary_dim=rd)

Rotate-half, interleaved and complex-frequency RoPE are taken. Left alone: a RoPE output (or the
slices and concatenation around it) with any other reader, q and k roped by different nodes, a
cached op that already carries a RoPE. Numerics are unchanged: the op applies the same
canonical RoPE op to the same tensors.
"""

import operator
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import fx

from ...ops.rope import ROPE_COMPLEX, ROPE_INTERLEAVED, ROPE_NONE, ROPE_ROTATE_HALF
from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._attention_utils import is_transpose_12

ad = torch.ops.autodeploy
aten = torch.ops.aten
CACHED_ATTENTION = (ad.torch_cached_attention_with_cache, ad.sdpa_cached_attention_with_cache)
ROPE_STYLES: Dict[object, int] = {ad.torch_rope_with_explicit_cos_sin.default: ROPE_ROTATE_HALF,
                                  ad.torch_rope_with_qk_interleaving.default: ROPE_INTERLEAVED,
                                  ad.torch_rope_with_complex_freqs.default: ROPE_COMPLEX}
_LAST = (-1, 3)  # the feature dim of a rank-4 q/k


class FuseRopeIntoAttentionConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT


@dataclass(frozen=True)
class _Roped:
    """One attention input traced back to its RoPE: the unroped tensor (``bnsd`` says whether it
    still needs a transpose to bsnd), the RoPE node and the rotary width (0: the whole head)."""

    source: fx.Node
    rope: fx.Node
    rotary_dim: int
    bnsd: bool


def _one_user(*nodes: fx.Node) -> bool:
    return all(len(n.users) == 1 for n in nodes)


def _is_slice(node: object, start: int, end: Optional[int] = None) -> bool:
    if not is_op(node, aten.slice.Tensor) or node.args[1] not in _LAST or node.args[2] != start:  # type: ignore[union-attr]
        return False
    stop = node.args[3]  # type: ignore[union-attr]
    return stop >= node.args[0].meta["val"].shape[-1] if end is None else stop == end  # type: ignore[union-attr]


def _trace(node: fx.Node, index: int) -> Optional[_Roped]:
    """``node`` (the op's q for ``index`` 0, k for 1) as ``_Roped``, or None."""
    bnsd = is_transpose_12(node) and _one_user(node)
    inner = node.args[0] if bnsd else node
    if is_op(inner, operator.getitem):
        rope, rd, source = inner.args[0], 0, None
        if inner.args[1] != index or not _one_user(inner) or rope.target not in ROPE_STYLES:
            return None
        source = rope.args[index]
    elif is_op(inner, aten.cat.default) and _one_user(inner) and len(inner.args[0]) == 2 and \
            arg(inner, 1, "dim", 0) in _LAST:
        item, passed = inner.args[0]
        if not (is_op(item, operator.getitem) and item.args[1] == index and _one_user(item, passed)):
            return None
        rope = item.args[0]
        if rope.target not in ROPE_STYLES:
            return None
        rotated = rope.args[index]
        rd = int(rotated.meta["val"].shape[-1])
        if not (_is_slice(rotated, 0, rd) and _is_slice(passed, rd) and passed.args[0] is rotated.args[0]
                and _one_user(rotated)):
            return None
        source = rotated.args[0]
    else:
        return None
    complex_freqs = ROPE_STYLES[rope.target] == ROPE_COMPLEX
    unsqueeze = arg(rope, 3 if complex_freqs else 4, "unsqueeze_dim", 2 if complex_freqs else 1)
    if unsqueeze != (1 if bnsd else 2):
        return None  # the RoPE's layout is not the one this path has
    return _Roped(source, rope, rd, bnsd)


@TransformRegistry.register("fuse_rope_into_trtllm_attention")
class FuseRopeIntoAttention(BaseTransform):
    config_class = FuseRopeIntoAttentionConfig
    run_after = ("insert_cached_attention", "optimize_rope", "initialize_mrope_delta_cache")  # mRoPE shifts the cos/sin the op then reads

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        nodes = [n for n in gm.graph.nodes if is_op(n, CACHED_ATTENTION)]
        if not nodes:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason="no cached attention op")
        count = sum(self._fuse(gm.graph, node) for node in nodes)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)

    @staticmethod
    def _fuse(graph: fx.Graph, node: fx.Node) -> int:
        if node.kwargs.get("rope_style", ROPE_NONE) != ROPE_NONE or len(node.args) > 17:
            return 0
        q, k = _trace(node.args[0], 0), _trace(node.args[1], 1)
        if q is None or k is None or q.rope is not k.rope or q.rotary_dim != k.rotary_dim or q.bnsd != k.bnsd:
            return 0
        rope = q.rope
        style = ROPE_STYLES[rope.target]
        cos, sin = (rope.args[2], None) if style == ROPE_COMPLEX else (rope.args[2], rope.args[3])
        sources = [q.source, k.source]
        if q.bnsd:
            with graph.inserting_before(node):
                sources = [graph.call_function(aten.transpose.int, (s, 1, 2)) for s in sources]
        node.args = (*sources, *node.args[2:])
        node.kwargs = {**node.kwargs, "rope_cos": cos, "rope_sin": sin, "rope_style": style,
                       "rotary_dim": q.rotary_dim}
        return 1
