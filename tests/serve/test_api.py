"""The OpenAI-compatible endpoints give what the Python API gives, streamed or not.

A real ``autodeploy serve`` process on loopback, the official ``openai`` client and raw
``httpx``; the reference is ``LLM("tiny-llama", max_seq_len=128)`` in this process.
"""

from collections import Counter, defaultdict

import httpx
import pytest

from autodeploy import SamplingParams

from serve_utils import LONG_PROMPT, MAX_SEQ_LEN, SERVED_NAME, json_events, parse_prometheus, sse_events

PROMPTS = ["The quick brown fox", "def add(a, b):"]
CHAT = "Write a haiku about the sea."
MAX_TOKENS = 10
# (temperature, seed): greedy, and seeded sampling
SAMPLING = [pytest.param(0.0, None, id="greedy"), pytest.param(0.8, 1234, id="seeded-t0.8")]


def _ref(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0]


def _ref_chat(llm, content, **kw):
    return llm.chat([{"role": "user", "content": content}], SamplingParams(**kw))[0]


def _sampling_kwargs(temperature, seed):
    kw = {"temperature": temperature}
    if seed is not None:
        kw["seed"] = seed
    return kw


# ---- vLLM's sampling extensions ------------------------------------------------------------------
def test_bad_words_as_llm_generate_does(server, llm):
    """vLLM's ``bad_words`` (a 400 before)."""
    plain = _ref(llm, PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # a token of the answer that is a space and a word: the word is banned as " word" too
    word = next(w.strip() for w in map(lambda t: llm.tokenizer.decode([t]), plain.token_ids)
                if w.startswith(" ") and w.strip().isalpha())
    ref = _ref(llm, PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, bad_words=[word])
    assert ref.token_ids != plain.token_ids
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "bad_words": [word]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.text


def test_allowed_token_ids_as_llm_generate_does(server, llm):
    """vLLM's ``allowed_token_ids`` (a 400 before), sampled and greedy, completions and chat."""
    allowed = [7, 300, 301, 377]
    for kw in ({"temperature": 0.0}, {"temperature": 1.2, "seed": 5}):
        ref = _ref(llm, PROMPTS[0], max_tokens=MAX_TOKENS, allowed_token_ids=allowed, **kw)
        assert set(ref.token_ids) <= set(allowed)
        r = server.http().post("/v1/completions", json={"model": SERVED_NAME, "prompt": PROMPTS[0],
                                                        "max_tokens": MAX_TOKENS, "allowed_token_ids": allowed, **kw})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text
    ref = _ref_chat(llm, CHAT, max_tokens=MAX_TOKENS, temperature=0, allowed_token_ids=allowed)
    r = server.http().post("/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": [{"role": "user", "content": CHAT}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "allowed_token_ids": allowed})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text


@pytest.mark.parametrize("keep", [3, -1])
def test_truncate_prompt_tokens_as_llm_generate_does(server, llm, keep):
    """vLLM's ``truncate_prompt_tokens`` (a 400 before): the prompt's last tokens only; -1: as many
    as the context leaves room for (here the long prompt, over the context, then fits)."""
    prompt = PROMPTS[0] if keep > 0 else " ".join(["sea"] * 2 * MAX_SEQ_LEN)
    ids = llm.tokenizer(prompt)["input_ids"]
    kept = ids[-keep:] if keep > 0 else ids[len(ids) - (MAX_SEQ_LEN - 1):]
    assert len(kept) < len(ids)
    ref = _ref(llm, {"prompt_token_ids": kept}, max_tokens=1, temperature=0)
    r = server.http().post("/v1/completions", json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1,
                                                    "temperature": 0, "truncate_prompt_tokens": keep, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(kept)
    assert body["choices"][0]["text"] == llm.tokenizer.decode(kept) + ref.text  # the prompt that ran, echoed


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_as_llm_generate_does(server, llm, skip):
    """vLLM's ``skip_special_tokens``: false puts special tokens in the text (a 400 before)."""
    user = llm.tokenizer.convert_tokens_to_ids("<|user|>")
    kw = dict(max_tokens=3, temperature=0.0, logit_bias={user: 100}, skip_special_tokens=skip)
    ref = _ref(llm, PROMPTS[0], **kw)
    body = {"model": SERVED_NAME, "prompt": PROMPTS[0], **kw, "logit_bias": {str(user): 100}}
    for path, text_of in (("/v1/completions", lambda c: c["text"]), ("/v1/chat/completions",
                                                                      lambda c: c["message"]["content"])):
        fields = body if path == "/v1/completions" else {**body, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{server.url}{path}", json=fields, timeout=60)
        assert r.status_code == 200, r.text
        assert text_of(r.json()["choices"][0]) == ref.text == ("" if skip else "<|user|>" * 3)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_end_the_output_as_llm_generate_does(server, llm, stream):
    """``stop_token_ids``: the output ends at (and with) the first of them, as the Python API's
    ``SamplingParams.stop_token_ids`` does (it was accepted and ignored before)."""
    tokens = _ref(llm, PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0).token_ids
    k = next(i for i in range(2, MAX_TOKENS) if tokens[i] not in tokens[:i])
    ref = _ref(llm, PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[tokens[k]])
    assert (len(ref.token_ids), ref.finish_reason) == (k + 1, "stop")
    body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stop_token_ids": [tokens[k]], "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    if stream:
        events = json_events(sse_events(r.text.splitlines()))
        text = "".join(c["text"] for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        usage = events[-1]["usage"]
    else:
        out = r.json()
        text, finish, usage = out["choices"][0]["text"], [out["choices"][0]["finish_reason"]], out["usage"]
    assert (text, finish, usage["completion_tokens"]) == (ref.text, ["stop"], k + 1)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_as_llm_generate(server, llm, stream):
    full = _ref(llm, PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0).text
    start = next(i for i in range(2, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].strip())
    stop = full[start:start + 2]
    ref = _ref(llm, PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop], include_stop_str_in_output=True)
    assert ref.text.endswith(stop) and ref.finish_reason == "stop"
    body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop],
            "include_stop_str_in_output": True, "stream": stream}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    if stream:
        text = "".join(c["text"] for e in json_events(sse_events(r.text.splitlines())) for c in e["choices"])
    else:
        text = r.json()["choices"][0]["text"]
    assert text == ref.text


@pytest.mark.parametrize("extra", [
    dict(frequency_penalty=-2.0), dict(presence_penalty=-2.0), dict(repetition_penalty=0.5),
    dict(min_tokens=MAX_TOKENS, temperature=0.8, seed=7, min_p=0.2), dict(logit_bias={"77": 100, "5": -100}),
], ids=["frequency", "presence", "repetition", "min-tokens-min-p-seeded", "logit-bias"])
def test_penalties_min_p_and_min_tokens_as_llm_generate(server, llm, extra):
    """The penalties, ``min_p`` and ``min_tokens`` reach the engine: the server's answer is the
    Python API's with the same parameters (and, greedy, not the answer without them: negative
    penalties, which favour repeats, change these 10 tokens where positive ones need a repeat)."""
    kw = {"temperature": 0.0, **extra}
    api = {**kw, "logit_bias": {int(t): b for t, b in kw["logit_bias"].items()}} if "logit_bias" in kw else kw
    ref = _ref(llm, PROMPTS[1], max_tokens=MAX_TOKENS, **api)
    if kw["temperature"] == 0:
        assert ref.token_ids != _ref(llm, PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0).token_ids
    out = httpx.post(f"{server.url}/v1/completions", timeout=60,
                     json={"model": SERVED_NAME, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, **kw}).json()
    assert (out["choices"][0]["text"], out["usage"]["completion_tokens"]) == (ref.text, len(ref.token_ids))
    if "min_tokens" in extra:
        assert len(ref.token_ids) == MAX_TOKENS


# ---- completions -------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,seed", SAMPLING)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_llm_generate(server, llm, prompt, temperature, seed):
    ref = _ref(llm, prompt, max_tokens=MAX_TOKENS, **_sampling_kwargs(temperature, seed))
    client = server.client()
    res = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                    **_sampling_kwargs(temperature, seed))
    assert res.object == "text_completion"
    assert res.model == SERVED_NAME
    assert len(res.choices) == 1
    choice = res.choices[0]
    assert choice.index == 0
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert res.usage.prompt_tokens == len(llm.tokenizer(prompt)["input_ids"]) == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == len(ref.token_ids)
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens

    # streamed: the deltas concatenate to the same text; one final chunk; usage at the end
    stream = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                       stream_options={"include_usage": True},
                                       **_sampling_kwargs(temperature, seed))
    text, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index == 0
            text.append(c.text)
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
    assert "".join(text) == ref.text
    assert finishes == [ref.finish_reason]
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))


