"""The engine and the ``LLM`` API on the real tiny-llama preset: continuous batching, preemption,
chunked prefill, request validation, stop conditions, sampling, abort, streaming, chat.

Greedy references are each prompt generated alone on a roomy engine (sdpa, pool for every
request at once, whole prompts in one step); every other setup must reproduce them exactly.
To keep to two builds, the small-pool engine also uses the other attention backend ("torch");
``test_attention_backends_torch_and_sdpa_agree`` checks that part alone (no chunking, no
preemption), so a backend mismatch shows there first.
"""

import dataclasses

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.transform.graph_utils import count_op
from autodeploy.runtime.sampling_params import InvalidRequestError
from autodeploy.config.chat_template import read_chat_template
from autodeploy.utils.errors import ConfigError

BASE = dict(max_seq_len=64, max_batch_size=4, max_num_tokens=64, page_size=4)
PROMPTS = [
    "The for statement",  # 4 tokens
    "x",  # 2 tokens
    "Exceptions are raised when",  # 12 tokens
    "A class definition defines a class object and the body of the class is executed in a new frame",  # 32
]
LONG = PROMPTS[3]
EOS_PROMPT = "A class definition defines a class object"  # the preset emits EOS a few tokens in
NEW = 16
SMALL_POOL = 18  # 16 pages hold one max_seq_len sequence; the four requests need 29 at the end


def greedy(max_tokens=NEW, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=kw.pop("ignore_eos", True), **kw)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **BASE)


@pytest.fixture(scope="module")
def small_llm():
    """A pool too small for all requests at once, a 16-token step budget (chunked prefill) and
    the reference attention backend."""
    return LLM("tiny-llama", **{**BASE, "max_num_tokens": 16}, attn_backend="torch",
               transforms={"initialize_cache": {"num_pages": SMALL_POOL}})


@pytest.fixture(scope="module")
def ref(llm):
    """prompt -> greedy tokens (ignore_eos, NEW tokens), each prompt generated alone."""
    out = {}
    for p in PROMPTS + [EOS_PROMPT]:
        (res,) = llm.generate([p], greedy())
        assert len(res.token_ids) == NEW and res.finish_reason == "length"
        out[p] = res.token_ids
    assert llm.engine.scheduler.num_preemptions == 0
    return out


@pytest.fixture(autouse=True)
def _engines_left_idle(request):
    yield
    for name in ("llm", "small_llm"):
        if name in request.fixturenames:
            eng = request.getfixturevalue(name).engine
            leftover = list(eng.requests)
            for rid in leftover:
                eng.abort(rid)
            assert not leftover, f"{name}: requests left in the engine: {leftover}"
            assert not eng.has_unfinished()
            assert eng.num_free_pages == eng.pool.num_pages, f"{name}: pages leaked"


def ids_of(llm, prompt):
    return llm.tokenizer(prompt)["input_ids"]


def prep(llm, prompt, params):
    """A request as the engine takes it: checked by the request processor."""
    return llm.processor.prepare(prompt, params)


# ---- (a) continuous batching ---------------------------------------------------------------------
def test_continuous_batching_matches_each_request_alone(llm, ref):
    eng = llm.engine
    rids = {}
    finals = {}

    def step(times=1):
        for _ in range(times):
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out

    rids[eng.add_request(prep(llm, PROMPTS[0], greedy()))] = PROMPTS[0]
    step(3)
    rids[eng.add_request(prep(llm, PROMPTS[1], greedy()))] = PROMPTS[1]
    step()
    rids[eng.add_request(prep(llm, PROMPTS[2], greedy()))] = PROMPTS[2]
    step(2)
    assert len(eng.scheduler.running) == 3  # really batched together
    rids[eng.add_request(prep(llm, PROMPTS[3], greedy()))] = PROMPTS[3]
    while eng.has_unfinished():
        step()
    assert set(finals) == set(rids)
    for rid, prompt in rids.items():
        assert finals[rid].token_ids == ref[prompt], prompt
        assert finals[rid].finish_reason == "length"


def test_batched_generate_matches_each_request_alone(llm, ref):
    outs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == [ref[p] for p in PROMPTS]
    assert [o.prompt for o in outs] == PROMPTS


