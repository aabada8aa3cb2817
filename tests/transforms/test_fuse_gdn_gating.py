"""fuse_gdn_gating: a Gated DeltaNet layer's ``-exp(A_log) * softplus(a + dt_bias)`` and
``sigmoid(b)`` -> one ``torch_fused_gdn_gating`` node.

Real tiny Qwen3-Next and OLMo-Hybrid (one match per linear-attention layer, logits equal HF's),
toy layers for the accepted spellings (float32 and bfloat16 with HF's casts), near misses, and the
op against HF's expression.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

from autodeploy.transform.interface import Stage
from helpers import apply_transform, assert_matches_hf, assert_same_outputs, build, count_op, coverage_checkpoint, export_gm

ad = torch.ops.autodeploy
aten = torch.ops.aten
H, HK, D, HIDDEN = 4, 2, 8, 32
GATE_OPS = [aten.softplus, aten.exp, aten.neg]


class GdnGate(nn.Module):
    """The gating and delta rule of a Gated DeltaNet layer; ``mode`` picks how g and beta are written."""

    def __init__(self, mode="hf"):
        super().__init__()
        self.mode = mode
        torch.manual_seed(0)
        self.w_qkv = nn.Parameter(torch.randn(2 * HK * D + H * D, HIDDEN) * 0.2)
        self.w_a = nn.Parameter(torch.randn(H, HIDDEN) * 0.5)
        self.w_b = nn.Parameter(torch.randn(H, HIDDEN) * 0.5)
        self.A_log = nn.Parameter(torch.empty(H).uniform_(0.01, 16).log())
        self.dt_bias = nn.Parameter(torch.randn(H))

    def forward(self, x):
        bsz, s, _ = x.shape
        q, k, v = F.linear(x, self.w_qkv).split([HK * D, HK * D, H * D], dim=-1)
        q, k, v = q.reshape(bsz, s, HK, D), k.reshape(bsz, s, HK, D), v.reshape(bsz, s, H, D)
        a, b = F.linear(x, self.w_a), F.linear(x, self.w_b)
        beta = b.sigmoid()
        mode = self.mode
        if mode == "hf":  # Qwen3-Next / Qwen3.5
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        elif mode == "olmo":  # OLMo-Hybrid with allow_neg_eigval
            beta = beta * 2.0
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        elif mode == "swapped":
            g = F.softplus(self.dt_bias + a) * -self.A_log.exp()
        elif mode == "neg_outside":
            g = -(self.A_log.exp() * F.softplus(a + self.dt_bias))
        # near misses
        elif mode == "no_exp":  # A itself, not A_log
            g = -self.A_log * F.softplus(a + self.dt_bias)
        elif mode == "softplus_beta":
            g = -self.A_log.exp() * F.softplus(a + self.dt_bias, beta=2.0)
        elif mode == "softplus_read_twice":
            sp = F.softplus(a + self.dt_bias)
            g = -self.A_log.exp() * sp
            beta = beta * sp.sigmoid()
        elif mode == "beta_not_sigmoid":
            beta = torch.tanh(b).abs()
            g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        elif mode == "no_delta_rule":
            g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
            return g, beta
        else:
            raise ValueError(mode)
        out = ad.torch_gated_delta_rule(q, k, v, g, beta, None, True)
        return out.reshape(bsz, s, H * D)


def _inputs(dtype=torch.float32):
    return [(torch.randn(2, 5, HIDDEN, dtype=dtype),), (torch.randn(3, 1, HIDDEN, dtype=dtype),)]


def _run(module, dtype=torch.float32, **config):
    module = module.to(dtype).eval()
    gm = export_gm(module, torch.randn(2, 5, HIDDEN, dtype=dtype))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_gdn_gating", gm, **config)
    return reference, gm, record


def _fused_nodes(gm):
    return gm.graph.find_nodes(op="call_function", target=ad.torch_fused_gdn_gating.default)


@pytest.mark.parametrize("mode", ["hf", "olmo", "swapped", "neg_outside"])
def test_gate_and_beta_become_one_op(mode):
    reference, gm, record = _run(GdnGate(mode))
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_fused_gdn_gating) == 1
    assert count_op(gm, GATE_OPS + [aten.sigmoid]) == 0
    (node,) = _fused_nodes(gm)
    A_log, a, b, dt_bias, neg_exp = node.args
    assert (str(A_log.target), str(dt_bias.target)) == ("A_log", "dt_bias")
    assert a.target == b.target == aten.linear.default and str(a.args[1].target) == "w_a"
    # -exp(A_log) computed once, at load
    assert torch.equal(getattr(gm, neg_exp.target), -gm.A_log.float().exp())
    assert count_op(gm, aten.mul) == (1 if mode == "olmo" else 0)  # OLMo's beta * 2 stays
    assert_same_outputs(reference, gm, _inputs(), tol=1e-6)


def test_bfloat16_casts_are_the_ops_own():
    """HF's ``.float()`` casts of a half-precision model are folded into the op (g float32, beta bfloat16)."""
    reference, gm, record = _run(GdnGate("hf"), torch.bfloat16)
    assert reference.A_log.dtype == torch.bfloat16
    assert count_op(reference, [aten.to, aten._to_copy]) >= 2
    assert record.num_matches == 1
    assert count_op(gm, GATE_OPS + [aten.sigmoid, aten.to, aten._to_copy]) == 0
    (node,) = _fused_nodes(gm)
    assert node.args[1].meta["val"].dtype == torch.bfloat16  # a, before HF's cast
    assert_same_outputs(reference, gm, _inputs(torch.bfloat16), tol=1e-6)


