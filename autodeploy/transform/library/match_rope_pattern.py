"""``match_rope_pattern`` (pattern_matcher): RoPE subgraphs -> ``torch_rope_*`` (q and k together).

Before (rotate-half, Llama and most models; ``d2 = head_dim // 2``)::

    c = unsqueeze(cos, 1); s = unsqueeze(sin, 1)
    q2 = add(mul(q, c), mul(cat([neg(q[..., d2:]), q[..., :d2]], -1), s))      # same for k

After::

    q2, k2 = autodeploy.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 1)

Also: GPT-OSS's halves with half-width tables (``x1, x2 = chunk(x, 2, -1); cat([x1 * c - x2 * s,
x2 * c + x1 * s])``: rotate-half with tables ``cat([c, c])`` / ``cat([s, s])``, which the rewrite
builds; exact, since ``a - b`` is ``a + (-b)``) -> ``torch_rope_with_explicit_cos_sin``;
DeepSeek's interleaved pairs (``q[..., 0::2]``, ``q[..., 1::2]`` rotated by half-width
cos/sin tables) -> ``torch_rope_with_qk_interleaving`` (on those half tables, exact for any
table); Llama-4's complex form (``view_as_complex(q) *
freqs_cis``) -> ``torch_rope_with_complex_freqs``. Partial rotary works unchanged: q is then
the rotary slice. Near misses (a split other than the middle, q and k with different
tables, a different unsqueeze dim than the replacement's) are left alone.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ..pattern_matcher import PatternSet

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match

aten = torch.ops.aten
INT64_MAX = 2**63 - 1


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _explicit(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _interleaved(q, k, cos, sin):
    # cos/sin here are the half-width (one angle per pair) tables, e.g. HF's cos[..., :d//2]
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_out = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_out = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_out, k_out


def _halves(q, k, cos, sin):
    # GPT-OSS: cos/sin are the half-width tables, applied to the two halves of each head
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q1, q2 = torch.chunk(q, 2, dim=-1)
    k1, k2 = torch.chunk(k, 2, dim=-1)
    q_out = torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=-1)
    k_out = torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin), dim=-1)
    return q_out, k_out


def _complex(q, k, freqs_cis):
    q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    k_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    freqs = freqs_cis.unsqueeze(2)
    q_out = torch.view_as_real(q_ * freqs).flatten(3)
    k_out = torch.view_as_real(k_ * freqs).flatten(3)
    return q_out.type_as(q), k_out.type_as(k)


def _complex_unshared(q, k, freqs_cis):
    """Llama-4 writes ``freqs_cis[:, :, None, :]`` once for q and once for k."""
    q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    k_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    q_out = torch.view_as_real(q_ * freqs_cis.unsqueeze(2)).flatten(3)
    k_out = torch.view_as_real(k_ * freqs_cis.unsqueeze(2)).flatten(3)
    return q_out.type_as(q), k_out.type_as(k)


def _unsqueeze_dim(match: Match) -> Optional[int]:
    """The (single) dim at which the pattern unsqueezed its cos/sin or freqs table."""
    dims = set()
    for node in match.nodes:
        if is_op(node, aten.unsqueeze):
            rank = node.meta["val"].dim()
            dims.add(arg(node, 1, "dim") % rank)
    return dims.pop() if len(dims) == 1 else None


def _looks_swapped(q: fx.Node, k: fx.Node, order: dict) -> bool:
    """The pattern is symmetric in q and k, so the matcher may bind them either way. Queries
    have at least as many heads as keys; with equal heads, HF computes q_proj first."""
    qv, kv = q.meta.get("val"), k.meta.get("val")
    if qv is not None and kv is not None and qv.dim() == kv.dim() == 4:
        heads = [d for d in range(4) if isinstance(qv.shape[d], int) and qv.shape[d] != kv.shape[d]]
        if heads:
            return qv.shape[heads[0]] < kv.shape[heads[0]]
    return order[q] > order[k]


def _rope_handler(op: Callable) -> Callable:
    """Replace the matched q/k outputs with one ``op(q, k, *tables, unsqueeze_dim)`` node."""

    def handler(match: Match, graph: fx.Graph, q: fx.Node, k: fx.Node, **tables: fx.Node) -> None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        old_q, old_k = match.output_nodes()
        if _looks_swapped(q, k, order):
            q, k, old_q, old_k = k, q, old_k, old_q
        inputs = [q, k, *tables.values()]
        anchor = max(inputs, key=lambda n: order[n])
        with graph.inserting_after(anchor):
            rope = graph.call_function(op, (*inputs, _unsqueeze_dim(match)))
        with graph.inserting_after(rope):
            q_out = graph.call_function(operator.getitem, (rope, 0))
            k_out = graph.call_function(operator.getitem, (rope, 1))
        old_q.replace_all_uses_with(q_out)
        old_k.replace_all_uses_with(k_out)
        match.erase_nodes()

    return handler


def _full_tables_handler(op: Callable) -> Callable:
    """``_rope_handler`` for half-width tables: the op gets ``cat([t, t], -1)`` of each."""
    base = _rope_handler(op)

    def handler(match: Match, graph: fx.Graph, q: fx.Node, k: fx.Node, cos: fx.Node, sin: fx.Node) -> None:
        full = []
        for table in (cos, sin):
            with graph.inserting_after(table):
                node = graph.call_function(aten.cat.default, ([table, table], -1))
            value = table.meta.get("val")
            if value is not None:
                node.meta["val"] = torch.cat([value, value], -1)
            full.append(node)
        base(match, graph, q, k, cos=full[0], sin=full[1])

    return handler


def _last_dim(node: fx.Node) -> Optional[int]:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(v.shape[-1]) if v is not None and isinstance(v.shape[-1], int) else None


def _norm_dim(dim: int, node: fx.Node) -> Optional[int]:
    v = node.meta.get("val")
    return dim % v.dim() if v is not None else None


def _check_structure(slice_kind: str) -> Callable[[Match], bool]:
    """Check what inductor's wildcards cannot: one unsqueeze dim, slice bounds, cat dim."""

    def check(match: Match) -> bool:
        if _unsqueeze_dim(match) is None or match.kwargs.get("q") is match.kwargs.get("k"):
            return False
        for node in match.nodes:
            if is_op(node, aten.slice.Tensor):
                src = node.args[0]
                if _norm_dim(arg(node, 1, "dim", 0), src) != src.meta["val"].dim() - 1:
                    return False
                size = _last_dim(src)
                start, end, step = arg(node, 2, "start", 0), arg(node, 3, "end", INT64_MAX), arg(node, 4, "step", 1)
                if size is None or size % 2:
                    return False
                first_half = start in (0, None) and end == size // 2 and step == 1
                if slice_kind == "half":
                    second_half = start == size // 2 and end in (size, INT64_MAX, None) and step == 1
                    ok = first_half or second_half
                else:  # "pairs": q[..., 0::2] / q[..., 1::2]
                    ok = start in (0, 1) and step == 2 and end in (size, INT64_MAX, None)
                if not ok:
                    return False
            elif is_op(node, aten.chunk) or is_op(node, aten.split):
                src = node.args[0]
                chunks = arg(node, 1, "chunks" if is_op(node, aten.chunk) else "split_size")
                size = _last_dim(src)
                if is_op(node, aten.split) and size is not None:
                    chunks = size // chunks if isinstance(chunks, int) and chunks and size % chunks == 0 else None
                if _norm_dim(arg(node, 2, "dim", 0), src) != src.meta["val"].dim() - 1 or chunks != 2:
                    return False
                if size is None or size % 2:
                    return False
            elif is_op(node, aten.reshape) and slice_kind == "complex":
                src, out = node.args[0].meta["val"], node.meta["val"]
                if out.dim() != src.dim() + 1 or out.shape[-1] != 2 or out.shape[-2] * 2 != src.shape[-1]:
                    return False
                if not all(statically_known_true(a == b) for a, b in zip(out.shape[:-2], src.shape[:-1])):
                    return False
            elif is_op(node, aten.flatten) and slice_kind == "complex":
                src, out = node.args[0].meta["val"], node.meta["val"]
                if out.dim() != src.dim() - 1 or out.shape[-1] != src.shape[-1] * src.shape[-2]:
                    return False
            elif is_op(node, aten.cat):
                inputs = node.args[0]
                if _norm_dim(arg(node, 1, "dim", 0), inputs[0]) != inputs[0].meta["val"].dim() - 1:
                    return False
        return True

    return check


