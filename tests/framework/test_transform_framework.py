"""The transform contract: registry, stage order, ordering constraints, lazy cleanup and shape
propagation, skip_on_error, history, visualisation, memory warnings, summary table."""

import logging
import os
from typing import ClassVar

import pytest
import torch
from torch import fx, nn

from autodeploy.transform.interface import (
    BaseTransform,
    PipelineContext,
    Stage,
    TransformConfig,
    TransformInfo,
    TransformRegistry,
)
from autodeploy.transform.optimizer import InferenceOptimizer, format_summary
from autodeploy.utils.errors import ConfigError
from helpers import export_gm


class _Probe(nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


def _gm():
    return export_gm(_Probe(), torch.randn(2, 3, 4))


class AddDeadNodeConfig(TransformConfig):
    stage: Stage = Stage.POST_EXPORT
    marker: int = 0


@TransformRegistry.register("_test_add_dead_node")
class AddDeadNode(BaseTransform):
    """Adds a dead node and reports the graph dirty: the base class must clean it lazily."""

    config_class = AddDeadNodeConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(x):
            gm.graph.call_function(torch.ops.aten.neg.default, (x,))
        return TransformInfo(num_matches=1, is_clean=False, has_valid_shapes=False)


class NeedsShapesConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER
    requires_shape_prop: bool = True


@TransformRegistry.register("_test_needs_shapes")
class NeedsShapes(BaseTransform):
    config_class = NeedsShapesConfig
    run_after = ("_test_add_dead_node",)
    seen_vals: ClassVar[list] = []

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        NeedsShapes.seen_vals = [n.meta.get("val") is not None for n in gm.graph.nodes if n.op == "call_function"]
        dead = [n for n in gm.graph.nodes if n.op == "call_function" and not n.users]
        assert not dead, "requires_clean_graph: the dead node must be gone before this runs"
        return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)


class FailsConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("_test_fails")
class Fails(BaseTransform):
    config_class = FailsConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        raise RuntimeError("boom: this transform always fails")


class GrowsConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION


@TransformRegistry.register("_test_grows_memory")
class GrowsMemory(BaseTransform):
    config_class = GrowsConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        gm.register_buffer("_blob", torch.zeros(1 << 19))  # 2 MiB
        return TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)


