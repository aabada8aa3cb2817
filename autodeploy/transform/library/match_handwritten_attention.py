"""``match_handwritten_attention`` (pattern_matcher): causal attention written out by hand -> ``torch_attention``.

GPT-Neo, CodeGen, OpenAI-GPT, XGLM, GPT-NeoX-Japanese, BLOOM and MPT do not call HF's attention
interface: each multiplies, masks and normalises the scores itself, in its own order, often on
``[b*n, s, d]`` views (``bmm``/``baddbmm``), with the causal mask as a ``where``/``masked_fill``
over a boolean buffer slice or as ``s * m + (1 - m) * -10000``, and BLOOM/MPT add an ALiBi bias.
``match_eager_attention`` reads only HF's own eager function (``s * scale + mask``), so these
models stayed uncached (``recompute`` mode). This transform reads their score expressions.

Before (one of the shapes it reads; bnsd, ``[b*n, ...]`` views optional, pieces in any order)::

    s  = matmul(q, transpose(k, -1, -2))          | bmm(q3, kT3) | baddbmm(bias3, q3, kT3, beta, alpha)
    s  = s * c | s / c                             # any number of positive scalings
    s  = where(bias[:, :, :s, :s], s, -3.4e38)     # bool tril buffer (GPT-Neo: also banded = window)
       | s + torch_causal_mask(...)                # the export route's additive causal mask
       | masked_fill(s, torch_causal_mask(...).bool(), min)          # MPT
       | s * m + (1 - m) * -10000                  # OpenAI-GPT, m a float tril buffer
       | max(s, finfo.min)                         # XGLM's clamp
    s  = s + repeat(slopes[:, None, None] * arange(s_kv), [b, 1, 1])   # ALiBi (BLOOM via baddbmm, MPT)
    p  = softmax(s, -1) [-> cast] [-> dropout(train=False)]
    o  = matmul(p, v) | view(bmm(p3, v3), [b, n, s, d])

After::

    o_bsnd = autodeploy.torch_attention(q_bsnd, k_bsnd, v_bsnd, None, 0.0, True, scale, None, window, None
                                        [, alibi_slopes=reshape(slopes, [n]) * c])

Rules (what makes the rewrite exact, else the attention is left alone):

* At least one causal mask must be found: the transform canonicalises causal decoder
  attention; a bidirectional or an arbitrary explicit mask is ``match_eager_attention``'s job.
  Several causal masks combine (GPT-Neo's local layers: the banded buffer sets the window).
* A mask's fill (times the scalings above it) must be at most -1e4: softmax gives those
  positions exactly 0 in fp32 (exp underflows), as the op's -inf does. A causal row always keeps
  its diagonal, so no row is fully masked.
* Buffer masks are read from their values (the factory's initial buffers at this stage): exactly
  ``tril`` (causal) or ``tril`` minus ``tril(-w)`` (window ``w``); anything else is left alone,
  and so is a persistent buffer, whose value the checkpoint could replace at weight load.
* ALiBi: a per-head constant times a step-1 ``arange`` along the keys, constant along the
  queries. HF adds ``slope * key_pos``; the op adds ``slope * (key_pos - query_pos)``: equal up to
  a per-row constant, which softmax cancels.
* Query and key lengths must be provably equal (these masks are top-left aligned, the op's
  bottom-right), scalings positive, dropout off, and every intermediate read only by the next.

Runs after ``match_eager_attention``, so graphs that one already canonicalises are unchanged.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...export.exporter import CONSTANT_VALUES
from ...utils.logging import get_logger
from ..graph_utils import arg, eliminate_dead_code, is_op, owner_of, val
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._attention_utils import emit_attention_bnsd

logger = get_logger(__name__)
aten = torch.ops.aten

CASTS = (aten.to, aten._to_copy, torch.ops.prims.convert_element_type)
VIEWS = (aten.view, aten.reshape, aten._unsafe_view)
ALIASES = (aten.detach, aten.detach_, aten.clone, aten.alias, aten.lift_fresh_copy)
# A fill this low is exactly 0 after softmax in fp32 (exp(-1e4) underflows), like the op's -inf.
MASKED_FILL_LIMIT = -1e4
# ``max(s, c)`` is a no-op for softmax only when c is below every real score: finfo.min-like.
CLAMP_LIMIT = -1e30


@dataclass
class _Scores:
    """What the score expression of one attention amounts to."""

    q: fx.Node  # bnsd
    k: fx.Node  # bnsd, or bsnd when ``k_bsnd``
    scale: float
    k_bsnd: bool = False
    windows: List[Optional[int]] = field(default_factory=list)  # one per causal mask found
    alibi: Optional[Tuple[fx.Node, float]] = None  # (per-head constant node, factor)


class _Reader:
    """Reads the score/probability expressions of one graph; knows its constants' values."""

    def __init__(self, gm: fx.GraphModule, ctx: PipelineContext):
        self.gm = gm
        factory = ctx.factory
        self.buffers: Dict[str, torch.Tensor] = dict(getattr(factory, "initial_buffers", None) or {})
        self.buffers.update(gm.meta.get(CONSTANT_VALUES) or {})
        # in-place no-ops (GPT-Neo's ``detach_`` of its fill constant) that DCE keeps: dropped by
        # hand once the rewrite leaves them unread
        self.inplace: List[fx.Node] = []

    # ---- constants ------------------------------------------------------------------------

    def constant(self, node: Any) -> Optional[torch.Tensor]:
        """The value of a constant input (number, buffer, lifted constant, 0-d ``full``), or None.

        At the pattern-matcher stage the graph's buffers are on the meta device; their values are
        the factory's initial buffers and the exporter's recorded constants, looked up by name."""
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            return torch.tensor(float(node))
        if not isinstance(node, fx.Node):
            return None
        if is_op(node, ALIASES):
            return self.constant(node.args[0])
        if is_op(node, aten.full) and list(node.args[0]) == [] and isinstance(node.args[1], (int, float)):
            return torch.tensor(float(node.args[1]))
        if node.op != "get_attr":
            return None
        target = str(node.target)
        try:
            owner, leaf = owner_of(self.gm, target)
            obj = getattr(owner, leaf)
        except AttributeError:
            return None
        if leaf in owner._buffers and leaf not in owner._non_persistent_buffers_set:
            return None  # a persistent buffer: the checkpoint may overwrite it at weight load
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            return obj.detach()
        return self.buffers.get(target)

    def scalar(self, node: Any) -> Optional[float]:
        value = self.constant(node)
        return float(value) if value is not None and value.numel() == 1 else None

    # ---- causal masks ---------------------------------------------------------------------

    def _buffer_window(self, node: Any) -> Tuple[bool, Optional[int]]:
        """``(found, window)`` for a slice ``buf[..., :s_q, :s_kv]`` of a tril (or banded) buffer."""
        x = node
        while is_op(x, aten.slice.Tensor):  # top-left crops: [:, :, :s_q, :s_kv]
            if arg(x, 4, "step", 1) != 1 or arg(x, 2, "start") not in (None, 0):
                return False, None
            x = x.args[0]
        value = self.constant(x)
        if value is None or value.dim() < 2 or value.shape[-1] != value.shape[-2]:
            return False, None
        square = value.reshape(-1, *value.shape[-2:])
        if square.shape[0] != 1:
            return False, None
        square = square[0]
        if square.dtype != torch.bool:
            if not bool(((square == 0) | (square == 1)).all()):
                return False, None
            square = square == 1
        n = square.shape[-1]
        ones = torch.ones(n, n, dtype=torch.bool)
        tril = torch.tril(ones)
        if torch.equal(square, tril):
            return True, None
        width = int(square[-1].sum())
        if 0 < width < n and torch.equal(square, tril & ~torch.tril(ones, -width)):
            return True, width
        return False, None

    def keep_mask(self, node: Any) -> Tuple[bool, Optional[int]]:
        """Boolean, True = attend: the bool causal-mask op or a tril buffer slice."""
        if is_op(node, torch.ops.autodeploy.torch_causal_mask) and arg(node, 4, "dtype") == torch.bool:
            return True, arg(node, 3, "sliding_window")
        return self._buffer_window(node)

    def masked_positions(self, node: Any) -> Tuple[bool, Optional[int]]:
        """Boolean, True = masked: the float causal-mask op cast to bool (non-zero where masked),
        or ``~keep``."""
        if is_op(node, CASTS) and _cast_dtype(node) == torch.bool:
            inner = node.args[0]
            if is_op(inner, torch.ops.autodeploy.torch_causal_mask) and arg(inner, 4, "dtype") != torch.bool:
                return True, arg(inner, 3, "sliding_window")
        if is_op(node, (aten.logical_not, aten.bitwise_not)):
            return self.keep_mask(node.args[0])
        return False, None

    def additive_mask(self, node: Any, factor: float) -> Tuple[bool, Optional[int]]:
        """The float causal-mask op (0 / the dtype's minimum), scaled by ``factor`` > 0."""
        if is_op(node, torch.ops.autodeploy.torch_causal_mask):
            dtype = arg(node, 4, "dtype")
            if dtype != torch.bool and torch.finfo(dtype).min * factor <= MASKED_FILL_LIMIT:
                return True, arg(node, 3, "sliding_window")
        return False, None

    def openai_mask(self, a: Any, b: Any, factor: float
                    ) -> Tuple[bool, Optional[fx.Node], Optional[fx.Node], Optional[int]]:
        """``s * m + (1 - m) * c`` with a 0/1 tril buffer ``m`` and ``c * factor <= -1e4``:
        ``(found, s, the s * m node, window)``."""
        for lhs, rhs in ((a, b), (b, a)):
            if not (is_op(lhs, aten.mul.Tensor) and is_op(rhs, aten.mul.Tensor) and len(lhs.users) == 1):
                continue
            fill = rhs.args[1] if isinstance(rhs.args[1], (int, float)) else None
            inv = rhs.args[0]
            if fill is None or fill * factor > MASKED_FILL_LIMIT:
                continue
            if not (is_op(inv, aten.rsub.Scalar) and arg(inv, 1, "other") == 1 and arg(inv, 2, "alpha", 1) == 1):
                continue
            m = inv.args[0]
            for s, m2 in ((lhs.args[0], lhs.args[1]), (lhs.args[1], lhs.args[0])):
                if m2 is m:
                    found, window = self._buffer_window(m)
                    if found:
                        return True, s, lhs, window
        return False, None, None, None

    # ---- ALiBi ----------------------------------------------------------------------------

    def alibi_heads(self, bias: Any, n_heads: int, kv_len: Any) -> Optional[fx.Node]:
        """The per-head constant of an ALiBi bias ``heads[h] * arange(...)[key]``, or None.

        The bias must span the ``kv_len`` keys (a bias broadcast over the keys is a per-row
        constant, not ALiBi). Peels what only broadcasts it over batch/queries or crops the keys:
        a batch ``repeat``, ``expand``/``squeeze`` that keep the key dim, slices along the keys
        (any start: a shift is a per-row constant) or along size-1 dims."""
        v = val(bias)
        if v is None or not statically_known_true(v.shape[-1] == kv_len) or statically_known_true(kv_len == 1):
            return None
        x = bias
        while True:
            if is_op(x, aten.repeat) and all(r == 1 for r in list(x.args[1])[1:]):
                x = x.args[0]
            elif is_op(x, (aten.expand, aten.squeeze)) and _same_last_dim(x, x.args[0]):
                x = x.args[0]
            elif is_op(x, aten.slice.Tensor) and arg(x, 4, "step", 1) == 1:
                v = val(x.args[0])
                if v is None:
                    return None
                dim = arg(x, 1, "dim", 0) % v.dim()
                if dim != v.dim() - 1 and v.shape[dim] != 1:
                    return None
                x = x.args[0]
            else:
                break
        if not is_op(x, aten.mul.Tensor) or not all(isinstance(a, fx.Node) for a in x.args[:2]):
            return None
        out = val(x)
        if out is None or out.dim() < 3 or out.shape[-3] != n_heads or out.shape[-2] != 1:
            return None
        for heads, ramp in ((x.args[0], x.args[1]), (x.args[1], x.args[0])):
            if _per_head(heads, n_heads) and _key_ramp(ramp) and self.input_free(heads):
                return heads
        return None

    def input_free(self, node: fx.Node) -> bool:
        """Nothing but constants among ``node``'s ancestors: no graph input, no parameter (a
        ``get_attr`` counts only when it is a buffer or constant with a known value)."""
        seen, stack = set(), [node]
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x.op == "placeholder" or (x.op == "get_attr" and self.constant(x) is None):
                return False
            stack.extend(x.all_input_nodes)
        return True


