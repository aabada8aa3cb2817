"""Beam search over the engine: ``LLM.beam_search`` and the server's ``use_beam_search``.

The engine decodes sequences independently, so beam search is driven from outside it, as vLLM
does: every step each live beam is one request of one token (``max_tokens=1``) asking for the
log-probabilities of its ``2 * beam_width`` most likely next tokens; prefix caching lets the beams
read their shared history from cached pages instead of computing it again. ``BeamSearch`` holds
the beams of one prompt and does the bookkeeping; whoever drives it (the synchronous ``LLM``,
the asynchronous server) runs its ``requests()`` and hands the outputs to ``advance``.

The search is HF transformers' (``generate(num_beams=k)``, ``early_stopping=False``), the
correctness reference: each step takes the ``2k`` best continuations of all beams by the sum of
their log-probabilities; those of the first ``k`` that end (on EOS, or at ``max_tokens``) become
finished hypotheses scored by that sum divided by ``generated_length ** length_penalty`` (the EOS
counted), the best ``k`` kept; the best ``k`` that do not end are the next beams. It stops when
every continuation ends or when no beam can beat the worst of ``k`` finished hypotheses any more
(HF's heuristic: the best beam's sum over its current length). The results are the finished
hypotheses, best first. Log-probabilities are the model's own (no penalties or temperature).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .errors import InvalidRequestError
from .request_processor import CheckedPrompt
from .sampling_params import SamplingParams

@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams, at most ``max_tokens`` new tokens; ``length_penalty`` (HF's and
    vLLM's: the exponent of the length a finished hypothesis's log-probability is divided by;
    above 0 favours longer ones); ``ignore_eos``: hypotheses end only at ``max_tokens``."""

    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or not 1 <= self.beam_width <= 10:
            raise InvalidRequestError(f"invalid beam search parameter: beam_width must be an integer in [1, 10] "
                                      f"(it asks the engine for 2 x beam_width log-probabilities a step, at most 20), "
                                      f"got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequestError(f"invalid beam search parameter: max_tokens must be an integer >= 1, got "
                                      f"{self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool) \
                or self.length_penalty != self.length_penalty:
            raise InvalidRequestError(f"invalid beam search parameter: length_penalty must be a number, got "
                                      f"{self.length_penalty!r}")

    def step_params(self) -> SamplingParams:
        """One beam's request each step: one token, and the log-probabilities of the ``2k`` best."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2 * self.beam_width)


@dataclass
class BeamSearchSequence:
    """A finished hypothesis: its new tokens (the EOS that ended it included), their text (special
    tokens skipped), the sum of their log-probabilities and the score it was ranked by."""

    token_ids: List[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) or "length"
    text: str = ""


@dataclass
class BeamSearchOutput:
    prompt_token_ids: List[int]
    sequences: List[BeamSearchSequence] = field(default_factory=list)  # best first


@dataclass
class _Beam:
    token_ids: List[int]
    cum_logprob: float


class BeamSearch:
    """The beams of one prompt (module docstring). The prompt and ``max_tokens`` must leave the last
    step's input inside ``max_seq_len`` (an ``InvalidRequestError`` before any step otherwise)."""

    def __init__(self, prompt: CheckedPrompt, params: BeamSearchParams, eos_token_ids: Sequence[int],
                 max_seq_len: int):
        self.prompt = list(prompt.prompt_token_ids)
        if len(self.prompt) + params.max_tokens - 1 >= max_seq_len:
            raise InvalidRequestError(f"the prompt has {len(self.prompt)} tokens and beam search's max_tokens is "
                                      f"{params.max_tokens}: they do not fit in max_seq_len {max_seq_len}",
                                      code="context_length_exceeded")
        self.cache_salt = prompt.cache_salt  # goes with every beam's request
        self.params = params
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.beams: List[_Beam] = [_Beam([], 0.0)]
        self.finished: List[Tuple[float, _Beam, str]] = []  # (score, hypothesis, finish reason), best first
        self.improvable = True  # HF's early-stop heuristic not met yet
        self.done = False

    def requests(self) -> List[CheckedPrompt]:
        """What each live beam runs this step: the prompt and its tokens so far (checked once, for
        the prompt: they stay inside ``max_seq_len``)."""
        return [CheckedPrompt(None, self.prompt + beam.token_ids, self.cache_salt) for beam in self.beams]

    def advance(self, next_logprobs: Sequence[Dict[int, float]]) -> None:
        """One step, given each beam's ``{token: log-probability}`` of its best next tokens
        (at least ``2k`` of them, from ``step_params``)."""
        k = self.params.beam_width
        candidates: List[Tuple[float, int, int]] = []  # (sum of log-probabilities, beam, token)
        for b, (beam, logprobs) in enumerate(zip(self.beams, next_logprobs)):
            best = sorted(logprobs.items(), key=lambda kv: -kv[1])[:2 * k]
            candidates += [(beam.cum_logprob + lp, b, t) for t, lp in best]
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then token order
        candidates = candidates[:2 * k]
        length = len(self.beams[0].token_ids) + 1  # every beam has as many tokens
        ends = [t in self.eos or length >= self.params.max_tokens for _, _, t in candidates]
        for rank, ((total, b, t), end) in enumerate(zip(candidates, ends)):
            if end and rank < k and self.improvable:
                score = total / (length ** self.params.length_penalty)
                reason = "stop" if t in self.eos else "length"
                self.finished.append((score, _Beam(self.beams[b].token_ids + [t], total), reason))
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[k:]
        going = [(total, b, t) for (total, b, t), end in zip(candidates, ends) if not end][:k]
        self.beams = [_Beam(self.beams[b].token_ids + [t], total) for total, b, t in going]
        if self.beams and self.improvable and len(self.finished) == k:
            best_possible = self.beams[0].cum_logprob / (length ** self.params.length_penalty)
            self.improvable = best_possible > self.finished[-1][0]
        self.done = not self.beams or not self.improvable

    def output(self, tokenizer: Optional[Any] = None) -> BeamSearchOutput:
        """The finished hypotheses, best first, with their text (special tokens skipped) when there
        is a tokenizer."""
        return BeamSearchOutput(self.prompt, [
            BeamSearchSequence(beam.token_ids, beam.cum_logprob, score, reason,
                               tokenizer.decode(beam.token_ids, skip_special_tokens=True) if tokenizer else "")
            for score, beam, reason in self.finished])