@TransformRegistry.register("_test_grows_memory_then_fails")
class GrowsMemoryThenFails(BaseTransform):
    config_class = GrowsConfig
    run_after = ("_test_grows_memory",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        gm.register_buffer("_blob_of_a_failure", torch.zeros(1 << 20))  # 4 MiB
        raise RuntimeError("boom after allocating")


@TransformRegistry.register("_test_grows_memory_last")
class GrowsMemoryLast(BaseTransform):
    config_class = GrowsConfig
    run_after = ("_test_grows_memory_then_fails",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        gm.register_buffer("_last_blob", torch.zeros(1 << 19))  # 2 MiB
        return TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)


def _run(pipeline, gm=None):
    ctx = PipelineContext()
    out = InferenceOptimizer(pipeline)(ctx, gm if gm is not None else _gm())
    return out, ctx


def test_registry_and_stage_order_is_stable_and_independent_of_yaml_order():
    opt = InferenceOptimizer({"_test_needs_shapes": {}, "_test_add_dead_node": {}, "cleanup_noop_add": {}})
    keys = [t.get_transform_key() for t in opt.transforms]
    assert keys == ["_test_add_dead_node", "cleanup_noop_add", "_test_needs_shapes"]
    assert [t.config.stage for t in opt.transforms] == sorted(t.config.stage for t in opt.transforms)


def test_lazy_cleanup_and_shape_prop_before_a_transform_that_needs_them():
    gm, ctx = _run({"_test_add_dead_node": {}, "_test_needs_shapes": {}})
    assert NeedsShapes.seen_vals and all(NeedsShapes.seen_vals)
    assert [r.key for r in ctx.history] == ["_test_add_dead_node", "_test_needs_shapes"]


def test_ordering_constraint_is_checked_at_config_time():
    with pytest.raises(ConfigError, match="must run after '_test_add_dead_node'"):
        InferenceOptimizer({"_test_add_dead_node": {"stage": "compile"}, "_test_needs_shapes": {}})


def test_required_transform_missing_is_an_error():
    with pytest.raises(ConfigError, match="requires 'build_model'"):
        InferenceOptimizer({"export_to_gm": {}})


def test_unknown_key_and_bad_field_are_reported_with_close_matches():
    with pytest.raises(ConfigError, match=r"unknown transform '_test_add_dead_nod'.*_test_add_dead_node"):
        InferenceOptimizer({"_test_add_dead_nod": {}})
    with pytest.raises(ConfigError, match=r"transforms._test_add_dead_node.markr: unknown field.*marker"):
        InferenceOptimizer({"_test_add_dead_node": {"markr": 1}})
    with pytest.raises(ConfigError, match=r"transforms._test_add_dead_node.marker: .*integer"):
        InferenceOptimizer({"_test_add_dead_node": {"marker": "many"}})
    with pytest.raises(ConfigError, match=r"transforms._test_add_dead_node.stage"):
        InferenceOptimizer({"_test_add_dead_node": {"stage": "nowhere"}})


def test_skip_on_error_records_failure_and_continues():
    gm, ctx = _run({"_test_fails": {"skip_on_error": True}, "_test_needs_shapes": {}})
    records = {r.key: r for r in ctx.history}
    assert records["_test_fails"].status == "failed" and "boom" in records["_test_fails"].error
    assert records["_test_needs_shapes"].status == "ok", "the pipeline goes on after a skipped failure"
    with pytest.raises(RuntimeError, match="boom"):
        _run({"_test_fails": {}})


def test_disabled_transform_is_recorded_not_run():
    gm, ctx = _run({"_test_fails": {"enabled": False}})
    assert ctx.history[0].status == "disabled"


def test_history_is_kept_in_graph_meta():
    gm, ctx = _run({"_test_add_dead_node": {}, "cleanup_noop_add": {}})
    assert [r.key for r in gm.meta["autodeploy_history"]] == ["_test_add_dead_node", "cleanup_noop_add"]


def test_debug_visualize_dir_writes_dot_and_text(tmp_path):
    _run({"_test_add_dead_node": {"debug_visualize_dir": str(tmp_path)}})
    dot = (tmp_path / "_test_add_dead_node.dot").read_text()
    txt = (tmp_path / "_test_add_dead_node.txt").read_text()
    assert dot.startswith("digraph") and "relu" in dot
    assert "relu" in txt and "def forward" in txt


def test_memory_change_warns_unless_expected(caplog):
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        _run({"_test_grows_memory": {}})
    assert any("changed model memory by +2.0 MiB" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        gm, ctx = _run({"_test_grows_memory": {"expect_mem_change": True}})
    assert not any("changed model memory" in r.getMessage() for r in caplog.records)
    assert ctx.history[0].mem_delta_mb == pytest.approx(2.0)


def test_each_transform_reports_its_own_memory_change():
    """The driver reuses one transform's "after" count as the next one's "before": each delta is
    still the transform's own, also after a failed transform that allocated before failing."""
    grow = {"expect_mem_change": True}
    gm, ctx = _run({"_test_grows_memory": grow, "_test_grows_memory_last": grow})
    assert [r.mem_delta_mb for r in ctx.history] == pytest.approx([2.0, 2.0])
    gm, ctx = _run({"_test_grows_memory": grow, "_test_grows_memory_then_fails": {**grow, "skip_on_error": True},
                    "_test_grows_memory_last": grow})
    assert [r.status for r in ctx.history] == ["ok", "failed", "ok"]
    assert ctx.history[2].mem_delta_mb == pytest.approx(2.0)  # not the failed transform's 4 MiB too


def test_summary_table_lists_each_transform():
    gm, ctx = _run({"_test_add_dead_node": {}, "_test_fails": {"skip_on_error": True}, "cleanup_noop_add": {"enabled": False}})
    table = format_summary(ctx.history)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["transform", "stage", "matches"]
    assert any(line.startswith("_test_add_dead_node") and " 1 " in line for line in lines)
    assert any("failed: boom" in line for line in lines)
    assert any(line.startswith("cleanup_noop_add") and "disabled" in line for line in lines)
    assert lines[-1].startswith("total")


def test_a_transform_needing_a_graph_fails_clearly_without_one():
    with pytest.raises(RuntimeError, match="needs an exported graph"):
        InferenceOptimizer({"cleanup_noop_add": {}})(PipelineContext(), nn.Linear(2, 2))


def test_every_registered_transform_has_a_stage_and_a_docstring():
    import sys

    import autodeploy.transform.library  # noqa: F401

    for key, cls in TransformRegistry.items():
        if key.startswith("_test"):
            continue
        assert isinstance(cls.get_config_class().model_fields["stage"].default, Stage), key
        doc = sys.modules[cls.__module__].__doc__ or ""
        assert f"``{key}``" in doc, f"{key}: module docstring must name the key and show before/after"
        assert os.path.basename(sys.modules[cls.__module__].__file__) == f"{key}.py", "one transform per file, named after its key"


class NoMatchConfig(TransformConfig):
    stage: Stage = Stage.POST_EXPORT


@TransformRegistry.register("_test_no_match")
class NoMatch(BaseTransform):
    """Matches nothing and (as transforms do) reports a clean graph with valid shapes."""

    config_class = NoMatchConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)


def test_a_transform_that_matched_nothing_keeps_stale_shapes_stale():
    CheckShapes.widths = []
    _run({"_test_widen": {}, "_test_no_match": {}, "_test_check_shapes": {}})
    assert CheckShapes.widths == [8]


class RetargetConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("_test_retarget")
class Retarget(BaseTransform):
    """Changes an op without changing shapes, and says (truthfully) it broke no shapes."""

    config_class = RetargetConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.relu.default)
        node.target = torch.ops.aten.abs.default
        return TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)


