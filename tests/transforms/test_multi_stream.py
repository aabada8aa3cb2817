"""multi_stream_gemm / multi_stream_moe / multi_stream_mla_attn (compile): independent branches on an
aux CUDA stream (``autodeploy/ops/streams.py``).

On CPU each transform is a verified no-op (skipped with its reason, the graph's code unchanged,
the same numbers). The pattern finders are checked for their exact counts on a real tiny
DeepSeek-V3 (MLA + a MoE layer with a shared expert) and on exported MoE blocks and linear
modules, and for zero on near-misses. The rewrite itself is run with the device set to "cuda"
at the graph level only (nothing executes on a GPU here): exact fork/end/join counts, a valid
graph (lint, shape propagation), and the same numbers on CPU, where the stream ops do nothing.
What only a GPU can show (two streams really used, CUDA graph capture, timing) is in
``tests/gpu/test_multi_stream_gpu.py``.
"""

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from autodeploy.compile.direct_kernels import direct_kernel_graph
from autodeploy.config.deploy_config import DEFAULT_YAML
from autodeploy.ops.streams import regions_run, stream_ops
from autodeploy.transform.graph_utils import canonicalize_graph, run_shape_prop
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.library.multi_stream_gemm import find_shared_input_gemms
from autodeploy.transform.library.multi_stream_mla_attn import find_mla_latent_branches
from autodeploy.transform.library.multi_stream_moe import find_moe_shared_experts
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.fx import copy_graph_module
from helpers import (MOE_FAMILIES, apply_transform, assert_same_outputs, build, count_op, export_gm,
                     export_moe_block, moe_block, moe_family_checkpoint, prefill_then_decode)
from helpers import graph_logits

aten = torch.ops.aten
ad = torch.ops.autodeploy
FORK, END, JOIN = stream_ops()
KEYS = ("multi_stream_gemm", "multi_stream_moe", "multi_stream_mla_attn")
# the graph a CUDA build has: torch's linears and the grouped MoE op (the CPU backends stay out)
CUDA_LIKE = {"compile_model": {"enabled": False}, "select_linear_backend": {"enabled": False},
             "select_moe_backend": {"enabled": False}}
LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
VOCAB = MOE_FAMILIES["deepseek_v3"]["vocab_size"]


def _apply(key, gm, device="cuda", **ctx_fields):
    """Run one transform through the base class with the build's device set to ``device`` (the
    graph and its tensors stay where they are: this is a graph-level rewrite)."""
    ctx = PipelineContext(device=device, **ctx_fields)
    build_transform(key, {"enabled": True})(gm, ctx)
    return ctx.history[-1]


def _stream_counts(gm):
    return tuple(count_op(gm, op) for op in (FORK, END, JOIN))


def _region_is_well_formed(gm):
    """fork, end, join alternate in that order, each region's join before the first reader of what
    its end hands over, and every node of a branch between its fork and end."""
    seq = [n.target for n in gm.graph.nodes if n.target in (FORK, END, JOIN)]
    assert seq == [FORK, END, JOIN] * (len(seq) // 3)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for end in [n for n in gm.graph.nodes if n.target is END]:
        join = next(n for n in gm.graph.nodes if n.target is JOIN and order[n] > order[end])
        assert list(join.args[0]) == list(end.args[0])
        for out in end.args[0]:
            assert order[out] < order[end]
            assert all(order[u] > order[join] for u in out.users if u not in (end, join))


# ---- tiny DeepSeek-V3: MLA in both layers, a shared expert in the MoE layer -------------------------------------

@pytest.fixture(scope="module")
def deepseek():
    # a fixed page pool (no resize to a share of RAM): each run allocates it afresh
    return build(moe_family_checkpoint("deepseek_v3"), overrides={**CUDA_LIKE, "resize_kv_cache": {"enabled": False}},
                 **LIMITS)


def _logits(res, gm):
    """A prefill step of two sequences (8 tokens), then three decode steps (2 tokens), on the
    cached graph ``gm``: two shapes."""
    rng = random.Random(0)
    seqs = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(2)]
    return prefill_then_decode(dataclasses.replace(res, graph=gm), seqs, (5, 3))


@pytest.fixture(scope="module")
def reference_logits(deepseek):
    return _logits(deepseek, deepseek.graph)


