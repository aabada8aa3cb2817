"""RWKV-4's WKV ops: the reference against HF's own ``rwkv_linear_attention_cpu`` (from its empty state
and from a stored state, fp32 and bf16, bit for bit), the empty state being zeros even where a
zero exponent would underflow, the cached op over flattened steps against the uncached op on whole
sequences (prefill then decode, chunked prefill, mixed steps, a restart over garbage), fake
kernels and export."""

from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch.export import Dim
from transformers.models.rwkv import modeling_rwkv as hf

import autodeploy.ops.wkv  # noqa: F401  (registers the ops)
from state_steps import check_slot_writes, step_metadata

ad = torch.ops.autodeploy
C = 6
DECAY, FIRST = torch.randn(C, generator=torch.Generator().manual_seed(1)), torch.randn(C)


def _inputs(s: int, b: int = 1, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    return {"k": (torch.randn(b, s, C) * 3).to(dtype), "v": torch.randn(b, s, C).to(dtype)}


def _hf(t: Dict[str, torch.Tensor], state: Optional[List[torch.Tensor]] = None):
    """HF's CPU WKV loop itself; with ``state`` also its final state (num, den, max)."""
    return hf.rwkv_linear_attention_cpu(DECAY, FIRST, t["k"], t["v"], state=state, return_state=True)


@pytest.mark.parametrize("s", [1, 2, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hf_wkv_bit_for_bit(s, dtype):
    t = _inputs(s, b=2, dtype=dtype)
    out = ad.torch_wkv(DECAY, FIRST, t["k"], t["v"])
    assert out.dtype == dtype
    assert torch.equal(out, _hf(t)[0])


def test_zeros_are_the_empty_state_even_for_very_negative_keys():
    """With an exponent of 0 instead of HF's -1e38, exp(u + k - 0) underflows to 0 for k = -200
    and the first token would be 0/0; the op reads a zero denominator as empty: output v."""
    t = {"k": torch.full((1, 3, C), -200.0), "v": torch.randn(1, 3, C)}
    out = ad.torch_wkv(torch.zeros(C), torch.zeros(C), t["k"], t["v"])
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 0], t["v"][:, 0])
    assert torch.equal(out, hf.rwkv_linear_attention_cpu(torch.zeros(C), torch.zeros(C), t["k"], t["v"])[0])


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match=r"wkv: k .* and v .* must be \[b, s, c\]"):
        ad.torch_wkv(DECAY, FIRST, torch.zeros(1, 3, C), torch.zeros(1, 3, C + 1))


# ---- cached op --------------------------------------------------------------------------------


def _run_schedule(seqs: List[Dict[str, torch.Tensor]], slots: List[int], steps, num_slots: int,
                  cache: Optional[torch.Tensor] = None):
    cache = torch.zeros(num_slots, 3, C) if cache is None else cache
    outs: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    for step in steps:
        meta = step_metadata([(slots[i], s, e - s, cont) for i, s, e, cont in step])
        flat = {n: torch.cat([seqs[i][n][0, s:e] for i, s, e, _ in step])[None] for n in ("k", "v")}
        o = ad.torch_cached_wkv(DECAY, FIRST, flat["k"], flat["v"], *meta.values(), cache)
        for (i, s, e, _), start in zip(step, meta["cu_seqlen"].tolist()):
            outs[i].append(o[0, start:start + e - s])
    return {i: torch.cat(o)[None] for i, o in outs.items() if o}, cache


