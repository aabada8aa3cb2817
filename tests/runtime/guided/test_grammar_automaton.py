"""The pushdown recognizer of recursive GBNF grammars (``grammar_automaton``), against references:

* nested brackets: at every byte of random texts it refuses exactly where a bracket-matching loop
  says no text can follow any more, and accepts exactly the balanced texts;
* arithmetic: it accepts exactly what Python's parser reads as sums, products and brackets of
  numbers;
* recursive grammars of regular languages: byte by byte it refuses and accepts where the DFA of
  the same language's regular expression does (UTF-8 included), and its token masks over a real
  vocabulary equal the DFA's;
* generation: under a recursive grammar equal to a regex, the same tokens as under the regex; under
  a JSON grammar, answers ``json.loads`` reads.
"""

import ast
import json
import random
import re

import pytest

from autodeploy import LLM, SamplingParams
from autodeploy.runtime.guided.errors import GuidedDecodingError
from autodeploy.runtime.guided.grammar_automaton import MAX_DEPTH, GrammarAutomaton, grammar_recognizer
from autodeploy.runtime.guided.regex_dfa import RegexAutomaton
from autodeploy.runtime.guided.token_masks import TokenMasks
from autodeploy.runtime.guided.vocab import vocab_of

BRACKETS = 'root ::= item*\nitem ::= "(" root ")" | "[" root "]" | [a-z]'
ARITHMETIC = ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
              'factor ::= "0"+ | [1-9] [0-9]* | "(" expr ")"')  # Python's integers: no leading zeros
