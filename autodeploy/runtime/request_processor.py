"""Prompts in, engine requests out: tokenization, chat templates and every check a request needs.

``LLM`` and the HTTP server both turn what a user sent into a ``PreparedRequest`` here, and only
here; the engine takes prepared requests without checking them again. So a rule (the prompt
fits the context, token ids are in the vocabulary, stop strings need a tokenizer) lives in one
place and every entry point applies it the same way.

The tokenizer is loaded on first use (``TokenizerHandle``): a checkpoint without tokenizer
files still serves token-id prompts, and a text prompt then gets an error saying why there is
no tokenizer and what to send instead. ``skip_tokenizer_init`` (vLLM's name) never loads one.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..utils.errors import AutoDeployError
from ..utils.logging import get_logger
from .sampling_params import InvalidRequestError, SamplingParams

logger = get_logger(__name__)

# A prompt: text, token ids, or a mapping with ``prompt_token_ids`` (and optionally its ``prompt``
# text) or ``prompt``.
Prompt = Union[str, Sequence[int], Mapping[str, Any]]
Message = Mapping[str, Any]


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt tokenized and checked against the model (``RequestProcessor.check``)."""

    prompt: Optional[str]  # the prompt's text, when it came as text (or with its text)
    prompt_token_ids: List[int]
    # vLLM's: a prompt mapping's "cache_salt"; prefix caching shares pages only under the same one
    cache_salt: Optional[str] = None


@dataclass(frozen=True)
class PreparedRequest:
    """A request that passed every check; made by ``RequestProcessor.prepare`` only."""

    prompt: Optional[str]
    prompt_token_ids: List[int]
    params: SamplingParams
    cache_salt: Optional[str] = None
    priority: int = 0  # the priority scheduling policy serves lower values first


class TokenizerHandle:
    """The tokenizer, loaded the first time something needs it.

    ``load`` raises ``AutoDeployError`` when there is none; that reason is remembered and
    repeated in the error of every request that needs text.
    """

    def __init__(self, load: Callable[[], Any], skip: bool = False):
        self._load = load
        self._skip = skip
        self._tokenizer: Any = None
        self._error: Optional[str] = "skip_tokenizer_init is set" if skip else None
        self._tried = skip

    def _try(self) -> None:
        if self._tried:
            return
        self._tried = True
        try:
            self._tokenizer = self._load()
        except AutoDeployError as exc:
            self._error = str(exc)
            logger.warning("no tokenizer: %s; prompts must be token ids and outputs have no text", exc)

    @property
    def available(self) -> bool:
        self._try()
        return self._tokenizer is not None

    @property
    def tokenizer(self) -> Any:
        """The tokenizer, or ``None`` when there is none (see ``available``)."""
        self._try()
        return self._tokenizer

    def require(self, purpose: str) -> Any:
        """The tokenizer, or an ``InvalidRequestError`` saying why ``purpose`` cannot be served."""
        self._try()
        if self._tokenizer is None:
            raise InvalidRequestError(
                f"{purpose} needs a tokenizer, but there is none ({self._error}); give prompts as token ids "
                "({'prompt_token_ids': [...]}), or load one (tokenizer=<checkpoint or hub id>)"
            )
        return self._tokenizer