def _whole(t: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    out, state = _hf(t)
    return out, torch.stack(state, dim=1)[0]


def test_prefill_then_decode_equals_one_pass():
    seqs = [_inputs(12), _inputs(9)]
    steps = [[(0, 0, 7, False), (1, 0, 4, False)]]
    steps += [[(0, p, p + 1, True), (1, p - 3, p - 2, True)] for p in range(7, 12)]
    outs, cache = _run_schedule(seqs, [3, 1], steps, num_slots=5)
    for i, slot in [(0, 3), (1, 1)]:
        expected, state = _whole(seqs[i])
        torch.testing.assert_close(outs[i], expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cache[slot], state, rtol=1e-6, atol=1e-6)
    for unused in (0, 2, 4):
        assert torch.equal(cache[unused], torch.zeros(3, C))


def test_continuing_a_stored_state_matches_hf_given_that_state():
    head, tail = _inputs(5), _inputs(4)
    _, hf_state = _hf(head)
    cache = torch.zeros(2, 3, C)
    cache[1] = torch.stack(hf_state, dim=1)[0]
    outs, cache = _run_schedule([tail], [1], [[(0, 0, 4, True)]], 2, cache=cache)
    expected, expected_state = _hf(tail, [s.clone() for s in hf_state])
    torch.testing.assert_close(outs[0], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[1], torch.stack(expected_state, dim=1)[0], rtol=1e-6, atol=1e-6)


def test_chunked_prefill_equals_one_prefill():
    seq = _inputs(15)
    chunks = [[(0, 0, 5, False)], [(0, 5, 9, True)], [(0, 9, 15, True)]]
    chunked, cache = _run_schedule([seq], [2], chunks, 3)
    expected, state = _whole(seq)
    torch.testing.assert_close(chunked[0], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[2], state, rtol=1e-6, atol=1e-6)


def test_mixed_step_keeps_sequences_and_other_slots_apart():
    a, b = _inputs(6), _inputs(5)
    sentinel = torch.randn(5, 3, C)
    steps = [[(1, 0, 4, False)], [(0, 0, 6, False), (1, 4, 5, True)]]
    outs, cache = _run_schedule([a, b], [2, 0], steps, 5, cache=sentinel.clone())
    torch.testing.assert_close(outs[0], _whole(a)[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1], _whole(b)[0], rtol=1e-6, atol=1e-6)
    for untouched in (1, 3, 4):
        assert torch.equal(cache[untouched], sentinel[untouched])


@pytest.mark.parametrize("length", [5, 1], ids=["prefill_path", "one_token_path"])
def test_restart_without_initial_state_ignores_garbage_in_the_slot(length):
    restarted, other = _inputs(length), _inputs(3)
    cache = torch.randn(3, 3, C) * 1e4
    cache[1, 0, 0], cache[1, 2, 3] = float("nan"), float("inf")
    _, cache = _run_schedule([other], [2], [[(0, 0, 2, False)]], 3, cache=cache)
    outs, cache = _run_schedule([restarted, other], [1, 2], [[(0, 0, length, False), (1, 2, 3, True)]], 3,
                                cache=cache)
    torch.testing.assert_close(outs[0], _whole(restarted)[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1], _whole(other)[0][:, -1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[1], _whole(restarted)[1], rtol=1e-6, atol=1e-6)


def test_a_state_cache_of_another_width_is_refused():
    t = _inputs(3)
    with pytest.raises(ValueError, match="state cache .* does not fit"):
        ad.torch_cached_wkv(DECAY, FIRST, t["k"], t["v"], *step_metadata([(0, 0, 3, False)]).values(),
                            torch.zeros(2, 3, C + 1))


# ---- fake kernels and export --------------------------------------------------------------------


def _opcheck_cases():
    a, b = _inputs(4), _inputs(3)
    meta = step_metadata([(2, 0, 4, False), (0, 2, 1, True)])
    flat = {n: torch.cat([a[n][0], b[n][0, 2:3]])[None] for n in a}
    t = _inputs(5, b=2)
    state = torch.stack(_hf(_inputs(3, b=3))[1], dim=1)
    return [
        ("uncached", ad.torch_wkv, (DECAY, FIRST, t["k"], t["v"])),
        ("cached", ad.torch_cached_wkv, (DECAY, FIRST, flat["k"], flat["v"], *meta.values(), state)),
    ]


@pytest.mark.parametrize("name,op,args", _opcheck_cases(), ids=[c[0] for c in _opcheck_cases()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_cached_op_writes_only_named_slots_and_declares_the_mutation():
    _, op, args = _opcheck_cases()[1]
    check_slot_writes(op, args, state_arg=9)


class _Wkv(torch.nn.Module):
    def forward(self, k, v):
        return ad.torch_wkv(DECAY, FIRST, k, v) * 2.0


def test_export_with_dynamic_sequence_serves_other_lengths():
    t = _inputs(9)
    seq = Dim("seq", min=1, max=4096)
    ep = torch.export.export(_Wkv(), (t["k"], t["v"]), dynamic_shapes=({1: seq}, {1: seq}), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_wkv.default) == 1
    for s in (9, 30, 1):
        u = _inputs(s)
        assert torch.equal(ep.module()(u["k"], u["v"]), _Wkv()(u["k"], u["v"]))
