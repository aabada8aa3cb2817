"""Penalties, ``logit_bias`` and ``min_tokens`` against HF transformers on the same checkpoint (the tiny-llama
preset): greedy tokens with ``repetition_penalty`` (HF's ``RepetitionPenaltyLogitsProcessor``),
``logit_bias`` (HF's ``sequence_bias`` of one-token sequences) and ``min_tokens`` (HF's
``min_new_tokens``), ``bad_words_token_ids`` (HF's ``bad_words_ids``) and ``allowed_token_ids`` (HF's
``prefix_allowed_tokens_fn``) equal ``generate``'s; ``frequency_penalty`` and
``presence_penalty``, which HF does not have, equal OpenAI's formula applied to HF's logits step
by step. Each case first checks that the setting changes the plain greedy answer, so that the
comparison cannot pass with the setting ignored."""

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.models.presets import preset_dir
from helpers import hf_model

PROMPTS = ["The for statement", "Exceptions are raised when", "A class definition defines a class object"]
EOS_PROMPT = PROMPTS[2]  # the preset's greedy answer ends with EOS a few tokens in
NEW = 16


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_seq_len=64, max_batch_size=4, max_num_tokens=64, page_size=4)


@pytest.fixture(scope="module")
def hf():
    return hf_model(preset_dir("tiny-llama"))


def _ids(llm, prompt):
    return llm.tokenizer(prompt)["input_ids"]


def _ours(llm, prompts, **params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=NEW, temperature=0,
                                                                                   **params))
    return [list(o.token_ids) for o in outs]


def _hf_generate(hf, prompt, **kw):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, **kw)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_gives_hf_greedy_tokens(llm, hf):
    prompts = [_ids(llm, p) for p in PROMPTS]
    ours = _ours(llm, prompts, repetition_penalty=1.8)
    assert ours != _ours(llm, prompts)  # the penalty changes the answers
    assert ours == [_hf_generate(hf, p, repetition_penalty=1.8) for p in prompts]


def test_min_tokens_gives_hf_min_new_tokens(llm, hf):
    prompt = _ids(llm, EOS_PROMPT)
    (plain,) = _ours(llm, [prompt])
    assert len(plain) < 10  # ends with EOS before 10 tokens ...
    (ours,) = _ours(llm, [prompt], min_tokens=10)
    assert len(ours) >= 10  # ... which min_tokens forbids
    assert ours == _hf_generate(hf, prompt, min_new_tokens=10)


@pytest.mark.parametrize("freq, pres", [(0.9, 0.0), (0.0, 1.5), (-0.5, 1.0)])
def test_frequency_and_presence_penalties_follow_openai_on_hf_logits(llm, hf, freq, pres):
    prompts = [_ids(llm, p) for p in PROMPTS]
    ours = _ours(llm, prompts, frequency_penalty=freq, presence_penalty=pres, ignore_eos=True)
    assert ours != _ours(llm, prompts, ignore_eos=True)
    for prompt, tokens in zip(prompts, ours):
        out = []
        for _ in range(NEW):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            out.append(int((logits - freq * counts - pres * (counts > 0).float()).argmax()))
        assert tokens == out


def test_logit_bias_gives_hf_sequence_bias_tokens(llm, hf):
    prompts = [_ids(llm, p) for p in PROMPTS]
    plain = _ours(llm, prompts, ignore_eos=True)
    bias = {plain[0][3]: 3.0, plain[1][2]: -4.0, 77: 2.5}
    ours = _ours(llm, prompts, logit_bias=bias, ignore_eos=True)
    assert ours != plain
    hf_bias = {(t,): b for t, b in bias.items()}
    assert ours == [_hf_generate(hf, p, sequence_bias=hf_bias, eos_token_id=None) for p in prompts]


def test_bad_words_token_ids_give_hf_bad_words_ids_tokens(llm, hf):
    """One-token sequences are never sampled; a longer one's last token not right after the rest
    (HF's ``bad_words_ids``; here the banned pair starts inside the output, where HF's check over
    prompt and output and vLLM's over the output alone agree)."""
    prompt = _ids(llm, PROMPTS[0])
    (plain,) = _ours(llm, [prompt], ignore_eos=True)
    k = next(i for i in range(2, NEW) if plain[i - 1] != prompt[-1] and plain[i] not in plain[:i])
    for banned in ([[plain[0]]], [[plain[k - 1], plain[k]]], [[plain[1]], [plain[k - 1], plain[k]]]):
        (ours,) = _ours(llm, [prompt], ignore_eos=True, bad_words_token_ids=banned)
        assert ours != plain  # the ban changes the answer
        assert ours == _hf_generate(hf, prompt, bad_words_ids=banned)
        for ids in banned:  # and the sequence never appears
            assert all(ours[i:i + len(ids)] != ids for i in range(len(ours)))


def test_bad_words_are_banned_as_the_tokenizer_writes_them(llm):
    prompt = _ids(llm, PROMPTS[0])
    (plain,) = _ours(llm, [prompt], ignore_eos=True)
    word = llm.tokenizer.decode(plain[:2]).strip()  # the answer's first word(s)
    ids = llm.processor.bad_words_token_ids([word])
    assert ids[0] == llm.tokenizer(word, add_special_tokens=False)["input_ids"]
    (ours,) = _ours(llm, [prompt], ignore_eos=True, bad_words=[word])
    assert ours != plain
    assert ours == _ours(llm, [prompt], ignore_eos=True, bad_words_token_ids=ids)[0]
    assert all(ours[i:i + len(seq)] != seq for seq in ids for i in range(len(ours)))



def test_allowed_token_ids_give_hf_prefix_allowed_tokens(llm, hf):
    """vLLM's ``allowed_token_ids``: greedy tokens = HF's ``generate`` allowing the same tokens at
    every step; a seeded sample stays inside them too."""
    prompts = [_ids(llm, p) for p in PROMPTS[:2]]
    plain = _ours(llm, prompts)
    allowed = sorted({plain[0][1], plain[0][3], plain[1][2], 7, 300, 301})  # not the first tokens, not EOS
    ours = _ours(llm, prompts, allowed_token_ids=allowed)
    for p, o, q in zip(prompts, ours, plain):
        assert o != q and set(o) <= set(allowed)
        assert o == _hf_generate(hf, p, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    sampled = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(
        max_tokens=NEW, temperature=1.5, seed=3, allowed_token_ids=allowed))[0]
    assert set(sampled.token_ids) <= set(allowed) and len(set(sampled.token_ids)) > 1


def test_no_token_left_ends_the_output(llm):
    """A request whose parameters ban every token it allows ends ("abort") instead of taking a
    forbidden token: here its one allowed token may not follow itself."""
    prompt = _ids(llm, PROMPTS[0])
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=NEW, temperature=0, allowed_token_ids=[300], bad_words_token_ids=[[300, 300]]))[0]
    assert out.token_ids == [300] and out.outputs[0].finish_reason == "abort"
    # the other requests of its steps are untouched
    both = llm.generate([{"prompt_token_ids": prompt}] * 2, [
        SamplingParams(max_tokens=NEW, temperature=0, allowed_token_ids=[300], min_tokens=2, stop_token_ids=[300]),
        SamplingParams(max_tokens=NEW, temperature=0)])
    assert both[0].token_ids == [] and both[0].outputs[0].finish_reason == "abort"
    assert both[1].token_ids == _ours(llm, [prompt])[0]
