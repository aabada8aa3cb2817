"""The bytes each token adds to the output text, which is what guided decoding constrains.

A token's string in the vocabulary is not its text: byte-level BPE (GPT-2, Llama 3, Qwen) spells
bytes as printable characters (``Ġ`` is a space), SentencePiece writes a space as ``▁`` and bytes
it has no piece for as ``<0xNN>`` tokens, and its decoder drops the space that starts the first
token of a text. ``TokenVocab.from_tokenizer`` reads the tokenizer's decoder (a fast tokenizer's
``tokenizer.json``) to tell these apart, maps every token to its bytes, and then checks the map on
a sample text against the tokenizer's own ``decode``: a tokenizer it does not understand is refused
with an error instead of constraining the wrong bytes.

Special tokens (BOS, EOS, chat markers) have no bytes here (``None``): guided output never contains
them; the engine allows EOS separately once the output is complete.
"""

import json
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Set

from .errors import GuidedDecodingError

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# the check of the map: ASCII, JSON punctuation, digits, non-ASCII letters and an emoji (byte tokens)
# (ASCII only for a tokenizer that has no tokens for the rest: no byte fallback)
_SAMPLES = ('Hello world {"key": [1, 2.5e-3, true, null], "name": "Zoë 中文 🙂"}\n\tend',
            'Hello world {"key": [1, 2.5e-3, true, null], "name": "x_y"}\nend')


def _byte_level_alphabet() -> Dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): printable Latin-1 bytes
    stand for themselves, the others are shifted to code points from 256 on, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: Dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in keep:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def _decoder_steps(tokenizer: Any) -> List[Dict[str, Any]]:
    """The decoder of a fast tokenizer as a flat list of its steps (a ``Sequence`` unrolled)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GuidedDecodingError(
            f"guided decoding needs a fast tokenizer (tokenizer.json); {type(tokenizer).__name__} is a slow one")
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return [s for s in steps if s]


class TokenVocab:
    """``tokens[i]``: the bytes token ``i`` adds to a text; ``first[i]``: what it adds as the first
    token of the output (differs where the decoder strips a leading space). ``None``: never
    generated under guidance (special tokens, tokens without text)."""

    def __init__(self, tokens: List[Optional[bytes]], first: List[Optional[bytes]]):
        self.tokens, self.first = tokens, first
        self._derived: Dict[str, Any] = {}

    def derived(self, key: str, build: Callable[[], Any]) -> Any:
        """What ``build`` makes of this vocabulary (the token orders the mask builders use), made
        once and shared by every constraint."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "TokenVocab":
        steps = _decoder_steps(tokenizer)
        kinds = {s.get("type") for s in steps}
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        special = _special_ids(tokenizer)
        if "ByteLevel" in kinds:
            alphabet = _byte_level_alphabet()
            tokens = [None if i in special or p is None else _from_alphabet(p, alphabet) for i, p in enumerate(pieces)]
            first = tokens
        elif kinds & {"Metaspace", "Replace", "ByteFallback", "Strip", "Fuse"}:
            fallback = "ByteFallback" in kinds
            tokens = [None if i in special or p is None else _from_sentencepiece(p, fallback)
                      for i, p in enumerate(pieces)]
            first = [t[1:] if t and t[:1] == b" " else t for t in tokens] if _strips_first_space(steps) else tokens
        else:
            raise GuidedDecodingError(
                f"guided decoding does not know this tokenizer's decoder ({sorted(k for k in kinds if k) or 'none'}); "
                "it supports byte-level BPE and SentencePiece/Metaspace tokenizers")
        vocab = cls(tokens, first)
        vocab._check(tokenizer)
        return vocab

    def _check(self, tokenizer: Any) -> None:
        """Refuse a map that does not reproduce the tokenizer's decode of a sample text."""
        unknown = getattr(tokenizer, "unk_token_id", None)
        for sample in _SAMPLES:
            ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
            if unknown not in ids:
                break
        expected = tokenizer.decode(ids, skip_special_tokens=True).encode()
        parts = [self.first[ids[0]]] + [self.tokens[i] for i in ids[1:]]
        if any(p is None for p in parts) or b"".join(parts) != expected:  # type: ignore[arg-type]
            got = b"".join(p or b"?" for p in parts)
            raise GuidedDecodingError(
                f"guided decoding cannot map this tokenizer's tokens to text: its decode of a sample gives "
                f"{expected!r}, the token map {got!r}; use a byte-level BPE or SentencePiece tokenizer")


def _from_alphabet(piece: str, alphabet: Dict[str, int]) -> Optional[bytes]:
    try:
        return bytes(alphabet[c] for c in piece) or None
    except KeyError:  # an added token spelled in plain text (not in the byte alphabet)
        return piece.encode() or None


def _from_sentencepiece(piece: str, byte_fallback: bool) -> Optional[bytes]:
    match = _BYTE_TOKEN.fullmatch(piece) if byte_fallback else None
    if match is not None:
        return bytes([int(match.group(1), 16)])
    return piece.replace("\u2581", " ").encode() or None


def _strips_first_space(steps: List[Dict[str, Any]]) -> bool:
    """Whether the decoder drops the space that starts a text's first token (SentencePiece's
    ``Strip`` of one leading space, or ``Metaspace`` with a prefix space scheme)."""
    for step in steps:
        if step.get("type") == "Strip" and step.get("start", 0) >= 1:
            return True
        if step.get("type") == "Metaspace" and (step.get("prepend_scheme", "always") != "never"
                                                 and step.get("add_prefix_space", True)):
            return True
    return False


def _special_ids(tokenizer: Any) -> Set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


_CACHE: "weakref.WeakKeyDictionary[Any, TokenVocab]" = weakref.WeakKeyDictionary()


def vocab_of(tokenizer: Any) -> TokenVocab:
    """The tokenizer's ``TokenVocab``, built once per tokenizer object."""
    try:
        return _CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = TokenVocab.from_tokenizer(tokenizer)
    try:
        _CACHE[tokenizer] = vocab
    except TypeError:  # not weakly referenceable: build again next time
        pass
    return vocab

