"""The ``rg_lru`` export patch: RecurrentGemma's recurrent block, patched, equals HF's own forward
(a fresh sequence and one whose positions start at 0 mid-batch) at two lengths; it exports as one
``torch_causal_conv1d`` and one ``torch_diagonal_recurrence`` with a dynamic sequence (one token
included); calls with a cache run HF's code; the classes are restored after the export."""

import pytest
import torch
from torch.export import Dim
from transformers import RecurrentGemmaConfig
from transformers.models.recurrent_gemma import modeling_recurrent_gemma as hf

from autodeploy.export import apply_export_patches, export_patches
from autodeploy.export.hf_rg_lru import is_recurrent_block, is_rg_lru

ad = torch.ops.autodeploy
HIDDEN = 32


def _config() -> RecurrentGemmaConfig:
    return RecurrentGemmaConfig(vocab_size=64, hidden_size=HIDDEN, lru_width=48, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=8, intermediate_size=64, num_hidden_layers=3,
                                conv1d_width=4, attention_window_size=16)


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    module = hf.RecurrentGemmaRecurrentBlock(_config(), layer_idx=0).eval()
    with torch.no_grad():  # HF's init leaves the RG-LRU parameters empty
        for p in module.rg_lru.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module


def _patched(model: torch.nn.Module):
    """Only this patch, so the test sees nothing else change."""
    return apply_export_patches(model, {**{p.name: False for p in export_patches()}, "rg_lru": True})


@pytest.mark.parametrize("s", [3, 19])
def test_patched_block_equals_hf(block, s):
    x = torch.randn(2, s, HIDDEN)
    positions = torch.stack([torch.arange(s), torch.arange(s) + 5])  # the second row continues a history
    with torch.no_grad():
        expected, _ = block(x, positions, None, use_cache=False)
        with _patched(block):
            out, _ = block(x, positions, None, use_cache=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_export_carries_the_conv_and_the_recurrence_with_a_dynamic_sequence(block):
    x = torch.randn(1, 12, HIDDEN)
    positions = torch.arange(12)[None]
    seq = Dim("seq", min=1, max=512)
    with _patched(block):
        ep = torch.export.export(block, (x, positions, None, False), dynamic_shapes=({1: seq}, {1: seq}, None, None),
                                 strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_causal_conv1d.default) == 1
    assert targets.count(ad.torch_diagonal_recurrence.default) == 1
    for s in (12, 1, 30):
        x, positions = torch.randn(1, s, HIDDEN), torch.arange(s)[None]
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x, positions, None, False)[0],
                                       block(x, positions, None, use_cache=False)[0], rtol=1e-5, atol=1e-6)


def test_a_call_with_a_cache_runs_hf(block):
    x, positions = torch.randn(1, 5, HIDDEN), torch.arange(5)[None]
    with torch.no_grad(), _patched(block):
        out, _ = block(x, positions, None, use_cache=True)
    assert block.conv1d_state is not None and block.rg_lru.recurrent_states is not None
    with torch.no_grad():
        torch.testing.assert_close(out, block(x, positions, None, use_cache=False)[0], rtol=1e-5, atol=1e-6)


def test_only_the_recurrent_modules_match_and_the_classes_are_restored():
    config = _config()
    attention = hf.RecurrentGemmaAttention(config, layer_idx=1)
    recurrent = hf.RecurrentGemmaRecurrentBlock(config, layer_idx=0)
    assert is_recurrent_block(recurrent) and is_rg_lru(recurrent.rg_lru)
    assert not is_recurrent_block(attention) and not is_rg_lru(recurrent)
    forward, scan, attention_forward = (hf.RecurrentGemmaRecurrentBlock.forward, hf.RecurrentGemmaRglru._rnn_scan,
                                        hf.RecurrentGemmaAttention.forward)
    with _patched(torch.nn.ModuleList([recurrent, attention])):
        assert hf.RecurrentGemmaRecurrentBlock.forward is not forward and hf.RecurrentGemmaRglru._rnn_scan is not scan
        assert hf.RecurrentGemmaAttention.forward is attention_forward
    assert hf.RecurrentGemmaRecurrentBlock.forward is forward and hf.RecurrentGemmaRglru._rnn_scan is scan
