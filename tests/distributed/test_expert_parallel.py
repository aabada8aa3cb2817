"""Expert parallelism: detect_sharding splits each ``torch_moe`` by whole experts (each
``torch_moe_fused`` by rows of its stacked tensors), the executor keeps this rank's block (and
loads only its weights), routes the other ranks' pairs nowhere and all-reduces the partial outputs.

One process: the plan for Mixtral at world size 2, and at 3, which divides neither its 4 experts
nor their 128 hidden features: an error naming the world sizes that work. Two real gloo ranks (``-m slow``): Mixtral's and Qwen3-MoE's logits at
world size 2 equal HF eager's at two shapes, each rank holding two of the four experts.
"""

import copy

import pytest
import torch

from autodeploy.transform.interface import Stage
from autodeploy.transform.library._sharding import ExpertShard, ShardingPlan
from autodeploy.transform.library.detect_sharding import detect, plan_moe
from autodeploy.utils.errors import ConfigError
from helpers import MOE_FAMILIES, MOE_LAYERS, build, count_op, moe_family_checkpoint
from test_collectives import _run_ranks

# these plan the per-expert torch_moe (a build's layout for quantized experts, or experts the world size
# does not divide) of a world-size-1 build for other world sizes
PER_EXPERT = {"export_to_gm": {"experts_layout": "per_expert"}}

ad = torch.ops.autodeploy


def test_plan_splits_whole_experts_when_the_world_size_divides_them():
    gm = build(moe_family_checkpoint("mixtral"), up_to=Stage.PATTERN_MATCHER,
               overrides=PER_EXPERT).graph_module
    for rank in (0, 1):
        shards = [d for d in detect(gm, world_size=2, rank=rank).decisions if isinstance(d, ExpertShard)]
        assert len(shards) == MOE_LAYERS["mixtral"]
        assert all((d.start, d.end) == (2 * rank, 2 * rank + 2) for d in shards)
        other = {0: ("experts.2.", "experts.3."), 1: ("experts.0.", "experts.1.")}[rank]
        assert all(any(o in t for o in other) for d in shards for t in d.dropped)
        assert len(shards[0].dropped) == 2 * 3  # two experts' gate, up and down weights
    # 4 experts of 128 hidden features over 3 ranks: split neither way, an error naming the sizes that work
    moe = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_moe.default)
    plan = ShardingPlan(world_size=3, rank=0)
    with pytest.raises(ConfigError, match=r"4 experts of 128 hidden features each, which world_size 3 splits neither "
                                          r"by whole experts nor inside them; world sizes that split them: "
                                          r"\[1, 2, 4, 8, 16, 32, 64\]"):
        plan_moe(gm, moe, plan)
    assert plan.decisions == []


def _ep_job(rank: int, family: str, layout: str = "auto"):
    from helpers import assert_matches_hf

    checkpoint = moe_family_checkpoint(family)
    gm = build(checkpoint, up_to=Stage.WEIGHT_LOAD, world_size=2,
               overrides={"export_to_gm": {"experts_layout": layout}}).graph_module
    torch.manual_seed(0)  # every rank feeds the same tokens
    assert_matches_hf(gm, checkpoint, shapes=((1, 5), (2, 3)))
    params = dict(gm.named_parameters())
    per_expert = sorted({n.split(".experts.")[1].split(".")[0] for n in params if ".experts." in n
                         and n.split(".experts.")[1].split(".")[0].isdigit()})
    stacked_rows = sorted({int(p.shape[0]) for n, p in params.items() if n.endswith(("experts.gate_up_proj",
                                                                                      "experts.down_proj"))})
    return {"experts": per_expert, "stacked_rows": stacked_rows, "all_reduce": count_op(gm, ad.torch_dist_all_reduce)}


def _mixtral_job(rank: int):
    return _ep_job(rank, "mixtral")


def _qwen3_moe_job(rank: int):
    return _ep_job(rank, "qwen3_moe")


def _mixtral_per_expert_job(rank: int):
    return _ep_job(rank, "mixtral", "per_expert")


@pytest.mark.slow  # ~20 s each on 2 cores: two ranks build the model and run HF
@pytest.mark.distributed
@pytest.mark.parametrize("job", [_mixtral_job, _qwen3_moe_job, _mixtral_per_expert_job],
                         ids=["mixtral", "qwen3_moe", "mixtral-per_expert"])
def test_two_ranks_hold_half_the_experts_and_match_hf(job):
    """Four experts over two ranks: by default each rank holds rows 2r, 2r+1 of the stacked expert
    tensors (the loader stacks the checkpoint's experts, then takes the rank's rows); exported per
    expert, each rank holds experts 2r and 2r+1's own tensors. Either way the logits match HF."""
    layers = MOE_FAMILIES["mixtral"]["num_hidden_layers"]
    for family in ("mixtral", "qwen3_moe"):  # written here once, not by both ranks at the same time
        moe_family_checkpoint(family)
    for rank, r in enumerate(_run_ranks(job, timeout=240)):
        assert "error" not in r, r.get("error")
        if job is _mixtral_per_expert_job:
            assert r["experts"] == [str(2 * rank), str(2 * rank + 1)] and r["stacked_rows"] == []
        else:  # only this rank's experts were loaded
            assert r["experts"] == [] and r["stacked_rows"] == [2]
        assert r["all_reduce"] == 2 * layers + 1  # after each attention and each MoE, and the embedding


