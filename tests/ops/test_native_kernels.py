"""autodeploy's C kernels (``autodeploy.ops.native``): built once per machine, numerics equal to
the torch reference, inputs they cannot take declined (nothing written), and every way of
being unavailable (switched off, no compiler, a failed build) a logged fallback, not an error."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from autodeploy.ops import cached_attention, native

ad = torch.ops.autodeploy
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")
PAGE = 16


def _paged(num_pages=64, n_kv=4, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_pages, PAGE, n_kv, d, generator=g), torch.randn(num_pages, PAGE, n_kv, d, generator=g))


def _reference(q, k_cache, v_cache, pages, length, scale, window=None):
    """SDPA over one sequence's first ``length`` cached positions (the last ``window`` of them)."""
    first = max(0, length - window) if window else 0
    slots = [int(pages[t // PAGE]) * PAGE + t % PAGE for t in range(first, length)]
    n_kv, d = k_cache.shape[2:]
    k = k_cache.view(-1, n_kv, d)[slots].transpose(0, 1)[None]
    v = v_cache.view(-1, n_kv, d)[slots].transpose(0, 1)[None]
    return F.scaled_dot_product_attention(q[None, :, None], k, v, scale=scale, enable_gqa=True)[0, :, 0]


@needs_native
@pytest.mark.parametrize("lengths, n_q, window", [([37], 12, None), ([1, 17, 40, 100, 33], 12, None),
                                                  ([1, 17, 40, 100, 33], 8, 10), ([5, 300], 4, None)])
def test_paged_decode_attention_matches_sdpa(lengths, n_q, window):
    # one sequence (heads split over threads) and several (whole sequences per thread), GQA and
    # MHA, a window, and scores far apart (scale 1.0 on unit keys: exp of large negative numbers)
    k_cache, v_cache = _paged(num_pages=128, n_kv=4)
    batch = len(lengths)
    table = torch.randperm(k_cache.shape[0])[: batch * 20].reshape(batch, 20).int()
    q = torch.randn(batch, n_q, 64) * 3
    lens = torch.tensor(lengths, dtype=torch.int32)
    for scale in (0.125, 1.0):
        out = native.paged_decode_attention(q, k_cache, v_cache, table, lens - 1, torch.ones_like(lens), scale, window)
        assert out.shape == (batch, n_q, 64)
        for b, n in enumerate(lengths):
            # as close to a float64 reference as torch's float32 SDPA is, give or take a few float32
            # ulps of the output (the two sum in different orders: on one AVX-512 CPU SDPA happened
            # to land within 7e-7 where the kernel was 2.4e-6 off, both ~1e-6 of outputs ~3)
            exact = _reference(q[b].double(), k_cache.double(), v_cache.double(), table[b], n, scale, window)
            sdpa_err = (_reference(q[b], k_cache, v_cache, table[b], n, scale, window).double() - exact).abs().max()
            err = (out[b].double() - exact).abs().max()
            ulps = 4 * torch.finfo(torch.float32).eps * exact.abs().max()
            assert err <= 2 * sdpa_err + ulps, (b, float(err), float(sdpa_err))


@needs_native
def test_paged_decode_attention_writes_the_new_rows_like_index_copy():
    k_cache, v_cache = _paged(n_kv=2, d=32)
    table = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    input_pos = torch.tensor([3, 20, 0], dtype=torch.int32)
    slots = torch.tensor([int(table[b, p // PAGE]) * PAGE + p % PAGE for b, p in enumerate(input_pos.tolist())])
    fused = torch.randn(3, 4 * 32 + 2 * 32 + 2 * 32)  # q | k | v of a fused projection: strided rows
    q, k, v = fused[:, :128].view(3, 4, 32), fused[:, 128:192].view(3, 2, 32), fused[:, 192:].view(3, 2, 32)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    expect_k.view(-1, 2, 32).index_copy_(0, slots, k)
    expect_v.view(-1, 2, 32).index_copy_(0, slots, v)
    out = native.paged_decode_attention(q, k_cache, v_cache, table, input_pos, torch.ones(3, dtype=torch.int32), 0.2,
                                        None, new_kv=(k, v, slots))
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    for b in range(3):
        torch.testing.assert_close(out[b], _reference(q[b], k_cache, v_cache, table[b], int(input_pos[b]) + 1, 0.2),
                                   rtol=1e-5, atol=1e-5)


@needs_native
def test_paged_decode_attention_declines_what_it_cannot_take_and_writes_nothing():
    k_cache, v_cache = _paged(n_kv=2, d=32)
    before = k_cache.clone()
    table, pos, one = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([4], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    q, k, v = torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    slots = torch.tensor([4])
    assert native.paged_decode_attention(q.bfloat16(), k_cache, v_cache, table, pos, one, 1.0, None) is None
    assert native.paged_decode_attention(q, k_cache.bfloat16(), v_cache.bfloat16(), table, pos, one, 1.0, None) is None
    assert native.paged_decode_attention(q, k_cache, v_cache, table.long(), pos, one, 1.0, None) is None
    assert native.paged_decode_attention(torch.randn(1, 3, 32), k_cache, v_cache, table, pos, one, 1.0, None) is None
    assert native.paged_decode_attention(q, k_cache, v_cache, table, pos, one, 1.0, None,
                                         new_kv=(k, v, slots.int())) is None  # slots must be int64
    assert native.paged_decode_attention(q, k_cache, v_cache, table, pos, one, 1.0, None,
                                         new_kv=(k.transpose(1, 2).contiguous().transpose(1, 2), v, slots)) is None
    assert torch.equal(k_cache, before)
    with native.disabled():
        assert native.paged_decode_attention(q, k_cache, v_cache, table, pos, one, 1.0, None) is None
    assert native.paged_decode_attention(q, k_cache, v_cache, table, pos, one, 1.0, None) is not None  # control
    with pytest.raises(RuntimeError, match="runs past its page table"):
        native.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([40], dtype=torch.int32), one, 1.0, None)


@needs_native
@pytest.mark.parametrize("window", [None, 6])
def test_cached_attention_op_same_with_and_without_the_kernel(window):
    """The whole op in a decode step (cache write + attention): the native path and the torch
    path leave the same cache and give the same output."""
    n_kv, d, lengths = 2, 16, [3, 9, 30]
    batch = len(lengths)
    table = torch.arange(batch * 2, dtype=torch.int32).reshape(batch, 2)
    input_pos = torch.tensor(lengths, dtype=torch.int32)
    seq_len = torch.ones(batch, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    positions = input_pos.long()[None]
    slots = ad.torch_cached_attention_prepare_metadata(positions, seq_len, cu, table, PAGE)
    q, k, v = torch.randn(1, batch, 4, d), torch.randn(1, batch, n_kv, d), torch.randn(1, batch, n_kv, d)
    info = torch.tensor([0, 0, batch], dtype=torch.int32)
    results = []
    for off in (False, True):
        k_cache, v_cache = _paged(num_pages=8, n_kv=n_kv, d=d, seed=1)
        ctx = native.disabled() if off else torch.no_grad()
        with ctx:
            out = cached_attention.sdpa_cached_attention_with_cache(
                q, k, v, info, seq_len, input_pos, cu, table, slots, k_cache, v_cache, None, None, window, None)
        results.append((out, k_cache, v_cache))
    (a, ka, va), (b, kb, vb) = results
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _load_in_subprocess(env: dict) -> str:
    code = textwrap.dedent("""
        from autodeploy.ops import native
        print("LOADED" if native.available() else "OFF: " + native.unavailable_reason())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_switched_off_by_the_environment(tmp_path):
    out = _load_in_subprocess({native.ENV_SWITCH: "0", "AUTODEPLOY_CACHE": str(tmp_path)})
    assert out == f"OFF: {native.ENV_SWITCH}=0"
    assert not (tmp_path / "native").exists()  # nothing built


def test_a_failed_build_is_a_fallback_with_the_reason(tmp_path):
    failing = tmp_path / "badcc"
    failing.write_text("#!/bin/sh\necho 'badcc: cannot compile' >&2\nexit 1\n")
    failing.chmod(0o755)
    out = _load_in_subprocess({"CC": str(failing), "AUTODEPLOY_CACHE": str(tmp_path)})
    assert out.startswith("OFF: building them failed") and "cannot compile" in out


@needs_native
def test_fresh_build_loads_with_torchs_openmp_runtime(tmp_path):
    out = _load_in_subprocess({"AUTODEPLOY_CACHE": str(tmp_path)})
    assert out == "LOADED"
    built = list((tmp_path / "native").glob("*/libautodeploy_kernels.so"))
    assert len(built) == 1
    code = ("import torch; from autodeploy.ops import native; native.load(); "
            "print(len(native._openmp_runtimes()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "AUTODEPLOY_CACHE": str(tmp_path)})
    assert done.stdout.strip().splitlines()[-1] == "1", done.stderr  # one OpenMP runtime in the process


# ---- one-row GEMV ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(64, 32), (37, 45), (1283, 771), (3, 7)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemv_matches_a_float64_linear(n, k, with_bias):
    torch.manual_seed(n + k)
    w, x = torch.randn(n, k), torch.randn(1, 1, k)
    bias = torch.randn(n) if with_bias else None
    out = native.gemv(x, w, bias)
    ref = F.linear(x.double(), w.double(), bias.double() if with_bias else None)
    assert out.shape == (1, 1, n) and out.dtype == torch.float32
    # float32 sums of k products: as close to float64 as torch's own float32 linear
    own = (F.linear(x, w, bias).double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= max(4 * own, 1e-5)


def test_gemv_reads_rows_with_a_stride():
    w_wide = torch.randn(40, 80)
    w = w_wide[:, :48]  # row stride 80, not contiguous
    x = torch.randn(48)
    torch.testing.assert_close(native.gemv(x, w), w @ x, rtol=1e-5, atol=1e-5)


def test_gemv_declines_what_it_cannot_take():
    w = torch.randn(16, 32)
    assert native.gemv(torch.randn(2, 32), w) is None  # two rows
    assert native.gemv(torch.randn(1, 32, dtype=torch.bfloat16), w.bfloat16()) is None
    assert native.gemv(torch.randn(1, 32), w.t().contiguous().t()) is None  # column-major
    assert native.gemv(torch.randn(1, 32), torch.ops.mkldnn._reorder_linear_weight(w)) is None  # packed
    assert native.gemv(torch.randn(1, 32), w, torch.randn(8)) is None  # bias of the wrong size
    with native.disabled():
        assert native.gemv(torch.randn(1, 32), w) is None


# ---- SwiGLU's activation --------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1, 4096), (32, 4096), (3, 5, 18), (2, 7, 30)])
def test_silu_and_mul_matches_torch(shape):
    torch.manual_seed(shape[-1])
    x = torch.randn(*shape) * 6
    d = shape[-1] // 2
    out = native.silu_and_mul(x)
    ref = (F.silu(x[..., :d].double()) * x[..., d:].double())
    assert out.shape == (*shape[:-1], d) and out.dtype == torch.float32
    # a few float32 ulps of the float64 value, as torch's own float32 pair of ops
    assert ((out.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item() < 2e-6


def test_silu_and_mul_extremes_and_strided_rows():
    g = torch.tensor([-1e4, -100.0, -20.0, -1e-8, 0.0, 1e-8, 20.0, 100.0, 1e4])
    x = torch.cat([g, torch.ones_like(g)]).unsqueeze(0)
    out = native.silu_and_mul(x)[0]
    assert torch.isfinite(out).all() and out[-3:].tolist() == [20.0, 100.0, 1e4] and out[4] == 0
    assert (out[:3].abs() < 1e-6).all()  # silu of a large negative is ~0, never NaN
    wide = torch.randn(4, 40)
    rows = wide[:, :20]  # row stride 40
    torch.testing.assert_close(native.silu_and_mul(rows), F.silu(rows[:, :10]) * rows[:, 10:])


def test_silu_and_mul_declines_what_it_cannot_take():
    assert native.silu_and_mul(torch.randn(2, 7)) is None  # odd width
    assert native.silu_and_mul(torch.randn(2, 8, dtype=torch.bfloat16)) is None
    assert native.silu_and_mul(torch.randn(8, 2).t()) is None  # last dim not contiguous
    with native.disabled():
        assert native.silu_and_mul(torch.randn(2, 8)) is None


def test_swiglu_ops_same_with_and_without_the_kernel():
    torch.manual_seed(0)
    x, gate_up, down = torch.randn(3, 5, 32), torch.randn(96, 32) / 6, torch.randn(32, 48) / 7
    ad = torch.ops.autodeploy
    with_kernel = ad.torch_fused_swiglu_mlp(x, gate_up, down), ad.torch_silu_and_mul(x @ gate_up.T)
    with native.disabled():
        without = ad.torch_fused_swiglu_mlp(x, gate_up, down), ad.torch_silu_and_mul(x @ gate_up.T)
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    h = x @ gate_up.T
    assert torch.equal(ad.torch_silu_and_mul(h), native.silu_and_mul(h))  # the op took the kernel


# ---- rotate-half RoPE -----------------------------------------------------------------------------
def _rope_reference(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


@pytest.mark.parametrize("b, s, heads, d", [(1, 1, 12, 64), (2, 5, 4, 64), (3, 7, 2, 18), (1, 300, 12, 64)])
def test_rope_equals_torch_bit_for_bit_on_strided_views(b, s, heads, d):
    torch.manual_seed(s)
    fused = torch.randn(b, s, heads * d + 40)  # q as a view of a wider fused projection
    x = fused[..., 8:8 + heads * d].reshape(b, s, heads, d)
    cos, sin = torch.randn(b, s, d), torch.randn(b, s, d)
    out = native.rope(x, cos, sin)
    assert out.is_contiguous() and torch.equal(out, _rope_reference(x, cos, sin))


def test_rope_op_takes_the_kernel_and_equals_its_reference():
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 1280)
    q, k = qkv[..., :768].reshape(2, 5, 12, 64), qkv[..., 768:1024].reshape(2, 5, 4, 64)
    cos, sin = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    op = torch.ops.autodeploy.torch_rope_with_explicit_cos_sin
    fast = op(q, k, cos, sin, 2)
    with native.disabled():
        reference = op(q, k, cos, sin, 2)
    assert all(torch.equal(a, b) for a, b in zip(fast, reference))
    assert torch.equal(fast[0], native.rope(q, cos, sin))


def test_rope_declines_what_it_cannot_take():
    x, cs = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 8)
    assert native.rope(x.transpose(1, 2), cs, cs) is None  # cos/sin not [B, S, D] for this layout
    assert native.rope(torch.randn(1, 3, 2, 7), torch.randn(1, 3, 7), torch.randn(1, 3, 7)) is None  # odd D
    assert native.rope(x.double(), cs.double(), cs.double()) is None
    assert native.rope(x.transpose(2, 3).contiguous().transpose(2, 3), cs, cs) is None  # D not contiguous
    assert native.rope(x, torch.randn(1, 1, 8), cs) is None  # a broadcast cos is not taken
