"""Decode steps replayed from CUDA graphs captured per batch-size bucket.

A decode step (every sequence has one new token, so ``T == B``) is padded to the next bucket:
padded rows are single-token sequences at position 0 on a reserved scratch page, so they write
only there and their outputs are dropped. Inputs are copied into the bucket's static buffers
and the captured graph is replayed; the caches are the same tensors at capture and replay.
Other steps (prefill, mixed) run the model as it is.

The padding logic is device-agnostic; ``capture`` decides how a bucket is frozen (CUDA graph
capture on CUDA; tests on CPU pass an eager runner to check the padding).
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..cache.interface import CachedSequenceInterface
from ..utils.errors import ConfigError
from ..utils.logging import get_logger

logger = get_logger(__name__)

Runner = Tuple[Callable[[], None], torch.Tensor]  # (replay, static output)


def cuda_graph_capture(fn: Callable[..., torch.Tensor], static_args: List[torch.Tensor], pool=None) -> Runner:
    """Warm up on a side stream, then capture ``fn(*static_args)`` into a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*static_args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*static_args)
    return graph.replay, out


def eager_capture(fn: Callable[..., torch.Tensor], static_args: List[torch.Tensor], pool=None) -> Runner:
    """No capture: replay runs ``fn`` on the static buffers and copies into the static outputs,
    like a graph replay would (checks padding and buffering on any device)."""
    static_out = fn(*static_args)

    def replay() -> None:
        fresh = fn(*static_args)
        for dst, src in zip(pytree.tree_leaves(static_out), pytree.tree_leaves(fresh)):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)

    return replay, static_out


class DecodeGraphs(nn.Module):
    """Wraps a cached graph; decode steps up to the largest bucket replay captured graphs."""

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        cache: CachedSequenceInterface,
        batch_sizes: Sequence[int],
        capture: Callable[..., Runner] = cuda_graph_capture,
    ):
        super().__init__()
        self.model = model
        self.cache = cache
        self.batch_sizes = sorted(set(b for b in batch_sizes if 1 <= b <= cache.max_batch_size))
        if not self.batch_sizes:
            raise ConfigError(
                f"transforms.compile_model.cuda_graph_batch_sizes {list(batch_sizes)} has no size in "
                f"1..max_batch_size ({cache.max_batch_size}); give sizes up to max_batch_size, or leave it unset"
            )
        self.scratch_page = cache.reserve_scratch_page()
        self.width = cache.pages_per_sequence
        self._index = {name: i for i, name in enumerate(cache.input_names)}
        self._static: Dict[int, List[torch.Tensor]] = {}
        self._runners: Dict[int, Runner] = {}
        pool = torch.cuda.graph_pool_handle() if capture is cuda_graph_capture else None
        for batch in reversed(self.batch_sizes):  # largest first: smaller ones reuse its memory pool
            static = self._static_inputs(batch)
            self._static[batch] = static
            self._runners[batch] = capture(self.model, static, pool)
        logger.info("captured decode graphs for batch sizes %s", self.batch_sizes)

    def _static_inputs(self, batch: int) -> List[torch.Tensor]:
        """The captured graph's inputs, in the graph's input order (by name): an all-decode step
        whose padding rows write the scratch page and the spare state slot."""
        dev = self.cache.device
        i32 = dict(dtype=torch.int32, device=dev)
        step = {
            "input_ids": torch.zeros(1, batch, dtype=torch.long, device=dev),
            "position_ids": torch.zeros(1, batch, dtype=torch.long, device=dev),
            "batch_info": torch.tensor([0, 0, batch], **i32),  # all decode
            "seq_len": torch.ones(batch, **i32),
            "input_pos": torch.zeros(batch, **i32),
            "cu_seqlen": torch.arange(batch + 1, **i32),
            "page_table": torch.full((batch, self.width), self.scratch_page, **i32),
            "slot_idx": torch.full((batch,), self.cache.spare_slot, **i32),
            "use_initial_state": torch.ones(batch, dtype=torch.bool, device=dev),  # decodes continue
            # every row is its sequence's last: a decode step's logits_index is always arange(batch)
            "logits_index": torch.arange(batch, **i32),
            **self.cache.caches,
        }
        return [step[name] for name in self.cache.input_names]

    def bucket_for(self, batch: int) -> Optional[int]:
        return next((b for b in self.batch_sizes if b >= batch), None)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        at = self._index
        input_ids, seq_len = args[at["input_ids"]], args[at["seq_len"]]
        tokens, batch = input_ids.shape[1], seq_len.shape[0]
        bucket = self.bucket_for(batch) if tokens == batch else None
        if bucket is None:
            return self.model(*args)
        static = self._static[bucket]
        # per-row inputs: the step's rows, then padding rows (token 0 at position 0, scratch
        # page, spare slot); batch_info, seq_len, cu_seqlen and logits_index are fixed for an
        # all-decode bucket
        for name, pad in (("input_ids", 0), ("position_ids", 0), ("input_pos", 0),
                          ("slot_idx", self.cache.spare_slot), ("use_initial_state", True)):
            dst, src = static[at[name]], args[at[name]]
            dim = 1 if name in ("input_ids", "position_ids") else 0  # [1, T] token rows, [B] per sequence
            dst.narrow(dim, 0, batch).copy_(src)
            dst.narrow(dim, batch, dst.shape[dim] - batch).fill_(pad)
        table, dst = args[at["page_table"]], static[at["page_table"]]
        dst[:batch, : table.shape[1]].copy_(table)
        dst[:batch, table.shape[1]:].fill_(self.scratch_page)
        dst[batch:].fill_(self.scratch_page)
        replay, out = self._runners[bucket]
        replay()
        return out[:, :batch]