@pytest.mark.parametrize("stream_options", [None, {"include_usage": False}, {"include_usage": True}],
                         ids=["no-options", "usage-false", "usage-true"])
def test_completion_stream_raw_sse_ends_with_done(server, llm, stream_options):
    """The usage chunk comes only when asked for (``stream_options.include_usage``), as OpenAI's."""
    ref = _ref(llm, PROMPTS[0], max_tokens=6, temperature=0)
    body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "stream": True}
    if stream_options is not None:
        body["stream_options"] = stream_options
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    chunks = json_events(events)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ref.text
    assert all(c["object"] == "text_completion" and c["model"] == SERVED_NAME for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    usage = [c["usage"] for c in chunks if "usage" in c]
    if stream_options and stream_options["include_usage"]:
        assert usage == [{"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": len(ref.token_ids),
                          "total_tokens": len(ref.prompt_token_ids) + len(ref.token_ids)}]
        assert chunks[-1]["choices"] == []  # the usage chunk is the last one, with no choices
    else:
        assert usage == [] and all(c["choices"] for c in chunks)


def test_long_prompt_does_not_stop_early(llm):
    """The disconnect/shutdown tests rely on this prompt generating without hitting EOS."""
    ref = _ref(llm, LONG_PROMPT, max_tokens=100, temperature=0)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 100


# ---- chat --------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,seed", SAMPLING)
def test_chat_matches_llm_chat(server, llm, temperature, seed):
    ref = _ref_chat(llm, CHAT, max_tokens=MAX_TOKENS, **_sampling_kwargs(temperature, seed))
    client = server.client()
    messages = [{"role": "user", "content": CHAT}]
    res = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                         **_sampling_kwargs(temperature, seed))
    assert res.object == "chat.completion"
    assert len(res.choices) == 1
    msg = res.choices[0].message
    assert msg.role == "assistant"
    assert msg.content == ref.text
    assert res.choices[0].finish_reason == ref.finish_reason
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == len(ref.token_ids)
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens

    stream = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                            stream=True, stream_options={"include_usage": True},
                                            **_sampling_kwargs(temperature, seed))
    text, roles, finishes, usage = [], [], [], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                text.append(c.delta.content)
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
    assert roles == ["assistant"]
    assert "".join(text) == ref.text
    assert finishes == [ref.finish_reason]
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))


