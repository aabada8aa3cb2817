"""Tensor parallelism of quantized linears, of MLPs that are not a ``torch_swiglu_mlp``, and inside
experts the world size does not divide.

One process (the plan): a quantized Llama's q/k/v and gate/up split by output features and o/down
by input features, each with the scales of its format that split with the weight (NVFP4's and
int4's group scales), the per-tensor scales whole; a fine-grained FP8 model whose 128-blocks a
split would cut stays whole (near miss); an MLP whose gate has another reader stays whole (near
miss); a MoE with fewer experts than ranks is split inside its experts; quantized experts split
whole, with their scales (per expert: the other experts' tensors dropped; stacked: rows of each
[E, ...] tensor).

Two real gloo ranks: the FP8 Llama's logits equal the float reference (decoded weights, FP8
activation rounding) at two shapes with each rank holding its checkpoint slice of every quantized
weight, bit for bit. ``-m slow``: a 3-expert Qwen3-MoE (experts not divisible by 2) equals HF with
each rank holding half of every expert; greedy tokens through ``LLM`` at 2 ranks equal 1 rank for
FP8, NVFP4 and GPTQ Llamas; a Qwen3-MoE with ModelOpt FP8 experts, four whole experts a rank
(stacked: the rows hold exactly those experts' checkpoint tensors; and per expert), matches the
float reference, and 1 rank's tokens; a 2-expert model at 4 ranks equals HF.
"""

import os
from functools import partial
from typing import Any, Dict, List

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import quant_checkpoints as qc
import quant_expert_checkpoints as qe
from autodeploy.transform.interface import Stage
from autodeploy.transform.library._sharding import (ColumnShard, EmbeddingShard, ExpertShard, ExpertTensorShard,
                                                    RowShard, SwigluShard)
from autodeploy.transform.library.detect_sharding import detect
from helpers import build, count_op, graph_logits, hf_greedy_tokens, moe_family_checkpoint, rel_rmse
from test_collectives import _run_ranks

# these plan the per-expert torch_moe (the layout of experts the world size does not divide, or of
# experts whose checkpoint tensors differ) of a world-size-1 build for other world sizes
PER_EXPERT = {"export_to_gm": {"experts_layout": "per_expert"}}

ad = torch.ops.autodeploy
LAYERS = qc.TINY["num_hidden_layers"]
# per quantized linear: the tensors a split carries along with the weight (dim), per format
GROUPED = {"fp8": (), "nvfp4": ("weight_scale",), "gptq": ("int4_scales", "int4_zeros")}


def _plan(checkpoint: str, world: int = 2, rank: int = 1):
    gm = build(checkpoint, up_to=Stage.PATTERN_MATCHER, max_seq_len=64, max_batch_size=2).graph_module
    return gm, detect(gm, world_size=world, rank=rank)


# NVFP4 (group scales split, per-tensor scales whole) by default; FP8 and GPTQ with -m slow (~2 s each)
@pytest.mark.parametrize("fmt", [pytest.param("fp8", marks=pytest.mark.slow),
                                 pytest.param("gptq", marks=pytest.mark.slow), "nvfp4"])
def test_quantized_linears_split_with_the_scales_of_their_format(fmt):
    gm, plan = _plan(qc.quantized_checkpoint("llama", fmt))
    columns = [d for d in plan.decisions if isinstance(d, ColumnShard)]
    rows = [d for d in plan.decisions if isinstance(d, RowShard)]
    # q, k, v, gate, up per layer + the (float) LM head; o and down per layer; no float SwiGLU op
    assert len(columns) == 5 * LAYERS + 1 and len(rows) == 2 * LAYERS
    assert not any(isinstance(d, SwigluShard) for d in plan.decisions)
    assert {d.weight.rsplit(".", 2)[-2] for d in rows} == {"o_proj", "down_proj"}
    for d in columns + rows:
        if d.weight == "lm_head.weight":
            assert d.extra == () and d.gather
            continue
        prefix = d.weight.rsplit(".", 1)[0]
        dim = 1 if isinstance(d, RowShard) else 0
        assert d.extra == tuple((f"{prefix}.{name}", dim) for name in GROUPED[fmt]), d
    # the per-tensor scales are in no decision: every rank keeps them whole
    planned = {t for d in plan.decisions for t, _ in getattr(d, "extra", ())}
    assert not any(t.endswith(("input_scale", "weight_scale_2")) for t in planned)


