"""The lean custom Doge (``autodeploy/models/custom/modeling_doge.py``) against HF's ``DogeForCausalLM``.

HF's init leaves ``A`` at zero, which makes every dynamic-mask bias exactly 1: the bias then
cancels in the softmax and the top-k selection only breaks ties. So the fixtures draw ``A`` at
random (the bias matters, ``test_the_dynamic_mask_matters`` proves it), and one config keeps
``A == 0`` to check that the ties are broken as HF breaks them. Three model forms:

* ``topk``: keep_window_size 5 < context 64, dense MLP: explicit dynamic mask, recompute mode;
* ``moe``: the same with the CDMoE;
* ``channel``: keep_window_size 64 = context: the bias rides in a key channel, paged KV cache.
"""

import logging
from typing import Dict, List, Tuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DogeConfig
from transformers import DogeForCausalLM as HFDogeForCausalLM

from autodeploy import LLM, SamplingParams
from autodeploy.coverage.reference import hf_greedy_reference, load_hf_eager
from autodeploy.models.custom import custom_model_for
from autodeploy.models.custom.modeling_doge import DogeForCausalLM, torch_doge_dynamic_mask
from autodeploy.models.custom.testing import (
    assert_block_matches, assert_exports_at_two_shapes, assert_layer_matches, assert_logits_match, copy_weights,
    relative_rmse,
)
from autodeploy.models.presets import write_random_checkpoint

ad = torch.ops.autodeploy
VOCAB = 160
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_experts=10, num_experts_per_tok=3)
FORMS: Dict[str, dict] = {
    "topk": dict(keep_window_size=5),
    "moe": dict(keep_window_size=5, is_moe=True),
    "channel": dict(keep_window_size=64),
}


