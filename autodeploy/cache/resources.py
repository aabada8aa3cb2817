"""Resource handlers: what one cache tensor looks like and how to allocate it.

Two kinds (DESIGN.md section 5):

* paged (``ResourceHandler``): tokens' keys/values in pages of one pool, addressed by page
  tables; the pool is sized to the free memory (``resize_kv_cache``);
* per-sequence state (``StateHandler``): a fixed-size state per running sequence (an SSM state,
  a convolution window, a delta-rule matrix), ``[num_slots, *shape]`` addressed by ``slot_idx``,
  with ``num_slots = max_batch_size + 1`` (the last slot is the padding rows' scratch). Its size
  does not depend on the page pool.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Tuple

import torch


class ResourceHandler(ABC):
    """Describes one cache input of the graph (per layer and kind)."""

    @abstractmethod
    def bytes_per_page(self, page_size: int) -> int:
        """Bytes this cache needs for one page of ``page_size`` tokens."""

    @abstractmethod
    def allocate(self, num_pages: int, page_size: int, device: torch.device) -> torch.Tensor:
        """A zero-initialised cache for ``num_pages`` pages."""


@dataclass(frozen=True)
class PagedKVHandler(ResourceHandler):
    """A paged key or value cache: ``[num_pages, page_size, num_kv_heads, head_dim]``."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_page(self, page_size: int) -> int:
        return page_size * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_pages: int, page_size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_pages, page_size, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class StateHandler:
    """A per-sequence state cache: ``[num_slots, *shape]`` of ``dtype``, zero-initialised.

    Not a ``ResourceHandler``: it has no pages, so it never enters the page pool's arithmetic."""

    shape: Tuple[int, ...]
    dtype: torch.dtype

    def bytes_per_slot(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_slots: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_slots, *self.shape, dtype=self.dtype, device=device)