# ---- (b) preemption and (c) chunked prefill ------------------------------------------------------
def test_chunked_prefill_gives_the_same_tokens(small_llm, ref):
    eng = small_llm.engine
    assert eng.scheduler.max_num_tokens == 16 and len(ids_of(small_llm, LONG)) > 16
    prefill_before = eng.stats.prefill_tokens
    steps_before = eng.stats.steps
    preemptions = eng.scheduler.num_preemptions
    (out,) = small_llm.generate([LONG], greedy())
    assert out.token_ids == ref[LONG]
    assert eng.scheduler.num_preemptions == preemptions  # alone it fits: this is chunking only
    assert eng.stats.prefill_tokens - prefill_before == len(ids_of(small_llm, LONG))
    # 32 prompt tokens in 16-token chunks: 2 prefill steps, then NEW - 1 decode steps
    assert eng.stats.steps - steps_before == 2 + NEW - 1


def test_preemption_under_a_small_pool_gives_the_same_tokens(small_llm, ref):
    eng = small_llm.engine
    assert eng.pool.num_pages == SMALL_POOL
    before = eng.scheduler.num_preemptions
    outs = small_llm.generate(PROMPTS, greedy())
    assert eng.scheduler.num_preemptions > before
    for prompt, out in zip(PROMPTS, outs):
        assert out.finish_reason == "length"
        assert out.token_ids == ref[prompt], prompt


def test_attention_backends_torch_and_sdpa_agree(llm, small_llm, ref):
    ops = torch.ops.autodeploy
    assert count_op(llm.build.graph_module, ops.sdpa_cached_attention_with_cache) == 2  # the default backend
    assert count_op(small_llm.build.graph_module, ops.torch_cached_attention_with_cache) == 2
    assert count_op(small_llm.build.graph_module, ops.sdpa_cached_attention_with_cache) == 0
    eng = small_llm.engine
    before = eng.scheduler.num_preemptions
    short = [p for p in PROMPTS if len(ids_of(small_llm, p)) <= 16]  # one prefill step each
    assert len(short) == 3
    outs = small_llm.generate(short, greedy())  # 5 + 5 + 7 pages: no preemption
    assert eng.scheduler.num_preemptions == before
    assert [o.token_ids for o in outs] == [ref[p] for p in short]


# ---- (d) bad requests ----------------------------------------------------------------------------
def test_bad_requests_raise_and_leave_running_requests_alone(llm, ref):
    eng = llm.engine
    good = {eng.add_request(prep(llm, p, greedy())): p for p in PROMPTS[:2]}
    for _ in range(3):
        eng.step()
    in_flight = set(eng.requests)
    free = eng.num_free_pages
    ok = greedy(4)
    with pytest.raises(InvalidRequestError, match="max_seq_len") as err:
        llm.processor.prepare([5] * 64, ok)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.processor.prepare([], ok)
    with pytest.raises(InvalidRequestError, match=r"token ids must be in \[0, 512\)"):
        llm.processor.prepare([5, 512], ok)
    with pytest.raises(InvalidRequestError, match=r"token ids must be in \[0, 512\)"):
        llm.processor.prepare({"prompt_token_ids": [-1, 5]}, ok)
    with pytest.raises(InvalidRequestError, match="integers"):
        llm.processor.prepare([5, True], ok)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        greedy(4).top_p = 2.0  # parameters cannot change after they were checked
    with pytest.raises(TypeError, match="PreparedRequest"):
        eng.add_request([5, 6])  # the engine only takes checked requests
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request(prep(llm, [5, 6], ok), request_id=next(iter(good)))
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llm.generate(["x", PROMPTS[2] * 8], ok)  # the second prompt is too long
    with pytest.raises(InvalidRequestError, match="prompt 1.*empty"):
        llm.generate(["x", {"prompt_token_ids": []}], ok)
    with pytest.raises(InvalidRequestError, match="prompt 1.*empty"):
        llm.generate(["x", ""], ok)  # empty text: refused before the tokenizer's BOS makes it one token
    with pytest.raises(InvalidRequestError, match="prompt 0"):
        llm.generate([42], ok)
    assert set(eng.requests) == in_flight
    assert eng.num_free_pages == free
    finals = eng.run_until_done(list(good))
    for rid, prompt in good.items():
        assert finals[rid].token_ids == ref[prompt]


