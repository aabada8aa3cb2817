"""Diagonal linear recurrence ops (RecurrentGemma's RG-LRU scan): the reference against HF's own
``_rnn_scan`` (its loop and its one-token branch, fp32 and bf16), the cached op over flattened
steps against the uncached op on whole sequences (prefill then decode, chunked prefill, mixed
steps, a restart over garbage), fake kernels and export."""

from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch.export import Dim
from transformers.models.recurrent_gemma import modeling_recurrent_gemma as hf

import autodeploy.ops.diagonal_recurrence  # noqa: F401  (registers the ops)
from state_steps import check_slot_writes, step_metadata

ad = torch.ops.autodeploy
W = 6


def _inputs(s: int, b: int = 1, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """x and a decay a in (0.5, 1), as the RG-LRU's exp(-8 * gate * softplus(param)) gives."""
    return {"x": torch.randn(b, s, W).to(dtype), "a": (0.5 + 0.5 * torch.rand(b, s, W)).to(dtype)}


def _hf_scan(x: torch.Tensor, a: torch.Tensor, state: Optional[torch.Tensor] = None):
    """HF's RecurrentGemmaRglru._rnn_scan, no reset (positions > 0)."""
    reset = torch.zeros(x.shape[:2] + (1,), dtype=torch.bool)
    return hf.RecurrentGemmaRglru._rnn_scan(None, x, a, reset, state)


@pytest.mark.parametrize("s", [1, 2, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hf_rnn_scan(s, dtype):
    t = _inputs(s, b=2, dtype=dtype)
    out = ad.torch_diagonal_recurrence(t["x"], t["a"])
    expected, _ = _hf_scan(t["x"], t["a"])
    assert out.dtype == dtype
    assert torch.equal(out, expected)


def test_hf_one_token_path_from_a_state_equals_the_cached_op():
    """HF's decode branch (a stored fp32 state, one token) against the cached op continuing that
    state: output and final state."""
    t = _inputs(1, b=1)
    init = torch.randn(1, W)
    expected, expected_state = _hf_scan(t["x"], t["a"], init)
    cache = torch.zeros(2, W)
    cache[1] = init[0]
    out = ad.torch_cached_diagonal_recurrence(t["x"], t["a"], *step_metadata([(1, 5, 1, True)]).values(), cache)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[1], expected_state[0], rtol=1e-6, atol=1e-6)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match=r"diagonal recurrence: x .* and a .* must both be \[b, s, w\]"):
        ad.torch_diagonal_recurrence(torch.zeros(1, 3, W), torch.zeros(1, 3, W + 1))


# ---- cached op --------------------------------------------------------------------------------


def _run_schedule(seqs: List[Dict[str, torch.Tensor]], slots: List[int], steps, num_slots: int,
                  cache: Optional[torch.Tensor] = None):
    cache = torch.zeros(num_slots, W) if cache is None else cache
    outs: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    for step in steps:
        meta = step_metadata([(slots[i], s, e - s, cont) for i, s, e, cont in step])
        flat = {n: torch.cat([seqs[i][n][0, s:e] for i, s, e, _ in step])[None] for n in ("x", "a")}
        o = ad.torch_cached_diagonal_recurrence(flat["x"], flat["a"], *meta.values(), cache)
        for (i, s, e, _), start in zip(step, meta["cu_seqlen"].tolist()):
            outs[i].append(o[0, start:start + e - s])
    return {i: torch.cat(o)[None] for i, o in outs.items() if o}, cache


def _whole(t: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    out, state = _hf_scan(t["x"], t["a"])
    return out, state[0]


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
        assert torch.equal(cache[unused], torch.zeros(W))


def test_chunked_prefill_equals_one_prefill():
    seq = _inputs(15)
    chunks = [[(0, 0, 5, False)], [(0, 5, 9, True)], [(0, 9, 15, True)]]
    chunked, cache = _run_schedule([seq], [2], chunks, 3)
    expected, state = _whole(seq)
    torch.testing.assert_close(chunked[0], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[2], state, rtol=1e-6, atol=1e-6)


def test_mixed_step_keeps_sequences_and_other_slots_apart():
    a, b = _inputs(6), _inputs(5)
    sentinel = torch.randn(5, W)
    steps = [[(1, 0, 4, False)], [(0, 0, 6, False), (1, 4, 5, True)]]
    outs, cache = _run_schedule([a, b], [2, 0], steps, 5, cache=sentinel.clone())
    torch.testing.assert_close(outs[0], _whole(a)[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1], _whole(b)[0], rtol=1e-6, atol=1e-6)
    for untouched in (1, 3, 4):
        assert torch.equal(cache[untouched], sentinel[untouched])


@pytest.mark.parametrize("length", [5, 1], ids=["prefill_path", "one_token_path"])
def test_restart_without_initial_state_ignores_garbage_in_the_slot(length):
    restarted, other = _inputs(length), _inputs(3)
    cache = torch.randn(3, W) * 1e4
    cache[1, 0], cache[1, 3] = float("nan"), float("inf")
    _, cache = _run_schedule([other], [2], [[(0, 0, 2, False)]], 3, cache=cache)
    outs, cache = _run_schedule([restarted, other], [1, 2], [[(0, 0, length, False), (1, 2, 3, True)]], 3,
                                cache=cache)
    torch.testing.assert_close(outs[0], _whole(restarted)[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1], _whole(other)[0][:, -1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[1], _whole(restarted)[1], rtol=1e-6, atol=1e-6)


def test_a_state_cache_of_another_width_is_refused():
    t = _inputs(3)
    with pytest.raises(ValueError, match="state cache .* does not fit"):
        ad.torch_cached_diagonal_recurrence(t["x"], t["a"], *step_metadata([(0, 0, 3, False)]).values(),
                                            torch.zeros(2, W + 1))


# ---- fake kernels and export --------------------------------------------------------------------


def _opcheck_cases():
    a, b = _inputs(4), _inputs(3)
    meta = step_metadata([(2, 0, 4, False), (0, 2, 1, True)])
    flat = {n: torch.cat([a[n][0], b[n][0, 2:3]])[None] for n in a}
    t = _inputs(5, b=2)
    return [
        ("uncached", ad.torch_diagonal_recurrence, (t["x"], t["a"])),
        ("cached", ad.torch_cached_diagonal_recurrence, (flat["x"], flat["a"], *meta.values(), torch.randn(3, W))),
    ]


@pytest.mark.parametrize("name,op,args", _opcheck_cases(), ids=[c[0] for c in _opcheck_cases()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_cached_op_writes_only_named_slots_and_declares_the_mutation():
    _, op, args = _opcheck_cases()[1]
    check_slot_writes(op, args, state_arg=7)


class _Scan(torch.nn.Module):
    def forward(self, x, a):
        return ad.torch_diagonal_recurrence(x, a) * 2.0


def test_export_with_dynamic_sequence_serves_other_lengths():
    t = _inputs(9)
    seq = Dim("seq", min=1, max=4096)
    ep = torch.export.export(_Scan(), (t["x"], t["a"]), dynamic_shapes=({1: seq}, {1: seq}), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_diagonal_recurrence.default) == 1
    for s in (9, 30, 1):
        u = _inputs(s)
        assert torch.equal(ep.module()(u["x"], u["a"]), _Scan()(u["x"], u["a"]))
