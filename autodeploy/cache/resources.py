"""Resource handlers: what one cache tensor looks like and how to allocate it.

Three kinds (DESIGN.md section 5 has the first two):

* paged (``ResourceHandler``): tokens' keys/values in pages of one pool, addressed by page
  tables; the pool is sized to the free memory (``resize_kv_cache``);
* per-sequence state (``StateHandler``): a fixed-size state per running sequence (an SSM state,
  a convolution window, a delta-rule matrix), ``[num_slots, *shape]`` addressed by ``slot_idx``,
  with ``num_slots = max_batch_size + 1`` (the last slot is the padding rows' scratch). Its size
  does not depend on the page pool;
* per-step token buffer (``TokenBufferHandler``): one row per token of the current step,
  ``[max_num_tokens, hidden]``, rewritten by every step and read by the runtime after the graph
  call (the hidden states ``insert_cached_residual_add`` captures). Nothing in it outlives the
  step, so it depends on neither the pool nor the batch size.
"""

import math
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

# A CPU cache at least this large is mapped from the OS instead of filled by ``torch.zeros``.
LAZY_ZERO_MIN_BYTES = 1 << 20


def zeroed(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of ``shape``; on CPU, a large one is lazily zeroed anonymous memory.

    Why: ``torch.zeros`` writes every byte, and on a CPU host the first write to each 4 KiB page
    also takes a page fault: the default ``small`` pool (4 GiB) took 2-3 s of a ~12 s build, for
    pages that a short run never uses. An anonymous private mapping reads as zeros by definition
    (POSIX ``MAP_ANONYMOUS``; the kernel maps each page when it is first written), so the cache is
    exactly as zeroed as before, at no cost up front; a page is paid for when a step first writes
    it. The mapping is the tensor's storage (``torch.frombuffer`` holds a reference to it) and is
    unmapped when the tensor is freed. The memory is committed as for any allocation; it only
    becomes resident as it is used. CUDA tensors and small ones are plain ``torch.zeros``.
    """
    device = torch.device(device)
    numel = math.prod(int(d) for d in shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < LAZY_ZERO_MIN_BYTES:
        return torch.zeros(*shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(*shape)


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
    """A paged key or value cache: ``[num_pages, page_size, num_kv_heads, head_dim]``.

    ``dtype`` is the storage type: the model's dtype, or ``float8_e4m3fn`` for an FP8 KV cache
    (``insert_cached_attention.kv_cache_dtype: fp8``). ``bytes_per_page`` follows it, so
    ``resize_kv_cache`` fits 2x (bf16/fp16 model) or 4x (fp32 model) the pages in the same budget."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_page(self, page_size: int) -> int:
        return page_size * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_pages: int, page_size: int, device: torch.device) -> torch.Tensor:
        return zeroed((num_pages, page_size, self.num_kv_heads, self.head_dim), self.dtype, device)


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
        return zeroed((num_slots, *self.shape), self.dtype, device)


@dataclass(frozen=True)
class TokenBufferHandler:
    """A per-step token buffer: ``[num_tokens, hidden]`` of ``dtype`` (``num_tokens`` is
    ``max_num_tokens``), zero-initialised. Row ``t`` holds token ``t`` of the step that ran last.

    Neither a ``ResourceHandler`` nor a ``StateHandler``: it has no pages and no slots, so it
    enters neither the page pool's nor the state slots' arithmetic."""

    hidden: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        return int(self.hidden) * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_tokens, self.hidden, dtype=self.dtype, device=device)
