"""DeepSeek Sparse Attention ops (``autodeploy.ops.dsa``): the indexer against HF's indexer modules,
the cached indexer against the uncached one over a schedule of prefills, chunks and decodes, and
MLA restricted to the selected keys, cached against uncached. The top-k is small (3) against
sequences of up to 13 tokens, so the selection is sparse and changes the attention output."""

import random
from typing import Dict, List

import pytest
import torch

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.cache import build_sequence_info
from autodeploy.export.hf_attention import hf_attention_route
from autodeploy.export.hf_dsa import IndexerLayout, _dsa_indexer, indexer_layout, is_dsa_indexer
from helpers import rel_rmse

ad = torch.ops.autodeploy
H, D, TOPK = 4, 16, 3
TOTALS = [9, 5, 13]
STEPS = [[(0, 0, 7), (1, 0, 5), (2, 0, 4)], [(2, 4, 11), (0, 7, 8)], [(2, 11, 12), (0, 8, 9)], [(2, 12, 13)]]


def _tables(page_size: int, seed: int = 0) -> List[List[int]]:
    pool = list(range(sum(-(-t // page_size) for t in TOTALS) + 2))
    random.Random(seed).shuffle(pool)
    return [[pool.pop() for _ in range(-(-t // page_size))] for t in TOTALS]


def _selected(indices: torch.Tensor) -> List[List[set]]:
    return [[set(v for v in row.tolist() if v >= 0) for row in seq] for seq in indices]


# half-split and interleaved RoPE; HY-V4: the roped part last, the scale on the head weights
@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "hy_v4"])
def test_indexer_selects_what_hfs_indexer_selects(model_type):
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    import importlib

    config = AutoConfig.for_model(model_type, hidden_size=32, q_lora_rank=24, qk_rope_head_dim=8, index_topk=TOPK,
                                  index_n_heads=H, index_head_dim=D, num_hidden_layers=1, vocab_size=32)
    family = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = next(getattr(family, n) for n in dir(family) if n.endswith("Indexer"))
    torch.manual_seed(0)
    indexer = cls(config, 0).eval()
    assert is_dsa_indexer(indexer)
    batch, seq = 2, 9
    hidden, q_resid = torch.randn(batch, seq, 32), torch.randn(batch, seq, 24)
    rotary = getattr(family, next(n for n in dir(family) if n.endswith("RotaryEmbedding")), DeepseekV3RotaryEmbedding)
    cos_sin = rotary(config)(hidden, torch.arange(seq).expand(batch, seq))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, seq, seq)
    with torch.no_grad():
        ref = indexer(hidden, q_resid, cos_sin, causal, None)
        config._attn_implementation = "autodeploy"
        with _dsa_indexer(indexer), hf_attention_route(indexer, "autodeploy"):
            got = indexer(hidden, q_resid, cos_sin, causal, None)
    assert got.shape == (batch, seq, TOPK) and got.dtype == torch.int32
    keep = [[set(v for v in row.tolist() if v <= s) for s, row in enumerate(b)] for b in ref]  # HF's causal picks
    assert _selected(got) == keep
    assert any(len(row) == TOPK and max(row) < s for b in keep for s, row in enumerate(b))  # a query skipped its own key


def test_indexer_layout_is_read_from_the_forward_and_unknown_code_is_not_patched():
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4Indexer

    assert indexer_layout(DeepseekV32Indexer) == IndexerLayout(rope_first=True, scale_on_weights=False)
    assert indexer_layout(HYV4Indexer) == IndexerLayout(rope_first=False, scale_on_weights=True)

    class Scaled(torch.nn.Module):  # the scale on both: neither layout
        def forward(self, q, k, w):
            q_rot, q_pass = torch.split(q, [2, 2], dim=-1)
            scores = q_rot @ k * self.softmax_scale
            weights = w * self.softmax_scale
            return scores, weights

    class Unsplit(torch.nn.Module):  # no split of q in the known names
        def forward(self, q, k, w):
            a, b = torch.split(q, [2, 2], dim=-1)
            scores = a @ k * self.softmax_scale
            return scores

    assert indexer_layout(Scaled) is None and indexer_layout(Unsplit) is None


def _sequences(seed: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"q": torch.randn(t, H, D, generator=g), "k": torch.randn(t, D, generator=g),
             "w": torch.randn(t, H, generator=g)} for t in TOTALS]


def test_cached_indexer_equals_the_uncached_one():
    seqs, page_size = _sequences(1), 4
    tables = _tables(page_size)
    cache = torch.zeros(sum(len(t) for t in tables) + 2, page_size, 1, D)
    got: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(TOTALS))}
    for step in STEPS:
        info = build_sequence_info([[0] * (e - s) for _, s, e in step], [s for _, s, _ in step],
                                   [tables[i] for i, _, _ in step])
        cat = {k: torch.cat([seqs[i][k][s:e] for i, s, e in step])[None] for k in ("q", "k", "w")}
        slots = ad.torch_cached_attention_prepare_metadata(info.position_ids, info.seq_len, info.cu_seqlen,
                                                           info.page_table, page_size)
        out = ad.torch_cached_dsa_indexer(cat["q"], cat["k"], cat["w"], info.batch_info, info.seq_len,
                                          info.input_pos, info.cu_seqlen, info.page_table, slots, cache, 0.25, TOPK)
        off = 0
        for i, s, e in step:
            got[i].append(out[0, off:off + e - s])
            off += e - s
    for i, seq in enumerate(seqs):
        ref = ad.torch_dsa_indexer(seq["q"][None], seq["k"][None], seq["w"][None], 0.25, TOPK)[0]
        assert torch.equal(torch.cat(got[i]), ref), i


def _latents(seed: int):
    g = torch.Generator().manual_seed(seed)
    n, d_nope, d_rope, d_v, lora = 2, 8, 4, 6, 16
    weight = torch.randn(n * (d_nope + d_v), lora, generator=g) / 4
    return weight, [{"q_nope": torch.randn(t, n, d_nope, generator=g), "q_pe": torch.randn(t, n, d_rope, generator=g),
                     "ckv": torch.randn(t, lora, generator=g), "kpe": torch.randn(t, 1, d_rope, generator=g)}
                    for t in TOTALS]


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_sparse_mla_cached_equals_uncached(backend):
    weight, lat = _latents(2)
    idx = [ad.torch_dsa_indexer(s["q"][None], s["k"][None], s["w"][None], 0.25, TOPK)[0] for s in _sequences(3)]
    page_size = 4
    tables = _tables(page_size, seed=5)
    cache = torch.zeros(sum(len(t) for t in tables) + 2, page_size, 1, 16 + 4)
    op = getattr(ad, f"{backend}_cached_mla_with_cache")
    got: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(TOTALS))}
    for step in STEPS:
        info = build_sequence_info([[0] * (e - s) for _, s, e in step], [s for _, s, _ in step],
                                   [tables[i] for i, _, _ in step])
        cat = {k: torch.cat([lat[i][k][s:e] for i, s, e in step])[None] for k in lat[0]}
        topk = torch.cat([idx[i][s:e] for i, s, e in step])[None]
        slots = ad.torch_cached_attention_prepare_metadata(info.position_ids, info.seq_len, info.cu_seqlen,
                                                           info.page_table, page_size)
        out = op(cat["q_nope"], cat["q_pe"], cat["ckv"], cat["kpe"], weight, info.batch_info, info.seq_len,
                 info.input_pos, info.cu_seqlen, info.page_table, slots, cache, 0.3, None, None, -1, topk)
        off = 0
        for i, s, e in step:
            got[i].append(out[0, off:off + e - s])
            off += e - s
    for i, s in enumerate(lat):
        args = (s["q_nope"][None], s["q_pe"][None], s["ckv"][None], s["kpe"][None], weight, True, 0.3)
        sparse = ad.torch_mla(*args, idx[i][None])[0]
        assert rel_rmse(torch.cat(got[i]), sparse) < 1e-5, (backend, i)
        if TOTALS[i] > TOPK + 1:  # the selection matters: dense attention differs
            assert rel_rmse(ad.torch_mla(*args)[0], sparse) > 1e-3
