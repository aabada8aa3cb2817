"""fuse_add_rms_norm (post_load_fusion): ``s = x + r; y = rmsnorm(s)`` -> torch_fused_add_rmsnorm -> (y, s).

Small modules after match_rmsnorm_pattern (or calling the canonical op directly), several users
of the sum and of the norm, the real tiny llama (4 fusions), and near misses left alone.
"""

import copy
import operator

import torch
from torch import nn

from autodeploy.transform.interface import Stage
from helpers import apply_transform, assert_matches_hf, assert_same_outputs, build, count_op, export_gm, family_checkpoint

ad = torch.ops.autodeploy
aten = torch.ops.aten
D = 32


def _llama_norm(x, w, eps=1e-6):
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class AddThenNorm(nn.Module):
    """``h = x + r; y = rmsnorm(h)`` written out in aten (needs match_rmsnorm_pattern first)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, r):
        return _llama_norm(x + r, self.w)


class ResidualChain(nn.Module):
    """Two pre-norm blocks: the sum feeds the next residual add, the norm feeds two linears,
    and the intermediate sum is also a graph output."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))
        self.a, self.b, self.c = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, r):
        h = x + r                                   # sum: used by the norm, by h2 and returned
        y = ad.torch_rmsnorm(h, self.w1, 1e-6)      # norm: used by two linears
        h2 = h + self.a(y) * self.b(y)
        y2 = ad.torch_rmsnorm(h2, self.w2, 1e-5)
        return h, self.c(y2) + h2, y.sum(-1)


def _positions(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def test_add_then_matched_norm_fuses_into_one_op():
    x, r = torch.randn(2, 5, D), torch.randn(2, 5, D)
    gm = export_gm(AddThenNorm().eval(), x, r)
    gm, rec = apply_transform("match_rmsnorm_pattern", gm)
    assert rec.num_matches == 1 and count_op(gm, ad.torch_rmsnorm) == 1
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_add_rms_norm", gm)
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_fused_add_rmsnorm) == 1
    assert count_op(gm, ad.torch_rmsnorm) == 0
    assert count_op(gm, aten.add) == 0
    fused = _positions(gm, ad.torch_fused_add_rmsnorm.default)[0]
    assert {n.name for n in fused.args[:2]} == {"x", "r"}
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, D), torch.randn(2, 5, D)),
                                        (torch.randn(3, 1, D), torch.randn(3, 1, D))])


def test_several_users_of_the_sum_and_of_the_norm_stay_correct():
    x, r = torch.randn(2, 5, D), torch.randn(2, 5, D)
    gm = export_gm(ResidualChain().eval(), x, r)
    reference = copy.deepcopy(gm)
    assert count_op(reference, aten.add) >= 3  # the two residual adds + the output add
    gm, record = apply_transform("fuse_add_rms_norm", gm)
    assert record.num_matches == 2
    assert count_op(gm, ad.torch_fused_add_rmsnorm) == 2
    assert count_op(gm, ad.torch_rmsnorm) == 0
    # the not-normalised output add survives: one add fewer per fusion
    assert count_op(gm, aten.add) == count_op(reference, aten.add) - 2
    first, second = _positions(gm, ad.torch_fused_add_rmsnorm.default)
    # the second fusion takes the first one's sum output as its residual input
    sums = [u for u in first.users if u.target is operator.getitem and u.args[1] == 1]
    assert len(sums) == 1 and sums[0] in second.all_input_nodes
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0][0] is sums[0]  # the returned intermediate sum is the fused op's second output
    inputs = [(torch.randn(2, 5, D), torch.randn(2, 5, D)), (torch.randn(4, 3, D), torch.randn(4, 3, D))]
    assert_same_outputs(reference, gm, inputs)
    for args in inputs:  # bit-exact: the fused reference op computes the same expressions
        with torch.no_grad():
            for a, b in zip(reference(*args), gm(*args)):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_tiny_llama_has_four_fusions():
    # the reference ops kept (fuse_rmsnorm's choice of kernel is tested in test_fuse_rmsnorm.py)
    res = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION, overrides={"fuse_rmsnorm": {"backend": "torch"}})
    record = next(r for r in res.context.history if r.key == "fuse_add_rms_norm")
    # per layer: post-attention norm + next input norm (layer 1's input norm, then the final norm)
    assert record.status == "ok" and record.num_matches == 4
    assert count_op(res.graph, ad.torch_fused_add_rmsnorm) == 4
    assert count_op(res.graph, ad.torch_rmsnorm) == 1  # layer 0's input norm reads the embedding
    first = _positions(res.graph, ad.torch_rmsnorm.default)[0]
    assert first.args[0].target == aten.embedding.default
    assert_matches_hf(res.graph, family_checkpoint("llama"))


