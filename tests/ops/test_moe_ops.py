"""MoE ops: torch_moe (per-expert), torch_moe_fused (stacked) and grouped_moe_fused (both of its
strategies) against an independent dense formulation and against transformers' own experts
modules; fake kernels under export."""

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import autodeploy.ops  # noqa: F401
from autodeploy.ops.moe import expert_activation
from helpers import rel_rmse

ad = torch.ops.autodeploy
E, H, I, K = 4, 32, 16, 2


def experts(bias=False, scale=0.3, dtype=torch.float32):
    g = [torch.randn(I, H) * scale for _ in range(E)]
    u = [torch.randn(I, H) * scale for _ in range(E)]
    d = [torch.randn(H, I) * scale for _ in range(E)]
    gb = [torch.randn(I) for _ in range(E)] if bias else []
    ub = [torch.randn(I) for _ in range(E)] if bias else []
    db = [torch.randn(H) for _ in range(E)] if bias else []
    cast = lambda ts: [t.to(dtype) for t in ts]  # noqa: E731
    return cast(g), cast(u), cast(d), cast(gb), cast(ub), cast(db)


def stacked(g, u, d, gb, ub, db):
    gate_up = torch.stack([torch.cat([a, b]) for a, b in zip(g, u)])
    gate_up_bias = torch.stack([torch.cat([a, b]) for a, b in zip(gb, ub)]) if gb else None
    return gate_up, torch.stack(d), gate_up_bias, torch.stack(db) if db else None


def routing(shape, k=K):
    """Distinct experts per token (like top-k) and softmax weights, in float32."""
    logits = torch.randn(*shape, E)
    weights, index = torch.topk(logits.softmax(-1), k, dim=-1)
    return index, weights


def dense_reference(x, index, weights, g, u, d, gb, ub, db, act, alpha, limit):
    """Every expert on every token, combined with a scattered [T, E] weight matrix."""
    x2 = x.reshape(-1, H).double()
    outs = []
    for e in range(E):
        b = (lambda ts: ts[e].double() if ts else None)
        h = expert_activation(F.linear(x2, g[e].double(), b(gb)), F.linear(x2, u[e].double(), b(ub)), act, alpha, limit)
        outs.append(F.linear(h, d[e].double(), b(db)))
    combine = torch.zeros(x2.shape[0], E, dtype=torch.float64).scatter_add_(
        1, index.reshape(-1, index.shape[-1]), weights.reshape(-1, weights.shape[-1]).double())
    return torch.einsum("te,eth->th", combine, torch.stack(outs)).reshape(x.shape)


ACTS = [("silu", 1.0, 0.0, False), ("swiglu_oai", 1.702, 1.5, True)]  # low limit: the clamps matter


@pytest.mark.parametrize("act,alpha,limit,bias", ACTS, ids=[a[0] for a in ACTS])
@pytest.mark.parametrize("shape", [(7,), (2, 5), (1,)], ids=["T7", "b2s5", "T1"])
def test_all_ops_equal_dense_reference(act, alpha, limit, bias, shape):
    g, u, d, gb, ub, db = experts(bias)
    x = torch.randn(*shape, H)
    index, weights = routing(shape)
    ref = dense_reference(x, index, weights, g, u, d, gb, ub, db, act, alpha, limit)
    outs = {
        "torch_moe": ad.torch_moe(x, index, weights, g, u, d, gb, ub, db, act, alpha, limit),
        "torch_moe_fused": ad.torch_moe_fused(x, index, weights, *stacked(g, u, d, gb, ub, db), act, alpha, limit),
    }
    for pairs in (0, 10**6):  # sorted grouped GEMMs / gathered-weight bmm
        outs[f"grouped[{pairs}]"] = ad.grouped_moe_fused(x, index, weights, *stacked(g, u, d, gb, ub, db), act, alpha,
                                                         limit, pairs)
    for name, out in outs.items():
        assert out.shape == x.shape and out.dtype == x.dtype, name
        assert rel_rmse(out, ref) < 1e-6, (name, rel_rmse(out, ref))
    if act == "swiglu_oai":  # the clamp really changed something at this limit
        no_clamp = dense_reference(x, index, weights, g, u, d, gb, ub, db, act, alpha, 1e9)
        assert rel_rmse(no_clamp, ref) > 1e-2


def test_experts_without_tokens_and_top1():
    g, u, d, *_ = experts()
    x = torch.randn(6, H)
    index = torch.tensor([[1], [1], [3], [1], [3], [3]])  # experts 0 and 2 get nothing
    weights = torch.rand(6, 1)
    ref = dense_reference(x, index, weights, g, u, d, [], [], [], "silu", 1.0, 0.0)
    assert rel_rmse(ad.torch_moe(x, index, weights, g, u, d, [], [], []), ref) < 1e-6
    for pairs in (0, 100):
        out = ad.grouped_moe_fused(x, index, weights, *stacked(g, u, d, [], [], []), bmm_max_pairs=pairs)
        assert rel_rmse(out, ref) < 1e-6


