"""Tool calls out of a chat answer's text, whole or as it streams.

A model asked to call a function writes the call in its own format; a parser finds the calls
and leaves the rest as content. One parser object follows one choice: ``feed`` takes each new
piece of text and returns the content that can go out now and the tool-call pieces found, so a
whole answer is one ``feed(text, final=True)`` and a stream is many: the two cannot disagree.

- ``hermes`` (Hermes, Qwen 2.5 / 3 and the presets' template): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, any number, with text around them. A tag whose body is not
  a JSON object with a string ``name`` stays content, as does an unclosed one.
- ``llama3_json`` (Llama 3.1 / 3.2 JSON tool calling): the whole answer is ``{"name": ...,
  "parameters": {...}}`` (``arguments`` also accepted), optionally after ``<|python_tag|>``, several
  separated by ``;``. An answer that does not parse that way is content, whole.
- ``pythonic`` (Llama 3.2 / 4's pythonic calls): the whole answer is a Python list of calls,
  ``[get_weather(city="Paris"), get_time()]``, arguments given by keyword as literals (read with
  ``ast``, never evaluated). An answer that does not parse that way is content, whole.
- ``mistral`` (Mistral / Mixtral instruct models): text, then ``[TOOL_CALLS]`` and the calls to the
  end of the answer, either a JSON array of ``{"name", "arguments"}`` (v0.3 tokenizers) or
  ``name[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]`` (v11 and later). The marker is
  a special token: the server keeps special tokens in such answers' text (as vLLM does). What
  follows a marker that does not parse that way is content, marker included.
- ``NamedCall``: ``tool_choice`` named one function; the output (constrained to its parameters'
  schema) is the arguments, streamed as they come.
- ``RequiredCalls``: ``tool_choice: "required"``; the output (constrained to a JSON array of
  ``{"name", "parameters"}``) gives each call as soon as its element is complete.

Content that is only whitespace beside a call (the newlines templates put around tags) is not
content; an answer without calls is returned exactly as generated.
"""

import ast
import json
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")
# the parsers whose marker is a special token: answers they read keep special tokens in their text
KEEP_SPECIAL_TOKENS = ("mistral",)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of one tool call: the first piece of a call has its ``id`` and ``name``, later
    ones only more ``arguments`` text (OpenAI's streaming shape)."""

    index: int  # the call's position among the choice's calls
    arguments: str
    id: Optional[str] = None
    name: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        function: Dict[str, Any] = {"arguments": self.arguments}
        out: Dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, **function}
        out["function"] = function
        return out


Feed = Tuple[str, List[ToolCallDelta]]


def merge_calls(deltas: List[ToolCallDelta]) -> List[Dict[str, Any]]:
    """Whole tool calls (``{"id", "type", "function": {"name", "arguments"}}``) from their pieces."""
    calls: List[Dict[str, Any]] = []
    for d in deltas:
        if d.id is not None:
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        calls[d.index]["function"]["arguments"] += d.arguments
    return calls


class ToolCallParser:
    """The base: everything is content. ``single``: only the first call is kept
    (``parallel_tool_calls: false``)."""

    def __init__(self, single: bool = False):
        self.single = single
        self.calls = 0  # calls given out
        self._pending_space = ""  # whitespace held back: content unless a call follows it

    def feed(self, text: str, final: bool = False) -> Feed:
        return text, []

    # ---- helpers for the parsers ----------------------------------------------------------------
    def _call(self, name: str, arguments: Any) -> List[ToolCallDelta]:
        if self.single and self.calls >= 1:
            return []
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self.calls += 1
        return [ToolCallDelta(self.calls - 1, args, new_call_id(), name)]

    def _content(self, text: str, call_follows: bool = False, final: bool = False) -> str:
        """Content to send now. Trailing whitespace is held back until it is known what follows
        it: more text (then it is sent), a call (dropped), or the end of an answer that made a
        call (dropped). Without calls, what is sent joins to exactly the generated text."""
        text = self._pending_space + text
        self._pending_space = ""
        if call_follows:
            return text.rstrip()
        if final:
            return "" if self.calls and not text.strip() else text
        kept = text.rstrip()
        self._pending_space = text[len(kept):]
        return kept