class NearMisses(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, r):
        s = x + r                                          # an add that is not normalised
        n1 = ad.torch_rmsnorm(x * r, self.w, 1e-6)         # a norm of a non-add
        n2 = ad.torch_rmsnorm(torch.add(x, r, alpha=2), self.w, 1e-6)  # an add with alpha
        n3 = ad.torch_rmsnorm(x + 1.5, self.w, 1e-6)       # an add of a scalar
        n4 = ad.torch_rmsnorm(x - r, self.w, 1e-6)         # a sub
        return s * 2, n1, n2, n3, n4


def test_near_misses_are_left_alone():
    x, r = torch.randn(2, 5, D), torch.randn(2, 5, D)
    gm = export_gm(NearMisses().eval(), x, r)
    reference = copy.deepcopy(gm)
    assert count_op(reference, ad.torch_rmsnorm) == 4
    gm, record = apply_transform("fuse_add_rms_norm", gm)
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_fused_add_rmsnorm) == 0
    assert count_op(gm, ad.torch_rmsnorm) == 4
    assert gm.code == reference.code
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, D), torch.randn(2, 5, D)),
                                        (torch.randn(1, 3, D), torch.randn(1, 3, D))])


class SumUsedBeforeTheNorm(nn.Module):
    """Doge's order: the scaled residual is computed before the sublayer reads ``norm(h)``, so a
    user of the sum precedes the norm in the graph."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.scale = nn.Parameter(torch.randn(D))
        self.mlp = nn.Linear(D, D)

    def forward(self, x, r):
        h = x + r
        return self.scale * h + self.mlp(ad.torch_rmsnorm(h, self.w, 1e-6))


def test_a_user_of_the_sum_before_the_norm_reads_a_defined_value():
    x, r = torch.randn(2, 5, D), torch.randn(2, 5, D)
    gm = export_gm(SumUsedBeforeTheNorm().eval(), x, r)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_add_rms_norm", gm)
    assert record.num_matches == 1 and count_op(gm, ad.torch_fused_add_rmsnorm) == 1
    gm.graph.lint()  # every node's inputs are defined before it
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, D), torch.randn(2, 5, D)),
                                        (torch.randn(1, 3, D), torch.randn(1, 3, D))])


class ComputedNormWeight(nn.Module):
    """Gemma's norm: the weight is computed (``1 + w``) between the add and the norm."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.mlp = nn.Linear(D, D)

    def forward(self, x, r):
        h = x + r
        y = ad.torch_rmsnorm(h, 1.0 + self.w, 1e-6)
        return h + self.mlp(y)


def test_a_computed_norm_weight_is_waited_for_not_a_reason_to_skip():
    x, r = torch.randn(2, 5, D), torch.randn(2, 5, D)
    gm = export_gm(ComputedNormWeight().eval(), x, r)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_add_rms_norm", gm)
    assert record.num_matches == 1 and count_op(gm, ad.torch_fused_add_rmsnorm) == 1
    gm.graph.lint()
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, D), torch.randn(2, 5, D)),
                                        (torch.randn(1, 3, D), torch.randn(1, 3, D))])
