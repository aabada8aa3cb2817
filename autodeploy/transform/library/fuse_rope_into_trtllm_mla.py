"""``fuse_rope_into_trtllm_mla`` (cache_init): the RoPE in front of a cached MLA op moves into it.

Before (what the MLA export route and ``insert_cached_mla_attention`` leave; ``q`` is HF's query
``cat(q_nope, roped q_rot)`` in ``bnsd``, sliced back apart for the op)::

    r = autodeploy.torch_rope_with_qk_interleaving(q_rot, k_rot, cos, sin, 1)       # bnsd
    q = aten.cat([q_pass, getitem(r, 0)], -1)
    o = autodeploy.sdpa_cached_mla_with_cache(slice(transpose(q, 1, 2), 3, 0, d_nope),
                                              slice(transpose(q, 1, 2), 3, d_nope, end), c_kv,
                                              transpose(getitem(r, 1), 1, 2), W_kv, ..., mla_cache, scale)

After (no RoPE node and no copy of the query; the op ropes ``q_pe`` and ``kpe`` itself, ``kpe``
as it is written to the cache)::

    o = autodeploy.sdpa_cached_mla_with_cache(transpose(q_pass, 1, 2), transpose(q_rot, 1, 2), c_kv,
                                              transpose(k_rot, 1, 2), W_kv, ..., mla_cache, scale,
                                              cos, sin, ROPE_INTERLEAVED)

The cos/sin rows are the ones the RoPE node read (with ``optimize_rope``, lookups into tables
computed once at build). Rotate-half, interleaved and complex-frequency RoPE are taken, on the
``bnsd`` tensors HF's MLA code ropes. Left alone: a RoPE output with any other reader,
a query that is not the concatenation of its nope and rope parts, a cached op that already
carries a RoPE.
"""

import operator
from typing import Dict, Optional, Tuple

import torch
from torch import fx

from ...ops.rope import ROPE_COMPLEX, ROPE_INTERLEAVED, ROPE_NONE, ROPE_ROTATE_HALF
from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._attention_utils import is_transpose_12

ad = torch.ops.autodeploy
aten = torch.ops.aten
CACHED_MLA = (ad.torch_cached_mla_with_cache, ad.sdpa_cached_mla_with_cache)
ROPE_STYLES: Dict[object, int] = {ad.torch_rope_with_explicit_cos_sin.default: ROPE_ROTATE_HALF,
                                  ad.torch_rope_with_qk_interleaving.default: ROPE_INTERLEAVED,
                                  ad.torch_rope_with_complex_freqs.default: ROPE_COMPLEX}
_Q_NOPE, _Q_PE, _KPE, _ROPE_ARGS = 0, 1, 3, 13  # positions in the cached MLA op's arguments


class FuseRopeIntoMLAConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT


@TransformRegistry.register("fuse_rope_into_trtllm_mla")
class FuseRopeIntoMLA(BaseTransform):
    config_class = FuseRopeIntoMLAConfig
    run_after = ("insert_cached_mla_attention", "optimize_rope", "initialize_mrope_delta_cache")  # mRoPE shifts the cos/sin the op then reads

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        nodes = [n for n in gm.graph.nodes if is_op(n, CACHED_MLA)]
        if not nodes:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason="no cached MLA op")
        count = sum(self._fuse(gm.graph, node) for node in nodes)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)

    @staticmethod
    def _fuse(graph: fx.Graph, node: fx.Node) -> int:
        if arg(node, _ROPE_ARGS + 2, "rope_style", ROPE_NONE) != ROPE_NONE:
            return 0
        query = _split_query(node.args[_Q_NOPE], node.args[_Q_PE])
        if query is None:
            return 0
        q_pass, q_roped = query
        rope = _rope_of(q_roped, node.args[_KPE])
        if rope is None:
            return 0
        style = ROPE_STYLES[rope.target]
        complex_freqs = style == ROPE_COMPLEX
        if arg(rope, 3 if complex_freqs else 4, "unsqueeze_dim", 2 if complex_freqs else 1) != 1:
            return 0  # the RoPE of HF's MLA code runs on bnsd tensors
        q_rot, k_rot = rope.args[0], rope.args[1]
        cos, sin = (rope.args[2], None) if complex_freqs else (rope.args[2], rope.args[3])
        with graph.inserting_before(node):
            q_nope, q_pe, kpe = (graph.call_function(aten.transpose.int, (x, 1, 2)) for x in (q_pass, q_rot, k_rot))
        args = list(node.args) + [None, None, ROPE_NONE][max(0, len(node.args) - _ROPE_ARGS):]
        args[_Q_NOPE], args[_Q_PE], args[_KPE] = q_nope, q_pe, kpe
        args[_ROPE_ARGS:_ROPE_ARGS + 3] = [cos, sin, style]  # a DSA topk_indices after them stays
        node.args = tuple(args)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("rope_cos", "rope_sin", "rope_style")}
        return 1


def _split_query(q_nope: fx.Node, q_pe: fx.Node) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(q_pass, q_roped)`` in ``bnsd`` when the op's q_nope / q_pe are the two slices of
    ``transpose(cat([q_pass, q_roped], -1), 1, 2)`` at the concatenation's boundary."""
    if not (is_op(q_nope, aten.slice.Tensor) and is_op(q_pe, aten.slice.Tensor)):
        return None
    src = q_nope.args[0]
    if q_pe.args[0] is not src or not is_transpose_12(src) or len(src.users) != 2:
        return None
    cat = src.args[0]
    if not is_op(cat, aten.cat.default) or len(cat.users) != 1 or len(cat.args[0]) != 2:
        return None
    rank = cat.meta["val"].dim()
    if arg(cat, 1, "dim", 0) not in (-1, rank - 1):
        return None
    q_pass, q_roped = cat.args[0]
    width = q_pass.meta["val"].shape[-1]
    last = (-1, rank - 1)
    if (q_nope.args[1] not in last or q_nope.args[2] != 0 or q_nope.args[3] != width or q_pe.args[1] not in last
            or q_pe.args[2] != width or q_pe.args[3] < cat.meta["val"].shape[-1]):
        return None
    return q_pass, q_roped


def _rope_of(q_roped: fx.Node, kpe: fx.Node) -> Optional[fx.Node]:
    """The RoPE node whose two outputs are ``q_roped`` (bnsd) and ``kpe`` (its bsnd transpose), each
    read there only."""
    if not is_transpose_12(kpe) or len(kpe.users) != 1:
        return None
    q_item, k_item = q_roped, kpe.args[0]
    if not (is_op(q_item, operator.getitem) and is_op(k_item, operator.getitem)):
        return None
    rope = q_item.args[0]
    if k_item.args[0] is not rope or rope.target not in ROPE_STYLES or (q_item.args[1], k_item.args[1]) != (0, 1):
        return None
    if len(q_item.users) != 1 or len(k_item.users) != 1:
        return None
    return rope
