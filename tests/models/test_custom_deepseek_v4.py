"""The lean DeepSeek-V4 (``autodeploy/models/custom/modeling_deepseek_v4.py``) against HF's
``DeepseekV4ForCausalLM`` on the same weights: blocks (compressors, indexer picks, MoE,
hyper-connections) -> decoder layers -> logits -> export at two shapes -> greedy tokens through
``autodeploy.LLM`` equal HF eager ``generate`` (which runs V4's own compressor caches).

The tiny config has one layer of each type (sliding, CSA, HCA) and both MoE kinds, compress rates small
enough (4 and 8) that entries appear within a few tokens, and ``index_topk = 2`` so the indexer
really drops entries. HF initialises sinks, position biases, hyper-connection biases and the hash
table to zeros; they are randomised here so that the checks see them.
"""

import logging

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM as HFDeepseekV4

from autodeploy import LLM, SamplingParams
from autodeploy.export.hf_names import conversions
from autodeploy.models.custom import custom_model_for
from autodeploy.models.custom.modeling_deepseek_v4 import DeepseekV4ForCausalLM, num_windows
from autodeploy.models.custom.testing import (
    assert_block_matches, assert_exports_at_two_shapes, assert_layer_matches, assert_logits_match,
    assert_rmse_close, copy_weights,
)

ad = torch.ops.autodeploy
VOCAB = 128
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=16, q_lora_rank=32,
    num_experts_per_tok=2, n_routed_experts=4, sliding_window=4, o_groups=2, o_lora_rank=16, partial_rotary_factor=0.5,
    index_n_heads=16, index_head_dim=8, index_topk=2, num_hidden_layers=3, hc_sinkhorn_iters=5,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def _hf_model(seed: int = 0) -> HFDeepseekV4:
    """HF V4 with random weights, including the parameters HF initialises to constants."""
    torch.manual_seed(seed)
    hf = HFDeepseekV4(DeepseekV4Config(**TINY, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                param.normal_(0.0, 0.5)
        for name, buf in hf.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.randint(0, TINY["n_routed_experts"], buf.shape))
            elif name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return hf


@pytest.fixture(scope="module")
def pair():
    hf = _hf_model()
    custom = DeepseekV4ForCausalLM(hf.config).eval()
    copy_weights(hf, custom)
    return hf, custom


def _ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(7 * b + s))


def _positions(b: int, s: int) -> torch.Tensor:
    return torch.arange(s).expand(b, s)


# ---- blocks ---------------------------------------------------------------------------------------
def test_registered_for_the_config_class_and_loads_through_transformers_mapping(pair):
    """Checkpoints on disk carry V4's original names (``attn.wq_a``, ``ffn.experts.N.w1``); the
    custom model keeps HF's module names, so the loader needs transformers' mapping for it."""
    assert custom_model_for(DeepseekV4Config(**TINY)) is DeepseekV4ForCausalLM
    assert any(type(c).__name__ == "WeightConverter" for c in conversions(pair[1]))


@pytest.mark.parametrize("layer", [1, 2])  # CSA (with indexer), HCA
@torch.no_grad()
def test_compressor_entries_and_visibility_match(pair, layer):
    """The compressed entries and which of them each query sees equal HF's stateless compressor's
    (HF returns only complete windows; the two extra entries here must never be visible)."""
    hf, custom = pair
    b, s = 2, 19
    x, q_residual = torch.randn(b, s, 64), torch.randn(b, s, 32)
    hf_kv, hf_bias = hf.model.layers[layer].self_attn.compressor(x, q_residual, _positions(b, s), None, layer)
    tables = custom.model.tables(_positions(b, s), x.dtype)
    kv, keep = custom.model.layers[layer].self_attn.compressor(x, q_residual, tables)
    rate = custom.model.layers[layer].self_attn.compressor.rate
    complete = s // rate
    assert kv.shape[1] == keep.shape[-1] == num_windows(s, rate) == complete + 2
    assert_rmse_close(kv[:, :complete], hf_kv[:, 0], 1e-5, "compressed entries")
    assert torch.equal(keep[..., :complete], hf_bias[:, 0] == 0)
    assert not keep[..., complete:].any()


@torch.no_grad()
def test_indexer_really_drops_entries(pair):
    """With index_topk = 2 some queries see fewer CSA entries than are causal (else the top-k
    path would be untested)."""
    _, custom = pair
    b, s = 2, 19
    tables = custom.model.tables(_positions(b, s), torch.float32)
    keep = custom.model.layers[1].self_attn.compressor(torch.randn(b, s, 64), torch.randn(b, s, 32), tables)[1]
    assert keep.sum(-1).max() == TINY["index_topk"]
    assert (tables.causal[4].sum(-1) > TINY["index_topk"]).any()


