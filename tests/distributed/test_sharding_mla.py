"""Tensor parallelism of multi-head latent attention (``torch_mla``, DeepSeek-V3's attention).

One process (the plan): each MLA layer splits its query projection by output features,
``kv_b_proj``'s weight by its per-head rows and the output projection by input features; the
latent projection (``kv_a_proj_with_mqa``) stays whole; a query with another reader leaves the
layer whole (near miss); heads the world size does not divide are an error naming the sizes that
do. Per-head sinks (HY-V4) are split with their heads, and sinks computed in the graph leave the layer
whole. Two real gloo ranks (``-m slow``): a tiny DeepSeek-V3 (MLA + expert-parallel MoE + shared
expert) gives HF's logits at two shapes and, through ``LLM`` with the latent cache, HF's greedy
tokens; so does a tiny HY-V4 (sparse attention with top-k 4, sinks, a per-head output gate, all split
by heads) through ``LLM``.
"""

import copy
from typing import Any, Dict

import pytest
import torch

from autodeploy.transform.interface import Stage
from autodeploy.transform.library._sharding import ColumnShard, HeadWeightShard, RowShard, ShardingPlan
from autodeploy.transform.library.detect_sharding import detect, plan_mla
from autodeploy.utils.errors import ConfigError
from helpers import build, count_op, hf_greedy_tokens, moe_family_checkpoint
from test_collectives import _run_ranks
from test_sharding_quantized import NEW, PROMPTS, _tokens

ad = torch.ops.autodeploy


_GRAPH = []


def _graph():
    """The pattern-matched DeepSeek-V3 graph, built once per process; each test gets its own copy."""
    if not _GRAPH:
        _GRAPH.append(build(moe_family_checkpoint("deepseek_v3"), up_to=Stage.PATTERN_MATCHER).graph_module)
    return copy.deepcopy(_GRAPH[0])


def test_mla_splits_by_heads_and_keeps_the_latent_whole():
    gm = _graph()
    plan = detect(gm, world_size=2, rank=1)
    layers = 2
    kv_b = [d for d in plan.decisions if isinstance(d, HeadWeightShard)]
    assert [d.weight for d in kv_b] == [f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in range(layers)]
    split = {d.weight for d in plan.decisions if isinstance(d, (ColumnShard, RowShard))}
    for i in range(layers):
        assert {f"model.layers.{i}.self_attn.q_b_proj.weight", f"model.layers.{i}.self_attn.o_proj.weight"} <= split
    rows = {d.weight for d in plan.decisions if isinstance(d, RowShard)}
    assert "model.layers.0.self_attn.o_proj.weight" in rows
    # the latent and everything before q_b_proj's split stay whole on every rank
    assert not any("kv_a_proj" in w or "q_a_proj" in w for w in split)


def test_a_query_with_another_reader_leaves_the_layer_whole():
    gm = _graph()
    q_b = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default
               and "layers_0_self_attn_q_b_proj" in n.args[1].name)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        extra = gm.graph.call_function(torch.ops.aten.sum.default, (q_b,))
    output.args = ((output.args[0][0] if isinstance(output.args[0], tuple) else output.args[0], extra),)
    mla = [n for n in gm.graph.nodes if n.target == ad.torch_mla.default]
    assert not plan_mla(gm, mla[0], ShardingPlan(world_size=2, rank=0))
    assert plan_mla(gm, mla[1], ShardingPlan(world_size=2, rank=0))


def _with_sinks(gm, mla, computed: bool = False):
    """Hands ``mla`` per-head sinks: a stored ``[4]`` weight, or (``computed``) that weight doubled."""
    gm.register_parameter("sinks_0", torch.nn.Parameter(torch.zeros(4), requires_grad=False))
    with gm.graph.inserting_before(mla):
        sinks = gm.graph.get_attr("sinks_0")
        if computed:
            sinks = gm.graph.call_function(torch.ops.aten.mul.Tensor, (sinks, 2.0))
    mla.args = (*mla.args[:7], None, sinks)


def test_sinks_split_with_their_heads_and_computed_sinks_leave_the_layer_whole():
    gm = _graph()
    mla = next(n for n in gm.graph.nodes if n.target == ad.torch_mla.default)
    _with_sinks(gm, mla)
    plan = ShardingPlan(world_size=2, rank=1)
    assert plan_mla(gm, mla, plan)
    assert [d.weight for d in plan.decisions if isinstance(d, HeadWeightShard)] == [
        "model.layers.0.self_attn.kv_b_proj.weight", "sinks_0"]
    gm = _graph()
    mla = next(n for n in gm.graph.nodes if n.target == ad.torch_mla.default)
    _with_sinks(gm, mla, computed=True)
    plan = ShardingPlan(world_size=2, rank=1)
    assert not plan_mla(gm, mla, plan) and plan.decisions == []


def test_heads_the_world_size_does_not_divide_are_an_error():
    gm = _graph()
    mla = next(n for n in gm.graph.nodes if n.target == ad.torch_mla.default)
    with pytest.raises(ConfigError, match=r"has 4 heads, which world_size 3 does not divide; world sizes that split "
                                          r"them: \[1, 2, 4\]"):
        plan_mla(gm, mla, ShardingPlan(world_size=3, rank=0))


