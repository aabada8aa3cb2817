"""ZAYA's CCA convolution ops: the reference against HF's own two ``nn.Conv1d`` over the left-padded
input (bit for bit), the cached op over flattened steps against the uncached op on whole sequences
(prefill then decode, chunked prefill, mixed steps, a restart over garbage), fake kernels and export."""

from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import autodeploy.ops.cca_conv  # noqa: F401  (registers the ops)
from state_steps import check_slot_writes, step_metadata

ad = torch.ops.autodeploy
C, GROUPS, T0, T1 = 12, 3, 2, 3
K = (T0 - 1) + (T1 - 1)
torch.manual_seed(0)
DEPTHWISE = nn.Conv1d(C, C, T0, groups=C, padding=0)
GROUPED = nn.Conv1d(C, C, T1, groups=GROUPS, padding=0)
WEIGHTS = (DEPTHWISE.weight.detach(), DEPTHWISE.bias.detach(), GROUPED.weight.detach(), GROUPED.bias.detach())


def _hf(x: torch.Tensor) -> torch.Tensor:
    """HF's ZayaCCAProjection path: pad K zeros in front, the depthwise then the grouped conv."""
    with torch.no_grad():
        return GROUPED(DEPTHWISE(F.pad(x.transpose(1, 2), (K, 0)))).transpose(1, 2)


def _op(x: torch.Tensor) -> torch.Tensor:
    return ad.torch_cca_conv(x, *WEIGHTS, GROUPS)


@pytest.mark.parametrize("s", [1, 2, 11])
def test_reference_is_hf_convs_bit_for_bit(s):
    x = torch.randn(2, s, C)
    assert torch.equal(_op(x), _hf(x))


def test_a_token_sees_only_the_last_k_inputs():
    x = torch.randn(1, 10, C)
    y = x.clone()
    y[:, 3] += 1.0  # token 3 changes: outputs 3 .. 3 + K change, the rest not
    changed = (_op(x) - _op(y)).abs().amax(-1)[0] > 0
    assert changed.tolist() == [t in range(3, 3 + K + 1) for t in range(10)]


def test_mismatched_weights_are_refused():
    with pytest.raises(ValueError, match=r"cca conv: x .* must be \[b, s, c\]"):
        ad.torch_cca_conv(torch.zeros(1, 3, C), *WEIGHTS, 5)


# ---- cached op --------------------------------------------------------------------------------


def _run_schedule(seqs: List[torch.Tensor], slots: List[int], steps, num_slots: int,
                  cache: Optional[torch.Tensor] = None):
    cache = torch.zeros(num_slots, C, K) if cache is None else cache
    outs: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    for step in steps:
        meta = step_metadata([(slots[i], s, e - s, cont) for i, s, e, cont in step])
        flat = torch.cat([seqs[i][0, s:e] for i, s, e, _ in step])[None]
        o = ad.torch_cached_cca_conv(flat, *WEIGHTS, *meta.values(), cache, GROUPS)
        for (i, s, e, _), start in zip(step, meta["cu_seqlen"].tolist()):
            outs[i].append(o[0, start:start + e - s])
    return {i: torch.cat(o)[None] for i, o in outs.items() if o}, cache


def test_prefill_then_decode_equals_one_pass_and_keeps_the_last_k_inputs():
    seqs = [torch.randn(1, 12, C), torch.randn(1, 9, C)]
    steps = [[(0, 0, 7, False), (1, 0, 4, False)]]
    steps += [[(0, p, p + 1, True), (1, p - 3, p - 2, True)] for p in range(7, 12)]
    outs, cache = _run_schedule(seqs, [3, 1], steps, num_slots=5)
    for i, slot in [(0, 3), (1, 1)]:
        torch.testing.assert_close(outs[i], _hf(seqs[i]), rtol=1e-6, atol=1e-6)
        assert torch.equal(cache[slot], seqs[i][0, -K:].T)
    for unused in (0, 2, 4):
        assert torch.equal(cache[unused], torch.zeros(C, K))


