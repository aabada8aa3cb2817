"""gather_logits_before_lm_head (cache_init): the LM head runs only on the rows ``logits_index`` names.

The tiny llama is built through cache_init with and without the transform; on a mixed step
(two prefills of different lengths + one decode) the gathered rows equal the last-token rows
of the full logits, and with one prefill scoring its prompt (``all_logits``) they equal that
sequence's every row plus the others' last rows. Small hand-made graphs cover what is skipped.
"""

import random

import pytest
import torch
from torch import fx, nn

from autodeploy.cache import build_sequence_info
from autodeploy.cache.interface import CachedSequenceInterface
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.library.gather_logits_before_lm_head import find_lm_head
from autodeploy.transform.optimizer import build_transform
from helpers import build, count_op, family_checkpoint, rel_rmse

aten = torch.ops.aten
LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
VOCAB = 512


def _build(enabled: bool):
    return build(family_checkpoint("llama"), up_to=Stage.CACHE_INIT,
                 overrides={"resize_kv_cache": {"enabled": False},
                            "gather_logits_before_lm_head": {"enabled": enabled}}, **LIMITS)


@pytest.fixture(scope="module")
def gathered():
    return _build(True)


@pytest.fixture(scope="module")
def full():
    return _build(False)


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _steps(res):
    """Step 1: prefill C (6 tokens). Step 2: prefill A (9), prefill B (5), decode C."""
    res.cache.allocate(res.cache.num_pages)
    free = list(range(res.cache.num_pages))
    random.Random(1).shuffle(free)
    table_a, table_b, table_c = ([free.pop() for _ in range(n)] for n in (3, 2, 2))
    c = _ids(6, 3)
    a, b = _ids(9, 1), _ids(5, 2)
    steps = [build_sequence_info([c], [0], [table_c]),
             build_sequence_info([a, b, [77]], [0, 0, 6], [table_a, table_b, table_c]),
             # B again (its pages rewritten with the same tokens), scoring all its rows, and C's next decode
             build_sequence_info([a, b, [78]], [0, 0, 7], [table_a, table_b, table_c], all_logits=[False, True, False])]
    outs = []
    with torch.no_grad():
        for info in steps:
            outs.append((info, res.graph(*res.cache.graph_args(info)).clone()))
    return outs


def test_graph_structure(gathered, full):
    record = next(r for r in gathered.context.history if r.key == "gather_logits_before_lm_head")
    assert record.status == "ok" and record.num_matches == 1
    assert gathered.cache.gathered_logits is True
    assert full.cache.gathered_logits is False
    assert count_op(full.graph, aten.index_select) == 0
    assert count_op(gathered.graph, aten.index_select) == 1
    head = find_lm_head(gathered.graph)
    assert head is not None and head.args[1].target == "lm_head.weight"
    select = head.args[0]
    assert select.target == aten.index_select.default and select.args[1] == 1
    # the index is the logits_index step input
    stack, seen = [select.args[2]], set()
    while stack:
        n = stack.pop()
        seen.add(n)
        stack.extend(n.all_input_nodes)
    assert {n.name for n in seen if n.op == "placeholder"} == {"logits_index"}
    # the hidden state it selects from is the final norm's output
    assert "rmsnorm" in str(select.args[0].args[0].target)


def test_gathered_rows_equal_the_rows_logits_index_names(gathered, full):
    steps = list(zip(_steps(gathered), _steps(full)))
    for (info, got), (_, ref) in steps:
        rows = info.logits_index.tolist()
        assert got.shape == (1, len(rows), VOCAB)
        assert ref.shape == (1, info.num_tokens, VOCAB)
        for row, idx in enumerate(rows):
            assert rel_rmse(got[0, row], ref[0, idx]) < 1e-5, (row, idx)
    assert steps[1][0][0].logits_index.tolist() == [8, 13, 14]  # the mixed step: ends of A, B and C's decode
    assert steps[2][0][0].logits_index.tolist() == [8, 9, 10, 11, 12, 13, 14]  # A's end, all of B, C


# ---- small hand-made graphs -----------------------------------------------------------------------
class _Head(nn.Module):
    """embedding -> (linear | matmul) -> optional ops, with the cached graph's inputs."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Parameter(torch.randn(32, 8))
        self.w = nn.Parameter(torch.randn(16, 8))

    def forward(self, input_ids, position_ids, batch_info, seq_len, input_pos, cu_seqlen, page_table, slot_idx,
                use_initial_state, logits_index):
        h = aten.embedding.default(self.emb, input_ids)
        if self.kind == "matmul":
            return aten.matmul.default(h, aten.t.default(self.w))
        if self.kind == "linear_simple":  # the head as match_linear_simple leaves it
            return torch.ops.autodeploy.torch_linear_simple.default(h, self.w)
        logits = aten.linear.default(h, self.w)
        if self.kind == "softcap":  # token-wise ops after the head
            return aten.mul.Tensor(aten.tanh.default(aten.div.Tensor(logits, 30.0)), 30.0)
        if self.kind == "cumsum":  # mixes tokens: not token-wise
            return aten.cumsum.default(logits, 1)
        return logits


def _apply(kind):
    gm = fx.symbolic_trace(_Head(kind))
    cache = CachedSequenceInterface(page_size=4, max_batch_size=3, max_seq_len=16, max_num_tokens=16)
    ctx = PipelineContext(max_seq_len=16, max_num_tokens=16, max_batch_size=3, page_size=4, cache=cache)
    info = build_sequence_info([[1, 2, 3, 4], [5, 6], [7]], [0, 0, 3], [[0], [1], [2]])
    args = list(info.as_inputs().values())
    with torch.no_grad():
        before = gm(*args)
    gm = build_transform("gather_logits_before_lm_head", {})(gm, ctx)
    with torch.no_grad():
        after = gm(*args)
    return gm, ctx, info, before, after


@pytest.mark.parametrize("kind", ["linear", "softcap", "linear_simple"])
def test_small_graph_with_linear_head_is_gathered(kind):
    gm, ctx, info, before, after = _apply(kind)
    assert ctx.history[-1].status == "ok" and ctx.history[-1].num_matches == 1
    assert ctx.cache.gathered_logits is True
    assert count_op(gm, aten.index_select) == 1
    assert after.shape == (1, 3, 16)
    torch.testing.assert_close(after[0], before[0, info.last_token_indices()], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["matmul", "cumsum"])
def test_output_not_produced_by_a_token_wise_linear_is_skipped(kind):
    gm, ctx, info, before, after = _apply(kind)
    assert ctx.history[-1].status == "skipped" and ctx.history[-1].num_matches == 0
    assert ctx.cache.gathered_logits is False
    assert count_op(gm, aten.index_select) == 0
    assert after.shape == (1, info.num_tokens, 16)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
