"""The ``zaya_cca`` export patch: ZAYA's CCA projection, patched, returns HF's q/k/v (two lengths,
with and without a padding mask, attention biases on so the delayed value's first row is the
projection's bias); it exports as one ``torch_cca_conv`` and one width-2 ``torch_causal_conv1d`` with
a dynamic sequence (one token included); a call with an HF cache runs HF's code; the class is
restored after the export."""

import pytest
import torch
from torch.export import Dim
from transformers import ZayaConfig
from transformers.models.zaya import modeling_zaya as hf

from autodeploy.export import apply_export_patches, export_patches
from autodeploy.export.hf_zaya import is_cca_projection

ad = torch.ops.autodeploy
HIDDEN = 64


def _config() -> ZayaConfig:
    return ZayaConfig(vocab_size=128, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_hidden_layers=2, attention_bias=True)


@pytest.fixture(scope="module")
def projection():
    torch.manual_seed(0)
    return hf.ZayaCCAProjection(_config(), layer_idx=0).eval()


def _patched(model: torch.nn.Module):
    """Only this patch, so the test sees nothing else change."""
    return apply_export_patches(model, {**{p.name: False for p in export_patches()}, "zaya_cca": True})


@pytest.mark.parametrize("s", [1, 9])
@pytest.mark.parametrize("masked", [False, True])
def test_patched_projection_returns_hf_qkv(projection, s, masked):
    x = torch.randn(2, s, HIDDEN)
    mask = None
    if masked:
        mask = torch.ones(2, s, dtype=torch.long)
        mask[1, 0] = 0
    with torch.no_grad():
        expected = projection(x, None, mask)
        with _patched(projection):
            out = projection(x, None, mask)
    for name, a, b in zip("qkv", out, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_export_carries_the_ops_with_a_dynamic_sequence(projection):
    # Dim.DYNAMIC, not a named Dim: torch 2.11's solver cannot prove HF's repeat_kv guard
    # min(16*s, 32*s) == 16*s for a named dim (2.13's can); the lengths below show it stays dynamic
    with _patched(projection):
        ep = torch.export.export(projection, (torch.randn(1, 12, HIDDEN), None, None),
                                 dynamic_shapes=({1: Dim.DYNAMIC}, None, None), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_cca_conv.default) == 1 and targets.count(ad.torch_causal_conv1d.default) == 1
    for s in (12, 1, 2, 30):
        x = torch.randn(1, s, HIDDEN)
        with torch.no_grad():
            for a, b in zip(ep.module()(x, None, None), projection(x, None, None)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_call_with_an_hf_cache_runs_hf(projection):
    from transformers import DynamicCache

    config = _config()
    cache = DynamicCache(config=config)
    x = torch.randn(1, 5, HIDDEN)
    with torch.no_grad(), _patched(projection):
        out = projection(x, cache, None)
    assert cache.get_conv_state(0, state_idx=0) is not None
    with torch.no_grad():
        for a, b in zip(out, projection(x, None, None)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_only_unpadded_cca_projections_match_and_the_class_is_restored(projection):
    assert is_cca_projection(projection)
    padded = hf.ZayaCCAProjection(_config(), layer_idx=1)
    padded.conv_qk_grouped.padding = (1,)
    assert not is_cca_projection(padded) and not is_cca_projection(torch.nn.Linear(2, 2))
    original = hf.ZayaCCAProjection.forward
    with _patched(projection):
        assert hf.ZayaCCAProjection.forward is not original
    assert hf.ZayaCCAProjection.forward is original