@pytest.mark.parametrize("key", KEYS)
def test_cpu_is_a_verified_noop(deepseek, reference_logits, key):
    gm = copy_graph_module(deepseek.graph)
    before = gm.code
    record = _apply(key, gm, device="cpu")
    assert record.status == "skipped" and record.error == "CPU: one stream"
    assert gm.code == before
    assert _stream_counts(gm) == (0, 0, 0)
    torch.testing.assert_close(_logits(deepseek, gm), reference_logits, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch-compile", "torch-opt"])
def test_retracing_backends_left_alone(deepseek, backend):
    gm = copy_graph_module(deepseek.graph)
    before = gm.code
    record = _apply("multi_stream_moe", gm, compile_backend=backend)
    assert record.status == "skipped" and backend in record.error and gm.code == before


def test_finders_on_deepseek(deepseek):
    gm = deepseek.graph
    moe = find_moe_shared_experts(gm)
    assert len(moe) == 1  # first_k_dense_replace=1: one MoE layer
    moe_op, branch = moe[0]
    assert moe_op.target is ad.grouped_moe_fused.default
    assert [n.target for n in branch] == [ad.torch_fused_swiglu_mlp.default]  # the shared expert
    mla = find_mla_latent_branches(gm)
    assert len(mla) == 2  # both layers
    for op, branch in mla:
        # fuse_gemms made q_a/kv_a one GEMM: the branch is the kv half after the split, with its norm
        assert set(branch) >= {op.args[2], op.args[3]}
        assert sum(n.target is ad.native_rmsnorm.default for n in branch) == 1
        assert not any(n.target is aten.linear.default for n in branch)
    # after fuse_gemms no two linears share an input in this model
    assert find_shared_input_gemms(gm) == []


@pytest.mark.parametrize("key,regions", [("multi_stream_moe", 1), ("multi_stream_mla_attn", 2)])
def test_rewrite_on_deepseek(deepseek, reference_logits, key, regions):
    gm = copy_graph_module(deepseek.graph)
    record = _apply(key, gm)
    assert record.status == "ok" and record.num_matches == regions
    assert _stream_counts(gm) == (regions, regions, regions)
    gm.graph.lint()
    _region_is_well_formed(gm)
    run_shape_prop(gm, incremental=False)
    canonicalize_graph(gm)  # dead-code elimination keeps the stream ops (they return nothing)
    assert _stream_counts(gm) == (regions, regions, regions)
    count = regions_run()
    torch.testing.assert_close(_logits(deepseek, gm), reference_logits, rtol=0, atol=0)
    assert regions_run() == count  # CPU tensors: no region ran on a stream


def test_moe_region_places_the_shared_expert_before_the_routed_experts(deepseek):
    gm = copy_graph_module(deepseek.graph)
    _apply("multi_stream_moe", gm)
    nodes = list(gm.graph.nodes)
    fork, end, join = (next(i for i, n in enumerate(nodes) if n.target is op) for op in (FORK, END, JOIN))
    shared = next(i for i, n in enumerate(nodes) if n.target is ad.torch_fused_swiglu_mlp.default
                  and fork < i < end)
    routed = next(i for i, n in enumerate(nodes) if n.target is ad.grouped_moe_fused.default)
    router = next(i for i, n in enumerate(nodes) if n.target is aten.linear.default and "mlp_gate" in str(n.args[1]))
    assert fork < shared < end < router < routed < join  # router and routed experts on main, concurrently


def test_all_three_together_never_nest(deepseek, reference_logits):
    gm = copy_graph_module(deepseek.graph)
    keys = ("multi_stream_moe", "multi_stream_mla_attn", "multi_stream_gemm")
    matches = [_apply(key, gm).num_matches for key in keys]
    assert matches == [1, 2, 0]
    _region_is_well_formed(gm)
    torch.testing.assert_close(_logits(deepseek, gm), reference_logits, rtol=0, atol=0)
    # torch-simple runs a sibling graph whose autodeploy ops are direct Python calls: the stream ops too
    sibling, _ = direct_kernel_graph(gm, "cpu")
    torch.testing.assert_close(_logits(deepseek, sibling), reference_logits, rtol=0, atol=0)


# ---- MLA with its own kv projection (before fuse_gemms): the two latent projections -----------------------------

@pytest.fixture(scope="module")
def mla_unfused():
    """One dense DeepSeek-V3 layer as exported (torch_mla, q_a_proj and kv_a_proj_with_mqa apart,
    one RoPE op over the query and the rope key)."""
    return build(moe_family_checkpoint("deepseek_v3", num_hidden_layers=1), up_to=Stage.WEIGHT_LOAD).graph


def test_mla_two_latent_projections_on_two_streams(mla_unfused):
    gm = copy_graph_module(mla_unfused)
    (op, branch), = find_mla_latent_branches(gm)
    assert op.target is ad.torch_mla.default
    linears = [str(n.args[1].target) for n in branch if n.target is aten.linear.default]
    assert linears == ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]  # kv_a on aux, q_a/q_b on main
    assert not any("rope" in str(n.target) for n in branch)  # the joint RoPE reads the query: main stream
    record = _apply("multi_stream_mla_attn", gm)
    assert record.num_matches == 1 and _stream_counts(gm) == (1, 1, 1)
    gm.graph.lint()
    _region_is_well_formed(gm)
    nodes = list(gm.graph.nodes)
    end, join = (next(i for i, n in enumerate(nodes) if n.target is op) for op in (END, JOIN))
    assert [str(n.args[1].target) for n in nodes[end:join] if n.target is aten.linear.default] == [
        "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_b_proj.weight"]
    for b, s in ((1, 5), (3, 2)):
        ids = torch.randint(0, VOCAB, (b, s))
        assert torch.equal(graph_logits(gm, ids), graph_logits(mla_unfused, ids))