def _same_last_dim(a: fx.Node, b: Any) -> bool:
    va, vb = val(a), val(b)
    return va is not None and vb is not None and va.dim() > 0 and vb.dim() > 0 and statically_known_true(
        va.shape[-1] == vb.shape[-1])


def _cast_dtype(node: fx.Node) -> Optional[torch.dtype]:
    for a in list(node.args[1:]) + list(node.kwargs.values()):
        if isinstance(a, torch.dtype):
            return a
    return None


def _per_head(node: fx.Node, n_heads: int) -> bool:
    """Shape ``[..., n, 1, 1]``: one value per head, broadcast over queries and keys."""
    v = val(node)
    return (v is not None and v.dim() >= 3 and v.shape[-3] == n_heads and v.shape[-2] == 1 and v.shape[-1] == 1
            and v.numel() == n_heads and v.is_floating_point())


def _key_ramp(node: Any) -> bool:
    """A step-1 increasing ``arange`` laid along the last dim (all other dims 1)."""
    v = val(node)
    if v is None or any(not statically_known_true(d == 1) for d in v.shape[:-1]):
        return False
    x = node
    while is_op(x, (*VIEWS, *CASTS, aten.unsqueeze)):
        x = x.args[0]
    if is_op(x, aten.arange.default):
        return True
    if is_op(x, aten.arange.start):
        return True
    if is_op(x, aten.arange.start_step):
        return arg(x, 2, "step", 1) == 1
    return False