def test_chat_stream_raw_sse_ends_with_done(server, llm):
    ref = _ref_chat(llm, CHAT, max_tokens=5, temperature=0)
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": CHAT}], "max_tokens": 5,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = json_events(events)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == ref.text


# ---- n, logprobs, echo, stop -------------------------------------------------------------------
def test_completion_n2_matches_llm(server, llm):
    ref = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=2))[0]
    res = server.client().completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=6,
                                             temperature=0.8, seed=7, n=2)
    assert sorted(c.index for c in res.choices) == [0, 1]
    by_index = {c.index: c for c in res.choices}
    for out in ref.outputs:
        assert by_index[out.index].text == out.text
        assert by_index[out.index].finish_reason == out.finish_reason
    assert res.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_n2(server, llm):
    ref = llm.chat([{"role": "user", "content": CHAT}], SamplingParams(max_tokens=5, temperature=0.8, seed=11, n=2))[0]
    res = server.client().chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": CHAT}],
                                                  max_tokens=5, temperature=0.8, seed=11, n=2)
    assert sorted(c.index for c in res.choices) == [0, 1]
    for c in res.choices:
        assert c.message.content == ref.outputs[c.index].text


_UNEVEN = {}


def _seed_with_uneven_finish(llm, chat: bool):
    """A seed for which the two sampled choices (8 tokens at most) finish at different steps
    (one hits EOS first), for LONG_PROMPT as a completion prompt or as a chat message."""
    if chat not in _UNEVEN:
        _UNEVEN[chat] = None
        for seed in range(40):
            params = SamplingParams(max_tokens=8, temperature=0.8, seed=seed, n=2)
            if chat:
                out = llm.chat([{"role": "user", "content": LONG_PROMPT}], params)[0]
            else:
                out = llm.generate(LONG_PROMPT, params)[0]
            if len(out.outputs[0].token_ids) != len(out.outputs[1].token_ids):
                _UNEVEN[chat] = (seed, out)
                break
    # Model, prompt and seeds are fixed by the suite, so finding no such seed is a change in what the
    # model generates (or in seeded sampling), not an environment the test may skip in.
    assert _UNEVEN[chat] is not None, (
        f"precondition: no seed in range(40) makes the two sampled choices for LONG_PROMPT "
        f"({'chat' if chat else 'completion'}) finish at different steps; pick another prompt or seed range")
    return _UNEVEN[chat]


def _stream_n2(server, path, body):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}{path}", json=body) as r:
            assert r.status_code == 200
            events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    return json_events(events)


