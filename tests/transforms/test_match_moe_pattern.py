"""match_moe_pattern: transformers' batched_mm experts graph -> torch_moe / torch_moe_fused, for the
six HF MoE families (blocks with real random weights, and whole tiny models); the export route
that emits the canonical op directly agrees with it; near misses are left alone."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from autodeploy.export.exporter import export_causal_lm
from autodeploy.transform.cleanups import cleanup_for_matching
from autodeploy.transform.interface import Stage
from helpers import (MOE_FAMILIES, MOE_LAYERS, apply_transform, assert_same_outputs, build, count_op, export_gm,
                     export_moe_block, moe_block, moe_config, moe_family_checkpoint, rel_rmse)

ad = torch.ops.autodeploy
aten = torch.ops.aten
H = 64
FAMILIES = sorted(MOE_FAMILIES)
SHAPES = [(torch.randn(2, 5, H),), (torch.randn(3, 1, H),)]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_block_batched_mm_becomes_torch_moe_fused(family):
    module = moe_block(family)
    gm = export_moe_block(module, "batched_mm")
    assert count_op(gm, aten.bmm) == 2
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("match_moe_pattern", gm)
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_moe_fused) == 1
    assert count_op(gm, [aten.bmm, aten.index, aten.repeat_interleave]) == 0
    node = gm.graph.find_nodes(op="call_function", target=ad.torch_moe_fused.default)[0]
    act = node.args[7]
    assert act == ("swiglu_oai" if family == "gpt_oss" else "silu")
    # routing stays plain ops: top-k is still in the graph
    assert count_op(gm, aten.topk) >= 1
    assert_same_outputs(reference, gm, SHAPES)
    assert_same_outputs(module, gm, SHAPES)  # and equals HF's eager experts loop


@pytest.mark.parametrize("family", FAMILIES)
def test_export_route_emits_the_same_canonical_op(family):
    """The default route (experts_implementation autodeploy) gives what the matcher gives."""
    module = moe_block(family)
    gm = export_moe_block(module, "autodeploy")
    assert count_op(gm, ad.torch_moe_fused) == 1
    assert count_op(gm, aten.bmm) == 0
    _, record = apply_transform("match_moe_pattern", gm)
    assert record.num_matches == 0
    assert_same_outputs(module, gm, SHAPES)


def _tiny_model(family):
    cfg = moe_config(family)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_whole_model_per_expert_weights_become_torch_moe(family):
    """A whole model: per-expert parameters named as the checkpoint names them, stacked inside the
    graph for HF's batched_mm; the matcher takes the per-expert parameters back out."""
    model = _tiny_model(family)
    before = [(n, p.shape) for n, p in model.named_parameters()]
    gm = export_causal_lm(model, max_batch_size=4, max_seq_len=32, experts_implementation="batched_mm")
    # the export left the HF model as it was (parameters, modules, experts implementation)
    assert [(n, p.shape) for n, p in model.named_parameters()] == before
    assert model.config._experts_implementation == "eager"
    from transformers.integrations.moe import ExpertsInterface

    assert "autodeploy" not in ExpertsInterface._global_mapping
    cleanup_for_matching(gm)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("match_moe_pattern", gm)
    assert record.num_matches == MOE_LAYERS[family]
    assert count_op(gm, ad.torch_moe) == MOE_LAYERS[family]
    assert count_op(gm, [aten.bmm, aten.stack]) == 0
    node = gm.graph.find_nodes(op="call_function", target=ad.torch_moe.default)[0]
    gates = [str(n.target) for n in node.args[3]]
    prefix = "model.layers.0.block_sparse_moe" if family == "mixtral" else "model.layers.0.mlp"
    leaf = "w1.weight" if family == "mixtral" else "gate_proj.weight"
    assert gates == [f"{prefix}.experts.{e}.{leaf}" for e in range(4)]
    vocab = MOE_FAMILIES[family]["vocab_size"]
    inputs = [(torch.randint(0, vocab, (b, s)), torch.arange(s).expand(b, s)) for b, s in ((2, 7), (3, 1))]
    assert_same_outputs(reference, gm, inputs)
    with torch.no_grad():
        hf = model(input_ids=inputs[0][0], position_ids=inputs[0][1]).logits
    assert_same_outputs(lambda *a: hf, gm, inputs[:1])


# the default run keeps Mixtral (renamed router, per-expert experts under another module name)
@pytest.mark.parametrize("family", [f if f == "mixtral" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(MOE_FAMILIES)])
def test_pipeline_parameters_are_checkpoint_tensors(family):
    """Through the pipeline (batched_mm route, experts exported per expert), each MoE layer matches
    once and every parameter of the graph is a tensor of the checkpoint transformers saved (per
    expert where it saves so)."""
    ckpt = moe_family_checkpoint(family)
    result = build(ckpt, up_to=Stage.PATTERN_MATCHER,
                   overrides={"export_to_gm": {"experts_implementation": "batched_mm", "experts_layout": "per_expert"}})
    record = next(r for r in result.context.history if r.key == "match_moe_pattern")
    assert record.status == "ok" and record.num_matches == MOE_LAYERS[family]
    per_expert = family != "gpt_oss"
    assert count_op(result.graph, ad.torch_moe if per_expert else ad.torch_moe_fused) == MOE_LAYERS[family]
    keys = set(result.factory.checkpoint_index().weight_map)
    names = {n for n, _ in result.graph.named_parameters()}
    assert names <= keys, sorted(names - keys)[:5]