def _only_user(node: Any, user: fx.Node) -> bool:
    return isinstance(node, fx.Node) and list(node.users) == [user]


def _scalar_arg(node: fx.Node) -> Optional[float]:
    other = arg(node, 1, "other")
    return float(other) if isinstance(other, (int, float)) and not isinstance(other, bool) else None


def _heads_view(node: Any) -> bool:
    """A view between ``[b*n, s, k]`` and ``[b, n, s, k]`` (same last two dims)."""
    if not is_op(node, VIEWS):
        return False
    a, b = val(node.args[0]), val(node)
    if a is None or b is None or {a.dim(), b.dim()} != {3, 4}:
        return False
    return all(statically_known_true(x == y) for x, y in zip(a.shape[-2:], b.shape[-2:]))


def _unflatten(node: Any) -> Optional[fx.Node]:
    """The 4-D ``[b, n, s, d]`` tensor a ``[b*n, s, d]`` operand is a view of, or None."""
    if not is_op(node, VIEWS):
        return None
    a, b = val(node.args[0]), val(node)
    if a is None or b is None or a.dim() != 4 or b.dim() != 3:
        return None
    same = statically_known_true(a.shape[0] * a.shape[1] == b.shape[0]) and all(
        statically_known_true(x == y) for x, y in zip(a.shape[2:], b.shape[1:]))
    return node.args[0] if same else None


