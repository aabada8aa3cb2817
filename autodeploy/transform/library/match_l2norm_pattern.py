"""``match_l2norm_pattern`` (pattern_matcher): L2 normalisation over the last dim -> ``torch_l2norm``.

Before (Qwen3-Next / Qwen3.5 / OLMo-Hybrid ``l2norm``)::

    y = mul(x, rsqrt(add(sum(mul(x, x), [-1], keepdim=True), eps)))

Before (Kimi-Linear / Bailing-Hybrid / GLM-5-Next ``l2norm``)::

    y = div(x, sqrt(add(sum(mul(x, x), [-1], keepdim=True), eps)))

Before (either, computed in fp32 around a half-precision input)::

    xf = to(x, f32); y = to(<either of the above on xf>, x.dtype)

After::

    y = autodeploy.torch_l2norm(x, eps)

Also matched: ``pow(x, 2)`` for ``x * x`` and ``rsqrt(...) * x`` for ``x * rsqrt(...)``. eps is
read from the graph (a number; a tensor eps is left alone). The canonical op computes in fp32 and
casts back: exact for fp32 inputs and for the upcast form (Kimi's ``x / sqrt`` differs from the
op's ``x * rsqrt`` by up to 2 ulps, see ``ops/delta_rule.py``); for a half-precision input
written without the upcast it rounds once instead of after every op, i.e. it is the more
accurate result (the delta-rule ops normalise q/k in fp32 the same way). A float64 input, or
casts that compute in another dtype, are left alone.

Near misses left alone: ``F.normalize`` (exports as ``linalg_vector_norm`` and ``clamp_min``:
eps clamps the norm instead of being added to the sum of squares, a different function), a
reduction over any dim but the last or over several dims, ``mean`` instead of ``sum`` (that is
RMSNorm), and a sum without keepdim.

In the default pipeline HF's delta-rule kernels (where every HF ``l2norm`` is called) are
replaced during export by the canonical delta-rule ops, which normalise q/k themselves
(``use_qk_l2norm``): this matcher is for the same norm written in a model's own code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import fx

from ..graph_utils import arg, is_op, val
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ..pattern_matcher import PatternSet

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match

aten = torch.ops.aten

# Dtypes torch_l2norm reproduces (it computes in fp32): wider inputs would lose precision.
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# The search functions. Each needs its own name (the traced-pattern cache is keyed by it).
def _rsqrt_mul(x, eps):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _rsqrt_mul_swapped(x, eps):
    return torch.rsqrt((x * x).sum(-1, keepdim=True) + eps) * x


def _sqrt_div(x, eps):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _rsqrt_mul_pow(x, eps):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _rsqrt_mul_pow_swapped(x, eps):
    return torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * x


def _sqrt_div_pow(x, eps):
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _upcast_rsqrt_mul(x, eps):
    return _rsqrt_mul(x.float(), eps).to(x.dtype)


def _upcast_rsqrt_mul_swapped(x, eps):
    return _rsqrt_mul_swapped(x.float(), eps).to(x.dtype)


def _upcast_sqrt_div(x, eps):
    return _sqrt_div(x.float(), eps).to(x.dtype)


def _upcast_rsqrt_mul_pow(x, eps):
    return _rsqrt_mul_pow(x.float(), eps).to(x.dtype)


def _upcast_rsqrt_mul_pow_swapped(x, eps):
    return _rsqrt_mul_pow_swapped(x.float(), eps).to(x.dtype)


def _upcast_sqrt_div_pow(x, eps):
    return _sqrt_div_pow(x.float(), eps).to(x.dtype)


_PLAIN = (_rsqrt_mul, _rsqrt_mul_swapped, _sqrt_div, _rsqrt_mul_pow, _rsqrt_mul_pow_swapped, _sqrt_div_pow)
_UPCAST = (_upcast_rsqrt_mul, _upcast_rsqrt_mul_swapped, _upcast_sqrt_div, _upcast_rsqrt_mul_pow,
           _upcast_rsqrt_mul_pow_swapped, _upcast_sqrt_div_pow)


def _replace(x, eps):
    return torch.ops.autodeploy.torch_l2norm(x, eps)


def _is_l2norm(match: Match) -> bool:
    """What the pattern leaves open (lists, dtypes and the eps are wildcards to inductor)."""
    eps = match.kwargs.get("eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return False
    x_val = val(match.kwargs.get("x"))
    if not isinstance(x_val, torch.Tensor) or x_val.dtype not in _INPUT_DTYPES:
        return False
    sums = [n for n in match.nodes if is_op(n, aten.sum)]
    if len(sums) != 1:
        return False
    summed = sums[0]
    dims = arg(summed, 1, "dim")
    ndim = x_val.dim()
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or dims[0] not in (-1, ndim - 1) or ndim == 0:
        return False
    if arg(summed, 2, "keepdim", False) is not True:
        return False
    # computed in fp32 or in x's own dtype, returned in x's dtype
    sum_val, out_val = val(summed), val(match.output_node())
    if not isinstance(sum_val, torch.Tensor) or sum_val.dtype not in (torch.float32, x_val.dtype):
        return False
    return isinstance(out_val, torch.Tensor) and out_val.dtype == x_val.dtype


_PATTERNS: Optional[PatternSet] = None


def l2norm_patterns() -> PatternSet:
    global _PATTERNS
    if _PATTERNS is None:
        ps = PatternSet("match_l2norm_pattern")
        # Upcast forms end in the cast back, so they are tried at that node, before the plain
        # forms could take the fp32 norm inside (the pass walks the graph from its outputs).
        for fns, dtype in ((_UPCAST, torch.bfloat16), (_PLAIN, torch.float32)):
            x = torch.randn(2, 3, 8, dtype=dtype)
            for search in fns:
                ps.add(search, [x], replace_fn=_replace, scalar_workaround={"eps": 1e-6}, extra_check=_is_l2norm)
        _PATTERNS = ps
    return _PATTERNS


class MatchL2NormConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("match_l2norm_pattern")
class MatchL2NormPattern(BaseTransform):
    config_class = MatchL2NormConfig
    run_after = ("cleanup_noop_cast", "cleanup_assert_metadata")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = l2norm_patterns().apply(gm)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
