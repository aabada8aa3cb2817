"""Cached attention ops over a paged KV cache against plain ``torch_attention`` on whole sequences.

Each scenario schedules a few sequences over several steps (fresh prefills, chunked prefills that
continue at ``input_pos > 0``, single-token decodes), with page tables drawn from a shuffled pool
so no sequence has contiguous pages. The concatenated per-step outputs of every sequence must
equal ``torch_attention`` run once on the whole sequence.
"""

import random
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.cache import build_sequence_info

ad = torch.ops.autodeploy
BACKENDS = ["torch", "sdpa"]

# (sequence, start, end) per step. Totals: 9, 5, 13, 7.
TOTALS = [9, 5, 13, 7]
MIXED_STEPS = [
    # fresh prefills (seq 2 only its first chunk)
    [(0, 0, 8), (1, 0, 4), (2, 0, 6), (3, 0, 5)],
    # chunked prefills continuing in the cache, then decodes
    [(2, 6, 11), (3, 5, 6), (0, 8, 9), (1, 4, 5)],
    # one more chunk and a decode-only tail
    [(2, 11, 12), (3, 6, 7)],
    [(2, 12, 13)],
]


def _op(backend: str):
    return getattr(ad, f"{backend}_cached_attention_with_cache")


def _pages(totals: Sequence[int], page_size: int, num_pages: int, seed: int = 0) -> List[List[int]]:
    """Page tables from a shuffled pool; asserts no sequence got consecutive ascending pages."""
    pool = list(range(num_pages))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-t // page_size))] for t in totals]
    multi = [p for p in tables if len(p) > 1]
    assert not multi or any(any(b != a + 1 for a, b in zip(p, p[1:])) for p in multi)
    return tables


def _run(
    backend: str,
    totals: Sequence[int] = TOTALS,
    steps: Sequence[Sequence[Tuple[int, int, int]]] = MIXED_STEPS,
    n: int = 4,
    n_kv: int = 2,
    d: int = 8,
    page_size: int = 4,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    cap: Optional[float] = None,
    alibi: Optional[torch.Tensor] = None,
    chunk: Optional[int] = None,
    rel: Optional[List[torch.Tensor]] = None,
):
    """Runs the schedule; returns (per-sequence outputs, q, k, v, page tables, k_cache, v_cache).
    ``rel``: per sequence, its queries' relative position bias tables ``[t, n, R]``."""
    num_pages = sum(-(-t // page_size) for t in totals) + 3
    k_cache = torch.zeros(num_pages, page_size, n_kv, d)
    v_cache = torch.zeros(num_pages, page_size, n_kv, d)
    tables = _pages(totals, page_size, num_pages)
    Q = [torch.randn(t, n, d) for t in totals]
    K = [torch.randn(t, n_kv, d) for t in totals]
    V = [torch.randn(t, n_kv, d) for t in totals]
    outs: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(totals))}
    for step in steps:
        info = build_sequence_info([[0] * (e - s) for _, s, e in step], [s for _, s, _ in step],
                                   [tables[i] for i, _, _ in step])
        q = torch.cat([Q[i][s:e] for i, s, e in step])[None]
        k = torch.cat([K[i][s:e] for i, s, e in step])[None]
        v = torch.cat([V[i][s:e] for i, s, e in step])[None]
        slots = ad.torch_cached_attention_prepare_metadata(
            info.position_ids, info.seq_len, info.cu_seqlen, info.page_table, page_size)
        extra = {} if rel is None else {"rel_logits": torch.cat([rel[i][s:e] for i, s, e in step])[None]}
        o = _op(backend)(q, k, v, info.batch_info, info.seq_len, info.input_pos, info.cu_seqlen, info.page_table,
                         slots, k_cache, v_cache, scale, sinks, window, cap, alibi_slopes=alibi,
                         attention_chunk=chunk, **extra)
        assert o.shape == q.shape
        off = 0
        for i, s, e in step:
            outs[i].append(o[0, off:off + e - s])
            off += e - s
    return outs, Q, K, V, tables, k_cache, v_cache


def _check(backend: str, totals=TOTALS, steps=MIXED_STEPS, **kw):
    outs, Q, K, V, *_ = _run(backend, totals, steps, **kw)
    n = Q[0].shape[1]
    sinks, window, cap, scale, alibi, chunk, rel = (kw.get(k) for k in ("sinks", "window", "cap", "scale", "alibi",
                                                                        "chunk", "rel"))
    for i, t in enumerate(totals):
        got = torch.cat(outs[i])
        assert got.shape == (t, n, Q[0].shape[2])
        ref = ad.torch_attention(Q[i][None], K[i][None], V[i][None], None, 0.0, True, scale, sinks, window, cap,
                                 alibi, chunk, None, None if rel is None else rel[i][None])[0]
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"sequence {i}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_prefill_chunked_decode_matches_full_attention(backend):
    _check(backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n, n_kv", [(4, 4), (6, 2), (4, 1)])
def test_gqa_and_mha(backend, n, n_kv):
    _check(backend, n=n, n_kv=n_kv)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 3, 6])
