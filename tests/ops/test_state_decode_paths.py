"""The two decode paths of ``scan_each_sequence``, the driver every cached state op shares: on CPU
an op's one-token sequences run one by one on their own slots, updated in place (its ``step``); on
other devices as one gathered batch scattered back (its ``scan``). Both must give the same outputs
and the same cache, for every op that gives a ``step``: the conv window, the Mamba2 and Mamba
scans, the gated and channelwise delta rules, the decayed linear attention.

Each case builds the op's two closures the way its cached variant does, from the op module's own
functions, on a step with a 5-token prefill, a continuing decode and a fresh one-token prompt over a
slot of NaNs (as uninitialised memory may be); the slots no row names stay untouched. Two one-token
rows: the CPU driver takes the in-place path for that many whatever the state's size (counted).
The C kernels that run a whole step in one call (``step_all``: the conv, the Mamba2 and Mamba scans,
the delta rules, linear attention, RecurrentGemma's RG-LRU, RWKV's WKV, xLSTM's mLSTM) are held to the torch
paths the same way, on decode-only and mixed steps, with inputs strided as the graph's splits of one
projection are.
"""

from typing import List, Sequence

import pytest
import torch

from autodeploy.ops import (causal_conv, delta_rule, diagonal_recurrence, linear_attention, mlstm, native, native_state,
                            ssm, wkv)

H, P, G, N, DK, DV = 4, 3, 2, 5, 6, 7
torch.manual_seed(0)
A2, D2, DTB2 = -torch.rand(H) - 0.1, torch.randn(H), torch.randn(H)
A1, D1 = -torch.rand(H * P, N) - 0.1, torch.randn(H * P)
CONV_W, CONV_B = torch.randn(H * P, 1, 4), torch.randn(H * P)
WKV_DECAY, WKV_FIRST = torch.randn(H * P), torch.randn(H * P)


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


needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


def _native_case(name: str, groups: int = G):
    """(tokens of s positions, scan, step_all over ``cache``, state shape): the C kernels of a whole
    step (``native_state.py``), the conv's and Mamba's token inputs a slice of a wider tensor as the
    graph's splits of one projection are."""
    def split(s: int, *shape: int) -> torch.Tensor:  # [1, s, *shape], rows strided (a split's view)
        wide = torch.randn(1, s, *shape[:-1], shape[-1] + 3)
        return wide[..., 1:shape[-1] + 1]

    if name in ("gated_delta_rule", "channelwise_delta_rule", "delta_rule", "linear_attention"):
        make, scan, _, shape = _case("gated_delta_rule" if name == "delta_rule" else name)
        if name == "delta_rule":  # plain DeltaNet: no decay
            base = make
            make = lambda s: base(s)[:4]  # noqa: E731
            scan = lambda t, st: delta_rule._recurrence(t[1], t[2], t[0], None, t[3], st, None, True)  # noqa: E731
        if name == "linear_attention":
            def step_all(cache):
                return lambda t, cu, slots, carry: native_state.fast_weight_step(
                    t[1], t[2], t[0], t[3], None, cache, cu, slots, carry, None, False)
        else:
            def step_all(cache):
                return lambda t, cu, slots, carry: native_state.fast_weight_step(
                    t[1], t[2], t[0], t[4] if len(t) > 4 else None, t[3], cache, cu, slots, carry, None, True)
        return make, scan, step_all, shape
    if name == "diagonal_recurrence":  # RecurrentGemma's RG-LRU: a in [0, 1]
        return (lambda s: [split(s, H * P), torch.rand(1, s, H * P)],
                lambda t, st: diagonal_recurrence._scan(t[0], t[1], st),
                lambda cache: lambda t, cu, slots, carry: native_state.diagonal_recurrence_step(t[0], t[1], cache, cu,
                                                                                                slots, carry),
                (H * P,))
    if name == "mlstm":  # xLSTM: q/k [nh, dqk], v [nh, dv], gate pre-activations [nh]
        return (lambda s: [torch.randn(1, s, H, DV), split(s, H, DK), split(s, H, DK), torch.randn(1, s, H) * 3,
                           torch.randn(1, s, H) * 3],
                lambda t, st: mlstm._steps(t[1], t[2], t[0], t[3], t[4], st, 1e-6),
                lambda cache: lambda t, cu, slots, carry: native_state.mlstm_step(t[1], t[2], t[0], t[3], t[4], cache,
                                                                                  cu, slots, carry, 1e-6),
                (H, DK + 1, DV + 1))
    if name == "wkv":  # RWKV-4
        return (lambda s: [split(s, H * P), torch.randn(1, s, H * P)],
                lambda t, st: wkv._scan(WKV_DECAY, WKV_FIRST, t[0], t[1], st),
                lambda cache: lambda t, cu, slots, carry: native_state.wkv_step(WKV_DECAY, WKV_FIRST, t[0], t[1],
                                                                                cache, cu, slots, carry),
                (3, H * P))
    if name in ("conv", "conv-nobias"):
        bias, act = (CONV_B, "silu") if name == "conv" else (None, None)
        return (lambda s: [split(s, H * P)],
                lambda t, w: causal_conv._conv_scan(t[0], w, CONV_W, bias, act),
                lambda cache: lambda t, cu, slots, carry: native_state.conv_step(t[0], cache, CONV_W, bias, act, cu,
                                                                                 slots, carry),
                (H * P, 3))
    if name == "mamba1":
        make, scan, _, shape = _case(name)
        return (lambda s: [split(s, H * P), *make(s)[1:2], split(s, N), make(s)[3]], scan,
                lambda cache: lambda t, cu, slots, carry: native_state.mamba_step(*t, A1, D1, cache, cu, slots, carry),
                shape)
    return (lambda s: [torch.randn(1, s, H, P), ssm._mamba2_dt(torch.randn(1, s, H), DTB2, None),
                       split(s, groups, N), split(s, groups, N)],
            lambda t, st: ssm._mamba2_scan(t[0], t[1], A2, t[2], t[3], D2, st),
            lambda cache: lambda t, cu, slots, carry: native_state.mamba2_step(*t, A2, D2, cache, cu, slots, carry),
            (H, P, N))


