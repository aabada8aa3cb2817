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
            # as close to a float64 reference as torch's float32 SDPA is
            exact = _reference(q[b].double(), k_cache.double(), v_cache.double(), table[b], n, scale, window)
            sdpa_err = (_reference(q[b], k_cache, v_cache, table[b], n, scale, window).double() - exact).abs().max()
            err = (out[b].double() - exact).abs().max()
            assert err <= 2 * sdpa_err + 1e-6, (b, float(err), float(sdpa_err))


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