@torch.no_grad()
def test_moe_and_hyper_connection_blocks_match(pair):
    hf, custom = pair
    x, ids = torch.randn(2, 5, 64), _ids(2, 5)
    for layer in (0, 1):  # hash-routed, top-k routed; x * 60 drives experts past swiglu_limit (clamps)
        for scale in (1.0, 60.0):
            assert_block_matches(hf.model.layers[layer].mlp, custom.model.layers[layer].mlp, x * scale,
                                 input_ids=ids, msg=f"moe {layer} at input scale {scale}")
    assert_block_matches(hf.model.layers[0].mlp.shared_experts, custom.model.layers[0].mlp.shared_experts, x * 30,
                         msg="shared expert (clamped)")
    streams = torch.randn(2, 5, TINY.get("hc_mult", 4), 64)
    for got, want in zip(custom.model.layers[1].attn_hc(streams), hf.model.layers[1].attn_hc(streams)):
        assert_rmse_close(got, want, 1e-5, "hyper-connection")
    assert_block_matches(hf.model.hc_head, custom.model.hc_head, streams, msg="hc head")


# ---- layers, logits, export -------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [0, 1, 2])  # sliding, CSA, HCA
def test_decoder_layers_match(pair, layer):
    hf, custom = pair
    assert_layer_matches(hf, custom, f"model.layers.{layer}", _ids(2, 19))


def test_logits_match(pair):
    hf, custom = pair
    for b, s in ((2, 19), (1, 3), (3, 8)):
        assert_logits_match(hf, custom, _ids(b, s))


def test_yarn_compress_rope_and_tied_embeddings():
    """V4-Flash's YaRN on the compress rope (main rope stays default) and tied embeddings."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    torch.manual_seed(0)
    hf = HFDeepseekV4(DeepseekV4Config(**{**TINY, "rope_parameters": rope, "tie_word_embeddings": True,
                                          "max_position_embeddings": 256}, attn_implementation="eager")).eval()
    assert hf.config.rope_parameters["compress"]["rope_type"] == "yarn"
    custom = DeepseekV4ForCausalLM(hf.config).eval()
    copy_weights(hf, custom)
    assert custom.lm_head.weight is custom.model.embed_tokens.weight
    assert_logits_match(hf, custom, _ids(2, 19))


@pytest.mark.slow  # ~11 s: three layer kinds exported twice; the coverage sweep exports the type too
def test_exports_at_two_shapes(pair):
    _, custom = pair
    gm = assert_exports_at_two_shapes(custom, VOCAB, shapes=((2, 19), (1, 3)))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_attention.default) == TINY["num_hidden_layers"]
    assert targets.count(ad.torch_moe_fused.default) == TINY["num_hidden_layers"]
    assert ad.torch_rmsnorm.default in targets


def test_unsupported_options_raise():
    with pytest.raises(NotImplementedError, match="hidden_act"):
        DeepseekV4ForCausalLM(DeepseekV4Config(**{**TINY, "hidden_act": "gelu"}))
    with pytest.raises(NotImplementedError, match="dynamic"):
        DeepseekV4ForCausalLM(DeepseekV4Config(**{**TINY, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}))


# ---- the full pipeline ------------------------------------------------------------------------------
@pytest.mark.slow  # ~18 s: the whole pipeline in recompute mode (HF's generate is most of it)
def test_llm_greedy_tokens_equal_hf_and_come_from_the_custom_model(tmp_path_factory, caplog):
    hf = _hf_model(seed=1)
    path = str(tmp_path_factory.mktemp("deepseek_v4"))
    hf.save_pretrained(path)
    prompts = [_ids(1, n)[0].tolist() for n in (5, 11)]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        llm = LLM(path, dtype="float32", device="cpu", max_seq_len=32, max_batch_size=2, max_num_tokens=32)
    assert llm.build.factory.custom_model is DeepseekV4ForCausalLM
    assert "building custom model DeepseekV4ForCausalLM for DeepseekV4Config" in caplog.text
    assert llm.build.context.cache_mode == "recompute"  # compressed entries: state no KV cache holds
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == expected


@pytest.mark.slow
def test_sliding_only_config_gets_the_paged_kv_cache(tmp_path_factory):
    """Without compressed layers every attention is causal + windowed + sinks, which the cached
    attention serves: paged KV, not recompute, with HF's greedy tokens."""
    cfg = {**TINY, "num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2,
           "mlp_layer_types": ["hash_moe", "moe"]}
    torch.manual_seed(0)
    hf = HFDeepseekV4(DeepseekV4Config(**cfg)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("sinks", ".base")):
                param.normal_(0.0, 0.5)
    path = str(tmp_path_factory.mktemp("deepseek_v4_sliding"))
    hf.save_pretrained(path)
    prompts = [_ids(1, n)[0].tolist() for n in (5, 11)]
    expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=8,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(path, dtype="float32", device="cpu", max_seq_len=32, max_batch_size=2, max_num_tokens=32)
    assert llm.build.context.cache_mode == "paged_kv"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == expected
