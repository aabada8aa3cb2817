"""``GuidedDecodingParams``: what a request's output must match (vLLM's guided decoding fields).

Exactly one of:

* ``json``: a JSON Schema (a dict, or its JSON text); the output is one JSON text valid under it,
  within the subset ``json_schema`` supports (properties in the schema's order, bounded
  whitespace; unsupported keywords are refused, never ignored); a recursive schema runs on the
  pushdown recognizer (``schema_grammar``);
* ``regex``: the output matches the regular expression in full (``regex_dfa``'s subset of
  Python's syntax);
* ``choice``: the output is one of these strings;
* ``grammar``: a GBNF grammar (vLLM's ``guided_grammar``): the output matches its ``root`` rule
  (a regular one runs as a regular expression, a recursive one on a pushdown recognizer; left
  recursion is refused, see ``grammar_automaton``);
* ``json_object``: the output is one JSON object, any keys (OpenAI's JSON mode).

``whitespace_pattern`` (vLLM's name; with ``json`` only) is the regular expression of the
whitespace allowed between JSON tokens. The default, ``SCHEMA_WHITESPACE``, is at most one space:
the compact one-line form models write in JSON mode. An unbounded pattern lets a model pad its
answer with whitespace until ``max_tokens`` (small and quantized models do), which is why it is
not the default; a pretty-printing model is steered to the compact form instead.

The automaton is compiled when the parameters are made, so a bad schema or pattern is a request
error at once (a 400 at the server); compiled automata are cached by their source, so a schema
sent with every request is compiled once.
"""

import functools
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from .errors import GuidedDecodingError
from .json_automaton import JsonObjectAutomaton

SCHEMA_WHITESPACE = "[ ]?"
_KINDS = ("json", "regex", "choice", "grammar")
_REGEX_SPECIAL = set('\\.^$*+?{}[]|()-/"')
_ESCAPED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def escape_regex(text: str) -> str:
    """``text`` as a regular expression matching exactly it (in ``regex_dfa``'s syntax)."""
    return "".join(_ESCAPED.get(c, "\\" + c if c in _REGEX_SPECIAL else c) for c in text)


@dataclass(frozen=True)
class GuidedDecodingParams:
    json: Optional[Union[Dict[str, Any], str, bool]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    whitespace_pattern: Optional[str] = None

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            raise GuidedDecodingError(f"guided json_object must be true or false, got {self.json_object!r}")
        if len(given) != 1:
            raise GuidedDecodingError(
                "guided decoding takes exactly one of json (a JSON Schema), regex, choice, grammar or json_object; "
                + (f"got {', '.join(given)}" if given else "got none"))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise GuidedDecodingError(f"guided {name} must be a string, got {type(getattr(self, name)).__name__}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise GuidedDecodingError("guided choice must be a non-empty list of non-empty strings")
        if self.whitespace_pattern is not None and (self.json is None or not isinstance(self.whitespace_pattern, str)):
            raise GuidedDecodingError(
                "guided whitespace_pattern (a regular expression) goes with json (a JSON Schema) only")
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise GuidedDecodingError(
                f"guided json must be a JSON Schema (an object, or its JSON text), got {type(self.json).__name__}")
        self.automaton()  # compile now: a bad schema or pattern is an error of this request

    @property
    def kind(self) -> str:
        return next(n for n in _KINDS if getattr(self, n) is not None) \
            if not self.json_object else "json_object"

    def source(self) -> str:
        """The canonical text of the constraint (the cache key of its automaton)."""
        if self.json_object:
            return ""
        if self.json is not None:
            # keys in the user's order: properties are generated in the schema's order
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.regex is not None:
            return self.regex
        if self.grammar is not None:
            return self.grammar
        return json.dumps(list(self.choice or []))

    def automaton(self) -> Any:
        """The compiled recognizer (shared between requests with the same constraint)."""
        return _compile(self.kind, self.source(), self.whitespace_pattern or SCHEMA_WHITESPACE)


@functools.lru_cache(maxsize=16)
def _compile(kind: str, source: str, whitespace: str) -> Any:
    from .regex_dfa import RegexAutomaton

    if kind == "json_object":
        return JsonObjectAutomaton()
    if kind == "regex":
        return RegexAutomaton(source)
    if kind == "choice":
        return RegexAutomaton("|".join(f"(?:{escape_regex(c)})" for c in json.loads(source)))
    if kind == "grammar":
        from .grammar_automaton import grammar_recognizer

        return grammar_recognizer(source)
    from .schema_grammar import schema_recognizer

    return schema_recognizer(source, whitespace=whitespace)