def test_mla_near_miss_without_kv_split():
    """An MLA op whose compressed kv is not a split of a projection (nothing to move)."""

    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4 * 24, 32) * 0.1)

        def forward(self, q_nope, q_pe, ckv, kpe):
            return ad.torch_mla(q_nope, q_pe, ckv, kpe, self.w, True, 0.25)

    args = (torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), torch.randn(1, 3, 32), torch.randn(1, 3, 1, 8))
    gm = export_gm(Direct(), *args, dynamic=[{}] * 4)
    assert find_mla_latent_branches(gm) == []
    assert _apply("multi_stream_mla_attn", gm).num_matches == 0


# ---- exported MoE blocks ------------------------------------------------------------------------------------------

BLOCK_SHAPES = [(torch.randn(2, 5, 64),), (torch.randn(1, 3, 64),)]


@pytest.mark.parametrize("family,expected", [("qwen2_moe", 1), ("deepseek_v3", 1), ("mixtral", 0)])
def test_moe_block_counts_rewrite_and_numerics(family, expected):
    gm = export_moe_block(moe_block(family), "autodeploy")
    reference = copy_graph_module(gm)
    assert len(find_moe_shared_experts(gm)) == expected  # Mixtral has no shared expert: the near-miss
    record = _apply("multi_stream_moe", gm)
    assert record.num_matches == expected
    assert _stream_counts(gm) == (expected,) * 3
    gm.graph.lint()
    if expected:
        _region_is_well_formed(gm)
        assert count_op(gm, ad.torch_moe_fused) == 1
    else:
        assert gm.code == reference.code
    assert_same_outputs(reference, gm, BLOCK_SHAPES, tol=1e-6)


def test_qwen2_moe_shared_expert_with_its_gate():
    gm = export_moe_block(moe_block("qwen2_moe"), "autodeploy")
    (_, branch), = find_moe_shared_experts(gm)
    # gate/up/down of the shared expert and its sigmoid gate; the router stays out
    assert sum(n.target is aten.linear.default for n in branch) == 4
    assert any(n.target is aten.sigmoid.default for n in branch)
    assert not any(n.target is aten.softmax.int for n in branch)


def test_moe_then_gemm_do_not_overlap():
    """The shared expert's linears and the router share an input: multi_stream_gemm finds the group
    but leaves it (a region already covers it)."""
    gm = export_moe_block(moe_block("qwen2_moe"), "autodeploy")
    reference = copy_graph_module(gm)
    assert _apply("multi_stream_moe", gm).num_matches == 1
    assert len(find_shared_input_gemms(gm)) == 1
    assert _apply("multi_stream_gemm", gm).num_matches == 0
    assert _stream_counts(gm) == (1, 1, 1)
    assert_same_outputs(reference, gm, BLOCK_SHAPES, tol=1e-6)


# ---- linears sharing an input -------------------------------------------------------------------------------------

class QKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16, bias=False)

    def forward(self, x):
        h = torch.tanh(x)
        return self.q(h) * 2, self.k(h), torch.relu(self.v(h))


