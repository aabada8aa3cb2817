"""match_rmsnorm_pattern: Llama- and Gemma-style RMSNorm -> torch_rmsnorm."""

import copy

import torch
from torch import nn

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

ad = torch.ops.autodeploy
aten = torch.ops.aten


class LlamaNorm(nn.Module):
    def __init__(self, d, eps=1e-5, weight_first=True, exponent=2, dim=-1):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))
        self.eps, self.weight_first, self.exponent, self.dim = eps, weight_first, exponent, dim

    def forward(self, x):
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(self.exponent).mean(self.dim, keepdim=True) + self.eps)
        return self.w * xf.to(dtype) if self.weight_first else xf.to(dtype) * self.w


class GemmaNorm(nn.Module):
    def __init__(self, d, offset=1.0):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d) * 0.1)
        self.offset = offset

    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (out * (self.offset + self.w.float())).type_as(x)


class TwoNorms(nn.Module):
    """Two norms around a linear, as in a block (QK-norm over the head dim included)."""

    def __init__(self):
        super().__init__()
        self.n1, self.lin, self.n2 = LlamaNorm(32), nn.Linear(32, 32), LlamaNorm(8, weight_first=False)

    def forward(self, x):
        h = self.lin(self.n1(x))
        return self.n2(h.view(*h.shape[:-1], 4, 8))


def _run(module, x):
    gm = export_gm(module, x)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("match_rmsnorm_pattern", gm)
    return reference, gm, record


def test_llama_norms_match_and_numerics_hold():
    x = torch.randn(2, 5, 32)
    reference, gm, record = _run(TwoNorms().eval(), x)
    assert record.num_matches == 2
    assert count_op(gm, ad.torch_rmsnorm) == 2
    assert count_op(gm, [aten.rsqrt, aten.pow, aten.mean]) == 0
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(3, 1, 32),)])
    # a handler's new nodes keep the module the matched norm came from (the pattern set copies it)
    paths = [list(n.meta["nn_module_stack"].values())[-1][0] for n in gm.graph.nodes
             if n.op == "call_function" and n.target == ad.torch_rmsnorm.default]
    assert paths == ["n1", "n2"]


def test_gemma_offset_norm():
    x = torch.randn(2, 5, 16)
    reference, gm, record = _run(GemmaNorm(16).eval(), x)
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_rmsnorm) == 1
    assert count_op(gm, [aten.rsqrt, aten.pow, aten.mean]) == 0
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 16),), (torch.randn(1, 9, 16),)])


def test_bf16_norm_with_casts():
    module = LlamaNorm(16).to(torch.bfloat16).eval()
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    reference, gm, record = _run(module, x)
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_rmsnorm) == 1
    assert count_op(gm, [aten.rsqrt, aten.pow, aten.mean]) == 0
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 16, dtype=torch.bfloat16),),
                                        (torch.randn(1, 7, 16, dtype=torch.bfloat16),)], tol=1e-2)


def test_any_weight_expression_is_a_norm_weight():
    """``x_normed * (2 + w)`` is an RMSNorm whose weight is ``2 + w``: canonical and exact."""
    x = torch.randn(2, 5, 16)
    reference, gm, record = _run(GemmaNorm(16, offset=2.0).eval(), x)
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_rmsnorm) == 1
    assert count_op(gm, [aten.rsqrt, aten.pow, aten.mean]) == 0
    node = gm.graph.find_nodes(op="call_function", target=ad.torch_rmsnorm.default)[0]
    assert node.args[1].target == aten.add.Tensor  # the weight is the expression 2 + w
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 16),), (torch.randn(1, 2, 16),)])


def test_near_misses_are_left_alone():
    for module in (LlamaNorm(16, exponent=4), LlamaNorm(16, dim=1)):
        x = torch.randn(2, 16, 16)
        reference, gm, record = _run(module.eval(), x)
        assert record.num_matches == 0, type(module).__name__
        assert count_op(gm, ad.torch_rmsnorm) == 0
        assert count_op(gm, aten.rsqrt) == 1
        assert gm.code == reference.code
        assert_same_outputs(reference, gm, [(torch.randn(2, 16, 16),), (torch.randn(3, 16, 16),)])


def test_a_match_is_rewritten_without_tracing(monkeypatch):
    """Issue 21 (build time): a match becomes ``torch_rmsnorm`` directly; no replacement function
    is traced with ``make_fx`` per match (inductor's ``register_replacement`` did, ~10 ms each,
    25 times in ``small``). The patterns are registered by the first run; the second counts."""
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    _run(TwoNorms().eval(), torch.randn(2, 5, 32))  # registers the pattern set
    calls = []
    real_make_fx = proxy_tensor.make_fx

    def counting_make_fx(*args, **kwargs):
        calls.append(args[0])
        return real_make_fx(*args, **kwargs)

    monkeypatch.setattr(proxy_tensor, "make_fx", counting_make_fx)
    reference, gm, record = _run(TwoNorms().eval(), torch.randn(2, 5, 32))
    assert record.num_matches == 2 and count_op(gm, ad.torch_rmsnorm) == 2
    assert calls == []
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(3, 1, 32),)])
