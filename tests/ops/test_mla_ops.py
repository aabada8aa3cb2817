"""MLA ops (``autodeploy.ops.mla``): ``torch_mla`` against HF's MLA attention module, and the cached
ops over a paged latent cache against ``torch_mla`` on whole sequences.

The cached scenarios schedule a few sequences over several steps (fresh prefills, chunked
prefills continuing at ``input_pos > 0``, decodes, a prefill and decodes in one step) on page
tables drawn from a shuffled pool. The weight-absorbed decode of the ``sdpa`` backend must equal
the expanded decode of the reference within 1e-5 relative RMSE in fp32. Per-head attention sinks
(HY-V4) are checked the same way, and ``torch_mla``'s sinks against the closed form: a sink scales
each head's sink-free output by ``Z / (Z + exp(sink))``, ``Z`` its softmax denominator.
"""

import random
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.cache import build_sequence_info
from autodeploy.export.hf_attention import hf_attention_route
from autodeploy.export.hf_mla import _EXPANSIONS, _mla_latent_attention
from autodeploy.ops.mla import absorbed_decode
from helpers import rel_rmse

ad = torch.ops.autodeploy
BACKENDS = ["torch", "sdpa"]
N, D_NOPE, D_ROPE, D_V, LORA = 4, 8, 4, 6, 16
TOTALS = [9, 5, 13, 7]
MIXED_STEPS = [
    [(0, 0, 8), (1, 0, 4), (2, 0, 6), (3, 0, 5)],  # fresh prefills (sequence 2 only its first chunk)
    [(2, 6, 11), (3, 5, 6), (0, 8, 9), (1, 4, 5)],  # a chunk continuing in the cache, then decodes
    [(2, 11, 12), (3, 6, 7)],  # decodes only
    [(2, 12, 13)],
]


def _inputs(total: int, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    return {"q_nope": torch.randn(total, N, D_NOPE, generator=gen), "q_pe": torch.randn(total, N, D_ROPE, generator=gen),
            "ckv": torch.randn(total, LORA, generator=gen), "kpe": torch.randn(total, 1, D_ROPE, generator=gen)}


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])


def _run(backend: str, steps: Sequence[Sequence[Tuple[int, int, int]]], totals: Sequence[int], page_size: int = 4,
         scale: float = 0.3, seed: int = 0, sinks: Optional[torch.Tensor] = None):
    """Runs the schedule; returns (per-sequence outputs, per-sequence inputs, weight)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(N * (D_NOPE + D_V), LORA, generator=gen) / LORA**0.5
    seqs = [_inputs(t, gen) for t in totals]
    num_pages = sum(-(-t // page_size) for t in totals) + 3
    pool = list(range(num_pages))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-t // page_size))] for t in totals]
    cache = torch.zeros(num_pages, page_size, 1, LORA + D_ROPE)
    outs: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(totals))}
    op = getattr(ad, f"{backend}_cached_mla_with_cache")
    for step in steps:
        info = build_sequence_info([[0] * (e - s) for _, s, e in step], [s for _, s, _ in step],
                                   [tables[i] for i, _, _ in step])
        cat = {k: torch.cat([seqs[i][k][s:e] for i, s, e in step])[None] for k in seqs[0]}
        slots = ad.torch_cached_attention_prepare_metadata(info.position_ids, info.seq_len, info.cu_seqlen,
                                                           info.page_table, page_size)
        o = op(cat["q_nope"], cat["q_pe"], cat["ckv"], cat["kpe"], weight, info.batch_info, info.seq_len,
               info.input_pos, info.cu_seqlen, info.page_table, slots, cache, scale,
               **({} if sinks is None else {"sinks": sinks}))
        assert o.shape == (1, info.num_tokens, N, D_V)
        off = 0
        for i, s, e in step:
            outs[i].append(o[0, off:off + e - s])
            off += e - s
    return outs, seqs, weight


def _reference(seq: Dict[str, torch.Tensor], weight: torch.Tensor, scale: float,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    return ad.torch_mla(seq["q_nope"][None], seq["q_pe"][None], seq["ckv"][None], seq["kpe"][None], weight, True,
                        scale, None, sinks)[0]


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["plain", "sinks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_chunks_and_decodes_equal_uncached_mla(backend, sinks):
    outs, seqs, weight = _run(backend, MIXED_STEPS, TOTALS, sinks=sinks)
    for i, total in enumerate(TOTALS):
        got = torch.cat(outs[i])
        assert got.shape == (total, N, D_V)
        assert rel_rmse(got, _reference(seqs[i], weight, 0.3, sinks)) < 1e-5, (backend, i)
        if sinks is not None:  # the sinks matter at these sizes
            assert rel_rmse(got, _reference(seqs[i], weight, 0.3)) > 1e-2, (backend, i)


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["plain", "sinks"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_at_a_time_equals_one_prefill(backend, sinks):
    steps = [[(0, t, t + 1)] for t in range(6)]
    outs, seqs, weight = _run(backend, steps, [6], sinks=sinks)
    assert rel_rmse(torch.cat(outs[0]), _reference(seqs[0], weight, 0.3, sinks)) < 1e-5


@pytest.mark.parametrize("seq", [1, 7])
def test_torch_mla_sinks_scale_each_head_by_its_denominator_share(seq):
    """``torch_mla(..., sinks)`` = the sink-free output times ``Z / (Z + exp(sink))`` per head and
    query, with ``Z`` the sum of the query's exponentiated causal scores (computed here from the
    expanded keys, apart from the op)."""
    gen = torch.Generator().manual_seed(5)
    s = _inputs(seq, gen)
    weight = torch.randn(N * (D_NOPE + D_V), LORA, generator=gen) / LORA**0.5
    k_nope = (s["ckv"] @ weight.T).view(seq, N, D_NOPE + D_V)[..., :D_NOPE]
    keys = torch.cat([k_nope, s["kpe"].expand(seq, N, D_ROPE)], dim=-1)  # [t, n, d]
    q = torch.cat([s["q_nope"], s["q_pe"]], dim=-1)  # [s, n, d]
    scores = torch.einsum("snd,tnd->nst", q, keys) * 0.3
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [n, s]
    share = torch.sigmoid(lse - SINKS[:, None]).T[..., None]  # Z / (Z + e^sink): [s, n, 1]
    expected = _reference(s, weight, 0.3) * share
    assert rel_rmse(_reference(s, weight, 0.3, SINKS), expected) < 1e-5


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["plain", "sinks"])
def test_absorbed_decode_equals_expanded_decode(sinks):
    """The sdpa backend's decodes (absorbed) against the reference's (expanded), same schedule and
    inputs: the decode steps' rows only."""
    steps = [[(0, 0, 9), (1, 0, 3), (2, 0, 14)], [(0, 9, 10), (1, 3, 4), (2, 14, 15)], [(0, 10, 11), (2, 15, 16)]]
    totals = [11, 4, 16]
    expanded, _, _ = _run("torch", steps, totals, seed=3, sinks=sinks)
    absorbed, _, _ = _run("sdpa", steps, totals, seed=3, sinks=sinks)
    for i in range(len(totals)):
        decode_rows = torch.cat(expanded[i][1:])
        assert rel_rmse(absorbed[i][0], expanded[i][0]) < 1e-5  # the prefill rows: both expand
        assert rel_rmse(torch.cat(absorbed[i][1:]), decode_rows) < 1e-5, i


