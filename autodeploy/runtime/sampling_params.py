"""``SamplingParams``: how one request is decoded (vLLM's conventions)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

from .errors import InvalidRequestError
from .guided.params import GuidedDecodingParams


GREEDY_BELOW = 1e-5


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


@dataclass(frozen=True)
class SamplingParams:
    """``temperature=0`` (or below 1e-5) is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.

    Validated once, on construction, and immutable afterwards (``dataclasses.replace`` makes a
    changed copy, validated again), so a request's parameters cannot change between the check
    and the run.

    ``stop`` strings end the output (the text is cut before them, or after with
    ``include_stop_str_in_output``, vLLM's name); ``stop_token_ids`` and the model's EOS token end
    it too unless ``ignore_eos`` (the token that ends it is counted in ``token_ids`` but adds no
    text, unless ``include_stop_str_in_output``: vLLM's rule); ``skip_special_tokens`` (vLLM's;
    default True): special tokens add no text; none of them before ``min_tokens`` tokens (EOS and
    ``stop_token_ids`` cannot be sampled until then). Penalties, applied to the logits before the
    temperature (``logits_processors``): ``repetition_penalty`` (vLLM's and HF's: a token seen in
    the prompt or the output has its logit divided by it when positive, multiplied when negative; 1
    is off), ``frequency_penalty`` and ``presence_penalty`` (OpenAI's: subtract the penalty times
    the token's count in the output, and once more if it occurs at all; 0 is off); ``logit_bias``
    (OpenAI's: token id -> a bias in [-100, 100] added to its logit). ``bad_words`` (vLLM's: each
    word as the tokenizer writes it at the start of a text and after a space) and
    ``bad_words_token_ids`` (HF's ``bad_words_ids``): a token that would complete one of these
    sequences, the output so far ending with the rest of it, cannot be sampled.
    ``allowed_token_ids`` (vLLM's): only these tokens can be sampled (EOS too only if listed).
    ``truncate_prompt_tokens`` (vLLM's): a longer prompt keeps only its last that many tokens (-1:
    as many as ``max_seq_len`` leaves room for, one token to generate). ``min_p`` drops tokens less
    likely than ``min_p`` times the most likely one (after the temperature, before top-k / top-p).
    Log-probabilities are always those of the model's own distribution, before any of these.
    ``seed`` makes sampling reproducible per request. ``n`` completions per prompt; ``logprobs``
    returns the chosen token's log probability and that many top alternatives per step;
    ``prompt_logprobs`` (vLLM's name) returns each prompt token's log probability given the tokens
    before it, and that many top alternatives (``RequestOutput.prompt_logprobs``; the first token
    has none). ``max_tokens=0`` scores the prompt without generating (it needs ``prompt_logprobs``).
    ``return_hidden_states`` returns the hidden states the build captures
    (``transforms.insert_cached_residual_add.layers``) for every token the model ran
    (``CompletionOutput.hidden_states``); a build that captures none refuses the request. ``guided``
    (``GuidedDecodingParams``, or a dict of its fields) constrains the output to a JSON Schema, a
    JSON object, a regular expression or a list of choices: tokens that cannot continue it are
    masked out, EOS is allowed only once the output is complete, and the sequence ends
    (``finish_reason`` "stop") as soon as nothing can follow.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: Optional[List[str]] = None
    bad_words_token_ids: Optional[List[List[int]]] = None
    allowed_token_ids: Optional[List[int]] = None
    truncate_prompt_tokens: Optional[int] = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: Optional[Dict[int, float]] = None
    n: int = 1
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_hidden_states: bool = False
    guided: Optional[GuidedDecodingParams] = None
    stop_strings: List[str] = field(init=False, default_factory=list, repr=False)
    # whether ``logits_processors`` changes this request's logits before sampling (read every step)
    adjusts_logits: bool = field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_strings", [self.stop] if isinstance(self.stop, str) else list(self.stop or []))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        if isinstance(self.guided, dict):
            unknown = sorted(set(self.guided) - {"json", "regex", "choice", "grammar", "json_object",
                                                 "whitespace_pattern"})
            if unknown:
                raise InvalidRequestError(f"invalid sampling parameter: guided has no field(s) {unknown}; "
                                          "it takes json, regex, choice, grammar, json_object and whitespace_pattern")
            object.__setattr__(self, "guided", GuidedDecodingParams(**self.guided))
        self.validate()
        object.__setattr__(self, "adjusts_logits", self.repetition_penalty != 1 or self.frequency_penalty != 0
                           or self.presence_penalty != 0 or self.min_tokens > 0 or bool(self.logit_bias)
                           or self.guided is not None or bool(self.bad_words) or bool(self.bad_words_token_ids)
                           or self.allowed_token_ids is not None)

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise bad(f"max_tokens must be an integer >= 1 (or 0 with prompt_logprobs), got {self.max_tokens!r}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise bad("max_tokens=0 generates nothing; it is only for scoring a prompt: set prompt_logprobs too")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop must be a non-empty string or a list of them")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(f"{name} must be in [-2, 2] (0 is off), got {getattr(self, name)!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1] (0 is off), got {self.min_p!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.logit_bias):
                raise bad("logit_bias must map token ids (integers >= 0) to biases")
            if any(not _number(b) or not -100 <= b <= 100 for b in self.logit_bias.values()):
                raise bad("logit_bias values must be numbers in [-100, 100]")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad(f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or len(self.bad_words) > 256 or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words must be a list of at most 256 non-blank strings")
        if self.bad_words_token_ids is not None and (
                not isinstance(self.bad_words_token_ids, list) or len(self.bad_words_token_ids) > 1024 or any(
                    not isinstance(ids, list) or not ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0
                                                               for t in ids) for ids in self.bad_words_token_ids)):
            raise bad("bad_words_token_ids must be a list of at most 1024 non-empty lists of token ids (integers >= 0)")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        if self.allowed_token_ids is not None and self.guided is not None:
            raise bad("allowed_token_ids and guided both choose the tokens that may come next; give one of them")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
                or not (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)):
            raise bad(f"truncate_prompt_tokens must be an integer >= 1, or -1 (as many as max_seq_len allows), got "
                      f"{self.truncate_prompt_tokens!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad(f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}")
        if self.guided is not None and not isinstance(self.guided, GuidedDecodingParams):
            raise bad(f"guided must be a GuidedDecodingParams (or a dict of its fields), got {self.guided!r}")
        if not isinstance(self.return_hidden_states, bool):
            raise bad(f"return_hidden_states must be True or False, got {self.return_hidden_states!r}")

    @property
    def greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows fp32; the distribution is
        # a point mass on the argmax anyway.
        return self.temperature < GREEDY_BELOW
