"""Piecewise graphs: prefill and mixed steps with the token-wise parts frozen per token bucket.

Attention cannot be captured for prefill (its work depends on each sequence's length), but
everything between two attention ops works token by token. The graph is split at the cached
attention ops; a step of ``T`` tokens is padded to the next bucket ``T*`` by one extra sequence
of ``T* - T`` tokens at the front, on the reserved scratch page; token-wise pieces replay the
runner frozen for ``T*`` while attention pieces run as they are; the padding's outputs are
dropped.
"""

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from ..cache.interface import CachedSequenceInterface
from ..cache.sequence_info import METADATA_NAMES
from ..utils.logging import get_logger
from .cuda_graph import Runner

logger = get_logger(__name__)


def is_cached_attention(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and "cached_attention_with_cache" in str(name)


def split_at_attention(gm: fx.GraphModule) -> tuple:
    """Split ``gm`` into consecutive pieces that are either token-wise (every tensor has one row
    per token, so the piece can be frozen per token count) or eager: cached attention, and
    anything computed from per-sequence metadata other than positions (slot mapping, the
    logits gather and what follows it). Returns ``(split module, frozen piece names)``."""
    per_sequence = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in METADATA_NAMES}
    eager: Dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        tainted = any(inp in per_sequence for inp in node.all_input_nodes)
        if is_cached_attention(node):
            eager[node] = True  # its output is token-shaped again: no taint passes through it
        else:
            eager[node] = tainted
            if tainted:
                per_sequence.add(node)
    parts: Dict[fx.Node, int] = {}
    kinds: Dict[int, bool] = {}
    part, last_kind = -1, None
    for node in gm.graph.nodes:
        if node not in eager:
            continue
        kind = eager[node]
        if kind != last_kind or is_cached_attention(node):
            part += 1
            kinds[part] = kind
            last_kind = kind if not is_cached_attention(node) else None
        parts[node] = part
    for node in gm.graph.nodes:  # get_attrs go with their (first) user
        if node.op == "get_attr" and node.users:
            parts[node] = min(parts[u] for u in node.users if u in parts)
    split = split_module(gm, None, lambda n: parts[n], keep_original_order=True)
    frozen = {f"submod_{i}" for i, is_eager in kinds.items() if not is_eager}
    return split, frozen


class _FrozenPiece(nn.Module):
    """A token-wise piece: replays the runner frozen for the step's bucket."""

    def __init__(self, piece: fx.GraphModule, owner: "PiecewiseGraphs"):
        super().__init__()
        self.piece = piece
        self.owner = owner
        self.runners: Dict[int, tuple] = {}  # bucket -> (static inputs, runner)

    def forward(self, *args):
        bucket = self.owner.current_bucket
        if bucket is None:
            return self.piece(*args)
        if bucket not in self.runners:
            # opaque packed weights (oneDNN, CPU) are constants: captured as they are
            static = [a.clone() if isinstance(a, torch.Tensor) and not a.is_mkldnn else a for a in args]
            self.runners[bucket] = (static, self.owner.capture(self.piece, static, self.owner.pool))
        static, (replay, out) = self.runners[bucket]
        for dst, src in zip(static, args):
            if isinstance(dst, torch.Tensor) and dst is not src and dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        replay()
        return out


class PiecewiseGraphs(nn.Module):
    """Runs prefill/mixed steps of up to the largest bucket piecewise (see module docstring)."""

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        gm: fx.GraphModule,
        cache: CachedSequenceInterface,
        token_buckets: Sequence[int],
        capture: Callable[..., Runner],
        pool=None,
    ):
        super().__init__()
        self.model = model  # runs every step that is not piecewise (decode, or too many tokens)
        self.cache = cache
        self.capture = capture
        self.pool = pool
        self.buckets = sorted(set(b for b in token_buckets if b >= 2))
        self.scratch_page = cache.reserve_scratch_page()
        self.split, frozen = split_at_attention(gm)
        for name, child in list(self.split.named_children()):
            if name in frozen:
                setattr(self.split, name, _FrozenPiece(child, self))
        self.current_bucket: Optional[int] = None
        logger.info("piecewise graphs: %d pieces, token buckets %s", len(list(self.split.children())), self.buckets)

    def bucket_for(self, tokens: int) -> Optional[int]:
        return next((b for b in self.buckets if b > tokens), None)  # room for >= 1 padding token

    def _padded(self, args: Sequence[torch.Tensor], pad: int) -> List[torch.Tensor]:
        """The step's inputs (in the graph's input order, found by name) with a padding prefill
        sequence of ``pad`` tokens in front: it writes the scratch page and the spare state slot,
        starting from an empty state, and only its own (discarded) outputs read them."""
        step = dict(zip(self.cache.input_names, args))
        input_ids, page_table = step["input_ids"], step["page_table"]
        dev = input_ids.device
        i32 = dict(dtype=torch.int32, device=dev)
        info = step["batch_info"].clone()
        info[0] += 1
        info[1] += pad
        padded = {
            "input_ids": torch.cat([torch.zeros(1, pad, dtype=input_ids.dtype, device=dev), input_ids], dim=1),
            # positions 0..pad-1 of the one scratch page
            "position_ids": torch.cat([torch.arange(pad, device=dev)[None] % self.cache.page_size,
                                       step["position_ids"]], dim=1),
            "batch_info": info,
            "seq_len": torch.cat([torch.tensor([pad], **i32), step["seq_len"]]),
            "input_pos": torch.cat([torch.zeros(1, **i32), step["input_pos"]]),
            "cu_seqlen": torch.cat([torch.zeros(1, **i32), step["cu_seqlen"] + pad]),
            "page_table": torch.cat([torch.full((1, page_table.shape[1]), self.scratch_page, **i32), page_table]),
            "slot_idx": torch.cat([torch.tensor([self.cache.spare_slot], **i32), step["slot_idx"]]),
            "use_initial_state": torch.cat([torch.zeros(1, dtype=torch.bool, device=dev), step["use_initial_state"]]),
            # the padding sequence's last row first (dropped below), then the step's rows shifted
            "logits_index": torch.cat([torch.full((1,), pad - 1, **i32), step["logits_index"] + pad]),
        }
        return [padded.get(name, step[name]) for name in self.cache.input_names]

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        at = self.cache.input_index
        tokens, sequences = args[at("input_ids")].shape[1], args[at("seq_len")].shape[0]
        bucket = self.bucket_for(tokens) if tokens != sequences else None
        if bucket is None:
            return self.model(*args)
        pad = bucket - tokens
        self.current_bucket = bucket
        try:
            out = self.split(*self._padded(args, pad))
        finally:
            self.current_bucket = None
        # drop the padding sequence: its one logits row (gathered: first of logits_index) or its tokens
        return out[:, 1:] if self.cache.gathered_logits else out[:, pad:]
