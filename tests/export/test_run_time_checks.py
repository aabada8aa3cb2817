"""The named sequence dim kept when torch cannot prove a shape guard that holds anyway
(``export.run_time_checks``): exported again with the guards as ``_assert_scalar`` nodes, taken
when every one holds on the grid of batch and sequence lengths, so the graph takes one-token
steps (paged KV cache) instead of running in recompute mode; a guard that fails somewhere keeps
the old fallback."""

import operator

import pytest
import sympy
import torch
from torch import fx, nn
from torch.export import Dim
from transformers import AutoModelForCausalLM

from autodeploy import LLM, SamplingParams
from autodeploy.export.exporter import export_causal_lm
from autodeploy.export.run_time_checks import _grid, failing_check, run_time_checks


class _TopKOverSeq(nn.Module):
    """HunYuan-V4's router shape: ``topk(k=min(cap, seq))`` over the sequence; the meta kernel
    guards ``Min(cap, seq) <= seq``, which torch's solver cannot prove."""

    def __init__(self, cap: int = 16):
        super().__init__()
        self.cap = cap
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.embed(input_ids)
        scores = x.sum(-1)
        picked = scores.topk(min(self.cap, x.shape[1]), dim=1).indices
        return self.head(x) + torch.zeros_like(scores).scatter(1, picked, 1.0)[..., None]


class _FlattenAndBack(nn.Module):
    """Aria's MoE block shape: flatten to rows, view back to ``[batch, seq, hidden]``; the view's
    contiguity guard is ``Eq(seq*Min(8, 8*seq), 8*seq)``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.embed(input_ids)
        rows = x.view(-1, x.size(-1))
        return self.head(self.mix(rows).view(x.shape) + rows.view(x.shape))


class _Pairs(nn.Module):
    """Near miss: works on token pairs, so the sequence length must be even: the deferred check
    ``Eq(Mod(seq, 2), 0)`` is false at seq 1 and the named dim must not be taken."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.embed(input_ids)
        b, s, h = x.shape
        pairs = x.reshape(b, s // 2, 2 * h)
        return self.head(pairs).repeat_interleave(2, dim=1)


def _assert_scalars(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_scalar.default]


@pytest.mark.parametrize("module", [_TopKOverSeq, _FlattenAndBack])
def test_the_named_dim_is_kept_with_the_checks_in_the_graph(module):
    torch.manual_seed(0)
    model = module().eval()
    with pytest.raises(Exception, match="Constraints violated"):  # what torch.export says of the named dim
        ids = torch.zeros(2, 8, dtype=torch.long)
        dims = {0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=64)}
        torch.export.export(model, (), {"input_ids": ids, "position_ids": ids}, strict=False,
                            dynamic_shapes={"input_ids": dims, "position_ids": dims})
    # with and without the recompute fallbacks (static_seq_len): they are not needed
    gm = export_causal_lm(model, max_batch_size=4, max_seq_len=64, static_seq_len=64)
    assert _assert_scalars(export_causal_lm(model, max_batch_size=4, max_seq_len=64))
    meta = gm.meta["autodeploy_export"]
    assert "min_seq_len" not in meta and "static_seq_len" not in meta  # the named dim: one-token steps
    assert len(_assert_scalars(gm)) >= 1
    assert failing_check(gm.graph, 4, 64) is None
    with torch.no_grad():
        for batch, seq in ((1, 1), (3, 5), (2, 64)):  # seq 1 included: where Min(cap, seq) is seq
            ids = torch.randint(0, 32, (batch, seq))
            pos = torch.arange(seq).expand(batch, seq)
            torch.testing.assert_close(gm(ids, pos), model(ids), rtol=1e-5, atol=1e-6)


def test_a_check_that_fails_somewhere_keeps_the_recompute_fallback(caplog):
    model = _Pairs().eval()
    with caplog.at_level("INFO", logger="autodeploy.export.run_time_checks"):
        gm = export_causal_lm(model, max_batch_size=4, max_seq_len=12, static_seq_len=12)
    meta = gm.meta["autodeploy_export"]
    assert "min_seq_len" in meta or "static_seq_len" in meta
    assert "does not always hold" in caplog.text and "false at batch 1, sequence length 1" in caplog.text


def _graph_asserting(condition_of):
    """A graph whose inputs have symbolic [batch, seq] shapes and one ``_assert_scalar`` of
    ``condition_of(batch, seq)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    graph = fx.Graph()
    ids = graph.placeholder("input_ids")
    ids.meta["val"] = mode.from_tensor(torch.empty(2, 8, dtype=torch.long))
    batch, seq = ids.meta["val"].shape
    condition = graph.call_function(operator.truth, (ids,))
    condition.meta["val"] = condition_of(batch, seq)
    graph.call_function(torch.ops.aten._assert_scalar.default, (condition, "a check"))
    return graph


def test_failing_check_reads_each_condition_on_the_grid():
    assert failing_check(_graph_asserting(lambda b, s: torch.sym_min(16, s) <= s), 4, 64) is None
    assert failing_check(_graph_asserting(lambda b, s: b * s >= s), 4, 64) is None
    assert "false at batch 1, sequence length 3" in failing_check(_graph_asserting(lambda b, s: s != 3), 4, 64)
    assert "false at batch 1, sequence length 33" in failing_check(_graph_asserting(lambda b, s: s < 33), 4, 64)
    assert "false at batch 3" in failing_check(_graph_asserting(lambda b, s: b * s != 3 * s), 4, 64)
    assert _grid(40, 8) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40]
    torch.manual_seed(0)
    gm = export_causal_lm(_TopKOverSeq(cap=16).eval(), max_batch_size=4, max_seq_len=64, static_seq_len=64)
    conditions = [c for c in run_time_checks(gm.graph) if c is not sympy.true]
    assert conditions and all(c.free_symbols for c in conditions)  # what the real export deferred


def test_aria_takes_one_token_steps_with_the_paged_kv_cache_and_gives_hfs_tokens():
    """The coverage sweep's Aria (MoE with a shared expert): before, recompute mode because the
    named dim was rejected; now the paged KV cache, and HF eager's greedy tokens."""
    from helpers import coverage_checkpoint

    path, vocab = coverage_checkpoint("aria_text")
    llm = LLM(path, max_seq_len=64, max_batch_size=2, max_num_tokens=64, page_size=8)
    assert llm.build.context.cache_mode == "paged_kv"
    assert _assert_scalars(llm.build.graph.graph)  # the checks run with every step
    prompts = [[3, 17, 29, 41, 5], [7, 8]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert ours == expected
