"""How close each autodeploy engine's answers are to HF eager's, measured in the benchmark run.

A speed number means little for a variant that changes the numerics (``gemv_dtype`` rounds
batch-1 decode to float16/bfloat16), so the report puts its accuracy beside it. Each prompt is
generated alone (batch 1, greedy, the path such a variant serves) with the chosen tokens'
top log-probabilities; HF then reads the prompt plus those same tokens in one forward pass
(teacher forcing), which gives its log-probabilities for every step's exact context. Comparing
step by step, rather than HF's own generation against ours, keeps one early flip from
counting every later token as an error.

Reported per engine: the share of steps whose token is HF's argmax for that context, the number
of prompts whose whole continuation equals HF greedy, and the largest difference of a
log-probability (over the top tokens the engine returned).
"""

from typing import Any, Dict, List

import torch
from torch import nn

TOP_LOGPROBS = 5


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=gen).tolist()


def compare_with_hf(llm: Any, reference: nn.Module, prompts: List[List[int]], new_tokens: int) -> Dict[str, Any]:
    from ..runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    device = next(reference.parameters()).device
    steps = agreed = equal = 0
    worst = 0.0
    for prompt in prompts:
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
        if len(out.token_ids) != new_tokens:
            raise RuntimeError(f"accuracy check: {len(out.token_ids)} of {new_tokens} tokens generated "
                               f"({out.finish_reason}); is max_seq_len below prompt + {new_tokens}?")
        ids = torch.tensor([prompt + out.token_ids[:-1]], device=device)
        with torch.inference_mode():
            logits = reference(ids).logits[0, len(prompt) - 1:]
        ref = torch.log_softmax(logits.double(), dim=-1).cpu()
        best = ref.argmax(dim=-1).tolist()
        matches = [int(b == t) for b, t in zip(best, out.token_ids)]
        steps += len(matches)
        agreed += sum(matches)
        equal += all(matches)
        for step, top in enumerate(out.logprobs or []):
            worst = max(worst, max(abs(lp - float(ref[step, token])) for token, lp in top.items()))
    return {"greedy_step_match": agreed / max(steps, 1), "prompts_equal_hf": equal, "prompts": len(prompts),
            "new_tokens": new_tokens, "max_logprob_abs_err": worst}
