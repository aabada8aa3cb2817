"""``apply_sharding_hints``: a model whose graph states its own sharding (``torch_linear_with_hint``).

One process: the hint op is ``F.linear`` and rejects a mode that means nothing; the transform
matches every hinted linear and, at world size 1, only lowers it to ``aten.linear``; at world
sizes 2 and 4 the hints give the very plan objects ``detect_sharding`` gives the HF Llama (one
path: the same ``ColumnShard`` / ``RowShard``, key/value heads replicated by
``tp_min_local_shape``), the MoE model's experts get ``ExpertShard``, and the executor inserts the
all-reduces and the all-gather. Near misses: ``shard_layers`` without "mlp" leaves the MLP whole,
a ``tp_min_local_shape`` above the local slice replicates, sizes the world size does not split
are an error naming those that work. Two real gloo ranks: the dense and the MoE model at world
size 2 give the logits and greedy tokens of world size 1 and of HF eager on the same weights.
"""

import copy
import functools
import glob
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.library._sharding import (SHARDING_HINTS_META, ColumnShard, ExpertShard, RowShard,
                                                    ShardingPlan, SwigluShard)
from autodeploy.transform.library.apply_sharding_hints import column_split, lower_hints, plan_hints
from autodeploy.transform.library.detect_sharding import detect
from autodeploy.transform.library.sharding_transform_executor import execute
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.errors import ConfigError
from helpers import TINY, build, count_op, family_checkpoint, graph_logits, hf_model, moe_family_checkpoint, rel_rmse
from sharding_hint_models import registered
from test_collectives import _run_ranks

ad = torch.ops.autodeploy
aten = torch.ops.aten
LAYERS = TINY["num_hidden_layers"]
HINTS_DENSE = 7 * LAYERS + 1  # q, k, v, o, gate, up, down per layer + the LM head
HINTS_MOE = 5 * LAYERS + 1  # q, k, v, o, router per layer + the LM head
PROMPTS = [[3, 17, 29, 41, 5], [7, 8, 9]]


def _checkpoint(config_class: str) -> str:
    return family_checkpoint("llama") if config_class == "LlamaConfig" else moe_family_checkpoint("mixtral")


@functools.lru_cache(maxsize=None)
def _pattern_graph(config_class: str) -> fx.GraphModule:
    """The hinted model's graph as the sharding stage receives it (parameters on meta)."""
    with registered(config_class):
        return build(_checkpoint(config_class), up_to=Stage.PATTERN_MATCHER).graph_module


@functools.lru_cache(maxsize=None)
def _hf_graph() -> fx.GraphModule:
    """HF Llama's graph on the same checkpoint, for detect_sharding (which only reads it)."""
    return build(family_checkpoint("llama"), up_to=Stage.PATTERN_MATCHER).graph_module


@functools.lru_cache(maxsize=None)
def _one_rank(config_class: str) -> Any:
    """The hinted model built at world size 1 up to its weights (read, never changed, by the tests)."""
    return _hinted_build(config_class, 1)


def _hinted_plan(config_class: str, world: int, rank: int,
                 shard_layers: Optional[List[str]] = None) -> Tuple[fx.GraphModule, ShardingPlan]:
    gm = copy.deepcopy(_pattern_graph(config_class))
    plan = ShardingPlan(world_size=world, rank=rank)
    plan_hints(gm, lower_hints(gm), plan, shard_layers)
    return gm, plan


def _keys(decisions) -> set:
    """Decisions without their node names (graph-specific): what is split and how."""
    return {(type(d).__name__, d.weight, d.bias, getattr(d, "parts", None), getattr(d, "index", None),
             getattr(d, "gather", False)) for d in decisions if isinstance(d, (ColumnShard, RowShard))}


