"""fold_constants: arithmetic on weights alone becomes buffers computed once, at load.

A toy with the spellings real models use (a Gemma ``1 + w`` norm weight, Mamba's
``-exp(A_log.float())``, a token-shift tap built with ``ones``/``zeros_like``/``cat``), near misses
(the input in the chain, a mutated buffer, a random op, a chain over the growth budget), and real
tiny RWKV-4 and Gemma-3 checkpoints (logits equal HF's).
"""

import copy

import pytest
import torch
from torch import nn

from autodeploy.transform.interface import Stage
from autodeploy.transform.library.fold_constants import constant_nodes
from helpers import apply_transform, assert_matches_hf, build, count_op, coverage_checkpoint, export_gm

aten = torch.ops.aten
HIDDEN = 16


class WeightArithmetic(nn.Module):
    """Per call: ``1 + norm_w``, ``-exp(A_log.float())`` and the taps ``[1, 0]`` of a token shift."""

    def __init__(self, mode: str = "fold"):
        super().__init__()
        self.mode = mode
        torch.manual_seed(0)
        self.norm_w = nn.Parameter(torch.randn(HIDDEN) * 0.1)
        self.A_log = nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.proj = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.2)
        self.register_buffer("counter", torch.zeros(HIDDEN))

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.proj)
        scale = 1.0 + self.norm_w
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
        decay = -torch.exp(self.A_log.float())
        taps = torch.cat([torch.ones(HIDDEN, 1), torch.zeros(HIDDEN, 1)], dim=-1)  # [c, 2]
        shifted = torch.nn.functional.pad(y, (0, 0, 1, 0))[:, :-1]
        y = y * decay + shifted * taps[:, 0] + y * taps[:, 1]
        mode = self.mode
        if mode == "input_in_chain":  # x takes part: nothing of it is constant
            y = y + (self.norm_w * x.mean()).exp()
        elif mode == "random":  # a random op is never run once for all calls
            y = y + torch.rand_like(self.norm_w) * 0
        elif mode == "mutated":  # a buffer the graph writes is not constant
            self.counter.add_(1.0)
            y = y + (self.counter * 2.0)
        elif mode == "wide":  # a float64 copy of a weight that stays (the linear reads it): 2 KiB more
            y = y + (x.double() @ self.proj.double().t()).float()
        return y


def _inputs():
    return [(torch.randn(2, 5, HIDDEN),), (torch.randn(3, 1, HIDDEN),)]


def _run(mode="fold", **config):
    gm = export_gm(WeightArithmetic(mode).eval(), torch.randn(2, 5, HIDDEN))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fold_constants", gm, **config)
    return reference, gm, record


def _assert_bit_equal(reference, gm):
    """The same ops on the same tensors: equal bit for bit at two shapes."""
    for args in _inputs():
        with torch.no_grad():
            assert torch.equal(reference(*args), gm(*args))


def _buffers(gm):
    return {name for name, _ in gm.named_buffers() if "_folded" in name}


def test_weight_arithmetic_becomes_buffers_and_outputs_stay_bit_equal():
    reference, gm, record = _run()
    # (1 + w), -exp(A_log.float()) and the two tap columns: four values a non-constant node reads
    assert record.num_matches == 4
    assert count_op(reference, [aten.exp, aten.ones, aten.cat]) == 3
    assert count_op(gm, [aten.exp, aten.neg, aten.ones, aten.zeros_like, aten.zeros, aten.cat]) == 0
    assert not [n for n in constant_nodes(gm.graph) if n.op == "call_function"]
    assert len(_buffers(gm)) == 4
    # weights nothing reads any more are dropped; the linear's weight stays a parameter
    assert not hasattr(gm, "norm_w") and not hasattr(gm, "A_log") and hasattr(gm, "proj")
    assert torch.equal(gm.get_buffer("A_log_folded"), -reference.A_log.float().exp())
    _assert_bit_equal(reference, gm)


@pytest.mark.parametrize("mode", ["input_in_chain", "random", "mutated"])
def test_near_misses_stay_computed_per_call(mode):
    reference, gm, record = _run(mode)
    assert record.num_matches == 4  # the toy's own four constants still fold
    if mode == "input_in_chain":
        assert hasattr(gm, "norm_w")  # also read with x: the weight stays, its exp(w * mean(x)) per call
        assert count_op(gm, aten.exp) == 1
    elif mode == "random":
        assert count_op(gm, aten.rand_like) == 1
    else:
        assert count_op(gm, aten.add_) + count_op(gm, aten.add.Tensor) >= 1
        assert "counter" in dict(gm.named_buffers()) and count_op(gm, aten.mul.Tensor) >= 1
        assert not any(n.target == "counter_folded" for n in gm.graph.nodes)
    if mode != "random":
        _assert_bit_equal(reference, gm)


def _casts_of_proj(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (aten.to.dtype, aten._to_copy.default)
               and n.args[0].op == "get_attr" and n.args[0].target == "proj")


def test_a_constant_past_the_growth_budget_stays_computed():
    # the float64 copy of proj would add 2 KiB to a 1 KiB budget: left computed, the rest folds
    reference, gm, record = _run("wide", max_growth_mib=1 / 1024)
    assert record.num_matches == 4
    assert _casts_of_proj(gm) == 1
    _assert_bit_equal(reference, gm)
    _, gm_big, record_big = _run("wide")
    assert record_big.num_matches == 5 and _casts_of_proj(gm_big) == 0


def test_nothing_to_fold_in_a_plain_llama():
    path, _ = coverage_checkpoint("llama")
    result = build(path, up_to=Stage.POST_LOAD_FUSION)
    record = next(r for r in result.context.history if r.key == "fold_constants")
    assert record.num_matches == 0


@pytest.mark.parametrize("model_type, folded", [("rwkv", 14), ("gemma3_text", 37)])
def test_real_models_fold_and_match_hf(model_type, folded):
    """RWKV-4: ``1 - time_mix`` (10) and the token shifts' taps; Gemma-3: ``1 + w`` of every norm."""
    path, _ = coverage_checkpoint(model_type)
    result = build(path, up_to=Stage.POST_LOAD_FUSION)
    record = next(r for r in result.context.history if r.key == "fold_constants")
    assert record.status == "ok" and record.num_matches == folded
    gm = result.graph
    assert not [n for n in constant_nodes(gm.graph) if n.op == "call_function"]
    assert len(_buffers(gm)) == folded
    assert_matches_hf(gm, path)
