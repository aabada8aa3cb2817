"""The ``lightning_attention`` export patch: MiniMax's lightning attention module, patched, equals HF's
own forward (its block form) at two shapes, with and without padding; it exports as one
``torch_linear_attention`` with a dynamic sequence (one token included); calls with an HF cache and
the full-attention layers are left to HF; the class is restored after the export."""

import pytest
import torch
from torch.export import Dim
from transformers import MiniMaxConfig
from transformers.models.minimax import modeling_minimax as hf

from autodeploy.export import apply_export_patches, export_patches
from autodeploy.export.hf_lightning import is_lightning_attention

ad = torch.ops.autodeploy
ONLY = {"lightning_attention": True}


def _config() -> MiniMaxConfig:
    return MiniMaxConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_attention_heads=4, head_dim=8,
                         num_key_value_heads=2, num_hidden_layers=3, block_size=16, num_local_experts=2,
                         num_experts_per_tok=1, layer_types=["linear_attention", "full_attention", "linear_attention"])


@pytest.fixture(scope="module")
def module():
    torch.manual_seed(0)
    return hf.MiniMaxLightningAttention(_config(), layer_idx=2).eval()


def _patched(model: torch.nn.Module):
    """Only this patch, so the test sees nothing else change."""
    return apply_export_patches(model, {**{p.name: False for p in export_patches()}, **ONLY})


@pytest.mark.parametrize("s", [5, 37], ids=["one_block", "three_blocks"])
def test_patched_forward_equals_hf(module, s):
    x = torch.randn(2, s, 32)
    with torch.no_grad():
        expected, _ = module(x, None, None)
        with _patched(module):
            out, state = module(x, None, None)
    assert state is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_padding_rows_are_zeroed_as_hf_does(module):
    x, mask = torch.randn(2, 9, 32), torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        expected, _ = module(x, None, mask)
        with _patched(module):
            out, _ = module(x, None, mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_export_carries_one_linear_attention_with_a_dynamic_sequence(module):
    with _patched(module):
        ep = torch.export.export(module, (torch.randn(1, 20, 32), None, None),
                                 dynamic_shapes=({1: Dim("seq", min=1, max=512)}, None, None), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_linear_attention.default) == 1
    for s in (20, 1, 40):
        x = torch.randn(1, s, 32)
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x, None, None)[0], module(x, None, None)[0], rtol=1e-5,
                                       atol=1e-6)


def test_a_call_with_an_hf_cache_runs_hf_and_fills_the_cache(module):
    x = torch.randn(1, 6, 32)
    cache = hf.MiniMaxCache()
    with torch.no_grad(), _patched(module):
        out, state = module(x, None, None, past_key_values=cache)
    assert state is not None and cache.get_linear_cache(2) is not None
    with torch.no_grad():
        torch.testing.assert_close(out, module(x, None, None)[0], rtol=1e-5, atol=1e-6)


def test_only_lightning_layers_match_and_the_class_is_restored():
    config = _config()
    full = hf.MiniMaxAttention(config, layer_idx=1)
    lightning = hf.MiniMaxLightningAttention(config, layer_idx=0)
    assert is_lightning_attention(lightning) and not is_lightning_attention(full)
    original, full_forward = hf.MiniMaxLightningAttention.forward, hf.MiniMaxAttention.forward
    with _patched(torch.nn.ModuleList([lightning, full])):
        assert hf.MiniMaxLightningAttention.forward is not original
        assert hf.MiniMaxAttention.forward is full_forward
    assert hf.MiniMaxLightningAttention.forward is original
