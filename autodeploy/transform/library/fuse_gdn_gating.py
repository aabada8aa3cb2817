"""``fuse_gdn_gating`` (post_load_fusion): a Gated DeltaNet layer's decay gate and beta -> one op.

Before (Qwen3-Next, Qwen3.5, OLMo-Hybrid; the ``to`` casts only in a half-precision model)::

    beta = aten.sigmoid(b)                                   # OLMo-Hybrid: beta = mul(sigmoid(b), 2.0)
    e    = aten.exp(aten.to(A_log, float32))                 # A_log, dt_bias: the layer's weights
    x    = aten.add(aten.to(a, float32), dt_bias)
    g    = aten.mul(aten.neg(e), aten.softplus(x))
    o    = autodeploy.torch_gated_delta_rule(q, k, v, g, beta, ...)

After::

    gb   = autodeploy.torch_fused_gdn_gating(A_log, a, b, dt_bias, A_log_neg_exp)
    g    = getitem(gb, 0);  beta = getitem(gb, 1)            # OLMo-Hybrid: mul(getitem(gb, 1), 2.0)
    o    = autodeploy.torch_gated_delta_rule(q, k, v, g, beta, ...)

``A_log_neg_exp`` is ``-exp(A_log.float())``, computed once here (the weights are loaded by now)
and kept as a buffer beside ``A_log`` (``precompute_decay``; off, or for an ``A_log`` that is not
a loaded weight, the op computes it on every call). Same operations in the same order as HF's
``-A_log.float().exp() * F.softplus(a.float() + dt_bias)`` and ``b.sigmoid()``, so the values
are identical. Also accepted: the product in either order and ``-(exp(A_log) * softplus(x))``.
Measured with ``benchmarks/bench_gdn_gating.py`` (the 2-core CI CPU, ``torch-simple``'s direct
calls): 21 -> 13 us per layer and decode step (1.6x; 2.5 us of it the precomputed decay), 1.2x at
512 tokens, even at 2048 tokens x 64 heads, where the arithmetic dominates.

g and beta are paired through the gated delta rule that reads them (``g`` and ``beta``
arguments; beta as ``sigmoid(b)`` or ``sigmoid(b)`` times a constant, whose sigmoid is fused).
Left alone: a softplus not scaled by ``-exp(A_log)`` (or with non-default ``beta``/``threshold``),
a softplus read elsewhere too, arithmetic that is not float32 where HF's is (an ``A_log`` or ``a``
not cast to float32 in a half-precision graph), a gate whose beta is not a sigmoid, and a gate
that feeds no gated delta rule.
"""

import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
from pydantic import Field
from torch import fx

from ..graph_utils import arg, get_attr_value, is_op, val
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten
ad = torch.ops.autodeploy


class FuseGdnGatingConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    requires_shape_prop: bool = True
    precompute_decay: bool = Field(
        default=True,
        description="Compute -exp(A_log) once at load (a buffer beside A_log) instead of on every call.",
    )


def _dtype(node: Any) -> Optional[torch.dtype]:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _float_source(node: Any) -> Any:
    """``x`` for ``x.float()`` spelled as a plain cast to float32 (``aten.to.dtype`` or
    ``aten._to_copy`` with only a dtype), else ``node`` itself."""
    if is_op(node, aten.to.dtype):
        extra = list(node.args[2:]) + [v for k, v in node.kwargs.items() if k != "dtype"]
        if arg(node, 1, "dtype") == torch.float32 and all(e in (False, None) for e in extra):
            return node.args[0]
    if is_op(node, aten._to_copy.default) and set(node.kwargs) == {"dtype"} and len(node.args) == 1:
        if node.kwargs["dtype"] == torch.float32:
            return node.args[0]
    return node


def _other(node: fx.Node, one: fx.Node) -> Any:
    """The other argument of a two-argument ``node`` of which ``one`` is an argument."""
    a, b = node.args[0], node.args[1]
    return b if a is one else a


