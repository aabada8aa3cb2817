"""One sequence's progress through its constraint, and the engine's store of token masks.

``Guides`` (one per engine) holds the tokenizer's ``TokenVocab`` and a ``TokenMasks`` per
automaton, so requests with the same schema share their masks. ``Guide`` (one per sequence)
holds the automaton state after the tokens generated so far: ``mask()`` is what the next token
may be, ``advance(token)`` moves on, ``complete`` says no token can follow (the engine finishes
the sequence then, without waiting for an EOS token).
"""

from collections import OrderedDict
from typing import Any, Hashable, Optional

import torch

from ...utils.logging import get_logger
from .errors import GuidedDecodingError
from .params import GuidedDecodingParams
from .token_masks import TokenMasks
from .vocab import vocab_of

MAX_AUTOMATA = 16  # constraints whose masks are kept (each up to MASK_CACHE_SIZE masks)

logger = get_logger(__name__)


class Guide:
    def __init__(self, masks: TokenMasks):
        self._masks = masks
        self.state: Hashable = masks.automaton.initial
        self.first = True  # no token generated yet
        # the constraint cannot go on: its automaton grew past its limit (``error`` says so), or a
        # token it refuses was appended (a degenerate sample); the engine aborts the sequence
        self.failed = False
        self.error: Optional[str] = None
        self._width: Optional[int] = None  # the logits width the masks are built for

    def mask(self, width: int) -> torch.Tensor:
        """``[width]`` bool: the tokens that keep the output completable (all of them once the
        guide has failed: the sequence is aborted after this step)."""
        self._width = width
        if not self.failed:
            try:
                return self._masks.mask(self.state, self.first, width)
            except GuidedDecodingError as exc:
                self._fail(exc)
        return torch.ones(width, dtype=torch.bool)

    def _fail(self, exc: GuidedDecodingError) -> None:
        """The automaton cannot go on (its limits: DFA states, nesting, ambiguity): the sequence ends."""
        logger.warning("guided decoding stops this sequence: %s", exc)
        self.failed, self.error = True, str(exc)

    @property
    def accepting(self) -> bool:
        """The output so far is complete (EOS may come now)."""
        return not self.failed and self._masks.automaton.accepting(self.state)

    @property
    def complete(self) -> bool:
        """Nothing can follow: the output is done (or the constraint failed)."""
        if self.failed:
            return True
        if not self.accepting:
            return False
        return not bool(self.mask(self._width or len(self._masks.tokens)).any()) or self.failed

    def advance(self, token: int) -> bool:
        """Move past ``token``; True when the output is then complete (nothing can follow)."""
        if self.failed:
            return True
        tokens = self._masks.tokens_first if self.first else self._masks.tokens
        data = tokens[token] if 0 <= token < len(tokens) else None
        state = self.state
        try:
            for byte in data or b"":
                state = self._masks.automaton.step(state, byte)
                if state is None:
                    break
        except GuidedDecodingError as exc:  # a pushdown recognizer's limits (nesting, ambiguity)
            self._fail(exc)
            return True
        if not data or state is None:
            logger.warning("guided decoding: token %d does not continue the constrained output; "
                           "the sequence ends here", token)
            self.failed = True
            return True
        self.state = state
        self.first = False
        return self.complete


class Guides:
    """The engine's token masks: one ``TokenMasks`` per constraint, for its tokenizer."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._masks: "OrderedDict[int, TokenMasks]" = OrderedDict()

    def start(self, params: GuidedDecodingParams) -> Guide:
        automaton = params.automaton()
        key = id(automaton)
        masks = self._masks.get(key)
        if masks is None or masks.automaton is not automaton:
            masks = TokenMasks(automaton, vocab_of(self._tokenizer))
            self._masks[key] = masks
            if len(self._masks) > MAX_AUTOMATA:
                self._masks.popitem(last=False)
        self._masks.move_to_end(key)
        return Guide(masks)