NATIVE_CASES = [("conv", G), ("conv-nobias", G), ("mamba2", G), ("mamba2", 1), ("mamba1", G), ("gated_delta_rule", G),
                ("channelwise_delta_rule", G), ("delta_rule", G), ("linear_attention", G), ("diagonal_recurrence", G),
                ("wkv", G), ("mlstm", G)]


@needs_native
@pytest.mark.parametrize("name,groups", NATIVE_CASES)
@pytest.mark.parametrize("prefill", [True, False])
def test_the_native_step_equals_the_torch_paths(name, groups, prefill):
    """A step of three one-token rows (a continuing decode, a fresh prompt over a NaN slot, another
    decode), alone or after two prefills (a fresh 5-token prompt, a 3-token chunk continuing its
    slot): one kernel call for the whole step (for linear attention, for its decodes), equal to the
    references' prefill scans and batched decode, its states written to the named slots only."""
    make, scan, step_all, shape = _native_case(name, groups)
    lengths, slots, carries = [1, 1, 1], [3, 0, 5], [True, False, True]
    if prefill:
        lengths, slots, carries = [5, 3] + lengths, [1, 6] + slots, [False, True] + carries
    parts = [make(n) for n in lengths]
    tokens = [torch.cat([p[j] for p in parts], dim=1) for j in range(len(parts[0]))]
    meta = _metadata(lengths, slots, carries, 2 if prefill else 0)
    cache = torch.randn(7, *shape) * 3
    if name == "wkv":  # a running numerator and denominator of positive weights
        cache[:, :2] = cache[:, :2].abs()
    cache[0] = float("nan")
    reference_cache, native_cache = cache.clone(), cache.clone()
    reference = causal_conv.scan_each_sequence(scan, tokens, *meta, reference_cache)
    calls = []

    def counted(t, cu, slots_t, carry_t):
        calls.append((cu.tolist(), slots_t.tolist()))
        return step_all(native_cache)(t, cu, slots_t, carry_t)

    whole = name != "linear_attention"  # its prefills take the chunked scan (``step_all_prefills``)
    mine = causal_conv.scan_each_sequence(scan, tokens, *meta, native_cache, step_all=counted,
                                          step_all_prefills=whole)
    expected = (meta[2].tolist(), slots) if whole or not prefill else ([0, 1, 2, 3], slots[2:])
    assert calls == [expected] and not mine.isnan().any()
    torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_cache, reference_cache, rtol=1e-5, atol=1e-5)
    untouched = sorted(set(range(7)) - set(slots))
    assert torch.equal(native_cache[untouched], cache[untouched])


def _two_decodes(make, slots=(1, 2), cu=(0, 1, 2)):
    i32 = dict(dtype=torch.int32)
    return [t[0] for t in make(2)], torch.tensor(cu, **i32), torch.tensor(slots, **i32), torch.tensor([True, True])


