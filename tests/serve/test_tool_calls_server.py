"""Function calling on the real server (``--tool-call-parser hermes``): the tools reach the chat
template, a forced ``tool_choice`` constrains the output to calls, ``auto`` finds the calls the
model wrote, and whole and streamed answers agree.

The reference for each answer is the same server's plain completion of the prompt this test
renders itself with the checkpoint's tokenizer (``apply_chat_template(..., tools=...)``) under
the constraint the tool choice stands for, written out here independently of the server's own.
Malformed tool requests are 400s naming the field (here; ``auto`` without a parser in
``test_bad_input``); the parsers alone are ``test_tool_parsers``."""

import json

import httpx
import pytest
from transformers import AutoTokenizer

from autodeploy.models.presets import preset_dir

from serve_utils import MODEL, TOOLS_TEMPLATE, json_events, sse_events

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 48
# the array ``tool_choice: "required"`` stands for: one of the tools per element
REQUIRED = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["name", "parameters"],
     "properties": {"name": {"const": t["function"]["name"]}, "parameters": t["function"]["parameters"]}}
    for t in TOOLS]}}


@pytest.fixture(scope="module")
def tokenizer():
    """The checkpoint's tokenizer with the template the tools server was given."""
    tok = AutoTokenizer.from_pretrained(preset_dir(MODEL))
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def _chat(server, **fields):
    return _chat_response(server, **fields)["choices"][0]


def _chat_response(server, **fields):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": MSGS, "tools": TOOLS, "max_tokens": MAX_TOKENS, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def _reference(server, tokenizer, messages=MSGS, tools=TOOLS, **fields):
    """The plain completion of the prompt rendered here: its text, finish reason and length."""
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, **fields})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]


