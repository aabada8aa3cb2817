"""The recompute path: a paged *token* cache instead of a KV cache, for models the KV cache
cannot serve.

Some graphs cannot be cached per attention layer: their attention was not canonicalised (an
explicit mask the matchers could not read, a custom attention), they carry state across tokens
outside attention (short convolutions, SSM scans, linear attention, recurrences), or they only
export with a static sequence length. Rather than refusing them, or worse running them with a
KV cache that silently drops that state, the pipeline can run them in *recompute* mode: the
cache holds each sequence's token ids in the same pages the scheduler already manages, and
each step runs the uncached graph over every scheduled sequence's whole history. A causal LM's
output at position ``i`` depends only on tokens ``0..i``, so this is exact; it costs a full
forward per sequence per step (quadratic in length), which is why it is a fallback and says so.

A graph exported with a static sequence length ``S`` gets each history right-padded to ``S``
(pad tokens only follow the real ones, so causality keeps them out of the real positions) and
all sequences of the step run as one ``[B, S]`` batch; a graph whose automatic dynamic dim
starts at 2 tokens gets a one-token history padded to 2. ``recompute_fallback`` checks both
against the eager model once, since padding is exact only for a model that does not branch on
the sequence length.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import fx, nn

from .resources import ResourceHandler, zeroed
from .sequence_info import METADATA_NAMES

TOKEN_CACHE = "token_cache"


@dataclass(frozen=True)
class TokenCacheHandler(ResourceHandler):
    """Token ids of every cached position: ``[num_pages, page_size]`` int64."""

    def bytes_per_page(self, page_size: int) -> int:
        return page_size * 8

    def allocate(self, num_pages: int, page_size: int, device: torch.device) -> torch.Tensor:
        return zeroed((num_pages, page_size), torch.long, device)


class RecomputeRunner(nn.Module):
    """Runs the uncached graph ``model(input_ids [b, s], position_ids [b, s]) -> [b, s, V]`` over
    each sequence's full history, read back from the token cache.

    Returns the logits of the rows ``logits_index`` names (``[1, R, V]``): each sequence's last
    new token, or every new token of a sequence scoring its prompt.
    """

    def __init__(self, model: fx.GraphModule, page_size: int, static_seq_len: Optional[int] = None,
                 min_seq_len: int = 1):
        super().__init__()
        self.model = model
        self.page_size = page_size
        self.static_seq_len = static_seq_len
        self.min_seq_len = min_seq_len  # a graph exported with an automatic dim may need >= 2 tokens
        self.pad_token_id = 0  # what fills a static-length row after the history (see check_cache_consistency)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch_info: torch.Tensor,
                seq_len: torch.Tensor, input_pos: torch.Tensor, cu_seqlen: torch.Tensor, page_table: torch.Tensor,
                slot_idx: torch.Tensor, use_initial_state: torch.Tensor, logits_index: torch.Tensor,
                token_cache: torch.Tensor) -> torch.Tensor:
        # slot_idx / use_initial_state: taken (the cached interface is one signature) but unused:
        # recompute keeps no state besides the tokens
        page = self.page_size
        positions = position_ids[0]
        # Scatter the new tokens into their slots (same page arithmetic as the KV caches).
        seq_of_token = torch.repeat_interleave(
            torch.arange(seq_len.numel(), device=seq_len.device), seq_len.long(), output_size=positions.numel()
        )
        pages = page_table[seq_of_token, positions // page].long()
        token_cache[pages, positions % page] = input_ids[0]
        totals: List[int] = (input_pos + seq_len).tolist()
        histories = []
        for i, total in enumerate(totals):
            idx = torch.arange(total, device=token_cache.device)
            histories.append(token_cache[page_table[i, idx // page].long(), idx % page])
        # each returned row as (sequence, position in its history)
        rows = logits_index.long()
        seq = seq_of_token[rows]
        return self.logits_at(histories, seq.tolist(), (input_pos.long()[seq] + rows - cu_seqlen.long()[seq]).tolist())

    def last_logits(self, histories: List[torch.Tensor]) -> torch.Tensor:
        """Next-token logits after each history: ``[1, len(histories), V]``."""
        return self.logits_at(histories, list(range(len(histories))), [int(h.numel()) - 1 for h in histories])

    def logits_at(self, histories: List[torch.Tensor], seqs: List[int], positions: List[int]) -> torch.Tensor:
        """Row ``j``: the logits at position ``positions[j]`` of history ``seqs[j]`` (``[1, R, V]``)."""
        totals = [int(h.numel()) for h in histories]
        if self.static_seq_len is not None:
            logits = self._run_padded(histories, totals, self.static_seq_len)
            return logits[torch.tensor(seqs, device=logits.device), torch.tensor(positions, device=logits.device)][None]
        full = {}
        for i in sorted(set(seqs)):
            hist, total = histories[i], totals[i]
            if total < self.min_seq_len:
                full[i] = self._run_padded([hist], [total], self.min_seq_len)[0]
            else:
                pos = torch.arange(total, device=hist.device)[None]
                full[i] = self.model(hist[None], pos)[0]
        return torch.stack([full[i][p] for i, p in zip(seqs, positions)])[None]

    def _run_padded(self, histories: List[torch.Tensor], totals: List[int], width: int) -> torch.Tensor:
        """The histories right-padded to ``width`` and run as one batch: ``[B, width, V]``."""
        if max(totals) > width:
            raise RuntimeError(f"a sequence of {max(totals)} tokens exceeds the graph's static length {width}")
        batch = torch.full((len(histories), width), self.pad_token_id, dtype=torch.long, device=histories[0].device)
        for row, hist in zip(batch, histories):
            row[: hist.numel()] = hist
        pos = torch.arange(width, device=batch.device).expand(len(histories), width)
        return self.model(batch, pos)


def build_recompute_graph(inner: fx.GraphModule, page_size: int, static_seq_len: Optional[int],
                          min_seq_len: int = 1) -> fx.GraphModule:
    """A GraphModule with the cached interface (``input_ids, position_ids, <metadata>,
    token_cache``) whose one node calls the runner, so the rest of the pipeline and the runtime
    treat it like any cached graph."""
    root = nn.Module()
    root.recompute = RecomputeRunner(inner, page_size, static_seq_len, min_seq_len)
    graph = fx.Graph()
    args = [graph.placeholder(name) for name in ("input_ids", "position_ids", *METADATA_NAMES, TOKEN_CACHE)]
    out = graph.call_module("recompute", tuple(args))
    graph.output(out)
    gm = fx.GraphModule(root, graph)
    gm.meta["autodeploy_recompute"] = {"static_seq_len": static_seq_len, "min_seq_len": min_seq_len}
    for key in ("autodeploy_export",):
        if key in inner.meta:
            gm.meta[key] = inner.meta[key]
    return gm
