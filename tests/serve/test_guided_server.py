"""Structured output on the real server: OpenAI's ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` / ``structured_outputs`` give the answer the Python API gives with the same ``guided`` parameters
(greedy and seeded), whole and streamed, and the answer satisfies the constraint where it
finished. Malformed constraints are 400s (``test_bad_input``)."""

import json
import re

import httpx
import pytest

from autodeploy import SamplingParams

from serve_utils import SERVED_NAME, json_events, sse_events

PROMPT = "The quick brown fox"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
          "required": ["ok", "size"]}
MAX_TOKENS = 40
GRAMMAR = 'root ::= word ("-" [0-9]{2})?\nword ::= [a-z]{2,5}'
NESTED = 'root ::= "(" root ")" | [a-z]{1,8}'  # recursive: the pushdown recognizer
# (request fields, the same constraint for the Python API)
CASES = [
    pytest.param({"guided_json": SCHEMA}, {"json": SCHEMA}, id="guided_json"),
    pytest.param({"guided_regex": "[a-z]{2,5}-[0-9]{2}"}, {"regex": "[a-z]{2,5}-[0-9]{2}"}, id="guided_regex"),
    pytest.param({"guided_choice": ["red", "green"]}, {"choice": ["red", "green"]}, id="guided_choice"),
    pytest.param({"structured_outputs": {"choice": ["up", "down"]}}, {"choice": ["up", "down"]},
                 id="structured_outputs"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
                 {"json": SCHEMA}, id="response_format-json_schema"),
    pytest.param({"response_format": {"type": "json_object"}}, {"json_object": True}, id="response_format-json_object"),
    pytest.param({"guided_grammar": GRAMMAR}, {"grammar": GRAMMAR}, id="guided_grammar"),
    pytest.param({"structured_outputs": {"grammar": GRAMMAR}}, {"grammar": GRAMMAR}, id="structured_outputs-grammar"),
    pytest.param({"guided_grammar": NESTED}, {"grammar": NESTED}, id="guided_grammar-recursive"),
]


def _post(server, path, body):
    return httpx.post(f"{server.url}{path}", json={"model": SERVED_NAME, **body}, timeout=120)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 7)])
@pytest.mark.parametrize("fields, guided", CASES)
def test_completion_is_the_python_apis_guided_answer(server, llm, fields, guided, temperature, seed):
    kw = dict(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed)
    (ref,) = llm.generate(PROMPT, SamplingParams(**kw, guided=guided))
    out = _post(server, "/v1/completions", {"prompt": PROMPT, **kw, **fields})
    assert out.status_code == 200, out.text
    choice = out.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (ref.outputs[0].text, ref.outputs[0].finish_reason)
    if choice["finish_reason"] == "stop":
        _check(guided, choice["text"])


def _check(guided, text):
    if "choice" in guided:
        assert text in guided["choice"]
    elif "regex" in guided:
        assert re.fullmatch(guided["regex"], text)
    elif guided.get("grammar") == NESTED:
        m = re.fullmatch(r"(\(*)[a-z]{1,8}(\)*)", text)
        assert m and len(m.group(1)) == len(m.group(2))  # NESTED's language, by hand
    elif "grammar" in guided:
        assert re.fullmatch(r"[a-z]{2,5}(-[0-9]{2})?", text)  # GRAMMAR's language, by hand
    else:
        value = json.loads(text)
        assert isinstance(value, dict)
        if "json" in guided:
            assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in "sml"


def test_streamed_chat_with_a_json_schema_is_the_whole_answer(server, llm):
    fields = {"messages": [{"role": "user", "content": "Is it big?"}], "max_tokens": MAX_TOKENS, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}}
    whole = _post(server, "/v1/chat/completions", fields).json()["choices"][0]
    streamed = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                          json={"model": SERVED_NAME, **fields, "stream": True})
    events = json_events(sse_events(streamed.text.splitlines()))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == whole["message"]["content"]
    assert whole["finish_reason"] == "stop"
    _check({"json": SCHEMA}, text)
    (ref,) = llm.chat([{"role": "user", "content": "Is it big?"}],
                      SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guided={"json": SCHEMA}))
    assert text == ref.outputs[0].text


def test_the_openai_client_sends_response_format(server):
    res = server.client().chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Colour?"}], max_tokens=8, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": {"enum": ["a", "b"]}}})
    assert res.choices[0].message.content in ('"a"', '"b"')
