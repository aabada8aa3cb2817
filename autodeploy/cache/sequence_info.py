"""The per-step batch description the cached graph takes.

After ``cache_init`` the graph is called with every token of the step flattened into one row
(``input_ids [1, T]``, ``position_ids [1, T]``) plus this metadata, which tells the cached
attention ops where each sequence's tokens are and where its keys live in the paged cache, and
the state ops (SSM, convolution, delta rule) which state slot holds each sequence's state and
whether this step continues from it, and ``logits_index`` which token rows the graph returns
logits for (each sequence's last token, and every token of a sequence that asked for its
prompt's log-probabilities: ``SamplingParams.prompt_logprobs``).
Prefill sequences (several new tokens) come first, decode sequences (one new token) last, so
decode rows are contiguous. The runtime builds a fresh ``SequenceInfo`` for each step; nothing
lives in module globals.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

# Graph inputs after input_ids/position_ids, in this order.
METADATA_NAMES = ("batch_info", "seq_len", "input_pos", "cu_seqlen", "page_table", "slot_idx", "use_initial_state",
                  "logits_index")


@dataclass
class SequenceInfo:
    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    batch_info: torch.Tensor  # [3] int32: num_prefill, num_prefill_tokens, num_decode
    seq_len: torch.Tensor  # [B] int32: new tokens of each sequence in this step
    input_pos: torch.Tensor  # [B] int32: tokens of each sequence already in the cache
    cu_seqlen: torch.Tensor  # [B+1] int32: offsets of each sequence's tokens in the row
    page_table: torch.Tensor  # [B, P] int32: cache pages of each sequence (padded with 0)
    slot_idx: torch.Tensor  # [B] int32: the state slot of each sequence (per-sequence state caches)
    # [B] bool: the step continues from the stored state (input_pos > 0: a later prefill chunk
    # or a decode); False starts from zeros, whatever the slot held before (a new or preempted one)
    use_initial_state: torch.Tensor
    # [R] int32: the token rows whose logits the graph returns, in order (R >= B): the last token
    # of each sequence, or every token of a sequence in ``all_logits`` (vLLM's logits_indices).
    # A graph whose LM head is gathered (``gather_logits_before_lm_head``) computes only these
    # rows; any other graph returns every row and the runner picks these.
    logits_index: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return int(self.seq_len.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def last_token_indices(self) -> torch.Tensor:
        """Row index of each sequence's last new token (where its next-token logits are)."""
        return (self.cu_seqlen[1:] - 1).long()

    def as_inputs(self) -> Dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            **{name: getattr(self, name) for name in METADATA_NAMES},
        }


def example_metadata(name: str, max_batch: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An example value of the metadata input ``name`` (for the fake tensors of the graph's new
    placeholders): only its dtype and rank matter downstream."""
    i32 = dict(dtype=torch.int32, device=device)
    return {
        "batch_info": lambda: torch.zeros(3, **i32),
        "seq_len": lambda: torch.zeros(max_batch, **i32),
        "input_pos": lambda: torch.zeros(max_batch, **i32),
        "cu_seqlen": lambda: torch.zeros(max_batch + 1, **i32),
        "page_table": lambda: torch.zeros(max_batch, 4, **i32),
        "slot_idx": lambda: torch.zeros(max_batch, **i32),
        "use_initial_state": lambda: torch.zeros(max_batch, dtype=torch.bool, device=device),
        "logits_index": lambda: torch.zeros(max_batch, **i32),
    }[name]()


def build_sequence_info(
    tokens: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    device: torch.device | str = "cpu",
    slots: Optional[Sequence[int]] = None,
    all_logits: Optional[Sequence[bool]] = None,
) -> SequenceInfo:
    """Metadata for one step: ``tokens[i]`` are sequence i's new tokens, which start at position
    ``start_positions[i]``; ``page_tables[i]`` lists its cache pages and ``slots[i]`` its state
    slot (default: slot i). The graph returns logits for each sequence's last new token, or for
    every new token of sequence i when ``all_logits[i]`` (default: none). Prefill sequences (more than one new token, or a first chunk) must
    come before single-token decode sequences."""
    if not tokens:
        raise ValueError("a step needs at least one sequence")
    lengths = [len(t) for t in tokens]
    if min(lengths) < 1:
        raise ValueError("every scheduled sequence needs at least one new token")
    if slots is not None and len(slots) != len(tokens):
        raise ValueError(f"{len(slots)} state slots for {len(tokens)} sequences")
    if all_logits is not None and len(all_logits) != len(tokens):
        raise ValueError(f"{len(all_logits)} all_logits flags for {len(tokens)} sequences")
    is_decode = [n == 1 and s > 0 for n, s in zip(lengths, start_positions)]
    num_decode = sum(is_decode)
    num_prefill = len(tokens) - num_decode
    if any(is_decode[:num_prefill]):
        raise ValueError("prefill sequences must come before decode sequences")
    flat: List[int] = [t for seq in tokens for t in seq]
    positions: List[int] = [s + i for s, n in zip(start_positions, lengths) for i in range(n)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    # At least 2 columns: a dimension of size 1 would make compiled graphs specialise on it.
    width = max(2, max(len(p) for p in page_tables))
    table = [list(p) + [0] * (width - len(p)) for p in page_tables]
    rows: List[int] = []
    for i, n in enumerate(lengths):
        rows.extend(range(cu[i], cu[i + 1]) if all_logits is not None and all_logits[i] else (cu[i + 1] - 1,))
    i32 = dict(dtype=torch.int32, device=device)
    return SequenceInfo(
        input_ids=torch.tensor([flat], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        batch_info=torch.tensor([num_prefill, cu[num_prefill], num_decode], **i32),
        seq_len=torch.tensor(lengths, **i32),
        input_pos=torch.tensor(list(start_positions), **i32),
        cu_seqlen=torch.tensor(cu, **i32),
        page_table=torch.tensor(table, **i32),
        slot_idx=torch.tensor(list(slots) if slots is not None else list(range(len(tokens))), **i32),
        use_initial_state=torch.tensor([s > 0 for s in start_positions], dtype=torch.bool, device=device),
        logits_index=torch.tensor(rows, **i32),
    )
