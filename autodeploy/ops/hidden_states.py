"""Capture of hidden states into a per-step token buffer (``insert_cached_residual_add``).

``torch_capture_hidden_states(hidden, buffer)`` copies the step's token rows of ``hidden``
(``[1, T, H]`` in the cached graph, any ``[..., H]``: the leading dims are flattened in row
order) into rows ``0..T-1`` of ``buffer`` (``[max_num_tokens, H]``, a graph input the cache
interface owns: ``autodeploy.cache.resources.TokenBufferHandler``). The runtime reads those rows
after the graph call (``ModelRunner``); the next step overwrites them.

The op returns nothing and declares ``buffer`` mutated, so its schema is mutable: FX's
``Node.is_impure`` is then true and dead-code elimination keeps the node although nothing reads
its output, and ``torch.compile`` keeps the write as a side effect. The captured value itself is
only read, never changed.

A step never has more than ``max_num_tokens`` tokens (the scheduler's budget), so every real row
fits. Rows beyond the buffer can only be padding (a CUDA-graph decode bucket larger than
``max_num_tokens``) and are not written.
"""

import torch
from torch import Tensor


@torch.library.custom_op("autodeploy::torch_capture_hidden_states", mutates_args=("buffer",))
def torch_capture_hidden_states(hidden: Tensor, buffer: Tensor) -> None:
    """``buffer[:T] = hidden`` viewed as ``[T, H]`` (cast to the buffer's dtype)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    n = min(rows.shape[0], buffer.shape[0])
    buffer[:n].copy_(rows[:n])


@torch_capture_hidden_states.register_fake
def _torch_capture_hidden_states_fake(hidden: Tensor, buffer: Tensor) -> None:
    return None
