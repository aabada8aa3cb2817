"""Incremental detokenization and stop-string search: constant work per generated token.

Why
---
The engine used to call ``tokenizer.decode(output_ids)`` on the *whole* output after every
generated token and then ``text.find(stop)`` over the whole text: both are O(n) per token, so
O(n^2) per sequence. ``IncrementalDetokenizer`` and ``StopStringMatcher`` do the same job with a
bounded amount of work per token.

How the detokenizer works (the idea of vLLM's ``detokenize_incrementally`` and HF's
``TextStreamer``)
-----------------------------------------------------------------------------------------------
It keeps two offsets into the output tokens: ``read`` (text of the tokens before it has been
emitted) and ``prefix`` (a few already-emitted tokens before ``read``, kept as context). Per
token it decodes only the window ``tokens[prefix:]``; the window's text minus the text of
``tokens[prefix:read]`` (cached) is the candidate new text. Decoding a window together with its
context tokens is what keeps tokenizers whose decode depends on position right: SentencePiece /
Metaspace decoders drop the leading space of the *first* token, which here is the context token
in both decodes, so the difference is exactly what the full decode adds. When the new text is
settled (see below) it is emitted, ``prefix`` moves to the old ``read`` and ``read`` to the end,
so the window stays a few tokens long whatever the output length. Windows are decoded with the
same call the full decode uses (``tokenizer.decode(ids, skip_special_tokens=...)``, the
tokenizer's own ``clean_up_tokenization_spaces``), never with a re-implementation.

Text is held back (not emitted, offsets not moved) while it may still change:

* it ends in U+FFFD: byte-level BPE (GPT-2, Llama 3) splits multi-byte characters (emoji, CJK)
  across tokens, and a decode that stops inside one ends in U+FFFD until the character is
  complete;
* the last token is a SentencePiece byte-fallback token (``<0xE4>``): HF's ``ByteFallback``
  decoder turns a *whole* run of byte tokens into U+FFFDs as soon as the run is not valid UTF-8
  (``E4 B8 AD E4`` decodes to four U+FFFDs although ``E4 B8 AD`` was already "中"), so a run is
  final only once a non-byte token ends it;
* the tokenizer cleans up tokenization spaces and the text ends in the start of one of
  transformers' clean-up patterns (``" "``, ``" '"``, ``" n"``, ...): ``"a '"`` becomes ``"a'b"``
  once ``" b"`` follows.

Special tokens skipped by the decode (``skip_special_tokens=True``) never enter the window: the
fast tokenizers drop them before their decoder runs, so leaving them out does not change the
decode, and it keeps one from being a window's only context token (a Metaspace decoder would
then drop the leading space of the next token, which is first once the special one is skipped)
and a run of them from growing the window. Their ids are found once per tokenizer and cached.

Exactness
---------
``flush()`` (or ``finish()``) returns the rest, and the emitted deltas joined are exactly
``tokenizer.decode(output_ids, skip_special_tokens=...)``. In between:

* byte-level BPE, and SentencePiece/Metaspace without byte fallback or clean-up: ``text`` equals
  the full decode of the tokens so far unless that decode ends in held-back text (ending in
  U+FFFD), and is always a prefix of it;
* byte fallback: the full decode of a prefix is not monotonic (``E4 B8 AD E4`` above), so no
  stream of deltas can equal it at every step; ``text`` holds at least the full decode up to the
  trailing run of byte tokens, and is always a prefix of the final text;
* clean-up of tokenization spaces: the full decode of a prefix is not monotonic either
  (``"a '"``, then ``"a'b"``); ``text`` is a prefix of it and equals it whenever it does not end
  in the start of a clean-up pattern.

Bounds
------
Work per token is at most three decodes of at most ``2 * (HARD_PENDING_TOKENS + 1)`` tokens. Real
text is normally emitted within a few tokens (a UTF-8 character has at most 4 bytes). When more
than ``MAX_PENDING_TOKENS`` tokens are held back, a byte-fallback run ending in a complete
character is emitted, or the point ``3`` tokens back is emitted once the text after it decides
it (runs of spaces under clean-up, invalid bytes); past ``HARD_PENDING_TOKENS`` everything is
emitted and only the last 3 tokens stay as context. That last step is exact for byte-level BPE
(e.g. tokens that each straddle two characters never end on a character boundary): a lossy UTF-8
decode ends inside a character with exactly one U+FFFD, which is left for the next window. It is
not exact for one kind of garbage: a byte-fallback run of more than ``HARD_PENDING_TOKENS`` byte
tokens that is not valid UTF-8 as a whole but has valid parts, whose full decode is one U+FFFD
per byte; matching it would need the whole run in every decode, the unbounded work this module
exists to avoid (an all-invalid run still comes out exact).

The prompt
----------
``prompt_token_ids`` is accepted so callers can hand over the request as it is, but the prompt is
deliberately *not* used as decoding context: the text is defined as ``decode(output_ids)``, and
with the prompt's last tokens in front a SentencePiece tokenizer would keep the first output
token's leading space (``decode(prompt + out)`` gives ``" Hello"`` where ``decode(out)`` gives
``"Hello"``), and a prompt ending inside a multi-byte character would change the first output
characters. The window's own emitted tokens are the context from the second token on.

Stop strings
------------
``StopStringMatcher.find(text, new_chars)`` searches only the characters where a stop string
ending in the ``new_chars`` just added can lie (the last ``new_chars + len(stop) - 1``). Rule:
generation stops at the first step at which any stop string is complete in the text; among the
stop strings completed at that step, the one starting earliest wins, and the text is cut where
it starts. A stop string that would have started earlier but is not complete at that step never
counts (generation has stopped), so with stops ``["xyz123", "z1"]`` the text ``"xyz1"`` is cut
to ``"xy"``. This is the old whole-text rule (``min(text.find(s))`` at the first step with a
hit), in O(1) per token.
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

REPLACEMENT_CHAR = "\ufffd"

# transformers' ``PreTrainedTokenizerBase.clean_up_tokenization`` replaces these; a text ending in
# a proper prefix of one may still lose that space when the next characters arrive.
_CLEANUP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")
_CLEANUP_OPEN_ENDS: Tuple[str, ...] = tuple(sorted({p[:k] for p in _CLEANUP_PATTERNS for k in range(1, len(p))}))

# Tokens held back before looking for an earlier settled point, and before emitting regardless.
MAX_PENDING_TOKENS = 4
HARD_PENDING_TOKENS = 8
# A text point is settled once this much follows it: a UTF-8 character has at most 3 bytes after
# its first one (each token has at least one byte), a clean-up pattern at most 3 characters after
# its space.
_SETTLE_TOKENS = 3
_SETTLE_CHARS = max(len(p) for p in _CLEANUP_PATTERNS) - 1


class _TokenizerFacts:
    """What the detokenizer needs to know about one tokenizer; found once, shared by sequences."""

    def __init__(self, tokenizer: Any):
        candidates = set(getattr(tokenizer, "all_special_ids", None) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        candidates.update(i for i, tok in added.items() if getattr(tok, "special", False))
        self._special_candidates: FrozenSet[int] = frozenset(candidates)
        self._skipped: Dict[int, bool] = {}
        # SentencePiece byte-fallback tokens ("<0x00>" .. "<0xFF>") in the vocabulary, if any
        unk = getattr(tokenizer, "unk_token_id", None)
        ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)])
        self.byte_token_ids: FrozenSet[int] = frozenset(i for i in ids if i is not None and i != unk)
        self.cleans_up_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def skipped(self, tokenizer: Any, token_id: int) -> bool:
        """Whether ``decode(..., skip_special_tokens=True)`` drops this token."""
        if token_id not in self._special_candidates:
            return False
        hit = self._skipped.get(token_id)
        if hit is None:
            hit = self._skipped[token_id] = tokenizer.decode([token_id], skip_special_tokens=True) == ""
        return hit


_FACTS: "weakref.WeakKeyDictionary[Any, _TokenizerFacts]" = weakref.WeakKeyDictionary()


def _facts_for(tokenizer: Any) -> _TokenizerFacts:
    try:
        facts = _FACTS.get(tokenizer)
    except TypeError:  # not hashable / not weak-referenceable: no sharing
        return _TokenizerFacts(tokenizer)
    if facts is None:
        facts = _TokenizerFacts(tokenizer)
        try:
            _FACTS[tokenizer] = facts
        except TypeError:
            pass
    return facts


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time, with bounded work per token.

    ``add(token_id)`` returns the text that is now certain (the delta, possibly ``""``);
    ``text`` is everything emitted so far; ``flush()`` emits what is still held back and returns
    it, ``finish()`` flushes and returns the whole text, which is exactly
    ``tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)``. See the module
    docstring for what is held back and why, and why ``prompt_token_ids`` is not decoding
    context. Not thread-safe; one instance per generated sequence.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Optional[List[int]] = None,
        skip_special_tokens: bool = True,
    ):
        del prompt_token_ids  # accepted for the caller's convenience; see the module docstring
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._facts = _facts_for(tokenizer)
        # the window: output tokens that reach the decoder, from the context start on (tokens
        # before it are dropped, so memory stays bounded too)
        self._ids: List[int] = []
        self._read = 0  # tokens of the window before this one have had their text emitted
        self._prefix_text = ""  # decode(self._ids[:self._read])
        self._chunks: List[str] = []  # emitted deltas not yet joined into self._text
        self._text = ""
        self._num_tokens = 0
        self._finished = False

    # ---- public API ------------------------------------------------------------------------
    @property
    def skip_special_tokens(self) -> bool:
        return self._skip

    @property
    def num_tokens(self) -> int:
        """Tokens added so far (skipped special tokens included)."""
        return self._num_tokens

    @property
    def text(self) -> str:
        """All text emitted so far (held-back text not included until it settles or is flushed)."""
        if self._chunks:
            self._text += "".join(self._chunks)
            self._chunks.clear()
        return self._text

    @property
    def finished(self) -> bool:
        return self._finished

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the newly certain text (``""`` if none yet)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() after flush()/finish()")
        self._num_tokens += 1
        if self._skip and self._facts.skipped(self._tokenizer, token_id):
            return ""
        ids = self._ids
        ids.append(token_id)
        end = len(ids)
        window = self._decode(end)
        settled = len(window) > len(self._prefix_text) and self._settled(window)
        if settled and not self._ends_in_byte_run(end):
            return self._commit(end, window)
        pending = end - self._read
        if pending <= MAX_PENDING_TOKENS:
            return ""
        # Held back for long: a byte-fallback run that ends in a complete character is cut short
        # here; otherwise the point a few tokens back is settled once what follows it decides it.
        if settled:
            return self._commit(end, window)
        point = end - _SETTLE_TOKENS
        if point > self._read and not self._splits_byte_run(point):
            text = self._decode(point)
            if (
                len(text) > len(self._prefix_text)
                and window.startswith(text)
                and len(window) - len(text) >= _SETTLE_CHARS
            ):
                return self._commit(point, text)
        if pending > HARD_PENDING_TOKENS:
            return self._commit_all(window)
        return ""

    def flush(self) -> str:
        """Emit everything still held back (a trailing incomplete character as U+FFFD, as the full
        decode has it) and end the stream; returns that text. Later calls return ``""``."""
        if self._finished:
            return ""
        self._finished = True
        if len(self._ids) == self._read:
            return ""
        delta = self._decode(len(self._ids))[len(self._prefix_text):]
        if delta:
            self._chunks.append(delta)
        return delta

    def finish(self) -> str:
        """``flush()``, then the whole text: exactly ``tokenizer.decode(output_ids, ...)``."""
        self.flush()
        return self.text

    # ---- internals ---------------------------------------------------------------------------
    def _decode(self, end: int) -> str:
        if end == 0:
            return ""
        return self._tokenizer.decode(self._ids[:end], skip_special_tokens=self._skip)

    def _settled(self, text: str) -> bool:
        """Whether the end of ``text`` can no longer change when more tokens follow."""
        if text.endswith(REPLACEMENT_CHAR):
            return False
        return not (self._facts.cleans_up_spaces and text.endswith(_CLEANUP_OPEN_ENDS))

    def _ends_in_byte_run(self, end: int) -> bool:
        byte_ids = self._facts.byte_token_ids
        return bool(byte_ids) and self._ids[end - 1] in byte_ids

    def _splits_byte_run(self, point: int) -> bool:
        byte_ids = self._facts.byte_token_ids
        ids = self._ids
        return bool(byte_ids) and point < len(ids) and ids[point - 1] in byte_ids and ids[point] in byte_ids

    def _commit(self, point: int, text: str) -> str:
        """Emit the window's text up to token ``point`` (``text`` is its decode); the tokens
        emitted now become the next window's context."""
        delta = text[len(self._prefix_text):]
        if delta:
            self._chunks.append(delta)
        del self._ids[: self._read]
        self._read = point - self._read
        self._prefix_text = self._decode(self._read)
        return delta

    def _commit_all(self, window: str) -> str:
        """The bound: emit the whole window now, keeping only the last few tokens as context.

        A byte-level decode (lossy UTF-8) that ends inside a character ends in exactly one
        U+FFFD, and that character started within the last 3 bytes, so within the kept context:
        leaving that one U+FFFD out of both the emitted text and the context's text makes the
        next window's difference start at that character, which stays exact. A byte-fallback
        run is emitted as it decodes now (see "Bounds" in the module docstring)."""
        end = len(self._ids)
        strip = window.endswith(REPLACEMENT_CHAR) and not self._facts.byte_token_ids
        cut = max(len(self._prefix_text), len(window) - 1 if strip else len(window))
        delta = window[len(self._prefix_text) : cut]
        if delta:
            self._chunks.append(delta)
        keep = min(_SETTLE_TOKENS, end)
        del self._ids[: end - keep]
        self._read = keep
        context = self._decode(keep)
        if strip and context.endswith(REPLACEMENT_CHAR):
            context = context[:-1]
        self._prefix_text = context
        return delta