_PATTERNS: Optional[PatternSet] = None


def rope_patterns() -> PatternSet:
    global _PATTERNS
    if _PATTERNS is None:
        ops = torch.ops.autodeploy
        ps = PatternSet("match_rope_pattern")
        for dtype in (torch.float32, torch.bfloat16):
            # The unsqueeze dim is a wildcard in the pattern: one trace serves bnsd and bsnd.
            q, k = torch.randn(2, 4, 3, 8, dtype=dtype), torch.randn(2, 2, 3, 8, dtype=dtype)
            cos, sin = torch.randn(2, 3, 8, dtype=dtype), torch.randn(2, 3, 8, dtype=dtype)
            ps.add(_explicit, [q, k, cos, sin], handler=_rope_handler(ops.torch_rope_with_explicit_cos_sin.default),
                   extra_check=_check_structure("half"))
            half_cos, half_sin = cos[..., :4].contiguous(), sin[..., :4].contiguous()
            ps.add(_halves, [q, k, half_cos, half_sin],
                   handler=_full_tables_handler(ops.torch_rope_with_explicit_cos_sin.default),
                   extra_check=_check_structure("half"))
            ps.add(_interleaved, [q, k, half_cos, half_sin],
                   handler=_rope_handler(ops.torch_rope_with_qk_interleaving.default),
                   extra_check=_check_structure("pairs"))
            q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
            freqs = torch.polar(torch.ones(2, 3, 4), torch.randn(2, 3, 4))
            for search in (_complex, _complex_unshared):
                ps.add(search, [q, k, freqs], handler=_rope_handler(ops.torch_rope_with_complex_freqs.default),
                       extra_check=_check_structure("complex"))
        _PATTERNS = ps
    return _PATTERNS


class MatchRopeConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("match_rope_pattern")
class MatchRopePattern(BaseTransform):
    config_class = MatchRopeConfig
    run_after = ("cleanup_noop_cast", "cleanup_noop_slice", "cleanup_assert_metadata")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = rope_patterns().apply(gm)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
