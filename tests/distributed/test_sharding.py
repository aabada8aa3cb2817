"""Tensor parallelism: detect_sharding + sharding_transform_executor + per-rank weight loading.

One process: the plan on a tiny Llama (what is split, what is left replicated, sizes that do not
divide). Two real gloo ranks: each rank's graph holds half of every sharded weight (the
checkpoint's own slice), its logits equal HF eager at two shapes, and generation through ``LLM``
at world size 2 (paged KV cache split by heads) gives HF's greedy tokens.
"""

import time

import pytest
import torch

from autodeploy.transform.interface import Stage
from autodeploy.transform.library._sharding import ColumnShard, EmbeddingShard, RowShard, SwigluShard
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
    assert kinds.count(ColumnShard) == 3 * layers + 1 and kinds.count(RowShard) == layers
    assert kinds.count(SwigluShard) == layers
    columns = {d.weight.rsplit(".", 2)[-2] for d in plan.decisions if isinstance(d, ColumnShard)}
    assert columns == {"q_proj", "k_proj", "v_proj", "lm_head"}
    assert {d.weight.rsplit(".", 2)[-2] for d in plan.decisions if isinstance(d, RowShard)} == {"o_proj"}
    # the LM head (untied) is split by vocabulary and gathered
    (head,) = [d for d in plan.decisions if isinstance(d, ColumnShard) and d.gather]
    assert head.weight == "lm_head.weight"
    # the embedding by vocabulary rows (rank 1 of 2: the second half); near miss: the norms stay whole
    (embedding,) = [d for d in plan.decisions if isinstance(d, EmbeddingShard)]
    assert (embedding.weight, embedding.start, embedding.end) == ("model.embed_tokens.weight", 256, 512)
    planned = {w for d in plan.decisions for w in vars(d).values() if isinstance(w, str)}
    assert not any("norm" in w for w in planned)
    # off: the whole table on every rank
    assert not any(isinstance(d, EmbeddingShard) for d in detect(gm, world_size=2, rank=1, embedding=False).decisions)
    assert plan.layout_fixes == {}  # Llama splits heads with -1: nothing literal to divide


def test_sizes_the_world_size_does_not_divide_are_an_error_naming_those_that_do():
    gm = build(family_checkpoint("llama"), up_to=Stage.PATTERN_MATCHER).graph_module
    with pytest.raises(ConfigError, match=r"4 query and 2 key/value heads, which world_size 3 does not split "
                                          r"\(query heads evenly, key/value heads evenly or replicated\); world sizes "
                                          r"that split them: \[1, 2, 4\]"):
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
        "head": tuple(gm.get_parameter("lm_head.weight").shape),
        "table": tuple(gm.get_parameter("model.embed_tokens.weight").shape),
        "table_slice": torch.equal(gm.get_parameter("model.embed_tokens.weight"),
                                   full["model.embed_tokens.weight"][rank * 256:(rank + 1) * 256]),
        "all_gather": count_op(gm, ad.torch_dist_all_gather),
    }


