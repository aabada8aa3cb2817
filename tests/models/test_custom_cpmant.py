"""The lean CPM-Ant (autodeploy/models/custom/modeling_cpmant.py) against HF's ``CpmAntForCausalLM``:
buckets -> blocks -> layers -> logits -> export at two shapes -> greedy tokens through ``LLM``.

HF's CPM-Ant attends bidirectionally in a plain ``model(input_ids)`` call (``context`` is all
ones), so its logits at a position depend on later tokens (``test_hf_looks_at_later_tokens``).
The reference for generation is therefore HF re-running the full sequence at every step
(``generate(use_cache=False)``, which is what the coverage reference does), and the pipeline
serves the model in recompute mode.
"""

import logging

import pytest
import torch
from transformers import CpmAntConfig, CpmAntForCausalLM

from autodeploy import LLM, SamplingParams
from autodeploy.models.custom.modeling_cpmant import LeanCpmAntForCausalLM, position_bucket
from autodeploy.models.custom.testing import (
    assert_block_matches, assert_exports_at_two_shapes, assert_layer_matches, assert_logits_match,
    assert_rmse_close, copy_weights,
)
from autodeploy.models.presets import write_random_checkpoint

ad = torch.ops.autodeploy

# Small buckets (32, max distance 16) so that 20-token sequences reach the log-spaced buckets and
# the clamp at max_distance; 4 prompt tokens of 3 types keep the prompt embeddings apart.
TINY = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=48, num_hidden_layers=2,
            prompt_length=4, prompt_types=3, segment_types=4, position_bias_num_buckets=32,
            position_bias_max_distance=16)


@pytest.fixture(scope="module")
def pair():
    """HF CPM-Ant with random weights and the lean model with the same weights."""
    torch.manual_seed(0)
    hf = CpmAntForCausalLM(CpmAntConfig(**TINY, attn_implementation="eager")).eval()
    custom = LeanCpmAntForCausalLM(hf.config).eval()
    copy_weights(hf, custom)
    return hf, custom


def _ids(b: int, s: int, zeros: bool = False) -> torch.Tensor:
    """Random ids in 1..vocab; with ``zeros``, a few 0s (CPM-Ant's pad id: HF gives them segment 0
    and masks as many leading positions)."""
    ids = torch.randint(1, TINY["vocab_size"], (b, s), generator=torch.Generator().manual_seed(b * s))
    if zeros:
        ids[0, s // 2] = 0
        ids[-1, 1] = ids[-1, s - 2] = 0
    return ids


# ---- buckets -> blocks -> layers -> model -> export -----------------------------------------------
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 16), (512, 2048)])
def test_position_buckets_equal_hf(pair, num_buckets, max_distance):
    hf, _ = pair
    relative = torch.arange(-3000, 3001, dtype=torch.int32)
    expected = hf.cpmant.position_bias._position_bucket(relative, num_buckets, max_distance)
    actual = position_bucket(relative.long(), num_buckets, max_distance)
    assert torch.equal(actual, expected.long())


def test_position_bias_equals_hf(pair):
    """The bias of the prompt + text sequence, with the segments HF derives (0s included)."""
    hf, custom = pair
    ids = _ids(2, 20, zeros=True)
    b, s, p = *ids.shape, TINY["prompt_length"]
    segments = custom.cpmant.segments(ids)
    positions = torch.arange(p + s).expand(b, p + s)
    with torch.no_grad():
        expected = hf.cpmant.position_bias(positions.int(), positions.int(), segments.int(), segments.int())
        actual = custom.cpmant.position_bias(positions, segments)
    assert segments[0, p + s // 2] == 0 and segments[0, p] == 2
    assert_rmse_close(actual, expected, 0.0, "position bias")


def test_blocks_match(pair):
    hf, custom = pair
    x = torch.randn(2, 5, TINY["hidden_size"])
    hf_layer, layer = hf.cpmant.encoder.layers[0], custom.cpmant.encoder.layers[0]
    assert_block_matches(hf_layer.ffn, layer.ffn, x, msg="ffn block")
    assert_block_matches(hf_layer.self_att.layernorm_before_attention, layer.self_att.layernorm_before_attention,
                         x, msg="norm")
    assert_block_matches(hf.cpmant.encoder.output_layernorm, custom.cpmant.encoder.output_layernorm, x,
                         msg="final norm")


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("zeros", [False, True])
def test_decoder_layers_match(pair, layer, zeros):
    hf, custom = pair
    assert_layer_matches(hf, custom, f"cpmant.encoder.layers.{layer}", _ids(2, 9, zeros))


@pytest.mark.parametrize("zeros", [False, True])
def test_logits_match(pair, zeros):
    hf, custom = pair
    for b, s in ((1, 20), (3, 6)):
        assert_logits_match(hf, custom, _ids(b, s, zeros))


def test_hf_looks_at_later_tokens(pair):
    """Why the model runs in recompute mode: changing the last token changes HF's logits at the
    first position (bidirectional attention), and the lean model follows HF there too."""
    hf, custom = pair
    ids = _ids(1, 8)
    other = ids.clone()
    other[0, -1] = ids[0, -1] % (TINY["vocab_size"] - 1) + 1
    with torch.no_grad():
        first, second = hf(ids).logits[0, 0], hf(other).logits[0, 0]
    assert (first - second).abs().max() > 1e-3
    assert_logits_match(hf, custom, other)


def test_exports_at_two_shapes(pair):
    _, custom = pair
    gm = assert_exports_at_two_shapes(custom, TINY["vocab_size"], shapes=((2, 7), (1, 3)))
    attention = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_attention.default]
    assert len(attention) == TINY["num_hidden_layers"]
    assert all(n.args[3] is not None and n.args[5] is False for n in attention)  # bias as mask, bidirectional
    assert any(n.target == ad.torch_rmsnorm.default for n in gm.graph.nodes if n.op == "call_function")


# ---- the full pipeline ----------------------------------------------------------------------------
def _hf_full_sequence_greedy(model: torch.nn.Module, prompt: list, new_tokens: int) -> list:
    """HF ``generate`` re-running the whole sequence at each step (HF's cached generate freezes the
    prompt's keys/values, which a bidirectional model's full forward does not)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             use_cache=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_llm_greedy_tokens_equal_hf_and_come_from_the_custom_model(tmp_path_factory, caplog):
    path = write_random_checkpoint(dict(model_type="cpmant", **TINY), str(tmp_path_factory.mktemp("cpmant")), seed=1)
    reference = CpmAntForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [_ids(1, 5)[0].tolist(), _ids(1, 12, zeros=True)[0].tolist()]
    expected = [_hf_full_sequence_greedy(reference, p, 8) for p in prompts]
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        llm = LLM(path, max_seq_len=64, max_batch_size=2, max_num_tokens=64)
    assert llm.build.factory.custom_model is LeanCpmAntForCausalLM
    assert "building custom model LeanCpmAntForCausalLM for CpmAntConfig" in caplog.text
    assert llm.build.context.cache_mode == "recompute"  # bidirectional attention: no KV cache can serve it
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == expected