class StopStringMatcher:
    """Finds stop strings completed by the characters just added, searching only the text's tail.

    ``find(text, new_chars)`` returns where the text must be cut (the start of the earliest-
    starting stop string among those that end within the last ``new_chars`` characters), or
    ``None``. Called once per step with the characters that step added, it implements the rule in
    the module docstring; the work is O(new_chars + len(stop)) per stop string per call.
    """

    def __init__(self, stop_strings: Iterable[str]):
        self.stop_strings: Tuple[str, ...] = tuple(dict.fromkeys(s for s in stop_strings if s))
        self.max_len = max((len(s) for s in self.stop_strings), default=0)

    @classmethod
    def for_params(cls, params: Any) -> "StopStringMatcher":
        """The matcher for a request's ``SamplingParams.stop_strings`` (cached, so a step does not
        rebuild it)."""
        return _matcher_for(tuple(getattr(params, "stop_strings", None) or ()))

    def __bool__(self) -> bool:
        return bool(self.stop_strings)

    def find(self, text: str, new_chars: int) -> Optional[int]:
        match = self.find_match(text, new_chars)
        return match[0] if match is not None else None

    def find_match(self, text: str, new_chars: int) -> Optional[Tuple[int, int]]:
        """``(start, end)`` of the stop string ``find`` cuts at (the first listed among those
        starting there), or ``None``."""
        if new_chars <= 0 or not self.stop_strings:
            return None
        n = len(text)
        new_start = n - min(new_chars, n)
        best: Optional[Tuple[int, int]] = None
        for stop in self.stop_strings:
            # an occurrence ending in the new characters starts at or after this
            i = text.find(stop, max(0, new_start - len(stop) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, i + len(stop))
        return best


@lru_cache(maxsize=256)
def _matcher_for(stop_strings: Tuple[str, ...]) -> StopStringMatcher:
    return StopStringMatcher(stop_strings)
