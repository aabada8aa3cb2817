"""Incremental detokenizer and stop strings, with real tokenizers only (built offline).

Tokenizers: the project's byte-level BPE (trained, saved, loaded through ``AutoTokenizer``), the
bundled demo model's tokenizer, two SentencePiece-style BPE tokenizers with byte fallback (a
Metaspace pre-tokenizer/decoder one and a Llama-2 layout: normalizer + Replace/ByteFallback/Fuse/
Strip decoders), and a Metaspace Unigram tokenizer that cleans up tokenization spaces.

Every streaming test checks every step of a >= 2000-token generation against
``tokenizer.decode`` of the tokens so far, and the final text against the full decode.
"""

import os
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from autodeploy.models.tokenizer import pydoc_corpus, save_tokenizer, train_bpe_tokenizer
from autodeploy.runtime.detokenizer import (
    HARD_PENDING_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
)

DEMO_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "autodeploy", "models", "demo")
SNIPPETS = [
    "Grüße aus Köln — naïve café, déjà vu. ",
    "中文字符和日本語のテキスト。",
    " 😀👍🏽🇫🇷 emoji ",
    "Don't stop , it 's fine . Really ? yes ! a ' b ",
    "  indented    code  \n\tmore\n",
]
# split across byte tokens in the streams (a special token inside each)
MULTIBYTE = ["😀", "中文", "é", "👍🏽", "🇫🇷", "€"]
# transformers' clean-up patterns' proper prefixes (text ending in one may still change)
CLEANUP_OPEN_ENDS = (" ", " '", " n", " n'", " 'v", " 'r")


@dataclass
class Tok:
    name: str
    tok: object
    byte_ids: Dict[int, int]  # byte value -> id of the token that is exactly that byte
    byte_fallback: bool  # SentencePiece "<0xNN>" tokens grouped by a ByteFallback decoder
    cleanup: bool  # the decode cleans up tokenization spaces

    def __post_init__(self):
        self.special_ids = frozenset(self.tok.all_special_ids)
        self.byte_id_set = frozenset(self.byte_ids.values())

    def decode(self, ids: List[int], skip: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip)


