"""The server contract an outside fuzzer and a hostile client probed (issue 20): unencodable
text, strict JSON types, ``stream_options.include_usage``, work bounded per request, preemptions
counted and logged, prompt lists streamed together.

Each test failed on the server before the contract was fixed (500s, coerced types, a usage
chunk nobody asked for, 1,000 prompts accepted, no preemption metric).
"""

import asyncio
import json
import time

import httpx
import pytest

from serve_utils import LONG_PROMPT, MAX_CHOICES, SERVED_NAME, json_events, sse_events
from test_bad_input import CHAT, CMPL, MSGS, assert_error

SURROGATE = "abc\ud800def"  # a lone UTF-16 surrogate: JSON can carry it (\ud800), UTF-8 cannot


def _raw_post(server, path, body, **kw):
    """POST ``body`` serialized with ASCII escapes, so that lone surrogates travel as ``\\ud800``
    (httpx's own ``json=`` would fail to encode them on the client side)."""
    return httpx.post(f"{server.url}{path}", content=json.dumps(body).encode("ascii"),
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, timeout=60, **kw)


# ---- 1. unencodable text: a 400 naming the field, never a 500 -----------------------------------
@pytest.mark.parametrize("path,body,param,where", [
    (CMPL, {"prompt": SURROGATE}, "prompt", "'prompt'"),
    (CMPL, {"prompt": ["fine", SURROGATE]}, "prompt", "'prompt.1'"),
    (CMPL, {"prompt": SURROGATE, "stream": True}, "prompt", "'prompt'"),
    (CMPL, {"prompt": "hi", "stop": [SURROGATE]}, "stop", "'stop.0'"),
    (CHAT, {"messages": [{"role": "user", "content": SURROGATE}]}, "messages", "'messages.0.content'"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}], "stream": True},
     "messages", "'messages.0.content.0.text'"),
    (CHAT, {"messages": MSGS, "user": SURROGATE}, "user", "'user'"),
], ids=["prompt", "prompt-list", "prompt-stream", "stop", "chat-content", "chat-parts-stream", "user"])
def test_unencodable_text_is_a_400_naming_the_field(healthy, path, body, param, where):
    r = _raw_post(healthy, path, {"model": SERVED_NAME, "max_tokens": 2, **body})
    err = assert_error(r, 400, param=param)
    assert where in err["message"] and "surrogate" in err["message"], err


@pytest.mark.parametrize("path,extra", [(CMPL, {"prompt": "hi"}), (CHAT, {"messages": MSGS})])
def test_unencodable_model_name_is_a_400_not_a_404(healthy, path, extra):
    """The 404 would echo the name back; the name cannot be encoded, so it is a 400 first."""
    err = assert_error(_raw_post(healthy, path, {"model": SURROGATE, **extra}), 400, param="model")
    assert "surrogate" in err["message"]


def test_well_formed_astral_text_is_served(healthy):
    """A surrogate *pair* (one astral character, e.g. an emoji) is valid text, not an error."""
    r = _raw_post(healthy, CMPL, {"model": SERVED_NAME, "prompt": "smile \U0001F600", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- 3. strict types: OpenAI's types, no coercion ------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    (CMPL, {"prompt": "hi", "stream": "yes"}, "stream"),
    (CMPL, {"prompt": "hi", "stream": 1}, "stream"),
    (CMPL, {"prompt": [True, False]}, "prompt"),
    (CMPL, {"prompt": "hi", "echo": 0}, "echo"),
    (CMPL, {"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
    (CMPL, {"prompt": "hi", "n": True}, "n"),
    (CMPL, {"prompt": "hi", "logprobs": True}, "logprobs"),
    (CMPL, {"prompt": "hi", "seed": "7"}, "seed"),
    (CMPL, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "true"}}, "stream_options"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": False}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": 1}, "logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (CHAT, {"messages": MSGS, "temperature": "0.5"}, "temperature"),
], ids=["stream-str", "stream-int", "prompt-bools", "echo-int", "max_tokens-float", "n-bool", "logprobs-bool",
        "seed-str", "include_usage-str", "top_logprobs-bool", "chat-logprobs-int", "content-int",
        "temperature-str"])
def test_wrong_json_types_are_400s(healthy, path, body, param):
    err = assert_error(_raw_post(healthy, path, {"model": SERVED_NAME, "max_tokens": 2, **body}), 400)
    assert err["param"] == param or (err["param"] or "").startswith(param + "."), err


def test_an_integer_where_a_number_is_expected_is_accepted(healthy):
    """JSON has one number type: ``"temperature": 1`` is a float field given an integer (fine)."""
    r = _raw_post(healthy, CMPL, {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 1,
                                  "top_p": 1})
    assert r.status_code == 200, r.text


# ---- 6. stream_options.include_usage -------------------------------------------------------------
def _stream_chunks(server, path, body):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}{path}", json=body) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return json_events(events)


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}, {"include_usage": True}],
                         ids=["absent", "empty", "false", "true"])
def test_usage_chunk_only_when_asked(server, path, options):
    body = {"model": SERVED_NAME, "max_tokens": 3, "temperature": 0, "stream": True}
    body.update({"prompt": "hi"} if path == CMPL else {"messages": MSGS})
    if options is not None:
        body["stream_options"] = options
    chunks = _stream_chunks(server, path, body)
    with_usage = [c for c in chunks if c.get("usage")]
    if options and options.get("include_usage"):
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1]["choices"] == []
        assert 1 <= with_usage[0]["usage"]["completion_tokens"] <= 3
    else:
        assert with_usage == [] and all(c["choices"] for c in chunks)


