"""Per-request changes to the next-token logits before sampling: penalties and ``min_tokens``.

Applied to the model's raw logits (fp32), before the temperature and the filters of ``sampler``,
with vLLM's semantics (``SamplingParams`` documents each):

* ``repetition_penalty`` ``r`` (as HF's ``RepetitionPenaltyLogitsProcessor``): every token that
  occurs in the prompt or the output so far has its logit ``l`` replaced by ``l / r`` when
  ``l > 0`` and ``l * r`` otherwise, so ``r > 1`` makes repeats less likely either way;
* ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (OpenAI's): ``l - f * c - p * (c > 0)``
  with ``c`` the token's count in the output so far (the prompt does not count);
* ``logit_bias`` (OpenAI's): each listed token's bias added to its logit (-100 all but bans it);
* ``min_tokens``: until that many tokens are out, the EOS tokens (unless ``ignore_eos``) and
  ``stop_token_ids`` cannot be sampled.

Only the rows of requests that ask for one of these are touched (``SamplingParams.adjusts_logits``);
a batch without any returns its logits as they are.
"""

from typing import AbstractSet, List, Sequence as Seq

import torch

from .sequence import Sequence


def process_logits(logits: torch.Tensor, sequences: Seq[Sequence], eos_token_ids: AbstractSet[int]) -> torch.Tensor:
    """``logits`` ([B, V]) with each row changed as its sequence's parameters say."""
    rows = [i for i, seq in enumerate(sequences) if seq.params.adjusts_logits]
    if not rows:
        return logits
    logits = logits.float().clone()
    for i in rows:
        logits[i] = _process_row(logits[i], sequences[i], eos_token_ids)
    return logits


def _ids(tokens: List[int], vocab: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([t for t in tokens if 0 <= t < vocab], dtype=torch.long, device=device)


def _process_row(row: torch.Tensor, seq: Sequence, eos_token_ids: AbstractSet[int]) -> torch.Tensor:
    params, vocab = seq.params, row.shape[0]
    if params.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[_ids(seq.token_ids, vocab, row.device)] = True
        penalized = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        row = torch.where(seen, penalized, row)
    if params.frequency_penalty != 0 or params.presence_penalty != 0:
        counts = torch.bincount(_ids(seq.output_token_ids, vocab, row.device), minlength=vocab).to(row.dtype)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(row.dtype)
    if params.logit_bias:
        ids = list(params.logit_bias)
        bias = torch.tensor([params.logit_bias[t] for t in ids], dtype=row.dtype, device=row.device)
        row = row.index_add(0, torch.tensor(ids, dtype=torch.long, device=row.device), bias)
    if seq.num_output_tokens < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        row = row.index_fill(0, _ids(sorted(banned), vocab, row.device), float("-inf"))
    return row