def test_completion_stream_n2_deltas_concatenate(server, llm):
    seed, ref = _seed_with_uneven_finish(llm, chat=False)
    chunks = _stream_n2(server, "/v1/completions", {"model": SERVED_NAME, "prompt": LONG_PROMPT, "max_tokens": 8,
                                                    "temperature": 0.8, "seed": seed, "n": 2, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    texts = defaultdict(str)
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
    assert dict(texts) == {o.index: o.text for o in ref.outputs}
    usage = [ch["usage"] for ch in chunks if ch.get("usage")][-1]
    assert usage["completion_tokens"] == sum(len(o.token_ids) for o in ref.outputs)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_n2_one_finish_chunk_per_choice(server, llm, path):
    """A choice that finishes early sends exactly one final chunk, not one per later step."""
    seed, _ = _seed_with_uneven_finish(llm, chat=path.endswith("chat/completions"))
    body = {"model": SERVED_NAME, "max_tokens": 8, "temperature": 0.8, "seed": seed, "n": 2, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = LONG_PROMPT
    else:
        body["messages"] = [{"role": "user", "content": LONG_PROMPT}]
    chunks = _stream_n2(server, path, body)
    finishes = Counter(c["index"] for ch in chunks for c in ch["choices"] if c["finish_reason"] is not None)
    assert finishes == {0: 1, 1: 1}


def test_completion_logprobs(server, llm):
    ref = _ref(llm, PROMPTS[1], max_tokens=6, temperature=0, logprobs=2)
    res = server.client().completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=6,
                                             temperature=0, logprobs=2)
    lp = res.choices[0].logprobs
    out = ref.outputs[0]
    n = len(out.token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for i, (tid, step) in enumerate(zip(out.token_ids, out.logprobs)):
        chosen_id, chosen_lp = next(iter(step.items()))
        assert chosen_id == tid
        assert lp.tokens[i] == llm.tokenizer.decode([tid])
        assert lp.token_logprobs[i] == pytest.approx(chosen_lp, abs=1e-4)
        assert lp.token_logprobs[i] <= 0
        top = lp.top_logprobs[i]
        assert next(iter(top)) == lp.tokens[i]  # the chosen token first
        assert 1 <= len(top) <= 3  # chosen + up to 2 alternatives
    # greedy: the chosen token is the most likely one
    for i in range(n):
        assert lp.token_logprobs[i] >= max(lp.top_logprobs[i].values()) - 1e-4

    # streamed: the per-chunk logprobs concatenate to the same tokens and values
    stream = server.client().completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=6,
                                                temperature=0, logprobs=2, stream=True)
    tokens, values = [], []
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert tokens == lp.tokens
    assert values == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_completion_stream_logprobs_text_offset(server):
    body = {"model": SERVED_NAME, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 1}
    with httpx.Client(timeout=60) as http:
        full = http.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["logprobs"]
        with http.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
            chunks = json_events(sse_events(list(r.iter_lines())))
    offsets = [o for ch in chunks for c in ch["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert len(offsets) == len(full["text_offset"]) > 1
    assert offsets == full["text_offset"]


def test_chat_logprobs(server, llm):
    ref = _ref_chat(llm, CHAT, max_tokens=4, temperature=0, logprobs=2)
    res = server.client().chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": CHAT}],
                                                  max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = res.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids)
    for entry, tid, step in zip(content, ref.token_ids, ref.outputs[0].logprobs):
        assert entry.token == llm.tokenizer.decode([tid])
        assert entry.logprob == pytest.approx(step[tid], abs=1e-4)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_echo(server, llm, stream):
    prompt = PROMPTS[0]
    ref = _ref(llm, prompt, max_tokens=5, temperature=0)
    client = server.client()
    if stream:
        text = "".join(c.text for ch in client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=5,
                                                                   temperature=0, echo=True, stream=True)
                       for c in ch.choices)
    else:
        text = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=5, temperature=0,
                                         echo=True).choices[0].text
    assert text.startswith(prompt)
    assert text == prompt + ref.text


# ---- echo + logprobs: the prompt scored (legacy completions, what lm-eval's loglikelihoods read) ----
def _echo_scored(server, prompt, stream=False, **kw):
    body = {"model": SERVED_NAME, "prompt": prompt, "temperature": 0, "echo": True, "logprobs": 2, **kw}
    if not stream:
        r = server.http().post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    with server.http().stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [c["choices"][0] for c in json_events(sse_events(r.iter_lines())) if c["choices"]]
    joined = {"text": "".join(c["text"] for c in chunks), "finish_reason": chunks[-1]["finish_reason"],
              "logprobs": {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}}
    for c in chunks:
        for k, v in (c["logprobs"] or {}).items():
            joined["logprobs"][k] += v
    return joined


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_echo_logprobs_score_the_prompt(server, llm, stream, as_ids):
    text = PROMPTS[0]
    ref = llm.generate(text, SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2))[0]
    ids = ref.prompt_token_ids  # a string prompt gets the tokenizer's BOS; token ids are used as sent
    choice = _echo_scored(server, ids if as_ids else text, stream, max_tokens=3)
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(ids) + 3  # every prompt token scored, then the generated ones
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert lps["tokens"][: len(ids)] == [llm.tokenizer.decode([t]) for t in ids]
    for j in range(1, len(ids)):
        assert lps["token_logprobs"][j] == pytest.approx(ref.prompt_logprobs[j][ids[j]], abs=1e-4)
        assert max(lps["top_logprobs"][j].values()) == pytest.approx(max(ref.prompt_logprobs[j].values()), abs=1e-4)
    for k, step in enumerate(ref.outputs[0].logprobs):
        assert lps["token_logprobs"][len(ids) + k] == pytest.approx(step[ref.token_ids[k]], abs=1e-4)
    echoed = choice["text"][: len(choice["text"]) - len(ref.text)]
    assert choice["text"] == echoed + ref.text
    offsets = lps["text_offset"]
    assert offsets == sorted(offsets) and offsets[len(ids)] == len(echoed)  # generated text starts after the echo
    if not as_ids:
        assert echoed == text and offsets[1] == 0  # the BOS the server added takes no room in the text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_max_tokens_zero_with_echo_scores_only(server, llm, stream):
    text = PROMPTS[1]
    ref = llm.generate(text, SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    choice = _echo_scored(server, text, stream, max_tokens=0)
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ref.prompt_token_ids)
    got = choice["logprobs"]["token_logprobs"][1:]
    want = [ref.prompt_logprobs[j][t] for j, t in enumerate(ref.prompt_token_ids) if j > 0]
    assert got == pytest.approx(want, abs=1e-4)