# ---- 8. work per request is bounded ---------------------------------------------------------------
def test_thousand_prompts_rejected(aux_server):
    """(On the aux server: its body limit is the default 1 MiB, the main server's 4 KiB.)"""
    before = aux_server.metrics()
    body = {"model": aux_server.model, "prompt": ["hi"] * 1000, "max_tokens": 1}
    err = assert_error(httpx.post(f"{aux_server.url}{CMPL}", json=body, headers=aux_server.headers(), timeout=60),
                       400, param="prompt")
    assert "1000" in err["message"] and "128" in err["message"], err
    assert aux_server.metrics()["autodeploy_prompt_tokens_total"] == before["autodeploy_prompt_tokens_total"]


def test_prompts_times_n_is_bounded(healthy):
    over = {"model": SERVED_NAME, "prompt": ["hi"] * 9, "n": 16, "max_tokens": 1}  # 144 > 128
    err = assert_error(httpx.post(f"{healthy.url}{CMPL}", json=over, timeout=60), 400, param="prompt")
    assert "144" in err["message"], err
    at = {"model": SERVED_NAME, "prompt": ["hi"] * 8, "n": 16, "max_tokens": 1, "temperature": 0}  # 128
    r = httpx.post(f"{healthy.url}{CMPL}", json=at, timeout=120)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(128))


def test_max_choices_flag(tight_server):
    """--max-choices-per-request 4 on the tight server: n=5 is refused on both endpoints, 4 is fine."""
    srv = tight_server
    for path, extra in ((CMPL, {"prompt": "hi"}), (CHAT, {"messages": MSGS})):
        body = {"model": srv.model, "max_tokens": 1, **extra}
        err = assert_error(httpx.post(f"{srv.url}{path}", json={**body, "n": MAX_CHOICES + 1}, timeout=60), 400,
                           param="n")
        assert f"at most {MAX_CHOICES} per request" in err["message"], err
        r = httpx.post(f"{srv.url}{path}", json={**body, "n": MAX_CHOICES}, timeout=60)
        assert r.status_code == 200, r.text
    two_prompts = {"model": srv.model, "prompt": ["a", "b"], "n": 3, "max_tokens": 1}
    assert_error(httpx.post(f"{srv.url}{CMPL}", json=two_prompts, timeout=60), 400, param="prompt")


# ---- prompt lists stream together ---------------------------------------------------------------
def test_streamed_prompt_list_matches_whole_response(server):
    """A streamed list of prompts gives every choice the text of the non-streamed response, and the
    prompts run at once (their chunks interleave) rather than one after another."""
    body = {"model": SERVED_NAME, "prompt": [LONG_PROMPT, "Once upon a time", "The"], "n": 2, "max_tokens": 12,
            "temperature": 0}
    whole = httpx.post(f"{server.url}{CMPL}", json=body, timeout=60).json()
    expected = {c["index"]: c["text"] for c in whole["choices"]}
    chunks = _stream_chunks(server, CMPL, {**body, "stream": True, "stream_options": {"include_usage": True}})
    texts, order = {}, []
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            order.append(c["index"] // 2)
    assert texts == expected
    assert chunks[-1]["usage"] == whole["usage"]
    # interleaved: a later prompt's chunk comes before an earlier prompt's last chunk
    last_of_first = max(i for i, p in enumerate(order) if p == 0)
    assert any(p > 0 for p in order[:last_of_first]), order


# ---- 7. preemptions are counted and logged -------------------------------------------------------
async def _concurrent(server, n):
    async with httpx.AsyncClient(timeout=120) as http:
        bodies = [{"model": server.model, "prompt": f"{LONG_PROMPT} {i}", "max_tokens": 40, "temperature": 0}
                  for i in range(n)]
        return await asyncio.gather(*[http.post(f"{server.url}{CMPL}", json=b) for b in bodies])


def test_preemptions_counted_and_logged(tight_server):
    before = tight_server.metrics()
    assert before["autodeploy_preemptions_total"] == 0
    responses = asyncio.run(_concurrent(tight_server, 8))  # 8 x ~45 tokens = 24 pages > 12
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses if r.status_code != 200]
    assert all(1 <= r.json()["usage"]["completion_tokens"] <= 40 for r in responses)
    after = tight_server.wait_idle()
    assert after["autodeploy_preemptions_total"] > 0, after
    assert after["autodeploy_kv_pages_used"] == 0
    time.sleep(0.2)
    assert "preempted request" in tight_server.log_text(), tight_server.log_tail()


def test_prefix_cache_hits_counted(server):
    """The same long prompt twice: the second request reads the first one's full pages and the
    start of its tail page from the prefix cache, and /metrics counts those tokens."""
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 4)  # ~45 tokens of MAX_SEQ_LEN 128
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    server.wait_idle()
    before = server.metrics()
    first = httpx.post(f"{server.url}{CMPL}", json=body, timeout=60).json()
    between = server.wait_idle()  # (the first may start from pages other tests left: not counted)
    second = httpx.post(f"{server.url}{CMPL}", json=body, timeout=60).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    after = server.wait_idle()
    tokens = first["usage"]["prompt_tokens"]
    queried = after["autodeploy_prefix_cache_queried_tokens_total"] - before["autodeploy_prefix_cache_queried_tokens_total"]
    hit = after["autodeploy_prefix_cache_hit_tokens_total"] - between["autodeploy_prefix_cache_hit_tokens_total"]
    assert queried == 2 * tokens
    assert hit == tokens - 1  # the first one's whole pages and its tail page: all but the last token
    tails = after["autodeploy_prefix_cache_tail_pages_total"] - between["autodeploy_prefix_cache_tail_pages_total"]
    assert tails == 1
