"""run_shape_prop is incremental: unchanged nodes keep their values, changed ones (and what they
change downstream) are recomputed, and the result equals a full propagation."""

import pytest
import torch
from torch import nn
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autodeploy.transform import graph_utils
from autodeploy.transform.graph_utils import run_shape_prop
from helpers import apply_transform, export_gm
from test_match_rope_pattern import LlamaRope, bnsd


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h).reshape(x.shape[0], -1, 4, 4).sum(-1)


def _metas(gm, hinted_strides=False):
    """Each node's value: shape and strides as expressions, dtype. ``hinted_strides``: strides as
    their values at the example sizes instead (a trace and a propagation may write one stride as
    different but equal expressions, e.g. ``16`` and ``Min(16, 64*s70)`` where ``s70 >= 1``)."""
    def stride(s):
        if hinted_strides and isinstance(s, torch.SymInt):
            return str(s.node.hint)
        return str(s)

    def meta(v):
        if isinstance(v, torch.Tensor):
            return (tuple(str(s) for s in v.shape), tuple(stride(s) for s in v.stride()), v.dtype)
        if isinstance(v, (list, tuple)):
            return tuple(meta(x) for x in v)
        return str(v)

    return {n.name: meta(n.meta.get("val")) for n in gm.graph.nodes}


def _assert_equals_a_full_propagation(gm, hinted_strides=False):
    """The values in the graph now equal those of a propagation that recomputes every node."""
    incremental = _metas(gm, hinted_strides)
    for n in gm.graph.nodes:
        n.meta.pop(graph_utils._PROP_MEMO, None)
    run_shape_prop(gm, incremental=False)
    assert _metas(gm, hinted_strides) == incremental


def _count_computed(monkeypatch):
    calls = []
    original = FakeTensorProp.run_node

    def counting(self, n):
        calls.append(n.name)
        return original(self, n)

    monkeypatch.setattr(FakeTensorProp, "run_node", counting)
    return calls


def test_unchanged_graph_recomputes_nothing(monkeypatch):
    gm = export_gm(Block(), torch.randn(2, 5, 16))
    run_shape_prop(gm)
    before = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    calls = _count_computed(monkeypatch)
    run_shape_prop(gm)
    computed = [c for c in calls if c in before]
    assert computed == []
    assert all(n.meta["val"] is before[n.name] for n in gm.graph.nodes if n.op == "call_function")


def test_changed_literal_is_recomputed_and_flows_downstream(monkeypatch):
    gm = export_gm(Block(), torch.randn(2, 5, 16))
    run_shape_prop(gm)
    reshape = next(n for n in gm.graph.nodes if n.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default))
    total = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.sum.dim_IntList)
    assert total.meta["val"].shape[-1] == 4
    sizes = list(reshape.args[1])
    sizes[-2:] = [2, 8]  # a near miss of "unchanged": same inputs, a different literal
    reshape.args = (reshape.args[0], sizes)
    gm.recompile()
    calls = _count_computed(monkeypatch)
    run_shape_prop(gm)
    assert reshape.name in calls and total.name in calls
    assert total.meta["val"].shape[-1] == 2
    upstream = [n.name for n in gm.graph.nodes if n.target in (torch.ops.aten.linear.default, torch.ops.aten.relu.default)]
    assert len(upstream) == 3 and not set(upstream) & set(calls)  # nothing before the change was redone


def test_incremental_equals_full_after_a_rewrite():
    gm = export_gm(LlamaRope(), *bnsd(2, 6))
    run_shape_prop(gm)
    gm, record = apply_transform("match_rope_pattern", gm)
    assert record.num_matches == 1
    run_shape_prop(gm)  # incremental: the rope op is new, the rest is reused
    _assert_equals_a_full_propagation(gm)


def test_a_replaced_weight_is_seen(monkeypatch):
    gm = export_gm(Block(), torch.randn(2, 5, 16))
    run_shape_prop(gm)
    lin = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    assert lin.meta["val"].dtype == torch.float32
    gm.a.weight = nn.Parameter(gm.a.weight.detach().double())  # what a dtype-changing load would do
    gm.a.bias = nn.Parameter(gm.a.bias.detach().double())
    run_shape_prop(gm)
    assert lin.meta["val"].dtype == torch.float64


class BiaslessProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(16, 32, bias=False), nn.Linear(32, 16)

    def forward(self, x):
        return self.o(torch.relu(self.q(x)))