def test_pairs_of_experts_on_other_ranks_contribute_nothing():
    """Expert parallelism marks a pair whose expert lives on another rank with id -1 and weight 0:
    every op (reference loop, sorted grouped GEMMs, gathered-weight bmm, oneDNN per-expert) skips
    it, so the output is the local pairs' sum alone."""
    g, u, d, *_ = experts()
    x = torch.randn(7, H)
    index, weights = routing((7,))
    remote = torch.rand(7, K) < 0.5
    local_index, local_weights = index.masked_fill(remote, -1), weights.masked_fill(remote, 0.0)
    ref = dense_reference(x, index.masked_fill(remote, 0), local_weights, g, u, d, [], [], [], "silu", 1.0, 0.0)
    outs = {"torch_moe": ad.torch_moe(x, local_index, local_weights, g, u, d, [], [], []),
            "onednn": ad.onednn_grouped_moe_fused(x, local_index, local_weights, [torch.cat([a, b]) for a, b in zip(g, u)],
                                                  d)}
    for pairs in (0, 100):
        outs[f"grouped[{pairs}]"] = ad.grouped_moe_fused(x, local_index, local_weights, *stacked(g, u, d, [], [], []),
                                                         bmm_max_pairs=pairs)
    assert remote.any() and (~remote).any()
    for name, out in outs.items():
        assert rel_rmse(out, ref) < 1e-6, name


def test_low_precision_input_with_fp32_routing_weights():
    g, u, d, *_ = experts(dtype=torch.bfloat16)
    x = torch.randn(5, H, dtype=torch.bfloat16)
    index, weights = routing((5,))  # float32, as HF routers produce
    ref = dense_reference(x.float(), index, weights, *[[t.float() for t in ts] for ts in (g, u, d)], [], [], [],
                          "silu", 1.0, 0.0)
    for out in (ad.torch_moe(x, index, weights, g, u, d, [], [], []),
                ad.grouped_moe_fused(x, index, weights, *stacked(g, u, d, [], [], [])),
                ad.grouped_moe_fused(x, index, weights, *stacked(g, u, d, [], [], []), bmm_max_pairs=100)):
        assert out.dtype == torch.bfloat16
        assert rel_rmse(out, ref) < 2e-2


def _hf_experts(cls, config):
    config._experts_implementation = "eager"  # the reference loop over hit experts
    module = cls(config).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


@pytest.mark.parametrize("cls,config", [
    (MixtralExperts, MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E)),
    (Qwen3MoeExperts, Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E)),
], ids=["mixtral", "qwen3_moe"])
def test_stacked_ops_equal_hf_experts(cls, config):
    module = _hf_experts(cls, config)
    x = torch.randn(9, H)
    index, weights = routing((9,))
    with torch.no_grad():
        ref = module(x, index, weights)
        outs = [ad.torch_moe_fused(x, index, weights, module.gate_up_proj, module.down_proj),
                ad.grouped_moe_fused(x, index, weights, module.gate_up_proj, module.down_proj),
                ad.grouped_moe_fused(x, index, weights, module.gate_up_proj, module.down_proj, bmm_max_pairs=100)]
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_gpt_oss_experts_in_canonical_layout_equal_hf():
    """GPT-OSS stores [E, H, 2I] with gate/up interleaved, plus biases: transposed and de-interleaved
    once, the canonical op with act swiglu_oai computes what HF computes."""
    config = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, swiglu_limit=1.0)
    module = _hf_experts(GptOssExperts, config)
    x = torch.randn(9, H) * 3
    index, weights = routing((9,))
    gate_up = module.gate_up_proj.detach().transpose(1, 2)
    gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    bias = module.gate_up_proj_bias.detach()
    bias = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
    down = module.down_proj.detach().transpose(1, 2)
    with torch.no_grad():
        ref = module(x, index, weights)
        for pairs in (0, 100):
            out = ad.grouped_moe_fused(x, index, weights, gate_up, down, bias, module.down_proj_bias, "swiglu_oai",
                                       config.swiglu_alpha, config.swiglu_limit, pairs)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        wrong = ad.torch_moe_fused(x, index, weights, gate_up, down, bias, module.down_proj_bias, "silu")
    assert rel_rmse(wrong, ref) > 1e-2  # the activation matters: the check above can fail


def test_list_lengths_are_checked():
    g, u, d, *_ = experts()
    x = torch.randn(3, H)
    index, weights = routing((3,))
    with pytest.raises(ValueError, match="one entry per expert"):
        ad.torch_moe(x, index, weights, g, u[:-1], d, [], [], [])
    with pytest.raises(ValueError, match="gate_biases"):
        ad.torch_moe(x, index, weights, g, u, d, [torch.zeros(I)], [], [])
    with pytest.raises(ValueError, match="unknown MoE activation"):
        ad.torch_moe(x, index, weights, g, u, d, [], [], [], "gelu")


class _Calls(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g, u, d, *_ = experts()
        param = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.g = torch.nn.ParameterList([param(t) for t in g])
        self.u = torch.nn.ParameterList([param(t) for t in u])
        self.d = torch.nn.ParameterList([param(t) for t in d])
        gate_up, down, _, _ = stacked(g, u, d, [], [], [])
        self.gate_up = param(gate_up)
        self.down = param(down)

    def forward(self, x, index, weights):
        a = ad.torch_moe(x, index, weights, list(self.g), list(self.u), list(self.d), [], [], [])
        b = ad.torch_moe_fused(x, index, weights, self.gate_up, self.down)
        c = ad.grouped_moe_fused(x, index, weights, self.gate_up, self.down)
        return a + b + c


def test_ops_survive_export_with_dynamic_tokens():
    module = _Calls().eval()
    x = torch.randn(5, H)
    index, weights = routing((5,))
    t = Dim("tokens", min=1, max=64)
    ep = torch.export.export(module, (x, index, weights), dynamic_shapes=({0: t}, {0: t}, {0: t}), strict=False)
    gm = ep.module()
    for op in (ad.torch_moe.default, ad.torch_moe_fused.default, ad.grouped_moe_fused.default):
        assert len(gm.graph.find_nodes(op="call_function", target=op)) == 1
    for tokens in (1, 11):
        x = torch.randn(tokens, H)
        index, weights = routing((tokens,))
        with torch.no_grad():
            torch.testing.assert_close(gm(x, index, weights), module(x, index, weights))