def test_absorbed_decode_never_expands_the_latent():
    """The absorbed path reads the cache as [c_kv, k_pe] rows and projects the query instead: with
    the value rows of kv_b_proj zeroed the output is zero whatever the cache holds."""
    cache = torch.randn(3, 4, 1, LORA + D_ROPE)
    weight = torch.randn(N * (D_NOPE + D_V), LORA)
    weight.view(N, D_NOPE + D_V, LORA)[:, D_NOPE:] = 0
    out = absorbed_decode(torch.randn(2, N, D_NOPE), torch.randn(2, N, D_ROPE), cache,
                          torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), torch.tensor([5, 2], dtype=torch.int32),
                          torch.tensor([1, 1], dtype=torch.int32), weight, 0.3)
    assert out.shape == (2, N, D_V) and torch.count_nonzero(out) == 0


def test_bad_shapes_are_errors_naming_them():
    gen = torch.Generator().manual_seed(0)
    s = _inputs(3, gen)
    with pytest.raises(ValueError, match="does not map a 16-wide latent to 4 heads"):
        ad.torch_mla(s["q_nope"][None], s["q_pe"][None], s["ckv"][None], s["kpe"][None], torch.randn(56, 8), True, None)
    with pytest.raises(ValueError, match="q_pe has 4 rope dims, kpe 3"):
        ad.torch_mla(s["q_nope"][None], s["q_pe"][None], s["ckv"][None], s["kpe"][None, ..., :3], torch.randn(56, LORA),
                     True, None)


# ---- torch_mla against HF's MLA attention ----------------------------------------------------


class _OpsCalled(TorchDispatchMode):
    """Records the name of every op dispatched while it is active."""

    def __enter__(self):
        self.names = set()
        super().__enter__()
        return self.names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def _hf_attention(model_type: str, interleave: bool):
    from transformers import AutoConfig
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    config = AutoConfig.for_model(model_type, hidden_size=48, num_attention_heads=4, num_key_value_heads=4,
                                  q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                  v_head_dim=6, rope_interleave=interleave, num_hidden_layers=1, vocab_size=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return ds.DeepseekV3Attention(config, layer_idx=0).eval(), ds.DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("batch, seq", [(2, 7), (1, 1)])
def test_torch_mla_equals_hf_mla_attention(interleave, batch, seq):
    """HF's module (eager attention over expanded K/V with its causal mask) against the same module
    exported-route style: ``expand_kv`` claimed, ``torch_mla`` over the latent."""
    attn, rotary = _hf_attention("deepseek_v3", interleave)
    hidden = torch.randn(batch, seq, 48)
    pos = torch.arange(seq).expand(batch, seq)
    cos_sin = rotary(hidden, pos)
    causal = torch.full((seq, seq), float("-inf")).triu(1).expand(batch, 1, seq, seq)
    with torch.no_grad():
        ref = attn(hidden, cos_sin, attention_mask=causal)[0]
        with _mla_latent_attention(attn), hf_attention_route(attn, "autodeploy"), _OpsCalled() as called:
            got = attn(hidden, cos_sin, attention_mask=None)[0]
            assert len(_EXPANSIONS) == 1
    assert "autodeploy::torch_mla" in called  # the expansion was claimed: torch_mla ran
    assert rel_rmse(got, ref) < 1e-5
