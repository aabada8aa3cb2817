"""Cached attention over an FP8 (``float8_e4m3fn``) KV cache with per-tensor scales.

The contract: an fp8 cache stores ``e4m3(clamp(k / k_scale, +-448))`` and every read returns
``stored.float() * k_scale``. So the ops over an fp8 cache must equal the same ops over a float32
cache fed with k/v already rounded to that grid (quantize-dequantize), up to float32 reduction
order, in every kind of step: fresh prefills, chunked prefills, decodes and mixed steps; and both
backends must agree. Scales other than 1 must be honoured (a 900 survives with scale 4 and
saturates to 448 with scale 1), the native float32 decode kernel must never see an fp8 cache, and
a page of an fp8 cache costs a quarter of a float32 page's bytes.
"""

from typing import List, Optional, Sequence, Tuple

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.cache import build_sequence_info
from autodeploy.cache.resources import PagedKVHandler
from autodeploy.ops import native
from autodeploy.ops.cached_attention import KV_FP8_DTYPE, dequantize_kv, quantize_kv

ad = torch.ops.autodeploy
BACKENDS = ["torch", "sdpa"]
FP8 = torch.float8_e4m3fn
PAGE = 4
N_HEADS, N_KV, D = 4, 2, 8

# (sequence, start, end) per step; totals 9, 5, 13, 7 (as tests/ops/test_cached_attention_ops.py)
TOTALS = [9, 5, 13, 7]
MIXED = [
    [(0, 0, 8), (1, 0, 4), (2, 0, 6), (3, 0, 5)],  # fresh prefills (seq 2: its first chunk)
    [(2, 6, 11), (3, 5, 6), (0, 8, 9), (1, 4, 5)],  # a chunked prefill continuing in the cache + decodes
    [(2, 11, 12), (3, 6, 7)],  # a decode-only step
    [(2, 12, 13)],
]
# every sequence prefilled in chunks of 3 tokens, all in the same steps
CHUNKED = [[(i, s, min(s + 3, t)) for i, t in enumerate(TOTALS) if s < t] for s in range(0, max(TOTALS), 3)]
SCHEDULES = {"mixed": MIXED, "chunked": CHUNKED}
SCALES = [(None, None), (0.5, 3.0)]