@needs_native
@pytest.mark.parametrize("name", ["conv", "mamba2", "mamba1", "gated_delta_rule", "linear_attention",
                                  "diagonal_recurrence", "wkv", "mlstm"])
def test_a_native_step_rejects_bad_metadata_and_writes_nothing(name):
    """A slot outside the cache; row offsets past the step's rows, or decreasing."""
    make, _, step_all, shape = _native_case(name)
    cache = torch.randn(4, *shape)
    before = cache.clone()
    with pytest.raises(IndexError, match="outside"):
        step_all(cache)(*_two_decodes(make, slots=(1, 4)))
    for cu in ((0, 1, 3), (0, 2, 1)):
        with pytest.raises(ValueError, match="do not fit"):
            step_all(cache)(*_two_decodes(make, cu=cu))
    assert torch.equal(cache, before)


@needs_native
def test_the_native_steps_decline_what_they_cannot_take():
    """A bfloat16 state or conv weight, an int64 slot list, an unknown activation: None, the caller's
    torch path."""
    x, cache = torch.randn(2, H * P), torch.randn(3, H * P, 3)
    cu, slots, carry = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), \
        torch.tensor([True, True])
    assert native_state.conv_step(x, cache.bfloat16(), CONV_W, None, None, cu, slots, carry) is None
    assert native_state.conv_step(x, cache, CONV_W.bfloat16(), None, None, cu, slots, carry) is None
    assert native_state.conv_step(x, cache, CONV_W, None, None, cu, slots.long(), carry) is None
    assert native_state.conv_step(x, cache, CONV_W, None, "gelu", cu, slots, carry) is None
    assert native_state.conv_step(x, cache, CONV_W, None, None, cu, slots, carry) is not None
    state = torch.randn(3, H, P, N)
    args = (torch.randn(2, H, P), torch.rand(2, H), torch.randn(2, G, N), torch.randn(2, G, N), A2, D2)
    assert native_state.mamba2_step(*args, state.bfloat16(), cu, slots, carry) is None
    assert native_state.mamba2_step(*args, state, cu, slots, carry) is not None


@needs_native
@pytest.mark.parametrize("name", ["conv", "mamba2", "mamba1", "gated_delta_rule", "linear_attention",
                                  "diagonal_recurrence", "wkv", "mlstm"])
def test_rows_of_no_sequence_come_back_zero(name):
    """Three rows, two sequences of one token: the third row (padding) is zeros, not whatever the
    output's memory held."""
    make, _, step_all, shape = _native_case(name)
    tokens = [t[0] for t in make(3)]
    i32 = dict(dtype=torch.int32)
    for _ in range(3):  # fresh output buffers may reuse freed memory: try a few
        y = step_all(torch.randn(3, *shape))(tokens, torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1], **i32),
                                             torch.tensor([True, False]))
        assert y.shape[0] == 3 and torch.equal(y[2], torch.zeros_like(y[2])) and y[:2].abs().sum() > 0


@needs_native
@pytest.mark.parametrize("name", ["mamba2", "mamba1", "gated_delta_rule", "linear_attention", "diagonal_recurrence",
                                  "wkv", "mlstm", "conv"])
def test_half_precision_inputs_take_the_kernel_as_the_references_compute(name):
    """bfloat16 token inputs (a bf16 model's activations) over a float32 state: the kernel reads them
    as float32, as the references do, and equals the torch paths (the driver rounds both outputs to
    bf16); the conv with float32 taps too."""
    make, scan, step_all, shape = _native_case(name)
    lengths, slots, carries = [4, 1, 1], [1, 3, 0], [False, True, False]
    parts = [make(n) for n in lengths]
    tokens = [torch.cat([p[j] for p in parts], dim=1).bfloat16() for j in range(len(parts[0]))]
    meta = _metadata(lengths, slots, carries, 1)
    cache = torch.randn(5, *shape).abs()
    reference_cache, native_cache = cache.clone(), cache.clone()
    reference = causal_conv.scan_each_sequence(scan, tokens, *meta, reference_cache)
    results = []

    def kernel(*args):
        results.append(step_all(native_cache)(*args))
        return results[-1]

    mine = causal_conv.scan_each_sequence(scan, tokens, *meta, native_cache, step_all=kernel)
    assert len(results) == 1 and results[0] is not None and results[0].dtype == torch.float32
    assert mine.dtype == torch.bfloat16 == reference.dtype
    torch.testing.assert_close(mine.float(), reference.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(native_cache, reference_cache, rtol=1e-4, atol=1e-4)