class WidenConfig(TransformConfig):
    stage: Stage = Stage.POST_EXPORT


@TransformRegistry.register("_test_widen")
class Widen(BaseTransform):
    """Feeds relu a tensor twice as wide: every shape after it changes (and it says so)."""

    config_class = WidenConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        relu = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.relu.default)
        x = relu.args[0]
        with gm.graph.inserting_before(relu):
            wide = gm.graph.call_function(torch.ops.aten.cat.default, ([x, x], -1))
        relu.replace_input_with(x, wide)
        return TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=False)


class CheckShapesConfig(TransformConfig):
    stage: Stage = Stage.SHARDING
    requires_shape_prop: bool = True


@TransformRegistry.register("_test_check_shapes")
class CheckShapes(BaseTransform):
    config_class = CheckShapesConfig
    widths: ClassVar[list] = []

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        ops = (torch.ops.aten.abs.default, torch.ops.aten.relu.default)
        node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops)
        CheckShapes.widths.append(node.meta["val"].shape[-1])
        return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)


def test_a_shape_preserving_transform_does_not_vouch_for_stale_shapes():
    # _test_widen leaves shapes stale; _test_retarget changes no shape and says so; the shapes
    # _test_check_shapes sees must be the widened ones (8), not the stale ones (4).
    CheckShapes.widths = []
    _run({"_test_widen": {}, "_test_retarget": {}, "_test_check_shapes": {}})
    assert CheckShapes.widths == [8]


def test_a_graph_shape_propagation_cannot_handle_skips_the_transform_not_the_build(monkeypatch, caplog):
    """Some ops' fake kernels need concrete sizes (RWKV, Bloom): a transform that needs shapes is
    then skipped with the reason, the graph is left as it was, and the pipeline goes on."""
    import autodeploy.transform.interface as interface

    def broken(gm):
        raise RuntimeError("SymIntArrayRef expected to contain only concrete integers\nmore")

    monkeypatch.setattr(interface, "run_shape_prop", broken)
    NeedsShapes.seen_vals = []
    gm = _gm()
    x = torch.randn(2, 3, 4)
    ref = gm(x)
    with caplog.at_level(logging.WARNING):
        out, ctx = _run({"_test_add_dead_node": {}, "_test_needs_shapes": {}}, gm)
    record = ctx.history[-1]
    assert record.key == "_test_needs_shapes" and record.status == "skipped"
    assert record.error == "shape propagation failed (RuntimeError: SymIntArrayRef expected to contain only " \
                           "concrete integers)"
    assert NeedsShapes.seen_vals == []  # it never ran
    assert "transform _test_needs_shapes skipped" in caplog.text
    torch.testing.assert_close(out(x), ref)


@pytest.mark.parametrize("owned", [True, False])
def test_nodes_created_lists_the_new_nodes_in_order(owned):
    """Through the module's create-node hook, or (a graph without a module) by comparing; nodes made
    after the block are not listed, and the hook is gone after it."""
    from autodeploy.transform.graph_utils import nodes_created

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    graph = gm.graph
    if not owned:
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
    x = next(n for n in graph.nodes if n.op == "placeholder")
    relu = next(n for n in graph.nodes if n.op == "call_function")
    assert (graph.owning_module is not None) == owned
    with nodes_created(graph) as created:
        with graph.inserting_after(relu):
            b = graph.call_function(torch.neg, (relu,))
        with graph.inserting_after(x):
            a = graph.call_function(torch.abs, (x,))
    with graph.inserting_after(b):
        graph.call_function(torch.exp, (b,))
    assert set(created) == {a, b} and len(created) == 2
    if owned:
        assert created == [b, a] and gm._create_node_hooks == []
