"""In a build the exported graph module generates its Python code only when it runs or its code is
read, not at every transform's ``recompile`` (``defer_recompile``); it still runs the graph as it is
at that moment, and the build returns a plain GraphModule (``recompile_now``)."""

import copy

import pytest
import torch
from torch import fx, nn

from autodeploy.utils.fx import copy_graph_module, defer_recompile, recompile_now
from helpers import export_gm


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.fixture
def generations(monkeypatch):
    """Each real code generation of a graph module: (number of nodes of its graph)."""
    seen = []
    original = fx.GraphModule.recompile

    def counting(self):
        seen.append(len(self.graph.nodes))
        return original(self)

    monkeypatch.setattr(fx.GraphModule, "recompile", counting)
    return seen


def _double_the_output(gm: fx.GraphModule) -> None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (output.args[0], 2.0))
    output.args = (doubled,)
    gm.recompile()


def test_a_rewrite_is_run_and_shown_though_its_code_was_made_later(generations):
    torch.manual_seed(0)
    module, x = Mlp(), torch.randn(3, 8)
    gm = defer_recompile(export_gm(module, x))
    generations.clear()
    for _ in range(3):  # three rewrites, three recompiles: no code made yet
        _double_the_output(gm)
    assert generations == []
    assert gm.code.count("aten.mul.Tensor") == 3  # reading the code makes it
    assert len(generations) == 1
    torch.testing.assert_close(gm(x), module(x) * 8)
    assert len(generations) == 1  # made once, then run as made
    _double_the_output(gm)
    y = torch.randn(5, 8)
    torch.testing.assert_close(gm(y), module(y) * 16)
    assert len(generations) == 2


def test_copies_of_a_deferring_module_run_their_own_graph():
    torch.manual_seed(0)
    module, x = Mlp(), torch.randn(3, 8)
    gm = defer_recompile(export_gm(module, x))
    deep, sibling = copy.deepcopy(gm), copy_graph_module(gm)
    _double_the_output(gm)
    _double_the_output(sibling)
    _double_the_output(sibling)
    torch.testing.assert_close(deep(x), module(x))
    torch.testing.assert_close(gm(x), module(x) * 2)
    torch.testing.assert_close(sibling(x), module(x) * 4)


def test_a_module_made_plain_again_compiles_with_its_latest_graph(generations):
    """dynamo cannot trace into a module whose code is deferred (torch.fx is on its skip list):
    ``recompile_now`` makes the code and a plain GraphModule, which ``torch.compile`` takes."""
    torch.manual_seed(0)
    module, x = Mlp(), torch.randn(3, 8)
    gm = defer_recompile(export_gm(module, x))
    _double_the_output(gm)
    generations.clear()
    assert recompile_now(gm) is gm and len(generations) == 1
    assert type(gm).__mro__[1] is fx.GraphModule
    compiled = torch.compile(gm, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(x), module(x) * 2)
    generations.clear()  # (dynamo made modules of its own)
    _double_the_output(gm)  # a plain module's recompile makes the code at once, as always
    assert generations == [len(gm.graph.nodes)] and gm.code.count("aten.mul.Tensor") == 2


def test_a_build_makes_the_whole_graph_s_code_only_a_few_times(generations, monkeypatch):
    """Every transform recompiles; the code of the model's graph is made by torch.export itself
    (the ExportedProgram and ``ep.module()`` construct four GraphModules and recompile once), by
    the exporter's own clean-up, when the build first runs the graph (the cache consistency
    check) and when the build returns it: not at each of the ~40 recompiles (~60 ms each on a
    48-layer model)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from autodeploy.transform.interface import Stage
    from helpers import build

    marks = []
    original = _LazyGraphModule.recompile.__func__

    def marking(cls):
        marks.append(cls)
        return original(cls)

    monkeypatch.setattr(_LazyGraphModule, "recompile", classmethod(marking))
    res = build("tiny-llama", up_to=Stage.CACHE_INIT, max_seq_len=64, max_batch_size=2)
    nodes = len(res.graph_module.graph.nodes)
    whole = [n for n in generations if n > nodes // 2]
    assert len(whole) <= 8, whole  # the code was made only a few times...
    assert len(marks) >= 20, len(marks)  # ...though the transforms recompiled
    assert not isinstance(res.graph_module, _LazyGraphModule)  # a plain GraphModule leaves the build
