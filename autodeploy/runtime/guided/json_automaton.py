"""A byte-level recognizer of one JSON object (OpenAI's ``response_format: {"type": "json_object"}``).

JSON nests without bound, so no regular expression describes it: this is a pushdown recognizer.
Its state is a small hashable tuple ``(mode, stack, aux)``:

* ``mode``: what the next byte may be (a value, a key, ``:``, ``,`` or a closing bracket, a byte of
  a string, a number or a literal);
* ``stack``: the open containers, one character each (``o`` object, ``a`` array), innermost last;
* ``aux``: the mode's counter: UTF-8 continuation bytes still due in a string, hex digits due in a
  ``\\uXXXX`` escape, bytes of ``true``/``false``/``null`` left, or the length of the current run
  of whitespace.

What it accepts: exactly the texts ``json.loads`` reads as a dict, with three deliberate limits
that keep a model from wandering: no whitespace before the object or after it (the output ends at
the closing brace), at most ``MAX_WHITESPACE`` whitespace bytes in a row between tokens, and
strings that are valid UTF-8 (``json.loads`` would read lone surrogate escapes too; they are
accepted as escapes). ``step`` returns ``None`` for a byte no continuation can follow, so a state
it returns can always still become a complete object.

``mask_key`` is what the token masks are cached by: a token of ``L`` bytes can look at most ``L``
containers deep, so two states that agree on mode, aux and the innermost ``MAX_TOKEN_DEPTH``
containers (and on whether there are more) allow the same tokens.
"""

from typing import Hashable, Optional, Tuple

MAX_WHITESPACE = 8
MAX_TOKEN_DEPTH = 64  # above the byte length of any token a vocabulary has

State = Tuple[int, str, int]

# modes
_VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER = range(6)  # structural (whitespace allowed)
_STRING, _KEY_STRING, _ESCAPE, _KEY_ESCAPE, _UNICODE, _KEY_UNICODE = range(6, 12)
_MINUS, _ZERO, _INT, _DOT, _FRAC, _EXP, _EXP_SIGN, _EXP_DIGITS = range(12, 20)
_TRUE, _FALSE, _NULL = range(20, 23)
_START = 23

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {_TRUE: b"true", _FALSE: b"false", _NULL: b"null"}
_LITERAL_START = {ord("t"): _TRUE, ord("f"): _FALSE, ord("n"): _NULL}
_STRUCTURAL = frozenset((_VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _COLON, _AFTER))
_NUMBER_END = frozenset((_ZERO, _INT, _FRAC, _EXP_DIGITS))  # a number may end in these


def _utf8_lead(byte: int) -> Optional[int]:
    """Continuation bytes a UTF-8 lead byte needs (None: not a lead byte)."""
    if 0xC2 <= byte <= 0xDF:
        return 1
    if 0xE0 <= byte <= 0xEF:
        return 2
    if 0xF0 <= byte <= 0xF4:
        return 3
    return None


