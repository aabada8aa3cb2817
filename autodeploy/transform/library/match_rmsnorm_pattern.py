"""``match_rmsnorm_pattern`` (pattern_matcher): RMSNorm subgraphs -> ``torch_rmsnorm``.

Before (Llama; casts present when the model runs in half precision)::

    xf = to(x, f32); var = mean(pow(xf, 2), [-1], keepdim=True)
    y = mul(w, to(mul(xf, rsqrt(add(var, eps))), x.dtype))

Before (Gemma)::

    y = type_as(mul(mul(xf, rsqrt(add(var, eps))), add(1.0, to(w, f32))), x)

After::

    y = autodeploy.torch_rmsnorm(x, w, eps)            # Gemma: w -> add(w, 1.0)

Covers QK-norm too (the same norm over the head dim). Near misses (a reduction over another
dim, another exponent, an offset other than 1) are left alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import fx

from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ..pattern_matcher import PatternSet

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match

aten = torch.ops.aten


def _llama_weight_first(x, weight, eps):
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _llama_weight_last(x, weight, eps):
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(dtype) * weight


def _gemma(x, weight, eps):
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1.0 + weight.float())
    return out.type_as(x)


def _rmsnorm_handler(weight_offset: Optional[float]) -> Callable[..., None]:
    """Replace the matched norm with ``torch_rmsnorm(x, w, eps)`` (Gemma: ``w + 1.0`` first).

    Why a handler, not a replacement function: inductor traces a replacement function with
    ``make_fx`` at every match (~10 ms each, 25 matches in ``small``: a third of this
    transform's time), for a graph that is one or two nodes."""

    def handler(match: Match, graph: fx.Graph, x: fx.Node, weight: fx.Node, eps: float) -> None:
        out = match.output_node()
        with graph.inserting_before(out):
            if weight_offset is not None:
                weight = graph.call_function(aten.add.Tensor, (weight, weight_offset))
            norm = graph.call_function(torch.ops.autodeploy.torch_rmsnorm.default, (x, weight, eps))
        out.replace_all_uses_with(norm)
        match.erase_nodes()

    return handler


def _reduces_last_dim_only(match: Match) -> bool:
    for node in match.nodes:
        if is_op(node, aten.mean):
            dims = arg(node, 1, "dim")
            inp_val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            ndim = inp_val.dim() if inp_val is not None else None
            if not isinstance(dims, (list, tuple)) or len(dims) != 1:
                return False
            if dims[0] != -1 and (ndim is None or dims[0] != ndim - 1):
                return False
        if is_op(node, aten.pow) and arg(node, 1, "exponent") != 2:
            return False
    return True


def _offset_is_one(match: Match) -> bool:
    if not _reduces_last_dim_only(match):
        return False
    for node in match.nodes:
        if is_op(node, aten.add):
            consts = [a for a in node.args if isinstance(a, (int, float))]
            operands = [a for a in node.args if isinstance(a, fx.Node)]
            # The eps add has a mean() operand; the offset add has the weight operand.
            if consts and not any(is_op(o, aten.mean) for o in operands) and consts[0] != 1:
                return False
    return True


_PATTERNS: Optional[PatternSet] = None


def rmsnorm_patterns() -> PatternSet:
    global _PATTERNS
    if _PATTERNS is None:
        ps = PatternSet("match_rmsnorm_pattern")
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(2, 3, 8, dtype=dtype), torch.randn(8, dtype=dtype)
            for search in (_llama_weight_first, _llama_weight_last):
                ps.add(search, [x, w], handler=_rmsnorm_handler(None), scalar_workaround={"eps": 1e-6},
                       extra_check=_reduces_last_dim_only)
            ps.add(_gemma, [x, w], handler=_rmsnorm_handler(1.0), scalar_workaround={"eps": 1e-6},
                   extra_check=_offset_is_one)
        _PATTERNS = ps
    return _PATTERNS


class MatchRMSNormConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("match_rmsnorm_pattern")
class MatchRMSNormPattern(BaseTransform):
    config_class = MatchRMSNormConfig
    run_after = ("cleanup_noop_cast", "cleanup_assert_metadata")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = rmsnorm_patterns().apply(gm)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
