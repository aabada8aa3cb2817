"""Step metadata for the cached state ops' tests (tests/ops/test_*_ops.py): what the engine's
``sequence_info`` hands the ops, built by hand for a schedule."""

from typing import Dict, Sequence, Tuple

import torch


def step_metadata(seqs: Sequence[Tuple[int, int, int, bool]]) -> Dict[str, torch.Tensor]:
    """``batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state`` of one step, in that order;
    ``seqs`` is (slot, start, num_new_tokens, use_initial_state) per sequence, prefills (several
    tokens, or a first token) before the single-token continuations."""
    i32 = dict(dtype=torch.int32)
    lengths = [n for _, _, n, _ in seqs]
    is_decode = [n == 1 and s > 0 for _, s, n, _ in seqs]
    num_prefill = len(seqs) - sum(is_decode)
    assert not any(is_decode[:num_prefill]), "prefills first"
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return dict(
        batch_info=torch.tensor([num_prefill, cu[num_prefill], len(seqs) - num_prefill], **i32),
        seq_len=torch.tensor(lengths, **i32),
        cu_seqlen=torch.tensor(cu, **i32),
        slot_idx=torch.tensor([slot for slot, _, _, _ in seqs], **i32),
        use_initial_state=torch.tensor([cont for _, _, _, cont in seqs], dtype=torch.bool),
    )