def _randomize_dynamic_mask(model: torch.nn.Module, seed: int) -> None:
    """Random ``A`` (so the bias is not 1 everywhere) and residual scales (so they are not 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.A"):
                param.copy_(torch.randn(param.shape, generator=gen))
            elif name.endswith("_residual"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)


def _pair(form: str, random_a: bool = True, **extra) -> Tuple[HFDogeForCausalLM, DogeForCausalLM]:
    torch.manual_seed(0)
    hf = HFDogeForCausalLM(DogeConfig(**{**TINY, **FORMS[form], **extra}, attn_implementation="eager")).eval()
    if random_a:
        _randomize_dynamic_mask(hf, seed=1)
    custom = DogeForCausalLM(hf.config).eval()
    copy_weights(hf, custom)
    return hf, custom


@pytest.fixture(scope="module", params=sorted(FORMS))
def pair(request):
    return _pair(request.param)


def _ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(b * 100 + s))


# ---- block -> layer -> model -> export ----------------------------------------------------------
def test_dynamic_mask_op_equals_hf_bit_for_bit():
    """The op against HF's ``prepare_dynamic_mask`` itself, with distinct biases and with ties
    (all 1, HF's ``A == 0``), below and above the window: equal, not just close."""
    hf, _ = _pair("topk")
    attn = hf.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(3)
    for s in (4, 5, 6, 13):
        keep = ad.torch_causal_mask(2, s, s, None, torch.bool, torch.device("cpu"))
        hf_mask = ad.torch_causal_mask(2, s, s, None, torch.float32, torch.device("cpu"))
        for bias in (torch.rand(2, 2, s, generator=gen), torch.ones(2, 2, s)):
            expected = attn.prepare_dynamic_mask(torch.zeros(2, s, 64), bias, 5, hf_mask)
            actual = torch_doge_dynamic_mask(bias, keep, 5)
            assert torch.equal(actual, expected), f"dynamic mask differs from HF's at s={s}"
        if s > 5:  # the selection ran: each query past the window keeps exactly 5 keys
            assert int((actual[0, 0, -1] > torch.finfo(torch.float32).min).sum()) == 5


def test_blocks_match():
    hf, custom = _pair("moe")
    x = torch.randn(2, 5, 64)
    assert_block_matches(hf.model.layers[0].mlp, custom.model.layers[0].mlp, x, msg="cdmoe")
    assert_block_matches(hf.model.layers[0].input_layernorm, custom.model.layers[0].input_layernorm, x, msg="norm")
    assert_block_matches(hf.model.norm, custom.model.norm, x, msg="final norm")
    hf_dense, custom_dense = _pair("topk")
    assert_block_matches(hf_dense.model.layers[1].mlp, custom_dense.model.layers[1].mlp, x, msg="mlp")


@pytest.mark.parametrize("layer", [0, 1])
def test_decoder_layers_match(pair, layer):
    hf, custom = pair
    assert_layer_matches(hf, custom, f"model.layers.{layer}", _ids(2, 11))


def test_logits_match(pair):
    hf, custom = pair
    for b, s in ((1, 13), (3, 4), (2, 9), (1, 1)):
        assert_logits_match(hf, custom, _ids(b, s))


@pytest.mark.parametrize("extra", [dict(random_a=False), dict(sliding_window=4), dict(hidden_act="gelu")],
                         ids=["ties", "sliding_window", "gelu"])
def test_logits_match_other_options(extra):
    """``A == 0`` (every bias 1: the top-k keeps the keys HF's ``topk`` picks among ties), a
    sliding window under the dynamic mask, and a non-SiLU MLP."""
    hf, custom = _pair("moe" if "hidden_act" in extra else "topk", **extra)
    assert_logits_match(hf, custom, _ids(2, 13))


def test_the_dynamic_mask_matters():
    """The fixtures exercise the bias and the top-k: dropping either changes HF's logits a lot."""
    ids = _ids(1, 13)
    with torch.no_grad():
        reference = _pair("topk")[0](input_ids=ids).logits
        no_topk = _pair("topk", keep_window_size=64)[0](input_ids=ids).logits
        no_bias = _pair("topk", random_a=False)[0](input_ids=ids).logits
    assert relative_rmse(no_topk, reference) > 1e-2
    assert relative_rmse(no_bias, reference) > 1e-2


@pytest.mark.parametrize("form", ["moe", "channel"])  # the two attention forms (and both MLPs)
def test_exports_at_two_shapes(form):
    _, custom = _pair(form)
    gm = assert_exports_at_two_shapes(custom, VOCAB, shapes=((2, 7), (1, 13)))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {ad.torch_attention.default, ad.torch_rope_with_explicit_cos_sin.default,
            ad.torch_rmsnorm.default} <= targets
    assert (ad.torch_doge_dynamic_mask.default in targets) == (form != "channel")
    assert ad.torch_swiglu_mlp.default in targets


def test_unsupported_rope_is_refused():
    config = DogeConfig(**TINY, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        DogeForCausalLM(config)


def test_registered_for_doge_config():
    assert custom_model_for(DogeConfig(**TINY)) is DogeForCausalLM


# ---- the full pipeline ----------------------------------------------------------------------------
def _checkpoint(directory: str, form: str) -> str:
    """A real one-layer checkpoint (safetensors + tokenizer) of ``form`` with a random ``A``."""
    write_random_checkpoint({"model_type": "doge", **TINY, **FORMS[form], "num_hidden_layers": 1}, directory, seed=0)
    weights = load_file(f"{directory}/model.safetensors")
    gen = torch.Generator().manual_seed(2)
    for name in weights:
        if name.endswith("self_attn.A"):
            weights[name] = torch.randn(weights[name].shape, generator=gen)
    save_file(weights, f"{directory}/model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("form, cache_mode", [("channel", "paged_kv"),
                                              pytest.param("moe", "recompute", marks=pytest.mark.slow)])
def test_llm_greedy_tokens_equal_hf(form, cache_mode, tmp_path, caplog):
    """Through ``autodeploy.LLM``: greedy tokens equal HF eager's full-forward greedy decoding
    (the coverage reference) for a prompt shorter and one longer than the window; the graph
    comes from the custom model, with the cache mode its form allows."""
    path = _checkpoint(str(tmp_path), form)
    gen = torch.Generator().manual_seed(5)
    prompts: List[List[int]] = [torch.randint(6, VOCAB, (n,), generator=gen).tolist() for n in (4, 13)]
    expected = hf_greedy_reference(load_hf_eager(path), prompts, 8).tokens
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        llm = LLM(path, dtype="float32", device="cpu", max_seq_len=64, max_batch_size=2, max_num_tokens=64)
    assert llm.build.factory.custom_model is DogeForCausalLM
    assert "building custom model DogeForCausalLM for DogeConfig" in caplog.text
    assert llm.build.context.cache_mode == cache_mode
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == expected
