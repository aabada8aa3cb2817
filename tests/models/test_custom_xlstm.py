"""The lean xLSTM (``autodeploy/models/custom/modeling_xlstm.py``) against HF's ``xLSTMForCausalLM``:
the mLSTM kernel against HF's recurrent and chunkwise kernels, then block -> layer -> logits ->
export at two shapes -> greedy tokens through ``autodeploy.LLM``.

The configs use ``chunk_size=4`` so that HF's chunkwise scan really runs several chunks plus a
per-token remainder (13 tokens = 3 chunks + 1), and every weight gets random noise: HF's
initialisation zeroes the gate weights, which would make the gates the same for every token and
leave the stabiliser untested.

HF's own state cache is sized with the config's rounded ``qk_dim``/``v_dim`` (multiples of 64),
not the layer's widths, so HF's cached forward fails for these tiny widths; every HF reference
here runs with ``use_cache=False`` (as the coverage sweep's reference does).
"""

import logging
import os
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, xLSTMConfig, xLSTMForCausalLM
from transformers.models.xlstm import modeling_xlstm as hf_xlstm

from autodeploy import LLM, SamplingParams
from autodeploy.models.custom import custom_model_for
from autodeploy.models.custom.modeling_xlstm import XLSTMForCausalLM
from autodeploy.models.custom.testing import (
    assert_block_matches, assert_exports_at_two_shapes, assert_layer_matches, assert_logits_match,
    assert_rmse_close, copy_weights,
)
from autodeploy.models.presets import write_random_checkpoint

ad = torch.ops.autodeploy
VOCAB = 256
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_heads=4, num_hidden_layers=2, chunk_size=4)


def _perturb(model: torch.nn.Module, scale: float, seed: int = 0) -> None:
    """Add seeded noise to every weight, so the gates depend on the token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def _pair(**overrides):
    """HF xLSTM (random, perturbed weights) and the lean model holding the same weights."""
    cfg = xLSTMConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    if cfg.weight_mode == "fused":  # HF's _init_weights crashes on the fused gate bias: skip it
        with mock.patch.object(hf_xlstm.xLSTMPreTrainedModel, "_init_weights", lambda self, module: None):
            hf = xLSTMForCausalLM(cfg).eval()
    else:
        hf = xLSTMForCausalLM(cfg).eval()
    _perturb(hf, 0.1)
    custom = XLSTMForCausalLM(hf.config).eval()
    copy_weights(hf, custom)
    return hf, custom


@pytest.fixture(scope="module")
def pair():
    return _pair()


@pytest.fixture(scope="module")
def fused_pair():
    return _pair(weight_mode="fused", use_bias=True)


def _ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(b * 100 + s))


class _HFNoCache(torch.nn.Module):
    """HF's model called with ``use_cache=False`` (see the module docstring)."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor, **unused) -> torch.Tensor:
        return self.hf(input_ids=input_ids, use_cache=False).logits