class HermesParser(ToolCallParser):
    """A call's tag ends at the first closing tag, even one inside a JSON string of its body
    (which then is not a call: content), as other Hermes parsers read it: a stream cannot take
    back what it sent."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, single: bool = False):
        super().__init__(single)
        self._buffer = ""  # text not decided yet: a partial opening tag, or an open call's body

    def feed(self, text: str, final: bool = False) -> Feed:
        self._buffer += text
        content: List[str] = []
        deltas: List[ToolCallDelta] = []
        while True:
            start = self._buffer.find(self.OPEN)
            end = self._buffer.find(self.CLOSE, start + len(self.OPEN)) if start >= 0 else -1
            if end < 0:
                break
            call = _named_object(self._buffer[start + len(self.OPEN):end], ("arguments",))
            if call is None:  # not a call after all: the tag and its body are content
                content.append(self._content(self._buffer[:end + len(self.CLOSE)]))
            else:
                content.append(self._content(self._buffer[:start], call_follows=True))
                deltas += self._call(*call)
            self._buffer = self._buffer[end + len(self.CLOSE):]
        start = self._buffer.find(self.OPEN)
        if final:
            content.append(self._content(self._buffer, final=True))
            self._buffer = ""
        else:  # send what is decided; keep an open call, or what could still become its tag
            keep = len(self._buffer) - start if start >= 0 else _partial_suffix(self._buffer, self.OPEN)
            content.append(self._content(self._buffer[:len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]
        return "".join(content), deltas


class _WholeAnswerParser(ToolCallParser):
    """Formats where the calls are the whole answer: held from where its first characters say it
    is calls (``_opens``) to the end, then read at once (``_read``); content as it comes otherwise."""

    def __init__(self, single: bool = False):
        super().__init__(single)
        self._text = ""
        self._holding: Optional[bool] = None  # None: undecided (only whitespace so far)

    def _opens(self, head: str) -> Optional[bool]:
        """Whether an answer starting with ``head`` (no leading whitespace) is calls; None: too
        early to say."""
        raise NotImplementedError

    def _read(self, text: str) -> Optional[List[Tuple[str, Any]]]:
        raise NotImplementedError

    def feed(self, text: str, final: bool = False) -> Feed:
        self._text += text
        if self._holding is None:
            head = self._text.lstrip()
            self._holding = self._opens(head) if head else None
            if self._holding is None and not final:
                return "", []
        if not self._holding or not final:
            out, self._text = ("", self._text) if self._holding else (self._text, "")
            return out, []
        calls = self._read(self._text.strip())
        if calls is None:  # not calls after all: the whole answer is content
            return self._text, []
        deltas: List[ToolCallDelta] = []
        for name, arguments in calls:
            deltas += self._call(name, arguments)
        return "", deltas


class Llama3JsonParser(_WholeAnswerParser):
    """Calls from a first ``{`` (or the python tag) on."""

    TAG = "<|python_tag|>"

    def _opens(self, head: str) -> Optional[bool]:
        if head.startswith("{") or head.startswith(self.TAG):
            return True
        return None if self.TAG.startswith(head) else False

    def _read(self, text: str) -> Optional[List[Tuple[str, Any]]]:
        return _llama3_calls(text)


class PythonicParser(_WholeAnswerParser):
    """Calls from an opening ``[`` on, read as a list of calls."""

    def _opens(self, head: str) -> Optional[bool]:
        return head.startswith("[")

    def _read(self, text: str) -> Optional[List[Tuple[str, Any]]]:
        return _pythonic_calls(text)


class MistralParser(ToolCallParser):
    """Content until the first ``[TOOL_CALLS]``; from there to the end, the calls."""

    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, single: bool = False):
        super().__init__(single)
        self._buffer = ""  # a partial marker, or everything from the marker on
        self._calls_follow = False  # the marker was seen

    def feed(self, text: str, final: bool = False) -> Feed:
        self._buffer += text
        content = ""
        if not self._calls_follow:
            at = self._buffer.find(self.MARKER)
            if at < 0:
                keep = 0 if final else _partial_suffix(self._buffer, self.MARKER)
                sent, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return self._content(sent, final=final), []
            content, self._buffer, self._calls_follow = self._content(self._buffer[:at]), self._buffer[at:], True
        if not final:
            return content, []
        calls = _mistral_calls(self._buffer)
        if calls is None:  # not calls after all: content, marker included
            return content + self._content(self._buffer, final=True), []
        deltas: List[ToolCallDelta] = []
        for name, arguments in calls:
            deltas += self._call(name, arguments)
        return content + self._content("", call_follows=True), deltas


class NamedCall(ToolCallParser):
    """The whole output is the arguments of one named function, streamed as they come."""

    def __init__(self, name: str):
        super().__init__(single=True)
        self.name = name

    def feed(self, text: str, final: bool = False) -> Feed:
        if self.calls == 0:
            return "", self._call(self.name, text)
        return "", [ToolCallDelta(0, text)] if text else []


class RequiredCalls(ToolCallParser):
    """The output is a JSON array of ``{"name", "parameters"}``: each call is given as soon as its
    element is complete; whatever does not parse when the output ends (cut by ``max_tokens``)
    is content."""

    def __init__(self, single: bool = False):
        super().__init__(single)
        self._text = ""
        self._pos = 0  # where the next element (or the array's opening) starts
        self._opened = False

    def feed(self, text: str, final: bool = False) -> Feed:
        self._text += text
        deltas: List[ToolCallDelta] = []
        decoder = json.JSONDecoder()
        while True:
            rest = self._text[self._pos:]
            skip = len(rest) - len(rest.lstrip())
            rest = rest[skip:]
            if not self._opened:
                if not rest.startswith("["):
                    break
                self._opened, self._pos = True, self._pos + skip + 1
                continue
            if rest[:1] in (",", "]"):
                self._pos += skip + 1
                continue
            try:
                element, used = decoder.raw_decode(rest)
            except ValueError:
                break
            if not (isinstance(element, dict) and isinstance(element.get("name"), str)):
                break
            self._pos += skip + used
            deltas += self._call(element["name"], element.get("parameters", {}))
        content = ""
        if final and self._text[self._pos:].strip() not in ("", "]"):
            content = self._text if not self.calls else self._text[self._pos:]
        return content, deltas


def make_parser(kind: str, single: bool = False) -> ToolCallParser:
    """A parser for one choice of an answer under ``tool_choice: "auto"``."""
    if kind == "hermes":
        return HermesParser(single)
    if kind == "llama3_json":
        return Llama3JsonParser(single)
    if kind == "pythonic":
        return PythonicParser(single)
    if kind == "mistral":
        return MistralParser(single)
    raise ValueError(f"unknown tool-call parser {kind!r}; one of {list(PARSERS)}")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _named_object(text: str, argument_keys: Tuple[str, ...]) -> Optional[Tuple[str, Any]]:
    """``(name, arguments)`` when ``text`` is a JSON object with a string ``name`` and its
    arguments (an object, or absent: none) under one of ``argument_keys``; else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in argument_keys:
        if key in obj:
            return (obj["name"], obj[key]) if isinstance(obj[key], dict) else None
    return obj["name"], {}


def _llama3_calls(text: str) -> Optional[List[Tuple[str, Any]]]:
    if text.startswith(Llama3JsonParser.TAG):
        text = text[len(Llama3JsonParser.TAG):].lstrip()
    decoder = json.JSONDecoder()
    calls: List[Tuple[str, Any]] = []
    pos = 0
    while pos < len(text):
        try:
            obj, used = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = _named_object(json.dumps(obj), ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        pos = used
        rest = text[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return None
        pos = len(text) - len(rest)
    return calls or None


def _pythonic_calls(text: str) -> Optional[List[Tuple[str, Any]]]:
    """``[f(a=1), g()]`` as ``[("f", {"a": 1}), ("g", {})]``; None unless it is exactly a list of
    calls of plain names with keyword arguments whose values are literals."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls: List[Tuple[str, Any]] = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            json.dumps(arguments)  # (a set or bytes literal has no JSON form)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append((node.func.id, arguments))
    return calls


def _mistral_calls(text: str) -> Optional[List[Tuple[str, Any]]]:
    """The calls after ``[TOOL_CALLS]`` (``text`` starts with it): a JSON array of ``{"name",
    "arguments"}``, or ``name[ARGS]{...}`` after each marker; None when it is neither."""
    body = text[len(MistralParser.MARKER):].strip()
    if body.startswith("["):
        try:
            items = json.loads(body)
        except ValueError:
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = [_named_object(json.dumps(item), ("arguments",)) for item in items]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
    out: List[Tuple[str, Any]] = []
    for part in text.split(MistralParser.MARKER)[1:]:
        name, found, arguments = part.partition(MistralParser.ARGS)
        name = name.strip()
        if not found or not name or any(c.isspace() or c in "[]{}" for c in name):
            return None
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        out.append((name, parsed))
    return out or None
