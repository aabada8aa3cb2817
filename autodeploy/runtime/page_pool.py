"""The page pool: which KV-cache pages are free."""

from typing import List


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> List[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} pages with {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages: List[int]) -> None:
        self._free.extend(reversed(pages))