def _last_two_swapped(node: Any) -> Optional[fx.Node]:
    """``x`` for ``transpose(x, -1, -2)``."""
    if not is_op(node, aten.transpose.int):
        return None
    rank = val(node.args[0]).dim() if val(node.args[0]) is not None else 0
    dims = {arg(node, 1, "dim0") % max(rank, 1), arg(node, 2, "dim1") % max(rank, 1)}
    return node.args[0] if rank >= 3 and dims == {rank - 2, rank - 1} else None


def _keys(kt: Any, flat: bool) -> Tuple[Optional[fx.Node], bool]:
    """``(k, is_bsnd)`` from the scores' right operand (``k^T``): ``transpose(k, -1, -2)`` of
    bnsd k, ``permute(k_bsnd, [0, 2, 3, 1])`` (OpenAI-GPT), or the ``[b*n, ...]`` form."""
    inner = _last_two_swapped(kt)
    if inner is not None:
        return (_unflatten(inner) if flat else inner), False
    if not flat and is_op(kt, aten.permute) and list(kt.args[1]) == [0, 2, 3, 1]:
        return kt.args[0], True
    return None, False


def _rank4(node: Any) -> bool:
    return val(node) is not None and val(node).dim() == 4


def _root(x: fx.Node, factor: float, reader: _Reader, found: dict) -> Optional[_Scores]:
    """The q.k product at the bottom of the score expression."""
    if is_op(x, aten.matmul) and len(x.args) == 2:
        q, (k, k_bsnd) = x.args[0], _keys(x.args[1], flat=False)
        return _Scores(q, k, factor, k_bsnd) if _rank4(q) and _rank4(k) else None
    if is_op(x, aten.bmm):
        q, (k, _) = _unflatten(x.args[0]), _keys(x.args[1], flat=True)
        return _Scores(q, k, factor) if q is not None and k is not None else None
    if is_op(x, aten.baddbmm):
        bias, q3, kt3 = x.args[:3]
        beta, alpha = arg(x, 3, "beta", 1.0), arg(x, 4, "alpha", 1.0)
        q, (k, _) = _unflatten(q3), _keys(kt3, flat=True)
        if q is None or k is None or not isinstance(alpha, (int, float)) or not isinstance(beta, (int, float)):
            return None
        if alpha <= 0:
            return None
        scores = _Scores(q, k, factor * alpha)
        if beta != 0 and not is_op(bias, (aten.zeros, aten.zeros_like, aten.new_zeros)):
            heads = reader.alibi_heads(bias, int(val(q).shape[1]), val(k).shape[2])
            if heads is None or found.get("alibi") is not None:
                return None
            found["alibi"] = (heads, factor * beta)
        return scores
    return None