@pytest.mark.parametrize("value, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(n=0), "n must"), (dict(logprobs=21), "logprobs"), (dict(stop=""), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(seed=1.5), "seed"),
    (dict(min_tokens=-1), "min_tokens"), (dict(max_tokens=4, min_tokens=5), "must not exceed max_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(logit_bias={-1: 1.0}), "logit_bias must map token ids"), (dict(logit_bias={3: 101}), "logit_bias values"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty"),
    (dict(allowed_token_ids=[3], guided={"choice": ["a"]}), "give one of them"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be"),
])
def test_sampling_params_validate_on_construction(value, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**value)


def test_generate_rejects_an_out_of_vocab_prompt_before_queueing_any(llm):
    """``generate`` promises to raise, naming the prompt, before any prompt of the call is queued."""
    eng = llm.engine
    try:
        with pytest.raises(InvalidRequestError, match="prompt 1"):
            llm.generate(["x", {"prompt_token_ids": [5, 512]}], greedy(4))
        assert not eng.has_unfinished(), "prompt 0 was queued and left behind"
    finally:
        for rid in list(eng.requests):
            eng.abort(rid)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, ref):
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens run (its text is then not
    the given one); -1 keeps what max_seq_len leaves room for, so a prompt too long otherwise runs."""
    ids = llm.tokenizer(PROMPTS[2])["input_ids"]
    (out,) = llm.generate([PROMPTS[2]], greedy(truncate_prompt_tokens=3))
    (alone,) = llm.generate([{"prompt_token_ids": ids[-3:]}], greedy())
    assert out.prompt_token_ids == ids[-3:] and out.prompt is None and out.token_ids == alone.token_ids
    (short,) = llm.generate([PROMPTS[2]], greedy(truncate_prompt_tokens=len(ids) + 5))  # shorter: unchanged
    assert short.prompt_token_ids == ids and short.token_ids == ref[PROMPTS[2]]
    long = [5] * (2 * llm.engine.max_seq_len)
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        llm.generate([{"prompt_token_ids": long}], greedy(2))
    (fits,) = llm.generate([{"prompt_token_ids": long}], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    assert len(fits.prompt_token_ids) == llm.engine.max_seq_len - 1 and len(fits.token_ids) == 1


def test_out_of_vocab_allowed_token_ids_are_refused(llm):
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids must be in \[0, 512\)"):
        llm.generate(["x"], greedy(allowed_token_ids=[3, 512]))


def test_priority_scheduling_serves_the_most_urgent_first(ref):
    """``scheduling_policy='priority'`` (vLLM's): one sequence at a time, the lower priority value
    runs first whatever the order of arrival; tokens are those of each prompt alone."""
    urgent_llm = LLM("tiny-llama", **{**BASE, "max_batch_size": 1}, scheduling_policy="priority")
    eng, finished = urgent_llm.engine, []
    prompts = PROMPTS[:3]
    ids = [eng.add_request(urgent_llm.processor.prepare(p, greedy(), priority=prio))
           for p, prio in zip(prompts, (2, 0, 1))]
    while eng.has_unfinished():
        finished += [out.request_id for out in eng.step()]
    assert finished == [ids[1], ids[2], ids[0]]
    outs = urgent_llm.generate(prompts, greedy(), priority=[2, 0, 1])  # in prompt order
    assert [o.token_ids for o in outs] == [ref[p] for p in prompts]


def test_a_priority_needs_the_priority_policy(llm):
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'"):
        llm.generate(PROMPTS[:2], greedy(), priority=[0, 1])
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'"):
        llm.engine.add_request(llm.processor.prepare(PROMPTS[0], greedy(), priority=3))
    with pytest.raises(InvalidRequestError, match="2 prompts but 1 priorities"):
        llm.generate(PROMPTS[:2], greedy(), priority=[0])
    assert [o.token_ids for o in llm.generate(PROMPTS[:1], greedy(), priority=[0])]  # 0 is the default


# ---- (e) stop conditions -------------------------------------------------------------------------
def test_max_tokens_finishes_with_length(llm, ref):
    (out,) = llm.generate([PROMPTS[0]], greedy(5))
    assert out.token_ids == ref[PROMPTS[0]][:5] and out.finish_reason == "length"


def test_stop_token_id_ends_the_output_with_it(llm, ref):
    tokens = ref[PROMPTS[2]]
    k = next(i for i in range(3, NEW) if tokens[i] not in tokens[:i])
    (out,) = llm.generate([PROMPTS[2]], greedy(stop_token_ids=[tokens[k]]))
    assert out.token_ids == tokens[: k + 1]
    assert out.token_ids[-1] == tokens[k]
    assert out.finish_reason == "stop"
    # its text is not part of the output unless include_stop_str_in_output (vLLM's rule)
    tok = llm.tokenizer
    assert tok.decode(tokens[k]) and out.text == tok.decode(tokens[:k])
    (kept,) = llm.generate([PROMPTS[2]], greedy(stop_token_ids=[tokens[k]], include_stop_str_in_output=True))
    assert kept.token_ids == out.token_ids and kept.text == tok.decode(tokens[: k + 1])


def test_min_tokens_holds_stop_strings_and_stop_token_ids_off_until_then(llm, ref):
    """A stop string met early ends nothing before ``min_tokens`` tokens (the text goes on as
    before), and a stop token id cannot even be sampled until then (vLLM's min_tokens)."""
    tok = llm.tokenizer
    tokens = ref[PROMPTS[2]]
    early = tok.decode(tokens[:2], skip_special_tokens=True).strip()
    assert early, "the first two greedy tokens decode to nothing: choose another prompt"
    (plain,) = llm.generate([PROMPTS[2]], greedy(stop=[early]))
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 6
    (held,) = llm.generate([PROMPTS[2]], greedy(stop=[early], min_tokens=6))
    assert held.token_ids == tokens[:len(held.token_ids)] and len(held.token_ids) >= 6
    (held,) = llm.generate([PROMPTS[2]], greedy(stop_token_ids=[tokens[1]], min_tokens=NEW))
    assert held.finish_reason == "length" and len(held.token_ids) == NEW
    assert held.token_ids[0] == tokens[0] and held.token_ids[1] != tokens[1] and tokens[1] not in held.token_ids


def test_skip_special_tokens_false_keeps_their_text_but_not_the_eos_that_ends(llm, ref):
    tok = llm.tokenizer
    tokens = ref[EOS_PROMPT]
    k = tokens.index(tok.eos_token_id)
    (ignored,) = llm.generate([EOS_PROMPT], greedy(skip_special_tokens=False))  # (greedy: ignore_eos)
    assert ignored.token_ids == tokens
    assert ignored.text == tok.decode(tokens, skip_special_tokens=False) != tok.decode(tokens, skip_special_tokens=True)
    # ended by EOS: its text is not part of the output (vLLM's rule), unless include_stop_str_in_output
    (stopped,) = llm.generate([EOS_PROMPT], greedy(ignore_eos=False, skip_special_tokens=False))
    assert stopped.token_ids == tokens[:k + 1] and stopped.text == tok.decode(tokens[:k], skip_special_tokens=False)
    (kept,) = llm.generate([EOS_PROMPT], greedy(ignore_eos=False, skip_special_tokens=False,
                                                include_stop_str_in_output=True))
    assert kept.text == tok.decode(tokens[:k + 1], skip_special_tokens=False) and kept.text.endswith(tok.eos_token)
    user = tok.convert_tokens_to_ids("<|user|>")  # a special token in the middle of the output
    for skip, text in ((False, "<|user|>" * 3), (True, "")):
        (forced,) = llm.generate(["hi"], greedy(3, logit_bias={user: 100}, skip_special_tokens=skip))
        assert forced.token_ids == [user] * 3 and forced.text == text


def test_include_stop_str_in_output_keeps_the_stop_string(llm, ref):
    tok = llm.tokenizer
    full = tok.decode(ref[PROMPTS[2]], skip_special_tokens=True)
    start = next(i for i in range(4, len(full) - 3) if full[i:i + 3].isascii() and full[i:i + 3].isalpha())
    stop = full[start:start + 3]
    (out,) = llm.generate([PROMPTS[2]], greedy(stop=["\x00never", stop], include_stop_str_in_output=True))
    assert (out.finish_reason, out.text) == ("stop", full[:full.find(stop) + len(stop)])


def test_stop_string_cuts_the_text_before_it(llm, ref):
    tok = llm.tokenizer
    tokens = ref[PROMPTS[2]]
    full = tok.decode(tokens, skip_special_tokens=True)
    # a plain-letters stretch of the greedy text, some way in
    start = next(i for i in range(4, len(full) - 3) if full[i:i + 3].isascii() and full[i:i + 3].isalpha())
    stop = full[start:start + 3]
    cut = full.find(stop)
    (out,) = llm.generate([PROMPTS[2]], greedy(stop=[stop, "\x00never"]))
    assert out.finish_reason == "stop"
    assert out.text == full[:cut]
    assert stop not in out.text
    # it stopped at the first token whose text contains the stop string
    assert out.token_ids == tokens[: len(out.token_ids)]
    assert stop in tok.decode(out.token_ids, skip_special_tokens=True)
    assert stop not in tok.decode(out.token_ids[:-1], skip_special_tokens=True)


def test_eos_stops_unless_ignore_eos(llm, ref):
    eos = sorted(llm.engine.eos_token_ids)
    assert eos == [llm.tokenizer.eos_token_id]
    tokens = ref[EOS_PROMPT]
    assert any(t in eos for t in tokens), "precondition: the preset emits EOS for this prompt"
    k = next(i for i, t in enumerate(tokens) if t in eos)
    (stopped,) = llm.generate([EOS_PROMPT], greedy(ignore_eos=False))
    assert stopped.token_ids == tokens[: k + 1] and stopped.finish_reason == "stop"
    assert stopped.text == llm.tokenizer.decode(tokens[:k], skip_special_tokens=True)
    (ignored,) = llm.generate([EOS_PROMPT], greedy(ignore_eos=True))
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_generation_stops_at_max_seq_len(llm):
    prompt = ids_of(llm, LONG)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy(1000))
    assert len(prompt) + len(out.token_ids) == BASE["max_seq_len"]
    assert out.finish_reason == "length"
    (out,) = llm.generate([{"prompt_token_ids": [7] * 63}], greedy(10))  # the longest prompt allowed
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


# ---- (f) sampling --------------------------------------------------------------------------------
SAMPLED = 8


def sampled(seed, **kw):
    return SamplingParams(max_tokens=SAMPLED, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def test_seeds_make_sampling_reproducible(llm, ref):
    (a,) = llm.generate([PROMPTS[0]], sampled(7))
    (b,) = llm.generate([PROMPTS[0]], sampled(7))
    (c,) = llm.generate([PROMPTS[0]], sampled(8))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    assert a.token_ids != ref[PROMPTS[0]][:SAMPLED]  # actually sampled
    # the seed fixes the request's tokens whatever else is in the batch
    batched = llm.generate(PROMPTS, [greedy(), sampled(7), greedy(), greedy()])
    (alone,) = llm.generate([PROMPTS[1]], sampled(7))
    assert batched[1].token_ids == alone.token_ids
    assert batched[0].token_ids == ref[PROMPTS[0]]


def test_top_k_1_at_temperature_1_is_greedy(llm, ref):
    (out,) = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=NEW, temperature=1.0, top_k=1, ignore_eos=True))
    assert out.token_ids == ref[PROMPTS[2]]


