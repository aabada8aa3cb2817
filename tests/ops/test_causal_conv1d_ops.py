"""torch_causal_conv1d against a per-token loop and HF's own conv code (its ``causal_conv1d_fn``
and the LFM2 short-conv block); fake kernels and export. The cached variant is tested with the
SSM ops in test_ssm_ops.py (one scheduling harness for all cached state-space ops)."""

from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim
from transformers import Lfm2Config
from transformers.models.lfm2 import modeling_lfm2 as hf_lfm2
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2

import autodeploy.ops.ssm  # noqa: F401  (registers the ops, the conv ones included)

ad = torch.ops.autodeploy
RTOL, ATOL = 1e-5, 1e-5


def _torch_path(fn):
    """HF's torch fallback itself, even if a kernel package got installed and swapped in."""
    return getattr(fn, "__wrapped__", fn)


def _loop_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               activation: Optional[str]) -> torch.Tensor:
    """out[b, t, c] = act(bias[c] + sum_j w[c, j] * x[b, t - (k - 1) + j, c]), zeros before token 0;
    in float64, token by token."""
    w = weight.reshape(weight.shape[0], -1).double()
    k = w.shape[1]
    b, s, c = x.shape
    out = torch.zeros(b, s, c, dtype=torch.float64)
    for t in range(s):
        acc = torch.zeros(b, c, dtype=torch.float64) if bias is None else bias.double().expand(b, c).clone()
        for j in range(k):
            src = t - (k - 1) + j
            if src >= 0:
                acc += w[:, j] * x[:, src].double()
        out[:, t] = F.silu(acc) if activation == "silu" else acc
    return out.to(x.dtype)


@pytest.mark.parametrize("b,s,c,k", [(2, 9, 6, 4), (1, 3, 5, 4), (3, 17, 8, 2), (1, 6, 4, 1)])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_per_token_loop(b, s, c, k, activation, with_bias):
    # (1, 3, 5, 4): the sequence is shorter than the kernel; k=1 has no history at all
    x, weight = torch.randn(b, s, c), torch.randn(c, 1, k)
    bias = torch.randn(c) if with_bias else None
    out = ad.torch_causal_conv1d(x, weight, bias, activation)
    assert out.shape == (b, s, c) and out.dtype == x.dtype and out.is_contiguous()
    torch.testing.assert_close(out, _loop_conv(x, weight, bias, activation), rtol=RTOL, atol=ATOL)


def test_two_dimensional_weight_is_the_same_conv():
    x, weight, bias = torch.randn(2, 7, 6), torch.randn(6, 1, 4), torch.randn(6)
    assert torch.equal(ad.torch_causal_conv1d(x, weight[:, 0], bias, "silu"),
                       ad.torch_causal_conv1d(x, weight, bias, "silu"))


def test_is_causal():
    x, weight = torch.randn(1, 10, 4), torch.randn(4, 1, 4)
    changed = x.clone()
    changed[:, 6:] += 5.0
    a, b = ad.torch_causal_conv1d(x, weight, None, "silu"), ad.torch_causal_conv1d(changed, weight, None, "silu")
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.allclose(a[:, 6:], b[:, 6:])


def test_unknown_activation_is_rejected():
    with pytest.raises(ValueError, match="activation"):
        ad.torch_causal_conv1d(torch.randn(1, 3, 4), torch.randn(4, 1, 2), None, "gelu")


@pytest.mark.parametrize("activation", ["silu", None])
def test_matches_hf_causal_conv1d_fn(activation):
    """HF's function takes [b, c, s]; the op takes [b, s, c] and needs no transposes around it."""
    x, weight, bias = torch.randn(2, 11, 6), torch.randn(6, 1, 4), torch.randn(6)
    hf = _torch_path(hf_mamba2.causal_conv1d_fn)(x.transpose(1, 2), weight.squeeze(1), bias, activation=activation)
    torch.testing.assert_close(ad.torch_causal_conv1d(x, weight, bias, activation), hf.transpose(1, 2),
                               rtol=RTOL, atol=ATOL)


def test_bf16_follows_hf_dtypes():
    """bf16 input with fp32 weights: HF convolves in the weight's dtype and casts back."""
    x, weight, bias = torch.randn(2, 9, 6).bfloat16(), torch.randn(6, 1, 4), torch.randn(6)
    out = ad.torch_causal_conv1d(x, weight, bias, "silu")
    hf = _torch_path(hf_mamba2.causal_conv1d_fn)(x.transpose(1, 2), weight.squeeze(1), bias, activation="silu")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, hf.transpose(1, 2))


def _lfm2_block():
    cfg = Lfm2Config(hidden_size=16, conv_L_cache=3, conv_bias=True, num_hidden_layers=1, layer_types=["conv"],
                     intermediate_size=32, num_attention_heads=2, num_key_value_heads=2)
    block = hf_lfm2.Lfm2ShortConv(cfg, 0).eval()
    with torch.no_grad():
        block.conv.bias.normal_()  # nn.Conv1d's default init is small; make the bias matter
    return block


def test_lfm2_short_conv_built_from_the_op_matches_hf():
    block = _lfm2_block()
    h = torch.randn(2, 7, 16)
    with torch.no_grad():
        gate_b, gate_c, x = block.in_proj(h).chunk(3, dim=-1)
        y = ad.torch_causal_conv1d(gate_b * x, block.conv.weight, block.conv.bias, None)
        out = block.out_proj(gate_c * y)
        torch.testing.assert_close(out, block(h), rtol=RTOL, atol=ATOL)


def test_opcheck():
    x, weight, bias = torch.randn(2, 5, 6), torch.randn(6, 1, 4), torch.randn(6)
    torch.library.opcheck(ad.torch_causal_conv1d, (x, weight, bias, "silu"))
    torch.library.opcheck(ad.torch_causal_conv1d, (x, weight[:, 0], None, None))


class _Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 1, 4))
        self.bias = torch.nn.Parameter(torch.randn(6))

    def forward(self, x):
        return ad.torch_causal_conv1d(x, self.weight, self.bias, "silu") + 1.0


def test_export_with_dynamic_sequence_serves_other_lengths():
    model = _Conv()
    ep = torch.export.export(model, (torch.randn(1, 9, 6),), dynamic_shapes=({1: Dim("seq", min=1, max=4096)},),
                             strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_causal_conv1d.default) == 1
    for s in (9, 3, 1, 40):
        x = torch.randn(1, s, 6)
        assert torch.equal(ep.module()(x), model(x))
