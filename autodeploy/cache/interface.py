"""What the cached graph needs besides its weights: the cache tensors and their page geometry.

``insert_cached_*`` transforms register one handler per cache input they add to the graph:
paged (``ResourceHandler``), per-sequence state (``StateHandler``, one slot per running
sequence plus a spare) or a per-step token buffer (``TokenBufferHandler``, one row per token of
the step, ``[max_num_tokens, ...]``); ``initialize_cache`` / ``resize_kv_cache`` allocate them;
the runtime reads the page geometry to schedule and calls the graph with
``graph_args(seq_info)``.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import torch

from ..utils.errors import ConfigError
from .resources import ResourceHandler, StateHandler, TokenBufferHandler
from .sequence_info import METADATA_NAMES, SequenceInfo

Handler = Union[ResourceHandler, StateHandler, TokenBufferHandler]


@dataclass
class CacheConfig:
    page_size: int = 16
    num_pages: Optional[int] = None  # None: sized by resize_kv_cache (or the minimum)


class CachedSequenceInterface:
    """Cache tensors keyed by their graph input name, plus the page geometry."""

    def __init__(self, *, page_size: int, max_batch_size: int, max_seq_len: int, max_num_tokens: int,
                 device: torch.device | str = "cpu"):
        if page_size < 1:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self._max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)
        # in registration order, which is the order of the graph's cache placeholders
        self.handlers: Dict[str, Handler] = {}
        self.caches: Dict[str, torch.Tensor] = {}
        self.num_pages = 0
        self.fixed_size = False  # the pool size was given explicitly (resize keeps it)
        # The graph returns one logits row per sequence (its last token) instead of per token.
        self.gathered_logits = False
        # insert_cached_residual_add: decoder layer index -> the token buffer that holds the
        # hidden state leaving that layer for each token of the last step, in the order of the
        # layer axis of ``RequestOutput.hidden_states``. Empty: no hidden states are captured.
        self.captured_layers: Dict[int, str] = {}
        # Pages at the end of the pool kept out of the page allocator (CUDA-graph padding rows).
        self.reserved_pages = 0

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int) -> None:
        """Also resizes allocated state caches: they hold one slot per sequence that can run at
        once (the batch size is chosen after the pool is allocated, ``choose_batch_size``)."""
        self._max_batch_size = value
        for name in self.state_names:
            if name in self.caches and self.caches[name].shape[0] != self.num_slots:
                handler = self.handlers[name]
                del self.caches[name]
                self.caches[name] = handler.allocate(self.num_slots, self.device)  # type: ignore[call-arg]

    # ---- registration (by insert_cached_* transforms) ----------------------------------------
    def add_cache(self, name: str, handler: Handler) -> None:
        if name in self.handlers:
            raise ValueError(f"cache input '{name}' registered twice")
        self.handlers[name] = handler

    @property
    def paged_names(self) -> List[str]:
        return [n for n, h in self.handlers.items() if isinstance(h, ResourceHandler)]

    @property
    def state_names(self) -> List[str]:
        return [n for n, h in self.handlers.items() if isinstance(h, StateHandler)]

    @property
    def buffer_names(self) -> List[str]:
        """Per-step token buffers (``TokenBufferHandler``): neither paged nor per-sequence."""
        return [n for n, h in self.handlers.items() if isinstance(h, TokenBufferHandler)]

    def input_index(self, name: str) -> int:
        """Position of the graph input ``name`` (what wrappers that take the graph's positional
        arguments use, so that none of them hard-codes a position)."""
        return self.input_names.index(name)

    @property
    def cache_names(self) -> List[str]:
        return list(self.handlers)

    @property
    def input_names(self) -> List[str]:
        """Graph input names in placeholder order."""
        return ["input_ids", "position_ids", *METADATA_NAMES, *self.cache_names]

    # ---- geometry ----------------------------------------------------------------------------
    @property
    def pages_per_sequence(self) -> int:
        """Pages one sequence of ``max_seq_len`` tokens needs."""
        return -(-self.max_seq_len // self.page_size)

    @property
    def min_pages(self) -> int:
        return self.pages_per_sequence

    @property
    def useful_pages(self) -> int:
        """Pages that can ever be in use at once: every slot full at max length."""
        return self.max_batch_size * self.pages_per_sequence

    def bytes_per_page(self) -> int:
        """Bytes of one page over every paged cache (state caches have no pages)."""
        return sum(h.bytes_per_page(self.page_size) for h in self.handlers.values() if isinstance(h, ResourceHandler))

    def bytes_per_token(self) -> int:
        """Bytes one token takes in the paged caches, over every layer: the number the MLA latent
        cache shrinks (``kv_lora_rank + qk_rope_head_dim`` values a layer instead of per-head K/V)."""
        return self.bytes_per_page() // self.page_size

    # ---- state slots -------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """State slots: one per sequence that can run at once, and the spare."""
        return self.max_batch_size + 1

    @property
    def spare_slot(self) -> int:
        """The slot padding rows (CUDA-graph and piecewise padding) read and write; never a
        sequence's."""
        return self.max_batch_size

    def state_bytes_per_sequence(self) -> int:
        """Bytes of one slot over every state cache: what each running sequence holds."""
        return sum(h.bytes_per_slot() for h in self.handlers.values() if isinstance(h, StateHandler))

    def state_bytes(self) -> int:
        """Bytes of every state cache, all slots (fixed: does not grow with the page pool)."""
        return self.state_bytes_per_sequence() * self.num_slots

    # ---- token buffers -----------------------------------------------------------------------
    def buffer_bytes(self) -> int:
        """Bytes of every token buffer (``max_num_tokens`` rows each; fixed: depends on neither
        the page pool nor the batch size)."""
        return self.max_num_tokens * sum(
            h.bytes_per_token() for h in self.handlers.values() if isinstance(h, TokenBufferHandler))

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, num_pages: int) -> None:
        """Allocate the page pool at ``num_pages`` and the state slots, zeroed. Token buffers
        allocated before are kept as they are (their size never changes), so re-sizing the pool
        neither frees nor re-counts them."""
        if num_pages < self.min_pages:
            raise ValueError(
                f"{num_pages} cache pages cannot hold one sequence of max_seq_len={self.max_seq_len} "
                f"(needs {self.min_pages} pages of {self.page_size} tokens)"
            )
        kept = {name: self.caches[name] for name in self.buffer_names
                if name in self.caches and self.caches[name].shape[0] == self.max_num_tokens}
        self.caches.clear()  # free the old pool before allocating the new one
        self.caches = {
            name: h.allocate(num_pages, self.page_size, self.device) if isinstance(h, ResourceHandler)
            else h.allocate(self.num_slots, self.device) if isinstance(h, StateHandler)
            else kept[name] if name in kept
            else h.allocate(self.max_num_tokens, self.device)
            for name, h in self.handlers.items()
        }
        self.num_pages = num_pages

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Page ``src[i]`` into page ``dst[i]`` of every paged cache, one indexed copy per cache
        (prefix caching's tail pages; a page's contents are the same kind in every paged cache)."""
        src_t = torch.tensor(list(src), dtype=torch.long, device=self.device)
        dst_t = torch.tensor(list(dst), dtype=torch.long, device=self.device)
        for name in self.paged_names:
            self.caches[name][dst_t] = self.caches[name][src_t]

    def reserve_scratch_page(self) -> int:
        """Keep the last page out of the allocator (padded rows write there); returns its index."""
        if self.num_pages - self.reserved_pages - 1 < self.min_pages:
            # only a pool fixed by the user can be this small (a sized one holds a batch)
            raise ConfigError(
                f"CUDA graphs need a scratch page besides one sequence of max_seq_len={self.max_seq_len} "
                f"({self.min_pages} pages), but the pool has {self.num_pages - self.reserved_pages}; raise "
                f"transforms.initialize_cache.num_pages to at least {self.min_pages + self.reserved_pages + 1} "
                "or leave it unset"
            )
        self.reserved_pages = max(self.reserved_pages, 1)
        return self.num_pages - 1

    @property
    def allocatable_pages(self) -> int:
        return self.num_pages - self.reserved_pages

    def cache_bytes(self) -> int:
        """Bytes of every allocated cache: paged, state and token buffers."""
        return sum(t.numel() * t.element_size() for t in self.caches.values())

    def paged_bytes(self) -> int:
        """Bytes of the allocated paged caches (what the page pool costs)."""
        return sum(self.caches[n].numel() * self.caches[n].element_size() for n in self.paged_names if n in self.caches)

    # ---- calling the graph -------------------------------------------------------------------
    def graph_args(self, info: SequenceInfo) -> List[torch.Tensor]:
        if len(self.caches) != len(self.handlers):
            raise RuntimeError("caches are not allocated; is initialize_cache in the pipeline?")
        inputs = info.as_inputs()
        return [inputs[name] for name in ("input_ids", "position_ids", *METADATA_NAMES)] + [
            self.caches[name] for name in self.cache_names
        ]