class JsonObjectAutomaton:
    """The recognizer; stateless itself (every state is a value), so one instance serves all requests."""

    initial: State = (_START, "", 0)

    def accepting(self, state: State) -> bool:
        """The bytes so far are one complete JSON object."""
        mode, stack, _ = state
        return mode == _AFTER and not stack

    def mask_key(self, state: State) -> Hashable:
        mode, stack, aux = state
        return (mode, stack[-MAX_TOKEN_DEPTH:], len(stack) > MAX_TOKEN_DEPTH, aux)

    def step(self, state: State, byte: int) -> Optional[State]:
        mode, stack, aux = state
        if mode in _STRUCTURAL:
            return self._structural(mode, stack, aux, byte)
        if mode < _MINUS:
            return self._string(mode, stack, aux, byte)
        if mode < _TRUE:
            return self._number(mode, stack, byte)
        if mode == _START:
            return (_FIRST_KEY, "o", 0) if byte == ord("{") else None
        literal = _LITERALS[mode]
        if byte != literal[len(literal) - aux]:
            return None
        return (mode, stack, aux - 1) if aux > 1 else (_AFTER, stack, 0)

    # ---- structure -------------------------------------------------------------------------------
    def _structural(self, mode: int, stack: str, ws: int, byte: int) -> Optional[State]:
        if byte in _WS:
            if not stack or ws >= MAX_WHITESPACE:  # nothing after the object; bounded runs
                return None
            return (mode, stack, ws + 1)
        if mode in (_VALUE, _FIRST_ITEM):
            if mode == _FIRST_ITEM and byte == ord("]"):
                return self._close(stack)
            return self._value(stack, byte)
        if mode in (_FIRST_KEY, _KEY):
            if byte == ord('"'):
                return (_KEY_STRING, stack, 0)
            return self._close(stack) if mode == _FIRST_KEY and byte == ord("}") else None
        if mode == _COLON:
            return (_VALUE, stack, 0) if byte == ord(":") else None
        return self._after(stack, byte)  # _AFTER

    def _value(self, stack: str, byte: int) -> Optional[State]:
        if byte == ord('"'):
            return (_STRING, stack, 0)
        if byte == ord("{"):
            return (_FIRST_KEY, stack + "o", 0)
        if byte == ord("["):
            return (_FIRST_ITEM, stack + "a", 0)
        if byte == ord("-"):
            return (_MINUS, stack, 0)
        if byte == ord("0"):
            return (_ZERO, stack, 0)
        if byte in _DIGITS:
            return (_INT, stack, 0)
        literal = _LITERAL_START.get(byte)
        return (literal, stack, len(_LITERALS[literal]) - 1) if literal is not None else None

    def _after(self, stack: str, byte: int) -> Optional[State]:
        """After a value: ``,`` or the closing bracket of the innermost container."""
        if not stack:
            return None
        top = stack[-1]
        if byte == ord(","):
            return (_KEY, stack, 0) if top == "o" else (_VALUE, stack, 0)
        if byte == (ord("}") if top == "o" else ord("]")):
            return self._close(stack)
        return None

    @staticmethod
    def _close(stack: str) -> State:
        return (_AFTER, stack[:-1], 0)

    # ---- strings ---------------------------------------------------------------------------------
    def _string(self, mode: int, stack: str, aux: int, byte: int) -> Optional[State]:
        key = mode in (_KEY_STRING, _KEY_ESCAPE, _KEY_UNICODE)
        plain, escape, unicode = (_KEY_STRING, _KEY_ESCAPE, _KEY_UNICODE) if key else (_STRING, _ESCAPE, _UNICODE)
        if mode == escape:
            if byte == ord("u"):
                return (unicode, stack, 4)
            return (plain, stack, 0) if byte in _SIMPLE_ESCAPES else None
        if mode == unicode:
            if byte not in _HEX:
                return None
            return (unicode, stack, aux - 1) if aux > 1 else (plain, stack, 0)
        if aux:  # inside a multi-byte UTF-8 character
            return (plain, stack, aux - 1) if 0x80 <= byte <= 0xBF else None
        if byte == ord('"'):
            return (_COLON, stack, 0) if key else (_AFTER, stack, 0)
        if byte == ord("\\"):
            return (escape, stack, 0)
        if byte < 0x20:
            return None
        if byte < 0x80:
            return (plain, stack, 0)
        need = _utf8_lead(byte)
        return (plain, stack, need) if need is not None else None

    # ---- numbers ---------------------------------------------------------------------------------
    def _number(self, mode: int, stack: str, byte: int) -> Optional[State]:
        digit = byte in _DIGITS
        if mode == _MINUS:
            return (_ZERO if byte == ord("0") else _INT, stack, 0) if digit else None
        if digit and mode in (_INT, _DOT, _FRAC):
            return (_FRAC if mode != _INT else _INT, stack, 0)
        if digit and mode in (_EXP, _EXP_SIGN, _EXP_DIGITS):
            return (_EXP_DIGITS, stack, 0)
        if mode == _EXP and byte in b"+-":
            return (_EXP_SIGN, stack, 0)
        if mode in (_ZERO, _INT) and byte == ord("."):
            return (_DOT, stack, 0)
        if mode in (_ZERO, _INT, _FRAC) and byte in b"eE":
            return (_EXP, stack, 0)
        if mode in _NUMBER_END:  # the number ends here: the byte belongs to what follows it
            return self._structural(_AFTER, stack, 0, byte)
        return None

    def matches(self, data: bytes) -> bool:
        """Whether ``data`` is one complete JSON object (a convenience for tests and callers)."""
        state: Optional[State] = self.initial
        for byte in data:
            state = self.step(state, byte)
            if state is None:
                return False
        return self.accepting(state)