def test_sliding_window_smaller_than_sequences(backend, window):
    assert window < max(TOTALS)  # 6 also exceeds some sequences: both SDPA prefill paths
    _check(backend, window=window)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logit_cap(backend):
    _check(backend, cap=2.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks(backend):
    _check(backend, sinks=torch.randn(4) * 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 4])
def test_alibi_prefill_chunks_and_decodes_match_full_attention(backend, window):
    """ALiBi at absolute positions: a sequence split into prefill chunks and decodes (batched
    decode step included) gives what one uncached ``torch_attention`` gives on it whole. Slopes
    are large so that a position off by one would show."""
    _check(backend, alibi=torch.tensor([0.5, 0.25, -0.3, 1.0]), window=window)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_chunked_local_attention_matches_full_attention(backend, chunk):
    """Llama 4's chunked-local attention at absolute positions: prefill chunks and decodes that
    cross chunk boundaries give what one uncached ``torch_attention`` gives on the whole sequence."""
    assert chunk < max(TOTALS)
    _check(backend, chunk=chunk)


def test_chunked_local_attention_is_not_a_window():
    """The reference op itself: position 4 with chunks of 4 sees only itself; a window of 4 would see
    positions 1-4 (a near miss that would make the test above pass for the wrong reason)."""
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    v = torch.eye(6).reshape(1, 6, 1, 6).expand(1, 6, 2, 6).contiguous()
    out = ad.torch_attention(q, k, v, None, 0.0, True, None, None, None, None, None, 4)
    torch.testing.assert_close(out[0, 4, 0], torch.eye(6)[4])  # only its own value
    assert (out[0, 3, 0, :4] > 0).all() and (out[0, 3, 0, 4:] == 0).all()  # chunk 0: positions 0-3


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_relative_bias_prefill_chunks_and_decodes_match_full_attention(backend, window):
    """Inkling's per-query relative bias (extent 5, below the sequences' lengths) through chunked
    prefills and decodes: each query reads its table at its absolute distance to every key."""
    torch.manual_seed(0)
    rel = [torch.randn(t, 4, 5) * 2 for t in TOTALS]
    _check(backend, rel=rel, window=window)
    q, k, v = torch.randn(1, 13, 4, 8), torch.randn(1, 13, 2, 8), torch.randn(1, 13, 2, 8)
    biased = ad.torch_attention(q, k, v, None, 0.0, True, None, None, window, None, None, None, None, rel[2][None])
    plain = ad.torch_attention(q, k, v, None, 0.0, True, None, None, window, None)
    assert not torch.allclose(biased, plain, atol=1e-2)  # the bias matters at these sizes


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_scale(backend):
    _check(backend, scale=0.9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_cap_sinks_scale_together(backend):
    _check(backend, window=4, cap=3.0, sinks=torch.randn(4), scale=0.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 32])