@pytest.mark.parametrize("route", ["batched_mm", "autodeploy"])
def test_gelu_gated_experts_left_alone(route):
    """GeLU-gated experts are no canonical activation: the route falls back to batched_mm and the
    matcher leaves the GEMMs alone."""
    module = moe_block("mixtral", hidden_act="gelu")
    gm = export_moe_block(module, route)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("match_moe_pattern", gm)
    assert record.num_matches == 0
    assert count_op(gm, [ad.torch_moe, ad.torch_moe_fused]) == 0
    assert count_op(gm, aten.bmm) == 2
    assert_same_outputs(reference, gm, SHAPES)
    assert_same_outputs(module, gm, SHAPES)


def _hy_v4_moe(limit: float) -> nn.Module:
    from transformers import AutoConfig
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4MoE

    from autodeploy.coverage.configs import tiny_config

    cfg = tiny_config("hy_v4", "a")
    cfg["swiglu_limit"] = limit
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    module = HYV4MoE(config).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module


def test_clamped_silu_experts_export_canonically_with_their_limit():
    """HY-V4's experts gate with ``silu(min(gate, limit)) * clamp(up, -limit, limit)``: the route's
    probe finds ``silu_clamp`` with the module's ``swiglu_limit`` and emits the canonical op (numerics
    equal HF's experts at two shapes); at a limit of 0.5 the clamps change the output, so a limit
    lost on the way (plain SiLU) would fail."""
    module = _hy_v4_moe(0.5)
    gm = export_moe_block(module, "autodeploy")
    node = gm.graph.find_nodes(op="call_function", target=ad.torch_moe_fused.default)
    assert len(node) == 1 and tuple(node[0].args[7:10]) == ("silu_clamp", 1.0, 0.5)
    assert count_op(gm, aten.bmm) == 0
    assert_same_outputs(module, gm, SHAPES)
    node[0].args = (*node[0].args[:7], "silu", 1.0, 0.0, *node[0].args[10:])
    gm.recompile()
    with torch.no_grad():
        assert rel_rmse(gm(SHAPES[0][0]), module(SHAPES[0][0])) > 1e-2


class CrossWiredExperts(nn.Module):
    """batched_mm's computation except that the down projection uses the *next* expert's weights:
    not a mixture of experts, so nothing may be matched."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, 4, bias=False)
        self.gate_up = nn.Parameter(torch.randn(4, 64, H) * 0.2)
        self.down = nn.Parameter(torch.randn(4, H, 32) * 0.2)

    def forward(self, x):
        x = x.reshape(-1, H)
        weights, index = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        ids = index.reshape(-1)
        rows = x.repeat_interleave(2, dim=0)
        gu = torch.bmm(self.gate_up[ids], rows.unsqueeze(-1)).squeeze(-1)
        gate, up = gu.chunk(2, dim=-1)
        h = F.silu(gate) * up
        out = torch.bmm(self.down[(ids + 1) % 4], h.unsqueeze(-1)).squeeze(-1)
        out = out * weights.reshape(-1).unsqueeze(-1)
        return out.view(-1, 2, H).sum(dim=1)


def test_cross_wired_experts_left_alone():
    module = CrossWiredExperts().eval()
    gm = export_gm(module, torch.randn(2, 5, H))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("match_moe_pattern", gm)
    assert record.num_matches == 0
    assert count_op(gm, aten.bmm) == 2
    assert_same_outputs(reference, gm, SHAPES)


class HandWrittenExperts(CrossWiredExperts):
    """The same module wired correctly: the matcher also serves hand-written (custom model) code."""

    def forward(self, x):
        x = x.reshape(-1, H)
        weights, index = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        ids = index.reshape(-1)
        rows = x.repeat_interleave(2, dim=0)
        gu = torch.bmm(self.gate_up[ids], rows.unsqueeze(-1)).squeeze(-1)
        gate, up = gu.chunk(2, dim=-1)
        out = torch.bmm(self.down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (out * weights.reshape(-1).unsqueeze(-1)).view(-1, 2, H).sum(dim=1)


def test_hand_written_experts_match():
    module = HandWrittenExperts().eval()
    gm = export_gm(module, torch.randn(2, 5, H))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("match_moe_pattern", gm)
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_moe_fused) == 1
    assert count_op(gm, [aten.bmm, aten.repeat_interleave]) == 0
    assert_same_outputs(reference, gm, SHAPES)
    assert_same_outputs(module, gm, SHAPES)
