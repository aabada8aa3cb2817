"""Memory readings for sizing the KV cache: free memory and the peak of one forward."""

import os
from contextlib import contextmanager
from typing import Iterator, List, Optional

import torch


def _meminfo_kib(field: str, path: str = "/proc/meminfo") -> Optional[int]:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def free_memory_bytes(device: torch.device) -> int:
    """Memory a cache could take: CUDA free memory, or the OS's available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    kib = _meminfo_kib("MemAvailable")
    if kib is not None:
        return kib * 1024
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _reset_rss_peak() -> bool:
    try:  # Linux: "5" resets the peak RSS (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextmanager
def measure_peak(device: torch.device) -> Iterator[List[int]]:
    """Yields a one-element list that holds, afterwards, the peak extra bytes used inside."""
    out = [0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield out
        torch.cuda.synchronize(device)
        out[0] = max(0, torch.cuda.max_memory_allocated(device) - before)
        return
    before = (_meminfo_kib("VmRSS", "/proc/self/status") or 0) * 1024
    can_reset = _reset_rss_peak()
    yield out
    peak = (_meminfo_kib("VmHWM", "/proc/self/status") or 0) * 1024
    out[0] = max(0, peak - before) if can_reset else 0