def _graph_job(rank: int) -> Dict[str, Any]:
    from helpers import assert_matches_hf

    checkpoint = moe_family_checkpoint("deepseek_v3")
    gm = build(checkpoint, up_to=Stage.WEIGHT_LOAD, world_size=2).graph_module
    torch.manual_seed(0)
    assert_matches_hf(gm, checkpoint, shapes=((1, 5), (2, 3)))
    params = dict(gm.named_parameters())
    return {"kv_b": list(params["model.layers.0.self_attn.kv_b_proj.weight"].shape),
            "kv_a": list(params["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape),
            "all_reduce": count_op(gm, ad.torch_dist_all_reduce)}


@pytest.mark.slow  # ~30 s on 2 cores: two ranks build DeepSeek-V3 and run HF
@pytest.mark.distributed
def test_two_ranks_of_deepseek_v3_match_hf_logits_and_greedy_tokens():
    checkpoint = moe_family_checkpoint("deepseek_v3")
    for r in _run_ranks(_graph_job, world=2, timeout=300):
        assert "error" not in r, r.get("error")
        # 4 heads of (8 nope + 16 v) rows: 2 heads a rank; the latent projection whole
        assert r["kv_b"] == [48, 32] and r["kv_a"] == [40, 64]
    assert _tokens(checkpoint, 2) == hf_greedy_tokens(checkpoint, PROMPTS, NEW)


def _hy_v4_checkpoint() -> str:
    from autodeploy.coverage.configs import tiny_config
    from helpers import _cached_checkpoint

    config = tiny_config("hy_v4", "a")
    config["index_topk"] = 4  # sparse at these lengths
    return _cached_checkpoint("dsa-sparse-hy_v4", config)  # the one test_dsa_generation_vs_hf writes


def test_hy_v4_attention_splits_with_its_sinks_and_output_gate():
    """HY-V4's MLA layers: query projection, kv_b_proj, sinks, output gate (``sigmoid(gate_proj(x))``
    times the attention output, per head) and output projection split by heads; the indexer stays
    whole (every rank selects the same keys)."""
    gm = build(_hy_v4_checkpoint(), up_to=Stage.PATTERN_MATCHER).graph_module
    plan = detect(gm, world_size=2, rank=1)
    layers = 3
    heads = {d.weight for d in plan.decisions if isinstance(d, HeadWeightShard)}
    columns = {d.weight for d in plan.decisions if isinstance(d, ColumnShard)}
    rows = {d.weight for d in plan.decisions if isinstance(d, RowShard)}
    for i in range(layers):
        prefix = f"model.layers.{i}.self_attn."
        assert {prefix + "kv_b_proj.weight", prefix + "learnable_sink_param"} <= heads
        assert {prefix + "q_b_proj.weight", prefix + "linear_gate.weight"} <= columns
        assert prefix + "o_proj.weight" in rows
    assert not any("indexer" in w for w in columns | rows | heads)


def test_an_output_gate_broadcast_over_the_heads_leaves_the_layer_whole():
    """Near miss: the same gate reduced to one value per token (``[b, s, 1, d]``, shared by every
    head) is not split with the heads, so the layer stays whole."""
    gm = build(_hy_v4_checkpoint(), up_to=Stage.PATTERN_MATCHER).graph_module
    mla = next(n for n in gm.graph.nodes if n.target == ad.torch_mla.default)
    mul = next(iter(mla.users))
    gate = next(a for a in mul.args if a is not mla)
    with gm.graph.inserting_before(mul):
        shared = gm.graph.call_function(torch.ops.aten.mean.dim, (gate, [2], True))
    shared.meta["val"] = gate.meta["val"].mean(2, keepdim=True)
    mul.args = tuple(shared if a is gate else a for a in mul.args)
    assert not plan_mla(gm, mla, ShardingPlan(world_size=2, rank=0))


def _hy_v4_job(rank: int) -> Dict[str, Any]:
    from autodeploy import LLM, SamplingParams

    llm = LLM(_hy_v4_checkpoint(), world_size=2, max_seq_len=64, max_batch_size=4, max_num_tokens=64)
    prefix = "model.layers.0.self_attn."
    shapes = {k[len(prefix):]: list(v.shape) for k, v in (*llm.build.graph_module.named_parameters(),
                                                           *llm.build.graph_module.named_buffers())
              if k.startswith(prefix) and "norm" not in k}
    if not llm.is_driver:
        llm.follow()
        return {"shapes": shapes}
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                       SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    llm.shutdown()
    return {"shapes": shapes, "tokens": [list(o.outputs[0].token_ids) for o in out]}


@pytest.mark.slow  # ~40 s on 2 cores: two ranks build HY-V4, then HF
@pytest.mark.distributed
def test_two_ranks_of_hy_v4_give_hfs_greedy_tokens():
    checkpoint = _hy_v4_checkpoint()
    results = _run_ranks(_hy_v4_job, world=2, timeout=400)
    for r in results:
        assert "error" not in r, r.get("error")
        # 4 heads, 2 a rank. The linears reading the layer input are fused into one GEMM after
        # sharding: q_a 32 + kv_a 40 + indexer wk 16 + weights_proj 2 (whole) + the gate's 2 heads x 16
        # = 122 rows (154 on one rank); q_b's 2 heads x 24 + the indexer's wq_b 32 (whole) = 80
        assert r["shapes"] == {"learnable_sink_param": [2], "kv_b_proj.weight": [64, 32], "o_proj.weight": [64, 32],
                               "fused_q_a_proj_kv_a_proj_with_mqa_wk_linear_gate_weights_proj": [122, 64],
                               "fused_q_b_proj_wq_b": [80, 32]}
    assert results[0]["tokens"] == hf_greedy_tokens(checkpoint, PROMPTS, NEW)