def test_n_completions(llm, ref):
    (out,) = llm.generate([PROMPTS[0]], sampled(3, n=3))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == SAMPLED and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    (again,) = llm.generate([PROMPTS[0]], sampled(3, n=3))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    (g,) = llm.generate([PROMPTS[1]], greedy(n=3))
    assert [c.token_ids for c in g.outputs] == [ref[PROMPTS[1]]] * 3


def test_logprobs_per_token_with_chosen_first(llm, ref):
    (out,) = llm.generate([PROMPTS[0]], greedy(8, logprobs=2))
    assert out.token_ids == ref[PROMPTS[0]][:8]
    lps = out.outputs[0].logprobs
    assert len(lps) == 8
    for token, d in zip(out.token_ids, lps):
        assert next(iter(d)) == token
        assert len(d) == 2  # greedy: the chosen token is the top one, plus one alternative
        assert all(v <= 0 for v in d.values())
        assert d[token] == max(d.values())
    (s,) = llm.generate([PROMPTS[0]], sampled(5, logprobs=3))
    for token, d in zip(s.token_ids, s.outputs[0].logprobs):
        assert next(iter(d)) == token and len(d) in (3, 4)
    (plain,) = llm.generate([PROMPTS[0]], greedy(4))
    assert plain.outputs[0].logprobs is None


