"""Delta-rule ops: the references against an independent per-token loop and against HF's own
torch fallbacks (qwen3_next's chunked/recurrent gated delta rule, kimi_linear's chunked/recurrent
KDA); the cached ops over flattened steps against the uncached op on whole sequences (prefill
then decode, chunked prefill, mixed steps, preemption); fake kernels and export."""

import math
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from torch.export import Dim
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen

import autodeploy.ops.delta_rule  # noqa: F401  (registers the ops)
from state_steps import check_slot_writes, step_metadata

ad = torch.ops.autodeploy
RTOL, ATOL = 1e-5, 1e-5


def _torch_path(fn):
    """HF's torch fallback itself, even if a kernel package (fla) got installed and swapped in."""
    return getattr(fn, "__wrapped__", fn)


HF_GDN_CHUNK = _torch_path(hf_qwen.torch_chunk_gated_delta_rule)
HF_GDN_RECURRENT = _torch_path(hf_qwen.torch_recurrent_gated_delta_rule)
HF_KDA_CHUNK = _torch_path(hf_kimi.chunk_kimi_delta_attention)
HF_KDA_RECURRENT = _torch_path(hf_kimi.recurrent_kimi_delta_attention)

VARIANTS = ["gated", "delta", "channelwise"]


def _inputs(variant: str, b: int, s: int, hk: int, h: int, dk: int, dv: int, normalized_k: bool = True,
            dtype: torch.dtype = torch.float32) -> Dict[str, Optional[torch.Tensor]]:
    """Random q/k/v/g/beta with the magnitudes models produce: log-decays <= 0 and beta in (0, 1).

    With ``normalized_k`` the keys have unit norm, so the recurrence is stable without the op's
    own l2norm (unnormalised keys can make ``I - beta k k^T`` expand and the state blow up)."""
    k = torch.randn(b, s, hk, dk)
    if normalized_k:
        k = k / k.norm(dim=-1, keepdim=True)
    g = {"gated": -torch.rand(b, s, h) * 0.5, "delta": None, "channelwise": -torch.rand(b, s, h, dk) * 0.5}[variant]
    t = dict(q=torch.randn(b, s, hk, dk), k=k, v=torch.randn(b, s, h, dv), g=g, beta=torch.rand(b, s, h))
    return {n: None if x is None else x.to(dtype) for n, x in t.items()}


def _uncached(variant: str, t, scale: Optional[float] = None, l2: bool = False) -> torch.Tensor:
    if variant == "delta":
        return ad.torch_delta_rule(t["q"], t["k"], t["v"], t["beta"], scale, l2)
    op = ad.torch_gated_delta_rule if variant == "gated" else ad.torch_gated_delta_rule_channelwise
    return op(t["q"], t["k"], t["v"], t["g"], t["beta"], scale, l2)


