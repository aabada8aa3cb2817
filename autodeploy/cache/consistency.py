"""A build-time check that the cached graph computes what the uncached model computes.

The KV cache only carries attention's keys and values between steps, and the flattened-token
row puts several sequences side by side. A layer that mixes tokens any other way (a short
convolution, an SSM scan, a cumulative sum over the sequence) would then see a truncated
history or its neighbour's tokens, and the model would answer wrongly without any error.
Rather than trying to recognise every such layer, the check runs the same two prompts through
the cached graph scheduled two ways and compares the next-token logits:

* A: both prompts in one prefill step, side by side in the row;
* B: the short prompt alone, then the long one as a prefill of all but its last token followed
  by a one-token decode step.

A model whose state lives entirely in the KV cache gives the same logits both ways (up to
floating-point reduction order); one with hidden sequence state does not.

A recompute graph exported with a static length pads each history on the right. That is exact
only if no position looks at later ones; a model that does (a top-k over all keys before the
causal mask, say) would silently change its answers with the padding, so schedule A is run a
second time with a different pad token and must give the same logits.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import nn

from ..ops.linear import exact_linears
from ..ops.quant.formats import exact_activations
from .interface import CachedSequenceInterface
from .sequence_info import build_sequence_info

# Relative RMSE allowed between the two schedules. fp32 reduction-order noise is ~1e-7; a lost
# convolution state in a tiny random model shows up around 1e-3.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}
# Half precision: ten of the dtype's epsilons (fp16 ~1e-2, bf16 ~8e-2). A decode step reads its
# keys back from the cache and attends in another kernel than the prefill did, so the schedules
# differ by rounding: the `small` preset (12 layers) measured 1.3e-3 in fp16 and 1.0e-2 in bf16
# with no state anywhere, which a flat 1e-2 sent to recompute mode (~10x slower). The price: a
# lost state smaller than this passes in half precision (a tiny random LFM2 without its conv
# cache: 1e-3 in fp32, 5e-3 in bf16; caught in fp32 only, as it already was).
HALF_EPSILONS = 10


def tolerance_for(dtype: torch.dtype) -> float:
    """The relative RMSE two schedules of a state-free model may differ by in ``dtype``."""
    return TOLERANCE.get(dtype, HALF_EPSILONS * torch.finfo(dtype).eps)


@dataclass
class ConsistencyResult:
    ok: bool
    error: float  # the largest relative RMSE seen
    tolerance: float
    detail: str = ""


def _rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _pages(first: int, tokens: int, page_size: int) -> List[int]:
    return list(range(first, first + -(-tokens // page_size)))


def check_cache_consistency(model: nn.Module, cache: CachedSequenceInterface, vocab_size: int,
                            dtype: torch.dtype, long_len: int = 7, short_len: int = 3,
                            seed: int = 0) -> Optional[ConsistencyResult]:
    """Compare schedules A and B (module docstring). ``None`` when the pool or ``max_seq_len``
    is too small to run them."""
    long_len = min(long_len, cache.max_seq_len)
    short_len = min(short_len, long_len - 1)
    p = cache.page_size
    long_pages = _pages(0, long_len, p)
    short_pages = _pages(len(long_pages), short_len, p)
    if short_len < 1 or len(long_pages) + len(short_pages) > cache.allocatable_pages:
        return None
    gen = torch.Generator().manual_seed(seed)
    long_ids = torch.randint(0, vocab_size, (long_len,), generator=gen).tolist()
    short_ids = torch.randint(0, vocab_size, (short_len,), generator=gen).tolist()

    def run(tokens: Sequence[List[int]], starts: Sequence[int], tables: Sequence[List[int]]) -> torch.Tensor:
        info = build_sequence_info(tokens, starts, tables, device=cache.device)
        out = model(*cache.graph_args(info))
        rows = torch.arange(info.num_sequences) if cache.gathered_logits else info.last_token_indices()
        return out[0, rows.to(out.device)].float().cpu()

    # exact_linears: a lossy narrow-weight GEMV (select_linear_backend.gemv_dtype) would make the
    # one-row step of schedule B differ by its rounding; exact_activations: FP8/FP4 activation
    # rounding turns reduction-order noise into flipped codes. The check is about where state lives
    with torch.inference_mode(), exact_linears(), exact_activations():
        together = run([long_ids, short_ids], [0, 0], [long_pages, short_pages])
        short_alone = run([short_ids], [0], [short_pages])
        run([long_ids[:-1]], [0], [long_pages])
        long_split = run([long_ids[-1:]], [long_len - 1], [long_pages])
        repadded = None
        runner = getattr(model, "recompute", None)
        if runner is not None and (runner.static_seq_len is not None or runner.min_seq_len > 1):
            runner.pad_token_id = vocab_size - 1
            try:
                repadded = run([long_ids, short_ids], [0, 0], [long_pages, short_pages])
            finally:
                runner.pad_token_id = 0
        for tensor in cache.caches.values():
            tensor.zero_()
    tolerance = tolerance_for(dtype)
    packed_err = _rel_rmse(short_alone[0], together[1])
    split_err = _rel_rmse(long_split[0], together[0])
    details = []
    if packed_err > tolerance:
        details.append(f"a prompt's logits change when another prompt shares its step (rel. RMSE {packed_err:.1e})")
    if split_err > tolerance:
        details.append(f"a prompt's logits change when its last token comes in a later step (rel. RMSE {split_err:.1e})")
    pad_err = _rel_rmse(repadded, together) if repadded is not None else 0.0
    if pad_err > tolerance:
        details.append(f"the logits change with the padding after the prompt (rel. RMSE {pad_err:.1e}): positions "
                       "look at later tokens, so a static-length export cannot serve the model")
    return ConsistencyResult(not details, max(packed_err, split_err, pad_err), tolerance, "; ".join(details))


def check_static_export_against_eager(runner: nn.Module, factory: object, dtype: torch.dtype,
                                      device: torch.device, lengths: Sequence[int] = (1, 3, 13),
                                      seed: int = 0) -> ConsistencyResult:
    """Compare a padded recompute graph (static length, or an automatic dim with a minimum) with
    the eager model at the prompts' real lengths.

    A model that only exports with a static length may branch on the sequence length (a
    top-k that only starts above some window, a chunked path above some size): the padded
    graph would then take the branch of the static length for every prompt. Padding checks
    cannot see that, so the eager model (loaded from the same checkpoint, once, at build time)
    is the reference here."""
    width = runner.static_seq_len or max(lengths)
    vocab = int(factory.vocab_size)  # type: ignore[attr-defined]
    eager = factory.load_eager(dtype, device)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(seed)
    worst, details = 0.0, []
    try:
        with torch.inference_mode():
            for length in sorted({min(n, width) for n in lengths}):
                ids = torch.randint(0, vocab, (length,), generator=gen).to(device)
                ours = runner.last_logits([ids])[0, 0].float().cpu()
                ref = eager(ids[None], use_cache=False).logits[0, -1].float().cpu()
                err = _rel_rmse(ours, ref)
                worst = max(worst, err)
                if err > tolerance_for(dtype):
                    details.append(f"a {length}-token prompt's logits differ from the eager model's (rel. RMSE "
                                   f"{err:.1e}): the model depends on the sequence length beyond causality")
    finally:
        del eager
    tolerance = tolerance_for(dtype)
    return ConsistencyResult(not details, worst, tolerance, "; ".join(details))