# ---- the mLSTM kernel ---------------------------------------------------------------------------
@pytest.mark.parametrize("gate_scale", [1.0, 15.0])
def test_parallel_mlstm_equals_hf_recurrent_and_chunkwise_kernels(gate_scale):
    """In float64 the parallel form equals HF's per-token recurrence and its chunkwise scan to
    rounding, with gates up to the soft cap (large gates stress the max-stabiliser)."""
    gen = torch.Generator().manual_seed(0)
    b, nh, s, dqk, dv = 2, 3, 21, 8, 16
    q, k = (torch.randn(b, nh, s, dqk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, nh, s, dv, generator=gen, dtype=torch.float64)
    i, f = (torch.randn(b, nh, s, generator=gen, dtype=torch.float64) * gate_scale for _ in range(2))
    out = torch.ops.autodeploy.torch_mlstm(*(x.transpose(1, 2) for x in (q, k, v, i, f)), 1e-6).transpose(1, 2)
    recurrent = hf_xlstm.mlstm_recurrent_sequence_native(q, k, v, i, f, eps=1e-6, dtype_state=torch.float64)
    assert_rmse_close(out, recurrent, 1e-12, "vs HF recurrent kernel")
    n = 20  # the chunkwise kernel takes whole chunks only
    chunked = hf_xlstm.mlstm_chunkwise_native_autograd(q[:, :, :n], k[:, :, :n], v[:, :, :n], i[:, :, :n],
                                                       f[:, :, :n], eps=1e-6, chunk_size=4)
    assert_rmse_close(out[:, :, :n], chunked, 1e-12, "vs HF chunkwise kernel")


# ---- block -> layer -> model -> export ----------------------------------------------------------
def test_blocks_match(pair, fused_pair):
    for name, (hf, custom) in (("single", pair), ("fused", fused_pair)):
        x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(1))
        hb, cb = hf.backbone.blocks[0], custom.backbone.blocks[0]
        assert_block_matches(hb.norm_mlstm, cb.norm_mlstm, x, msg=f"{name} norm")
        assert_block_matches(hb.ffn, cb.ffn, x, msg=f"{name} ffn")
        assert_block_matches(hb.mlstm_layer, cb.mlstm_layer, x, msg=f"{name} mlstm layer")
        assert_block_matches(hb.mlstm_layer.multihead_norm, cb.mlstm_layer.multihead_norm, x.view(2, 13, 4, 16),
                             msg=f"{name} multi-head norm")
        assert_block_matches(hf.backbone.out_norm, custom.backbone.out_norm, x, msg=f"{name} out norm")


@pytest.mark.parametrize("layer", [0, 1])
def test_layers_match(pair, layer):
    hf, custom = pair
    assert_layer_matches(_HFNoCache(hf), custom, f"hf.backbone.blocks.{layer}", _ids(2, 13),
                         custom_layer=f"backbone.blocks.{layer}")


def test_logits_match(pair, fused_pair):
    """One token (HF's step kernel), under one chunk (its per-token loop), several chunks plus a
    remainder (chunkwise scan then loop), for both weight modes."""
    for hf, custom in (pair, fused_pair):
        for b, s in ((1, 1), (3, 3), (2, 13)):
            assert_logits_match(_HFNoCache(hf), custom, _ids(b, s))


def test_exports_at_two_shapes(pair):
    _, custom = pair
    gm = assert_exports_at_two_shapes(custom, VOCAB, shapes=((2, 13), (1, 1)))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {ad.torch_rmsnorm.default, ad.torch_swiglu_mlp.default} <= targets


def test_registered_for_the_hf_config():
    assert custom_model_for(xLSTMConfig(**TINY)) is XLSTMForCausalLM


def test_unsupported_options_are_refused():
    cfg = xLSTMConfig(**TINY)
    object.__setattr__(cfg, "weight_mode", "interleaved")  # past the strict config's own validation
    with pytest.raises(ValueError, match="weight_mode"):
        XLSTMForCausalLM(cfg)


# ---- the full pipeline ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny safetensors checkpoint (with a tokenizer) whose weights are perturbed as above."""
    path = str(tmp_path_factory.mktemp("xlstm") / "ckpt")
    write_random_checkpoint({"model_type": "xlstm", **TINY}, path, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _perturb(model, 0.1, seed=2)
    model.save_pretrained(path)
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    return path


def test_llm_greedy_tokens_equal_hf_on_the_mlstm_state_cache(checkpoint, caplog):
    prompts = [_ids(1, n)[0].tolist() for n in (5, 13)]
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                     eos_token_id=None, pad_token_id=0, use_cache=False)
        expected.append(out[0, len(p):].tolist())
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        llm = LLM(checkpoint, max_seq_len=64, max_batch_size=2, max_num_tokens=64)
    assert llm.build.factory.custom_model is XLSTMForCausalLM
    assert "building custom model XLSTMForCausalLM for xLSTMConfig" in caplog.text
    assert llm.build.context.cache_mode == "state"  # insert_cached_mlstm: one C/n/m state per layer
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == expected
