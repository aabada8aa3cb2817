"""Representative steps for warming up compiled graphs and capturing CUDA graphs."""

from typing import Dict, List

from ..cache.interface import CachedSequenceInterface
from ..cache.sequence_info import SequenceInfo, build_sequence_info


def default_buckets(limit: int) -> List[int]:
    """1, 2, 4, ... up to ``limit`` (included)."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def decode_step(cache: CachedSequenceInterface, batch: int, context: int = 1) -> SequenceInfo:
    """``batch`` single-token sequences, each with ``context`` tokens cached, on distinct pages."""
    per_seq = cache.pages_per_sequence
    tables = [[(i * per_seq + j) % cache.num_pages for j in range(per_seq)] for i in range(batch)]
    return build_sequence_info([[0]] * batch, [context] * batch, tables, device=cache.device)


def prefill_step(cache: CachedSequenceInterface, tokens: int) -> SequenceInfo:
    tokens = max(2, min(tokens, cache.max_seq_len - 1))
    pages = -(-tokens // cache.page_size)
    return build_sequence_info([[0] * tokens], [0], [list(range(pages))], device=cache.device)


def shape_classes(cache: CachedSequenceInterface) -> Dict[str, SequenceInfo]:
    """One step per shape class the compiler specialises on: one token, several one-token
    sequences, several tokens. Measured: after these, no other step shape recompiles."""
    classes = {"decode-1": decode_step(cache, 1), "prefill": prefill_step(cache, 8)}
    if cache.max_batch_size > 1:
        classes["decode-batch"] = decode_step(cache, 2)
    return classes
