"""The ``state_kernels`` export patch: HF's conv / SSM / delta-rule kernel functions become the
canonical state ops during export, and only then.

Each wrapper is compared with HF's own torch fallback on random inputs at two shapes; calls the
canonical ops cannot take (an initial state, a final state requested) go to HF's function; a
whole Mamba2 export carries the ops and equals HF; the functions are restored afterwards.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi
from transformers.models.mamba import modeling_mamba as hf_mamba
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

from autodeploy.export import state_kernels
from autodeploy.export.patch_registry import apply_export_patches
from autodeploy.transform.interface import Stage
from helpers import assert_matches_hf, build, count_op, coverage_checkpoint, rel_rmse

ad = torch.ops.autodeploy
SHAPES = [(1, 5), (2, 11)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("b,s", SHAPES)
def test_conv_wrapper_equals_hf(b, s):
    g = _gen(s)
    x, w, bias = torch.randn(b, 12, s, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    for act in (None, "silu"):
        ref = hf_mamba2.causal_conv1d_fn(x, w, bias, activation=act)
        out = state_kernels._conv_fn(hf_mamba2.causal_conv1d_fn)(x, w, bias, activation=act)
        assert rel_rmse(out, ref) < 1e-6


@pytest.mark.parametrize("b,s", SHAPES)
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, float("inf"))])
def test_mamba2_wrapper_equals_hf(b, s, limit):
    g = _gen(s)
    h, p, groups, n = 4, 8, 2, 6
    x, dt = torch.randn(b, s, h, p, generator=g), torch.randn(b, s, h, generator=g)
    A = -torch.rand(h, generator=g) - 0.1
    B, C = torch.randn(b, s, groups, n, generator=g), torch.randn(b, s, groups, n, generator=g)
    D, dt_bias = torch.randn(h, generator=g), torch.randn(h, generator=g)
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=limit)
    ref = hf_mamba2.mamba2_chunk_scan(x, dt, A, B, C, 4, **kw)
    out = state_kernels._mamba2_fn(hf_mamba2.mamba2_chunk_scan)(x, dt, A, B, C, 4, **kw)
    assert rel_rmse(out, ref.to(out.dtype)) < 1e-5


@pytest.mark.parametrize("b,s", SHAPES)
def test_mamba1_wrapper_equals_hf(b, s):
    g = _gen(s)
    c, n = 10, 6
    x, dt, z = (torch.randn(b, c, s, generator=g) for _ in range(3))
    A = -torch.rand(c, n, generator=g) - 0.1
    B, C = torch.randn(b, n, s, generator=g), torch.randn(b, n, s, generator=g)
    kw = dict(D=torch.randn(c, generator=g), z=z, delta_bias=torch.randn(c, generator=g), delta_softplus=True)
    ref = hf_mamba.mamba_selective_scan(x, dt, A, B, C, **kw)
    out = state_kernels._mamba1_fn(hf_mamba.mamba_selective_scan)(x, dt, A, B, C, **kw)
    assert rel_rmse(out, ref) < 1e-5


@pytest.mark.parametrize("b,s", SHAPES)
@pytest.mark.parametrize("module,fn,channelwise", [(hf_qwen3_next, "torch_chunk_gated_delta_rule", False),
                                                    (hf_kimi, "chunk_kimi_delta_attention", True)])
def test_delta_rule_wrappers_equal_hf(b, s, module, fn, channelwise):
    g = _gen(s)
    h, dk, dv = 2, 8, 6
    q, k = torch.randn(b, s, h, dk, generator=g), torch.randn(b, s, h, dk, generator=g)
    v = torch.randn(b, s, h, dv, generator=g)
    gate = -F.softplus(torch.randn(b, s, h, dk, generator=g) if channelwise else torch.randn(b, s, h, generator=g))
    beta = torch.rand(b, s, h, generator=g)
    original = getattr(module, fn)
    op = ad.torch_gated_delta_rule_channelwise if channelwise else ad.torch_gated_delta_rule
    ref, _ = original(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    out, state = state_kernels._delta_rule_fn(original, op)(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    assert state is None and rel_rmse(out, ref) < 1e-5


def test_calls_with_state_go_to_hf():
    """Near miss: with an initial state or a final state requested the wrapper must not drop
    them; HF's function runs and returns its (output, state) pair."""
    g = _gen(0)
    h, p, n = 2, 4, 3
    x, dt = torch.randn(1, 3, h, p, generator=g), torch.randn(1, 3, h, generator=g)
    B, C = torch.randn(1, 3, 1, n, generator=g), torch.randn(1, 3, 1, n, generator=g)
    A, D = -torch.ones(h), torch.ones(h)
    wrapper = state_kernels._mamba2_fn(hf_mamba2.mamba2_chunk_scan)
    out = wrapper(x, dt, A, B, C, 4, D=D, dt_softplus=True, return_final_states=True)
    ref = hf_mamba2.mamba2_chunk_scan(x, dt, A, B, C, 4, D=D, dt_softplus=True, return_final_states=True)
    assert isinstance(out, tuple) and torch.equal(out[1], ref[1])


def test_patch_swaps_only_during_export_and_restores():
    original, conv = hf_mamba2.mamba2_chunk_scan, hf_qwen3_next.causal_conv1d_fn
    with apply_export_patches(torch.nn.Module(), {}):
        assert hf_mamba2.mamba2_chunk_scan is not original
        assert hf_qwen3_next.causal_conv1d_fn is not conv  # every loaded modelling module, not one
    assert hf_mamba2.mamba2_chunk_scan is original and hf_qwen3_next.causal_conv1d_fn is conv
    with apply_export_patches(torch.nn.Module(), {"state_kernels": False}):
        assert hf_mamba2.mamba2_chunk_scan is original


def test_mamba2_export_carries_the_ops_and_equals_hf():
    path, _ = coverage_checkpoint("mamba2")
    gm = build(path, up_to=Stage.WEIGHT_LOAD, max_seq_len=32).graph
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(path).num_hidden_layers
    assert count_op(gm, ad.torch_ssm) == count_op(gm, ad.torch_causal_conv1d) == layers
    assert_matches_hf(gm, path, shapes=((1, 5), (2, 9)))
