"""torch_attention / torch_causal_mask against plain references and transformers' own masks."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import masking_utils as mu

from autodeploy.export.hf_attention import classify_mask_function

ad = torch.ops.autodeploy


def _qkv(b=2, s_q=5, s_kv=5, n=4, n_kv=4, d=8, d_v=None, dtype=torch.float32):
    q = torch.randn(b, s_q, n, d, dtype=dtype)
    k = torch.randn(b, s_kv, n_kv, d, dtype=dtype)
    v = torch.randn(b, s_kv, n_kv, d if d_v is None else d_v, dtype=dtype)
    return q, k, v


def _keep(s_q, s_kv, causal=True, window=None):
    """Bottom-right aligned keep-mask [s_q, s_kv] built position by position (no vectorised tricks)."""
    keep = torch.zeros(s_q, s_kv, dtype=torch.bool)
    for i in range(s_q):
        pos = s_kv - s_q + i  # absolute position of query i
        for j in range(s_kv):
            ok = True
            if causal:
                ok = ok and j <= pos
            if window is not None:
                ok = ok and j > pos - window
            keep[i, j] = ok
    return keep


def _reference(q, k, v, mask=None, scale=None):
    """SDPA in bnsd on repeat_interleave'd k/v with an explicit mask; output back to bsnd."""
    n, n_kv = q.shape[2], k.shape[2]
    qh = q.transpose(1, 2).double()
    kh = k.transpose(1, 2).double().repeat_interleave(n // n_kv, dim=1)
    vh = v.transpose(1, 2).double().repeat_interleave(n // n_kv, dim=1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).to(q.dtype)


def _close(out, ref, atol=1e-5):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-4)


def test_plain_attention_matches_sdpa():
    q, k, v = _qkv()
    _close(ad.torch_attention(q, k, v), _reference(q, k, v))


def test_gqa_heads_are_repeat_interleaved():
    q, k, v = _qkv(n=6, n_kv=2)
    out = ad.torch_attention(q, k, v)
    _close(out, _reference(q, k, v))
    # repeat (tiling) order would be a different head assignment: must not coincide
    kt = k.transpose(1, 2).repeat(1, 3, 1, 1).transpose(1, 2)
    vt = v.transpose(1, 2).repeat(1, 3, 1, 1).transpose(1, 2)
    assert not torch.allclose(out, ad.torch_attention(q, kt, vt), atol=1e-3)


def test_causal_square():
    q, k, v = _qkv(s_q=6, s_kv=6, n=4, n_kv=2)
    _close(ad.torch_attention(q, k, v, is_causal=True), _reference(q, k, v, _keep(6, 6)))


@pytest.mark.parametrize("s_q", [1, 3])
def test_causal_is_bottom_right_aligned_for_decode(s_q):
    q, k, v = _qkv(s_q=s_q, s_kv=7, n=4, n_kv=2)
    out = ad.torch_attention(q, k, v, is_causal=True)
    _close(out, _reference(q, k, v, _keep(s_q, 7)))
    if s_q == 1:
        # the last query sees every key: same as no mask at all
        _close(out, _reference(q, k, v))


@pytest.mark.parametrize("s_q,s_kv,window", [(7, 7, 3), (2, 9, 4), (1, 6, 2)])
def test_sliding_window(s_q, s_kv, window):
    q, k, v = _qkv(s_q=s_q, s_kv=s_kv, n=4, n_kv=1)
    out = ad.torch_attention(q, k, v, is_causal=True, sliding_window=window)
    _close(out, _reference(q, k, v, _keep(s_q, s_kv, window=window)))
    # the window really restricts something
    assert not torch.allclose(out, ad.torch_attention(q, k, v, is_causal=True), atol=1e-4)


def test_custom_scale():
    q, k, v = _qkv(n=4, n_kv=2)
    out = ad.torch_attention(q, k, v, is_causal=True, scale=0.05)
    _close(out, _reference(q, k, v, _keep(5, 5), scale=0.05))
    assert not torch.allclose(out, ad.torch_attention(q, k, v, is_causal=True), atol=1e-4)


def test_logit_cap_matches_manual_tanh_math():
    q, k, v = _qkv(s_q=5, s_kv=5, n=4, n_kv=2)
    q = q * 4  # large logits so the cap matters
    cap, scale = 2.0, 0.3
    out = ad.torch_attention(q, k, v, is_causal=True, scale=scale, logit_cap=cap)
    qh = q.transpose(1, 2).double()
    kh = k.transpose(1, 2).double().repeat_interleave(2, dim=1)
    vh = v.transpose(1, 2).double().repeat_interleave(2, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~_keep(5, 5), float("-inf"))
    ref = (scores.softmax(-1) @ vh).transpose(1, 2).float()
    _close(out, ref)
    assert not torch.allclose(out, ad.torch_attention(q, k, v, is_causal=True, scale=scale), atol=1e-3)


def test_sinks_join_the_denominator_and_are_dropped():
    q, k, v = _qkv(s_q=4, s_kv=4, n=4, n_kv=2)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = ad.torch_attention(q, k, v, is_causal=True, sinks=sinks)
    qh = q.transpose(1, 2).double()
    kh = k.transpose(1, 2).double().repeat_interleave(2, dim=1)
    vh = v.transpose(1, 2).double().repeat_interleave(2, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(~_keep(4, 4), float("-inf"))
    sink_col = sinks.double().view(1, 4, 1, 1).expand(2, 4, 4, 1)
    probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
    ref = (probs @ vh).transpose(1, 2).float()
    _close(out, ref)
    # probabilities no longer sum to one
    assert not torch.allclose(out, ad.torch_attention(q, k, v, is_causal=True), atol=1e-3)


@pytest.mark.parametrize("s_q, s_kv, n_kv", [(6, 6, 4), (1, 7, 2), (3, 8, 1)])
def test_alibi_matches_float64_hand_computation(s_q, s_kv, n_kv):
    """softmax(scale * q.k + slope_h * (key_pos - query_pos), causal) @ v in float64, with the
    queries at the last ``s_q`` positions (decode and chunk shapes included)."""
    q, k, v = _qkv(b=2, s_q=s_q, s_kv=s_kv, n=4, n_kv=n_kv)
    slopes = torch.tensor([0.5, 0.25, 0.125, -0.7])
    out = ad.torch_attention(q, k, v, None, 0.0, True, 0.3, None, None, None, slopes)
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd, vd = (x.repeat_interleave(4 // n_kv, dim=1) for x in (kd, vd))
    ref = torch.empty(2, 4, s_q, v.shape[-1], dtype=torch.float64)
    for b in range(2):
        for h in range(4):
            for i in range(s_q):
                qp = s_kv - s_q + i
                logits = torch.tensor([0.3 * float(qd[b, h, i] @ kd[b, h, j]) + float(slopes[h]) * (j - qp)
                                       for j in range(qp + 1)], dtype=torch.float64)
                ref[b, h, i] = torch.softmax(logits, 0) @ vd[b, h, : qp + 1]
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("s_q, s_kv", [(9, 9), (1, 12), (3, 12)])
def test_relative_bias_equals_inklings_dense_position_bias(s_q, s_kv):
    """``rel_logits`` against HF's own ``InklingRelativeLogits`` (the dense ``[b, n, q, kv]`` bias
    from the same per-query table, extent 5 below the key count) and Inkling's eager attention."""
    from transformers.models.inkling.modeling_inkling import InklingRelativeLogits, eager_attention_forward

    torch.manual_seed(0)
    b, n, n_kv, d, d_rel, extent = 2, 4, 2, 8, 3, 5
    rel_module = InklingRelativeLogits(d_rel, extent)
    rel_module.proj.data.normal_()
    states = torch.randn(b, s_q, n, d_rel)
    q, k, v = torch.randn(b, s_q, n, d), torch.randn(b, s_kv, n_kv, d), torch.randn(b, s_kv, n_kv, d)
    q_pos = torch.arange(s_q) + (s_kv - s_q)
    with torch.no_grad():
        bias = rel_module(states, q_pos, torch.arange(s_kv))
        causal = torch.zeros(s_q, s_kv).masked_fill(torch.arange(s_kv)[None] > q_pos[:, None], float("-inf"))
        module = type("M", (), {"num_key_value_groups": n // n_kv, "training": False})()
        ref, _ = eager_attention_forward(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         causal[None, None], 0.25, position_bias=bias)
        rel_logits = states @ rel_module.proj  # [b, s_q, n, R]
    got = ad.torch_attention(q, k, v, None, 0.0, True, 0.25, None, None, None, None, None, None, rel_logits)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    plain = ad.torch_attention(q, k, v, None, 0.0, True, 0.25, None, None, None)
    assert not torch.allclose(plain, ref, atol=1e-3)


def test_alibi_slope_count_must_match_heads():
    q, k, v = _qkv(n=4, n_kv=2)
    with pytest.raises(ValueError, match="ALiBi slopes"):
        ad.torch_attention(q, k, v, None, 0.0, True, None, None, None, None, torch.ones(2))


def test_explicit_bool_mask():
    q, k, v = _qkv(s_q=5, s_kv=5, n=4, n_kv=2)
    mask = torch.rand(2, 1, 5, 5) > 0.4
    mask[..., 0] = True  # no fully-masked rows
    _close(ad.torch_attention(q, k, v, attn_mask=mask), _reference(q, k, v, mask))


def test_explicit_float_mask_per_head():
    q, k, v = _qkv(s_q=3, s_kv=6, n=4, n_kv=2)
    mask = torch.randn(2, 4, 3, 6)
    _close(ad.torch_attention(q, k, v, attn_mask=mask), _reference(q, k, v, mask))


def test_explicit_mask_combines_with_causal():
    q, k, v = _qkv(s_q=5, s_kv=5, n=2, n_kv=2)
    mask = torch.randn(1, 1, 5, 5)
    expected_mask = mask.masked_fill(~_keep(5, 5), float("-inf"))
    _close(ad.torch_attention(q, k, v, attn_mask=mask, is_causal=True), _reference(q, k, v, expected_mask))


def test_different_value_head_dim():
    q, k, v = _qkv(n=4, n_kv=2, d=8, d_v=6)
    out = ad.torch_attention(q, k, v, is_causal=True)
    assert out.shape == (2, 5, 4, 6)
    _close(out, _reference(q, k, v, _keep(5, 5)))


def test_bf16_output_dtype():
    q, k, v = _qkv(n=4, n_kv=2, dtype=torch.bfloat16)
    out = ad.torch_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    _close(out, _reference(q, k, v, _keep(5, 5)), atol=2e-2)


def test_dropout_raises():
    q, k, v = _qkv()
    with pytest.raises(Exception, match="dropout"):
        ad.torch_attention(q, k, v, dropout_p=0.1)


# ---- torch_causal_mask against transformers.masking_utils ----------------------------------------


def _hf_fn(window):
    return mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("b,q_len,kv_len", [(2, 6, 6), (1, 1, 1), (3, 2, 7)])
def test_causal_mask_equals_hf_sdpa_mask(window, b, q_len, kv_len):
    ours = ad.torch_causal_mask(b, q_len, kv_len, window, torch.bool, torch.device("cpu"))
    # HF's queries sit at q_offset..; ours are the last q_len positions of kv_len keys
    hf = mu.sdpa_mask(b, q_len, kv_len, q_offset=kv_len - q_len, mask_function=_hf_fn(window),
                      allow_is_causal_skip=False)
    assert ours.dtype == torch.bool and hf.dtype == torch.bool
    assert ours.shape == (b, 1, q_len, kv_len) == hf.shape
    assert torch.equal(ours, hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 2])
def test_causal_mask_equals_hf_eager_mask(window, dtype):
    b, q_len, kv_len = 2, 5, 5
    ours = ad.torch_causal_mask(b, q_len, kv_len, window, dtype, torch.device("cpu"))
    hf = mu.eager_mask(b, q_len, kv_len, mask_function=_hf_fn(window), dtype=dtype)
    assert ours.dtype == dtype == hf.dtype
    assert ours.shape == hf.shape
    assert torch.equal(ours, hf)


def test_causal_mask_drives_sdpa_like_is_causal():
    q, k, v = _qkv(s_q=6, s_kv=6, n=2, n_kv=2)
    mask = ad.torch_causal_mask(2, 6, 6, 3, torch.bool, torch.device("cpu"))
    _close(ad.torch_attention(q, k, v, attn_mask=mask), ad.torch_attention(q, k, v, is_causal=True, sliding_window=3))


# ---- fake kernels ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_fake_kernel_matches_real(dtype):
    cases = [
        dict(),
        dict(is_causal=True, sliding_window=2, logit_cap=3.0, scale=0.2),
    ]
    q, k, v = _qkv(b=2, s_q=3, s_kv=5, n=4, n_kv=2, d=8, d_v=6, dtype=dtype)
    sinks = torch.zeros(4)
    mask = torch.zeros(2, 1, 3, 5)
    for extra in cases + [dict(sinks=sinks, attn_mask=mask)]:
        real = ad.torch_attention(q, k, v, **extra)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
            fextra = {key: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for key, t in extra.items()}
            fake = ad.torch_attention(fq, fk, fv, **fextra)
        assert fake.shape == real.shape and fake.dtype == real.dtype, extra


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.float16])
def test_causal_mask_fake_kernel_matches_real(dtype):
    real = ad.torch_causal_mask(3, 2, 5, None, dtype, torch.device("cpu"))
    with FakeTensorMode():
        fake = ad.torch_causal_mask(3, 2, 5, None, dtype, torch.device("cpu"))
    assert fake.shape == real.shape == (3, 1, 2, 5)
    assert fake.dtype == real.dtype == dtype
    assert fake.device == real.device


# ---- classify_mask_function ------------------------------------------------------------------------


def test_classify_plain_causal():
    assert classify_mask_function(mu.causal_mask_function) == (True, None)


@pytest.mark.parametrize("window", [3, 128])
def test_classify_sliding_window(window):
    assert classify_mask_function(mu.sliding_window_causal_mask_function(window)) == (True, window)


@pytest.mark.parametrize("window", [None, 5])
def test_classify_packed_sequence_wrapper(window):
    position_ids = torch.arange(6)[None]
    packed = torch.zeros(1, 6, dtype=torch.long)
    fn = mu.packed_sequence_compatibility_function(_hf_fn(window), position_ids, packed)
    assert classify_mask_function(fn) == (True, window)


def test_classify_rejects_what_it_does_not_understand():
    assert classify_mask_function(mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))) == (False, None)
    assert classify_mask_function(mu.bidirectional_mask_function) == (False, None)
    # a sliding window overlay alone (not and-ed with causal) is not causal
    assert classify_mask_function(mu.sliding_window_overlay(3)) == (False, None)
    # a window and-ed with something else than causal
    assert classify_mask_function(mu.and_masks(mu.sliding_window_overlay(3), mu.bidirectional_mask_function)) == (
        False, None)
