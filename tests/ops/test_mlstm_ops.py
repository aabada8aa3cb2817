"""xLSTM's mLSTM ops: the parallel form (``torch_mlstm``) and the token steps of the cached op against
HF's own recurrent kernel (``mlstm_recurrent_sequence_native``: from zero and from a given C/n/m
state, with large gates that exercise the stabiliser), the cached op over flattened steps against
the uncached op on whole sequences (prefill then decode, chunked prefill, mixed steps, a restart
over garbage), fake kernels and export. The parallel form against HF's chunkwise kernel and the
whole model against HF: tests/models/test_custom_xlstm.py."""

from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch.export import Dim
from transformers.models.xlstm import modeling_xlstm as hf

import autodeploy.ops.mlstm  # noqa: F401  (registers the ops)
from state_steps import check_slot_writes, step_metadata

ad = torch.ops.autodeploy
NH, DQK, DV, EPS = 3, 4, 5, 1e-6
TOL = dict(rtol=2e-5, atol=2e-5)


def _inputs(s: int, b: int = 1, gate_scale: float = 1.0) -> Dict[str, torch.Tensor]:
    return {"q": torch.randn(b, s, NH, DQK), "k": torch.randn(b, s, NH, DQK), "v": torch.randn(b, s, NH, DV),
            "i": torch.randn(b, s, NH) * gate_scale, "f": torch.randn(b, s, NH) * gate_scale + 2.0}


def _hf(t: Dict[str, torch.Tensor], state: Optional[Tuple[torch.Tensor, ...]] = None):
    """HF's recurrent kernel in its layout [b, nh, s, d]; returns (h [b, s, nh, dv], (C, n, m))."""
    q, k, v, i, f = (t[n].transpose(1, 2) for n in ("q", "k", "v", "i", "f"))
    c0, n0, m0 = state if state is not None else (None, None, None)
    h, (c, n, m) = hf.mlstm_recurrent_sequence_native(q, k, v, i, f, c_initial=c0, n_initial=n0, m_initial=m0,
                                                      return_last_states=True, eps=EPS)
    return h.transpose(1, 2), (c, n, m)


