"""Shared checks for the state-cache transforms (insert_cached_causal_conv / ssm_attention /
delta_rule / gated_delta_rule): a cached graph built from a real checkpoint (or a toy LM) is
run on flattened steps and compared with the uncached graph run on each sequence alone.

``recompute_fallback`` is off in these builds: its consistency check would otherwise hide a
broken state cache behind recompute mode, and these tests are about the cached graph itself.
"""

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import fx

from autodeploy.cache import build_sequence_info
from autodeploy.cache.interface import CachedSequenceInterface
from autodeploy.cache.resources import StateHandler
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.optimizer import build_transform
from helpers import build, rel_rmse

LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
CACHED_ONLY = {"resize_kv_cache": {"enabled": False}, "gather_logits_before_lm_head": {"enabled": False},
               "recompute_fallback": {"enabled": False}, "initialize_cache": {"num_pages": 40}}
TOL = 1e-5


@dataclass
class Cached:
    graph: fx.GraphModule
    cache: CachedSequenceInterface
    context: PipelineContext
    uncached: fx.GraphModule
    vocab: int


def build_cached(checkpoint: str, vocab: int, overrides: Optional[Dict[str, Any]] = None) -> Cached:
    """The cache_init graph of a checkpoint (no resize / gather / fallback) and its uncached graph."""
    res = build(checkpoint, up_to=Stage.CACHE_INIT, overrides={**CACHED_ONLY, **(overrides or {})}, **LIMITS)
    uncached = build(checkpoint, up_to=Stage.WEIGHT_LOAD, **LIMITS).graph
    return Cached(res.graph, res.cache, res.context, uncached, vocab)


def apply_cache_transforms(gm: fx.GraphModule, keys: Sequence[str], vocab: int, **limits: Any) -> Cached:
    """Run cache transforms by key on an exported graph (a toy LM), then allocate the caches."""
    settings = {**LIMITS, **limits}
    ctx = PipelineContext(max_batch_size=settings["max_batch_size"], max_seq_len=settings["max_seq_len"],
                          max_num_tokens=settings["max_num_tokens"], page_size=settings["page_size"])
    uncached = copy.deepcopy(gm)
    for key in keys:
        gm = build_transform(key, {})(gm, ctx)
    ctx.cache.allocate(ctx.cache.min_pages * settings["max_batch_size"] + 4)
    return Cached(gm, ctx.cache, ctx, uncached, vocab)


def ids(n: int, seed: int, vocab: int) -> List[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Pages:
    """Disjoint page tables handed out in order."""

    def __init__(self, page_size: int = LIMITS["page_size"]):
        self.next, self.page_size = 0, page_size

    def take(self, tokens: int) -> List[int]:
        n = -(-tokens // self.page_size)
        self.next += n
        return list(range(self.next - n, self.next))


def step(c: Cached, tokens: Sequence[Sequence[int]], starts: Sequence[int], tables: Sequence[List[int]],
         slots: Sequence[int]) -> List[torch.Tensor]:
    """One flattened step; returns each sequence's logits rows ``[n_new, vocab]``."""
    info = build_sequence_info(tokens, starts, tables, slots=slots)
    with torch.no_grad():
        out = c.graph(*c.cache.graph_args(info))[0]
    cu = info.cu_seqlen.tolist()
    return [out[cu[i]:cu[i + 1]] for i in range(len(tokens))]


def uncached_logits(c: Cached, token_ids: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return c.uncached(torch.tensor([list(token_ids)]), torch.arange(len(token_ids))[None])[0]


def reset(c: Cached) -> None:
    c.cache.allocate(c.cache.num_pages)


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = rel_rmse(out, ref)
    assert err < TOL, f"{what}: rel. RMSE {err:.2e}"


def check_prefill_two_shapes(c: Cached) -> None:
    """(c) of DESIGN.md: one 5-token sequence in slot 2; then 9 + 3 tokens side by side in slots
    1 and 0 (every row equals the uncached graph on that sequence alone)."""
    reset(c)
    pages = Pages()
    a = ids(5, 1, c.vocab)
    (out,) = step(c, [a], [0], [pages.take(5)], [2])
    assert_close(out, uncached_logits(c, a), "one prefill")
    b, d = ids(9, 2, c.vocab), ids(3, 3, c.vocab)
    out_b, out_d = step(c, [b, d], [0, 0], [pages.take(9), pages.take(3)], [1, 0])
    assert_close(out_b, uncached_logits(c, b), "first of two prefills")
    assert_close(out_d, uncached_logits(c, d), "second of two prefills")


def check_chunked_prefill_then_decode(c: Cached) -> None:
    """Three prefill chunks (5, 4, 3) then two decodes equal the uncached graph over the whole
    sequence, while another sequence decodes beside it in another slot."""
    reset(c)
    pages = Pages()
    seq, other = ids(14, 4, c.vocab), ids(8, 5, c.vocab)
    t_seq, t_other = pages.take(32), pages.take(32)
    step(c, [other[:5]], [0], [t_other], [0])
    outs = []
    for lo, hi in ((0, 5), (5, 9), (9, 12)):
        outs.append(step(c, [seq[lo:hi]], [lo], [t_seq], [2])[0])
    ref = uncached_logits(c, seq[:12])
    assert_close(torch.cat(outs), ref, "three prefill chunks")
    for pos in (12, 13):
        out_seq, out_other = step(c, [seq[pos:pos + 1], other[pos - 7:pos - 6]], [pos, pos - 7], [t_seq, t_other],
                                  [2, 0])
        assert_close(out_seq[0], uncached_logits(c, seq[:pos + 1])[-1], f"decode at {pos}")
        assert_close(out_other[0], uncached_logits(c, other[:pos - 6])[-1], f"neighbour decode at {pos - 7}")


def check_new_sequence_ignores_a_used_slot(c: Cached) -> None:
    """A sequence starting at position 0 in a slot another sequence used (a finished or
    preempted one) starts from an empty state."""
    reset(c)
    pages = Pages()
    step(c, [ids(7, 6, c.vocab)], [0], [pages.take(7)], [1])
    fresh = ids(4, 7, c.vocab)
    (out,) = step(c, [fresh], [0], [pages.take(4)], [1])
    assert_close(out, uncached_logits(c, fresh), "prefill in a reused slot")


def state_handlers(cache: CachedSequenceInterface, prefix: str) -> Dict[str, StateHandler]:
    return {n: h for n, h in cache.handlers.items() if n.startswith(prefix + "_")}


def run_all(c: Cached) -> None:
    check_prefill_two_shapes(c)
    check_chunked_prefill_then_decode(c)
    check_new_sequence_ignores_a_used_slot(c)
