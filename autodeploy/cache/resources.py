"""Resource handlers: what one cache tensor looks like and how to allocate it."""

from abc import ABC, abstractmethod
from dataclasses import dataclass

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