def test_without_precompute_the_op_computes_the_decay():
    reference, gm, record = _run(GdnGate("hf"), precompute_decay=False)
    assert record.num_matches == 1
    (node,) = _fused_nodes(gm)
    assert node.args[4] is None
    assert not any("neg_exp" in name for name, _ in gm.named_buffers())
    assert_same_outputs(reference, gm, _inputs(), tol=1e-6)


@pytest.mark.parametrize("mode", ["no_exp", "softplus_beta", "softplus_read_twice", "beta_not_sigmoid",
                                  "no_delta_rule"])
def test_near_misses_left_alone(mode):
    reference, gm, record = _run(GdnGate(mode))
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_fused_gdn_gating) == 0
    assert count_op(gm, aten.softplus) == 1
    assert_same_outputs(reference, gm, _inputs())


def test_op_equals_hf_expression_and_dtypes():
    torch.manual_seed(1)
    A_log = torch.empty(H).uniform_(0.01, 16).log().bfloat16()
    dt_bias = torch.randn(H).bfloat16()
    a, b = torch.randn(2, 3, H).bfloat16() * 4, torch.randn(2, 3, H).bfloat16() * 4
    g_ref = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    beta_ref = b.sigmoid()
    for neg_exp in (None, -A_log.float().exp()):
        g, beta = ad.torch_fused_gdn_gating(A_log, a, b, dt_bias, neg_exp)
        assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
        assert torch.equal(g, g_ref) and torch.equal(beta, beta_ref)


def _linear_layers(path):
    return AutoConfig.from_pretrained(path).layer_types.count("linear_attention")


# qwen3_next (~7.5 s) with -m slow: olmo_hybrid's run covers the same transform on a real model
@pytest.mark.parametrize("model_type", [pytest.param("qwen3_next", marks=pytest.mark.slow), "olmo_hybrid"])
def test_real_gated_deltanet_models(model_type):
    path, _ = coverage_checkpoint(model_type)
    n = _linear_layers(path)
    assert n >= 1
    result = build(path, up_to=Stage.POST_LOAD_FUSION)
    record = next(r for r in result.context.history if r.key == "fuse_gdn_gating")
    assert record.status == "ok" and record.num_matches == n
    gm = result.graph
    assert count_op(gm, ad.torch_fused_gdn_gating) == n
    assert count_op(gm, GATE_OPS) == 0
    # every delta rule reads its gate and beta from the fused op (OLMo-Hybrid: beta * 2 of it)
    for rule in gm.graph.find_nodes(op="call_function", target=ad.torch_gated_delta_rule.default):
        g, beta = rule.args[3], rule.args[4]
        beta = beta.args[0] if beta.target == aten.mul.Tensor else beta
        assert g.args[0].target == beta.args[0].target == ad.torch_fused_gdn_gating.default
    assert_matches_hf(gm, path)
