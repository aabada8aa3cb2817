"""Tensor parallelism: detect_sharding + sharding_transform_executor + per-rank weight loading.

One process: the plan on a tiny Llama (what is split, what is left replicated, sizes that do not
divide). Two real gloo ranks: each rank's graph holds half of every sharded weight (the
checkpoint's own slice), its logits equal HF eager at two shapes, and generation through ``LLM``
at world size 2 (paged KV cache split by heads) gives HF's greedy tokens.
"""

import pytest
import torch

from autodeploy.transform.interface import Stage
from autodeploy.transform.library._sharding import ColumnShard, RowShard, SwigluShard
from autodeploy.transform.library.detect_sharding import detect
from autodeploy.utils.errors import ConfigError
from helpers import TINY, build, count_op, family_checkpoint
from test_collectives import _run_ranks

ad = torch.ops.autodeploy


def test_plan_splits_attention_by_heads_and_the_mlp_and_leaves_the_rest():
    gm = build(family_checkpoint("llama"), up_to=Stage.PATTERN_MATCHER).graph_module
    plan = detect(gm, world_size=2, rank=1)
    kinds = [type(d) for d in plan.decisions]
    layers = TINY["num_hidden_layers"]
    assert kinds.count(ColumnShard) == 3 * layers and kinds.count(RowShard) == layers
    assert kinds.count(SwigluShard) == layers
    columns = {d.weight.rsplit(".", 2)[-2] for d in plan.decisions if isinstance(d, ColumnShard)}
    assert columns == {"q_proj", "k_proj", "v_proj"}
    assert {d.weight.rsplit(".", 2)[-2] for d in plan.decisions if isinstance(d, RowShard)} == {"o_proj"}
    # near misses: the LM head, the embedding and the norms stay whole on every rank
    planned = {w for d in plan.decisions for w in vars(d).values() if isinstance(w, str)}
    assert not any("lm_head" in w or "embed" in w or "norm" in w for w in planned)
    assert plan.layout_fixes == {}  # Llama splits heads with -1: nothing literal to divide


def test_sizes_the_world_size_does_not_divide_are_an_error_naming_those_that_do():
    gm = build(family_checkpoint("llama"), up_to=Stage.PATTERN_MATCHER).graph_module
    with pytest.raises(ConfigError, match=r"4 query and 2 key/value heads, which world_size 3 does not divide; "
                                          r"world sizes that split them: \[1, 2\]"):
        detect(gm, world_size=3, rank=0)


def test_world_size_one_skips_and_more_needs_a_group():
    result = build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD)
    history = {r.key: r for r in result.context.history}
    for key in ("detect_sharding", "sharding_transform_executor"):
        assert history[key].status.startswith("skipped") and history[key].num_matches == 0
    with pytest.raises(ConfigError, match="world_size 2 needs a torch.distributed group of 2 processes"):
        build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD, world_size=2)


def _graph_job(rank: int):
    from helpers import assert_matches_hf

    checkpoint = family_checkpoint("llama")
    gm = build(checkpoint, up_to=Stage.WEIGHT_LOAD, world_size=2).graph_module
    torch.manual_seed(0)  # every rank feeds the same tokens
    assert_matches_hf(gm, checkpoint, shapes=((1, 5), (3, 2)))
    from safetensors.torch import load_file
    import glob
    import os

    full = load_file(glob.glob(os.path.join(checkpoint, "*.safetensors"))[0])
    q = gm.get_parameter("model.layers.0.self_attn.q_proj.weight")
    down = gm.get_parameter("model.layers.1.mlp.down_proj.weight")
    rows, cols = q.shape[0], down.shape[1]
    return {
        "all_reduce": count_op(gm, ad.torch_dist_all_reduce),
        "q_slice": torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][rank * rows:(rank + 1) * rows]),
        "down_slice": torch.equal(down, full["model.layers.1.mlp.down_proj.weight"][:, rank * cols:(rank + 1) * cols]),
        "q_rows": rows, "down_cols": cols,
        "head_whole": tuple(gm.get_parameter("lm_head.weight").shape),
    }


@pytest.mark.distributed
def test_two_ranks_hold_their_slices_and_match_hf():
    for rank, r in enumerate(_run_ranks(_graph_job)):
        assert "error" not in r, r.get("error")
        assert r["all_reduce"] == 2 * TINY["num_hidden_layers"]  # after each attention and each MLP
        assert r["q_rows"] == TINY["num_attention_heads"] * TINY["head_dim"] // 2
        assert r["down_cols"] == TINY["intermediate_size"] // 2
        assert r["q_slice"] and r["down_slice"], f"rank {rank} loaded the wrong slice"
        assert r["head_whole"] == (TINY["vocab_size"], TINY["hidden_size"])


PROMPTS = [[3, 17, 29, 41, 5], [7, 8, 9]]


def _generate_job(rank: int):
    from autodeploy import LLM, SamplingParams

    # a fixed pool and batch size: every rank schedules the same steps (each sizes its own pool
    # from its own free memory otherwise; rank 0 driving the others is not built yet)
    llm = LLM(family_checkpoint("llama"), world_size=2, max_seq_len=64, max_batch_size=4, max_num_tokens=64,
              transforms={"initialize_cache": {"num_pages": 32}})
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    k_cache = llm.build.cache.caches[next(iter(llm.build.cache.caches))]
    from autodeploy.runtime.sampling_params import InvalidRequestError

    try:  # ranks that sample on their own must agree: an unseeded random request is refused
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2, temperature=0.8))
        refused = ""
    except InvalidRequestError as err:
        refused = str(err)
    return {"refused": refused,"tokens": [o.outputs[0].token_ids for o in out], "mode": llm.build.context.cache_mode,
            "kv_heads": int(k_cache.shape[2])}


@pytest.mark.slow  # ~10 s: two ranks each build and run the whole engine; the graph-level test stays default
@pytest.mark.distributed
def test_generation_at_world_size_two_gives_hfs_greedy_tokens():
    from helpers import hf_model

    hf = hf_model(family_checkpoint("llama"))
    expected = []
    for prompt in PROMPTS:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        expected.append(ids[0, len(prompt):].tolist())
    for r in _run_ranks(_generate_job):
        assert "error" not in r, r.get("error")
        assert r["mode"] == "paged_kv" and r["tokens"] == expected
        assert r["kv_heads"] == TINY["num_key_value_heads"] // 2  # each rank caches its own heads
        assert "at world_size 2 every rank samples on its own: give the request a seed" in r["refused"]


def test_a_projection_with_another_reader_is_left_whole():
    """Near miss: when the q projection's output also feeds something besides attention, that
    reader would see one rank's heads only, so the attention is not split at all."""
    gm = build(family_checkpoint("llama"), up_to=Stage.PATTERN_MATCHER).graph_module
    q_linear = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default
                    and "q_proj" in str(n.args[1].target) and "layers_0" in n.args[1].name)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        extra = gm.graph.call_function(torch.ops.aten.sum.default, (q_linear,))
    output.args = ((output.args[0][0] if isinstance(output.args[0], tuple) else output.args[0], extra),)
    plan = detect(gm, world_size=2, rank=0)
    split = {d.weight for d in plan.decisions if isinstance(d, (ColumnShard, RowShard))}
    assert not any("layers.0.self_attn" in w for w in split)  # layer 0's attention stays whole
    assert any("layers.1.self_attn.q_proj" in w for w in split)  # layer 1's is still split
