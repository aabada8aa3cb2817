"""Turn next-token logits into tokens: greedy, temperature, min-p, top-k, top-p, per-request seeds
(penalties come before, in ``logits_processors``)."""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .sampling_params import SamplingParams


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """min-p, top-k, then top-p (vLLM's order) on one row of temperature-scaled logits."""
    if min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[Optional[torch.Generator]],
) -> List[int]:
    """One token per row of ``logits`` ([B, V], any float dtype; computed in fp32)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = torch.softmax(row, dim=-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            continue  # a degenerate distribution (overflowing logits): its argmax, never a failure
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> List[Tuple[int, float]]:
    """The chosen token's log probability first, then the ``top`` most likely tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = [(token, float(logp[token]))]
    if top > 0:
        values, ids = torch.topk(logp, top)
        out += [(int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist()) if int(t) != token]
    return out


def prompt_token_logprobs(logits: torch.Tensor, targets: Sequence[int],
                          top: int) -> Tuple[List[Dict[int, float]], List[int]]:
    """For each row of ``logits`` ([n, V]), the log probability of ``targets[i]`` first, then the
    ``top`` most likely tokens (one log-softmax over all rows; computed in fp32); and each
    target's rank, vLLM's: the number of tokens at least as likely (1: the most likely one)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = logp.gather(1, torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None])
    ranks = (logp >= chosen_t).sum(dim=-1).tolist()
    out = [{int(t): v} for t, v in zip(targets, chosen_t[:, 0].tolist())]
    if top > 0:
        values, ids = torch.topk(logp, top, dim=-1)
        for entry, row_ids, row_values in zip(out, ids.tolist(), values.tolist()):
            for t, v in zip(row_ids, row_values):
                entry.setdefault(int(t), float(v))
    return out, [int(r) for r in ranks]