def test_fine_grained_fp8_blocks_a_split_would_cut_stay_whole():
    """Near miss: 128x128 weight tiles over 64 hidden features: half a tile per rank would change
    which channels share an activation scale, so those linears stay whole (only the float
    embedding and LM head are split)."""
    _, plan = _plan(qc.quantized_checkpoint("llama", "fp8_block"))
    assert [(type(d), d.weight) for d in plan.decisions] == [(EmbeddingShard, "model.embed_tokens.weight"),
                                                              (ColumnShard, "lm_head.weight")]


def test_an_mlp_whose_gate_has_another_reader_stays_whole():
    """Near miss for the element-wise MLP split: a second reader of layer 0's gate projection
    would see one rank's features only."""
    gm = build(qc.quantized_checkpoint("llama", "fp8"), up_to=Stage.PATTERN_MATCHER, max_seq_len=64,
               max_batch_size=2).graph_module
    gate = next(n for n in gm.graph.nodes if n.target == ad.torch_quant_fp8_linear.default
                and "layers.0.mlp.gate_proj" in str(n.args[1].target))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        extra = gm.graph.call_function(torch.ops.aten.sum.default, (gate,))
    output.args = ((output.args[0][0] if isinstance(output.args[0], tuple) else output.args[0], extra),)
    split = {d.weight for d in detect(gm, world_size=2, rank=0).decisions}
    assert not any("layers.0.mlp" in w for w in split)
    assert {"model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight"} <= split


def test_fewer_experts_than_ranks_split_inside_the_experts():
    gm = build(moe_family_checkpoint("mixtral", num_local_experts=2), up_to=Stage.PATTERN_MATCHER,
               overrides=PER_EXPERT).graph_module
    plan = detect(gm, world_size=4, rank=3)  # 2 experts, 4 ranks: 128 hidden features -> 32 a rank
    inside = [d for d in plan.decisions if isinstance(d, ExpertTensorShard)]
    assert len(inside) == LAYERS and not any(isinstance(d, ExpertShard) for d in plan.decisions)
    assert all(len(d.gate) == len(d.up) == len(d.down) == 2 and not d.down_bias for d in inside)
    assert all(".experts.1." in d.down[1] for d in inside)
    # at 2 ranks the same experts go whole to one rank each (expert parallelism)
    assert sum(isinstance(d, ExpertShard) for d in detect(gm, world_size=2, rank=0).decisions) == LAYERS


@pytest.mark.parametrize("fmt,per_expert", [("nvfp4", 4)])  # weight, input scale, block scales, global scale
def test_quantized_experts_are_split_whole_with_their_scales(fmt, per_expert):
    """Expert parallelism for the per-expert quantized MoE ops: this rank's block of experts, the
    other experts' weights and every scale of theirs (input, weight, global) dropped."""
    gm = build(qe.quantized_checkpoint("qwen3_moe", fmt), up_to=Stage.PATTERN_MATCHER, overrides=PER_EXPERT).graph_module
    assert count_op(gm, ad.torch_quant_nvfp4_moe) == qe.MOE_LAYERS["qwen3_moe"]
    shards = [d for d in detect(gm, world_size=2, rank=1).decisions if isinstance(d, ExpertShard)]
    assert [(d.start, d.end) for d in shards] == [(4, 8)] * qe.MOE_LAYERS["qwen3_moe"]
    # 4 other experts x gate/up/down x (weight + the format's scales)
    assert all(len(d.dropped) == 4 * 3 * per_expert and not d.stacked for d in shards)
    assert all(".experts.0." in t or ".experts.3." in t or ".experts.1." in t or ".experts.2." in t
               for d in shards for t in d.dropped)