def test_max_tokens_zero_needs_echo(server):
    r = server.http().post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


# ---- vLLM's prompt_logprobs ------------------------------------------------------------------------
def _check_prompt_logprobs(got, ref, top, tokenizer):
    """vLLM's format: per prompt token (the first null) {id: {logprob, rank, decoded_token}}: the
    prompt's token with its rank, then the ``top`` most likely ranked 1..top; values as the engine's."""
    ids = ref.prompt_token_ids
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        entry, scored = got[j], ref.prompt_logprobs[j]
        assert entry[str(ids[j])]["rank"] == ref.prompt_ranks[j]
        best = sorted(scored.items(), key=lambda kv: -kv[1])[:top]
        assert set(entry) == {str(ids[j])} | {str(t) for t, _ in best}
        for rank, (t, v) in enumerate(best, start=1):
            if t != ids[j]:
                assert entry[str(t)]["rank"] == rank
        for t, e in entry.items():
            assert e["logprob"] == pytest.approx(scored[int(t)], abs=1e-5)
            assert e["decoded_token"] == tokenizer.decode([int(t)])
    assert any(got[j][str(ids[j])]["rank"] > top for j in range(1, len(ids)))  # not only top tokens


@pytest.mark.parametrize("echo_logprobs, top", [(None, 3), (1, 4), (4, 1)], ids=["alone", "echo-fewer", "echo-more"])
def test_completion_prompt_logprobs(server, llm, echo_logprobs, top):
    """vLLM's ``prompt_logprobs`` (a 400 before), alone and beside echo's logprobs (one scoring with
    the larger count: each gets its own)."""
    text = PROMPTS[1]
    ref = _ref(llm, text, max_tokens=3, temperature=0, prompt_logprobs=4)
    body = {"model": SERVED_NAME, "prompt": text, "max_tokens": 3, "temperature": 0, "prompt_logprobs": top}
    if echo_logprobs is not None:
        body.update(echo=True, logprobs=echo_logprobs)
    r = server.http().post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].endswith(ref.text)
    _check_prompt_logprobs(choice["prompt_logprobs"], ref, top, llm.tokenizer)
    if echo_logprobs is not None:
        ids = ref.prompt_token_ids
        for j in range(1, len(ids)):  # the prompt token and its echo_logprobs alternatives
            best = sorted(ref.prompt_logprobs[j].items(), key=lambda kv: -kv[1])[:echo_logprobs]
            want = {ids[j]} | {t for t, _ in best}
            assert len(choice["logprobs"]["top_logprobs"][j]) == len({llm.tokenizer.decode([t]) for t in want})