JSON_GRAMMAR = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ws ("," ws string ws ":" ws value ws)* )? "}"
array  ::= "[" ws ( value ws ("," ws value ws)* )? "]"
string ::= "\"" ( [^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
ws     ::= " "?
'''
# recursive grammars whose languages are regular: (grammar, the same language as a regex)
REGULAR = {
    "list": ('root ::= item ("," root)?\nitem ::= "one" | "two" | "three"', r"(one|two|three)(,(one|two|three))*"),
    "unicode": ('root ::= "é" root | "€" | [\\U0001F600-\\U0001F64F] | [à-ÿ]{2}',
                "é*(€|[\U0001F600-\U0001F64F]|[à-ÿ]{2})"),
    "strings": ('root ::= "\\"" chars\nchars ::= [^"\\\\] chars | "\\\\" [nt"] chars | "\\""',
                r'"([^"\\]|\\[nt"])*"'),
}


def _first_refusal(automaton, data: bytes):
    """(bytes consumed before the first refusal, whether all of ``data`` is accepted)."""
    state = automaton.initial
    for i, byte in enumerate(data):
        state = automaton.step(state, byte)
        if state is None:
            return i, False
    return len(data), automaton.accepting(state)


def _brackets_reference(text: str):
    open_ = []
    for i, c in enumerate(text):
        if c in "([":
            open_.append(c)
        elif c in ")]":
            if not open_ or open_.pop() != "([" [")]".index(c)]:
                return i, False
        elif not "a" <= c <= "z":
            return i, False
    return len(text), not open_


def test_nested_brackets_are_followed_byte_by_byte():
    automaton = grammar_recognizer(BRACKETS)
    assert isinstance(automaton, GrammarAutomaton)
    rng = random.Random(0)
    texts = ["", "a", "(a)[b]", "([([x])])", "(]", "((", "a)", "[a(b]c)"]
    texts += ["".join(rng.choice("()[]ab-") for _ in range(rng.randint(0, 14))) for _ in range(4000)]
    balanced = 0
    for text in texts:
        assert _first_refusal(automaton, text.encode()) == _brackets_reference(text), text
        balanced += _brackets_reference(text)[1]
    assert balanced > 100  # the samples reach both answers


def _is_arithmetic(text: str) -> bool:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


def test_arithmetic_is_what_pythons_parser_reads_as_sums_and_products():
    automaton = grammar_recognizer(ARITHMETIC)
    rng = random.Random(1)
    texts = ["1+2", "(1+2)*30", "((7))", "(1", "1+", "", "2*(3+(4-5))/6", "-1", "1//2", "(1)(2)", "01"]
    texts += ["".join(rng.choice("1230+-*/()") for _ in range(rng.randint(1, 10))) for _ in range(6000)]
    accepted = 0
    for text in texts:
        assert automaton.matches(text.encode()) == _is_arithmetic(text), text
        accepted += _is_arithmetic(text)
    assert accepted > 100


@pytest.mark.parametrize("name", sorted(REGULAR))
def test_a_regular_language_is_refused_and_accepted_where_its_dfa_does(name):
    grammar, regex = REGULAR[name]
    pushdown, dfa = grammar_recognizer(grammar), RegexAutomaton(regex)
    assert isinstance(pushdown, GrammarAutomaton)
    pieces = [p.encode() for p in ["one", "two", "three", ",", "é", "€", "😀", "🙏", "à", "ÿ", '"', "\\", "n", "x"]]
    pieces += [b"\xc3", b"\xe2\x82", b"\xf0\x9f", b"\xff", b"\xed\xa0\x80",  # cut and invalid UTF-8:
               b"\xe0\x80", b"\xf0\x80", b"\xf4\x90", b"\xc0\x80"]  # overlong, past U+10FFFF
    rng = random.Random(2)
    for _ in range(3000):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        assert _first_refusal(pushdown, data) == _first_refusal(dfa, data), data


def test_a_long_repeat_keeps_its_stack_and_deep_nesting_is_an_error():
    automaton = grammar_recognizer(BRACKETS)
    state = automaton.initial
    for byte in b"(" + b"x" * 5000:  # a repeat continues in place: the stack does not grow with the text
        state = automaton.step(state, byte)
    assert max(len(stack) for stack in state[0]) <= 4
    with pytest.raises(GuidedDecodingError, match=f"more than {MAX_DEPTH} deep"):
        automaton.matches(b"(" * (MAX_DEPTH + 10))


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_seq_len=96, max_batch_size=4, max_num_tokens=96, page_size=4)


@pytest.mark.parametrize("name", sorted(REGULAR))
def test_token_masks_equal_the_dfas(llm, name):
    grammar, regex = REGULAR[name]
    vocab = vocab_of(llm.tokenizer)
    ours, ref = TokenMasks(grammar_recognizer(grammar), vocab), TokenMasks(RegexAutomaton(regex), vocab)
    width = len(vocab.tokens)
    rng = random.Random(3)
    for _ in range(4):  # random token walks through the language
        a, b, first = ours.automaton.initial, ref.automaton.initial, True
        for _ in range(12):
            mask = ours.mask(a, first, width)
            assert mask.equal(ref.mask(b, first, width))
            allowed = mask.nonzero().flatten().tolist()
            if not allowed:
                break
            data = (vocab.first if first else vocab.tokens)[rng.choice(allowed)]
            for byte in data:
                a, b = ours.automaton.step(a, byte), ref.automaton.step(b, byte)
            first = False
    assert ours.num_built >= 5  # distinct states compared


def test_generation_under_a_recursive_grammar_equals_its_regex(llm):
    grammar, regex = REGULAR["list"]
    prompts = ["The for statement", "Exceptions are raised when"]
    for temperature in (0.0, 1.0):
        kw = dict(max_tokens=16, temperature=temperature, seed=3)
        ours = llm.generate(prompts, SamplingParams(**kw, guided={"grammar": grammar}))
        ref = llm.generate(prompts, SamplingParams(**kw, guided={"regex": regex}))
        assert [o.token_ids for o in ours] == [o.token_ids for o in ref]


def test_generation_under_recursive_grammars_gives_their_texts(llm):
    prompts = ["The for statement", "Exceptions are raised when", "A list of", "{"]
    finished = 0
    for grammar, check in ((JSON_GRAMMAR, lambda t: isinstance(json.loads(t), dict)),
                           (BRACKETS, lambda t: _brackets_reference(t)[1]),
                           (ARITHMETIC, _is_arithmetic)):
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, guided={"grammar": grammar})
        outs = llm.generate(prompts, params)
        for o in outs:
            if o.outputs[0].finish_reason == "stop":
                assert check(o.text), (grammar, o.text)
                finished += 1
            else:  # cut off: still the start of a text of the grammar
                assert _first_refusal(grammar_recognizer(grammar), o.text.encode())[0] == len(o.text.encode())
    assert finished >= 3
    assert not re.fullmatch(r"\s*", "".join(o.text for o in outs))


def test_a_text_past_the_nesting_limit_ends_its_sequence_alone(llm, monkeypatch, caplog):
    from autodeploy.runtime.guided import grammar_automaton as module

    monkeypatch.setattr(module, "MAX_DEPTH", 4)
    deep = 'root ::= "(" a ")"\na ::= "(" b ")"\nb ::= "(" c ")"\nc ::= "(" d ")"\nd ::= "x" | "(" root ")"'
    prompts = ["The for statement", "Exceptions are raised when"]
    kw = dict(max_tokens=12, temperature=0)
    deep_out, plain = llm.generate(prompts, [SamplingParams(**kw, guided={"grammar": deep}), SamplingParams(**kw)])
    assert deep_out.outputs[0].finish_reason == "abort"
    assert "((((".startswith(deep_out.text) and "more than 4 deep" in caplog.text
    assert plain.token_ids == llm.generate(prompts[1], SamplingParams(**kw))[0].token_ids
