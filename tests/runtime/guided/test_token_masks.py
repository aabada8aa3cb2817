"""Token bytes and token masks on real tokenizers of every kind the detokenizer tests build
(byte-level BPE, SentencePiece with byte fallback, Llama 2's layout, a Unigram without byte
fallback): the bytes of a text's tokens are the bytes of its decode, and the mask of a state is
exactly the set of tokens whose bytes the automaton can consume from it (checked token by token,
without the sorted walk or the tensor steps of either builder)."""

import importlib.util
import os
import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from autodeploy.runtime.guided import dense_masks
from autodeploy.runtime.guided.errors import GuidedDecodingError
from autodeploy.runtime.guided.json_automaton import JsonObjectAutomaton
from autodeploy.runtime.guided.params import GuidedDecodingParams
from autodeploy.runtime.guided.token_masks import TokenMasks
from autodeploy.runtime.guided.vocab import TokenVocab

TEXTS = ['{"name": "Zoë", "n": [1, 2.5]}', "Hello world.\n  indented\tend", "中文 and 🙂 emoji", "x_y = a+b*(c-d)"]


def _detokenizer_tests():
    path = os.path.join(os.path.dirname(__file__), "..", "test_detokenizer.py")
    spec = importlib.util.spec_from_file_location("_detok_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return _detokenizer_tests().build_tokenizers(str(tmp_path_factory.mktemp("tok")))


KINDS = ["bpe512", "demo", "sp_metaspace", "sp_llama2", "unigram_cleanup"]


@pytest.mark.parametrize("kind", KINDS)
def test_token_bytes_join_to_the_decode(toks, kind):
    tok = toks[kind].tok
    vocab = TokenVocab.from_tokenizer(tok)
    unk = tok.unk_token_id
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if unk is not None and unk in ids:
            continue  # (the Unigram has no tokens for non-ASCII text)
        got = vocab.first[ids[0]] + b"".join(vocab.tokens[i] for i in ids[1:])
        assert got == tok.decode(ids).encode(), (text, ids)
    for special in tok.all_special_ids:
        assert vocab.tokens[special] is None


def test_first_token_space_is_stripped_only_where_the_decoder_strips_it(toks):
    sp = TokenVocab.from_tokenizer(toks["sp_llama2"].tok)
    assert any(t and t.startswith(b" ") for t in sp.tokens)
    assert all(f == (t[1:] if t and t.startswith(b" ") else t) for f, t in zip(sp.first, sp.tokens))
    bpe = TokenVocab.from_tokenizer(toks["bpe512"].tok)
    assert bpe.first is bpe.tokens


def test_a_tokenizer_it_cannot_map_is_refused():
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2, "c": 3}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import decoders

    wp.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]")
    with pytest.raises(GuidedDecodingError, match="decoder"):
        TokenVocab.from_tokenizer(tok)


def _brute_force(automaton, state, tokens):
    out = set()
    for i, data in enumerate(tokens):
        s = state
        for byte in data or b"":
            s = automaton.step(s, byte)
            if s is None:
                break
        if data and s is not None:
            out.add(i)
    return out


def _states(automaton, vocab, rng, count):
    """States reached by random walks over allowed tokens."""
    states = [automaton.initial]
    for _ in range(count):
        state = automaton.initial
        for _ in range(rng.randint(1, 6)):
            options = sorted(_brute_force(automaton, state, vocab.tokens))
            if not options:
                break
            for byte in vocab.tokens[rng.choice(options)]:
                state = automaton.step(state, byte)
            states.append(state)
    return states


@pytest.mark.parametrize("kind", ["bpe512", "sp_llama2"])
@pytest.mark.parametrize("guided, dense", [
    (dict(json_object=True), False),  # (a stack automaton: always the walk)
    (dict(regex=r"(yes|no|[0-9]{1,3}( apples)?)"), True), (dict(regex=r"(yes|no|[0-9]{1,3}( apples)?)"), False),
    (dict(choice=["alpha", "beta gamma", "{x}"]), True), (dict(choice=["alpha", "beta gamma", "{x}"]), False),
    (dict(regex=r'"([^"\\]|\\["\\n])*"'), True),  # a string: most tokens allowed inside it
    (dict(regex=r'"([^"\\]|\\["\\n])*"'), False),
    # the dense builder's two halves alone: tensor steps to the last byte, and Python from the first
    (dict(regex=r'"([^"\\]|\\["\\n])*"'), "tensor"), (dict(regex=r'"([^"\\]|\\["\\n])*"'), "python"),
    (dict(choice=["alpha", "beta gamma", "{x}"]), "tensor"), (dict(choice=["alpha", "beta gamma", "{x}"]), "python"),
])
def test_masks_are_exactly_the_tokens_the_automaton_can_consume(toks, kind, guided, dense, monkeypatch):
    if isinstance(dense, str):
        monkeypatch.setattr(dense_masks, "PYTHON_TAIL", 0 if dense == "tensor" else 10**9)
        dense = True
    vocab = TokenVocab.from_tokenizer(toks[kind].tok)
    automaton = GuidedDecodingParams(**guided).automaton()
    masks = TokenMasks(automaton, vocab, dense=dense)
    assert (masks._table is not None) == dense  # the builder asked for is the one tested
    width = len(vocab) + 7  # a model vocabulary wider than the tokenizer's
    rng = random.Random(0)
    for state in _states(automaton, vocab, rng, 12):
        for first in (True, False):
            mask = masks.mask(state, first, width)
            assert mask.shape == (width,) and not mask[len(vocab):].any()
            expected = _brute_force(automaton, state, vocab.first if first else vocab.tokens)
            assert set(mask.nonzero()[:, 0].tolist()) == expected


def test_masks_are_cached_by_the_automaton_key(toks):
    vocab = TokenVocab.from_tokenizer(toks["bpe512"].tok)
    automaton = JsonObjectAutomaton()
    masks = TokenMasks(automaton, vocab)
    a, b = automaton.initial, automaton.initial
    for byte in b'{"a":' + b"[" * 70:
        a = automaton.step(a, byte)
    for byte in b'{"b":{"c":' + b"[" * 70:
        b = automaton.step(b, byte)
    masks.mask(a, False, len(vocab))
    built = masks.num_built
    assert masks.mask(b, False, len(vocab)) is masks.mask(a, False, len(vocab))
    assert masks.num_built == built


@pytest.mark.parametrize("mode", ["walk", "dense", "tensor", "python"])
def test_long_tokens_are_stepped_to_their_last_byte(mode, monkeypatch):
    """A made-up vocabulary of long tokens that differ late (the trained ones have few): every
    builder steps each token to its last byte, whatever the order of its tokens."""
    if mode in ("tensor", "python"):
        monkeypatch.setattr(dense_masks, "PYTHON_TAIL", 0 if mode == "tensor" else 10**9)
    rng = random.Random(1)
    tokens = sorted({"".join(rng.choice('ab"') for _ in range(rng.randint(1, 40))).encode() for _ in range(400)})
    rng.shuffle(tokens)
    vocab = TokenVocab([None] + tokens, [None] + tokens)
    for regex in (r'"(a|b)*"', r'a{3,30}"?b*', r'(ab)*"?'):
        automaton = GuidedDecodingParams(regex=regex).automaton()
        masks = TokenMasks(automaton, vocab, dense=mode != "walk")
        for state in _states(automaton, vocab, rng, 6):
            mask = masks.mask(state, False, len(vocab))
            assert set(mask.nonzero()[:, 0].tolist()) == _brute_force(automaton, state, vocab.tokens), regex
