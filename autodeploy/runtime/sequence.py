"""One sequence being generated (a request with ``n`` completions has ``n`` of them)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

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
    output_token_ids: List[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys/values are in the cache
    pages: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    text: str = ""
    logprobs: Optional[List[Dict[int, float]]] = None

    @property
    def all_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache (the prompt, or the last sampled token)."""
        return self.num_tokens - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_computed > 0 and self.remaining == 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
