"""The tool-call parsers alone: what is a call and what stays content, for every format, and a
stream fed in pieces of any size gives exactly what the whole text gives."""

import json

import pytest

from autodeploy.serve.tool_calls import ChatTool, ToolSettings
from autodeploy.serve.tool_parsers import (HermesParser, NamedCall, RequiredCalls, ToolCallDelta, make_parser,
                                           merge_calls)


def _whole(parser, text):
    content, deltas = parser.feed(text, final=True)
    return content, _plain(merge_calls(deltas))


def _plain(calls):
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _streamed(parser, text, step):
    content, deltas = "", []
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        c, d = parser.feed(piece, final=i == len(pieces) - 1)
        content += c
        deltas += d
    return content, _plain(merge_calls(deltas))


CALL_F = '{"name": "f", "arguments": {"a": 1}}'
HERMES = [
    # (text, content, calls)
    ("plain answer  \n", "plain answer  \n", []),
    ("", "", []),
    (f"<tool_call>{CALL_F}</tool_call>", "", [("f", '{"a": 1}')]),
    (f"Let me see.\n<tool_call>\n{CALL_F}\n</tool_call>\n<tool_call>{{\"name\": \"g\"}}</tool_call>\n",
     "Let me see.", [("f", '{"a": 1}'), ("g", "{}")]),
    (f"<tool_call>{CALL_F}</tool_call> and then text", " and then text", [("f", '{"a": 1}')]),
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),  # arguments not an object
    (f"x <tool_call>{CALL_F}", f"x <tool_call>{CALL_F}", []),  # never closed
    ("ends with <tool_c", "ends with <tool_c", []),
    ('{"name": "f", "arguments": {}}', '{"name": "f", "arguments": {}}', []),  # no tag
    ('<tool_call>{"name": "\\u00e9t\\u00e9", "arguments": {"t": "\\u00e9"}}</tool_call>', "",
     [("été", '{"t": "é"}')]),
]


LLAMA3 = [
    ('{"name": "f", "parameters": {"a": 1}}', "", [("f", '{"a": 1}')]),
    ('  <|python_tag|>{"name": "f", "arguments": {}}; {"name": "g", "parameters": {"b": "x"}}', "",
     [("f", "{}"), ("g", '{"b": "x"}')]),
    (" hello {", " hello {", []),
    ("<|python", "<|python", []),
    ('{"name": 1}', '{"name": 1}', []),
    ('{"name": "f", "parameters": {}} trailing', '{"name": "f", "parameters": {}} trailing', []),
    ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),  # cut off
    ("   ", "   ", []),
]


