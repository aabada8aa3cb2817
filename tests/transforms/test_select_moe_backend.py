"""``select_moe_backend``: the grouped MoE ops' experts packed once for oneDNN
(``onednn_grouped_moe_fused``), float (Mixtral, Qwen3-MoE) and quantized experts decoded once
(fine-grained FP8). Checked: one match per MoE layer, the new op in the graph with per-expert
packed weights and the stacked tensors freed, the logits of the unpacked pipeline (``backend:
torch``) at two shapes, and near misses left alone: the gathered-weight strategy
(``bmm_max_pairs``), a ``torch-compile`` graph, and ``backend: torch``."""

import pytest
import torch

import quant_expert_checkpoints as qe
from autodeploy.transform.graph_utils import count_op
from autodeploy.transform.interface import Stage
from helpers import MOE_LAYERS, build, graph_logits, moe_family_checkpoint, rel_rmse

ad = torch.ops.autodeploy
LIMITS = dict(max_seq_len=64, max_batch_size=2, dtype="float32")
SHAPES = [(1, 7), (2, 12)]


def _build(checkpoint, **overrides):
    return build(checkpoint, up_to=Stage.POST_LOAD_FUSION, overrides=overrides, **LIMITS)


def _record(result):
    return next(r for r in result.context.history if r.key == "select_moe_backend")


CASES = {
    "mixtral": (lambda: moe_family_checkpoint("mixtral"), MOE_LAYERS["mixtral"], ad.grouped_moe_fused, "none"),
    "qwen3_moe-fp8_block": (lambda: qe.quantized_checkpoint("qwen3_moe", "fp8_block"), qe.MOE_LAYERS["qwen3_moe"],
                            ad.grouped_quant_moe_fused, "fp8_group"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_experts_are_packed_and_compute_the_unpacked_logits(case):
    checkpoint, layers, grouped, act_quant = CASES[case]
    packed = _build(checkpoint())
    plain = _build(checkpoint(), select_moe_backend={"backend": "torch"})
    assert _record(packed).num_matches == layers
    assert count_op(plain.graph, grouped) == layers  # the control: the grouped op over stacked weights
    gm = packed.graph
    assert count_op(gm, grouped) == 0 and count_op(gm, ad.onednn_grouped_moe_fused) == layers
    node = gm.graph.find_nodes(op="call_function", target=ad.onednn_grouped_moe_fused.default)[0]
    gate_up, down = node.args[3], node.args[4]
    experts = 4 if case == "mixtral" else qe.NUM_EXPERTS["qwen3_moe"]
    assert len(gate_up) == len(down) == experts and node.args[10] == act_quant
    assert all(_value(gm, n).is_mkldnn for n in gate_up + down)
    tensors = dict(gm.named_parameters()) | dict(gm.named_buffers())
    assert not any(n.endswith(("moe_gate_up_weight", "moe_down_weight", "experts.gate_up_proj")) for n in tensors)
    g = torch.Generator().manual_seed(0)
    for b, s in SHAPES:
        ids = torch.randint(0, 512, (b, s), generator=g)
        assert rel_rmse(graph_logits(gm, ids), graph_logits(plain.graph, ids)) < 1e-5


def _value(gm, node):
    owner, _, leaf = str(node.target).rpartition(".")
    return getattr(gm.get_submodule(owner), leaf)


@pytest.mark.parametrize("near_miss", ["bmm", "torch-compile", "torch"])
def test_near_misses_are_left_alone(near_miss):
    overrides = {"bmm": {"fuse_moe": {"bmm_max_pairs": 64}},
                 "torch-compile": {"compile_model": {"backend": "torch-compile"}},
                 "torch": {"select_moe_backend": {"backend": "torch"}}}[near_miss]
    result = _build(moe_family_checkpoint("mixtral"), **overrides)
    assert _record(result).num_matches == 0
    assert count_op(result.graph, ad.onednn_grouped_moe_fused) == 0
    assert count_op(result.graph, ad.grouped_moe_fused) == MOE_LAYERS["mixtral"]
