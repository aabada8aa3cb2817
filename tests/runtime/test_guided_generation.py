"""Guided decoding end to end on the tiny-llama preset.

The reference is HF transformers' ``generate`` with ``prefix_allowed_tokens_fn``: at every step
the allowed tokens are found by stepping the automaton over each token's bytes one token at a
time (no sorted walk, no mask cache, no engine), EOS once the output is complete. Greedy tokens
must be equal. Sampled outputs must satisfy their constraint (``json.loads``, ``re.fullmatch``),
and each case first checks that the unconstrained answer does not, so none can pass with the
constraint ignored."""

import json
import re

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.models.presets import preset_dir
from autodeploy.runtime.guided.params import GuidedDecodingParams
from autodeploy.runtime.guided.vocab import TokenVocab
from helpers import hf_model

PROMPTS = ["The for statement", "Exceptions are raised when", "A class definition defines a class object"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "bc", "def"]},
                                           "tag": {"type": "string", "maxLength": 3}},
          "required": ["ok", "kind", "tag"]}
CASES = {
    "json_object": dict(json_object=True),
    "regex": dict(regex=r"[a-z]{1,6}( [a-z]{1,6}){0,3}\."),
    "choice": dict(choice=["yes", "no", "maybe later"]),
    "schema": dict(json=SCHEMA),
    # complete after any letter, so only EOS (allowed once complete) or max_tokens ends it
    "open_regex": dict(regex=r"[a-zA-Z ,.]+"),
}
NEW = 24


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_seq_len=96, max_batch_size=4, max_num_tokens=96, page_size=4)


@pytest.fixture(scope="module")
def hf():
    return hf_model(preset_dir("tiny-llama"))


def _reference(hf, tokenizer, prompt, guided):
    """HF greedy generation under the constraint, allowed tokens found one token at a time."""
    automaton = GuidedDecodingParams(**guided).automaton()
    vocab = TokenVocab.from_tokenizer(tokenizer)
    eos = tokenizer.eos_token_id

    def allowed(_batch, ids):
        out = ids[len(prompt):].tolist()
        if out and out[-1] == eos:
            return [eos]
        state = automaton.initial
        for i, t in enumerate(out):
            for byte in (vocab.first if i == 0 else vocab.tokens)[t]:
                state = automaton.step(state, byte)
        table = vocab.first if not out else vocab.tokens
        ok = []
        for t, data in enumerate(table):
            s = state
            for byte in data or b"":
                s = automaton.step(s, byte)
                if s is None:
                    break
            if data and s is not None:
                ok.append(t)
        return ok + [eos] if automaton.accepting(state) else ok

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW,
                          prefix_allowed_tokens_fn=allowed, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


def _satisfies(kind, text):
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "schema":
        try:
            value = json.loads(text)
        except ValueError:
            return False
        # properties in the schema's order (not sorted)
        return (isinstance(value, dict) and list(value) == ["ok", "kind", "tag"] and isinstance(value["ok"], bool)
                and value["kind"] in ("a", "bc", "def") and isinstance(value["tag"], str) and len(value["tag"]) <= 3)
    if kind in ("regex", "open_regex"):
        return re.fullmatch(CASES[kind]["regex"], text) is not None
    return text in CASES["choice"]["choice"]


@pytest.mark.parametrize("kind", sorted(CASES))
def test_greedy_tokens_equal_hf_with_the_same_constraint(llm, hf, kind):
    eos = llm.tokenizer.eos_token_id
    ended_on_eos = 0
    for prompt_text in PROMPTS:
        prompt = llm.tokenizer(prompt_text)["input_ids"]
        (out,) = llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(max_tokens=NEW, temperature=0, guided=CASES[kind]))
        ours = list(out.outputs[0].token_ids)
        ref = _reference(hf, llm.tokenizer, prompt, CASES[kind])
        if ours and ours[-1] != eos and len(ref) == len(ours) + 1 and ref[-1] == eos:
            ref = ref[:-1]  # ours ended where nothing could follow; HF needs its EOS for that
        assert ours == ref, (kind, prompt_text)
        ended_on_eos += ours[-1] == eos
        if out.outputs[0].finish_reason == "stop":
            assert _satisfies(kind, out.outputs[0].text), out.outputs[0].text
    if kind == "open_regex":
        assert ended_on_eos  # EOS is allowed where the output is complete but could go on


@pytest.fixture(scope="module")
def plain_samples(llm):
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s) for s in range(6)]
    return [o.outputs[0].text for o in llm.generate(PROMPTS[:2] * 3, params)]


@pytest.mark.parametrize("kind", ["choice", "json_object", "regex", "schema"])
def test_sampled_outputs_satisfy_the_constraint(llm, plain_samples, kind):
    assert not any(_satisfies(kind, text) for text in plain_samples)  # unconstrained: none of them
    guided = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, guided=CASES[kind]) for s in range(6)]
    outs = llm.generate(PROMPTS[:2] * 3, guided)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= (2 if kind == "json_object" else 6)  # a random model may wander inside a string
    for o in finished:
        assert _satisfies(kind, o.text), o.text


def test_a_batch_mixing_guided_and_plain_requests(llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [SamplingParams(max_tokens=12, temperature=0,
                                                                           guided=CASES["choice"])] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].text in CASES["choice"]["choice"] for o in mixed[3:])


def test_n_sequences_follow_their_own_constraint_state(llm):
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=4,
                                                       guided=CASES["regex"]))
    texts = [o.text for o in out.outputs]
    assert len(set(texts)) > 1
    assert all(_satisfies("regex", t) or o.finish_reason == "length" for t, o in zip(texts, out.outputs))


def test_an_automaton_past_its_limit_aborts_only_its_sequence(llm):
    """A pattern whose DFA explodes (the n-th byte from the end) stops its own sequence with
    finish_reason 'abort'; the other request of the step is served as if alone."""
    blowup = GuidedDecodingParams(regex=".*a.{12}")  # a DFA state per pattern of a's in the last 13 bytes
    blowup.automaton().max_states = 10  # the first mask alone needs 19 states
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (alone,) = llm.generate([PROMPTS[0]], plain)
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [plain, SamplingParams(max_tokens=12, temperature=0,
                                                                          guided=blowup)])
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[1].outputs[0].finish_reason == "abort"


def test_guided_decoding_needs_a_tokenizer():
    from autodeploy.runtime.sampling_params import InvalidRequestError

    bare = LLM("tiny-llama", max_seq_len=32, max_batch_size=2, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        bare.generate([{"prompt_token_ids": [1, 5, 6]}], SamplingParams(max_tokens=2, guided=CASES["choice"]))


@pytest.mark.parametrize("bad, match", [
    (dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"), (dict(choice=[]), "choice"),
    (dict(json={"type": "object", "patternProperties": {}}), "patternProperties"), (dict(regex="a(b"), "regex"),
    (dict(regex="(?=a)"), "regex"), (dict(json_object="yes"), "json_object"),
])
def test_bad_constraints_are_request_errors(bad, match):
    from autodeploy.runtime.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(guided=bad)