PYTHONIC = [
    ('[get_weather(city="Paris", days=2), get_time()]', "",
     [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")]),
    ('  [f(a=[1, 2.5], b={"k": None}, c=True)]', "", [("f", '{"a": [1, 2.5], "b": {"k": null}, "c": true}')]),
    ("Sure: [f(a=1)]", "Sure: [f(a=1)]", []),  # text first: an answer, not calls
    ("[f(1)]", "[f(1)]", []),  # positional arguments: no names to give them
    ("[f(a=x)]", "[f(a=x)]", []),  # not a literal: never evaluated
    ("[os.system(a='ls')]", "[os.system(a='ls')]", []),  # only plain names
    ("[f(a=1)", "[f(a=1)", []),  # cut off
    ("[1, 2]", "[1, 2]", []),
    ("[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set has no JSON form
]


MISTRAL = [
    # v0.3: a JSON array after the marker; text before it is content
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', "",
     [("f", '{"a": 1}'), ("g", "{}")]),
    ('Checking.\n[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "Checking.", [("f", '{"a": 1}')]),
    # v11+: name[ARGS]{...} after each marker
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("plain [TOOL answer [", "plain [TOOL answer [", []),  # a partial marker mid-text is content
    ("ends with [TOOL_CA", "ends with [TOOL_CA", []),
    ('x [TOOL_CALLS] [{"name": "f", "argu', 'x [TOOL_CALLS] [{"name": "f", "argu', []),  # cut off
    ("[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS]f[ARGS][1]", []),  # arguments not an object
    ("[TOOL_CALLS]two words[ARGS]{}", "[TOOL_CALLS]two words[ARGS]{}", []),
    ('[TOOL_CALLS] {"name": "f"}', '[TOOL_CALLS] {"name": "f"}', []),  # neither format
]


FORMATS = {"hermes": HERMES, "llama3_json": LLAMA3, "pythonic": PYTHONIC, "mistral": MISTRAL}


@pytest.mark.parametrize("kind, text, content, calls", [(kind, *case) for kind, cases in FORMATS.items()
                                                        for case in cases])
@pytest.mark.parametrize("step", [0, 1, 3, 7])  # 0: whole
def test_each_format_whole_and_in_pieces(kind, text, content, calls, step):
    parser = make_parser(kind)
    got = _whole(parser, text) if step == 0 else _streamed(parser, text, step)
    assert got == (content, calls)


def test_mistral_streams_content_before_the_marker_as_it_comes():
    parser = make_parser("mistral")
    assert parser.feed("Let me check [TOO") == ("Let me check", [])  # the space and a partial marker held
    assert parser.feed('L_CALLS][{"name": "f", "arguments": {}}]') == ("", [])
    content, deltas = parser.feed("", final=True)
    assert content == "" and _plain(merge_calls(deltas)) == [("f", "{}")]


REQUIRED = [
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', "", [("f", '{"a": 1}'), ("g", "{}")]),
    ('[ {"name": "f", "parameters": {"a": [1, 2]}} ]', "", [("f", '{"a": [1, 2]}')]),
    # cut by max_tokens: the complete calls, the rest as content
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "para', ' {"name": "g", "para', [("f", '{"a": 1}')]),
    ('[{"name": "f", "para', '[{"name": "f", "para', []),
]


@pytest.mark.parametrize("text, content, calls", REQUIRED)
@pytest.mark.parametrize("step", [0, 1, 5])
def test_required_calls(text, content, calls, step):
    got = _whole(RequiredCalls(), text) if step == 0 else _streamed(RequiredCalls(), text, step)
    assert got == (content, calls)


def test_required_calls_come_as_soon_as_their_element_closes():
    parser = RequiredCalls()
    assert parser.feed('[{"name": "f", "parameters": {"a"') == ("", [])
    content, deltas = parser.feed(': 1}}, {"name"')
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("f", '{"a": 1}')]


def test_named_call_streams_its_arguments():
    parser = NamedCall("f")
    first = parser.feed('{"a"')
    assert first == ("", [ToolCallDelta(0, '{"a"', first[1][0].id, "f")]) and first[1][0].id.startswith("call_")
    assert parser.feed(": 1}", final=True) == ("", [ToolCallDelta(0, ": 1}")])
    assert first[1][0].to_dict() == {"index": 0, "id": first[1][0].id, "type": "function",
                                     "function": {"name": "f", "arguments": '{"a"'}}
    assert ToolCallDelta(0, "x").to_dict() == {"index": 0, "function": {"arguments": "x"}}


@pytest.mark.parametrize("kind", ["hermes", "llama3_json", "pythonic", "mistral"])
def test_single_keeps_the_first_call(kind):
    text = {"hermes": f"<tool_call>{CALL_F}</tool_call><tool_call>{{\"name\": \"g\"}}</tool_call>",
            "llama3_json": '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
            "pythonic": "[f(a=1), g()]",
            "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'}[kind]
    assert _whole(make_parser(kind, single=True), text) == ("", [("f", '{"a": 1}')])
    assert len(_whole(make_parser(kind), text)[1]) == 2


def test_required_single_keeps_the_first_call():
    text = '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {}}]'
    assert _whole(RequiredCalls(single=True), text) == ("", [("f", "{}")])


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        make_parser("granite")


def test_arguments_keep_non_ascii_text():
    _, calls = _whole(HermesParser(), '<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>')
    assert calls == [("f", '{"city": "Zürich"}')] and json.loads(calls[0][1]) == {"city": "Zürich"}


@pytest.mark.parametrize("parser, choice, keeps", [
    ("mistral", None, True), ("mistral", "required", False), ("mistral", "none", False), ("hermes", None, False)])
def test_only_the_mistral_parser_keeps_special_tokens_in_the_answer(parser, choice, keeps):
    """Mistral's ``[TOOL_CALLS]`` is a special token: under ``auto`` with that parser the server
    decodes the answer with special tokens (``chat.py``), as vLLM does; nothing else changes."""
    tool = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})
    assert ToolSettings([tool], choice, None).keeps_special_tokens(parser) is keeps