def test_completion_prompt_logprobs_without_generating(server, llm):
    text = PROMPTS[0]
    ref = _ref(llm, text, max_tokens=0, prompt_logprobs=2)
    r = server.http().post("/v1/completions", json={"model": SERVED_NAME, "prompt": text, "max_tokens": 0,
                                                    "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "length" and choice["logprobs"] is None
    _check_prompt_logprobs(choice["prompt_logprobs"], ref, 2, llm.tokenizer)


def test_chat_prompt_logprobs(server, llm):
    ref = _ref_chat(llm, CHAT, max_tokens=3, temperature=0, prompt_logprobs=2)
    r = server.http().post("/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": [{"role": "user", "content": CHAT}], "max_tokens": 3, "temperature": 0,
        "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == ref.text
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    _check_prompt_logprobs(body["prompt_logprobs"], ref, 2, llm.tokenizer)
    # absent unless asked for
    plain = server.http().post("/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": [{"role": "user", "content": CHAT}], "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize("path, extra, word", [
    ("/v1/completions", {"stream": True}, "stream"), ("/v1/chat/completions", {"stream": True}, "stream"),
    ("/v1/completions", {"prompt_logprobs": 21}, "20"), ("/v1/completions", {"prompt_logprobs": -1}, "0"),
])
def test_prompt_logprobs_errors(server, path, extra, word):
    body = {"model": SERVED_NAME, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "prompt_logprobs": 1, **extra}
    r = server.http().post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and word in err["message"]


def test_priority_needs_the_priority_policy(server, tools_server):
    """vLLM's ``priority``: a 400 naming the flag on an fcfs server; served on one started with
    ``--scheduling_policy priority`` (the order itself: tests/runtime/test_scheduler.py, test_engine.py)."""
    body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    r = server.http().post("/v1/completions", json={**body, "priority": -2})
    assert r.status_code == 400 and "--scheduling_policy priority" in r.json()["error"]["message"]
    texts = []
    for priority in (0, -2, 7):
        r = tools_server.http().post("/v1/completions", json={**body, "model": tools_server.model,
                                                              "priority": priority})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1] == texts[2]


def test_cache_salt_separates_cached_prefixes(server):
    """vLLM's ``cache_salt`` (a 400 before): a prompt's cached pages serve the same salt only."""
    prompt = "Salted prefix: " + " ".join(f"w{i}" for i in range(40))

    def hits(**extra):
        before = parse_prometheus(server.http().get("/metrics").text)["autodeploy_prefix_cache_hit_tokens_total"]
        r = server.http().post("/v1/completions", json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1,
                                                        "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        after = parse_prometheus(server.http().get("/metrics").text)["autodeploy_prefix_cache_hit_tokens_total"]
        return after - before

    hits(cache_salt="tenant-a")  # cached under tenant-a
    assert hits() == 0 and hits(cache_salt="tenant-b") == 0
    assert hits(cache_salt="tenant-a") > 0 and hits() > 0


# ---- vLLM's use_beam_search -------------------------------------------------------------------------
def test_beam_search_as_llm_beam_search_does(server, llm):
    """``use_beam_search`` with n beams (a 400 before): the choices are LLM.beam_search's hypotheses,
    best first, for each prompt of a completion and for a chat."""
    from autodeploy.runtime.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    refs = llm.beam_search(PROMPTS, params)
    body = {"model": SERVED_NAME, "prompt": PROMPTS, "max_tokens": 6, "n": 3, "use_beam_search": True,
            "length_penalty": 0.5, "temperature": 0}
    r = server.http().post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    for i, ref in enumerate(refs):
        want = [(s.text, s.finish_reason) for s in ref.sequences]
        assert [(c["text"], c["finish_reason"]) for c in got["choices"][3 * i:3 * i + 3]] == want
    assert got["usage"]["completion_tokens"] == sum(len(s.token_ids) for ref in refs for s in ref.sequences)
    [ref] = llm.beam_search(llm.processor.chat_prompt([{"role": "user", "content": CHAT}]), params)
    r = server.http().post("/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": [{"role": "user", "content": CHAT}], "max_tokens": 6, "n": 3,
        "use_beam_search": True, "length_penalty": 0.5})
    assert r.status_code == 200, r.text
    assert [c["message"]["content"] for c in r.json()["choices"]] == [s.text for s in ref.sequences]


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"temperature": 0.7}, "temperature"), ({"logprobs": 2}, "logprobs"),
    ({"stop": ["x"]}, "stop"), ({"guided_choice": ["a", "b"]}, "guided_choice"), ({"n": 11}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"use_beam_search": False, "length_penalty": 2}, "length_penalty"),
])
def test_beam_search_refuses_what_it_would_ignore(server, extra, param):
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True, **extra}
    r = server.http().post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- vLLM's stop_reason, return_token_ids, return_tokens_as_token_ids -----------------------------