def _streamed(server, **fields):
    """A streamed answer put together as a client does: content joined, each call's pieces
    merged by index (its id, type and name come with its first piece)."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": MSGS, "tools": TOOLS, "max_tokens": MAX_TOKENS, "stream": True, **fields})
    assert r.status_code == 200, r.text
    content, calls, finish = "", [], None
    for event in json_events(sse_events(r.text.splitlines())):
        (choice,) = event["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            if piece["index"] == len(calls):
                assert piece["id"].startswith("call_") and piece["type"] == "function", piece
                calls.append({"id": piece["id"], "type": "function",
                              "function": {"name": piece["function"]["name"], "arguments": ""}})
            else:
                assert "id" not in piece and "name" not in piece["function"], piece
            calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content or None, calls, finish


def _without_ids(calls):
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    assert len({c["id"] for c in calls}) == len(calls)
    return [c["function"] for c in calls]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.9, 11)])
def test_named_tool_choice_gives_the_arguments_the_schema_constrains(tools_server, tokenizer, temperature, seed):
    kw = dict(temperature=temperature, seed=seed)
    choice = _chat(tools_server, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    text, finish, _ = _reference(tools_server, tokenizer, guided_json=WEATHER["function"]["parameters"], **kw)
    message = choice["message"]
    assert message["content"] is None
    assert _without_ids(message["tool_calls"]) == [{"name": "get_weather", "arguments": text}]
    assert choice["finish_reason"] == finish == "stop"  # OpenAI's for a named function
    args = json.loads(text)
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7


@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_choice_gives_each_call_of_the_constrained_array(tools_server, tokenizer, parallel):
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    # seed 0 makes two calls when it may (so one is a real limit); the preset's 512 tokens spell
    # JSON almost byte by byte, hence the room
    kw = dict(temperature=0.9, seed=0, max_tokens=160)
    response = _chat_response(tools_server, tool_choice="required", **kw, **fields)
    choice = response["choices"][0]
    schema = dict(REQUIRED, maxItems=1) if parallel is False else REQUIRED
    text, finish, length = _reference(tools_server, tokenizer, guided_json=schema, **kw)
    assert response["usage"]["completion_tokens"] == length  # the same output, not a longer one cut to fit
    assert finish == "stop", text  # the array closed within MAX_TOKENS
    expected = [{"name": c["name"], "arguments": c["parameters"]} for c in json.loads(text)]
    got = [{"name": f["name"], "arguments": json.loads(f["arguments"])}
           for f in _without_ids(choice["message"]["tool_calls"])]
    assert got == expected and (len(got) == 1 if parallel is False else len(got) >= 2)
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"


SECTION = {"type": "object", "required": ["title"], "properties": {
    "title": {"enum": ["Intro", "Body", "End"]}, "parts": {"type": "array", "items": {"$ref": "#/$defs/Section"}}}}
OUTLINE = {"type": "function", "function": {"name": "outline", "parameters": {
    "$defs": {"Section": SECTION}, "type": "object", "required": ["sections"],
    "properties": {"sections": {"type": "array", "items": {"$ref": "#/$defs/Section"}, "minItems": 1}}}}}
# what ``required`` stands for with OUTLINE alone, written by hand: its definitions at the root
OUTLINE_CALL = {"$defs": {"Section": SECTION, "Outline": {
    "type": "object", "required": ["sections"],
    "properties": {"sections": {"type": "array", "items": {"$ref": "#/$defs/Section"}, "minItems": 1}}}},
    "type": "array", "minItems": 1, "maxItems": 1, "items": {
        "type": "object", "required": ["name", "parameters"],
        "properties": {"name": {"const": "outline"}, "parameters": {"$ref": "#/$defs/Outline"}}}}


def test_required_tool_choice_takes_a_tool_with_definitions_and_recursion(tools_server, tokenizer):
    """A tool whose parameters refer to their own ``$defs`` (as pydantic writes them), here
    recursively: the server moves them under the array it constrains to, and runs the recursion
    on the pushdown recognizer."""
    kw = dict(temperature=0.9, seed=7, max_tokens=160)  # seed 7 nests a section in a section
    response = _chat_response(tools_server, tools=[OUTLINE], tool_choice="required", parallel_tool_calls=False, **kw)
    text, finish, length = _reference(tools_server, tokenizer, tools=[OUTLINE], guided_json=OUTLINE_CALL, **kw)
    assert response["usage"]["completion_tokens"] == length
    assert finish == "stop", text
    (call,) = json.loads(text)
    assert any(section.get("parts") for section in call["parameters"]["sections"]), text
    (got,) = _without_ids(response["choices"][0]["message"]["tool_calls"])
    assert got["name"] == "outline" and json.loads(got["arguments"]) == call["parameters"]


# the model is made to write a Hermes call (a regex constraint; tool_choice stays 'auto'); ~75 tokens
HERMES_CALL = r'Sure\.\n<tool_call>\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}</tool_call>'


def test_auto_finds_the_call_the_model_wrote(tools_server):
    choice = _chat(tools_server, guided_regex=HERMES_CALL, temperature=0, max_tokens=120)
    message = choice["message"]
    assert message["content"] == "Sure."
    (call,) = _without_ids(message["tool_calls"])
    assert call["name"] == "get_time" and json.loads(call["arguments"])["tz"] in ("UTC", "CET")
    assert choice["finish_reason"] == "tool_calls"


def test_auto_without_a_call_is_the_plain_answer(tools_server, tokenizer):
    choice = _chat(tools_server, temperature=0)  # tool_choice defaults to 'auto' with tools
    text, finish, _ = _reference(tools_server, tokenizer, temperature=0)
    assert "<tool_call>" not in text
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == finish


def test_tool_choice_none_shows_the_tools_and_answers_in_text(tools_server, tokenizer):
    choice = _chat(tools_server, tool_choice="none", guided_regex=HERMES_CALL, temperature=0, max_tokens=120)
    text, _, _ = _reference(tools_server, tokenizer, guided_regex=HERMES_CALL, temperature=0, max_tokens=120)
    assert choice["message"] == {"role": "assistant", "content": text}  # not parsed: 'none' makes no calls
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("fields", [
    pytest.param({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, id="named"),
    pytest.param({"tool_choice": "required"}, id="required"),
    pytest.param({"guided_regex": HERMES_CALL, "max_tokens": 120}, id="auto"),
    pytest.param({}, id="auto-no-call"),
])
def test_streamed_answer_is_the_whole_answer(tools_server, fields):
    whole = _chat(tools_server, temperature=0, **fields)
    content, calls, finish = _streamed(tools_server, temperature=0, **fields)
    assert content == whole["message"]["content"]
    assert _without_ids(calls) == _without_ids(whole["message"].get("tool_calls") or [])
    assert finish == whole["finish_reason"]


def test_a_tool_conversation_reaches_the_template(tools_server, tokenizer):
    """An assistant's calls (arguments sent as JSON text) and the tool's answer are rendered as
    the template writes them, not flattened to their text."""
    sent = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."},
    ]
    rendered = MSGS + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."},
    ]
    prompt = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>' in prompt
    r = httpx.post(f"{tools_server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": sent, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    text, _, _ = _reference(tools_server, tokenizer, messages=rendered, max_tokens=8, temperature=0)
    assert r.json()["choices"][0]["message"]["content"] == text
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def test_the_openai_client_calls_a_tool(tools_server):
    client = tools_server.client()
    res = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=MAX_TOKENS,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = res.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=MAX_TOKENS,
                                            tool_choice="required", temperature=0, stream=True)
    pieces = [tc for chunk in stream for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert pieces and pieces[0].function.name in ("get_weather", "get_time")


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("fields, param", [
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_rain"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": NAMED, "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "patternProperties": {"a": {}}}}}], "tool_choice": NAMED}, "tools"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages"),
])
def test_malformed_tool_requests_are_400s_naming_the_field(tools_server, fields, param):
    body = {"model": MODEL, "messages": MSGS, "tools": TOOLS, "max_tokens": 2, **fields}
    r = httpx.post(f"{tools_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == param, r.text


def test_tokenize_renders_the_tools(tools_server, tokenizer):
    prompt = tokenizer.apply_chat_template(MSGS, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    r = httpx.post(f"{tools_server.url}/tokenize", json={"model": MODEL, "messages": MSGS, "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