class QKVOnInput(QKV):
    """The linears read a graph input: the fork goes after the last placeholder."""

    def forward(self, x):
        return self.q(x) * 2, self.k(x), torch.relu(self.v(x))


class Chained(nn.Module):
    """Two GEMMs, one reading the other: nothing to run side by side."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.b(self.a(torch.tanh(x)))


class DependentBias(nn.Module):
    """Two GEMMs on the same input, but one's bias is the other's output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 16)
        self.w = nn.Parameter(torch.randn(16, 32))

    def forward(self, x):
        h = torch.tanh(x)
        a = self.a(h)
        return F.linear(h, self.w, a[0, 0])


SHAPES = [(torch.randn(2, 5, 32),), (torch.randn(3, 1, 32),)]


def _same(reference, gm, shapes):
    """Bit-equal outputs: on CPU the stream ops do nothing and the same kernels run in another order."""
    for args in shapes:
        with torch.no_grad():
            for a, b in zip(reference(*args), gm(*args)):
                assert torch.equal(a, b)


@pytest.mark.parametrize("cls", [QKV, QKVOnInput], ids=lambda c: c.__name__)
def test_gemm_group_found_and_rewritten(cls):
    gm = export_gm(cls(), torch.randn(2, 5, 32))
    reference = copy_graph_module(gm)
    groups = find_shared_input_gemms(gm)
    assert len(groups) == 1 and len(groups[0][1]) == 3
    record = _apply("multi_stream_gemm", gm)
    assert record.num_matches == 1 and _stream_counts(gm) == (1, 1, 1)
    gm.graph.lint()
    _region_is_well_formed(gm)
    nodes = list(gm.graph.nodes)
    fork, end, join = (next(i for i, n in enumerate(nodes) if n.target is op) for op in (FORK, END, JOIN))
    on_aux = [str(n.args[1].target) for n in nodes[fork:end] if n.target is aten.linear.default]
    on_main = [str(n.args[1].target) for n in nodes[end:join] if n.target is aten.linear.default]
    assert sorted(on_aux) == ["k.weight", "v.weight"] and on_main == ["q.weight"]  # the largest stays on main
    run_shape_prop(gm, incremental=False)
    _same(reference, gm, SHAPES)


def test_gemm_different_dtypes_left_by_fuse_gemms_get_a_region():
    """What fuse_gemms leaves apart (a bfloat16 weight next to float32 ones) is what this is for."""
    gm = export_gm(QKV(), torch.randn(2, 5, 32))
    gm.k.weight = nn.Parameter(gm.k.weight.detach().to(torch.bfloat16), requires_grad=False)
    gm.k.bias = nn.Parameter(gm.k.bias.detach().to(torch.bfloat16), requires_grad=False)
    gm, _ = apply_transform("fuse_gemms", gm)
    assert count_op(gm, aten.linear) == 3  # fuse_gemms left them apart
    assert len(find_shared_input_gemms(gm)) == 1
    assert _apply("multi_stream_gemm", gm).num_matches == 1


@pytest.mark.parametrize("cls", [Chained, DependentBias], ids=lambda c: c.__name__)
def test_gemm_near_misses(cls):
    gm = export_gm(cls(), torch.randn(2, 5, 32))
    before = gm.code
    assert find_shared_input_gemms(gm) == []
    assert _apply("multi_stream_gemm", gm).num_matches == 0
    assert gm.code == before


def test_gemm_cpu_noop():
    gm = export_gm(QKV(), torch.randn(2, 5, 32))
    reference, before = copy_graph_module(gm), gm.code
    gm, record = apply_transform("multi_stream_gemm", gm, enabled=True)  # PipelineContext(): device cpu
    assert record.status == "skipped" and record.error == "CPU: one stream" and gm.code == before
    _same(reference, gm, SHAPES)


# ---- the ops and the defaults ------------------------------------------------------------------------------------

def test_stream_ops_do_nothing_on_cpu():
    x = torch.randn(4)
    count = regions_run()
    ad.fork_to_aux([x])
    ad.end_aux([x])
    ad.join_from_aux([x])
    assert regions_run() == count and torch.equal(x, x.clone())


def test_default_yaml_keeps_them_off_before_compile_model():
    keys = list(yaml.safe_load(open(DEFAULT_YAML))["transforms"])
    for key in KEYS:
        assert key in keys and keys.index("fuse_causal_conv_activation") < keys.index(key) < keys.index("compile_model")
        assert build_transform(key, {}).config.enabled is False
