"""Bad requests get a 4xx with OpenAI's error body, and the server keeps serving after each.

Also the server flags: --max-request-bytes (413, with and without Content-Length),
--max-tokens-limit and --api-key (on a second server).
"""

import json

import httpx
import openai
import pytest

from serve_utils import (API_KEY, LONG_PROMPT, MAX_REQUEST_BYTES, MAX_SEQ_LEN, MAX_TOKENS_LIMIT, MODEL, SERVED_NAME,
                         json_events, read_events, sse_events)

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _post(server, path, body=None, *, content=None, headers=None):
    kw = {"json": body} if content is None else {"content": content}
    return httpx.post(f"{server.url}{path}", headers={"content-type": "application/json", **(headers or {})},
                      timeout=60, **kw)


def assert_error(r, status, *, param=..., code=..., contains=None):
    """``r`` is ``status`` with ``{"error": {"message", "type", "param", "code"}}``."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    if contains is not None:
        assert contains in err["message"], err
    return err


# ---- malformed bodies --------------------------------------------------------------------------
@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("raw", [b'{"model": "x", "prompt": "hi",', b"not json", b"", b"\xff\xfe{}", b"[]", b"5",
                                 b'"a string"', b"null"],
                         ids=["truncated", "text", "empty", "bad-utf8", "list", "number", "string", "null"])
def test_malformed_json(healthy, path, raw):
    err = assert_error(_post(healthy, path, content=raw), 400)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body,param", [
    (CMPL, {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": "ten"}, "max_tokens"),
    (CMPL, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (CMPL, {"prompt": "hi", "n": 1.5}, "n"),
    (CMPL, {"prompt": "hi", "stream": "sometimes"}, "stream"),
    (CMPL, {"prompt": "hi", "stop": 7}, None),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, None),
    (CHAT, {"messages": [{"content": "hi"}]}, None),
    (CMPL, {"prompt": "hi", "model": 5}, "model"),
], ids=["cmpl-max_tokens-str", "chat-max_tokens-str", "temperature-str", "n-float", "stream-str", "stop-int",
        "messages-str", "role-unknown", "role-missing", "model-int"])
def test_wrong_types(healthy, path, body, param):
    body = {"model": SERVED_NAME, **body}
    err = assert_error(_post(healthy, path, body), 400)
    if param is not None:
        assert err["param"] == param
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [5, None, {"text": "hi"}, [1, "a"], [[1, 2], "a"], 1.5])
def test_wrong_prompt_types(healthy, prompt):
    err = assert_error(_post(healthy, CMPL, {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2}), 400)
    assert (err["param"] or "prompt").split(".")[0] == "prompt"


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_missing_required_fields(healthy, path):
    assert_error(_post(healthy, path, {"model": SERVED_NAME}), 400, param="prompt" if path == CMPL else "messages")
    assert_error(_post(healthy, path, {"prompt": "hi", "messages": MSGS}), 400, param="model")


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_unknown_model_404(healthy, path):
    body = {"model": "gpt-17", "prompt": "hi", "messages": MSGS, "max_tokens": 2}
    err = assert_error(_post(healthy, path, body), 404, param="model", code="model_not_found")
    assert "gpt-17" in err["message"]
    with pytest.raises(openai.NotFoundError):
        healthy.client().completions.create(model="gpt-17", prompt="hi", max_tokens=2)


def test_unknown_route_404(healthy):
    r = httpx.get(f"{healthy.url}/v1/nothing", timeout=10)
    assert_error(r, 404)
    r = httpx.get(f"{healthy.url}/v1/completions", timeout=10)
    assert 400 <= r.status_code < 500
    assert_error(r, r.status_code)


# ---- out-of-range values -----------------------------------------------------------------------
@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("top_p", 2), ("top_p", 0), ("temperature", -1), ("temperature", 2.5),
    ("n", 0), ("n", 17), ("top_k", -2), ("stop", ""), ("stop", ["a"] * 9), ("stop", [""]),
    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0), ("min_p", 1.5),
    ("min_tokens", -1), ("stop_token_ids", [5, -1]), ("logit_bias", {"5": 101}), ("logit_bias", {"x5": 1}),
    ("logit_bias", {"\u00b2": 1}),
])
def test_out_of_range(healthy, path, field, value):
    body = {"model": SERVED_NAME, "prompt": "hi", "messages": MSGS, "max_tokens": 2, field: value}
    assert_error(_post(healthy, path, body), 400, param=field + (".1" if field == "stop_token_ids" else ""))


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_min_tokens_above_max_tokens(healthy, path):
    body = {"model": SERVED_NAME, "prompt": "hi", "messages": MSGS, "max_tokens": 2, "min_tokens": 3}
    assert_error(_post(healthy, path, body), 400, contains="min_tokens (3) must not exceed max_tokens (2)")


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_logit_bias_outside_the_vocabulary(healthy, path):
    body = {"model": SERVED_NAME, "prompt": "hi", "messages": MSGS, "max_tokens": 2, "logit_bias": {"100000": 1}}
    assert_error(_post(healthy, path, body), 400, contains="logit_bias token ids must be in [0, ")


@pytest.mark.parametrize("body,param", [
    ({"logprobs": 6}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"), ({"prompt": [600]}, "prompt"),
])
def test_completion_out_of_range(healthy, body, param):
    r = _post(healthy, CMPL, {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, **body})
    assert_error(r, 400, param=param)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object",
      "patternProperties": {}}}}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": '{"type": '}, "guided_json"), ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),  # x is no rule
    ({"guided_grammar": 'root ::= root ")" | "x"'}, "guided_grammar"),  # left-recursive
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs"),
])
def test_chat_out_of_range(healthy, body, param):
    r = _post(healthy, CHAT, {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 2, **body})
    assert_error(r, 400, param=param)


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("max_tokens", [MAX_SEQ_LEN, 10_000, 2**63])
def test_max_tokens_over_context(healthy, path, max_tokens):
    body = {"model": SERVED_NAME, "prompt": "hi", "messages": MSGS, "max_tokens": max_tokens}
    err = assert_error(_post(healthy, path, body), 400, param="max_tokens", code="context_length_exceeded")
    assert str(MAX_SEQ_LEN) in err["message"]


def test_max_tokens_that_just_fits(healthy, llm):
    prompt_len = len(llm.tokenizer(LONG_PROMPT)["input_ids"])
    body = {"model": SERVED_NAME, "prompt": LONG_PROMPT, "max_tokens": MAX_SEQ_LEN - prompt_len, "temperature": 0}
    r = _post(healthy, CMPL, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_SEQ_LEN - prompt_len
    assert_error(_post(healthy, CMPL, {**body, "max_tokens": MAX_SEQ_LEN - prompt_len + 1}), 400, param="max_tokens")


def test_prompt_longer_than_context(healthy, llm):
    prompt = "word " * 200
    assert len(llm.tokenizer(prompt)["input_ids"]) > MAX_SEQ_LEN
    assert_error(_post(healthy, CMPL, {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2}), 400,
                 param="prompt", code="context_length_exceeded")
    assert_error(_post(healthy, CMPL, {"model": SERVED_NAME, "prompt": prompt}), 400,
                 param="prompt", code="context_length_exceeded")
    assert_error(_post(healthy, CMPL, {"model": SERVED_NAME, "prompt": list(range(3, 3 + MAX_SEQ_LEN)),
                                       "max_tokens": 1}), 400, param="prompt", code="context_length_exceeded")
    assert_error(_post(healthy, CHAT, {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}]}),
                 400, param="messages", code="context_length_exceeded")
    # exactly the context: no room for one token
    ids = [5] * MAX_SEQ_LEN
    assert_error(_post(healthy, CMPL, {"model": SERVED_NAME, "prompt": ids}), 400, code="context_length_exceeded")


# ---- unsupported parameters --------------------------------------------------------------------
@pytest.mark.parametrize("path,field,value", [
    (CMPL, "suffix", "tail"),
    (CMPL, "best_of", 3),
    (CMPL, "mm_processor_kwargs", {"x": 1}), (CMPL, "spaces_between_special_tokens", False),
    (CHAT, "logits_processors", ["x"]),
    (CHAT, "priority", 5), (CMPL, "vllm_xargs", {"a": 1})
])
def test_unsupported_params(healthy, path, field, value):
    body = {"model": SERVED_NAME, "prompt": "hi", "messages": MSGS, "max_tokens": 2, field: value}
    err = assert_error(_post(healthy, path, body), 400, param=field)
    assert field in err["message"]


def test_unsupported_params_through_openai_client(healthy):
    with pytest.raises(openai.BadRequestError) as exc:
        healthy.client().completions.create(model=SERVED_NAME, prompt="hi", max_tokens=2, suffix="tail")
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == "suffix"


def test_neutral_values_of_unsupported_params_are_accepted(healthy):
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, "frequency_penalty": 0, "presence_penalty": 0.0,
            "logit_bias": {}, "suffix": "", "best_of": 1, "user": "u", "vendor_extra": {"a": 1},
            "use_beam_search": False, "length_penalty": 1, "guided_json": None, "guided_grammar": None,
            "skip_special_tokens": True, "priority": 0, "cache_salt": None}
    assert _post(healthy, CMPL, body).status_code == 200
    body = {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 2, "tools": [], "response_format": {"type": "text"}}
    assert _post(healthy, CHAT, body).status_code == 200


# ---- client input that once gave a 5xx ----------------------------------------------------------
@pytest.mark.parametrize("prompt", [[-1], [1, 10**6], [[1, 2], [2**40]]])
def test_prompt_token_ids_out_of_range(healthy, prompt):
    assert_error(_post(healthy, CMPL, {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2}), 400, param="prompt")


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_large_seed(healthy, path):
    body = {"model": SERVED_NAME, "prompt": "hi", "messages": MSGS, "max_tokens": 2, "temperature": 0.7,
            "seed": 10**14}
    r = _post(healthy, path, body)
    assert r.status_code < 500, r.text


@pytest.mark.parametrize("temperature", [1e-30, 1e-9, 5e-6])
def test_tiny_temperature(healthy, temperature):
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, "temperature": temperature}
    r = _post(healthy, CMPL, body)
    assert r.status_code < 500, r.text


def test_bad_request_does_not_fail_other_requests(healthy):
    server = healthy
    # 4 choices of 120 tokens: still running when the bad request arrives, and leaving batch
    # slots (max_batch_size 8) free so that the bad request joins the same engine steps
    body = {"model": SERVED_NAME, "prompt": LONG_PROMPT, "max_tokens": 120, "n": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}{CMPL}", json=body) as r:
            lines = r.iter_lines()
            events = read_events(lines, 2)
            assert httpx.get(f"{server.url}/health", timeout=10).json()["in_flight"] >= 1
            _post(server, CMPL, {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 4, "temperature": 1e-300})
            for line in lines:
                events += sse_events([line])
    assert events[-1] == "[DONE]"
    chunks = json_events(events)
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
    assert [c["usage"] for c in chunks if c.get("usage")][-1]["completion_tokens"] == 4 * 120


# ---- request size ------------------------------------------------------------------------------
def _big_body(size):
    return json.dumps({"model": SERVED_NAME, "prompt": "x" * size, "max_tokens": 2}).encode()


def test_body_over_limit_413(healthy):
    body = _big_body(MAX_REQUEST_BYTES)
    assert len(body) > MAX_REQUEST_BYTES
    err = assert_error(_post(healthy, CMPL, content=body), 413)
    assert str(MAX_REQUEST_BYTES) in err["message"]
    assert_error(_post(healthy, CHAT, content=body), 413)


def test_chunked_body_over_limit_413(healthy):
    body = _big_body(3 * MAX_REQUEST_BYTES)

    def chunks():
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    with httpx.Client(timeout=60) as http:
        r = http.post(f"{healthy.url}{CMPL}", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in r.request.headers
        assert r.request.headers["transfer-encoding"] == "chunked"
    err = assert_error(r, 413)
    assert str(MAX_REQUEST_BYTES) in err["message"]


def test_chunked_body_under_limit_ok(healthy):
    # greedy: with the server's default sampling an end-of-sequence token could end it after one token
    body = json.dumps({"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()

    def chunks():
        yield body[:7]
        yield body[7:]

    r = httpx.post(f"{healthy.url}{CMPL}", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_body_at_limit_ok(healthy):
    small = json.dumps({"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2}).encode()
    body = small + b" " * (MAX_REQUEST_BYTES - len(small))  # JSON whitespace up to exactly the limit
    assert len(body) == MAX_REQUEST_BYTES
    r = _post(healthy, CMPL, content=body)
    assert r.status_code == 200, r.text


# ---- --max-tokens-limit and --api-key (second server) ------------------------------------------
def test_max_tokens_limit(aux_server):
    auth = aux_server.headers()
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT, "temperature": 0}
    r = _post(aux_server, CMPL, ok, headers=auth)
    assert r.status_code == 200, r.text
    err = assert_error(_post(aux_server, CMPL, {**ok, "max_tokens": MAX_TOKENS_LIMIT + 1}, headers=auth), 400,
                       param="max_tokens")
    assert str(MAX_TOKENS_LIMIT) in err["message"]
    assert_error(_post(aux_server, CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": MAX_TOKENS_LIMIT + 1},
                       headers=auth), 400, param="max_tokens")
    # without max_tokens the server's default still works
    assert _post(aux_server, CMPL, {"model": MODEL, "prompt": "hi"}, headers=auth).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"}],
                         ids=["none", "wrong", "no-scheme", "basic", "prefix"])
def test_api_key_required(aux_server, headers):
    for method, path, body in [("POST", CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                               ("POST", CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 2}),
                               ("GET", "/v1/models", None)]:
        r = httpx.request(method, f"{aux_server.url}{path}", json=body, headers=headers, timeout=30)
        err = assert_error(r, 401, code="invalid_api_key")
        assert err["type"] == "authentication_error"


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})])
def test_api_key_guards_tokenize_and_detokenize(aux_server, path, body):
    body = {"model": aux_server.model, **body}
    assert_error(_post(aux_server, path, body), 401, code="invalid_api_key")
    assert _post(aux_server, path, body, headers={"authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_tool_choice_auto_needs_a_tool_call_parser(aux_server):
    """The aux server has no --tool-call-parser: 'auto' (the default with tools) could not find
    the calls, and says so."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = httpx.post(f"{aux_server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "messages": MSGS, "tools": tools, "max_tokens": 2}, timeout=60)
    err = assert_error(r, 400, param="tool_choice")
    assert "--tool-call-parser" in err["message"]


def test_api_key_accepted(aux_server):
    client = aux_server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    assert client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2).choices[0].finish_reason
    bad = openai.OpenAI(base_url=f"{aux_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_api_key_health_and_metrics_open(aux_server):
    assert httpx.get(f"{aux_server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{aux_server.url}/metrics", timeout=10).status_code == 200