def test_stacked_quantized_experts_are_split_by_rows_with_their_scales():
    """The stacked form (the default export): this rank's rows [4, 8) of every [E, ...] tensor,
    weights and each of the format's scales (input, block, global), nothing dropped."""
    gm = build(qe.quantized_checkpoint("qwen3_moe", "nvfp4"), up_to=Stage.PATTERN_MATCHER).graph_module
    assert count_op(gm, ad.torch_quant_nvfp4_moe_stacked) == qe.MOE_LAYERS["qwen3_moe"]
    shards = [d for d in detect(gm, world_size=2, rank=1).decisions if isinstance(d, ExpertShard)]
    assert [(d.start, d.end) for d in shards] == [(4, 8)] * qe.MOE_LAYERS["qwen3_moe"]
    kinds = ("weight", "input_scale", "weight_scale", "weight_scale_2")
    assert [sorted(d.stacked) for d in shards] == [
        sorted(f"model.layers.{i}.mlp.experts.{p}_{k}" for p in ("gate", "up", "down") for k in kinds)
        for i in qe.MOE_LAYER_IDS["qwen3_moe"]]
    assert all(not d.dropped for d in shards)


# ---- two ranks ------------------------------------------------------------------------------------
def _fp8_graph_job(rank: int) -> Dict[str, Any]:
    checkpoint = qc.quantized_checkpoint("llama", "fp8")
    gm = build(checkpoint, up_to=Stage.WEIGHT_LOAD, world_size=2, max_seq_len=64, max_batch_size=2).graph_module
    ref = qc.reference_model("llama", "fp8")
    torch.manual_seed(0)  # every rank feeds the same tokens
    errors = []
    for b, s in ((1, 7), (3, 4)):
        ids = torch.randint(0, 512, (b, s))
        with torch.no_grad():
            errors.append(rel_rmse(graph_logits(gm, ids), ref(ids).logits))
    buffers = dict(gm.named_buffers())
    slices = {}
    with safe_open(f"{checkpoint}/model.safetensors", "pt") as f:
        for name, dim in (("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.1.mlp.down_proj.weight", 1)):
            whole = f.get_tensor(name)
            part = whole.narrow(dim, rank * whole.shape[dim] // 2, whole.shape[dim] // 2)
            slices[name] = bool(torch.equal(buffers[name].view(torch.uint8), part.view(torch.uint8)))
    return {"errors": errors, "slices": slices, "all_reduce": count_op(gm, ad.torch_dist_all_reduce)}


@pytest.mark.slow  # ~8 s; the float 2-rank Llama (test_sharding.py) runs the executor by default
@pytest.mark.distributed
def test_two_ranks_of_an_fp8_model_hold_their_slices_and_match_the_float_reference():
    qc.quantized_checkpoint("llama", "fp8")
    results = _run_ranks(_fp8_graph_job, world=2, timeout=240)
    for r in results:
        assert "error" not in r, r.get("error")
        # row-parallel partial sums round differently from one GEMM, and FP8 activation rounding
        # can turn such a last-bit difference into one e4m3 step: close, not bit-equal
        assert max(r["errors"]) < 2e-3, r["errors"]
        assert all(r["slices"].values()), r["slices"]
        assert r["all_reduce"] == 2 * LAYERS + 1  # after each attention and MLP, and the embedding


def _moe_graph_job(rank: int) -> Dict[str, Any]:
    from helpers import assert_matches_hf

    checkpoint = moe_family_checkpoint("qwen3_moe", num_experts=3)
    gm = build(checkpoint, up_to=Stage.WEIGHT_LOAD, world_size=2).graph_module
    torch.manual_seed(0)
    assert_matches_hf(gm, checkpoint, shapes=((1, 5), (2, 3)))
    shapes = sorted({tuple(p.shape) for n, p in gm.named_parameters() if ".experts." in n})
    return {"shapes": shapes, "experts": len({n.split(".experts.")[1].split(".")[0]
                                              for n, _ in gm.named_parameters() if ".experts." in n})}


@pytest.mark.slow  # ~25 s on 2 cores; the plan test above covers the decision in the default run
@pytest.mark.distributed
def test_two_ranks_split_three_experts_inside_and_match_hf():
    moe_family_checkpoint("qwen3_moe", num_experts=3)  # written once here, not by two ranks at a time
    results = _run_ranks(_moe_graph_job, world=2, timeout=240)
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["experts"] == 3  # every rank holds every expert ...
        assert [list(s) for s in r["shapes"]] == [[32, 64], [64, 32]]  # ... half of its 64 hidden features


# ---- generation (slow) ----------------------------------------------------------------------------
PROMPTS = [[3, 17, 29, 41, 5, 11, 2], [7, 8, 9]]
NEW = 8


def _generate_job(rank: int, checkpoint: str, world: int) -> Dict[str, Any]:
    from autodeploy import LLM, SamplingParams

    llm = LLM(checkpoint, world_size=world, max_seq_len=64, max_batch_size=4, max_num_tokens=64)
    if not llm.is_driver:
        llm.follow()
        return {}
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                       SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    llm.shutdown()
    return {"tokens": [list(o.outputs[0].token_ids) for o in out]}


def _tokens(checkpoint: str, world: int) -> List[List[int]]:
    results = _run_ranks(partial(_generate_job, checkpoint=checkpoint, world=world), world=world, timeout=400)
    for r in results:
        assert "error" not in r, r.get("error")
    return results[0]["tokens"]


@pytest.mark.slow  # ~30 s each on 2 cores: two builds at each world size
@pytest.mark.distributed
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "gptq"])
def test_greedy_tokens_of_a_quantized_model_at_two_ranks_equal_one_rank(fmt):
    checkpoint = qc.quantized_checkpoint("llama", fmt)
    assert _tokens(checkpoint, 2) == _tokens(checkpoint, 1)


