"""State-space ops: the Mamba2 (``torch_ssm``) and Mamba1 (``torch_ssm_mamba1``) references against
an independent per-token loop; the ops assembled into HF's own mixers (Mamba2Mixer, MambaMixer,
with and without HF's cache); the cached ops (SSMs and the causal conv) over flattened steps
against the uncached ops on whole sequences (prefill then decode, chunked prefill, mixed steps,
untouched slots, preemption); fake kernels and export."""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim
from transformers import DynamicCache, Mamba2Config, MambaConfig
from transformers.models.mamba import modeling_mamba as hf_mamba
from transformers.models.mamba2 import modeling_mamba2 as hf_mamba2

import autodeploy.ops.ssm  # noqa: F401  (registers the ops)
from autodeploy.ops.ssm import CHUNK_SIZE

ad = torch.ops.autodeploy
RTOL, ATOL = 1e-5, 1e-5
LIMIT = [0.05, 1.0]  # tight enough that some steps are clamped at both ends (checked below)


# ---- independent references: the recurrence, one token at a time, in float64 -----------------


def _loop_mamba2(x, dt, A, B, C, D, dt_bias, limit=None, state=None):
    """Per token: S = exp(dt*A) S + dt x B^T, y = S C + D x; head h reads group h // (heads/groups)."""
    b, s, h, p = x.shape
    g, n = B.shape[2:]
    dt = F.softplus(dt.double() + dt_bias.double())
    if limit is not None:
        dt = dt.clamp(*limit)
    S = torch.zeros(b, h, p, n, dtype=torch.float64) if state is None else state.double().clone()
    y = torch.zeros(b, s, h, p, dtype=torch.float64)
    for t in range(s):
        for head in range(h):
            grp = head // (h // g)
            step = dt[:, t, head, None, None]
            S[:, head] = torch.exp(step * A[head].double()) * S[:, head] \
                + step * x[:, t, head, :, None].double() * B[:, t, grp, None, :].double()
            y[:, t, head] = (S[:, head] @ C[:, t, grp, :, None].double())[..., 0] + D[head] * x[:, t, head].double()
    return y.to(x.dtype), S


def _loop_mamba1(x, dt, A, B, C, D, dt_bias, state=None):
    """Per token and channel: S_c = exp(dt_c A_c) S_c + dt_c x_c B, y_c = S_c . C + D_c x_c."""
    b, s, c = x.shape
    dt = F.softplus(dt.double() + dt_bias.double())
    S = torch.zeros(b, c, A.shape[1], dtype=torch.float64) if state is None else state.double().clone()
    y = torch.zeros(b, s, c, dtype=torch.float64)
    for t in range(s):
        for ch in range(c):
            S[:, ch] = torch.exp(dt[:, t, ch, None] * A[ch].double()) * S[:, ch] \
                + (dt[:, t, ch] * x[:, t, ch].double())[:, None] * B[:, t].double()
            y[:, t, ch] = (S[:, ch] * C[:, t].double()).sum(-1) + D[ch] * x[:, t, ch].double()
    return y.to(x.dtype), S


def _mamba2_inputs(b, s, h, p, g, n) -> Dict[str, torch.Tensor]:
    return dict(x=torch.randn(b, s, h, p), dt=torch.randn(b, s, h) * 2, A=-torch.rand(h) * 4 - 0.1,
                B=torch.randn(b, s, g, n), C=torch.randn(b, s, g, n), D=torch.randn(h), dt_bias=torch.randn(h) * 0.5)


def _mamba1_inputs(b, s, c, n) -> Dict[str, torch.Tensor]:
    return dict(x=torch.randn(b, s, c), dt=torch.randn(b, s, c), A=-torch.rand(c, n) * 4 - 0.1,
                B=torch.randn(b, s, n), C=torch.randn(b, s, n), D=torch.randn(c), dt_bias=torch.randn(c) * 0.5)


