"""Reading a step's metadata on the host with one device-to-host copy.

The cached ops of a prefill or mixed step need the batch layout as Python ints (how many
sequences prefill, where each one's rows start, how long each is) to slice the step. On CPU a
``tolist()`` is a memory read. On CUDA every ``tolist()`` is a copy that waits for the GPU to
finish all the work queued before it, and the GPU then idles until the host has queued the next
kernels: four such reads in one attention call of each layer were four drains of the queue per
layer. ``host_lists`` reads any number of small metadata tensors with one copy (one drain).
"""

from typing import List, Sequence

import torch
from torch import Tensor


def host_lists(*tensors: Tensor) -> List[list]:
    """``[t.tolist() for t in tensors]`` for 1-d integer or bool tensors on one device, read
    with a single device-to-host copy when they live on an accelerator."""
    if any(t.dim() != 1 for t in tensors):
        raise ValueError(f"host_lists reads 1-d metadata; got shapes {[tuple(t.shape) for t in tensors]}")
    if not tensors or tensors[0].device.type == "cpu":
        return [t.tolist() for t in tensors]
    return read_once(tensors)


def read_once(tensors: Sequence[Tensor]) -> List[list]:
    """The accelerator path of ``host_lists``: concatenated as int64, one ``tolist()``, split
    again (bool tensors back to bools). Device-agnostic, so the CPU tests check its splitting."""
    flat = torch.cat([t.to(torch.int64) for t in tensors]).tolist()
    lists, at = [], 0
    for t in tensors:
        part = flat[at:at + t.numel()]
        lists.append([bool(x) for x in part] if t.dtype == torch.bool else part)
        at += t.numel()
    return lists