def read_scores(softmax: fx.Node, reader: _Reader) -> Optional[_Scores]:
    """Walk from the softmax input down to the q.k product; None for anything not understood."""
    x, consumer = softmax.args[0], softmax
    factor = 1.0
    windows: List[Optional[int]] = []
    found: Dict[str, Any] = {"alibi": None}
    n_heads: Optional[int] = None
    while True:
        if not _only_user(x, consumer):
            return None
        nxt: Any = None
        if _heads_view(x) or (is_op(x, CASTS) and (_cast_dtype(x) or torch.float32).is_floating_point):
            nxt = x.args[0]
        elif is_op(x, (aten.mul.Tensor, aten.div.Tensor)) and _scalar_arg(x) is not None:
            c = _scalar_arg(x)
            c = c if is_op(x, aten.mul.Tensor) else (1.0 / c if c else 0.0)
            if c <= 0:
                return None
            factor, nxt = factor * c, x.args[0]
        elif is_op(x, aten.where.self):
            cond, a, fill = x.args
            ok, window = reader.keep_mask(cond)
            value = reader.scalar(fill)
            if not ok or value is None or value * factor > MASKED_FILL_LIMIT:
                return None
            windows.append(window)
            if is_op(fill, aten.detach_):
                reader.inplace.append(fill)
            nxt = a
        elif is_op(x, aten.masked_fill.Scalar):
            a, cond, value = x.args
            ok, window = reader.masked_positions(cond)
            if not ok or not isinstance(value, (int, float)) or value * factor > MASKED_FILL_LIMIT:
                return None
            windows.append(window)
            nxt = a
        elif is_op(x, (aten.maximum, aten.max.other)):
            a, c = x.args
            value = reader.scalar(c)
            if value is None or value > CLAMP_LIMIT:
                return None
            nxt = a
        elif is_op(x, aten.add.Tensor) and arg(x, 2, "alpha", 1) == 1:
            a, b = x.args
            ok, s, product, window = reader.openai_mask(a, b, factor)
            if ok:
                windows.append(window)
                nxt, x = s, product  # the s * m product (read only by this add) reads s
            else:
                for chained, bias in ((a, b), (b, a)):
                    ok, window = reader.additive_mask(bias, factor)
                    if ok:
                        windows.append(window)
                        nxt = chained
                        break
                    if n_heads is None:
                        n_heads = _heads_of_scores(x)
                    heads = reader.alibi_heads(bias, n_heads, val(x).shape[-1]) if n_heads is not None else None
                    if heads is not None and found["alibi"] is None:
                        found["alibi"] = (heads, factor)
                        nxt = chained
                        break
                if nxt is None:
                    return None
        else:
            scores = _root(x, factor, reader, found)
            if scores is None:
                return None
            scores.windows, scores.alibi = windows, found["alibi"]
            return scores
        consumer, x = x, nxt


def _heads_of_scores(x: fx.Node) -> Optional[int]:
    v = val(x)
    return int(v.shape[1]) if v is not None and v.dim() == 4 else None