def _ssm(t, limit=None):
    return ad.torch_ssm(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"], limit)


def _ssm1(t):
    return ad.torch_ssm_mamba1(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"])


# ---- uncached references ------------------------------------------------------------------


@pytest.mark.parametrize("b,s,h,p,g,n", [
    (2, 37, 6, 4, 2, 8),  # groups > 1, heads > groups, one partial chunk
    (1, 2 * CHUNK_SIZE + 45, 8, 3, 1, 16),  # two chunk boundaries, a ragged last chunk
    (1, 5, 4, 2, 4, 3),  # groups == heads
])
@pytest.mark.parametrize("limit", [None, LIMIT])
def test_mamba2_matches_per_token_loop(b, s, h, p, g, n, limit):
    t = _mamba2_inputs(b, s, h, p, g, n)
    out = _ssm(t, limit)
    assert out.shape == (b, s, h, p) and out.dtype == torch.float32
    torch.testing.assert_close(out, _loop_mamba2(**t, limit=limit)[0], rtol=RTOL, atol=ATOL)


def test_time_step_limit_clamps_at_both_ends():
    t = _mamba2_inputs(1, 40, 6, 4, 2, 8)
    steps = F.softplus(t["dt"] + t["dt_bias"])
    assert (steps < LIMIT[0]).any() and (steps > LIMIT[1]).any()
    clamped, free = _ssm(t, LIMIT), _ssm(t, None)
    assert not torch.allclose(clamped, free, rtol=1e-3, atol=1e-3)
    assert torch.equal(_ssm(t, [0.0, float("inf")]), free)  # HF's default limit clamps nothing


def test_mamba2_heads_not_multiple_of_groups_is_rejected():
    t = _mamba2_inputs(1, 3, 6, 2, 4, 3)
    with pytest.raises(ValueError, match="multiple"):
        _ssm(t)


def test_mamba2_long_decay_is_stable():
    """Strong decays over a long chunk: the segment sums stay exact where differences of
    cumulative sums would cancel."""
    t = _mamba2_inputs(1, CHUNK_SIZE, 2, 2, 1, 4)
    t["A"] = torch.tensor([-8.0, -0.01])
    t["dt_bias"] = torch.tensor([3.0, 3.0])
    out = _ssm(t)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _loop_mamba2(**t)[0], rtol=RTOL, atol=ATOL)


def test_bf16_input_runs_in_fp32_and_returns_bf16():
    t = _mamba2_inputs(1, 20, 4, 4, 2, 8)
    low = dict(t, x=t["x"].bfloat16(), B=t["B"].bfloat16(), C=t["C"].bfloat16(), dt=t["dt"].bfloat16())
    out = _ssm(low)
    assert out.dtype == torch.bfloat16
    ref = _loop_mamba2(**{k: v.float() for k, v in low.items()})[0]  # same inputs, exact math
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("b,s,c,n", [(2, 13, 6, 5), (1, 150, 3, 16)])
def test_mamba1_matches_per_token_loop(b, s, c, n):
    t = _mamba1_inputs(b, s, c, n)
    out = _ssm1(t)
    assert out.shape == (b, s, c) and out.dtype == torch.float32
    torch.testing.assert_close(out, _loop_mamba1(**t)[0], rtol=RTOL, atol=ATOL)


# ---- HF's own mixers, built from the ops ---------------------------------------------------


def _mamba2_config(time_step_limit=(0.0, float("inf"))):
    return Mamba2Config(hidden_size=16, num_heads=8, head_dim=4, expand=2, n_groups=2, state_size=8, conv_kernel=4,
                        chunk_size=8, num_hidden_layers=1, time_step_limit=time_step_limit)


def _mamba2_mixer(time_step_limit=(0.0, float("inf"))):
    mixer = hf_mamba2.Mamba2Mixer(_mamba2_config(time_step_limit), 0).eval()
    with torch.no_grad():
        mixer.conv1d.bias.normal_()
        mixer.dt_bias.normal_(0, 0.5)
        mixer.D.normal_()
        mixer.norm.weight.normal_(1, 0.2)
    return mixer


def _mamba2_split(mixer, h):
    gate, xbc, dt = mixer.in_proj(h).split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    return gate, xbc, dt


def _mamba2_heads(mixer, xbc):
    gn = mixer.n_groups * mixer.ssm_state_size
    x, B, C = xbc.split([mixer.intermediate_size, gn, gn], dim=-1)
    b, s = x.shape[:2]
    return (x.reshape(b, s, mixer.num_heads, mixer.head_dim), B.reshape(b, s, mixer.n_groups, -1),
            C.reshape(b, s, mixer.n_groups, -1))


def _mamba2_params(mixer):
    return -torch.exp(mixer.A_log.float()), mixer.D, mixer.dt_bias


def _mamba2_forward(mixer, h):
    """Mamba2Mixer's torch path with the conv and the scan as canonical ops; the gated norm and
    the projections stay HF's modules."""
    gate, xbc, dt = _mamba2_split(mixer, h)
    xbc = ad.torch_causal_conv1d(xbc, mixer.conv1d.weight, mixer.conv1d.bias, mixer.activation)
    x, B, C = _mamba2_heads(mixer, xbc)
    A, D, dt_bias = _mamba2_params(mixer)
    y = ad.torch_ssm(x, dt, A, B, C, D, dt_bias, list(mixer.time_step_limit))
    return mixer.out_proj(mixer.norm(y.reshape(*h.shape[:2], -1), gate))


@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.5)])
def test_mamba2_mixer_built_from_ops_matches_hf(limit):
    mixer = _mamba2_mixer(limit)
    h = torch.randn(2, 19, 16)  # HF's chunk_size 8: two boundaries and a padded last chunk
    with torch.no_grad():
        steps = F.softplus(_mamba2_split(mixer, h)[2] + mixer.dt_bias)
        assert ((steps < limit[0]) | (steps > limit[1])).any() == (limit[1] < 1.0)  # the clamp is exercised
        torch.testing.assert_close(_mamba2_forward(mixer, h), mixer(h), rtol=RTOL, atol=ATOL)