def _events(server, path, body):
    r = server.http().post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return json_events(sse_events(r.text.splitlines()))


def test_stop_reason_names_what_ended_the_choice(server, llm):
    """The stop token id, the stop string, or null (EOS, max_tokens), whole and streamed, in both endpoints."""
    plain = _ref(llm, PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)
    k = next(i for i in range(2, MAX_TOKENS) if plain.token_ids[i] not in plain.token_ids[:i])
    stop, _ = _stop_string(plain.text)
    cases = [({}, None), ({"stop_token_ids": [plain.token_ids[k]]}, plain.token_ids[k]),
             ({"stop": ["@@@@", stop]}, stop)]
    for extra, want in cases:
        body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
        whole = server.http().post("/v1/completions", json=body).json()["choices"][0]
        streamed = [c for e in _events(server, "/v1/completions", body) for c in e["choices"]]
        assert whole["stop_reason"] == want and streamed[-1]["stop_reason"] == want
        assert whole["finish_reason"] == ("length" if want is None else "stop")
        assert all(c["stop_reason"] is None for c in streamed[:-1])
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": CHAT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stop_token_ids": [plain.token_ids[k]], "logit_bias": {str(plain.token_ids[k]): 100}}
    answer = server.http().post("/v1/chat/completions", json=chat).json()["choices"][0]
    assert answer["stop_reason"] == plain.token_ids[k]


def test_return_token_ids_completions(server, llm):
    """The prompt's and each choice's token ids, whole and streamed (the prompt's in each choice's
    first chunk, then each chunk's new tokens), for two prompts of two choices each."""
    kw = dict(max_tokens=MAX_TOKENS, temperature=0.8, seed=11, n=2)
    refs = [_ref(llm, p, **kw) for p in PROMPTS]
    body = {"model": SERVED_NAME, "prompt": PROMPTS, **kw, "return_token_ids": True}
    whole = server.http().post("/v1/completions", json=body).json()["choices"]
    streamed = defaultdict(list)
    for e in _events(server, "/v1/completions", body):
        for c in e["choices"]:
            streamed[c["index"]].append(c)
    for i, ref in enumerate(refs):
        for j, out in enumerate(ref.outputs):
            choice, chunks = whole[2 * i + j], streamed[2 * i + j]
            assert (choice["prompt_token_ids"], choice["token_ids"]) == (ref.prompt_token_ids, out.token_ids)
            assert chunks[0]["prompt_token_ids"] == ref.prompt_token_ids
            assert all("prompt_token_ids" not in c for c in chunks[1:])
            assert [t for c in chunks for t in c["token_ids"]] == out.token_ids
    plain = server.http().post("/v1/completions", json={**body, "return_token_ids": None}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_return_token_ids_chat(server, llm):
    ref = _ref_chat(llm, CHAT, max_tokens=MAX_TOKENS, temperature=0)
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": CHAT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True}
    whole = server.http().post("/v1/chat/completions", json=body).json()
    assert whole["prompt_token_ids"] == ref.prompt_token_ids and whole["choices"][0]["token_ids"] == ref.token_ids
    events = [e for e in _events(server, "/v1/chat/completions", body) if e["choices"]]
    assert events[0]["prompt_token_ids"] == ref.prompt_token_ids
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == ref.token_ids


def test_return_tokens_as_token_ids(server, llm):
    """Logprobs name tokens 'token_id:<id>' (vLLM's), in both formats; the values are unchanged."""
    ref = _ref(llm, PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "return_tokens_as_token_ids": True}
    lps = server.http().post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lps["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    for step, top in zip(ref.outputs[0].logprobs, lps["top_logprobs"]):
        assert top == pytest.approx({f"token_id:{t}": v for t, v in step.items()}, abs=1e-5)
    assert lps["text_offset"][-1] == len(llm.tokenizer.decode(ref.token_ids[:-1]))  # offsets stay the text's
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": CHAT}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    ref = _ref_chat(llm, CHAT, max_tokens=3, temperature=0)
    content = server.http().post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ref.token_ids]
    assert all(c["bytes"] == list(c["token"].encode()) and c["top_logprobs"][0]["token"].startswith("token_id:")
               for c in content)


def _stop_string(text):
    """A 2-character stop string taken from inside ``text`` (first occurrence at k > 0)."""
    for k in range(1, len(text) - 1):
        s = text[k:k + 2]
        if "\ufffd" not in s and s.strip() and text.find(s) == k:
            return s, k
    # the greedy text of a fixed prompt on the fixed model: a precondition the suite controls
    raise AssertionError(f"precondition: the greedy completion {text!r} has no 2-character stop string "
                         "(non-blank, whole characters, first occurring after the start)")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_stop_string(server, llm, stream):
    greedy = _ref(llm, PROMPTS[1], max_tokens=12, temperature=0)
    stop, k = _stop_string(greedy.text)
    ref = _ref(llm, PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    assert ref.text == greedy.text[:k] and ref.finish_reason == "stop"
    client = server.client()
    if stream:
        parts, finish = [], None
        for ch in client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            stop=[stop], stream=True):
            for c in ch.choices:
                parts.append(c.text)
                finish = c.finish_reason or finish
        text = "".join(parts)
    else:
        c = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                      stop=stop).choices[0]
        text, finish = c.text, c.finish_reason
    assert text == greedy.text[:k]
    assert stop not in text
    assert finish == "stop"


