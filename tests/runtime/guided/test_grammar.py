"""GBNF grammars (vLLM's ``guided_grammar``) read as regular expressions: each grammar's language
equals a regular expression written by hand for it (``re.fullmatch`` over members, near-misses and
random strings), a recursive grammar goes to the pushdown recognizer (``test_grammar_automaton``),
what cannot be read or run is refused naming the problem, and generation under a grammar gives the
same greedy tokens as under the hand-written regex."""

import random
import re

import pytest

from autodeploy import LLM, InvalidRequestError, SamplingParams
from autodeploy.runtime.guided.errors import GuidedDecodingError
from autodeploy.runtime.guided.grammar import grammar_to_regex
from autodeploy.runtime.guided.grammar_automaton import GrammarAutomaton, grammar_recognizer
from autodeploy.runtime.guided.regex_dfa import RegexAutomaton

GRAMMARS = {
    # (grammar, the same language by hand, members)
    "choice": ('root ::= "yes" | "no" | "maybe"', r"yes|no|maybe", ["yes", "no", "maybe"]),
    "rules_and_repeats": (
        '# an answer and its confidence\n'
        'root ::= answer " (" conf ")"  # comment after a rule\n'
        'answer ::= ("yes" | "no")\n'
        'conf ::= [0-9]{1,2} "%"\n',
        r"(yes|no) \([0-9]{1,2}%\)", ["yes (5%)", "no (99%)"]),
    "classes_and_escapes": (
        r'''root ::= "\"" [^"\\\n]* "\"" [\]\-a]? "\x41\u00e9"''',
        r'"[^"\\\n]*"[\]\-a]?Aé', ['""Aé', '"a b"-Aé', '"x"]Aé']),
    "postfix": ('root ::= "a"+ ("b" "c"?)* "d"? [xy]{2,} [z]{0,1}', r"a+(bc?)*d?[xy]{2,}z?", ["axy", "aabbcdyyyz"]),
    "multiline_alternatives": ('root ::= item ("," item)*\nitem ::=\n    "one"\n  | "two"\n  | "three"',
                               r"(one|two|three)(,(one|two|three))*", ["one", "two,three,one"]),
}
ALPHABET = 'abcdxyz"\\]-,()% 0123456789yesnoAé\n'


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_the_language_equals_the_hand_written_regex(name):
    grammar, by_hand, members = GRAMMARS[name]
    converted = grammar_to_regex(grammar)
    rng = random.Random(0)
    samples = members + [m + "x" for m in members] + [m[:-1] for m in members]
    samples += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(3000)]
    samples += ["".join(rng.choice(members[0] + members[-1]) for _ in range(rng.randint(1, 10))) for _ in range(3000)]
    for text in samples:
        assert bool(re.fullmatch(converted, text)) == bool(re.fullmatch(by_hand, text)), (text, converted)
    assert all(re.fullmatch(converted, m) for m in members)


@pytest.mark.parametrize("grammar, cycle", [
    ('root ::= "(" root ")" | "x"', r"recursive \(root -> root\)"),
    ('root ::= a\na ::= "x" b\nb ::= "y" a?', r"recursive \(a -> b -> a\)"),
])
def test_a_recursive_grammar_has_no_regex_and_runs_on_the_pushdown_recognizer(grammar, cycle):
    with pytest.raises(GuidedDecodingError, match=cycle):
        grammar_to_regex(grammar)
    assert isinstance(grammar_recognizer(grammar), GrammarAutomaton)
    assert isinstance(grammar_recognizer('root ::= a "x"\na ::= [a-z]+'), RegexAutomaton)  # a regular one does not
    SamplingParams(guided={"grammar": grammar})  # a valid request


@pytest.mark.parametrize("grammar, message", [
    ('root ::= root "x" | "x"', r"left-recursive \(root -> root\)"),
    ('root ::= a\na ::= b? "x"\nb ::= "(" a ")" | a', r"left-recursive \(a -> b -> a\)"),
    ('root ::= "(" x* ")"\nx ::= root?', "left-recursive .* a '\\*' or '\\+' over something that can be empty"),
    ('root ::= "a" root', "rule 'root' of the grammar can never end"),
    ('root ::= "(" root ")" | [^\\x00-\\U0010FFFF]', "has a character class that matches no character"),
    ('answer ::= "x"', "no 'root' rule"),
    ('root ::= missing', "rule 'root' refers to rule 'missing', which the grammar does not define"),
    ('root ::= [z-a]', "a reversed range 'z'-'a'"),
    ('root ::= "x"{2000}', "counts above 1000"),
    ('root ::= "x"{3,2}', "maximum is below the minimum"),
    ('root ::= ' + "(" * 150 + '"x"' + ")" * 150, "groups nested deeper than 100"),
    ('root ::= r0\n' + "\n".join(f'r{i} ::= r{i + 1} "x" | "y"' for i in range(3000)) + '\nr3000 ::= "z" root',
     "a chain too long to follow"),
    ('root ::= ("x"', "never closed"),
    (r'root ::= "\q"', r"unknown escape \\q"),
    ('root ::= "x"\nroot ::= "y"', "defines rule 'root' twice"),
    ('root ::= "x" ::=', "cannot be read|expected a rule|unexpected"),
    ('root ::= []', "empty character class"),
])
def test_what_cannot_be_read_or_run_is_refused(grammar, message):
    with pytest.raises(GuidedDecodingError, match=message):
        grammar_recognizer(grammar)
    with pytest.raises(InvalidRequestError, match=message):  # and is a request error, at once
        SamplingParams(guided={"grammar": grammar})


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", max_seq_len=96, max_batch_size=4, max_num_tokens=96, page_size=4)


@pytest.mark.parametrize("name", ["rules_and_repeats", "multiline_alternatives"])
def test_generation_under_a_grammar_equals_its_regex(llm, name):
    grammar, by_hand, _ = GRAMMARS[name]
    prompts = ["The for statement", "Exceptions are raised when"]
    plain = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert not any(re.fullmatch(by_hand, o.text) for o in plain)  # the constraint is what makes them match
    complete = 0
    for temperature in (0.0, 1.0):
        kw = dict(max_tokens=16, temperature=temperature, seed=3)
        ours = llm.generate(prompts, SamplingParams(**kw, guided={"grammar": grammar}))
        ref = llm.generate(prompts, SamplingParams(**kw, guided={"regex": by_hand}))
        assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
        for o in ours:
            assert o.outputs[0].finish_reason == "length" or re.fullmatch(by_hand, o.text), o.text
            complete += o.outputs[0].finish_reason == "stop"
    assert complete  # some outputs reached the end of the grammar