def _mamba1_mixer():
    cfg = MambaConfig(hidden_size=16, intermediate_size=24, state_size=8, conv_kernel=4, time_step_rank=4,
                      num_hidden_layers=1)
    mixer = hf_mamba.MambaMixer(cfg, 0).eval()
    with torch.no_grad():
        mixer.D.normal_()
    return mixer


def _mamba1_ssm_inputs(mixer, x):
    """x (after the conv) -> raw dt (``dt_proj`` without its bias), B, C, as MambaMixer computes them."""
    ts, B, C = mixer.x_proj(x).split([mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    return ts @ mixer.dt_proj.weight.t(), B, C


def _mamba1_forward(mixer, h):
    x, z = mixer.in_proj(h).chunk(2, dim=-1)
    x = ad.torch_causal_conv1d(x, mixer.conv1d.weight, mixer.conv1d.bias, mixer.activation)
    dt, B, C = _mamba1_ssm_inputs(mixer, x)
    y = ad.torch_ssm_mamba1(x, dt, -torch.exp(mixer.A_log.float()), B, C, mixer.D, mixer.dt_proj.bias)
    return mixer.out_proj(y * F.silu(z))


def test_mamba1_mixer_built_from_ops_matches_hf():
    mixer = _mamba1_mixer()
    h = torch.randn(2, 11, 16)
    with torch.no_grad():
        torch.testing.assert_close(_mamba1_forward(mixer, h), mixer(h), rtol=RTOL, atol=ATOL)


# ---- cached ops: step metadata and a scheduling harness -------------------------------------


def _step_metadata(seqs: Sequence[Tuple[int, int, int, bool]], num_prefill: Optional[int] = None
                   ) -> List[torch.Tensor]:
    """[(new tokens, tokens before, slot, use_initial_state)] -> the cached ops' metadata, in their
    argument order: batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state. Sequences with
    one new token after others are decodes, unless ``num_prefill`` says otherwise (padding rows at
    position 0 count as decodes, as in the CUDA-graph path)."""
    lengths = [n for n, _, _, _ in seqs]
    if num_prefill is None:
        is_decode = [n == 1 and pos > 0 for n, pos, _, _ in seqs]
        num_prefill = len(seqs) - sum(is_decode)
        assert not any(is_decode[:num_prefill]), "prefills come first"
    assert all(n == 1 for n in lengths[num_prefill:])
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    i32 = dict(dtype=torch.int32)
    return [torch.tensor([num_prefill, cu[num_prefill], len(seqs) - num_prefill], **i32), torch.tensor(lengths, **i32),
            torch.tensor(cu, **i32), torch.tensor([slot for _, _, slot, _ in seqs], **i32),
            torch.tensor([carry for _, _, _, carry in seqs], dtype=torch.bool)]


@dataclass
class Kind:
    """One cached op: random per-token inputs ``[1, s, ...]``, the uncached op on a whole sequence,
    the cached op on a flattened step, and its state's shape."""

    make: Callable[[int], List[torch.Tensor]]
    full: Callable[[List[torch.Tensor]], torch.Tensor]
    cached: Callable[[List[torch.Tensor], List[torch.Tensor], torch.Tensor], torch.Tensor]
    state_shape: Tuple[int, ...]


H, P, G, N, CH, K = 6, 4, 2, 8, 6, 4
with torch.random.fork_rng():  # module-level weights, the same whatever ran before
    torch.manual_seed(1)
    _M2 = _mamba2_inputs(1, 1, H, P, G, N)  # A, D, dt_bias are shared by every sequence
    _M1 = _mamba1_inputs(1, 1, CH, N)
    _CONV_W, _CONV_B = torch.randn(CH, 1, K), torch.randn(CH)

KINDS = {
    "ssm": Kind(
        make=lambda s: [torch.randn(1, s, H, P), torch.randn(1, s, H) * 2, torch.randn(1, s, G, N),
                        torch.randn(1, s, G, N)],
        full=lambda t: ad.torch_ssm(t[0], t[1], _M2["A"], t[2], t[3], _M2["D"], _M2["dt_bias"], LIMIT),
        cached=lambda t, meta, cache: ad.torch_cached_ssm(t[0], t[1], _M2["A"], t[2], t[3], _M2["D"], _M2["dt_bias"],
                                                          *meta, cache, LIMIT),
        state_shape=(H, P, N)),
    "ssm_mamba1": Kind(
        make=lambda s: [torch.randn(1, s, CH), torch.randn(1, s, CH), torch.randn(1, s, N), torch.randn(1, s, N)],
        full=lambda t: ad.torch_ssm_mamba1(t[0], t[1], _M1["A"], t[2], t[3], _M1["D"], _M1["dt_bias"]),
        cached=lambda t, meta, cache: ad.torch_cached_ssm_mamba1(t[0], t[1], _M1["A"], t[2], t[3], _M1["D"],
                                                                 _M1["dt_bias"], *meta, cache),
        state_shape=(CH, N)),
    "causal_conv1d": Kind(
        make=lambda s: [torch.randn(1, s, CH)],
        full=lambda t: ad.torch_causal_conv1d(t[0], _CONV_W, _CONV_B, "silu"),
        cached=lambda t, meta, cache: ad.torch_cached_causal_conv1d(t[0], _CONV_W, _CONV_B, *meta, cache, "silu"),
        state_shape=(CH, K - 1)),
}

Step = Sequence[Tuple[int, int, int]]  # (sequence, first token, end token) per scheduled sequence


def _run(kind: Kind, seqs: List[List[torch.Tensor]], steps: Sequence[Step], slots: Dict[int, int],
         cache: torch.Tensor, fresh: Sequence[Tuple[int, int]] = ()) -> Dict[int, List[torch.Tensor]]:
    """Runs the schedule; a sequence continues its state unless it starts at token 0 or
    ``(step index, sequence)`` is in ``fresh``. Returns each sequence's outputs in order."""
    outs: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    for si, step in enumerate(steps):
        meta = _step_metadata([(e - s, s, slots[i], s > 0 and (si, i) not in fresh) for i, s, e in step])
        tokens = [torch.cat([seqs[i][j][:, s:e] for i, s, e in step], dim=1) for j in range(len(seqs[0]))]
        out = kind.cached(tokens, meta, cache)
        assert out.shape == tokens[0].shape and out.dtype == tokens[0].dtype
        off = 0
        for i, s, e in step:
            outs[i].append(out[:, off:off + e - s])
            off += e - s
    return outs


def _garbage_cache(kind: Kind, num_slots: int) -> torch.Tensor:
    return torch.randn(num_slots, *kind.state_shape) * 100


def _assert_matches_full(kind: Kind, outs, seqs):
    for i in range(len(seqs)):
        torch.testing.assert_close(torch.cat(outs[i], dim=1), kind.full(seqs[i]), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"sequence {i}: {m}")


@pytest.mark.parametrize("name", KINDS)
def test_prefill_then_decodes_equals_whole_sequence(name):
    kind = KINDS[name]
    seqs = [kind.make(12)]
    steps = [[(0, 0, 8)]] + [[(0, t, t + 1)] for t in range(8, 12)]
    outs = _run(kind, seqs, steps, {0: 1}, _garbage_cache(kind, 3))
    _assert_matches_full(kind, outs, seqs)


@pytest.mark.parametrize("name", KINDS)
def test_three_prefill_chunks_equal_one_prefill(name):
    kind = KINDS[name]
    total = CHUNK_SIZE + 30  # the SSD scan crosses a chunk boundary inside the second piece
    seqs = [kind.make(total)]
    one_cache, three_cache = _garbage_cache(kind, 2), _garbage_cache(kind, 2)
    one = _run(kind, seqs, [[(0, 0, total)]], {0: 0}, one_cache)
    three = _run(kind, seqs, [[(0, 0, 50)], [(0, 50, 101)], [(0, 101, total)]], {0: 0}, three_cache)
    torch.testing.assert_close(torch.cat(three[0], dim=1), one[0][0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(three_cache[0], one_cache[0], rtol=RTOL, atol=ATOL)
    assert three_cache[0].abs().max() < 50  # the garbage the slot started with was ignored
    _assert_matches_full(kind, one, seqs)


@pytest.mark.parametrize("name", KINDS)
def test_mixed_prefill_and_decode_keep_to_their_slots(name):
    """Sequence 0 decodes in the step where sequence 1 prefills; slots 0, 2, 4 are never named
    and must stay bit-identical; each sequence equals its own whole-sequence result."""
    kind = KINDS[name]
    seqs = [kind.make(8), kind.make(10)]
    slots = {0: 1, 1: 3}
    cache = _garbage_cache(kind, 5)
    before = cache.clone()
    steps = [
        [(0, 0, 5)],
        [(1, 0, 7), (0, 5, 6)],  # one prefill + one decode in the same step
        [(1, 7, 9), (0, 6, 7)],  # a chunked-prefill continuation + a decode
        [(0, 7, 8), (1, 9, 10)],  # two decodes
    ]
    outs = _run(kind, seqs, steps, slots, cache)
    _assert_matches_full(kind, outs, seqs)
    for untouched in (0, 2, 4):
        assert torch.equal(cache[untouched], before[untouched])
    # sequence 0's state equals the state it reaches alone (nothing of sequence 1 leaked in)
    alone = _garbage_cache(kind, 5)
    _run(kind, [seqs[0]], [[(0, 0, 5)], [(0, 5, 6)], [(0, 6, 7)], [(0, 7, 8)]], {0: 1}, alone)
    torch.testing.assert_close(cache[1], alone[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", KINDS)
def test_restart_after_preemption_ignores_the_old_state(name):
    """Sequence 0 runs 7 tokens, is preempted and restarts from token 0 in the same slot (which
    still holds its old state) with use_initial_state=False: the result is a fresh run's. The
    flag alone decides: a chunk starting at token 3 that is flagged fresh also starts from zeros."""
    kind = KINDS[name]
    seqs = [kind.make(9)]
    cache = _garbage_cache(kind, 2)
    first = _run(kind, seqs, [[(0, 0, 6)], [(0, 6, 7)]], {0: 0}, cache)
    torch.testing.assert_close(torch.cat(first[0], dim=1), kind.full([t[:, :7] for t in seqs[0]]), rtol=RTOL,
                               atol=ATOL)
    restarted = _run(kind, seqs, [[(0, 0, 9)]], {0: 0}, cache)
    _assert_matches_full(kind, restarted, seqs)
    cache[0] = float("nan")  # what an uninitialised slot may hold: must not leak through
    again = _run(kind, seqs, [[(0, 3, 9)]], {0: 0}, cache, fresh=[(0, 0)])
    torch.testing.assert_close(again[0][0], kind.full([t[:, 3:9] for t in seqs[0]]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", KINDS)
def test_one_token_per_sequence_step_with_fresh_prompt_and_padding(name):
    """A step where every sequence has one token (the batched path): a decode, a prompt's first
    token starting fresh in a slot full of NaNs, and a padding row on the spare slot. The decode
    and the prompt are right (the prompt also in its next step, from the state it stored); the
    slots no row names stay bit-identical."""
    kind = KINDS[name]
    seqs = [kind.make(6), kind.make(2), kind.make(1)]
    slots = {0: 0, 1: 2, 2: 4}  # 4 is the spare slot the padding row points at
    cache = _garbage_cache(kind, 5)
    outs = _run(kind, seqs, [[(0, 0, 5)]], slots, cache)
    cache[2] = float("nan")  # the prompt's slot, as uninitialised memory may be
    before = cache.clone()
    step = [(1, 0, 1), (0, 5, 6), (2, 0, 1)]  # T == B: no sequence has more than one token
    meta = _step_metadata([(1, 0, 2, False), (1, 5, 0, True), (1, 0, 4, False)], num_prefill=1)
    tokens = [torch.cat([seqs[i][j][:, s:e] for i, s, e in step], dim=1) for j in range(len(seqs[0]))]
    out = kind.cached(tokens, meta, cache)
    for untouched in (1, 3):
        assert torch.equal(cache[untouched], before[untouched])
    torch.testing.assert_close(torch.cat(outs[0] + [out[:, 1:2]], dim=1), kind.full(seqs[0]), rtol=RTOL, atol=ATOL)
    prompt = [out[:, 0:1]] + _run(kind, seqs, [[(1, 1, 2)]], slots, cache)[1]
    torch.testing.assert_close(torch.cat(prompt, dim=1), kind.full(seqs[1]), rtol=RTOL, atol=ATOL)


def test_bf16_state_cache_only_costs_precision():
    """The state cache's dtype is the caller's choice; a bf16 cache only costs precision."""
    kind = KINDS["ssm"]
    seqs = [kind.make(20)]
    steps = [[(0, 0, 12)]] + [[(0, t, t + 1)] for t in range(12, 20)]
    outs = _run(kind, seqs, steps, {0: 0}, torch.zeros(1, *kind.state_shape, dtype=torch.bfloat16))
    torch.testing.assert_close(torch.cat(outs[0], dim=1), kind.full(seqs[0]), rtol=5e-2, atol=5e-2)


# ---- cached ops assembled into HF's mixers, against HF's own cache ---------------------------


def _hf_incremental(mixer, config, h, chunks):
    """HF's mixer over ``h`` chunk by chunk with its own cache: (outputs, conv state, SSM state)."""
    cache = DynamicCache(config=config)
    with torch.no_grad():
        out = torch.cat([mixer(h[:, s:e], cache_params=cache) for s, e in chunks], dim=1)
    layer = cache.layers[0]
    return out, layer.conv_states[0][0], layer.recurrent_states[0][0]


# sequence 0 prefills 9 tokens, continues with a 2-token chunk, then decodes; sequence 1
# prefills 4 tokens and decodes; they share steps
HF_STEPS = [[(0, 0, 9), (1, 0, 4)], [(0, 9, 11), (1, 4, 5)], [(0, 11, 12), (1, 5, 6)], [(0, 12, 13)]]
# HF's Mamba1 torch path restarts the SSM state from zeros in a multi-token chunk that follows a
# cached one (``mamba_selective_scan`` takes no initial state), so its own chunked prefill
# differs from its full forward; against HF, Mamba1 continues one token at a time. (Our chunked
# prefill is checked against the whole-sequence op, and that against HF, above.)
HF_STEPS_MAMBA1 = [[(0, 0, 9), (1, 0, 4)], [(0, 9, 10), (1, 4, 5)], [(0, 10, 11), (1, 5, 6)], [(0, 11, 12)],
                   [(0, 12, 13)]]
HF_TOTALS = [13, 6]


def _chunks_of(steps, seq: int):
    return [(s, e) for step in steps for i, s, e in step if i == seq]


def _flattened_steps(mixer_forward, steps, hs, slots):
    outs: Dict[int, List[torch.Tensor]] = {0: [], 1: []}
    for step in steps:
        meta = _step_metadata([(e - s, s, slots[i], s > 0) for i, s, e in step])
        out = mixer_forward(torch.cat([hs[i][:, s:e] for i, s, e in step], dim=1), meta)
        off = 0
        for i, s, e in step:
            outs[i].append(out[:, off:off + e - s])
            off += e - s
    return {i: torch.cat(o, dim=1) for i, o in outs.items()}


def test_cached_mamba2_mixer_matches_hf_with_its_cache():
    mixer = _mamba2_mixer()
    conv_state = torch.randn(4, mixer.conv_dim, mixer.conv_kernel_size - 1) * 100
    ssm_state = torch.randn(4, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size) * 100
    A, D, dt_bias = _mamba2_params(mixer)

    def forward(h, meta):
        gate, xbc, dt = _mamba2_split(mixer, h)
        xbc = ad.torch_cached_causal_conv1d(xbc, mixer.conv1d.weight, mixer.conv1d.bias, *meta, conv_state,
                                            mixer.activation)
        x, B, C = _mamba2_heads(mixer, xbc)
        y = ad.torch_cached_ssm(x, dt, A, B, C, D, dt_bias, *meta, ssm_state, list(mixer.time_step_limit))
        return mixer.out_proj(mixer.norm(y.reshape(*h.shape[:2], -1), gate))

    hs = [torch.randn(1, t, 16) for t in HF_TOTALS]
    slots = {0: 3, 1: 1}
    with torch.no_grad():
        ours = _flattened_steps(forward, HF_STEPS, hs, slots)
    for i in range(2):
        hf, hf_conv, hf_ssm = _hf_incremental(mixer, _mamba2_config(), hs[i], _chunks_of(HF_STEPS, i))
        torch.testing.assert_close(ours[i], hf, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ssm_state[slots[i]], hf_ssm, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(conv_state[slots[i]], hf_conv[:, 1:], rtol=RTOL, atol=ATOL)  # HF keeps k


def test_cached_mamba1_mixer_matches_hf_with_its_cache():
    mixer = _mamba1_mixer()
    conv_state = torch.randn(3, mixer.intermediate_size, mixer.conv_kernel_size - 1) * 100
    ssm_state = torch.randn(3, mixer.intermediate_size, mixer.ssm_state_size) * 100
    A = -torch.exp(mixer.A_log.float())

    def forward(h, meta):
        x, z = mixer.in_proj(h).chunk(2, dim=-1)
        x = ad.torch_cached_causal_conv1d(x, mixer.conv1d.weight, mixer.conv1d.bias, *meta, conv_state,
                                          mixer.activation)
        dt, B, C = _mamba1_ssm_inputs(mixer, x)
        y = ad.torch_cached_ssm_mamba1(x, dt, A, B, C, mixer.D, mixer.dt_proj.bias, *meta, ssm_state)
        return mixer.out_proj(y * F.silu(z))

    hs = [torch.randn(1, t, 16) for t in HF_TOTALS]
    slots = {0: 0, 1: 2}
    with torch.no_grad():
        ours = _flattened_steps(forward, HF_STEPS_MAMBA1, hs, slots)
    for i in range(2):
        hf, hf_conv, hf_ssm = _hf_incremental(mixer, mixer.config, hs[i], _chunks_of(HF_STEPS_MAMBA1, i))
        torch.testing.assert_close(ours[i], hf, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ssm_state[slots[i]], hf_ssm, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(conv_state[slots[i]], hf_conv[:, 1:], rtol=RTOL, atol=ATOL)


# ---- fake kernels and export ----------------------------------------------------------------


def _opcheck_cases():
    m2, m1 = _mamba2_inputs(2, 5, H, P, G, N), _mamba1_inputs(2, 5, CH, N)
    meta = _step_metadata([(4, 0, 2, False), (1, 3, 0, True)])
    k2, k1, kc = KINDS["ssm"], KINDS["ssm_mamba1"], KINDS["causal_conv1d"]
    t2 = [torch.cat([a[:, :4], b[:, :1]], dim=1) for a, b in zip(k2.make(5), k2.make(5))]
    t1 = [torch.cat([a[:, :4], b[:, :1]], dim=1) for a, b in zip(k1.make(5), k1.make(5))]
    tc = [torch.cat([a[:, :4], b[:, :1]], dim=1) for a, b in zip(kc.make(5), kc.make(5))]
    return [
        ("ssm", ad.torch_ssm, (m2["x"], m2["dt"], m2["A"], m2["B"], m2["C"], m2["D"], m2["dt_bias"], LIMIT)),
        ("ssm_no_limit", ad.torch_ssm, (m2["x"], m2["dt"], m2["A"], m2["B"], m2["C"], m2["D"], m2["dt_bias"], None)),
        ("ssm_mamba1", ad.torch_ssm_mamba1, (m1["x"], m1["dt"], m1["A"], m1["B"], m1["C"], m1["D"], m1["dt_bias"])),
        ("cached_ssm", ad.torch_cached_ssm, (t2[0], t2[1], _M2["A"], t2[2], t2[3], _M2["D"], _M2["dt_bias"], *meta,
                                             torch.randn(3, H, P, N), LIMIT)),
        ("cached_ssm_mamba1", ad.torch_cached_ssm_mamba1, (t1[0], t1[1], _M1["A"], t1[2], t1[3], _M1["D"],
                                                           _M1["dt_bias"], *meta, torch.randn(3, CH, N))),
        ("cached_causal_conv1d", ad.torch_cached_causal_conv1d, (tc[0], _CONV_W, _CONV_B, *meta,
                                                                 torch.randn(3, CH, K - 1), "silu")),
    ]


OPCHECK_CASES = _opcheck_cases()


@pytest.mark.parametrize("name,op,args", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("op,cache_arg", [(ad.torch_cached_ssm, "ssm_state"),
                                          (ad.torch_cached_ssm_mamba1, "ssm_state"),
                                          (ad.torch_cached_causal_conv1d, "conv_state")])
def test_cached_ops_declare_the_state_mutation(op, cache_arg):
    args = op.default._schema.arguments
    written = [a.name for a in args if a.alias_info is not None and a.alias_info.is_write]
    assert written == [cache_arg]


class _Mamba2Block(torch.nn.Module):
    """conv -> split -> scan, as an exported Mamba2 mixer's core would look."""

    def __init__(self):
        super().__init__()
        self.conv_w = torch.nn.Parameter(torch.randn(H * P + 2 * G * N, 1, K))
        self.A, self.D, self.dt_bias = (torch.nn.Parameter(_M2[n].clone()) for n in ("A", "D", "dt_bias"))

    def forward(self, xbc, dt):
        b, s = xbc.shape[:2]
        xbc = ad.torch_causal_conv1d(xbc, self.conv_w, None, "silu")
        x, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
        y = ad.torch_ssm(x.reshape(b, s, H, P), dt, self.A, B.reshape(b, s, G, N), C.reshape(b, s, G, N), self.D,
                         self.dt_bias, [0.0, float("inf")])
        return y.reshape(b, s, -1)


class _Mamba1Block(torch.nn.Module):
    def forward(self, x, dt, B, C):
        return ad.torch_ssm_mamba1(x, dt, _M1["A"], B, C, _M1["D"], _M1["dt_bias"]) * 2.0


def test_export_with_dynamic_sequence_serves_other_lengths():
    seq = Dim("seq", min=1, max=4096)
    block = _Mamba2Block()
    ep = torch.export.export(block, (torch.randn(2, 9, H * P + 2 * G * N), torch.randn(2, 9, H)),
                             dynamic_shapes=({1: seq}, {1: seq}), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_ssm.default) == 1 and targets.count(ad.torch_causal_conv1d.default) == 1
    for s in (9, 1, CHUNK_SIZE + 3):
        args = (torch.randn(2, s, H * P + 2 * G * N), torch.randn(2, s, H))
        assert torch.equal(ep.module()(*args), block(*args))

    m1 = _Mamba1Block()
    args = tuple(t[:1] for t in KINDS["ssm_mamba1"].make(7))
    ep = torch.export.export(m1, args, dynamic_shapes=tuple({1: seq} for _ in args), strict=False)
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"].count(ad.torch_ssm_mamba1.default) == 1
    for s in (7, 2):
        args = KINDS["ssm_mamba1"].make(s)
        assert torch.equal(ep.module()(*args), m1(*args))


class _CachedSSM(torch.nn.Module):
    def forward(self, x, dt, B, C, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, ssm_state):
        return ad.torch_cached_ssm(x, dt, _M2["A"], B, C, _M2["D"], _M2["dt_bias"], batch_info, seq_len, cu_seqlen,
                                   slot_idx, use_initial_state, ssm_state, LIMIT)


def test_cached_ssm_exports_as_one_mutating_node_with_dynamic_tokens():
    seqs = [KINDS["ssm"].make(6), KINDS["ssm"].make(2)]
    meta = _step_metadata([(6, 0, 0, False), (1, 1, 2, True)])
    tokens = [torch.cat([a, b[:, 1:2]], dim=1) for a, b in zip(*seqs)]
    cache = torch.randn(3, H, P, N)
    args = (*tokens, *meta, cache)
    t, b = Dim("tokens", min=1, max=4096), Dim("batch", min=1, max=64)
    dyn = ({1: t},) * 4 + (None, {0: b}, {0: b + 1}, {0: b}, {0: b}, None)
    ep = torch.export.export(_CachedSSM(), args, dynamic_shapes=dyn, strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_cached_ssm.default) == 1
    eager_cache, exported_cache = cache.clone(), cache.clone()
    expected = _CachedSSM()(*args[:-1], eager_cache)
    out = ep.module()(*args[:-1], exported_cache)
    assert torch.equal(out, expected) and torch.equal(exported_cache, eager_cache)
    assert not torch.equal(exported_cache, cache)