def test_chat_stop_string(server, llm):
    greedy = _ref_chat(llm, CHAT, max_tokens=12, temperature=0)
    stop, k = _stop_string(greedy.text)
    res = server.client().chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": CHAT}],
                                                  max_tokens=12, temperature=0, stop=[stop])
    assert res.choices[0].message.content == greedy.text[:k]
    assert res.choices[0].finish_reason == "stop"


def test_completion_token_id_prompt(server, llm):
    ids = llm.tokenizer(PROMPTS[0])["input_ids"]
    ref = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=5, temperature=0))[0]
    res = server.client().completions.create(model=SERVED_NAME, prompt=ids, max_tokens=5, temperature=0)
    assert res.choices[0].text == ref.text
    assert res.usage.prompt_tokens == len(ids)


def test_completion_prompt_list(server, llm):
    refs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    res = server.client().completions.create(model=SERVED_NAME, prompt=PROMPTS, max_tokens=4, temperature=0)
    assert [c.index for c in res.choices] == [0, 1]
    assert [c.text for c in res.choices] == [r.text for r in refs]
    assert res.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)


# ---- models, health, metrics -------------------------------------------------------------------
def test_models_lists_served_name(server):
    models = server.client().models.list()
    ids = [m.id for m in models.data]
    assert ids == [SERVED_NAME]
    raw = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert raw["object"] == "list"
    assert raw["data"][0]["max_model_len"] == MAX_SEQ_LEN


def test_health(server):
    r = httpx.get(f"{server.url}/health", timeout=10)
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_metrics_prometheus_text(server):
    server.client().completions.create(model=SERVED_NAME, prompt="metrics", max_tokens=3, temperature=0)
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name, kind in [("autodeploy_kv_pages_used", "gauge"), ("autodeploy_kv_pages_free", "gauge"),
                       ("autodeploy_requests_running", "gauge"), ("autodeploy_requests_total", "counter"),
                       ("autodeploy_generation_tokens_total", "counter"),
                       ("autodeploy_time_to_first_token_seconds", "histogram"),
                       ("autodeploy_inter_token_latency_seconds", "histogram")]:
        assert f"# TYPE {name} {kind}" in text
    m = parse_prometheus(text)
    assert m['autodeploy_requests_total{status="completed"}'] >= 1
    assert m["autodeploy_generation_tokens_total"] >= 3
    assert m["autodeploy_time_to_first_token_seconds_count"] >= 1
    ttft = "autodeploy_time_to_first_token_seconds"
    assert m[f'{ttft}_bucket{{le="+Inf"}}'] == m[f"{ttft}_count"]
    assert m["autodeploy_inter_token_latency_seconds_count"] >= 1
    m = server.wait_idle()
    assert m["autodeploy_kv_pages_used"] == 0
    assert m["autodeploy_kv_pages_free"] > 0
    assert m["autodeploy_requests_running"] == 0


def test_generation_tokens_counter_counts_tokens(server):
    before = server.metrics()
    res = server.client().completions.create(model=SERVED_NAME, prompt=LONG_PROMPT, max_tokens=7, temperature=0)
    after = server.metrics()
    assert res.usage.completion_tokens == 7
    assert after["autodeploy_generation_tokens_total"] - before["autodeploy_generation_tokens_total"] == 7
    completed = 'autodeploy_requests_total{status="completed"}'
    assert after[completed] - before[completed] == 1
