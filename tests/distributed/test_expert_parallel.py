"""Expert parallelism: detect_sharding splits each ``torch_moe`` by whole experts, the executor keeps
this rank's block (and loads only its weights), routes the other ranks' pairs nowhere and
all-reduces the partial outputs.

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

# a sharded build exports experts per expert; these plan a world-size-1 build for other world sizes
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


def _ep_job(rank: int, family: str):
    from helpers import assert_matches_hf

    checkpoint = moe_family_checkpoint(family)
    gm = build(checkpoint, up_to=Stage.WEIGHT_LOAD, world_size=2).graph_module
    torch.manual_seed(0)  # every rank feeds the same tokens
    assert_matches_hf(gm, checkpoint, shapes=((1, 5), (2, 3)))
    experts = sorted({n.split(".experts.")[1].split(".")[0] for n, _ in gm.named_parameters() if ".experts." in n})
    return {"experts": experts, "all_reduce": count_op(gm, ad.torch_dist_all_reduce)}


def _mixtral_job(rank: int):
    return _ep_job(rank, "mixtral")


def _qwen3_moe_job(rank: int):
    return _ep_job(rank, "qwen3_moe")


@pytest.mark.slow  # ~20 s each on 2 cores: two ranks build the model and run HF
@pytest.mark.distributed
@pytest.mark.parametrize("job", [_mixtral_job, _qwen3_moe_job], ids=["mixtral", "qwen3_moe"])
def test_two_ranks_hold_half_the_experts_and_match_hf(job):
    layers = MOE_FAMILIES["mixtral"]["num_hidden_layers"]
    for rank, r in enumerate(_run_ranks(job, timeout=240)):
        assert "error" not in r, r.get("error")
        assert r["experts"] == [str(2 * rank), str(2 * rank + 1)]  # only this rank's experts were loaded
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
