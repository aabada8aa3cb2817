"""The sampler on hand-made logits: greedy, top-k, top-p, temperature, seeds, log probabilities."""

import math

import pytest
import torch

from autodeploy.runtime.sampler import _filter, sample, token_logprobs
from autodeploy.runtime.sampling_params import SamplingParams

# A known distribution, deliberately not in sorted order so the top-p sort is exercised:
# token 3: 0.5, token 0: 0.25, token 4: 0.15, token 1: 0.07, token 2: 0.03
PROBS = torch.tensor([0.25, 0.07, 0.03, 0.5, 0.15])
LOGITS = PROBS.log()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _kept(filtered):
    return {i for i, v in enumerate(filtered.tolist()) if v != float("-inf")}


def _draw(logits, params, seed, num):
    """``num`` samples of one row with one generator (rows of a batch share nothing else)."""
    gen = _gen(seed)
    return [sample(logits[None], [params], [gen])[0] for _ in range(num)]


def test_greedy_is_argmax_per_row():
    logits = torch.randn(6, 100, generator=_gen(1))
    params = [SamplingParams(temperature=0)] * 6
    assert sample(logits, params, [None] * 6) == logits.argmax(dim=-1).tolist()


def test_greedy_rows_unaffected_by_sampled_rows_in_the_same_batch():
    logits = torch.randn(3, 50, generator=_gen(2))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=5.0, seed=1), SamplingParams(temperature=0)]
    out = sample(logits, params, [None, _gen(1), None])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    assert 0 <= out[1] < 50


def test_greedy_accepts_half_precision_logits():
    logits = torch.randn(2, 64, generator=_gen(3)).to(torch.bfloat16)
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [None, None]) == logits.float().argmax(-1).tolist()


def test_top_k_1_is_argmax_even_at_high_temperature():
    logits = torch.randn(200, generator=_gen(4))
    params = SamplingParams(temperature=100.0, top_k=1)
    assert set(_draw(logits, params, seed=0, num=200)) == {int(logits.argmax())}


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = torch.randn(200, generator=_gen(5))
    filtered = _filter(logits, 0, 1e-6, 0.0)
    assert _kept(filtered) == {int(logits.argmax())}
    params = SamplingParams(temperature=50.0, top_p=1e-6)
    assert set(_draw(logits, params, seed=0, num=200)) == {int(logits.argmax())}


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.3, {3}),  # 0.5 alone reaches 0.3
        (0.6, {3, 0}),  # 0.5 < 0.6 <= 0.75
        (0.8, {3, 0, 4}),  # 0.75 < 0.8 <= 0.9
        (0.95, {3, 0, 4, 1}),  # 0.9 < 0.95 <= 0.97
        (0.99, {3, 0, 4, 1, 2}),  # 0.97 < 0.99
        (1.0, {3, 0, 4, 1, 2}),  # disabled
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    filtered = _filter(LOGITS, 0, top_p, 0.0)
    assert _kept(filtered) == kept
    # kept logits are unchanged (renormalisation happens in the softmax)
    for i in kept:
        assert filtered[i].item() == pytest.approx(LOGITS[i].item())


@pytest.mark.parametrize("top_k, kept", [(1, {3}), (2, {3, 0}), (4, {3, 0, 4, 1}), (5, {0, 1, 2, 3, 4}), (0, {0, 1, 2, 3, 4}),
                                         (-1, {0, 1, 2, 3, 4})])
def test_top_k_keeps_the_k_largest(top_k, kept):
    assert _kept(_filter(LOGITS, top_k, 1.0, 0.0)) == kept


def test_top_p_applies_to_the_renormalised_top_k_distribution():
    # alone, top_p=0.8 keeps {3, 0, 4}; after top_k=3 the masses are .5/.9, .25/.9, .15/.9 =
    # .556, .278, .167, and .556 + .278 = .833 already reaches 0.8
    assert _kept(_filter(LOGITS, 0, 0.8, 0.0)) == {3, 0, 4}
    assert _kept(_filter(LOGITS, 3, 0.8, 0.0)) == {3, 0}


def test_sampling_never_returns_a_filtered_token():
    params = SamplingParams(temperature=1.0, top_p=0.6)
    assert set(_draw(LOGITS, params, seed=3, num=300)) == {3, 0}
    params = SamplingParams(temperature=1.0, top_k=3)
    assert set(_draw(LOGITS, params, seed=3, num=300)) == {3, 0, 4}


def test_seeded_generators_are_reproducible_and_seeds_differ():
    logits = torch.zeros(50)  # uniform: every draw is pure generator
    params = SamplingParams(temperature=1.0)
    a = _draw(logits, params, seed=123, num=100)
    b = _draw(logits, params, seed=123, num=100)
    c = _draw(logits, params, seed=124, num=100)
    assert a == b
    assert a != c
    assert len(set(a)) > 20  # actually random, not a constant


def test_batched_rows_use_their_own_generators():
    logits = torch.zeros(2, 50)
    params = [SamplingParams(temperature=1.0)] * 2
    g0, g1 = _gen(7), _gen(7)
    rows = [sample(logits, params, [g0, g1]) for _ in range(50)]
    assert all(x == y for x, y in rows)  # same seed per row -> same draws, rows do not share a stream
    alone = _draw(logits[0], params[0], seed=7, num=50)
    assert [x for x, _ in rows] == alone


