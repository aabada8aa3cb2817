"""What HF transformers eager computes for the coverage prompts: the ground truth.

Greedy decoding re-runs the whole sequence at every step (no KV cache), one prompt at a time
(no padding): slower than ``generate`` but it depends on nothing but the model's forward, so
a bug in HF's own cache classes or padding masks can never be mistaken for ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

import torch


@dataclass
class Reference:
    """Per prompt: the greedy tokens, the next-token logits after the prompt and after the first
    generated token, and the gap between the two best logits at each step (a tiny gap means a
    near-tie that fp32 rounding may flip)."""

    tokens: List[List[int]] = field(default_factory=list)
    prefill_logits: List[torch.Tensor] = field(default_factory=list)
    decode_logits: List[torch.Tensor] = field(default_factory=list)
    top2_gaps: List[List[float]] = field(default_factory=list)


def load_hf_eager(checkpoint: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _next_logits(model: torch.nn.Module, ids: List[int]) -> torch.Tensor:
    inputs = torch.tensor([ids], dtype=torch.long)
    try:
        out = model(input_ids=inputs, use_cache=False)
    except TypeError:  # a forward without use_cache
        out = model(input_ids=inputs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[0, -1].float()


@torch.inference_mode()
def hf_greedy_reference(model: torch.nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int) -> Reference:
    ref = Reference()
    for prompt in prompts:
        ids = list(prompt)
        tokens: List[int] = []
        gaps: List[float] = []
        for step in range(new_tokens):
            logits = _next_logits(model, ids)
            if step == 0:
                ref.prefill_logits.append(logits.clone())
            elif step == 1:
                ref.decode_logits.append(logits.clone())
            top = logits.topk(2).values
            gaps.append(float(top[0] - top[1]))
            token = int(logits.argmax())
            tokens.append(token)
            ids.append(token)
        ref.tokens.append(tokens)
        ref.top2_gaps.append(gaps)
    return ref
