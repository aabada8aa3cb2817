"""What a request returns (vLLM's shape: one ``RequestOutput`` with ``n`` completions)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import torch


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    logprobs: Optional[List[Dict[int, float]]] = None  # per step: {token_id: logprob}, chosen first
    # SamplingParams(return_hidden_states=True): ``[tokens, layers, hidden]`` (CPU), row j the hidden
    # state leaving each captured layer (LLM.hidden_state_layers, in that order) at token j of
    # prompt + token_ids. Only tokens the model ran have one: the last generated token was never fed
    # back, so a finished output has len(prompt_token_ids) + len(token_ids) - 1 rows, and row
    # len(prompt_token_ids) - 1 + k is the state token_ids[k] was sampled from.
    hidden_states: Optional[torch.Tensor] = None
    # vLLM's: the stop_token_ids token or the stop string that ended the output; None when it
    # ended otherwise (EOS, max_tokens, ...) or is running
    stop_reason: Union[int, str, None] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} given the tokens before
    # it, the prompt's own token first, then the top alternatives; the first entry is None.
    # Complete once the prompt's prefill finished (a streamed output may hold a prefix).
    prompt_logprobs: Optional[List[Optional[Dict[int, float]]]] = None
    # with prompt_logprobs: each prompt token's rank among the model's predictions for it (vLLM's:
    # how many tokens are at least as likely; 1 = the most likely); the first entry is None
    prompt_ranks: Optional[List[Optional[int]]] = None

    # Shortcuts for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> List[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason

    @property
    def hidden_states(self) -> Optional[torch.Tensor]:
        return self.outputs[0].hidden_states