def _chi_square(samples, probs):
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_sample_frequencies_follow_the_tempered_softmax(temperature):
    num = 4000
    params = SamplingParams(temperature=temperature)
    samples = _draw(LOGITS, params, seed=2024, num=num)
    expected = torch.softmax(LOGITS / temperature, dim=-1)
    # df = 4; the 1e-6 tail of chi2(4) is ~33. A fixed seed makes this deterministic.
    assert _chi_square(samples, expected) < 33.0
    # and the statistic is far larger against the untempered distribution when they differ
    if temperature != 1.0:
        assert _chi_square(samples, PROBS) > 100.0


def test_token_logprobs_chosen_first_then_top_alternatives():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0])
    logp = torch.log_softmax(logits, dim=-1)
    out = token_logprobs(logits, token=4, top=2)  # chosen not among the top 2
    assert [t for t, _ in out] == [4, 1, 2]
    for t, v in out:
        assert v == pytest.approx(float(logp[t]), abs=1e-6)
    assert math.isclose(sum(math.exp(v) for v in logp.tolist()), 1.0, rel_tol=1e-5)


def test_token_logprobs_chosen_in_top_is_not_repeated():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0])
    out = token_logprobs(logits, token=2, top=2)
    assert [t for t, _ in out] == [2, 1]
    d = dict(out)
    assert list(d) == [2, 1]
    assert d[2] == pytest.approx(float(torch.log_softmax(logits, -1)[2]), abs=1e-6)


def test_token_logprobs_zero_top_and_half_precision():
    logits = torch.tensor([0.0, 2.0, 1.0], dtype=torch.bfloat16)
    out = token_logprobs(logits, token=0, top=0)
    assert len(out) == 1 and out[0][0] == 0
    assert out[0][1] == pytest.approx(float(torch.log_softmax(logits.float(), -1)[0]), abs=1e-6)


@pytest.mark.parametrize("min_p, kept", [(0.4, {3, 0}), (0.1, {3, 0, 4, 1}), (0.0, {0, 1, 2, 3, 4})])
def test_min_p_keeps_tokens_at_least_that_share_of_the_most_likely(min_p, kept):
    # shares of the top probability 0.5: 1, .5, .3, .14, .06
    assert _kept(_filter(LOGITS, 0, 1.0, min_p)) == kept
    assert set(_draw(LOGITS, SamplingParams(temperature=1.0, min_p=min_p), seed=4, num=400)) == kept


def test_penalties_on_hand_made_logits():
    """repetition_penalty divides positive and multiplies negative logits of every token seen (prompt
    or output); frequency and presence penalties count the output only; min_tokens bans EOS and
    stop_token_ids until that many tokens are out."""
    from autodeploy.runtime.logits_processors import process_logits
    from autodeploy.runtime.sequence import Sequence

    def seq(output, **params):
        s = Sequence("r", 0, [0, 1], SamplingParams(max_tokens=8, **params), arrival=0)
        for t in output:
            s.append_token(t)
        return s

    logits = torch.tensor([[2.0, -2.0, 4.0, 1.0, -1.0, 3.0]])
    out = process_logits(logits, [seq([2, 2, 4], repetition_penalty=2.0)], set())
    assert out[0].tolist() == [1.0, -4.0, 2.0, 1.0, -2.0, 3.0]
    out = process_logits(logits, [seq([2, 2, 4], frequency_penalty=0.5, presence_penalty=0.25)], set())
    assert out[0].tolist() == [2.0, -2.0, 4.0 - 1.0 - 0.25, 1.0, -1.0 - 0.5 - 0.25, 3.0]
    out = process_logits(logits, [seq([2], min_tokens=2, stop_token_ids=[3])], {5})
    assert out[0].tolist() == [2.0, -2.0, 4.0, float("-inf"), -1.0, float("-inf")]
    out = process_logits(logits, [seq([2, 3], min_tokens=2, stop_token_ids=[3])], {5})
    assert out[0].tolist() == logits[0].tolist()  # two tokens out: nothing banned any more
    out = process_logits(logits, [seq([2], min_tokens=2, ignore_eos=True)], {5})
    assert out[0].tolist() == logits[0].tolist()  # EOS does not end it anyway
    out = process_logits(logits, [seq([2], logit_bias={0: -100, 4: 1.5})], set())
    assert out[0].tolist() == [-98.0, -2.0, 4.0, 1.0, 0.5, 3.0]
    plain = seq([2])
    assert process_logits(logits, [plain], {5}) is logits  # no request asks: the logits as they are


def test_penalties_of_a_mixed_batch_are_each_rows_own():
    """Rows with different settings (and one with none) in one batch: each row is what it is alone."""
    from autodeploy.runtime.logits_processors import process_logits
    from autodeploy.runtime.sequence import Sequence

    settings = [dict(repetition_penalty=1.7, frequency_penalty=0.4), dict(), dict(min_tokens=5, stop_token_ids=[7]),
                dict(presence_penalty=-1.0, logit_bias={3: 2.0, 9: -5.0}), dict(repetition_penalty=0.6, min_tokens=1)]
    gen = _gen(9)
    seqs = []
    for i, kw in enumerate(settings):
        s = Sequence("r", i, torch.randint(0, 40, (6,), generator=gen).tolist(), SamplingParams(max_tokens=8, **kw), 0)
        for t in torch.randint(0, 40, (i,), generator=gen).tolist():
            s.append_token(t)
        seqs.append(s)
    logits = torch.randn(len(seqs), 40, generator=gen)
    batch = process_logits(logits, seqs, {2})
    for i, seq in enumerate(seqs):
        assert torch.equal(batch[i], process_logits(logits[i:i + 1], [seq], {2})[0]), i
    assert torch.equal(batch[1], logits[1]) and not torch.equal(batch[0], logits[0])