class RequestProcessor:
    """Turns user prompts into ``PreparedRequest``s for one deployed model."""

    def __init__(self, tokenizer: TokenizerHandle, *, max_seq_len: int, vocab_size: Optional[int],
                 hidden_state_layers: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        # the decoder layers whose hidden states the build captures (insert_cached_residual_add)
        self.hidden_state_layers = list(hidden_state_layers)

    # ---- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> Tuple[Optional[str], List[int]]:
        """``(text, token ids)`` of a prompt in any accepted form (token ids are not checked here)."""
        if isinstance(prompt, str):
            return prompt, self._tokenize(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                    raise InvalidRequestError("'prompt_token_ids' must be a list of integers")
                text = prompt.get("prompt")
                return (text if isinstance(text, str) else None), list(ids)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self._tokenize(prompt["prompt"])
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            return None, list(prompt)
        raise InvalidRequestError(
            f"expected a string, a list of token ids or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    def _tokenize(self, text: str) -> List[int]:
        """A text prompt's ids, with the tokenizer's special tokens (e.g. BOS): the rule for text
        prompts everywhere (token-id prompts are used as sent). An empty text is refused here,
        before a BOS would make it look like a prompt. ``verbose=False``: a prompt longer than the
        tokenizer's ``model_max_length`` gets this processor's context error, not transformers'
        warning first."""
        if not text:
            raise InvalidRequestError("the prompt is empty; give at least one character (or token)")
        return list(self.tokenizer.require("a text prompt")(text, verbose=False)["input_ids"])

    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    tools: Optional[Sequence[Mapping[str, Any]]] = None, *, continue_final_message: bool = False,
                    documents: Optional[Sequence[Mapping[str, Any]]] = None,
                    template_kwargs: Optional[Mapping[str, Any]] = None,
                    chat_template: Optional[str] = None) -> Dict[str, Any]:
        """One conversation rendered with the tokenizer's chat template, as a prompt mapping
        (the template adds the special tokens, so none are added when tokenizing). ``tools``:
        function definitions (OpenAI's ``{"type": "function", "function": {...}}``) the template
        shows the model; ``documents``: for templates that cite them; ``continue_final_message``:
        the last (assistant) message is left open for the model to go on with;
        ``template_kwargs``: more variables for the template (e.g. Qwen 3's ``enable_thinking``);
        ``chat_template``: a Jinja template used instead of the tokenizer's, for this conversation
        only (transformers renders it in Jinja's sandbox). A template that refuses the
        conversation (many raise on roles out of order) is an ``InvalidRequestError`` with its
        message."""
        if not messages:
            raise InvalidRequestError("the conversation has no messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message; it cannot also open a new "
                                      "one: set add_generation_prompt to false")
        tokenizer = self.tokenizer.require("a chat conversation")
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("this model's tokenizer has no chat template; send plain prompts instead "
                                      "(or give one: the chat_template setting)")
        import jinja2

        try:
            text = tokenizer.apply_chat_template(
                list(messages), tools=list(tools) if tools else None, documents=list(documents) if documents else None,
                tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **({"chat_template": chat_template} if chat_template is not None else {}),
                **dict(template_kwargs or {}))
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"the chat template cannot render this conversation: {exc}") from None
        return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]}

    def decode(self, token_ids: Sequence[int]) -> Optional[str]:
        """Text of token ids, or ``None`` without a tokenizer."""
        tok = self.tokenizer.tokenizer
        return tok.decode(list(token_ids)) if tok is not None else None

    # ---- checks --------------------------------------------------------------------------------
    def room(self, num_prompt_tokens: int) -> int:
        """Tokens a prompt of this length leaves for generation within ``max_seq_len``."""
        return self.max_seq_len - num_prompt_tokens

    def check_prompt(self, ids: Sequence[Any]) -> List[int]:
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt token ids must be integers")
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        if len(ids) >= self.max_seq_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but max_seq_len is {self.max_seq_len} (prompt and generated "
                "tokens together); shorten it or raise max_seq_len", code="context_length_exceeded",
            )
        if self.vocab_size is not None and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        return list(ids)

    def check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if params.stop_strings:
            self.tokenizer.require("a stop string")
        banned = [t for ids in params.bad_words_token_ids or () for t in ids]
        if banned and self.vocab_size is not None and max(banned) >= self.vocab_size:
            raise InvalidRequestError(f"bad_words_token_ids must be in [0, {self.vocab_size}); got {max(banned)}")
        allowed = params.allowed_token_ids
        if allowed and self.vocab_size is not None and max(allowed) >= self.vocab_size:
            raise InvalidRequestError(f"allowed_token_ids must be in [0, {self.vocab_size}); got {max(allowed)}")
        if params.logit_bias and self.vocab_size is not None and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {self.vocab_size}); got "
                                      f"{max(params.logit_bias)}")
        if params.return_hidden_states and not self.hidden_state_layers:
            raise InvalidRequestError(
                "return_hidden_states: this deployment captures no hidden states; build it with the layers to capture, "
                "e.g. LLM(model, transforms={'insert_cached_residual_add': {'layers': [0, -1]}}) (YAML: "
                "transforms.insert_cached_residual_add.layers). A model served in recompute mode captures none"
            )

    def check(self, prompt: Prompt, truncate: Optional[int] = None) -> CheckedPrompt:
        """Tokenize and check a prompt (once: ``prepare`` does not check a ``CheckedPrompt`` again).
        ``truncate`` (``SamplingParams.truncate_prompt_tokens``): a longer prompt keeps its last
        that many tokens (-1: the most ``max_seq_len`` leaves room for), and has no text then."""
        if isinstance(prompt, CheckedPrompt):
            return prompt
        text, ids = self.encode(prompt)
        keep = self.max_seq_len - 1 if truncate == -1 else truncate
        if keep is not None and len(ids) > keep:
            text, ids = None, ids[len(ids) - keep:]
        salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError("cache_salt must be a non-empty string")
        return CheckedPrompt(text, self.check_prompt(ids), salt)

    def prepare(self, prompt: Union[Prompt, CheckedPrompt], params: SamplingParams,
                priority: int = 0) -> PreparedRequest:
        """The one place a request is checked; the engine trusts what this returns. ``bad_words``
        become token sequences here (``bad_words_token_ids``), with the tokenizer. ``priority``:
        for the priority scheduling policy (lower is served first)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        self.check_params(params)
        checked = self.check(prompt, params.truncate_prompt_tokens)
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=list(params.bad_words_token_ids or [])
                                         + self.bad_words_token_ids(params.bad_words))
        return PreparedRequest(checked.prompt, checked.prompt_token_ids, params, checked.cache_salt, priority)

    def bad_words_token_ids(self, words: Sequence[str]) -> List[List[int]]:
        """vLLM's reading of ``bad_words``: each word's tokens at the start of a text, and after a
        space where that makes a different first token (the word in the middle of a text)."""
        tokenizer = self.tokenizer.require("bad_words")
        out: List[List[int]] = []
        for word in words:
            alone = tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"]
            spaced = tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"]
            out.append(list(alone))
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(list(spaced))
        return out

    def prepare_all(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams],
                    priorities: Optional[Sequence[int]] = None) -> List[PreparedRequest]:
        """Every prompt prepared, or ``InvalidRequestError`` naming the first bad one (nothing queued)."""
        out = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                out.append(self.prepare(prompt, p, priorities[i] if priorities is not None else 0))
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"prompt {i}: {exc}", code=exc.code) from None
        return out