def test_composite_ops_take_their_python_decompositions_and_the_dims_stay_symbolic():
    """The propagation runs under the Python dispatcher, as torch.export does: ``aten.matmul`` (also
    behind ``aten.linear``) takes its Python decomposition, which keeps symbolic sizes symbolic.
    torch 2.11's C++ path for an N-d by a 2-d matmul read concrete sizes instead, raising "Cannot
    call numel() on tensor with symbolic sizes/strides" or specialising the sequence dim to the
    export's example length; torch 2.13's does not, so the Python kernel is counted here."""
    from torch._C import DispatchKey

    gm = export_gm(BiaslessProjection(), torch.randn(2, 5, 16))
    matmul = torch.ops.aten.matmul.default
    decomposition = matmul.py_kernels[DispatchKey.CompositeImplicitAutograd]
    calls = []

    def counted(*args, **kwargs):
        calls.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        return decomposition(*args, **kwargs)

    matmul.py_kernels[DispatchKey.CompositeImplicitAutograd] = counted
    matmul._dispatch_cache.clear()  # the op caches the kernel it resolved
    try:
        run_shape_prop(gm, incremental=False)
    finally:
        matmul.py_kernels[DispatchKey.CompositeImplicitAutograd] = decomposition
        matmul._dispatch_cache.clear()
    assert [c[1:] for c in calls] == [[(16, 32)]]  # the bias-less projection (the biased one folds into addmm)
    out = [n for n in gm.graph.nodes if n.op == "call_function"][-1].meta["val"]
    assert all(isinstance(d, torch.SymInt) for d in out.shape[:2]) and out.shape[2] == 16
    shape_env = out.shape[0].node.shape_env
    assert not shape_env.replacements  # no symbol was specialised to its example value


def test_traced_values_are_adopted_so_nothing_is_recomputed(monkeypatch):
    gm = export_gm(Block(), torch.randn(2, 5, 16), clean=False)
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr")]
    traced = {n.name: n.meta["val"] for n in nodes}
    assert graph_utils.adopt_traced_values(gm) == len(nodes)
    calls = _count_computed(monkeypatch)
    run_shape_prop(gm)
    assert [c for c in calls if c in traced] == []
    assert all(n.meta["val"] is traced[n.name] for n in nodes)
    _assert_equals_a_full_propagation(gm)


def test_adopted_values_do_not_hide_a_change(monkeypatch):
    gm = export_gm(Block(), torch.randn(2, 5, 16), clean=False)
    graph_utils.adopt_traced_values(gm)
    reshape = next(n for n in gm.graph.nodes if n.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default))
    reshape.args = (reshape.args[0], [*reshape.args[1][:-2], 2, 8])
    gm.a.weight = nn.Parameter(gm.a.weight.detach().double())
    gm.a.bias = nn.Parameter(gm.a.bias.detach().double())
    gm.recompile()
    run_shape_prop(gm)
    first = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    total = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.sum.dim_IntList)
    assert first.meta["val"].dtype == torch.float64 and total.meta["val"].shape[-1] == 2


def test_values_of_another_fake_mode_are_not_adopted():
    gm = export_gm(Block(), torch.randn(2, 5, 16), clean=False)
    relu = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.relu.default)
    with torch._subclasses.fake_tensor.FakeTensorMode() as other:
        relu.meta["val"] = torch.empty(3, 3)
    assert relu.meta["val"].fake_mode is other
    count = graph_utils.adopt_traced_values(gm)
    assert graph_utils._PROP_MEMO not in relu.meta
    # its users read a value of another mode: not adopted either
    assert all(graph_utils._PROP_MEMO not in u.meta for u in relu.users)
    assert 0 < count < sum(n.op in ("call_function", "get_attr") for n in gm.graph.nodes) - 1


def test_the_first_propagation_of_a_build_redoes_only_what_the_cleanups_changed(monkeypatch):
    """export_to_gm adopts the export's values: the first propagation of the pipeline (before the
    first pattern matcher) recomputes a small part of the graph, and its values equal a full one."""
    from autodeploy.transform.interface import Stage
    from helpers import build

    gm = build("tiny-llama", up_to=Stage.POST_EXPORT).graph_module
    calls = _count_computed(monkeypatch)
    run_shape_prop(gm)
    computed = [n for n in gm.graph.nodes if n.name in set(calls) and n.op == "call_function"]
    total = sum(n.op == "call_function" for n in gm.graph.nodes)
    assert 0 < len(computed) < total // 4, (len(computed), total)
    _assert_equals_a_full_propagation(gm)


def _devices(gm):
    def device(v):
        if isinstance(v, torch.Tensor):
            return str(v.device)
        if isinstance(v, (list, tuple)):
            return tuple(device(x) for x in v)
        return None

    return {n.name: device(n.meta.get("val")) for n in gm.graph.nodes}