# ---- the op ---------------------------------------------------------------------------------------
def test_the_hint_op_is_a_linear_and_names_the_modes_it_allows():
    x, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(ad.torch_linear_with_hint(x, w, b, "colwise", 2, "mlp"), F.linear(x, w, b))
    assert torch.equal(ad.torch_linear_with_hint(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match=r"tp_mode 'column' is not one of \['none', 'colwise', 'rowwise', "
                                         r"'colwise_gather'\]"):
        ad.torch_linear_with_hint(x, w, None, "column")


# ---- (a) matches, and world size 1 --------------------------------------------------------------
def test_world_size_one_lowers_every_hint_to_a_plain_linear_and_matches_hf():
    assert count_op(_pattern_graph("LlamaConfig"), ad.torch_linear_with_hint) == HINTS_DENSE
    checkpoint = _checkpoint("LlamaConfig")
    result = _one_rank("LlamaConfig")
    gm = result.graph_module
    history = {r.key: r for r in result.context.history}
    assert history["apply_sharding_hints"].status == "ok"
    assert history["apply_sharding_hints"].num_matches == HINTS_DENSE
    assert history["detect_sharding"].status == "skipped" and result.context.sharding_plan is None
    assert count_op(gm, ad.torch_linear_with_hint) == 0 and count_op(gm, aten.linear) == HINTS_DENSE
    assert count_op(gm, ad.torch_dist_all_reduce) == 0 and gm.meta[SHARDING_HINTS_META]
    ids = torch.randint(0, TINY["vocab_size"], (2, 6))
    assert rel_rmse(graph_logits(gm, ids), graph_logits(hf_model(checkpoint), ids)) < 1e-5


# ---- (b) the plan: the objects detection makes, applied by the one executor ----------------------
@pytest.mark.parametrize("world", [2, 4])
def test_hints_give_the_plan_detection_gives(world):
    hf_gm = _hf_graph()
    for rank in range(world):
        gm, plan = _hinted_plan("LlamaConfig", world, rank)
        detected = detect(hf_gm, world_size=world, rank=rank)
        assert count_op(gm, ad.torch_linear_with_hint) == 0
        attention_and_head = [d for d in plan.decisions if ".mlp." not in d.weight]
        assert _keys(attention_and_head) == _keys(detected.decisions)  # q/k/v, o, LM head: identical
        # the MLP: gate/up column, down row, the same split detection's SwigluShard makes
        mlp = {(d.gate, d.up, d.down) for d in detected.decisions if isinstance(d, SwigluShard)}
        assert {(d.weight,) for d in plan.decisions if ".mlp." in d.weight and isinstance(d, RowShard)} == \
            {(down,) for _, _, down in mlp}
        assert {d.weight for d in plan.decisions if ".mlp." in d.weight and isinstance(d, ColumnShard)} == \
            {w for gate, up, _ in mlp for w in (gate, up)}
        kv = [d for d in plan.decisions if "k_proj" in d.weight or "v_proj" in d.weight]
        # 2 key/value heads of 16 (tp_min_local_shape) over 4 ranks: each head replicated on two ranks
        assert all((d.parts, d.index) == ((None, None) if world == 2 else (2, rank // 2)) for d in kv)
        assert plan.layout_fixes == {}  # the model's views use -1


def test_the_executor_inserts_the_collectives_the_hints_ask_for():
    gm, plan = _hinted_plan("LlamaConfig", 2, 1)
    shards = execute(gm, plan)
    assert count_op(gm, ad.torch_dist_all_reduce) == 2 * LAYERS  # after o and after down
    assert count_op(gm, ad.torch_dist_all_gather) == 1  # the vocab-parallel LM head
    q = gm.get_parameter("model.layers.0.self_attn.q_proj.weight")
    down = gm.get_parameter("model.layers.0.mlp.down_proj.weight")
    assert tuple(q.shape) == (TINY["num_attention_heads"] * TINY["head_dim"] // 2, TINY["hidden_size"])
    assert tuple(down.shape) == (TINY["hidden_size"], TINY["intermediate_size"] // 2)
    assert (shards["model.layers.0.mlp.down_proj.weight"].dim, shards["lm_head.weight"].index) == (1, 1)


def test_the_moe_model_splits_whole_experts_and_keeps_its_router():
    for rank in (0, 1):
        gm, plan = _hinted_plan("MixtralConfig", 2, rank)
        experts = [d for d in plan.decisions if isinstance(d, ExpertShard)]
        assert [(d.start, d.end) for d in experts] == [(2 * rank, 2 * rank + 2)] * LAYERS
        assert not any("block_sparse_moe.gate" in getattr(d, "weight", "") for d in plan.decisions)
        assert sum(isinstance(d, RowShard) for d in plan.decisions) == LAYERS  # o only
        execute(gm, plan)
        assert count_op(gm, ad.torch_dist_all_reduce) == 2 * LAYERS  # after each attention and each MoE
    _, plan = _hinted_plan("MixtralConfig", 2, 0, shard_layers=["attention", "lm_head"])
    assert not any(isinstance(d, ExpertShard) for d in plan.decisions)  # near miss: "moe" not listed


# ---- (d) near misses ------------------------------------------------------------------------------
def test_shard_layers_without_mlp_leaves_the_mlp_whole():
    """Through the transforms themselves (rank 0 of 2; planning needs no process group): the
    config field reaches the plan, and detect_sharding does not split what the hints left whole."""
    gm = copy.deepcopy(_pattern_graph("LlamaConfig"))
    ctx = PipelineContext(world_size=2, rank=0)
    for key, config in (("apply_sharding_hints", {"shard_layers": ["attention", "lm_head"]}),
                        ("detect_sharding", {}), ("sharding_transform_executor", {})):
        gm = build_transform(key, config)(gm, ctx)
    history = {r.key: r for r in ctx.history}
    assert history["apply_sharding_hints"].num_matches == HINTS_DENSE
    assert history["detect_sharding"].status == "skipped" and "hints" in history["detect_sharding"].error
    plan = ctx.sharding_plan
    assert not any(".mlp." in d.weight for d in plan.decisions)
    assert sum(isinstance(d, ColumnShard) for d in plan.decisions) == 3 * LAYERS + 1
    assert count_op(gm, ad.torch_dist_all_reduce) == LAYERS  # after o only
    assert "model.layers.0.mlp.down_proj.weight" not in ctx.weight_shards
    assert tuple(gm.get_parameter("model.layers.0.mlp.down_proj.weight").shape) == \
        (TINY["hidden_size"], TINY["intermediate_size"])


def test_a_min_local_shape_above_the_local_slice_replicates():
    # 32 features (2 heads of 16): world size 4 would leave 8 a rank, so 2 slices, 2 ranks each
    assert [column_split(32, 16, 4, r, "k", gather=False) for r in range(4)] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert column_split(16, 16, 2, 1, "k", gather=False) is None  # one head: whole on every rank
    assert column_split(32, 64, 2, 0, "k", gather=False) is None
    assert column_split(32, 8, 2, 0, "k", gather=False) == (None, None)  # divides: the rank's share
    with pytest.raises(ConfigError, match=r"100 output features .* that work: \[1, 2, 4, 5, 10, 20, 25, 50\]"):
        column_split(100, 1, 8, 0, "lm head", gather=True)  # a gather cannot repeat slices


def test_sizes_the_world_size_does_not_split_are_an_error_naming_those_that_do():
    with pytest.raises(ConfigError, match=r"which world_size 3 does not split.*world sizes that work: \[1, 2"):
        _hinted_plan("LlamaConfig", 3, 0)
    # o_proj keeps whole heads (tp_min_local_shape 16): 64 input features split at most 4 ways
    with pytest.raises(ConfigError, match=r"o_proj.*64 input features \(at least 16 a rank\).*\[1, 2, 4\]"):
        _hinted_plan("LlamaConfig", 8, 0)


def test_a_hint_mode_that_means_nothing_is_an_error_naming_the_modes():
    gm = copy.deepcopy(_pattern_graph("LlamaConfig"))
    node = next(n for n in gm.graph.nodes if n.target == ad.torch_linear_with_hint.default)
    node.args = (*node.args[:3], "columnwise", *node.args[4:])
    with pytest.raises(ConfigError, match=r"tp_mode 'columnwise' is not one of \['none', 'colwise', 'rowwise', "
                                          r"'colwise_gather'\]"):
        lower_hints(gm)


# ---- (c) numerics on two gloo ranks ---------------------------------------------------------------
def _greedy(gm: Any, prompt: List[int], steps: int = 4) -> List[int]:
    """Greedy tokens by recomputing the whole sequence each step (the uncached graph)."""
    ids = torch.tensor([prompt])
    for _ in range(steps):
        ids = torch.cat([ids, graph_logits(gm, ids)[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


def _outputs(gm: Any) -> Dict[str, Any]:
    ids = torch.randint(0, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    return {"logits": graph_logits(gm, ids), "tokens": [_greedy(gm, p) for p in PROMPTS]}


def _hinted_build(config_class: str, world: int, **overrides: Any) -> Any:
    with registered(config_class):
        return build(_checkpoint(config_class), up_to=Stage.WEIGHT_LOAD, world_size=world,
                     overrides={"apply_sharding_hints": overrides} if overrides else None)


def _two_rank_job(rank: int) -> Dict[str, Any]:
    from safetensors.torch import load_file

    out: Dict[str, Any] = {}
    dense = _hinted_build("LlamaConfig", 2).graph_module
    full = load_file(glob.glob(os.path.join(_checkpoint("LlamaConfig"), "*.safetensors"))[0])
    q = dense.get_parameter("model.layers.0.self_attn.q_proj.weight")
    rows = q.shape[0]
    out["dense"] = {**_outputs(dense), "q_slice": torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"]
                                                               [rank * rows:(rank + 1) * rows]),
                    "all_reduce": count_op(dense, ad.torch_dist_all_reduce),
                    "all_gather": count_op(dense, ad.torch_dist_all_gather),
                    "hints": count_op(dense, ad.torch_linear_with_hint)}
    moe = _hinted_build("MixtralConfig", 2).graph_module
    experts = sorted({n.split(".experts.")[1].split(".")[0] for n, _ in moe.named_parameters() if ".experts." in n})
    out["moe"] = {**_outputs(moe), "experts": experts, "all_reduce": count_op(moe, ad.torch_dist_all_reduce)}
    return {k: {n: v.tolist() if isinstance(v, torch.Tensor) else v for n, v in d.items()} for k, d in out.items()}


@pytest.mark.slow  # ~25-50 s on 2 cores: two ranks each build both hinted models
@pytest.mark.distributed
def test_two_ranks_give_the_logits_and_greedy_tokens_of_one_rank_and_of_hf():
    results = _run_ranks(_two_rank_job, timeout=240)
    for r in results:
        assert "error" not in r, r.get("error")
    for config_class, key in (("LlamaConfig", "dense"), ("MixtralConfig", "moe")):
        one = _outputs(_one_rank(config_class).graph_module)
        hf = hf_model(_checkpoint(config_class))
        ids = torch.randint(0, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
        assert rel_rmse(one["logits"], graph_logits(hf, ids)) < 1e-5  # the ids _outputs feeds
        with torch.no_grad():
            hf_tokens = [hf.generate(torch.tensor([p]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                     attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        assert one["tokens"] == hf_tokens, config_class
        for rank, r in enumerate(results):
            got = r[key]
            assert rel_rmse(torch.tensor(got["logits"]), one["logits"]) < 1e-5, (config_class, rank)
            assert got["tokens"] == hf_tokens, (config_class, rank)
        if key == "moe":
            assert [r["moe"]["experts"] for r in results] == [["0", "1"], ["2", "3"]]
            assert all(r["moe"]["all_reduce"] == 2 * LAYERS for r in results)
    for r in results:
        assert r["dense"]["q_slice"] and r["dense"]["hints"] == 0
        assert (r["dense"]["all_reduce"], r["dense"]["all_gather"]) == (2 * LAYERS, 1)
