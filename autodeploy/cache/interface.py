"""What the cached graph needs besides its weights: the cache tensors and their page geometry.

``insert_cached_*`` transforms register one resource handler per cache input they add to the
graph; ``initialize_cache`` / ``resize_kv_cache`` allocate them; the runtime reads the page
geometry to schedule and calls the graph with ``graph_args(seq_info)``.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..utils.errors import ConfigError
from .resources import ResourceHandler
from .sequence_info import METADATA_NAMES, SequenceInfo


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
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)
        self.handlers: Dict[str, ResourceHandler] = {}
        self.caches: Dict[str, torch.Tensor] = {}
        self.num_pages = 0
        self.fixed_size = False  # the pool size was given explicitly (resize keeps it)
        # The graph returns one logits row per sequence (its last token) instead of per token.
        self.gathered_logits = False
        # Pages at the end of the pool kept out of the page allocator (CUDA-graph padding rows).
        self.reserved_pages = 0

    # ---- registration (by insert_cached_* transforms) ----------------------------------------
    def add_cache(self, name: str, handler: ResourceHandler) -> None:
        if name in self.handlers:
            raise ValueError(f"cache input '{name}' registered twice")
        self.handlers[name] = handler

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
        return sum(h.bytes_per_page(self.page_size) for h in self.handlers.values())

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, num_pages: int) -> None:
        if num_pages < self.min_pages:
            raise ValueError(
                f"{num_pages} cache pages cannot hold one sequence of max_seq_len={self.max_seq_len} "
                f"(needs {self.min_pages} pages of {self.page_size} tokens)"
            )
        self.caches.clear()  # free the old pool before allocating the new one
        self.caches = {name: h.allocate(num_pages, self.page_size, self.device) for name, h in self.handlers.items()}
        self.num_pages = num_pages

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
        return sum(t.numel() * t.element_size() for t in self.caches.values())

    # ---- calling the graph -------------------------------------------------------------------
    def graph_args(self, info: SequenceInfo) -> List[torch.Tensor]:
        if len(self.caches) != len(self.handlers):
            raise RuntimeError("caches are not allocated; is initialize_cache in the pipeline?")
        inputs = info.as_inputs()
        return [inputs[name] for name in ("input_ids", "position_ids", *METADATA_NAMES)] + [
            self.caches[name] for name in self.cache_names
        ]
