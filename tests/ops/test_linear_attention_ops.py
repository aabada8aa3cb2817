"""Decayed linear attention ops: the chunked reference against a float64 token-by-token loop (inside
a chunk, across chunks, strong decays), the cached op over flattened steps against the uncached op
on whole sequences (prefill then decode, chunked prefill, mixed steps, a restart over garbage),
fake kernels and export. HF's MiniMax module itself is the reference in
tests/export/test_hf_lightning.py."""

from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch.export import Dim

from autodeploy.ops import linear_attention
from state_steps import check_slot_writes, step_metadata

ad = torch.ops.autodeploy
RTOL, ATOL = 1e-5, 1e-5
H, DK, DV = 3, 6, 5


def _inputs(s: int, b: int = 1, decay: float = 0.5, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """q/k/v scaled so outputs stay O(1) over long sequences; log-decays in (-decay, 0]."""
    t = dict(q=torch.randn(b, s, H, DK) * 0.5, k=torch.randn(b, s, H, DK) * 0.5, v=torch.randn(b, s, H, DV),
             g=-torch.rand(b, s, H) * decay)
    return {n: x.to(dtype) for n, x in t.items()}


def _loop(t: Dict[str, torch.Tensor], scale: Optional[float],
          state: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per token in float64, as HF MiniMax's decode path writes it: S = exp(g) S + k^T v, o = q S."""
    q, k, v, g = (t[n].double() for n in ("q", "k", "v", "g"))
    b, s = q.shape[:2]
    scale = DK ** -0.5 if scale is None else scale
    S = torch.zeros(b, H, DK, DV, dtype=torch.float64) if state is None else state.double().clone()
    out = torch.zeros(b, s, H, DV, dtype=torch.float64)
    for i in range(s):
        S = S * g[:, i].exp()[..., None, None] + k[:, i, :, :, None] * v[:, i, :, None, :]
        out[:, i] = (scale * q[:, i, :, None, :] @ S).squeeze(-2)
    return out, S


def _uncached(t: Dict[str, torch.Tensor], scale: Optional[float] = None) -> torch.Tensor:
    return ad.torch_linear_attention(t["q"], t["k"], t["v"], t["g"], scale)


@pytest.mark.parametrize("s", [1, 7, linear_attention.CHUNK, 2 * linear_attention.CHUNK + 5])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_reference_matches_token_loop(s, scale):
    t = _inputs(s, b=2)
    torch.testing.assert_close(_uncached(t, scale), _loop(t, scale)[0].float(), rtol=RTOL, atol=ATOL)


def test_strong_decay_underflows_to_zero_not_nan():
    """A log-decay of -60 a token sums to -3,900 within a chunk: exp() of a cumulative sum
    underflows. The op only takes exponentials of differences G_t - G_j (t >= j) or of G_t, all
    <= 0, so it stays finite and equals the loop (where each token only sees itself and a 1e-26
    trace of the one before)."""
    t = _inputs(130, decay=0.0)
    t["g"] = torch.full_like(t["g"], -60.0)
    out = _uncached(t, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _loop(t, 1.0)[0].float(), rtol=RTOL, atol=ATOL)


def test_low_precision_inputs_compute_in_fp32_and_return_their_dtype():
    t = _inputs(70, dtype=torch.bfloat16)
    out = _uncached(t, 1.0)
    assert out.dtype == torch.bfloat16
    expected = _uncached({n: x.float() for n, x in t.items()}, 1.0)
    assert torch.equal(out, expected.bfloat16())


@pytest.mark.parametrize("bad", ["k_heads", "g_shape"])
def test_mismatched_shapes_name_the_tensors(bad):
    t = _inputs(4)
    if bad == "k_heads":
        t["k"] = t["k"][:, :, :2]
    else:
        t["g"] = t["g"][..., None]
    with pytest.raises(ValueError, match=r"linear attention: q .* must be \[b, s, h, dk\]"):
        _uncached(t)


# ---- cached op --------------------------------------------------------------------------------


def _run_schedule(seqs: List[Dict[str, torch.Tensor]], slots: List[int], steps, num_slots: int,
                  cache: Optional[torch.Tensor] = None, scale: Optional[float] = None):
    """Steps of (sequence, start, end, use_initial_state); returns per-sequence outputs and the cache."""
    cache = torch.zeros(num_slots, H, DK, DV) if cache is None else cache
    outs: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    for step in steps:
        meta = step_metadata([(slots[i], s, e - s, cont) for i, s, e, cont in step])
        flat = {n: torch.cat([seqs[i][n][0, s:e] for i, s, e, _ in step])[None] for n in ("q", "k", "v", "g")}
        o = ad.torch_cached_linear_attention(flat["q"], flat["k"], flat["v"], flat["g"], *meta.values(), cache, scale)
        assert o.shape == (1, meta["cu_seqlen"][-1], H, DV)
        for (i, s, e, _), start in zip(step, meta["cu_seqlen"].tolist()):
            outs[i].append(o[0, start:start + e - s])
    return {i: torch.cat(o)[None] for i, o in outs.items() if o}, cache


def test_prefill_then_decode_equals_one_pass():
    """Two prompts prefill in one step, then decode side by side (the batched one-token path) for
    five steps: outputs equal the uncached op, final states the loop's; other slots stay zero."""
    seqs = [_inputs(12), _inputs(9)]
    steps = [[(0, 0, 7, False), (1, 0, 4, False)]]
    steps += [[(0, p, p + 1, True), (1, p - 3, p - 2, True)] for p in range(7, 12)]
    outs, cache = _run_schedule(seqs, [3, 1], steps, num_slots=5)
    for i, slot in [(0, 3), (1, 1)]:
        torch.testing.assert_close(outs[i], _uncached(seqs[i]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(cache[slot], _loop(seqs[i], None)[1][0].float(), rtol=RTOL, atol=ATOL)
    for unused in (0, 2, 4):
        assert torch.equal(cache[unused], torch.zeros(H, DK, DV))


def test_chunked_prefill_across_the_op_chunk_equals_one_prefill():
    """Prefill chunks of 50, 30 and 70 tokens (the second crosses the op's 64-token chunk inside a
    step) against one 150-token prefill and the loop, scale 1 as MiniMax."""
    seq = _inputs(150)
    whole, whole_cache = _run_schedule([seq], [2], [[(0, 0, 150, False)]], 3, scale=1.0)
    chunks = [[(0, 0, 50, False)], [(0, 50, 80, True)], [(0, 80, 150, True)]]
    chunked, chunked_cache = _run_schedule([seq], [2], chunks, 3, scale=1.0)
    torch.testing.assert_close(chunked[0], whole[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(chunked_cache, whole_cache, rtol=RTOL, atol=ATOL)
    ref, ref_state = _loop(seq, 1.0)
    torch.testing.assert_close(whole[0], ref.float(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(whole_cache[2], ref_state[0].float(), rtol=RTOL, atol=ATOL)


def test_continuing_from_a_stored_state_matches_the_loop_from_that_state():
    seq = _inputs(20)
    init = torch.randn(H, DK, DV)
    cache = torch.zeros(2, H, DK, DV)
    cache[1] = init
    outs, cache = _run_schedule([seq], [1], [[(0, 0, 20, True)]], 2, cache=cache)
    ref, ref_state = _loop(seq, None, init[None])
    torch.testing.assert_close(outs[0], ref.float(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(cache[1], ref_state[0].float(), rtol=RTOL, atol=ATOL)
    assert torch.equal(cache[0], torch.zeros(H, DK, DV))


def test_mixed_step_keeps_sequences_and_other_slots_apart():
    """A prefill (slot 2) beside a decode (slot 0): each equals its own run; slots nobody named
    keep their sentinel contents bit for bit."""
    a, b = _inputs(6), _inputs(5)
    sentinel = torch.randn(5, H, DK, DV)
    steps = [[(1, 0, 4, False)], [(0, 0, 6, False), (1, 4, 5, True)]]
    outs, cache = _run_schedule([a, b], [2, 0], steps, 5, cache=sentinel.clone())
    torch.testing.assert_close(outs[0], _uncached(a), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(outs[1], _uncached(b), rtol=RTOL, atol=ATOL)
    for untouched in (1, 3, 4):
        assert torch.equal(cache[untouched], sentinel[untouched])


@pytest.mark.parametrize("length", [5, 1], ids=["prefill_path", "one_token_path"])
def test_restart_without_initial_state_ignores_garbage_in_the_slot(length):
    """A restarted sequence over a slot holding garbage (nan, inf) with use_initial_state=False
    is the fresh result, on the prefill path and on the batched one-token path."""
    restarted, other = _inputs(length), _inputs(3)
    cache = torch.randn(3, H, DK, DV) * 1e4
    cache[1, 0, 0, 0], cache[1, 1, 2, 3] = float("nan"), float("inf")
    _, cache = _run_schedule([other], [2], [[(0, 0, 2, False)]], 3, cache=cache)
    outs, cache = _run_schedule([restarted, other], [1, 2], [[(0, 0, length, False), (1, 2, 3, True)]], 3,
                                cache=cache)
    torch.testing.assert_close(outs[0], _uncached(restarted), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(outs[1], _uncached(other)[:, -1:], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(cache[1], _loop(restarted, None)[1][0].float(), rtol=RTOL, atol=ATOL)


def test_a_state_cache_of_another_size_is_refused():
    t = _inputs(3)
    meta = step_metadata([(0, 0, 3, False)])
    with pytest.raises(ValueError, match="state cache .* does not fit"):
        ad.torch_cached_linear_attention(t["q"], t["k"], t["v"], t["g"], *meta.values(),
                                         torch.zeros(2, H, DK, DV + 1), None)


# ---- fake kernels and export --------------------------------------------------------------------


def _opcheck_cases():
    a, b = _inputs(4), _inputs(3)
    meta = step_metadata([(2, 0, 4, False), (0, 2, 1, True)])
    flat = {n: torch.cat([a[n][0], b[n][0, 2:3]])[None] for n in a}
    t = _inputs(5, b=2)
    return [
        ("uncached", ad.torch_linear_attention, (t["q"], t["k"], t["v"], t["g"], 1.0)),
        ("cached", ad.torch_cached_linear_attention,
         (flat["q"], flat["k"], flat["v"], flat["g"], *meta.values(), torch.randn(3, H, DK, DV), None)),
    ]


@pytest.mark.parametrize("name,op,args", _opcheck_cases(), ids=[c[0] for c in _opcheck_cases()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_cached_op_writes_only_named_slots_and_declares_the_mutation():
    _, op, args = _opcheck_cases()[1]
    check_slot_writes(op, args, state_arg=9)


class _Lightning(torch.nn.Module):
    def forward(self, q, k, v, g):
        return ad.torch_linear_attention(q, k, v, g, 1.0) * 2.0


def test_export_with_dynamic_sequence_serves_other_lengths():
    t = _inputs(9)
    args = (t["q"], t["k"], t["v"], t["g"])
    seq = Dim("seq", min=1, max=4096)
    ep = torch.export.export(_Lightning(), args, dynamic_shapes=tuple({1: seq} for _ in args), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_linear_attention.default) == 1
    for s in (9, 70, 1):
        u = _inputs(s)
        a = (u["q"], u["k"], u["v"], u["g"])
        assert torch.equal(ep.module()(*a), _Lightning()(*a))