def _qdq(x: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """The value an fp8 cache gives back for ``x``, computed here from the contract."""
    s = 1.0 if scale is None else scale
    return (x / s).clamp(-448.0, 448.0).to(FP8).float() * s


def _inputs(seed: int = 0) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    q = [torch.randn(t, N_HEADS, D, generator=g) for t in TOTALS]
    k = [4 * torch.randn(t, N_KV, D, generator=g) for t in TOTALS]  # a spread that uses the fp8 exponents
    v = [torch.randn(t, N_KV, D, generator=g) for t in TOTALS]
    return q, k, v


def _tables(num_pages: int) -> List[List[int]]:
    """Pages handed out back to front, so no sequence has ascending consecutive pages."""
    free = list(range(num_pages))
    return [[free.pop() for _ in range(-(-t // PAGE))] for t in TOTALS]


def _run(backend: str, steps, k_cache: torch.Tensor, v_cache: torch.Tensor, q, k, v,
         scales: Tuple[Optional[float], Optional[float]] = (None, None), window: Optional[int] = None,
         cap: Optional[float] = None) -> List[torch.Tensor]:
    """Runs ``steps``; returns each sequence's outputs concatenated over the steps."""
    tables = _tables(k_cache.shape[0])
    outs: List[List[torch.Tensor]] = [[] for _ in TOTALS]
    for step in steps:
        info = build_sequence_info([[0] * (e - s) for _, s, e in step], [s for _, s, _ in step],
                                   [tables[i] for i, _, _ in step])
        qs, ks, vs = ([x[i][s:e] for i, s, e in step] for x in (q, k, v))
        slots = ad.torch_cached_attention_prepare_metadata(info.position_ids, info.seq_len, info.cu_seqlen,
                                                          info.page_table, PAGE)
        op = getattr(ad, f"{backend}_cached_attention_with_cache")
        o = op(torch.cat(qs)[None], torch.cat(ks)[None], torch.cat(vs)[None], info.batch_info, info.seq_len,
               info.input_pos, info.cu_seqlen, info.page_table, slots, k_cache, v_cache, None, None, window, cap,
               *scales)
        off = 0
        for i, s, e in step:
            outs[i].append(o[0, off:off + e - s])
            off += e - s
    return [torch.cat(x) for x in outs]


def _caches(dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    num_pages = sum(-(-t // PAGE) for t in TOTALS) + 2
    return (torch.zeros(num_pages, PAGE, N_KV, D, dtype=dtype), torch.zeros(num_pages, PAGE, N_KV, D, dtype=dtype))


def _fp8_and_rounded(backend: str, steps, scales, **kw) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(outputs over an fp8 cache, outputs over a float32 cache fed the rounded k/v)."""
    q, k, v = _inputs()
    got = _run(backend, steps, *_caches(FP8), q, k, v, scales, **kw)
    rounded_k, rounded_v = [_qdq(x, scales[0]) for x in k], [_qdq(x, scales[1]) for x in v]
    ref = _run(backend, steps, *_caches(torch.float32), q, rounded_k, rounded_v, **kw)
    return got, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("scales", SCALES, ids=["scale1", "scaled"])
def test_fp8_cache_equals_float_cache_fed_rounded_kv(backend, schedule, scales):
    got, ref = _fp8_and_rounded(backend, SCHEDULES[schedule], scales)
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"sequence {i}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, cap", [(3, None), (None, 2.0)], ids=["window", "softcap"])
def test_fp8_cache_with_window_and_softcap(backend, window, cap):
    got, ref = _fp8_and_rounded(backend, MIXED, (0.5, 3.0), window=window, cap=cap)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_backends_agree_on_an_fp8_cache():
    q, k, v = _inputs(seed=1)
    outs = {b: _run(b, MIXED, *_caches(FP8), q, k, v, (0.5, 3.0)) for b in BACKENDS}
    for a, b in zip(outs["torch"], outs["sdpa"]):  # float32's default tolerance: they sum in different orders
        torch.testing.assert_close(a, b)


def _one_token(backend: str, value: float, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """A one-token sequence whose k and v are all ``value``: attention over one key returns its
    value, so the output is what the cache gives back. Returns (output, stored v codes)."""
    k_cache, v_cache = _caches(FP8)
    info = build_sequence_info([[0]], [0], [[0]])
    slots = ad.torch_cached_attention_prepare_metadata(info.position_ids, info.seq_len, info.cu_seqlen,
                                                      info.page_table, PAGE)
    x = torch.full((1, 1, N_KV, D), value)
    q = torch.randn(1, 1, N_HEADS, D)
    op = getattr(ad, f"{backend}_cached_attention_with_cache")
    o = op(q, x, x, info.batch_info, info.seq_len, info.input_pos, info.cu_seqlen, info.page_table, slots,
           k_cache, v_cache, None, None, None, None, scale, scale)
    return o, v_cache[0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_scales_are_honoured_and_overflow_saturates(backend):
    out, stored = _one_token(backend, 900.0, 4.0)  # 900 / 4 = 225 -> e4m3 224 -> 896
    assert torch.all(stored.float() == 224.0)
    assert torch.all(out == 896.0)
    out, stored = _one_token(backend, -900.0, 1.0)  # beyond the range: saturates, never NaN
    assert torch.all(stored.float() == -448.0)
    assert torch.all(out == -448.0)


def test_quantize_kv_matches_the_contract():
    x = torch.tensor([0.0, 1e-4, -3.3, 17.0, 460.0, -1e6, 1e9])
    for scale in (None, 1.0, 0.25, 7.0):
        codes = quantize_kv(x, scale)
        assert codes.dtype == KV_FP8_DTYPE and not torch.isnan(codes.float()).any()
        assert torch.equal(dequantize_kv(codes, scale, torch.float32), _qdq(x, scale))


def test_native_decode_kernel_never_reads_an_fp8_cache(monkeypatch):
    """The C kernel reads float32 pages: with an fp8 cache the sdpa op must not call it (decode
    steps and the decodes of mixed steps take the SDPA path); with float32 it still does."""
    calls: List[torch.dtype] = []
    real = native.paged_decode_attention

    def spy(q, k_cache, *args, **kwargs):
        calls.append(k_cache.dtype)
        return real(q, k_cache, *args, **kwargs)

    monkeypatch.setattr(native, "paged_decode_attention", spy)
    q, k, v = _inputs()
    _run("sdpa", MIXED, *_caches(FP8), q, k, v)
    assert calls == []
    _run("sdpa", MIXED, *_caches(torch.float32), q, k, v)
    assert calls and set(calls) == {torch.float32}


@pytest.mark.parametrize("dtype, ratio", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_an_fp8_page_costs_a_fraction_of_the_model_dtype(dtype, ratio):
    fp8, wide = PagedKVHandler(N_KV, 16, FP8), PagedKVHandler(N_KV, 16, dtype)
    assert fp8.bytes_per_page(16) * ratio == wide.bytes_per_page(16) == 16 * N_KV * 16 * ratio
    pool = fp8.allocate(3, 16, torch.device("cpu"))
    assert pool.dtype == FP8 and pool.shape == (3, 16, N_KV, 16) and not pool.float().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fake_kernel_takes_the_scales(backend):
    op = getattr(ad, f"{backend}_cached_attention_with_cache")
    info = build_sequence_info([[0, 0, 0]], [0], [[0]])
    with FakeTensorMode() as mode:
        args: Sequence[torch.Tensor] = [mode.from_tensor(t) for t in (
            torch.randn(1, 3, N_HEADS, D), torch.randn(1, 3, N_KV, D), torch.randn(1, 3, N_KV, D), info.batch_info,
            info.seq_len, info.input_pos, info.cu_seqlen, info.page_table, torch.zeros(3, dtype=torch.long),
            *_caches(FP8))]
        out = op(*args, None, None, None, None, 0.5, 2.0)
    assert out.shape == (1, 3, N_HEADS, D) and out.dtype == torch.float32
