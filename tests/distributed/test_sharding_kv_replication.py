"""Tensor parallelism with fewer key/value heads than ranks, and the vocab-parallel LM head.

A tiny Qwen3 (4 query heads, 2 key/value heads, q/k norms before RoPE) at world size 4: every
rank holds one query head and the one key/value head it reads (each KV head replicated on two
ranks, the checkpoint's own rows), its KV cache one head wide, and the LM head a quarter of the
vocabulary whose logits an all-gather joins. The logits of all four ranks equal HF eager's at two
shapes. One process: the plan itself, for world sizes 2 and 4.
"""

import glob
import os

import pytest
import torch

from autodeploy.transform.interface import Stage
from autodeploy.transform.library._sharding import ColumnShard, EmbeddingShard
from autodeploy.transform.library.detect_sharding import detect
from helpers import TINY, build, count_op, family_checkpoint
from test_collectives import _run_ranks

ad = torch.ops.autodeploy


@pytest.mark.parametrize("world_size", [2, 4])
def test_kv_heads_fewer_than_ranks_are_replicated(world_size):
    gm = build(family_checkpoint("qwen3"), up_to=Stage.PATTERN_MATCHER).graph_module
    for rank in range(world_size):
        plan = detect(gm, world_size=world_size, rank=rank)
        columns = {d.weight.rsplit(".", 2)[-2]: d for d in plan.decisions
                   if isinstance(d, ColumnShard) and "layers.0." in d.weight}
        assert set(columns) == {"q_proj", "k_proj", "v_proj"}
        assert columns["q_proj"].parts is None  # query heads: the rank's share of world_size
        if world_size == 2:  # 2 KV heads over 2 ranks: split like the query heads
            assert columns["k_proj"].parts is None and columns["v_proj"].parts is None
        else:  # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
            assert (columns["k_proj"].parts, columns["k_proj"].index) == (2, rank // 2)
            assert (columns["v_proj"].parts, columns["v_proj"].index) == (2, rank // 2)
        head = [d for d in plan.decisions if isinstance(d, ColumnShard) and d.gather]
        assert [d.weight for d in head] == ["lm_head.weight"]


def test_a_tied_lm_head_shares_the_embedding_slice_or_stays_whole_with_it():
    """Gemma ties the LM head to the embedding: with the vocab-parallel embedding both read the same
    rows of the one table; near miss: with the embedding kept whole, the head stays whole too."""
    gm = build(family_checkpoint("gemma"), up_to=Stage.PATTERN_MATCHER).graph_module
    plan = detect(gm, world_size=2, rank=0)
    (head,) = [d for d in plan.decisions if isinstance(d, ColumnShard) and d.gather]
    (table,) = [d for d in plan.decisions if isinstance(d, EmbeddingShard)]
    assert head.weight == table.weight and (table.start, table.end) == (0, 256)
    whole = detect(gm, world_size=2, rank=0, embedding=False)
    assert not any(isinstance(d, ColumnShard) and d.gather for d in whole.decisions)
    assert any(isinstance(d, ColumnShard) for d in whole.decisions)  # attention is still split


def _qwen3_job(rank: int):
    from safetensors.torch import load_file

    from helpers import assert_matches_hf

    checkpoint = family_checkpoint("qwen3")
    gm = build(checkpoint, up_to=Stage.WEIGHT_LOAD, world_size=4).graph_module
    torch.manual_seed(0)  # every rank feeds the same tokens
    assert_matches_hf(gm, checkpoint, shapes=((1, 5), (2, 3)))
    full = load_file(glob.glob(os.path.join(checkpoint, "*.safetensors"))[0])
    k = gm.get_parameter("model.layers.0.self_attn.k_proj.weight")
    head_dim = TINY["head_dim"]
    kv_head = rank // 2
    return {
        "k_rows": k.shape[0],
        "k_slice": torch.equal(k, full["model.layers.0.self_attn.k_proj.weight"][kv_head * head_dim:(kv_head + 1) * head_dim]),
        "q_rows": gm.get_parameter("model.layers.0.self_attn.q_proj.weight").shape[0],
        "head_rows": gm.get_parameter("lm_head.weight").shape[0],
        "all_gather": count_op(gm, ad.torch_dist_all_gather),
    }


@pytest.mark.slow  # ~25 s on 2 cores: four ranks each build the model
@pytest.mark.distributed
def test_four_ranks_with_two_kv_heads_match_hf():
    for rank, r in enumerate(_run_ranks(_qwen3_job, world=4, timeout=240)):
        assert "error" not in r, r.get("error")
        assert r["q_rows"] == TINY["head_dim"]  # one query head
        assert r["k_rows"] == TINY["head_dim"] and r["k_slice"], f"rank {rank} holds the wrong key/value head"
        assert r["head_rows"] == TINY["vocab_size"] // 4 and r["all_gather"] == 1
