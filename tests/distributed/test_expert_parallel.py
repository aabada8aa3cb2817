"""Expert parallelism: detect_sharding splits each ``torch_moe`` by whole experts, the executor keeps
this rank's block (and loads only its weights), routes the other ranks' pairs nowhere and
all-reduces the partial outputs.

One process: the plan for Mixtral at world size 2, and at 3, which divides neither its 4 experts
nor their 128 hidden features: an error naming the world sizes that work. Two real gloo ranks (``-m slow``): Mixtral's and Qwen3-MoE's logits at
world size 2 equal HF eager's at two shapes, each rank holding two of the four experts.
"""

import pytest
import torch

from autodeploy.transform.interface import Stage
from autodeploy.transform.library._sharding import ExpertShard, ShardingPlan
from autodeploy.transform.library.detect_sharding import detect, plan_moe
from autodeploy.utils.errors import ConfigError
from helpers import MOE_FAMILIES, MOE_LAYERS, build, count_op, moe_family_checkpoint
from test_collectives import _run_ranks

ad = torch.ops.autodeploy


def test_plan_splits_whole_experts_when_the_world_size_divides_them():
    gm = build(moe_family_checkpoint("mixtral"), up_to=Stage.PATTERN_MATCHER).graph_module
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
        assert r["all_reduce"] == 2 * layers  # after each attention and each MoE