def _pack(c: torch.Tensor, n: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """HF's (C [b, nh, dqk, dv], n [b, nh, dqk], m [b, nh, 1]) as the cache's packed [b, nh, dqk + 1, dv + 1]."""
    packed = torch.zeros(c.shape[0], NH, DQK + 1, DV + 1)
    packed[..., :DQK, :DV], packed[..., :DQK, DV], packed[..., DQK, DV] = c, n, m[..., 0]
    return packed


@pytest.mark.parametrize("s", [1, 2, 19])
@pytest.mark.parametrize("gate_scale", [1.0, 15.0])
def test_parallel_form_equals_hf_recurrent_kernel(s, gate_scale):
    t = _inputs(s, b=2, gate_scale=gate_scale)
    out = ad.torch_mlstm(t["q"], t["k"], t["v"], t["i"], t["f"], EPS)
    torch.testing.assert_close(out, _hf(t)[0], **TOL)


def test_low_precision_returns_the_value_dtype():
    t = {n: x.bfloat16() for n, x in _inputs(6).items()}
    out = ad.torch_mlstm(t["q"], t["k"], t["v"], t["i"], t["f"], EPS)
    assert out.dtype == torch.bfloat16
    expected = ad.torch_mlstm(*(t[n].float() for n in ("q", "k", "v", "i", "f")), EPS)
    assert torch.equal(out, expected.bfloat16())


def test_mismatched_shapes_are_refused():
    t = _inputs(3)
    with pytest.raises(ValueError, match=r"mlstm: q .* must be \[b, s, nh, dqk\]"):
        ad.torch_mlstm(t["q"], t["k"][..., :2], t["v"], t["i"], t["f"], EPS)


# ---- cached op --------------------------------------------------------------------------------


def _run_schedule(seqs: List[Dict[str, torch.Tensor]], slots: List[int], steps, num_slots: int,
                  cache: Optional[torch.Tensor] = None):
    cache = torch.zeros(num_slots, NH, DQK + 1, DV + 1) if cache is None else cache
    outs: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    for step in steps:
        meta = step_metadata([(slots[i], s, e - s, cont) for i, s, e, cont in step])
        flat = {n: torch.cat([seqs[i][n][0, s:e] for i, s, e, _ in step])[None] for n in ("q", "k", "v", "i", "f")}
        o = ad.torch_cached_mlstm(flat["q"], flat["k"], flat["v"], flat["i"], flat["f"], *meta.values(), cache, EPS)
        for (i, s, e, _), start in zip(step, meta["cu_seqlen"].tolist()):
            outs[i].append(o[0, start:start + e - s])
    return {i: torch.cat(o)[None] for i, o in outs.items() if o}, cache


def _whole(t: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    out, state = _hf(t)
    return out, _pack(*state)[0]


def test_prefill_then_decode_equals_hf():
    seqs = [_inputs(12), _inputs(9, gate_scale=15.0)]
    steps = [[(0, 0, 7, False), (1, 0, 4, False)]]
    steps += [[(0, p, p + 1, True), (1, p - 3, p - 2, True)] for p in range(7, 12)]
    outs, cache = _run_schedule(seqs, [3, 1], steps, num_slots=5)
    for i, slot in [(0, 3), (1, 1)]:
        expected, state = _whole(seqs[i])
        torch.testing.assert_close(outs[i], expected, **TOL)
        torch.testing.assert_close(cache[slot], state, **TOL)
    for unused in (0, 2, 4):
        assert torch.equal(cache[unused], torch.zeros(NH, DQK + 1, DV + 1))


def test_continuing_a_stored_state_matches_hf_given_that_state():
    head, tail = _inputs(5), _inputs(4)
    _, state = _hf(head)
    cache = torch.zeros(2, NH, DQK + 1, DV + 1)
    cache[1] = _pack(*state)[0]
    outs, cache = _run_schedule([tail], [1], [[(0, 0, 4, True)]], 2, cache=cache)
    expected, expected_state = _hf(tail, state)
    torch.testing.assert_close(outs[0], expected, **TOL)
    torch.testing.assert_close(cache[1], _pack(*expected_state)[0], **TOL)


def test_chunked_prefill_equals_one_prefill():
    seq = _inputs(15)
    chunks = [[(0, 0, 5, False)], [(0, 5, 9, True)], [(0, 9, 15, True)]]
    chunked, cache = _run_schedule([seq], [2], chunks, 3)
    expected, state = _whole(seq)
    torch.testing.assert_close(chunked[0], expected, **TOL)
    torch.testing.assert_close(cache[2], state, **TOL)


def test_mixed_step_keeps_sequences_and_other_slots_apart():
    a, b = _inputs(6), _inputs(5)
    sentinel = torch.randn(5, NH, DQK + 1, DV + 1)
    steps = [[(1, 0, 4, False)], [(0, 0, 6, False), (1, 4, 5, True)]]
    outs, cache = _run_schedule([a, b], [2, 0], steps, 5, cache=sentinel.clone())
    torch.testing.assert_close(outs[0], _whole(a)[0], **TOL)
    torch.testing.assert_close(outs[1], _whole(b)[0], **TOL)
    for untouched in (1, 3, 4):
        assert torch.equal(cache[untouched], sentinel[untouched])


@pytest.mark.parametrize("length", [5, 1], ids=["prefill_path", "one_token_path"])
def test_restart_without_initial_state_ignores_garbage_in_the_slot(length):
    restarted, other = _inputs(length), _inputs(3)
    cache = torch.randn(3, NH, DQK + 1, DV + 1) * 1e4
    cache[1, 0, 0, 0], cache[1, 1, DQK, DV] = float("nan"), float("inf")
    _, cache = _run_schedule([other], [2], [[(0, 0, 2, False)]], 3, cache=cache)
    outs, cache = _run_schedule([restarted, other], [1, 2], [[(0, 0, length, False), (1, 2, 3, True)]], 3,
                                cache=cache)
    torch.testing.assert_close(outs[0], _whole(restarted)[0], **TOL)
    torch.testing.assert_close(outs[1], _whole(other)[0][:, -1:], **TOL)
    torch.testing.assert_close(cache[1], _whole(restarted)[1], **TOL)


def test_a_state_cache_of_another_size_is_refused():
    t = _inputs(3)
    with pytest.raises(ValueError, match="state cache .* does not fit"):
        ad.torch_cached_mlstm(t["q"], t["k"], t["v"], t["i"], t["f"], *step_metadata([(0, 0, 3, False)]).values(),
                              torch.zeros(2, NH, DQK, DV), EPS)


# ---- fake kernels and export --------------------------------------------------------------------


def _opcheck_cases():
    a, b = _inputs(4), _inputs(3)
    meta = step_metadata([(2, 0, 4, False), (0, 2, 1, True)])
    flat = {n: torch.cat([a[n][0], b[n][0, 2:3]])[None] for n in a}
    t = _inputs(5, b=2)
    state = _pack(*_hf(_inputs(3, b=3))[1])
    return [
        ("uncached", ad.torch_mlstm, (t["q"], t["k"], t["v"], t["i"], t["f"], EPS)),
        ("cached", ad.torch_cached_mlstm, (flat["q"], flat["k"], flat["v"], flat["i"], flat["f"], *meta.values(),
                                           state, EPS)),
    ]


@pytest.mark.parametrize("name,op,args", _opcheck_cases(), ids=[c[0] for c in _opcheck_cases()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_cached_op_writes_only_named_slots_and_declares_the_mutation():
    _, op, args = _opcheck_cases()[1]
    check_slot_writes(op, args, state_arg=10)


class _Mlstm(torch.nn.Module):
    def forward(self, q, k, v, i, f):
        return ad.torch_mlstm(q, k, v, i, f, EPS) * 2.0


def test_export_with_dynamic_sequence_serves_other_lengths():
    t = _inputs(9)
    args = tuple(t[n] for n in ("q", "k", "v", "i", "f"))
    seq = Dim("seq", min=1, max=4096)
    ep = torch.export.export(_Mlstm(), args, dynamic_shapes=tuple({1: seq} for _ in args), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_mlstm.default) == 1
    for s in (9, 30, 1):
        u = _inputs(s)
        a = tuple(u[n] for n in ("q", "k", "v", "i", "f"))
        assert torch.equal(ep.module()(*a), _Mlstm()(*a))