@pytest.mark.distributed
def test_two_ranks_hold_their_slices_and_match_hf():
    for rank, r in enumerate(_run_ranks(_graph_job)):
        assert "error" not in r, r.get("error")
        # after each attention and each MLP, and after the embedding's lookup
        assert r["all_reduce"] == 2 * TINY["num_hidden_layers"] + 1
        assert r["q_rows"] == TINY["num_attention_heads"] * TINY["head_dim"] // 2
        assert r["down_cols"] == TINY["intermediate_size"] // 2
        assert r["q_slice"] and r["down_slice"], f"rank {rank} loaded the wrong slice"
        assert r["head"] == (TINY["vocab_size"] // 2, TINY["hidden_size"])  # vocab-parallel LM head ...
        assert r["all_gather"] == 1  # ... whose logits are gathered
        assert r["table"] == (TINY["vocab_size"] // 2, TINY["hidden_size"]) and r["table_slice"]  # vocab-parallel


PROMPTS = [[3, 17, 29, 41, 5], [7, 8, 9]]


def _generate_job(rank: int):
    from autodeploy import LLM, SamplingParams
    from autodeploy.runtime.step_broadcast import StepSender

    # rank 0 schedules and samples; rank 1 runs the steps it sends. Rank 1's pool is smaller:
    # the group schedules within the smallest rank's.
    llm = LLM(family_checkpoint("llama"), world_size=2, max_seq_len=64, max_batch_size=4, max_num_tokens=64,
              transforms={"initialize_cache": {"num_pages": 32 if rank == 0 else 24}})
    k_cache = llm.build.cache.caches[next(iter(llm.build.cache.caches))]
    common = {"mode": llm.build.context.cache_mode, "kv_heads": int(k_cache.shape[2]), "driver": llm.is_driver}
    if not llm.is_driver:
        return {**common, "steps": llm.follow()}
    llm._sender.keepalive_s = 0.2  # idle between the calls below: keep-alives flow
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    time.sleep(1.0)
    # only rank 0 samples, so unseeded random sampling is fine at world size 2
    sampled = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 3, SamplingParams(max_tokens=4, temperature=1.0))
    steps = llm._sender.steps
    llm.shutdown()
    assert isinstance(llm._sender, StepSender)
    return {**common, "tokens": [o.outputs[0].token_ids for o in greedy], "steps": steps,
            "sampled": [len(o.outputs[0].token_ids) for o in sampled], "pages": llm.engine.pool.num_pages}


@pytest.mark.slow  # ~15 s: two ranks each build the whole engine; the graph-level test stays default
@pytest.mark.distributed
def test_rank_zero_drives_generation_at_world_size_two_and_gives_hfs_greedy_tokens():
    from helpers import hf_model

    hf = hf_model(family_checkpoint("llama"))
    expected = []
    for prompt in PROMPTS:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        expected.append(ids[0, len(prompt):].tolist())
    driver, follower = _run_ranks(_generate_job)
    for r in (driver, follower):
        assert "error" not in r, r.get("error")
        assert r["mode"] == "paged_kv"
        assert r["kv_heads"] == TINY["num_key_value_heads"] // 2  # each rank caches its own heads
    assert driver["driver"] and not follower["driver"]
    assert driver["tokens"] == expected
    assert driver["sampled"] == [4, 4, 4]
    assert follower["steps"] == driver["steps"] > 0  # the follower ran every step rank 0 ran, then left
    assert driver["pages"] == 24  # the smaller pool of the two ranks


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


class _GatedAttention(torch.nn.Module):
    """Attention whose output is gated per head, ``o * sigmoid(gate(x))`` before the output
    projection (``shared_gate``: one gate value per token and feature, broadcast over the heads;
    ``fused``: query and gate from one projection, chunked into ``[q | gate]`` before the view into
    heads, so its first half of features is all of q)."""

    def __init__(self, shared_gate: bool = False, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 64 if fused and i == 0 else 32, bias=False)
                                          for i in range(4))
        self.gate = torch.nn.Linear(32, 8 if shared_gate else 32, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        if self.fused:
            q, gate = self.q(x).chunk(2, dim=-1)
            q, gate = q.view(b, s, 4, 8), gate.view(b, s, 4, 8)
        else:
            q, gate = self.q(x).view(b, s, 4, 8), self.gate(x).view(b, s, -1, 8)
        k, v = (p(x).view(b, s, 4, 8) for p in (self.k, self.v))
        out = ad.torch_attention(q, k, v, None, 0.0, True, None, None, None, None)
        return self.o((out * torch.sigmoid(gate)).reshape(b, s, -1))


@pytest.mark.parametrize("shared_gate", [False, True], ids=["per-head gate", "shared gate"])
def test_a_per_head_output_gate_splits_with_the_heads(shared_gate):
    from helpers import export_gm

    gm = export_gm(_GatedAttention(shared_gate), torch.randn(2, 5, 32))
    plan = detect(gm, world_size=2, rank=0, lm_head=False, embedding=False)
    split = {d.weight for d in plan.decisions if isinstance(d, (ColumnShard, RowShard))}
    if shared_gate:  # near miss: a gate shared by every head does not split with them; the layer stays whole
        assert split == set() and list(plan.whole_layers) == ["torch_attention"]
    else:
        assert split == {"q.weight", "k.weight", "v.weight", "gate.weight", "o.weight"}
        assert plan.whole_layers == {}


def test_qwen3_next_attention_splits_with_its_partial_rope_and_query_half_gate():
    """Qwen3-Next's attention: q_proj's heads hold the query and the output gate (two halves of each
    head), q/k pass per-head norms and a RoPE on part of each head (slice, rotate, concatenate). One
    column split of q_proj serves query and gate; k/v by their heads; o_proj by rows. (Two ranks
    of it give HF's tokens: ``test_tp_greedy_tokens``, ``-m slow``.) OLMo-Hybrid's q/k norms run
    over all heads' features: they split with the heads as norms whose squares are summed over ranks."""
    from helpers import coverage_checkpoint

    gm = build(coverage_checkpoint("qwen3_next")[0], up_to=Stage.PATTERN_MATCHER).graph_module
    plan = detect(gm, world_size=2, rank=0)
    attention = sorted((type(d).__name__, d.weight.rsplit(".", 2)[-2]) for d in plan.decisions
                       if ".self_attn." in getattr(d, "weight", ""))
    assert attention == [("ColumnShard", "k_proj"), ("ColumnShard", "q_proj"), ("ColumnShard", "v_proj"),
                         ("RowShard", "o_proj")]
    assert plan.whole_layers == {}
    gm = build(coverage_checkpoint("olmo_hybrid")[0], up_to=Stage.PATTERN_MATCHER).graph_module
    plan = detect(gm, world_size=2, rank=0)
    attention = sorted((type(d).__name__, d.weight.rsplit(".", 2)[-2]) for d in plan.decisions
                       if ".self_attn." in getattr(d, "weight", ""))
    assert attention == [("ColumnShard", "k_proj"), ("ColumnShard", "q_proj"), ("ColumnShard", "v_proj"),
                         ("NormShard", "k_norm"), ("NormShard", "q_norm"), ("RowShard", "o_proj")]
    assert plan.whole_layers == {}


def test_a_query_and_gate_chunked_before_the_heads_view_leave_the_layer_whole():
    """Near miss to Qwen3-Next's layout: the fused projection is chunked into ``[q | gate]`` on its
    flat features, so a split of it by ranks would not follow the heads: the layer stays whole."""
    from helpers import export_gm

    gm = export_gm(_GatedAttention(fused=True), torch.randn(2, 5, 32))
    plan = detect(gm, world_size=2, rank=0, lm_head=False, embedding=False)
    assert not any(isinstance(d, (ColumnShard, RowShard)) for d in plan.decisions)
    assert list(plan.whole_layers) == ["torch_attention"]