class _BiasedExperts(torch.nn.Module):
    """Three biased experts of 8 hidden features over 6 channels, top-2 routing given as inputs:
    a ``torch_moe`` with every per-expert list filled, for the split inside the experts."""

    def __init__(self, experts: int = 3, dim: int = 6, hidden: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def params(*shape):
            return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.5)
                                           for _ in range(experts)])

        self.gate, self.up, self.down = params(hidden, dim), params(hidden, dim), params(dim, hidden)
        self.gate_b, self.up_b, self.down_b = params(hidden), params(hidden), params(dim)

    def forward(self, x, sel, w):
        return ad.torch_moe.default(x, sel, w, list(self.gate), list(self.up), list(self.down), list(self.gate_b),
                            list(self.up_b), list(self.down_b))


def test_inside_the_experts_each_rank_computes_its_share_and_rank_zero_adds_the_down_biases():
    """One process, both ranks' graphs: each holds its slice of every expert (the checkpoint slice
    the executor records), rank 1 drops the down biases, and the two partial outputs (what the
    all-reduce sums) add up to the unsplit MoE, biases included."""
    from autodeploy.transform.library._sharding import ExpertTensorShard
    from autodeploy.transform.library.sharding_transform_executor import execute

    module = _BiasedExperts().eval()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    sel = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0]])
    w = torch.softmax(torch.randn(5, 2, generator=torch.Generator().manual_seed(2)), dim=-1)
    expected = module(x, sel, w)
    parts = []
    for rank in (0, 1):
        gm = torch.fx.symbolic_trace(copy.deepcopy(module))
        moe = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_moe.default)
        plan = ShardingPlan(world_size=2, rank=rank)
        assert plan_moe(gm, moe, plan)  # 3 experts over 2 ranks: split inside
        (decision,) = plan.decisions
        assert isinstance(decision, ExpertTensorShard) and len(decision.down_bias) == 3
        shards = execute(gm, plan)
        for name, tensor in gm.named_parameters():  # load each rank's checkpoint slice
            whole = dict(module.named_parameters())[name]
            tensor.data = shards[name].take(whole.detach()).clone() if name in shards else whole.detach().clone()
        held = {n for n, _ in gm.named_parameters()}
        assert any(n.startswith("down_b.") for n in held) == (rank == 0)
        with torch.no_grad():
            parts.append(gm(x, sel, w))
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-6)


class _StackedExperts(torch.nn.Module):
    """Four experts stacked ([E, 2I, H] gate/up, [E, H, I] down, biased) over 6 channels, top-2
    routing given as inputs: a ``torch_moe_fused`` of stored stacked tensors."""

    def __init__(self, experts: int = 4, dim: int = 6, hidden: int = 8, computed: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up = torch.nn.Parameter(torch.randn(experts, 2 * hidden, dim, generator=g) * 0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, dim, hidden, generator=g) * 0.5)
        self.gate_up_b = torch.nn.Parameter(torch.randn(experts, 2 * hidden, generator=g) * 0.5)
        self.down_b = torch.nn.Parameter(torch.randn(experts, dim, generator=g) * 0.5)
        self.computed = computed

    def forward(self, x, sel, w):
        gate_up = self.gate_up * 1.0 if self.computed else self.gate_up
        return ad.torch_moe_fused.default(x, sel, w, gate_up, self.down, self.gate_up_b, self.down_b, "silu", 1.0, 0.0)


def _moe_inputs(experts: int):
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    sel = torch.randint(0, experts, (5, 2), generator=torch.Generator().manual_seed(3))
    w = torch.softmax(torch.randn(5, 2, generator=torch.Generator().manual_seed(2)), dim=-1)
    return x, sel, w


def test_stacked_experts_each_rank_holds_its_rows_and_the_partial_outputs_add_up():
    """One process, both ranks' graphs: each holds rows [2r, 2r+2) of every stacked tensor (the
    checkpoint slice the executor records), routes the other pairs nowhere, and the two partial
    outputs (what the all-reduce sums) add up to the unsplit MoE."""
    from autodeploy.transform.library.detect_sharding import plan_stacked_moe
    from autodeploy.transform.library.sharding_transform_executor import execute

    module = _StackedExperts().eval()
    inputs = _moe_inputs(4)
    expected = module(*inputs)
    parts = []
    for rank in (0, 1):
        gm = torch.fx.symbolic_trace(copy.deepcopy(module))
        moe = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_moe_fused.default)
        plan = ShardingPlan(world_size=2, rank=rank)
        assert plan_stacked_moe(gm, moe, plan)
        (decision,) = plan.decisions
        assert isinstance(decision, ExpertShard) and (decision.start, decision.end) == (2 * rank, 2 * rank + 2)
        assert sorted(decision.stacked) == ["down", "down_b", "gate_up", "gate_up_b"] and not decision.dropped
        shards = execute(gm, plan)
        assert sorted(shards) == sorted(decision.stacked)
        for name, tensor in gm.named_parameters():  # load each rank's checkpoint slice
            tensor.data = shards[name].take(dict(module.named_parameters())[name].detach()).clone()
            assert tensor.shape[0] == 2
        assert count_op(gm, ad.torch_dist_all_reduce) == 1
        gm.graph.eliminate_dead_code()
        # without a process group, the all-reduce of one rank is its own partial output
        with torch.no_grad():
            parts.append(gm(*inputs))
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-6)


def test_stacked_experts_left_whole_when_not_splittable():
    """Three experts over two ranks, or stacked weights computed in the graph: no decision (each
    rank keeps the whole MoE, which is correct)."""
    from autodeploy.transform.library.detect_sharding import plan_stacked_moe

    for module in (_StackedExperts(experts=3), _StackedExperts(computed=True)):
        gm = torch.fx.symbolic_trace(module)
        moe = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_moe_fused.default)
        plan = ShardingPlan(world_size=2, rank=0)
        assert not plan_stacked_moe(gm, moe, plan) and plan.decisions == []