def _loop_reference(variant: str, t, scale: Optional[float], l2: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, head and token, in float64, written as the DeltaNet paper's update:
    ``S_t = (I - beta k k^T) D_t S_{t-1} + beta k v^T`` with ``D_t = diag(exp(g_t))``, ``o = S_t^T q``."""
    q, k, v, beta = (t[n].double() for n in ("q", "k", "v", "beta"))
    b, s, hk, dk = q.shape
    h, dv = v.shape[2:]
    scale = dk ** -0.5 if scale is None else scale
    out = torch.zeros(b, s, h, dv, dtype=torch.float64)
    states = torch.zeros(b, h, dk, dv, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            S = torch.zeros(dk, dv, dtype=torch.float64)
            for ti in range(s):
                qv, kv = q[bi, ti, hi // (h // hk)], k[bi, ti, hi // (h // hk)]
                if l2:
                    qv, kv = qv / math.sqrt(float(qv @ qv) + 1e-6), kv / math.sqrt(float(kv @ kv) + 1e-6)
                if variant == "gated":
                    D = torch.eye(dk, dtype=torch.float64) * math.exp(float(t["g"][bi, ti, hi]))
                elif variant == "channelwise":
                    D = torch.diag(t["g"][bi, ti, hi].double().exp())
                else:
                    D = torch.eye(dk, dtype=torch.float64)
                bt = float(beta[bi, ti, hi])
                S = (torch.eye(dk, dtype=torch.float64) - bt * torch.outer(kv, kv)) @ D @ S \
                    + bt * torch.outer(kv, v[bi, ti, hi])
                out[bi, ti, hi] = S.T @ (scale * qv)
            states[bi, hi] = S
    return out.float(), states.float()


# ---- l2norm -------------------------------------------------------------------------------


def test_l2norm_is_qwen3_next_l2norm_bit_for_bit_and_kimi_within_two_ulps():
    x = torch.randn(3, 5, 16) * 3
    x[0, 0] = 0.0  # eps inside the root: a zero row stays zero instead of dividing by zero
    out = ad.torch_l2norm(x, 1e-6)
    assert torch.equal(out, hf_qwen.l2norm(x, dim=-1, eps=1e-6))
    torch.testing.assert_close(out, hf_kimi.l2norm(x, dim=-1, eps=1e-6), rtol=2.4e-7, atol=0.0)
    assert torch.equal(out[0, 0], torch.zeros(16))
    # eps is added to the sum of squares, not a clamp on the norm (F.normalize's convention)
    small = torch.full((4,), 1e-4)
    torch.testing.assert_close(ad.torch_l2norm(small, 1e-6), small / math.sqrt(4e-8 + 1e-6))


def test_l2norm_computes_in_fp32_and_keeps_the_dtype():
    x = torch.randn(4, 32).bfloat16()
    out = ad.torch_l2norm(x, 1e-6)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, hf_qwen.l2norm(x.float()).bfloat16())


# ---- uncached references ------------------------------------------------------------------

SHAPES = [  # (b, s, hk, h, dk, dv)
    (2, 7, 2, 4, 8, 6),  # grouped: 2 q/k heads serve 4 value heads
    (1, 5, 3, 3, 4, 4),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("l2", [False, True])
def test_reference_matches_per_token_loop(variant, shape, l2):
    t = _inputs(variant, *shape)
    scale = None if l2 else 0.37  # an explicit scale replaces dk ** -0.5
    expected, _ = _loop_reference(variant, t, scale, l2)
    out = _uncached(variant, t, scale, l2)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)


def test_value_heads_are_grouped_consecutively():
    """q/k head j serves value heads [j * G, (j + 1) * G): value head 1 belongs to q/k head 0."""
    t = _inputs("gated", 1, 4, 2, 4, 8, 4)
    out = _uncached("gated", t)
    sub = {n: t[n][:, :, :1] for n in ("q", "k")} | {n: t[n][:, :, :2] for n in ("v", "g", "beta")}
    torch.testing.assert_close(out[:, :, :2], _uncached("gated", sub), rtol=0, atol=0)


# Lengths around HF's chunk size 64: shorter, not a multiple, exactly one, two and a bit.
HF_LENGTHS = [1, 37, 64, 130]


@pytest.mark.parametrize("s", HF_LENGTHS)
@pytest.mark.parametrize("l2", [True, False])
def test_gated_matches_hf_qwen3_next_chunk_and_recurrent(s, l2):
    t = _inputs("gated", 2, s, 2, 4, 16, 8)
    out = _uncached("gated", t, None, l2)
    args = (t["q"], t["k"], t["v"])
    chunk, _ = HF_GDN_CHUNK(*args, g=t["g"], beta=t["beta"], use_qk_l2norm_in_kernel=l2)
    recurrent, _ = HF_GDN_RECURRENT(*args, g=t["g"], beta=t["beta"], use_qk_l2norm_in_kernel=l2)
    torch.testing.assert_close(out, recurrent, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out, chunk, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("s", [37, 130])
def test_delta_rule_is_hf_gated_rule_with_zero_decay(s):
    t = _inputs("delta", 1, s, 2, 2, 16, 8)
    out = _uncached("delta", t, None, True)
    chunk, _ = HF_GDN_CHUNK(t["q"], t["k"], t["v"], g=torch.zeros(1, s, 2), beta=t["beta"],
                            use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, chunk, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("s", HF_LENGTHS)
@pytest.mark.parametrize("l2", [True, False])
def test_channelwise_matches_hf_kimi_chunk_and_recurrent(s, l2):
    t = _inputs("channelwise", 2, s, 3, 3, 16, 8)
    out = _uncached("channelwise", t, None, l2)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    chunk, _ = HF_KDA_CHUNK(*args, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=l2)
    recurrent, _ = HF_KDA_RECURRENT(*args, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=l2)
    torch.testing.assert_close(out, recurrent, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out, chunk, rtol=RTOL, atol=ATOL)


def test_explicit_scale_is_applied_to_the_query_after_l2norm():
    t = _inputs("gated", 1, 9, 2, 2, 16, 8)
    out = _uncached("gated", t, 0.5, True)
    # HF has no scale argument: it always multiplies the (normalised) query by dk ** -0.5
    # (dk = 16: HF divides by 4), so feed it pre-normalised q/k with the query pre-scaled by 0.5 * 4.
    q_normed, k_normed = hf_qwen.l2norm(t["q"]), hf_qwen.l2norm(t["k"])
    hf, _ = HF_GDN_RECURRENT(q_normed * (0.5 * 4.0), k_normed, t["v"], g=t["g"], beta=t["beta"])
    torch.testing.assert_close(out, hf, rtol=RTOL, atol=ATOL)


def test_low_precision_inputs_compute_in_fp32_and_return_their_dtype():
    t = _inputs("channelwise", 1, 11, 2, 2, 8, 8, dtype=torch.bfloat16)
    out = _uncached("channelwise", t, None, True)
    assert out.dtype == torch.bfloat16
    expected = _uncached("channelwise", {n: x.float() for n, x in t.items()}, None, True)
    assert torch.equal(out, expected.bfloat16())


# ---- cached ops ---------------------------------------------------------------------------

H, HK, DK, DV = 4, 2, 8, 6


def _cached(variant: str, t, meta, state_cache, l2: bool = True) -> torch.Tensor:
    m = (meta["batch_info"], meta["seq_len"], meta["cu_seqlen"], meta["slot_idx"], meta["use_initial_state"])
    if variant == "delta":
        return ad.torch_cached_delta_rule(t["q"], t["k"], t["v"], t["beta"], *m, state_cache, None, l2)
    op = ad.torch_cached_gated_delta_rule if variant == "gated" else ad.torch_cached_gated_delta_rule_channelwise
    return op(t["q"], t["k"], t["v"], t["g"], t["beta"], *m, state_cache, None, l2)


def _flatten(parts: Sequence[Tuple[Dict[str, Optional[torch.Tensor]], int, int]]):
    """One step's inputs ``[1, T, ...]``: the rows ``start:end`` of each (whole-sequence) input."""
    names = parts[0][0].keys()
    return {n: None if parts[0][0][n] is None else torch.cat([t[n][0, s:e] for t, s, e in parts])[None]
            for n in names}


def _run_schedule(variant: str, seqs: List[Dict], slots: List[int], steps, num_slots: int,
                  state_cache: Optional[torch.Tensor] = None):
    """Runs steps of (sequence, start, end, use_initial_state); returns per-sequence outputs."""
    cache = torch.zeros(num_slots, H, DK, DV) if state_cache is None else state_cache
    outs: Dict[int, List[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    for step in steps:
        meta = step_metadata([(slots[i], s, e - s, cont) for i, s, e, cont in step])
        o = _cached(variant, _flatten([(seqs[i], s, e) for i, s, e, _ in step]), meta, cache)
        assert o.shape == (1, meta["cu_seqlen"][-1], H, DV)
        for (i, s, e, _), start in zip(step, meta["cu_seqlen"].tolist()):
            outs[i].append(o[0, start:start + e - s])
    return {i: torch.cat(o)[None] for i, o in outs.items()}, cache


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_decode_equals_one_pass(variant):
    """Two sequences prefill together, then decode side by side (the batched one-token path)
    for five steps; outputs and final states equal the uncached op / HF's final state."""
    seqs = [_inputs(variant, 1, 12, HK, H, DK, DV, normalized_k=False),
            _inputs(variant, 1, 9, HK, H, DK, DV, normalized_k=False)]
    steps = [[(0, 0, 7, False), (1, 0, 4, False)]]
    steps += [[(0, p, p + 1, True), (1, p - 3, p - 2, True)] for p in range(7, 12)]
    outs, cache = _run_schedule(variant, seqs, [3, 1], steps, num_slots=5)
    for i, slot in [(0, 3), (1, 1)]:
        torch.testing.assert_close(outs[i], _uncached(variant, seqs[i], None, True), rtol=RTOL, atol=ATOL)
        _, expected_state = _loop_reference(variant, seqs[i], None, True)
        torch.testing.assert_close(cache[slot], expected_state[0], rtol=RTOL, atol=ATOL)
    for unused in (0, 2, 4):
        assert torch.equal(cache[unused], torch.zeros(H, DK, DV))


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_in_three_chunks_equals_one_prefill(variant):
    seq = _inputs(variant, 1, 15, HK, H, DK, DV, normalized_k=False)
    whole, whole_cache = _run_schedule(variant, [seq], [2], [[(0, 0, 15, False)]], num_slots=3)
    chunks = [[(0, 0, 5, False)], [(0, 5, 9, True)], [(0, 9, 15, True)]]
    chunked, chunked_cache = _run_schedule(variant, [seq], [2], chunks, num_slots=3)
    torch.testing.assert_close(chunked[0], whole[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(chunked_cache, whole_cache, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(whole[0], _uncached(variant, seq, None, True), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mixed_step_keeps_sequences_and_other_slots_apart(variant):
    """A prefill (slot 2) and a decode (slot 0) in one step: each equals its own run, and the
    slots nobody named keep their (sentinel) contents bit for bit."""
    a = _inputs(variant, 1, 6, HK, H, DK, DV, normalized_k=False)
    b = _inputs(variant, 1, 5, HK, H, DK, DV, normalized_k=False)
    sentinel = torch.randn(5, H, DK, DV)
    cache = sentinel.clone()
    # b's prompt first (alone), then one step with a's prefill and b's decode
    outs, cache = _run_schedule(variant, [a, b], [2, 0], [[(1, 0, 4, False)], [(0, 0, 6, False), (1, 4, 5, True)]],
                                num_slots=5, state_cache=cache)
    torch.testing.assert_close(outs[0], _uncached(variant, a, None, True), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(outs[1], _uncached(variant, b, None, True), rtol=RTOL, atol=ATOL)
    for slot, seq in [(2, a), (0, b)]:
        torch.testing.assert_close(cache[slot], _loop_reference(variant, seq, None, True)[1][0], rtol=RTOL, atol=ATOL)
    for untouched in (1, 3, 4):
        assert torch.equal(cache[untouched], sentinel[untouched])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("length", [5, 1], ids=["prefill_path", "one_token_path"])
def test_restart_without_initial_state_ignores_garbage_in_the_slot(variant, length):
    """A preempted sequence restarts over a slot holding garbage (inf/nan included): with
    use_initial_state=False the result is the fresh one, on both the prefill and the batched
    one-token path (a fresh one-token sequence beside a decode goes through the latter)."""
    restarted = _inputs(variant, 1, length, HK, H, DK, DV, normalized_k=False)
    other = _inputs(variant, 1, 3, HK, H, DK, DV, normalized_k=False)
    cache = torch.randn(3, H, DK, DV) * 1e4
    cache[1, 0, 0, 0], cache[1, 1, 2, 3] = float("nan"), float("inf")
    _, cache = _run_schedule(variant, [other], [2], [[(0, 0, 2, False)]], num_slots=3, state_cache=cache)
    steps = [[(0, 0, length, False), (1, 2, 3, True)]]
    outs, cache = _run_schedule(variant, [restarted, other], [1, 2], steps, num_slots=3, state_cache=cache)
    torch.testing.assert_close(outs[0], _uncached(variant, restarted, None, True), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(outs[1][:, -1:], _uncached(variant, other, None, True)[:, -1:], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(cache[1], _loop_reference(variant, restarted, None, True)[1][0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("variant", ["gated", "channelwise"])
def test_continuing_from_a_stored_state_matches_hf_initial_state(variant):
    """A chunk continuing a stored state equals HF's chunked kernel given that initial_state,
    output and final state (qwen3_next for the per-head gate, kimi for the per-channel one)."""
    t = _inputs(variant, 1, 70, HK if variant == "gated" else H, H, DK, DV)
    init = torch.randn(H, DK, DV) * 0.3
    cache = torch.zeros(2, H, DK, DV)
    cache[1] = init
    out = _cached(variant, t, step_metadata([(1, 10, 70, True)]), cache)
    if variant == "gated":
        hf, hf_state = HF_GDN_CHUNK(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], initial_state=init[None],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    else:
        hf, hf_state = HF_KDA_CHUNK(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=init[None],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, hf, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(cache[1], hf_state[0], rtol=RTOL, atol=ATOL)
    assert torch.equal(cache[0], torch.zeros(H, DK, DV))


# ---- fake kernels and export ----------------------------------------------------------------


def _opcheck_cases():
    t = _inputs("channelwise", 2, 5, HK, H, DK, DV)
    g_head = -torch.rand(2, 5, H)
    ft = _flatten([({n: x[:1] for n, x in t.items()}, 0, 4), ({n: x[1:] for n, x in t.items()}, 2, 3)])
    fg_head = torch.cat([g_head[0, :4], g_head[1, 2:3]])[None]
    meta = step_metadata([(2, 0, 4, False), (0, 2, 1, True)])
    m = (meta["batch_info"], meta["seq_len"], meta["cu_seqlen"], meta["slot_idx"], meta["use_initial_state"])
    cache = torch.randn(3, H, DK, DV)
    q, k, v, beta = t["q"], t["k"], t["v"], t["beta"]
    return [
        ("l2norm", ad.torch_l2norm, (q, 1e-6)),
        ("gated", ad.torch_gated_delta_rule, (q, k, v, g_head, beta, None, True)),
        ("delta", ad.torch_delta_rule, (q, k, v, beta, 0.3, False)),
        ("channelwise", ad.torch_gated_delta_rule_channelwise, (q, k, v, t["g"], beta, None, True)),
        ("cached_gated", ad.torch_cached_gated_delta_rule,
         (ft["q"], ft["k"], ft["v"], fg_head, ft["beta"], *m, cache.clone(), None, True)),
        ("cached_delta", ad.torch_cached_delta_rule, (ft["q"], ft["k"], ft["v"], ft["beta"], *m, cache.clone(), None,
                                                      True)),
        ("cached_channelwise", ad.torch_cached_gated_delta_rule_channelwise,
         (ft["q"], ft["k"], ft["v"], ft["g"], ft["beta"], *m, cache.clone(), None, True)),
    ]


@pytest.mark.parametrize("name,op,args", _opcheck_cases(), ids=[c[0] for c in _opcheck_cases()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_cached_op_writes_only_named_slots_and_declares_the_mutation():
    _, op, args = _opcheck_cases()[4]
    check_slot_writes(op, args, state_arg=10)


class _GDN(torch.nn.Module):
    def forward(self, q, k, v, g, beta):
        return ad.torch_gated_delta_rule(q, k, v, g, beta, None, True) * 2.0


def test_export_with_dynamic_sequence_serves_other_lengths():
    t = _inputs("gated", 1, 9, HK, H, DK, DV)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    seq = Dim("seq", min=1, max=4096)
    ep = torch.export.export(_GDN(), args, dynamic_shapes=tuple({1: seq} for _ in args), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_gated_delta_rule.default) == 1
    for s in (9, 4, 1):
        u = _inputs("gated", 1, s, HK, H, DK, DV)
        a = (u["q"], u["k"], u["v"], u["g"], u["beta"])
        assert torch.equal(ep.module()(*a), _GDN()(*a))


class _CachedGDN(torch.nn.Module):
    def forward(self, q, k, v, g, beta, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, state_cache):
        return ad.torch_cached_gated_delta_rule(q, k, v, g, beta, batch_info, seq_len, cu_seqlen, slot_idx,
                                                use_initial_state, state_cache, None, True)


def test_cached_op_exports_as_one_mutating_node_with_dynamic_tokens():
    seqs = [_inputs("gated", 1, 6, HK, H, DK, DV), _inputs("gated", 1, 2, HK, H, DK, DV)]
    meta = step_metadata([(0, 0, 6, False), (1, 1, 1, True)])
    ft = _flatten([(seqs[0], 0, 6), (seqs[1], 1, 2)])
    cache = torch.randn(3, H, DK, DV)
    args = (ft["q"], ft["k"], ft["v"], ft["g"], ft["beta"], *meta.values(), cache)
    tokens, batch = Dim("tokens", min=1, max=4096), Dim("batch", min=1, max=64)
    dyn = ({1: tokens},) * 5 + (None, {0: batch}, {0: batch + 1}, {0: batch}, {0: batch}, None)
    ep = torch.export.export(_CachedGDN(), args, dynamic_shapes=dyn, strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ad.torch_cached_gated_delta_rule.default) == 1
    eager_cache, exported_cache = cache.clone(), cache.clone()
    expected = _CachedGDN()(*args[:-1], eager_cache)
    out = ep.module()(*args[:-1], exported_cache)
    assert torch.equal(out, expected) and torch.equal(exported_cache, eager_cache)
    assert not torch.equal(exported_cache, cache)