def test_logprobs_match_a_full_forward(llm, ref):
    """The chosen token's log probability equals log_softmax of the HF model's logits (same weights)."""
    from transformers import AutoModelForCausalLM

    from autodeploy.models.presets import preset_dir

    (out,) = llm.generate([PROMPTS[2]], greedy(4, logprobs=0))
    model = AutoModelForCausalLM.from_pretrained(preset_dir("tiny-llama"), dtype=torch.float32).eval()
    ids = torch.tensor([ids_of(llm, PROMPTS[2]) + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    p = len(ids_of(llm, PROMPTS[2]))
    for i, (token, d) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
        assert list(d) == [token]
        assert d[token] == pytest.approx(float(logp[p - 1 + i, token]), abs=1e-3)


# ---- (g) abort -----------------------------------------------------------------------------------
def test_abort_frees_pages_immediately(llm, ref):
    eng = llm.engine
    total = eng.pool.num_pages
    keep = eng.add_request(prep(llm, PROMPTS[1], greedy()))
    drop = eng.add_request(prep(llm, PROMPTS[2], greedy(40)))
    for _ in range(4):
        eng.step()
    with_both = eng.num_free_pages
    assert eng.abort(drop) is True
    assert eng.num_free_pages > with_both
    assert drop not in eng.requests
    assert eng.abort(drop) is False and eng.abort("no-such-request") is False
    final = eng.run_until_done([keep])
    assert final[keep].token_ids == ref[PROMPTS[1]]
    assert eng.num_free_pages == total
    # aborting a running request alone returns every page at once
    rid = eng.add_request(prep(llm, PROMPTS[0], greedy()))
    eng.step()
    eng.step()
    assert eng.num_free_pages < total
    eng.abort(rid)
    assert eng.num_free_pages == total and not eng.has_unfinished()
    # and a request still waiting (never scheduled)
    rid = eng.add_request(prep(llm, PROMPTS[0], greedy()))
    eng.abort(rid)
    assert not eng.has_unfinished() and eng.step() == []


def test_aborted_request_reports_abort(llm):
    eng = llm.engine
    seen = []
    rid = eng.add_request(prep(llm, PROMPTS[0], greedy()), on_update=seen.append)
    eng.step()
    eng.abort(rid)
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert len(seen[-1].token_ids) == 1


# ---- (h) streaming -------------------------------------------------------------------------------
def test_stream_grows_one_token_at_a_time(llm, ref):
    outs = list(llm.stream(PROMPTS[0], greedy(8)))
    assert [len(o.token_ids) for o in outs] == list(range(1, 9))
    for prev, cur in zip(outs, outs[1:]):
        assert cur.token_ids[: len(prev.token_ids)] == prev.token_ids
    assert [o.finished for o in outs] == [False] * 7 + [True]
    (gen,) = llm.generate([PROMPTS[0]], greedy(8))
    assert outs[-1].token_ids == gen.token_ids and outs[-1].text == gen.text
    assert outs[-1].finish_reason == "length"


def test_closing_a_stream_early_aborts_the_request(llm):
    it = llm.stream(PROMPTS[0], greedy(30))
    next(it)
    next(it)
    assert llm.engine.has_unfinished()
    it.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.num_free_pages == llm.engine.pool.num_pages


# ---- (i) defaults, (j) chat, (k) token-id prompts ------------------------------------------------
def test_default_sampling_params_come_from_generation_config(llm):
    assert llm.generation_config.get("do_sample") is False
    defaults = llm.get_default_sampling_params()
    assert defaults.greedy and defaults.max_tokens == 16
    (out,) = llm.generate(PROMPTS[0])
    (explicit,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0))
    assert out.token_ids == explicit.token_ids and len(out.token_ids) == 16
    (again,) = llm.generate(PROMPTS[0])
    assert again.token_ids == out.token_ids


def test_default_repetition_penalty_comes_from_generation_config(llm):
    """As HF's generate: a generation_config.json repetition_penalty applies, greedy or not."""
    llm.generation_config["repetition_penalty"] = 1.8
    try:
        assert llm.get_default_sampling_params().repetition_penalty == 1.8
        (out,) = llm.generate(PROMPTS[0])
    finally:
        del llm.generation_config["repetition_penalty"]
    (explicit,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.8))
    (plain,) = llm.generate(PROMPTS[0])
    assert out.token_ids == explicit.token_ids != plain.token_ids


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text and "hi" in text
    assert out.prompt_token_ids == llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(out.token_ids) == 6
    (same,) = llm.generate([{"prompt_token_ids": out.prompt_token_ids}], greedy(6))
    assert same.token_ids == out.token_ids
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]],
                   SamplingParams(max_tokens=3, temperature=0))
    assert len(two) == 2 and two[0].token_ids == out.token_ids[: len(two[0].token_ids)]


