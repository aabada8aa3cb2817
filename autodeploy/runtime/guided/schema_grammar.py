"""A JSON Schema's recognizer: its regex on ``regex_dfa``, or, when it recurses (a tree, a linked
list, a reference to ``"#"``), its rules on ``grammar_automaton``'s pushdown recognizer.

``json_schema.compile_schema`` writes each recursive reference into the regexes as one placeholder
character and compiles the referenced schema once, as a rule. Here each regex is parsed with
``regex_dfa``'s parser (which reads a placeholder as one code point), and its tree becomes a
grammar tree, a placeholder a reference to its rule: one grammar, whose ``root`` is the schema's
regex. A schema whose recursion has no finite instance (a required property holding the schema
itself) or recurses before any text (``{"anyOf": [{"$ref": "#"}, ...]}``) is refused by the
recognizer's checks, named.
"""

from typing import Any, Dict, Union

from .errors import GuidedDecodingError
from .grammar import Alternatives, CharClass, Node, Repeat, RuleRef, Sequence
from .grammar_automaton import GrammarAutomaton
from .json_schema import WHITESPACE, compile_schema
from .regex_dfa import RegexAutomaton
from .regex_parser import _Alt, _Chars, _Concat, _Node, _Parser


def schema_recognizer(schema: Union[dict, bool, str], whitespace: str = WHITESPACE) -> Any:
    """The full-match recognizer of the JSON texts valid against ``schema`` (see ``json_schema``)."""
    regex, rules = compile_schema(schema, whitespace)
    if not rules:
        return RegexAutomaton(regex)
    names = {ord(mark): name for mark, (name, _) in rules.items()}
    grammar = {"root": _grammar_tree(_Parser(regex, placeholders=True).parse(), names)}
    for name, rule in rules.values():
        grammar[name] = _grammar_tree(_Parser(rule, placeholders=True).parse(), names)
    try:
        return GrammarAutomaton(grammar)
    except GuidedDecodingError as exc:
        raise GuidedDecodingError(f"The JSON Schema recurses in a way guided decoding cannot generate (in the "
                                  f"grammar of its recursion, 'root' is the schema itself): {exc}") from None


def _grammar_tree(tree: _Node, names: Dict[int, str]) -> Node:
    """A regex tree as a grammar tree; a placeholder code point is a reference to its rule."""
    if isinstance(tree, _Chars):
        ranges = tree.ranges
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1] and ranges[0][0] in names:
            return RuleRef(names[ranges[0][0]])
        return CharClass(tree.ranges)
    if isinstance(tree, _Concat):
        return Sequence(tuple(_grammar_tree(item, names) for item in tree.items))
    if isinstance(tree, _Alt):
        return Alternatives(tuple(_grammar_tree(option, names) for option in tree.options))
    return Repeat(_grammar_tree(tree.item, names), tree.low, tree.high)
