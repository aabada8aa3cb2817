"""insert_cached_mla_attention (cache_init): torch_mla -> the backend's cached MLA op over a paged
latent cache, on a real tiny DeepSeek-V3 (MLA with a q LoRA, interleaved RoPE, MoE after one dense
layer). Structure, numerics against the uncached graph at two shapes (a prefill, then decodes that
take the absorbed path), the cache's size per token, and what it must leave alone.
"""

import random

import pytest
import torch

from autodeploy.cache import build_sequence_info
from autodeploy.export.hf_mla import is_mla_attention
from autodeploy.transform.interface import Stage
from helpers import MOE_FAMILIES, build, count_op, moe_family_checkpoint, rel_rmse

ad = torch.ops.autodeploy
CACHED_OPS = {"torch": ad.torch_cached_mla_with_cache, "sdpa": ad.sdpa_cached_mla_with_cache}
LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
CFG = MOE_FAMILIES["deepseek_v3"]
LAYERS, VOCAB = CFG["num_hidden_layers"], CFG["vocab_size"]
LATENT = CFG["kv_lora_rank"] + CFG["qk_rope_head_dim"]  # 32 + 8 values per token and layer
EXPANDED = CFG["num_attention_heads"] * (CFG["qk_nope_head_dim"] + CFG["qk_rope_head_dim"] + CFG["v_head_dim"])


@pytest.fixture(scope="module")
def uncached():
    return build(moe_family_checkpoint("deepseek_v3"), up_to=Stage.WEIGHT_LOAD).graph


@pytest.fixture(scope="module", params=["sdpa"])  # the reference backend: tests/ops/test_mla_ops.py
def cached(request):
    res = build(moe_family_checkpoint("deepseek_v3"), up_to=Stage.CACHE_INIT,
                overrides={"resize_kv_cache": {"enabled": False}, "gather_logits_before_lm_head": {"enabled": False},
                           "insert_cached_mla_attention": {"backend": request.param}}, **LIMITS)
    return request.param, res


def test_export_emits_torch_mla_for_each_layer(uncached):
    assert count_op(uncached, ad.torch_mla) == LAYERS
    assert count_op(uncached, ad.torch_attention) == 0
    # the expansion through kv_b_proj is gone: its weight only feeds torch_mla
    weights = [n for n in uncached.graph.nodes if n.op == "get_attr" and n.target.endswith("kv_b_proj.weight")]
    assert len(weights) == LAYERS and all(list(w.users)[0].target == ad.torch_mla.default for w in weights)
    assert all(len(w.users) == 1 for w in weights)


def test_graph_structure_and_cache_size(cached):
    backend, res = cached
    gm = res.graph
    record = next(r for r in res.context.history if r.key == "insert_cached_mla_attention")
    assert record.status == "ok" and record.num_matches == LAYERS
    assert count_op(gm, ad.torch_mla) == 0
    assert count_op(gm, CACHED_OPS[backend]) == LAYERS
    assert count_op(gm, CACHED_OPS["sdpa" if backend == "torch" else "torch"]) == 0
    assert count_op(gm, ad.torch_cached_attention_prepare_metadata) == 1
    assert res.cache.paged_names == [f"mla_cache_{i}" for i in range(LAYERS)]
    assert all(res.cache.caches[f"mla_cache_{i}"].shape[1:] == (LIMITS["page_size"], 1, LATENT) for i in range(LAYERS))
    # the bytes per token are the latent's, not the expanded per-head keys and values
    assert res.cache.bytes_per_token() == LAYERS * LATENT * 4
    assert res.context.cache_mode == "paged_kv"
    assert gm.meta["autodeploy_cached"]["mla_backend"] == backend


def _step(res, tokens, starts, tables):
    info = build_sequence_info(tokens, starts, tables)
    with torch.no_grad():
        return res.graph(*res.cache.graph_args(info))[0]


def _ids(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("lengths", [(7,), (9, 4)])
def test_prefill_then_decodes_match_uncached(cached, uncached, lengths):
    _, res = cached
    res.cache.allocate(res.cache.num_pages)
    free = list(range(res.cache.num_pages))
    random.Random(len(lengths)).shuffle(free)
    seqs = [_ids(n + 3, seed=i + 10 * len(lengths)) for i, n in enumerate(lengths)]
    tables = [[free.pop() for _ in range(-(-len(s) // LIMITS["page_size"]))] for s in seqs]
    out = _step(res, [s[:n] for s, n in zip(seqs, lengths)], [0] * len(seqs), tables)
    rows = [out[sum(lengths[:i]):sum(lengths[:i + 1])] for i in range(len(seqs))]
    for extra in range(3):  # decodes of every sequence in one step
        dec = _step(res, [[s[n + extra]] for s, n in zip(seqs, lengths)], [n + extra for n in lengths], tables)
        rows = [torch.cat([r, dec[i:i + 1]]) for i, r in enumerate(rows)]
    for seq, got in zip(seqs, rows):
        with torch.no_grad():
            ref = uncached(torch.tensor([seq]), torch.arange(len(seq))[None])[0]
        assert rel_rmse(got, ref) < 1e-5


def test_mla_disabled_keeps_the_model_exact_in_recompute_mode():
    """Near-miss: with the transform off, torch_mla stays uncached; recompute_fallback must notice
    (the cached graph would attend to each step's tokens only) instead of serving wrong logits."""
    res = build(moe_family_checkpoint("deepseek_v3"), up_to=Stage.CACHE_INIT,
                overrides={"insert_cached_mla_attention": {"enabled": False}}, **LIMITS)
    assert res.context.cache_mode == "recompute"
    assert count_op(res.graph, CACHED_OPS["sdpa"]) == 0


@pytest.mark.slow  # a fourth build; benchmarks/bench_mla.py measures the same at a larger size
def test_expanded_route_caches_per_head_keys_and_values():
    """The export patch off: HF's expansion stays, torch_attention is cached per head (3.2x the bytes here;
    DeepSeek-V3's 576 latent values against 128 x (192 + 128) is 71x)."""
    res = build(moe_family_checkpoint("deepseek_v3"), up_to=Stage.CACHE_INIT,
                overrides={"export_to_gm": {"patches": {"mla_latent_attention": False}},
                           "resize_kv_cache": {"enabled": False}}, **LIMITS)
    assert count_op(res.graph, ad.sdpa_cached_attention_with_cache) == LAYERS
    assert count_op(res.graph, CACHED_OPS["sdpa"]) == 0
    assert res.cache.bytes_per_token() == LAYERS * EXPANDED * 4


def test_route_declines_a_biased_or_replaced_kv_b_proj():
    from torch import nn
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = AutoConfig.for_model("deepseek_v3", hidden_size=32, num_attention_heads=2, kv_lora_rank=8,
                                  q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    attn = DeepseekV3Attention(config, 0)
    assert is_mla_attention(attn)
    attn.kv_b_proj = nn.Linear(8, 16, bias=True)
    assert not is_mla_attention(attn)
    attn.kv_b_proj = nn.Sequential(nn.Linear(8, 16, bias=False))
    assert not is_mla_attention(attn)