def test_page_size_extremes(backend, page_size):
    assert page_size == 1 or page_size > max(TOTALS)
    _check(backend, page_size=page_size)
    _check(backend, page_size=page_size, window=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_only_step_with_different_lengths(backend):
    # Every sequence prefilled in its own step, then one decode step over all of them.
    totals = [6, 11, 2, 9]
    steps = [[(i, 0, t - 1)] for i, t in enumerate(totals)] + [[(i, t - 1, t) for i, t in enumerate(totals)]]
    _check(backend, totals, steps, page_size=4)
    _check(backend, totals, steps, page_size=4, window=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_prompt_is_a_prefill(backend):
    totals = [2, 3]
    steps = [[(1, 0, 2), (0, 0, 1)], [(0, 1, 2), (1, 2, 3)]]
    _check(backend, totals, steps, page_size=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_holds_written_kv_at_slots(backend):
    page_size, totals = 4, [9, 5]
    steps = [[(0, 0, 7), (1, 0, 5)], [(0, 7, 9)]]
    outs, Q, K, V, tables, k_cache, v_cache = _run(backend, totals, steps, page_size=page_size)
    written = torch.zeros(k_cache.shape[0] * page_size, dtype=torch.bool)
    for i, t in enumerate(totals):
        for p in range(t):
            slot = tables[i][p // page_size] * page_size + p % page_size
            torch.testing.assert_close(k_cache[slot // page_size, slot % page_size], K[i][p], atol=0, rtol=0)
            torch.testing.assert_close(v_cache[slot // page_size, slot % page_size], V[i][p], atol=0, rtol=0)
            written[slot] = True
    # nothing else was touched
    assert (k_cache.reshape(-1, *k_cache.shape[2:])[~written] == 0).all()
    assert (v_cache.reshape(-1, *v_cache.shape[2:])[~written] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_dtype_differs_from_compute_dtype(backend):
    """A bf16 cache: values are stored rounded to bf16 and attention reads them back."""
    page_size = 4
    info = build_sequence_info([[0] * 6], [0], [[3, 1]])
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    kc, vc = torch.zeros(4, page_size, 2, 8, dtype=torch.bfloat16), torch.zeros(4, page_size, 2, 8, dtype=torch.bfloat16)
    slots = ad.torch_cached_attention_prepare_metadata(info.position_ids, info.seq_len, info.cu_seqlen,
                                                       info.page_table, page_size)
    out = _op(backend)(q, k, v, info.batch_info, info.seq_len, info.input_pos, info.cu_seqlen, info.page_table,
                       slots, kc, vc, None, None, None, None)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(kc[3], k[0, :4].bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(vc[1, :2], v[0, 4:].bfloat16(), atol=0, rtol=0)
    ref = ad.torch_attention(q, k, v, None, 0.0, True)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


def test_prepare_metadata_slots_are_page_times_size_plus_offset():
    page_size = 4
    tables = [[7, 2, 5], [0, 9], [4], [3, 8, 1, 6]]
    tokens = [[1] * 9, [1] * 3, [1], [1]]
    starts = [0, 2, 3, 13]  # fresh prefill, chunk, decode, decode
    info = build_sequence_info(tokens, starts, tables)
    slots = ad.torch_cached_attention_prepare_metadata(info.position_ids, info.seq_len, info.cu_seqlen,
                                                       info.page_table, page_size)
    expected = []
    for table, toks, start in zip(tables, tokens, starts):
        for p in range(start, start + len(toks)):
            expected.append(table[p // page_size] * page_size + p % page_size)
    # hand-written for the first sequence, to not only trust the loop above
    assert expected[:9] == [28, 29, 30, 31, 8, 9, 10, 11, 20]
    assert expected[9:] == [2, 3, 36, 19, 25]
    assert slots.dtype == torch.int64 and slots.shape == (info.num_tokens,)
    assert slots.tolist() == expected


def test_prepare_metadata_page_size_one():
    tables = [[5, 0, 3], [2, 4]]
    info = build_sequence_info([[1] * 3, [1]], [0, 1], tables)
    slots = ad.torch_cached_attention_prepare_metadata(info.position_ids, info.seq_len, info.cu_seqlen,
                                                       info.page_table, 1)
    assert slots.tolist() == [5, 0, 3, 4]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_kernels_return_q_shaped_outputs(backend, dtype):
    with FakeTensorMode():
        q, k, v = torch.empty(1, 11, 6, 16, dtype=dtype), torch.empty(1, 11, 2, 16, dtype=dtype), \
            torch.empty(1, 11, 2, 16, dtype=dtype)
        kc, vc = torch.empty(8, 4, 2, 16, dtype=dtype), torch.empty(8, 4, 2, 16, dtype=dtype)
        i32 = dict(dtype=torch.int32)
        position_ids = torch.empty(1, 11, dtype=torch.long)
        seq_len, input_pos, cu = torch.empty(3, **i32), torch.empty(3, **i32), torch.empty(4, **i32)
        table, batch_info = torch.empty(3, 2, **i32), torch.empty(3, **i32)
        slots = ad.torch_cached_attention_prepare_metadata(position_ids, seq_len, cu, table, 4)
        out = _op(backend)(q, k, v, batch_info, seq_len, input_pos, cu, table, slots, kc, vc,
                           None, None, None, None)
    assert slots.shape == (11,) and slots.dtype == torch.int64
    assert out.shape == q.shape and out.dtype == dtype


def test_sequence_info_fields_for_mixed_batch():
    info = build_sequence_info([[11, 12, 13], [14, 15], [16], [17]], [0, 4, 7, 2], [[3, 1], [0, 2, 5], [4], [6]])
    assert info.input_ids.tolist() == [[11, 12, 13, 14, 15, 16, 17]]
    assert info.position_ids.tolist() == [[0, 1, 2, 4, 5, 7, 2]]
    assert info.batch_info.tolist() == [2, 5, 2]
    assert info.seq_len.tolist() == [3, 2, 1, 1]
    assert info.input_pos.tolist() == [0, 4, 7, 2]
    assert info.cu_seqlen.tolist() == [0, 3, 5, 6, 7]
    assert info.page_table.tolist() == [[3, 1, 0], [0, 2, 5], [4, 0, 0], [6, 0, 0]]
    assert info.last_token_indices().tolist() == [2, 4, 5, 6]


def test_sequence_info_rejects_decode_before_prefill():
    with pytest.raises(ValueError, match="prefill sequences must come before decode"):
        build_sequence_info([[5], [1, 2, 3]], [4, 0], [[0, 1], [2]])
    # a one-token first chunk (start 0) is a prefill, so it may not follow a decode either
    with pytest.raises(ValueError, match="before decode"):
        build_sequence_info([[5], [1]], [4, 0], [[0, 1], [2]])
    # the valid order is accepted
    assert build_sequence_info([[1, 2, 3], [5]], [0, 4], [[2], [0, 1]]).batch_info.tolist() == [1, 3, 1]


def test_sequence_info_rejects_empty_steps():
    with pytest.raises(ValueError, match="at least one sequence"):
        build_sequence_info([], [], [])
    with pytest.raises(ValueError, match="at least one new token"):
        build_sequence_info([[1, 2], []], [0, 3], [[0], [1]])