def _quantized_moe_job(rank: int, layout: str) -> Dict[str, Any]:
    checkpoint = qe.quantized_checkpoint("qwen3_moe", "fp8")
    gm = build(checkpoint, up_to=Stage.WEIGHT_LOAD, world_size=2,
               overrides={"export_to_gm": {"experts_layout": layout}}).graph_module
    ref = qe.reference_model("qwen3_moe", "fp8")
    torch.manual_seed(0)
    errors = []
    for b, s in ((1, 7), (3, 4)):
        ids = torch.randint(0, qe.VOCAB, (b, s))
        with torch.no_grad():
            errors.append(rel_rmse(graph_logits(gm, ids), ref(ids).logits))
    buffers = dict(gm.named_buffers())
    if layout == "per_expert":
        experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in buffers if ".experts." in n})
    else:  # which experts' rows the stacked buffers hold: compare with the checkpoint's tensors
        sd = load_file(os.path.join(checkpoint, "model.safetensors"))
        rows = buffers["model.layers.1.mlp.experts.down_weight"].view(torch.uint8)
        experts = [e for e in range(qe.NUM_EXPERTS["qwen3_moe"]) for r in range(len(rows))
                   if torch.equal(rows[r], sd[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].view(torch.uint8))]
    return {"errors": errors, "experts": experts}


@pytest.mark.slow  # ~30 s on 2 cores, then two more builds for the tokens
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["auto", "per_expert"])
def test_two_ranks_of_fp8_experts_hold_half_and_match_the_reference_and_one_rank(layout):
    checkpoint = qe.quantized_checkpoint("qwen3_moe", "fp8")
    results = _run_ranks(partial(_quantized_moe_job, layout=layout), world=2, timeout=300)
    for rank, r in enumerate(results):
        assert "error" not in r, r.get("error")
        assert max(r["errors"]) < 2e-3, r["errors"]  # FP8 activation rounding of all-reduced sums, as above
        assert r["experts"] == list(range(4 * rank, 4 * rank + 4))
    if layout == "auto":
        assert _tokens(checkpoint, 2) == _tokens(checkpoint, 1)


@pytest.mark.slow  # ~60 s on 2 cores: four ranks build the model
@pytest.mark.distributed
def test_two_experts_at_four_ranks_give_hf_greedy_tokens():
    checkpoint = moe_family_checkpoint("qwen3_moe", num_experts=2, num_experts_per_tok=1)  # before the ranks start
    assert _tokens(checkpoint, 4) == hf_greedy_tokens(checkpoint, PROMPTS, NEW)