def _gpt2_byte_chars() -> Dict[int, str]:
    """GPT-2's byte -> printable character map used by ByteLevel tokenizers."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _byte_level_ids(tok) -> Dict[int, int]:
    chars = _gpt2_byte_chars()
    ids = {b: tok.convert_tokens_to_ids(c) for b, c in chars.items()}
    assert all(i is not None and i != tok.unk_token_id for i in ids.values())
    return ids


def _fallback_ids(tok) -> Dict[int, int]:
    return {b: tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}


def _metaspace_bpe_vocab():
    """A BPE trained with a Metaspace pre-tokenizer on ASCII-only pydoc text, plus the 256
    "<0xNN>" byte tokens in the model vocabulary (not added tokens), as Llama 2 has them."""
    import json

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=100, show_progress=False
    )
    tok.train_from_iterator(pydoc_corpus(), trainer)
    state = json.loads(tok.model.__getstate__())
    vocab = dict(state["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return vocab, [tuple(m) for m in state["merges"]]


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> Dict[str, Tok]:
    return build_tokenizers(str(tmp_path_factory.mktemp("bpe512")))


def build_tokenizers(d: str) -> Dict[str, Tok]:
    out: Dict[str, Tok] = {}

    # the project's byte-level BPE, saved and loaded as a user's checkpoint would be
    save_tokenizer(train_bpe_tokenizer(512), d, model_max_length=2048)
    bpe = AutoTokenizer.from_pretrained(d)
    out["bpe512"] = Tok("bpe512", bpe, _byte_level_ids(bpe), False, False)

    demo = AutoTokenizer.from_pretrained(DEMO_DIR)
    out["demo"] = Tok("demo", demo, _byte_level_ids(demo), False, False)

    vocab, merges = _metaspace_bpe_vocab()
    # Metaspace pre-tokenizer and decoder, byte fallback
    ms = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    ms.pre_tokenizer = pre_tokenizers.Metaspace()
    ms.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    ms.add_special_tokens(["<unk>", "<s>", "</s>"])
    sp = PreTrainedTokenizerFast(tokenizer_object=ms, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out["sp_metaspace"] = Tok("sp_metaspace", sp, _fallback_ids(sp), True, False)

    # Llama 2's layout: normalizer prepends/replaces "▁", decoder Replace/ByteFallback/Fuse/Strip
    ll = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    ll.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    ll.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    ll.add_special_tokens(["<unk>", "<s>", "</s>"])
    llama = PreTrainedTokenizerFast(tokenizer_object=ll, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out["sp_llama2"] = Tok("sp_llama2", llama, _fallback_ids(llama), True, False)

    # Metaspace Unigram that cleans up tokenization spaces (transformers applies the clean-up to
    # non-BPE models), so its full decode is not monotonic: "a '" becomes "a'b"
    ug = Tokenizer(models.Unigram())
    ug.pre_tokenizer = pre_tokenizers.Metaspace()
    ug.decoder = decoders.Metaspace()
    ug.train_from_iterator(
        pydoc_corpus()[::3],
        trainers.UnigramTrainer(
            vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False
        ),
    )
    uni = PreTrainedTokenizerFast(
        tokenizer_object=ug, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=True
    )
    assert uni.decode(uni.encode("a ' b", add_special_tokens=False)) == "a'b"  # clean-up is on
    out["unigram_cleanup"] = Tok("unigram_cleanup", uni, {}, False, True)
    return out


ALL = ["bpe512", "demo", "sp_metaspace", "sp_llama2", "unigram_cleanup"]


def _long_text(chars: int = 9000) -> str:
    corpus = pydoc_corpus()
    parts, total, i = [], 0, 0
    while total < chars:
        para = corpus[i % len(corpus)][:700]
        parts += [para, SNIPPETS[i % len(SNIPPETS)]]
        total += len(para) + len(SNIPPETS[i % len(SNIPPETS)])
        i += 1
    return "".join(parts)


def _stream(t: Tok, seed: int = 0, n_text: int = 1500, n_random: int = 500) -> List[int]:
    """>= 2000 generated ids: encoded text with special tokens sprinkled in, multi-byte characters
    split across byte tokens (with a special token inside), a run of invalid continuation bytes,
    random ids, and an incomplete character at the very end."""
    rng = random.Random(seed)
    tok = t.tok
    text_ids = tok.encode(_long_text(), add_special_tokens=False, verbose=False)[:n_text]
    assert len(text_ids) == n_text
    specials = sorted(set(tok.all_special_ids))
    ids = list(text_ids)
    for _ in range(40):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
    if t.byte_ids:
        for i, s in enumerate(MULTIBYTE * 4):
            seq = [t.byte_ids[b] for b in s.encode()]
            if i % 2:
                seq.insert(rng.randrange(1, len(seq) + 1), rng.choice(specials))
            ids += seq + text_ids[i * 7 : i * 7 + 3]
        ids += [t.byte_ids[0x80]] * 12 + text_ids[:4]  # garbage: continuation bytes with no lead byte
        ids += [t.byte_ids[b] for b in "中".encode()[:2]] + text_ids[4:8]  # a character cut short
    ids += [rng.randrange(len(tok)) for _ in range(n_random)]
    if t.byte_ids:
        ids += [t.byte_ids[b] for b in "😀".encode()[:3]]  # ends inside a character: flush() emits U+FFFD
    assert len(ids) >= 2000
    return ids


def _settled(t: Tok, full: str, ids: List[int], skip: bool) -> bool:
    """Whether the full decode of ``ids`` ends in text that no later token can change."""
    if full.endswith(REPLACEMENT_CHAR):
        return False
    if t.cleanup and full.endswith(CLEANUP_OPEN_ENDS):
        return False
    if t.byte_fallback:
        last = next((i for i in reversed(ids) if not (skip and i in t.special_ids)), None)
        if last in t.byte_id_set:
            return False
    return True


def _run_start(t: Tok, ids: List[int], skip: bool) -> int:
    """Start of the trailing run of byte tokens (skipped special tokens inside it included)."""
    s = len(ids)
    while s and (ids[s - 1] in t.byte_id_set or (skip and ids[s - 1] in t.special_ids)):
        s -= 1
    return s


def _check_stream(t: Tok, ids: List[int], skip: bool, ends_inside_char: bool = False) -> None:
    det = IncrementalDetokenizer(t.tok, skip_special_tokens=skip)
    final = t.decode(ids, skip)
    deltas: List[str] = []
    held = 0
    for k in range(1, len(ids) + 1):
        deltas.append(det.add(ids[k - 1]))
        text = det.text
        assert "".join(deltas) == text
        full = t.decode(ids[:k], skip)
        # never emits anything the final text will not have
        assert final.startswith(text), (t.name, k)
        if _settled(t, full, ids[:k], skip):
            assert text == full, (t.name, k, text[-40:], full[-40:])
        else:
            held += 1
        if t.byte_fallback:
            # the full decode of a prefix is not monotonic (a byte run turns into U+FFFDs while it
            # is cut inside a character): the text has everything before the trailing byte run
            assert text.startswith(t.decode(ids[: _run_start(t, ids[:k], skip)], skip)), (t.name, k)
        else:
            # the full decode of a prefix only ends in held-back text
            assert full.startswith(text), (t.name, k, text[-40:], full[-40:])
    assert held < len(ids) // 4  # held-back steps are the exception
    rest = det.flush()
    assert "".join(deltas) + rest == final
    assert det.text == final
    assert det.finish() == final
    if ends_inside_char:
        assert final.endswith(REPLACEMENT_CHAR) and rest.endswith(REPLACEMENT_CHAR)


# ---- exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("name", ALL)
def test_every_step_matches_full_decode(toks, name, skip):
    t = toks[name]
    _check_stream(t, _stream(t, seed=ALL.index(name) * 2 + skip), skip, ends_inside_char=bool(t.byte_ids))


@pytest.mark.parametrize("name", ALL)
def test_random_ids_only(toks, name):
    t = toks[name]
    rng = random.Random(7)
    _check_stream(t, [rng.randrange(len(t.tok)) for _ in range(2000)], skip=True)


@pytest.mark.parametrize("name", ["bpe512", "sp_metaspace"])
def test_split_character_is_held_back_until_complete(toks, name):
    t = toks[name]
    det = IncrementalDetokenizer(t.tok)
    word = t.tok.encode("ok", add_special_tokens=False)
    for i in word:
        det.add(i)
    emoji = [t.byte_ids[b] for b in "😀".encode()]
    eos = t.tok.eos_token_id
    assert [det.add(i) for i in emoji[:2]] == ["", ""]
    assert det.add(eos) == ""  # skipped, and does not split the character
    assert det.add(emoji[2]) == ""
    assert det.text == "ok"
    last = det.add(emoji[3])
    after = word + emoji + word[:1]
    if t.byte_fallback:  # a byte run is final only once a non-byte token ends it
        assert last == ""
        assert det.add(word[0]) == t.decode(after, True)[2:] == "😀" + t.decode(after, True)[3:]
    else:
        assert last == "😀"
        det.add(word[0])
    assert det.finish() == t.decode(word + emoji[:2] + [eos] + emoji[2:] + word[:1], True) == t.decode(after, True)


def test_sentencepiece_leading_space_and_prompt(toks):
    """Metaspace drops the first token's leading space; the window's context token keeps every
    later space. The prompt is not decoding context: the text is ``decode(output_ids)``."""
    for name in ["sp_metaspace", "sp_llama2", "unigram_cleanup"]:
        t = toks[name]
        prompt = t.tok.encode("Return the value", add_special_tokens=False)
        out = t.tok.encode("of the object is not a list", add_special_tokens=False)
        assert t.tok.convert_ids_to_tokens(out[0]).startswith("▁")
        det = IncrementalDetokenizer(t.tok, prompt_token_ids=prompt)
        deltas = [det.add(i) for i in out]
        assert deltas[0] == t.decode(out[:1], True) and not deltas[0].startswith(" ")
        assert "".join(deltas) + det.flush() == t.decode(out, True) == "of the object is not a list"
        # what decoding with the prompt in front would give instead
        with_prompt = t.decode(prompt + out, True)[len(t.decode(prompt, True)) :]
        assert with_prompt == " of the object is not a list"


def test_prompt_ending_inside_a_character_does_not_leak(toks):
    t = toks["bpe512"]
    emoji = [t.byte_ids[b] for b in "😀".encode()]
    prompt = t.tok.encode("say", add_special_tokens=False) + emoji[:2]
    out = emoji[2:] + t.tok.encode(" hi", add_special_tokens=False)
    det = IncrementalDetokenizer(t.tok, prompt_token_ids=prompt)
    text = "".join(det.add(i) for i in out) + det.flush()
    assert text == t.decode(out, True) == REPLACEMENT_CHAR * 2 + " hi"


def test_cleanup_space_is_held_back(toks):
    t = toks["unigram_cleanup"]
    ids = t.tok.encode("a ' b", add_special_tokens=False)
    det = IncrementalDetokenizer(t.tok)
    texts = []
    for i in ids:
        det.add(i)
        texts.append(det.text)
    prefixes = [t.decode(ids[:k], True) for k in range(1, len(ids) + 1)]
    assert "a '" in prefixes and "a'" in prefixes  # the full decode is not monotonic
    assert all("a'b".startswith(x) for x in texts)
    assert " " not in "".join(texts)  # the space that the clean-up removes is never emitted
    assert det.finish() == "a'b"


def test_flush_emits_incomplete_tail_and_ends_stream(toks):
    t = toks["bpe512"]
    det = IncrementalDetokenizer(t.tok)
    ids = t.tok.encode("x", add_special_tokens=False) + [t.byte_ids[0xE4], t.byte_ids[0xB8]]
    for i in ids:
        det.add(i)
    assert det.text == "x"
    assert det.flush() == REPLACEMENT_CHAR == t.decode(ids, True)[1:]
    assert det.flush() == ""
    assert det.finished
    with pytest.raises(RuntimeError):
        det.add(ids[0])


@pytest.mark.parametrize("name", ALL)
def test_pathological_runs_stay_bounded_and_exact(toks, name):
    """Runs the normal rule would hold back forever: invalid continuation bytes, spaces (a
    clean-up suffix), and special tokens (skipped, or kept as text)."""
    t = toks[name]
    space = t.tok.convert_tokens_to_ids("▁") if name.startswith(("sp", "uni")) else t.byte_ids[0x20]
    runs = [[space] * 300, [t.tok.bos_token_id] * 300]
    if t.byte_ids:
        runs.append([t.byte_ids[0x80]] * 300)
    word = t.tok.encode(" word.", add_special_tokens=False)
    for run in runs:
        for skip in (True, False):
            ids = word + run + word
            det = IncrementalDetokenizer(t.tok, skip_special_tokens=skip)
            for k, i in enumerate(ids, 1):
                det.add(i)
                full = t.decode(ids[:k], skip)
                assert full.startswith(det.text)
                # held back text is bounded whatever the run's length
                assert len(full) - len(det.text) <= 4 * HARD_PENDING_TOKENS + len(t.decode(word, skip))
            assert det.finish() == t.decode(ids, skip)


def _straddling_tokenizer_and_ids(reps: int = 350) -> Tuple[PreTrainedTokenizerFast, List[int]]:
    """A byte-level BPE whose tokens each hold the end of one character and the start of the next
    (as BPE merges trained on CJK text can), so no token boundary is a character boundary and
    every prefix's decode ends in U+FFFD: the rule "wait for a decode that does not end in U+FFFD"
    alone would never emit and its window would grow without bound."""
    chars = _gpt2_byte_chars()
    pieces = [c.encode() for c in "中文字符😀é" * reps]
    cuts = [pieces[0][:1]] + [a[1:] + b[:1] for a, b in zip(pieces, pieces[1:])] + [pieces[-1][1:]]
    vocab: Dict[str, int] = {}
    for piece in [bytes([b]) for b in range(256)] + cuts:
        vocab.setdefault("".join(chars[b] for b in piece), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = [vocab["".join(chars[b] for b in piece)] for piece in cuts]
    assert fast.decode(ids) == "中文字符😀é" * reps
    return fast, ids


def test_tokens_straddling_characters_stay_exact_and_bounded():
    tok, ids = _straddling_tokenizer_and_ids()
    assert len(ids) >= 2000
    counting = CountingTokenizer(tok)
    det = IncrementalDetokenizer(counting)
    deltas = []
    for k in range(1, len(ids) + 1):
        deltas.append(det.add(ids[k - 1]))
        full = tok.decode(ids[:k])
        assert full.endswith(REPLACEMENT_CHAR) or k == len(ids)
        assert full.startswith(det.text), k
        assert len(full) - len(det.text) <= HARD_PENDING_TOKENS + 2, k
    assert "".join(deltas) + det.flush() == tok.decode(ids)
    assert counting.decoded_ids <= 20 * len(ids)


# ---- O(1) per token --------------------------------------------------------------------------
class CountingTokenizer:
    """Forwards to the real tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tok):
        self._tok = tok
        self.decoded_ids = 0
        self.decode_calls = 0
        self.max_ids_per_call = 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        self.decode_calls += 1
        self.max_ids_per_call = max(self.max_ids_per_call, len(ids))
        return self._tok.decode(ids, **kwargs)

    def convert_ids_to_tokens(self, ids, **kwargs):
        self.decoded_ids += 1 if isinstance(ids, int) else len(ids)
        return self._tok.convert_ids_to_tokens(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.mark.parametrize("name", ALL)
def test_decode_work_is_linear_in_output_length(toks, name):
    t = toks[name]
    rng = random.Random(3)
    streams = {"mixed": _stream(t, seed=5)[:2000], "random": [rng.randrange(len(t.tok)) for _ in range(2000)]}
    if t.byte_ids:
        streams["garbage"] = [t.byte_ids[0x80]] * 2000  # never settles by itself
    for kind, ids in streams.items():
        counting = CountingTokenizer(t.tok)
        det = IncrementalDetokenizer(counting)
        for i in ids:
            det.add(i)
        assert det.finish() == t.decode(ids, True)
        n = len(ids)
        assert counting.decoded_ids <= 20 * n, (kind, counting.decoded_ids)
        assert counting.decode_calls <= 4 * n, (kind, counting.decode_calls)
        assert counting.max_ids_per_call <= 2 * HARD_PENDING_TOKENS + 2, (kind, counting.max_ids_per_call)


# ---- stop strings ----------------------------------------------------------------------------
def _old_rule(texts: List[str], stops: List[str]) -> Tuple[Optional[int], Optional[str]]:
    """The engine's old whole-text rule: at the first step where any stop string is in the text,
    cut before the earliest one."""
    for step, text in enumerate(texts, 1):
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return step, text[: min(hits)]
    return None, None


def _generate(t: Tok, ids: List[int], stops: List[str]) -> Tuple[Optional[int], str, List[str]]:
    """What the engine does per token: add, then search the tail for a stop string."""
    det = IncrementalDetokenizer(t.tok)
    matcher = StopStringMatcher(stops)
    texts = []
    for step, i in enumerate(ids, 1):
        delta = det.add(i)
        texts.append(det.text)
        cut = matcher.find(det.text, len(delta))
        if cut is not None:
            return step, det.text[:cut], texts
    return None, det.finish(), texts


def _token_spans(t: Tok, ids: List[int]) -> List[Tuple[int, int]]:
    """Character span of each token in the decode (text of the first k tokens grows by it)."""
    spans, prev = [], 0
    for k in range(1, len(ids) + 1):
        n = len(t.decode(ids[:k], True))
        spans.append((prev, n))
        prev = n
    return spans


TEXT = "The quick brown fox jumps over the lazy dog. Then the result is returned to the caller."


@pytest.mark.parametrize("name", ["bpe512", "demo", "sp_llama2"])
def test_stop_string_spanning_tokens(toks, name):
    t = toks[name]
    ids = t.tok.encode(TEXT, add_special_tokens=False)
    spans = _token_spans(t, ids)
    full = t.decode(ids, True)
    for ntok in (2, 3):
        # a stop string from the middle of token j to the middle of token j + ntok - 1
        j = next(j for j in range(len(ids) - ntok) if all(b - a >= 2 for a, b in spans[j : j + ntok]))
        start, end = spans[j][0] + 1, spans[j + ntok - 1][1] - 1
        stop = full[start:end]
        assert full.find(stop) == start
        step, cut, texts = _generate(t, ids, [stop])
        assert step == j + ntok  # found at the token that completes it, not earlier or later
        assert cut == full[:start]
        assert (step, cut) == _old_rule(texts, [stop])


@pytest.mark.parametrize("name", ["bpe512", "sp_metaspace"])
def test_stop_string_inside_one_token(toks, name):
    t = toks[name]
    ids = t.tok.encode(TEXT, add_special_tokens=False)
    spans = _token_spans(t, ids)
    full = t.decode(ids, True)
    j = next(j for j, (a, b) in enumerate(spans) if b - a >= 4 and full.find(full[a + 1 : b - 1]) == a + 1)
    a, b = spans[j]
    step, cut, _ = _generate(t, ids, [full[a + 1 : b - 1]])
    assert step == j + 1 and cut == full[: a + 1]


def test_later_starting_stop_string_completing_first_wins(toks):
    t = toks["bpe512"]
    ids = t.tok.encode(TEXT, add_special_tokens=False)
    # "brown fox jumps" starts first but "fox" completes first: generation stops there
    step, cut, texts = _generate(t, ids, ["brown fox jumps", "fox"])
    assert cut == "The quick brown "
    assert (step, cut) == _old_rule(texts, ["brown fox jumps", "fox"])
    # completed in the same step (same last character): the earliest start wins
    step2, cut2, texts2 = _generate(t, ids, ["brown", "k brown"])
    assert cut2 == "The quic"
    assert (step2, cut2) == _old_rule(texts2, ["brown", "k brown"])


def test_matcher_rule_on_one_delta():
    m = StopStringMatcher(["quick brown", "ick b", "zzz"])
    # both complete in the same delta: the earliest start wins even though "ick b" ends first
    assert m.find("The quick brown", len("quick brown")) == 4
    assert m.find("The quick brown", 0) is None  # nothing new, nothing to find
    # only occurrences ending in the new characters are seen (older ones were seen earlier)
    assert m.find("ick b and more", 3) is None
    assert m.find("x" * 10_000 + "zz" + "z", 1) == 10_000
    assert StopStringMatcher([]).find("anything", 8) is None
    assert not StopStringMatcher([""])


@pytest.mark.parametrize("name", ["bpe512", "sp_metaspace"])
def test_multibyte_stop_strings_split_across_byte_tokens(toks, name):
    t = toks[name]
    pre = t.tok.encode("Result: ", add_special_tokens=False)
    post = t.tok.encode(" done", add_special_tokens=False)
    for stop in ["😀", "中文", "é!"]:
        body = [t.byte_ids[b] for b in stop.encode()]
        ids = pre + body + post
        step, cut, texts = _generate(t, ids, [stop, "never"])
        assert cut == t.decode(pre, True)
        # found at the token that completes it; with byte fallback when the byte run has ended
        # (or is cut short after MAX_PENDING_TOKENS held-back tokens)
        done = len(pre) + len(body)
        assert done <= step <= done + (1 if t.byte_fallback else 0), stop
        assert (step, cut) == _old_rule(texts, [stop, "never"])


def test_matcher_equals_old_rule_on_random_chunkings():
    """Per-step tail search == whole-text search at the first step with a hit, for random texts
    cut into random deltas (multi-byte characters included)."""
    rng = random.Random(11)
    alphabet = "ab c中😀é"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 10))))
        texts = [text[:c] for c in cuts] + [text]
        m = StopStringMatcher(stops)
        got = (None, None)
        prev = 0
        for step, x in enumerate(texts, 1):
            cut = m.find(x, len(x) - prev)
            prev = len(x)
            if cut is not None:
                got = (step, x[:cut])
                break
        assert got == _old_rule(texts, stops), (text, stops, cuts)


def test_for_params_is_cached():
    from autodeploy.runtime.sampling_params import SamplingParams

    a = StopStringMatcher.for_params(SamplingParams(stop=["x", "yz"]))
    assert a is StopStringMatcher.for_params(SamplingParams(stop=["x", "yz"]))
    assert a.stop_strings == ("x", "yz") and a.max_len == 2
    assert not StopStringMatcher.for_params(SamplingParams())
