"""fuse_causal_conv_activation: ``silu(causal_conv1d(..., activation=None))`` -> the conv with
``activation='silu'``, for the uncached and the cached op.

HF models in transformers 5.23 pass the activation into the conv already (0 matches on the real
tiny Qwen3-Next), so the matches are on toy graphs that apply ``F.silu`` after the op.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from autodeploy.transform.interface import Stage
from helpers import apply_transform, assert_same_outputs, build, count_op, coverage_checkpoint, export_gm

ad = torch.ops.autodeploy
aten = torch.ops.aten
C, K = 16, 4
CONVS = [ad.torch_causal_conv1d, ad.torch_cached_causal_conv1d]


class ConvThenAct(nn.Module):
    """A depthwise causal conv followed by an activation; ``mode`` picks which and how."""

    def __init__(self, mode, weight_dtype=torch.float32):
        super().__init__()
        self.mode = mode
        torch.manual_seed(0)
        self.w_in = nn.Parameter(torch.randn(C, C) * 0.3)
        self.weight = nn.Parameter((torch.randn(C, 1, K) * 0.5).to(weight_dtype))
        self.bias = nn.Parameter(torch.randn(C).to(weight_dtype))

    def forward(self, x):
        h = F.linear(x, self.w_in)
        mode = self.mode
        bias = None if mode == "no_bias" else self.bias
        if mode == "already_silu":
            y = ad.torch_causal_conv1d(h, self.weight, bias, "silu")
        else:
            y = ad.torch_causal_conv1d(h, self.weight, bias)
        if mode == "gelu":
            return F.gelu(y)
        if mode == "other_user":  # the conv's value before the activation is read too
            return F.silu(y) + y
        return F.silu(y)


def _activation(conv, index):
    return conv.args[index] if len(conv.args) > index else conv.kwargs.get("activation")


def _inputs():
    return [(torch.randn(2, 7, C),), (torch.randn(3, 1, C),)]


def _run(module):
    gm = export_gm(module.eval(), torch.randn(2, 7, C))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_causal_conv_activation", gm)
    return reference, gm, record


@pytest.mark.parametrize("mode", ["with_bias", "no_bias"])
def test_silu_after_conv_moves_into_the_conv(mode):
    reference, gm, record = _run(ConvThenAct(mode))
    assert count_op(reference, aten.silu) == 1
    assert record.num_matches == 1
    assert count_op(gm, aten.silu) == 0
    (conv,) = gm.graph.find_nodes(op="call_function", target=ad.torch_causal_conv1d.default)
    assert _activation(conv, 3) == "silu"
    assert_same_outputs(reference, gm, _inputs(), tol=1e-6)


@pytest.mark.parametrize("mode,weight_dtype", [("gelu", torch.float32), ("other_user", torch.float32),
                                               ("already_silu", torch.float32), ("with_bias", torch.bfloat16)],
                         ids=["gelu", "other_user", "already_silu", "weight_of_another_dtype"])
def test_near_misses_left_alone(mode, weight_dtype):
    reference, gm, record = _run(ConvThenAct(mode, weight_dtype))
    assert record.num_matches == 0
    assert count_op(gm, [aten.silu, aten.gelu]) == 1
    (conv,) = gm.graph.find_nodes(op="call_function", target=ad.torch_causal_conv1d.default)
    assert _activation(conv, 3) == ("silu" if mode == "already_silu" else None)
    assert_same_outputs(reference, gm, _inputs())


# ---- the cached op: a flattened step graph with the step metadata and the conv window cache ----

STEP_INPUTS = ["x", "batch_info", "seq_len", "cu_seqlen", "slot_idx", "use_initial_state", "conv_state"]


def _cached_graph(activation_node=aten.silu.default, as_kwarg=False) -> fx.GraphModule:
    torch.manual_seed(0)
    root = nn.Module()
    root.weight = nn.Parameter(torch.randn(C, K) * 0.5)
    root.bias = nn.Parameter(torch.randn(C))
    graph = fx.Graph()
    ph = {name: graph.placeholder(name) for name in STEP_INPUTS}
    ph["x"].meta["val"] = torch.empty(1, 0, C)
    args = (ph["x"], graph.get_attr("weight"), graph.get_attr("bias"), *[ph[n] for n in STEP_INPUTS[1:]])
    conv = graph.call_function(ad.torch_cached_causal_conv1d.default, args, {"activation": None} if as_kwarg else {})
    if not as_kwarg:
        conv.args = (*args, None)
    graph.output(graph.call_function(activation_node, (conv,)))
    return fx.GraphModule(root, graph)


def _steps():
    """Two sequences: a prefill of 3 and 4 tokens (T = 7), then one decode token each (T = 2)."""
    i32 = dict(dtype=torch.int32)
    prefill = (torch.randn(1, 7, C), torch.tensor([2, 7, 0], **i32), torch.tensor([3, 4], **i32),
               torch.tensor([0, 3, 7], **i32), torch.tensor([2, 0], **i32), torch.tensor([0, 0], **i32))
    decode = (torch.randn(1, 2, C), torch.tensor([0, 0, 2], **i32), torch.tensor([1, 1], **i32),
              torch.tensor([0, 1, 2], **i32), torch.tensor([2, 0], **i32), torch.tensor([1, 1], **i32))
    return prefill, decode


def _run_steps(gm):
    state = torch.randn(3, C, K - 1)  # slot 1 unused; stale values in the used slots are ignored at first
    outs = [gm(*step, state) for step in _steps()]
    return outs, state


@pytest.mark.parametrize("as_kwarg", [False, True], ids=["positional", "keyword"])
def test_cached_conv_takes_the_silu(as_kwarg):
    reference = _cached_graph(as_kwarg=as_kwarg)
    gm, record = apply_transform("fuse_causal_conv_activation", copy.deepcopy(reference))
    assert record.num_matches == 1
    assert count_op(gm, aten.silu) == 0
    (conv,) = gm.graph.find_nodes(op="call_function", target=ad.torch_cached_causal_conv1d.default)
    assert _activation(conv, 9) == "silu"
    torch.manual_seed(1)
    ref_outs, ref_state = _run_steps(reference)
    torch.manual_seed(1)
    outs, state = _run_steps(gm)
    for out, ref in zip(outs, ref_outs):  # T = 7 (prefill) and T = 2 (decode)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(state, ref_state)


def test_cached_conv_with_gelu_left_alone():
    gm, record = apply_transform("fuse_causal_conv_activation", _cached_graph(aten.gelu.default))
    assert record.num_matches == 0 and count_op(gm, aten.gelu) == 1
    (conv,) = gm.graph.find_nodes(op="call_function", target=ad.torch_cached_causal_conv1d.default)
    assert conv.args[9] is None


def test_real_qwen3_next_already_passes_silu_into_the_conv():
    """Near miss on a real model: HF passes the activation to the conv, the export keeps it there."""
    path, _ = coverage_checkpoint("qwen3_next")
    gm = build(path, up_to=Stage.POST_LOAD_FUSION).graph
    convs = gm.graph.find_nodes(op="call_function", target=ad.torch_causal_conv1d.default)
    assert convs and all(c.args[3] == "silu" for c in convs)
    gm, record = apply_transform("fuse_causal_conv_activation", gm)
    assert record.num_matches == 0


def test_stage_is_compile_before_compile_model():
    from autodeploy.config import load_deploy_config

    keys = [k for k, v in load_deploy_config(model="demo").transforms.items()]
    assert keys.index("fuse_causal_conv_activation") < keys.index("compile_model")
    from autodeploy.transform.optimizer import build_transform

    assert build_transform("fuse_causal_conv_activation", {}).config.stage == Stage.COMPILE
