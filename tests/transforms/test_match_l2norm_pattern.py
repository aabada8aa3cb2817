"""match_l2norm_pattern: Qwen3-Next's and Kimi's l2norm (and the fp32-upcast form) -> torch_l2norm;
F.normalize and norms over another dim are left alone."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

ad = torch.ops.autodeploy
aten = torch.ops.aten
NORM_OPS = [aten.rsqrt, aten.sqrt, aten.sum]


class L2Norm(nn.Module):
    """``form``: qwen (x * rsqrt), kimi (x / sqrt), swapped (rsqrt * x), pow (x.pow(2) for x * x)."""

    def __init__(self, form="qwen", eps=1e-6, dim=-1, upcast=False):
        super().__init__()
        self.form, self.eps, self.dim, self.upcast = form, eps, dim, upcast

    def forward(self, x):
        xf = x.float() if self.upcast else x
        sq = xf.pow(2) if self.form == "pow" else xf * xf
        s = sq.sum(dim=self.dim, keepdim=True) + self.eps
        if self.form == "kimi":
            y = xf / torch.sqrt(s)
        elif self.form == "swapped":
            y = torch.rsqrt(s) * xf
        else:
            y = xf * torch.rsqrt(s)
        return y.to(x.dtype) if self.upcast else y


class QKNorm(nn.Module):
    """q and k projected, split into heads and L2-normalised over the head dim, as around a
    delta-rule layer."""

    def __init__(self, form="qwen", eps=1e-6, upcast=False):
        super().__init__()
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 32)
        self.norm = L2Norm(form, eps, upcast=upcast)

    def forward(self, x):
        q = self.q(x).view(*x.shape[:-1], 4, 8)
        k = self.k(x).view(*x.shape[:-1], 4, 8)
        return self.norm(q), self.norm(k)


def _run(module, x):
    gm = export_gm(module.eval(), x)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("match_l2norm_pattern", gm)
    return reference, gm, record


def _eps_of(gm):
    """The eps of every torch_l2norm (the graph drops an argument equal to the schema's default, 1e-6)."""
    nodes = gm.graph.find_nodes(op="call_function", target=ad.torch_l2norm.default)
    return [n.args[1] if len(n.args) > 1 else n.kwargs.get("eps", 1e-6) for n in nodes]


def test_qwen_and_kimi_forms_match_and_numerics_hold():
    for form in ("qwen", "kimi"):
        reference, gm, record = _run(QKNorm(form), torch.randn(2, 5, 32))
        assert record.num_matches == 2, form
        assert count_op(gm, ad.torch_l2norm) == 2
        assert count_op(gm, NORM_OPS + [aten.div]) == 0
        assert _eps_of(gm) == [1e-6, 1e-6]
        assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(3, 1, 32),)])


def test_eps_is_read_from_the_graph():
    # small inputs, so that the sum of squares (~8e-4) and eps (1e-3) are of one size: a wrong eps shows
    module = L2Norm("kimi", eps=1e-3)
    reference, gm, record = _run(module, torch.randn(2, 5, 8) * 0.01)
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_l2norm) == 1 and count_op(gm, NORM_OPS) == 0
    assert _eps_of(gm) == [1e-3]
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 8) * 0.01,), (torch.randn(1, 3, 8) * 0.01,)])


def test_operand_order_and_pow_variants():
    for form in ("swapped", "pow"):
        reference, gm, record = _run(L2Norm(form, eps=1e-5), torch.randn(2, 3, 4, 16))
        assert record.num_matches == 1, form
        assert count_op(gm, ad.torch_l2norm) == 1
        assert count_op(gm, NORM_OPS + [aten.pow]) == 0
        assert _eps_of(gm) == [1e-5]
        assert_same_outputs(reference, gm, [(torch.randn(2, 3, 4, 16),), (torch.randn(1, 7, 4, 16),)])


def test_bf16_upcast_form_matches_with_its_casts():
    module = QKNorm("kimi", upcast=True).to(torch.bfloat16)
    reference, gm, record = _run(module, torch.randn(2, 5, 32, dtype=torch.bfloat16))
    assert record.num_matches == 2
    assert count_op(gm, ad.torch_l2norm) == 2
    assert count_op(gm, NORM_OPS + [aten.div]) == 0
    assert count_op(gm, [aten.to, aten._to_copy]) == 0  # the casts went with the norm
    for node in gm.graph.find_nodes(op="call_function", target=ad.torch_l2norm.default):
        assert node.meta["val"].dtype == torch.bfloat16
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32, dtype=torch.bfloat16),),
                                        (torch.randn(3, 2, 32, dtype=torch.bfloat16),)], tol=1e-2)


def test_bf16_without_casts_matches_and_stays_close():
    """Written in bf16 without an upcast: the op computes in fp32 (one rounding), close to the bf16 ops."""
    reference, gm, record = _run(L2Norm("qwen"), torch.randn(2, 5, 16, dtype=torch.bfloat16))
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_l2norm) == 1 and count_op(gm, NORM_OPS) == 0
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 16, dtype=torch.bfloat16),),
                                        (torch.randn(1, 9, 16, dtype=torch.bfloat16),)], tol=1e-2)


class Normalize(nn.Module):
    def forward(self, x):
        return F.normalize(x, dim=-1, eps=1e-6)


def test_near_misses_are_left_alone():
    """F.normalize (eps clamps the norm: another function), a norm over dim 1, a norm over two dims."""
    for module in (Normalize(), L2Norm("qwen", dim=1), L2Norm("kimi", dim=1), L2Norm("qwen", dim=(-2, -1))):
        x = torch.randn(2, 16, 16)
        reference, gm, record = _run(module, x)
        assert record.num_matches == 0, module
        assert count_op(gm, ad.torch_l2norm) == 0
        assert gm.code == reference.code
        assert_same_outputs(reference, gm, [(torch.randn(2, 16, 16),), (torch.randn(3, 16, 16),)])