def read_probs(o: fx.Node) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(softmax, v_bnsd)`` for ``o = matmul(p, v)`` / ``bmm(p3, v3)``, walking back from ``p``
    through casts, views and inference-time dropout to a last-dim softmax."""
    p, v = o.args[:2]
    flat = is_op(o, aten.bmm)
    v4 = _unflatten(v) if flat else v
    if v4 is None or val(v4) is None or val(v4).dim() != 4:
        return None
    consumer = o
    while _only_user(p, consumer):
        if is_op(p, aten.dropout):
            if arg(p, 1, "p", 0.0) != 0.0 and arg(p, 2, "train", False):
                return None
        elif is_op(p, (aten.softmax.int, aten._softmax)):
            rank = val(p.args[0]).dim() if val(p.args[0]) is not None else 0
            dim = arg(p, 1, "dim")
            return (p, v4) if rank and dim % rank == rank - 1 else None
        elif not (is_op(p, CASTS) or _heads_view(p)):
            return None
        consumer, p = p, p.args[0]
    return None


def _bnsd_output(o: fx.Node) -> Optional[fx.Node]:
    """The node holding the attention's bnsd output: ``o`` itself (4-D matmul) or the view of a
    ``[b*n, s, d]`` bmm back to ``[b, n, s, d]``; None when the 3-D result is used otherwise."""
    if is_op(o, aten.matmul):
        return o if val(o) is not None and val(o).dim() == 4 else None
    users = list(o.users)
    if len(users) == 1 and is_op(users[0], VIEWS) and val(users[0]) is not None and val(users[0]).dim() == 4:
        return users[0] if _unflatten_shape_ok(users[0]) else None
    return None


def _unflatten_shape_ok(view4: fx.Node) -> bool:
    a, b = val(view4.args[0]), val(view4)
    return statically_known_true(b.shape[0] * b.shape[1] == a.shape[0]) and all(
        statically_known_true(x == y) for x, y in zip(b.shape[2:], a.shape[1:]))


def _slopes(graph: fx.Graph, before: fx.Node, heads: fx.Node, factor: float, n: int) -> fx.Node:
    """``reshape(heads, [n]).float() * factor``: the op's ``[n]`` float32 slopes."""
    with graph.inserting_before(before):
        slopes = graph.call_function(aten.reshape.default, (heads, [n]))
        if val(heads) is not None and val(heads).dtype != torch.float32:
            slopes = graph.call_function(aten._to_copy.default, (slopes,), {"dtype": torch.float32})
        if factor != 1.0:
            slopes = graph.call_function(aten.mul.Tensor, (slopes, factor))
    return slopes


class MatchHandwrittenConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("match_handwritten_attention")
class MatchHandwrittenAttention(BaseTransform):
    config_class = MatchHandwrittenConfig
    run_after = ("match_eager_attention", "cleanup_noop_cast", "cleanup_noop_slice", "cleanup_noop_view")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        reader = _Reader(gm, ctx)
        graph = gm.graph
        count = 0
        for o in reversed(list(graph.nodes)):
            if o._erased or not is_op(o, (aten.matmul, aten.bmm)) or len(o.args) != 2:
                continue
            probs = read_probs(o)
            out = _bnsd_output(o) if probs is not None else None
            if out is None:
                continue
            softmax, v = probs
            scores = read_scores(softmax, reader)
            if scores is None or not scores.windows:
                logger.debug("match_handwritten_attention: %s is not a causal attention it can read", o.name)
                continue
            kv_len = val(scores.k).shape[1 if scores.k_bsnd else 2]
            if not statically_known_true(val(scores.q).shape[2] == kv_len):
                continue  # these masks are top-left aligned, the op's causal bottom-right
            k = scores.k
            if scores.k_bsnd:
                with graph.inserting_before(out):
                    k = graph.call_function(aten.transpose.int, (k, 1, 2))  # cancels in emit
            windows = [w for w in scores.windows if w is not None]
            window = min(windows) if windows else None
            n = int(val(scores.q).shape[1])
            slopes = None
            if scores.alibi is not None:
                slopes = _slopes(graph, out, scores.alibi[0], scores.alibi[1], n)
            emit_attention_bnsd(graph, out, scores.q, k, v, mask=None, is_causal=True, scale=scores.scale,
                                sliding_window=window, alibi_slopes=slopes)
            graph.erase_node(out)
            if out is not o and not o.users:
                graph.erase_node(o)
            count += 1
        if count:
            eliminate_dead_code(gm)
            for node in reader.inplace:
                if not node._erased and not node.users:
                    graph.erase_node(node)
            eliminate_dead_code(gm)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
