"""What a request returns (vLLM's shape: one ``RequestOutput`` with ``n`` completions)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    logprobs: Optional[List[Dict[int, float]]] = None  # per step: {token_id: logprob}, chosen first


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput] = field(default_factory=list)
    finished: bool = False

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
