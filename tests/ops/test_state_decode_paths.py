"""The two decode paths of ``scan_each_sequence``, the driver every cached state op shares: on CPU
an op's one-token sequences run one by one on their own slots, updated in place (its ``step``); on
other devices as one gathered batch scattered back (its ``scan``). Both must give the same outputs
and the same cache, for every op that gives a ``step``: the conv window, the Mamba2 and Mamba
scans, the gated and channelwise delta rules, the decayed linear attention.

Each case builds the op's two closures the way its cached variant does, from the op module's own
functions, on a step with a 5-token prefill, a continuing decode and a fresh one-token prompt over a
slot of NaNs (as uninitialised memory may be); the slots no row names stay untouched. Two one-token
rows: the CPU driver takes the in-place path for that many whatever the state's size (counted).
"""

from typing import List, Sequence

import pytest
import torch

from autodeploy.ops import causal_conv, delta_rule, linear_attention, ssm

H, P, G, N, DK, DV = 4, 3, 2, 5, 6, 7
torch.manual_seed(0)
A2, D2, DTB2 = -torch.rand(H) - 0.1, torch.randn(H), torch.randn(H)
A1, D1 = -torch.rand(H * P, N) - 0.1, torch.randn(H * P)
CONV_W, CONV_B = torch.randn(H * P, 1, 4), torch.randn(H * P)


def _case(name: str):
    """(tokens of s positions, scan, step, state shape) for one op."""
    if name == "conv":
        return (lambda s: [torch.randn(1, s, H * P)],
                lambda t, w: causal_conv._conv_scan(t[0], w, CONV_W, CONV_B, "silu"),
                lambda t, w: causal_conv._conv_step(t[0], w, CONV_W, CONV_B, "silu"), (H * P, 3))
    if name == "mamba2":
        return (lambda s: [torch.randn(1, s, H, P), ssm._mamba2_dt(torch.randn(1, s, H), DTB2, None),
                           torch.randn(1, s, G, N), torch.randn(1, s, G, N)],
                lambda t, st: ssm._mamba2_scan(t[0], t[1], A2, t[2], t[3], D2, st),
                lambda t, st: ssm._mamba2_step_in_place(*t, A2, D2, st), (H, P, N))
    if name == "mamba1":
        return (lambda s: [torch.randn(1, s, H * P), torch.nn.functional.softplus(torch.randn(1, s, H * P)),
                           torch.randn(1, s, N), torch.randn(1, s, N)],
                lambda t, st: ssm._mamba1_scan(t[0], t[1], A1, t[2], t[3], D1, st),
                lambda t, st: ssm._mamba1_step_in_place(*t, A1, D1, st), (H * P, N))
    if name in ("gated_delta_rule", "channelwise_delta_rule"):
        width = 1 if name == "gated_delta_rule" else DK
        return (lambda s: [torch.randn(1, s, H, DV), torch.randn(1, s, 2, DK), torch.randn(1, s, 2, DK),
                           torch.rand(1, s, H), -torch.rand(1, s, H, width)],
                lambda t, st: delta_rule._recurrence(t[1], t[2], t[0], t[4], t[3], st, None, True),
                lambda t, st: delta_rule._step_in_place(t[1], t[2], t[0], t[4], t[3], st, None, True), (H, DK, DV))
    return (lambda s: [torch.randn(1, s, H, DV), torch.randn(1, s, H, DK), torch.randn(1, s, H, DK),
                       -torch.rand(1, s, H)],
            lambda t, st: linear_attention._scan(t[1], t[2], t[0], t[3], st, None),
            lambda t, st: linear_attention._step_in_place(t[1], t[2], t[0], t[3], st, None), (H, DK, DV))


def _metadata(lengths: Sequence[int], slots: Sequence[int], carries: Sequence[bool], num_prefill: int
              ) -> List[torch.Tensor]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    i32 = dict(dtype=torch.int32)
    return [torch.tensor([num_prefill, cu[num_prefill], len(lengths) - num_prefill], **i32),
            torch.tensor(list(lengths), **i32), torch.tensor(cu, **i32), torch.tensor(list(slots), **i32),
            torch.tensor(list(carries), dtype=torch.bool)]


@pytest.mark.parametrize("name", ["conv", "mamba2", "mamba1", "gated_delta_rule", "channelwise_delta_rule",
                                  "linear_attention"])
def test_the_cpu_in_place_decode_equals_the_batched_decode(name):
    make, scan, step, shape = _case(name)
    parts = [make(5), make(1), make(1)]
    tokens = [torch.cat([p[j] for p in parts], dim=1) for j in range(len(parts[0]))]
    meta = _metadata([5, 1, 1], [1, 3, 0], [False, True, False], 1)
    cache = torch.randn(6, *shape) * 3
    cache[0] = float("nan")
    calls = []

    def counted(t, state):
        calls.append(1)
        return step(t, state)

    results = []
    for use_step in (None, counted):
        mine = cache.clone()
        out = causal_conv.scan_each_sequence(scan, tokens, *meta, mine, step=use_step)
        results.append((out, mine))
    (batched, batched_cache), (in_place, in_place_cache) = results
    assert len(calls) == 2 and not in_place.isnan().any()
    torch.testing.assert_close(in_place, batched, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(in_place_cache, batched_cache, rtol=1e-5, atol=1e-5)
    assert torch.equal(in_place_cache[[2, 4, 5]], cache[[2, 4, 5]])


def test_many_sequences_take_the_in_place_path_only_for_large_states():
    """Eight one-token sequences: a conv window (small) goes as one batch, a 512 KiB Mamba2 state
    one by one in place (``IN_PLACE_MIN_BYTES``)."""
    for shape, expected in (((H * P, 3), 0), ((8, 128, 128), 8)):
        calls = []

        def step(t, state):
            calls.append(1)
            return t[0].float().sum() + state.sum() * 0

        def scan(t, state):
            return t[0].float(), state

        tokens = [torch.randn(1, 8, 2)]
        causal_conv.scan_each_sequence(scan, tokens, *_metadata([1] * 8, list(range(8)), [True] * 8, 0),
                                       torch.zeros(9, *shape), step=step)
        assert len(calls) == expected