def _decay_product(softplus: fx.Node) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(g, exp)`` where ``g = -exp * softplus`` in one of the accepted spellings."""
    if len(softplus.users) != 1:
        return None
    (mul,) = softplus.users
    if not is_op(mul, aten.mul.Tensor) or len(mul.args) != 2 or mul.kwargs:
        return None
    factor = _other(mul, softplus)
    if is_op(factor, aten.neg.default) and is_op(factor.args[0], aten.exp.default):
        return mul, factor.args[0]  # mul(neg(exp(A)), softplus(x))
    if is_op(factor, aten.exp.default) and len(mul.users) == 1:
        (neg,) = mul.users
        if is_op(neg, aten.neg.default):
            return neg, factor  # neg(mul(exp(A), softplus(x)))
    return None


_DELTA_RULES = (ad.torch_gated_delta_rule.default, ad.torch_cached_gated_delta_rule.default)


def _beta_sigmoid(g: fx.Node) -> Optional[fx.Node]:
    """The sigmoid behind the beta of the gated delta rule that reads ``g`` as its gate."""
    for user in g.users:
        if not is_op(user, _DELTA_RULES) or arg(user, 3, "g") is not g:
            continue
        beta = arg(user, 4, "beta")
        if is_op(beta, aten.mul.Tensor) and len(beta.args) == 2 and not beta.kwargs:
            x, y = beta.args
            scaled = x if isinstance(y, (int, float)) else y if isinstance(x, (int, float)) else None
            beta = scaled if is_op(scaled, aten.sigmoid.default) else beta
        if is_op(beta, aten.sigmoid.default):
            return beta
    return None


class _Match:
    def __init__(self, g: fx.Node, sigmoid: fx.Node, A_log: Any, a: Any, dt_bias: Any):
        self.g, self.sigmoid, self.A_log, self.a, self.dt_bias = g, sigmoid, A_log, a, dt_bias
        self.b = sigmoid.args[0]


def _match(softplus: fx.Node) -> Optional[_Match]:
    if arg(softplus, 1, "beta", 1) != 1 or arg(softplus, 2, "threshold", 20) != 20:
        return None
    found = _decay_product(softplus)
    if found is None:
        return None
    g, exp = found
    add = softplus.args[0]
    if not is_op(add, aten.add.Tensor) or len(add.args) != 2 or arg(add, 2, "alpha", 1) != 1:
        return None
    x, y = add.args
    if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)):
        return None
    # a.float() + dt_bias: dt_bias is the weight; a plain cast to float32 is the op's own a.float()
    a, dt_bias = (y, x) if x.op == "get_attr" and y.op != "get_attr" else (x, y)
    a = _float_source(a)
    A_log = _float_source(exp.args[0])
    # the arithmetic is float32 where HF's is (what the op computes whatever the inputs' dtypes)
    f32 = torch.float32
    if _dtype(add) != f32 or _dtype(exp) != f32 or _dtype(g) != f32:
        return None
    if not all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in (val(a), val(dt_bias), val(A_log))):
        return None
    sigmoid = _beta_sigmoid(g)
    if sigmoid is None or not isinstance(val(sigmoid.args[0]), torch.Tensor):
        return None
    return _Match(g, sigmoid, A_log, a, dt_bias)


def _neg_exp_buffer(gm: fx.GraphModule, A_log: fx.Node, made: Dict[str, str]) -> Optional[str]:
    """A buffer ``-exp(A_log.float())`` beside the weight (once per weight); None when ``A_log``
    is not a loaded weight."""
    if A_log.op != "get_attr":
        return None
    target = str(A_log.target)
    if target in made:
        return made[target]
    weight = get_attr_value(gm, A_log)
    if not isinstance(weight, torch.Tensor) or weight.is_meta:
        return None
    path, _, leaf = target.rpartition(".")
    owner = gm.get_submodule(path) if path else gm
    name, i = f"{leaf}_neg_exp", 0
    while hasattr(owner, name):
        i += 1
        name = f"{leaf}_neg_exp_{i}"
    with torch.no_grad():
        owner.register_buffer(name, -weight.detach().float().exp(), persistent=False)
    made[target] = f"{path}.{name}" if path else name
    return made[target]


@TransformRegistry.register("fuse_gdn_gating")
class FuseGdnGating(BaseTransform):
    config_class = FuseGdnGatingConfig
    run_after = ("load_weights", "fuse_gemms", "fuse_gemms_mixed_children")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        graph = gm.graph
        cfg: FuseGdnGatingConfig = self.config  # type: ignore[assignment]
        made: Dict[str, str] = {}
        fused_sigmoids: set = set()
        count = 0
        for softplus in list(graph.nodes):
            if not is_op(softplus, aten.softplus.default):
                continue
            m = _match(softplus)
            if m is None or m.sigmoid in fused_sigmoids:
                continue
            # one node for both outputs: after every input, before every reader of either output
            order = {n: i for i, n in enumerate(graph.nodes)}
            readers: List[fx.Node] = [*m.g.users, *m.sigmoid.users]
            first_reader = min(readers, key=order.__getitem__)
            inputs = [n for n in (m.A_log, m.a, m.b, m.dt_bias) if isinstance(n, fx.Node)]
            if max(order[n] for n in inputs) >= order[first_reader]:
                continue
            buffer = _neg_exp_buffer(gm, m.A_log, made) if cfg.precompute_decay else None
            with graph.inserting_before(first_reader):
                neg_exp = graph.get_attr(buffer) if buffer is not None else None
                fused = graph.call_function(ad.torch_fused_gdn_gating.default,
                                            (m.A_log, m.a, m.b, m.dt_bias, neg_exp))
                g_out = graph.call_function(operator.getitem, (fused, 0))
                beta_out = graph.call_function(operator.getitem, (fused, 1))
            m.g.replace_all_uses_with(g_out)
            m.sigmoid.replace_all_uses_with(beta_out)
            fused_sigmoids.add(m.sigmoid)
            count += 1
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
