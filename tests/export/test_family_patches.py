"""Per-family export patches: expert loops that torch.export cannot trace become torch_moe_fused,
computing what HF's loop computes (at two token counts), and without the patch export fails."""

import pytest
import torch
from torch.export import Dim
from transformers import DbrxConfig, LongcatFlashConfig
from transformers.models.dbrx.modeling_dbrx import DbrxExperts
from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

import autodeploy.ops  # noqa: F401
from autodeploy.export.exporter import export_to_graph_module
from helpers import count_op

HIDDEN, EXPERTS, TOP_K = 16, 4, 2


def _dbrx():
    cfg = DbrxConfig(d_model=HIDDEN, ffn_config={"ffn_hidden_size": 8, "moe_num_experts": EXPERTS,
                                                 "moe_top_k": TOP_K})
    return DbrxExperts(cfg.ffn_config), EXPERTS


def _longcat():
    cfg = LongcatFlashConfig(hidden_size=HIDDEN, expert_ffn_hidden_size=8, n_routed_experts=EXPERTS,
                             zero_expert_num=2, hidden_act="silu")
    return LongcatFlashExperts(cfg), EXPERTS + 2


@pytest.mark.parametrize("make, patch", [(_dbrx, "dbrx_experts"), (_longcat, "longcat_flash_experts")])
def test_expert_loop_exports_as_fused_moe_and_matches(make, patch):
    torch.manual_seed(0)
    module, choices = make()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    module.eval()

    def inputs(tokens):
        scores = torch.randn(tokens, choices)
        weights, index = torch.topk(scores.softmax(-1), TOP_K, dim=-1)
        return torch.randn(tokens, HIDDEN), index, weights

    t = Dim("tokens", min=2, max=64)
    shapes = ({0: t}, {0: t}, {0: t})
    gm = export_to_graph_module(module, inputs(8), dynamic_shapes=shapes)
    assert count_op(gm, torch.ops.autodeploy.torch_moe_fused) == 1
    for tokens in (5, 17):
        args = inputs(tokens)
        with torch.no_grad():
            ref = module(*args)
            out = gm(*args)
        torch.testing.assert_close(out.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception):
        export_to_graph_module(module, inputs(8), dynamic_shapes=shapes, patches={patch: False})
