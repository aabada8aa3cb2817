"""One sequence being generated (a request with ``n`` completions has ``n`` of them)."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .sampling_params import SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int
    prompt_token_ids: List[int]
    params: SamplingParams
    arrival: int
    generator: Optional[torch.Generator] = None
    # prompt then generated tokens, in one list: a step slices its new tokens without copying the rest
    token_ids: List[int] = field(init=False)
    num_computed: int = 0  # tokens whose keys/values are in the cache
    pages: List[int] = field(default_factory=list)
    # prefix caching: the pool's entry id of each of its full pages so far (``PagePool.register``)
    prefix_ids: List[int] = field(default_factory=list)
    # prefix caching: (tail page, its own page) when it starts from a copy of a tail page
    # (``PagePool.match_tail``): the step that admits it copies the page, then lets the tail go
    tail_copy: Optional[Tuple[int, int]] = None
    cache_salt: Optional[str] = None  # prefix caching: it shares cached pages only under this salt
    priority: int = 0  # the priority scheduling policy serves lower values first
    slot: Optional[int] = None  # its state slot while running (per-sequence state caches)
    # prefix caching with state snapshots: a page boundary where a prefill chunk ends so that a
    # copy of its state is kept there (``Scheduler``; None: no copy wanted)
    snapshot_at: Optional[int] = None
    # prefix caching with state snapshots: the snapshot it resumes from when admitted (the entry id
    # of its last matched page, or of the whole tail it matched; None: it starts from no state)
    resume_from: Optional[int] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # the stop_token_ids token or stop string that ended it
    logprobs: Optional[List[Dict[int, float]]] = None
    # SamplingParams.prompt_logprobs: entry j scores prompt token j given the tokens before it
    # (entry 0 is None: nothing precedes it); filled as prefill chunks run (None: not asked for)
    prompt_logprobs: Optional[List[Optional[Dict[int, float]]]] = None
    prompt_ranks: Optional[List[Optional[int]]] = None  # entry j: prompt token j's rank (vLLM's; 1 = most likely)
    detokenizer: Any = None  # an ``IncrementalDetokenizer`` when the engine has a tokenizer
    cut_text: Optional[str] = None  # the final text when a stop string cut it
    # SamplingParams.return_hidden_states: the captured hidden states of the tokens computed so
    # far, ``[tokens, layers, hidden]`` chunks in token order (None: not asked for)
    hidden_states: Optional[List[torch.Tensor]] = None
    num_hidden_rows: int = 0
    guide: Any = None  # a ``guided.Guide`` when the request constrains its output (SamplingParams.guided)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def add_hidden_states(self, start: int, rows: torch.Tensor) -> None:
        """The hidden states of tokens ``start..start + len(rows) - 1``. Rows from ``start`` on that
        are already there (a preempted sequence computing its tokens again) are replaced."""
        if self.hidden_states is None:
            return
        if start < self.num_hidden_rows:
            kept = torch.cat(self.hidden_states)[:start] if start else None
            self.hidden_states = [kept] if kept is not None else []
            self.num_hidden_rows = start
        self.hidden_states.append(rows)
        self.num_hidden_rows += int(rows.shape[0])

    def hidden_states_so_far(self) -> Optional[torch.Tensor]:
        """One ``[tokens computed, layers, hidden]`` tensor (None before the first step or when not
        asked for). The chunks are joined here, once, and kept joined."""
        if not self.hidden_states:
            return None
        if len(self.hidden_states) > 1:
            self.hidden_states = [torch.cat(self.hidden_states)]
        return self.hidden_states[0]

    @property
    def scores_prompt(self) -> bool:
        """Its next step needs the logits of every new token: prompt tokens remain to be scored
        (entry ``p + 1`` comes from the logits at position ``p``, and positions from
        ``num_computed`` on run next). A preempted sequence computing a prompt it already scored
        does not ask again."""
        prompt = len(self.prompt_token_ids)
        return (self.prompt_logprobs is not None and len(self.prompt_logprobs) < prompt
                and self.num_computed < prompt - 1)

    @property
    def may_share_prefix(self) -> bool:
        """Whether it may start from cached pages: not when it needs every prompt token's logits
        (prompt log-probabilities) or hidden states, which a skipped token would not produce."""
        return self.prompt_logprobs is None and self.hidden_states is None

    @property
    def text(self) -> str:
        """The output text so far: read from the detokenizer when asked, so no step copies it
        (empty without a tokenizer)."""
        if self.cut_text is not None:
            return self.cut_text
        return self.detokenizer.text if self.detokenizer is not None else ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> List[int]:
        """A copy of the generated tokens."""
        return self.token_ids[len(self.prompt_token_ids):]

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache (the prompt, or the last sampled token)."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_computed > 0 and self.remaining == 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