@pytest.mark.parametrize("model", ["tiny-llama", "qwen3_moe-fp8_block", "deepseek_v3-nvfp4", "coverage:qwen3_next",
                                   "coverage:mamba2"])
def test_loading_moves_the_values_so_the_next_propagation_recomputes_nothing(monkeypatch, model):
    """load_weights moves the graph to the weights' device (meta -> cpu): every value is moved with
    it (same shape and strides on the new device), and the loaded weights match their moved
    values, so the first propagation after loading recomputes no node; the values (devices
    included) equal a full propagation's, for dense, MoE (quantized experts), MLA and state-space
    graphs. Without the move it recomputed every node."""
    import quant_expert_checkpoints as qe
    from autodeploy.transform.interface import Stage
    from helpers import build

    from helpers import coverage_checkpoint

    if model.startswith("coverage:"):  # state caches: SSM (Mamba2), gated delta rule + attention (Qwen3-Next)
        source = coverage_checkpoint(model.split(":")[1])[0]
    elif "-" in model and model != "tiny-llama":  # quantized experts; DeepSeek-V3 with MLA
        source = qe.quantized_checkpoint(*model.split("-"))
    else:
        source = model
    gm = build(source, up_to=Stage.WEIGHT_LOAD, max_seq_len=64, max_batch_size=2).graph_module
    assert {d for d in _devices(gm).values() if isinstance(d, str)} == {"cpu"}
    calls = _count_computed(monkeypatch)
    run_shape_prop(gm)
    computed = [n.name for n in gm.graph.nodes if n.name in set(calls) and n.op == "call_function"]
    assert computed == []
    devices = _devices(gm)
    _assert_equals_a_full_propagation(gm, hinted_strides=True)  # the export's stride expressions are kept
    assert _devices(gm) == devices


class DataDependent(nn.Module):
    """The rows of ``x`` chosen by its data (an unbacked size ``u0``), then a view whose storage
    offset is an expression of ``u0`` (``Min(1, 4*u0)``, as in JetMoE's routed tokens)."""

    def forward(self, x):
        rows = x[torch.nonzero(x[:, 0] > 0)[:, 0]]
        y = rows.reshape(-1, 4, 4).transpose(0, 1).reshape(4, -1)[:, 1:]
        return y.sum(-1) + x.sum()


def _data_dependent_graph():
    gm = export_gm(DataDependent(), torch.randn(6, 16))
    run_shape_prop(gm)
    offsets = [n.meta["val"].storage_offset() for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert any(isinstance(o, torch.SymInt) and "u0" in str(o) for o in offsets)  # the case under test is there
    return gm


def test_values_with_data_dependent_offsets_move_too(monkeypatch):
    """An offset that depends on data is not guarded on (``Min(1, 4*u0) != 0`` cannot be decided):
    the values move whole, and the next propagation recomputes nothing."""
    gm = _data_dependent_graph()
    graph_utils.move_graph_to_device(gm, torch.device("meta"))
    assert {d for d in _devices(gm).values() if d is not None} == {"meta"}
    calls = _count_computed(monkeypatch)
    run_shape_prop(gm)
    assert [n.name for n in gm.graph.nodes if n.name in set(calls) and n.op == "call_function"] == []
    _assert_equals_a_full_propagation(gm)


def test_a_value_that_cannot_be_moved_leaves_them_all_for_the_next_propagation(monkeypatch):
    """When one value's move has to decide a data-dependent size, no value is moved (a graph of
    values on two devices would be wrong); the inputs are, and the next propagation recomputes
    the rest on the new device. The failure is injected into the last value's move, so the
    values before it were already computed when it happens."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    gm = _data_dependent_graph()
    before = _devices(gm)
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1].meta["val"]
    fake_on = graph_utils._fake_on

    def failing(v, device):
        if v is last:
            raise GuardOnDataDependentSymNode("injected: Could not guard on data-dependent expression")
        return fake_on(v, device)

    monkeypatch.setattr(graph_utils, "_fake_on", failing)
    graph_utils.move_graph_to_device(gm, torch.device("meta"))
    monkeypatch.setattr(graph_utils, "_fake_on", fake_on)
    after = _devices(gm)
    assert {n: d for n, d in after.items() if d == "meta"} == {"x": "meta"}
    assert {n: d for n, d in after.items() if n != "x"} == {n: d for n, d in before.items() if n != "x"}
    calls = _count_computed(monkeypatch)
    run_shape_prop(gm)
    assert "add" in calls  # recomputed, now on the inputs' device
    assert {d for d in _devices(gm).values() if d is not None} == {"meta"}
    _assert_equals_a_full_propagation(gm)
