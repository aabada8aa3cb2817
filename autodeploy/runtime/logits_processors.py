"""Per-request changes to the next-token logits before sampling: penalties and ``min_tokens``.

Applied to the model's raw logits (fp32), before the temperature and the filters of ``sampler``,
with vLLM's semantics (``SamplingParams`` documents each):

* ``repetition_penalty`` ``r`` (as HF's ``RepetitionPenaltyLogitsProcessor``): every token that
  occurs in the prompt or the output so far has its logit ``l`` replaced by ``l / r`` when
  ``l > 0`` and ``l * r`` otherwise, so ``r > 1`` makes repeats less likely either way;
* ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` (OpenAI's): ``l - f * c - p * (c > 0)``
  with ``c`` the token's count in the output so far (the prompt does not count);
* ``logit_bias`` (OpenAI's): each listed token's bias added to its logit (-100 all but bans it);
* ``bad_words`` / ``bad_words_token_ids``: the token that would complete a banned sequence gets
  -inf (HF's ``NoBadWordsLogitsProcessor``, over the output only, as vLLM's);
* ``allowed_token_ids``: every other token gets -inf;
* ``min_tokens``: until that many tokens are out, the EOS tokens (unless ``ignore_eos``) and
  ``stop_token_ids`` cannot be sampled;
* ``guided`` (last, so nothing can lift it): only the tokens that keep the output completable
  under its constraint (``guided.Guide.mask``); EOS and ``stop_token_ids`` only once the output
  is complete.

Only the rows of requests that ask for one of these are touched (``SamplingParams.adjusts_logits``);
a batch without any returns its logits as they are.
"""

from typing import AbstractSet, List, Sequence as Seq, Tuple

import torch

from .sequence import Sequence


def process_logits(logits: torch.Tensor, sequences: Seq[Sequence], eos_token_ids: AbstractSet[int]) -> torch.Tensor:
    """``logits`` ([B, V]) with each row changed as its sequence's parameters say (a new tensor
    when any is: the caller's raw logits still give the log-probabilities)."""
    rows = [i for i, seq in enumerate(sequences) if seq.params.adjusts_logits]
    if not rows:
        return logits
    picked = [sequences[i] for i in rows]
    sub = _Batch(picked, logits.shape[-1], logits.device).apply(logits[rows].float(), eos_token_ids)
    return logits.float().index_copy(0, torch.tensor(rows, device=logits.device), sub)


class _Batch:
    """The rows to change, as flat (row, token) index lists: one scatter per kind for the batch."""

    def __init__(self, sequences: List[Sequence], vocab: int, device: torch.device):
        self.sequences, self.vocab, self.device = sequences, vocab, device

    def _pairs(self, tokens_of) -> Tuple[torch.Tensor, torch.Tensor]:
        rows: List[int] = []
        tokens: List[int] = []
        for r, seq in enumerate(self.sequences):
            ids = [t for t in tokens_of(seq) if 0 <= t < self.vocab]
            rows += [r] * len(ids)
            tokens += ids
        return (torch.tensor(rows, dtype=torch.long, device=self.device),
                torch.tensor(tokens, dtype=torch.long, device=self.device))

    def _column(self, value_of) -> torch.Tensor:
        return torch.tensor([float(value_of(seq.params)) for seq in self.sequences], device=self.device)[:, None]

    def apply(self, sub: torch.Tensor, eos_token_ids: AbstractSet[int]) -> torch.Tensor:
        params = [seq.params for seq in self.sequences]
        if any(p.repetition_penalty != 1 for p in params):
            seen = torch.zeros_like(sub, dtype=torch.bool)
            seen[self._pairs(lambda s: s.token_ids if s.params.repetition_penalty != 1 else ())] = True
            penalty = self._column(lambda p: p.repetition_penalty)
            sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
        if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
            counts = torch.zeros_like(sub)
            index = self._pairs(lambda s: s.output_token_ids)
            counts.index_put_(index, torch.ones(index[0].shape[0], dtype=sub.dtype, device=sub.device), accumulate=True)
            sub = (sub - self._column(lambda p: p.frequency_penalty) * counts
                   - self._column(lambda p: p.presence_penalty) * (counts > 0).to(sub.dtype))
        if any(p.logit_bias for p in params):
            index = self._pairs(lambda s: list(s.params.logit_bias or ()))
            bias = [b for seq in self.sequences for t, b in (seq.params.logit_bias or {}).items() if t < self.vocab]
            sub = sub.index_put(index, torch.tensor(bias, dtype=sub.dtype, device=sub.device), accumulate=True)
        if any(p.bad_words_token_ids for p in params):
            index = self._pairs(_bad_word_ends)
            sub = sub.index_put(index, torch.tensor(float("-inf"), dtype=sub.dtype, device=sub.device))
        if any(p.allowed_token_ids is not None for p in params):
            allowed = torch.zeros_like(sub, dtype=torch.bool)
            allowed[self._pairs(lambda s: s.params.allowed_token_ids or ())] = True
            listed = torch.tensor([p.allowed_token_ids is not None for p in params], device=sub.device)
            sub = sub.masked_fill(listed[:, None] & ~allowed, float("-inf"))
        if any(seq.num_output_tokens < seq.params.min_tokens for seq in self.sequences):
            index = self._pairs(lambda s: _banned(s, eos_token_ids))
            sub = sub.index_put(index, torch.tensor(float("-inf"), dtype=sub.dtype, device=sub.device))
        if any(seq.guide is not None for seq in self.sequences):
            sub = self._guide(sub, eos_token_ids)
        return sub

    def _guide(self, sub: torch.Tensor, eos_token_ids: AbstractSet[int]) -> torch.Tensor:
        """Every token a row's constraint refuses gets -inf; the other rows pass whole."""
        allowed = torch.ones_like(sub, dtype=torch.bool)
        for r, seq in enumerate(self.sequences):
            guide = seq.guide
            if guide is None:
                continue
            row = guide.mask(self.vocab).clone()
            if guide.failed:  # the sequence is aborted after this step: let it end on EOS where there is one
                row[:] = not eos_token_ids
                row[[t for t in eos_token_ids if 0 <= t < self.vocab]] = True
            elif guide.accepting:  # complete: the stop tokens may end it (min_tokens may still ban them)
                ends = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(eos_token_ids))
                row[[t for t in ends if 0 <= t < self.vocab]] = True
            allowed[r] = row.to(sub.device)
        return sub.masked_fill(~allowed, float("-inf"))


def _bad_word_ends(seq: Sequence) -> List[int]:
    """The last tokens of the bad-word sequences whose other tokens end the output so far (the
    prompt does not count, as in vLLM)."""
    out = seq.output_token_ids
    return [ids[-1] for ids in seq.params.bad_words_token_ids or ()
            if len(ids) - 1 <= len(out) and (len(ids) == 1 or list(out[len(out) - len(ids) + 1:]) == ids[:-1])]


def _banned(seq: Sequence, eos_token_ids: AbstractSet[int]) -> List[int]:
    """The tokens ``min_tokens`` keeps from being sampled now: EOS (unless ignored) and the stop ids."""
    params = seq.params
    if seq.num_output_tokens >= params.min_tokens:
        return []
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))
