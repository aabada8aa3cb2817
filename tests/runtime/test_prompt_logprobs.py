"""Prompt log-probabilities (``SamplingParams(prompt_logprobs=k)``, vLLM's name): every prompt
token's log probability given the tokens before it equals HF eager's log-softmax on the same
weights, in each way a build can return logits (the LM head gathered per ``logits_index``, every
token's row, recompute mode), with prompts prefilled in 8-token chunks and sequences preempted
and recomputed; a request scoring its prompt leaves the other requests of its steps unchanged;
``max_tokens=0`` scores without generating.
"""

import pytest
import torch

from autodeploy import LLM, InvalidRequestError, SamplingParams
from helpers import family_checkpoint, hf_model

PROMPT_LENGTHS = (30, 9, 17, 5)
TOP = 3
# 8-token steps (prompts are chunked) and a pool too small for all four prompts at once (preemption)
SMALL = dict(max_seq_len=48, max_batch_size=4, max_num_tokens=8, page_size=4)
POOL = {"initialize_cache": {"num_pages": 16}}
BUILDS = {
    "gathered": POOL,
    "every_row": {**POOL, "gather_logits_before_lm_head": {"enabled": False}},
    "recompute": {**POOL, "recompute_fallback": {"mode": "always"}},
}


def _prompts(vocab=512):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_logprobs():
    hf = hf_model(family_checkpoint("llama"))

    def logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def _check_against_hf(out, hf_logprobs, top=TOP):
    ids = out.prompt_token_ids
    scored = out.prompt_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    assert len(out.prompt_ranks) == len(ids) and out.prompt_ranks[0] is None
    ref = hf_logprobs(ids)
    ranks = []
    for j in range(1, len(ids)):
        entry = scored[j]
        assert next(iter(entry)) == ids[j]  # the prompt's own token first
        assert entry[ids[j]] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-4)
        # its rank: the tokens HF finds at least as likely (a tie within the tolerance either way)
        own = float(ref[j - 1, ids[j]])
        assert int((ref[j - 1] > own + 1e-4).sum()) + 1 <= out.prompt_ranks[j] <= int((ref[j - 1] >= own - 1e-4).sum())
        ranks.append(out.prompt_ranks[j])
        values, best = torch.topk(ref[j - 1], top)
        for t, v in zip(best.tolist(), values.tolist()):
            assert entry[t] == pytest.approx(v, abs=1e-4)
        assert len(entry) in (top, top + 1)  # the prompt token, plus the top ones when it is not among them
        assert (len(entry) == top) == (out.prompt_ranks[j] <= top)
    assert max(ranks) > top  # random prompts: some of their tokens are far down the list


@pytest.mark.parametrize("build", list(BUILDS))
def test_prompt_logprobs_equal_hf(build, hf_logprobs):
    llm = LLM(family_checkpoint("llama"), transforms=BUILDS[build], **SMALL)
    prompts = _prompts()
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    alone = llm.generate([{"prompt_token_ids": p} for p in prompts], plain)
    # prompts 0 and 2 score theirs, in the same steps as 1 and 3 that do not
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], [scoring, plain, scoring, plain])
    if build != "recompute":
        assert llm.engine.num_preemptions > 0
    for i, (a, m) in enumerate(zip(alone, mixed)):
        assert m.token_ids == a.token_ids  # scoring changes no request's tokens
        assert a.prompt_logprobs is None
        if i % 2 == 0:
            _check_against_hf(m, hf_logprobs)
        else:
            assert m.prompt_logprobs is None


def test_max_tokens_zero_scores_only(hf_logprobs):
    llm = LLM(family_checkpoint("llama"), transforms=POOL, **SMALL)
    prompt = _prompts()[0]
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert out.token_ids == [] and out.finish_reason == "length"
    _check_against_hf(out, hf_logprobs, top=0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # k=0: the prompt token alone
    # n > 1: the prompt is scored once, for the request
    [outs] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, n=2, temperature=1.0, seed=1,
                                                                      prompt_logprobs=1))
    assert len(outs.outputs) == 2 and len(outs.prompt_logprobs) == len(prompt)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "set prompt_logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be an integer in [0, 20]"),
    (dict(prompt_logprobs=True), "prompt_logprobs must be an integer"),
    (dict(max_tokens=-1, prompt_logprobs=1), "max_tokens must be an integer >= 1"),
])
def test_bad_prompt_logprobs_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)