def test_chunked_prefill_shorter_than_the_window_equals_one_prefill():
    """Chunks of 5, 1 and 2 tokens (the last two shorter than K = 3)."""
    seq = torch.randn(1, 8, C)
    chunks = [[(0, 0, 5, False)], [(0, 5, 6, True)], [(0, 6, 8, True)]]
    chunked, cache = _run_schedule([seq], [2], chunks, 3)
    torch.testing.assert_close(chunked[0], _hf(seq), rtol=1e-6, atol=1e-6)
    assert torch.equal(cache[2], seq[0, -K:].T)


def test_mixed_step_keeps_sequences_and_other_slots_apart():
    a, b = torch.randn(1, 6, C), torch.randn(1, 5, C)
    sentinel = torch.randn(5, C, K)
    steps = [[(1, 0, 4, False)], [(0, 0, 6, False), (1, 4, 5, True)]]
    outs, cache = _run_schedule([a, b], [2, 0], steps, 5, cache=sentinel.clone())
    torch.testing.assert_close(outs[0], _hf(a), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1], _hf(b), rtol=1e-6, atol=1e-6)
    for untouched in (1, 3, 4):
        assert torch.equal(cache[untouched], sentinel[untouched])


@pytest.mark.parametrize("length", [5, 1], ids=["prefill_path", "one_token_path"])
def test_restart_without_initial_state_ignores_garbage_in_the_slot(length):
    restarted, other = torch.randn(1, length, C), torch.randn(1, 3, C)
    cache = torch.randn(3, C, K) * 1e4
    cache[1, 0, 0], cache[1, 2, 1] = float("nan"), float("inf")
    _, cache = _run_schedule([other], [2], [[(0, 0, 2, False)]], 3, cache=cache)
    outs, cache = _run_schedule([restarted, other], [1, 2], [[(0, 0, length, False), (1, 2, 3, True)]], 3,
                                cache=cache)
    torch.testing.assert_close(outs[0], _hf(restarted), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1], _hf(other)[:, -1:], rtol=1e-6, atol=1e-6)


def test_a_state_cache_of_another_window_is_refused():
    with pytest.raises(ValueError, match="state cache .* does not fit"):
        ad.torch_cached_cca_conv(torch.randn(1, 3, C), *WEIGHTS, *step_metadata([(0, 0, 3, False)]).values(),
                                 torch.zeros(2, C, K + 1), GROUPS)


# ---- fake kernels and export --------------------------------------------------------------------


def _opcheck_cases():
    a, b = torch.randn(1, 4, C), torch.randn(1, 3, C)
    meta = step_metadata([(2, 0, 4, False), (0, 2, 1, True)])
    flat = torch.cat([a[0], b[0, 2:3]])[None]
    return [
        ("uncached", ad.torch_cca_conv, (torch.randn(2, 5, C), *WEIGHTS, GROUPS)),
        ("cached", ad.torch_cached_cca_conv, (flat, *WEIGHTS, *meta.values(), torch.randn(3, C, K), GROUPS)),
    ]


@pytest.mark.parametrize("name,op,args", _opcheck_cases(), ids=[c[0] for c in _opcheck_cases()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_cached_op_writes_only_named_slots_and_declares_the_mutation():
    _, op, args = _opcheck_cases()[1]
    check_slot_writes(op, args, state_arg=10)


class _Conv(torch.nn.Module):
    def forward(self, x):
        return ad.torch_cca_conv(x, *WEIGHTS, GROUPS) * 2.0


def test_export_with_dynamic_sequence_serves_other_lengths():
    ep = torch.export.export(_Conv(), (torch.randn(1, 9, C),), dynamic_shapes=({1: Dim("seq", min=1, max=4096)},),
                             strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_cca_conv.default) == 1
    for s in (9, 30, 1):
        x = torch.randn(1, s, C)
        assert torch.equal(ep.module()(x), _Conv()(x))