def test_chat_renders_tools(llm):
    """``tools`` reach the template (the presets' shows them and asks for Hermes-style calls)."""
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    text = llm.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '{"name": "f"' in text and "<tool_call>" in text
    assert llm.processor.chat_prompt(messages, tools=tools)["prompt"] == text
    n = len(llm.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert n > BASE["max_seq_len"]  # this engine's context is too short for tools: LLM.chat says so
    with pytest.raises(InvalidRequestError, match=f"prompt has {n} tokens"):
        llm.chat(messages, SamplingParams(max_tokens=1), tools=tools)


def test_chat_template_replaces_the_tokenizers(tmp_path):
    """``chat_template`` (text or a file) is what ``chat`` renders with; the tokenizer's own is
    not used."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>>"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    messages = [{"role": "user", "content": "hi"}]
    other = LLM("tiny-llama", **BASE, chat_template=str(path))
    (out,) = other.chat(messages, SamplingParams(max_tokens=1, temperature=0))
    assert out.prompt == "[user] hi\n>>"
    assert read_chat_template(template) == read_chat_template(str(path)) == template


def test_a_chat_calls_own_template_replaces_the_deployments(llm):
    """``LLM.chat(chat_template=...)`` (vLLM's argument): these conversations only."""
    messages = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0),
                      chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}::")
    assert out.prompt == "<user>hi::"
    (again,) = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0))
    assert again.prompt == llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("given, message", [
    ("/no/such/template.jinja", "neither a file nor Jinja template text"),
    ("{% for m in messages %}", "not a valid Jinja template"),
])
def test_a_bad_chat_template_is_a_config_error(given, message):
    with pytest.raises(ConfigError, match=message):
        LLM("tiny-llama", **BASE, chat_template=given)


def test_chat_rejects_an_empty_conversation(llm):
    with pytest.raises(InvalidRequestError, match="no messages"):
        llm.chat([[]])
    with pytest.raises(InvalidRequestError, match="conversation 1"):
        llm.chat([[{"role": "user", "content": "hi"}], []])


def test_chat_rejects_an_empty_message_list(llm):
    with pytest.raises(InvalidRequestError):
        llm.chat([])


def test_prompt_token_ids_dict(llm, ref):
    ids = ids_of(llm, PROMPTS[2])
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids, "prompt": "named"}], greedy())
    assert [o.token_ids for o in outs] == [ref[PROMPTS[2]]] * 2
    assert outs[0].prompt is None and outs[1].prompt == "named"
    assert outs[0].prompt_token_ids == ids
    (text_dict,) = llm.generate([{"prompt": PROMPTS[2]}], greedy())
    assert text_dict.token_ids == ref[PROMPTS[2]]
