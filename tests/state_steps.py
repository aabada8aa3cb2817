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


def check_slot_writes(op, args: Sequence, state_arg: int, written: Sequence[int] = (0, 2),
                      untouched: Sequence[int] = (1,)) -> None:
    """Runs a cached state op on ``args`` (a step naming the ``written`` slots): those slots of the
    state ``args[state_arg]`` change, the ``untouched`` ones stay bit for bit, and the op's schema
    declares that argument written (what lets export and the graph keep the in-place update)."""
    cache = args[state_arg]
    before = cache.clone()
    op(*args)
    for slot in written:
        assert not torch.equal(cache[slot], before[slot]), f"slot {slot} was not written"
    for slot in untouched:
        assert torch.equal(cache[slot], before[slot]), f"slot {slot} was written"
    assert op.default._schema.arguments[state_arg].alias_info.is_write
