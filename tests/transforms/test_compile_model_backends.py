"""compile_model backends on the tiny llama: torch-simple runs autodeploy's ops as direct Python
calls with the same outputs and cache writes as the dispatched graph; torch-compile serves the
same tokens as torch-simple and never compiles after the build's warm-up; the CUDA-only backends are config errors on CPU;
the device-agnostic parts of the CUDA-graph runners (decode padding per batch bucket,
piecewise padding per token bucket) checked on CPU with ``eager_capture``.
"""

import copy
import random

import pytest
import torch
from torch._dynamo.utils import counters

from autodeploy import LLM, SamplingParams
from autodeploy.cache import build_sequence_info
from autodeploy.compile.backends import CompiledGraph
from autodeploy.compile.cuda_graph import DecodeGraphs, eager_capture
from autodeploy.compile import compile_graph
from autodeploy.compile.direct_kernels import direct_kernel_graph, python_kernel
from autodeploy.compile.piecewise import PiecewiseGraphs, _FrozenPiece
from autodeploy.transform.graph_utils import get_attr_value
from autodeploy.transform.interface import PipelineContext
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.errors import ConfigError
from helpers import rel_rmse

MAX_SEQ_LEN = 64
PROMPTS = ["The for statement", "Hello there, my friend, how are you doing today", "a"]


@pytest.fixture(scope="module")
def simple():
    return LLM("tiny-llama", max_seq_len=MAX_SEQ_LEN, compile_backend="torch-simple")


@pytest.fixture(scope="module")
def compiled():
    before = counters["stats"]["unique_graphs"]
    llm = LLM("tiny-llama", max_seq_len=MAX_SEQ_LEN, compile_backend="torch-compile")
    return llm, counters["stats"]["unique_graphs"] - before


def _greedy(llm):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 9, 14)]
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


# ---- torch-compile -------------------------------------------------------------------------------
def test_torch_compile_same_tokens_and_no_compile_while_serving(simple, compiled):
    llm, compiled_at_build = compiled
    assert isinstance(llm.build.graph, CompiledGraph) and llm.build.graph.backend == "torch-compile"
    record = next(r for r in llm.build.context.history if r.key == "compile_model")
    assert record.status == "ok" and record.num_matches == 1
    assert compiled_at_build >= 1  # the warm-up compiled (so the counter below can move)
    expected = _greedy(simple)
    assert [len(t) for t in expected] == [4, 9, 14]  # decode batches of 3, 2 and 1
    before = counters["stats"]["unique_graphs"]
    got = _greedy(llm)
    assert counters["stats"]["unique_graphs"] == before, "torch-compile compiled while serving"
    assert got == expected


# ---- config errors -------------------------------------------------------------------------------
def _compile(res, **cfg):
    ctx = PipelineContext(cache=copy.copy(res.cache))
    return build_transform("compile_model", cfg)(res.graph, ctx)


@pytest.mark.parametrize("backend", ["torch-cudagraph", "torch-opt"])
def test_cuda_graph_backends_on_cpu_are_config_errors(simple, backend):
    with pytest.raises(ConfigError, match=rf"'{backend}'.*cuda"):
        _compile(simple.build, backend=backend)


def test_piecewise_with_torch_compile_is_a_config_error(simple):
    with pytest.raises(ConfigError, match="piecewise_enabled"):
        _compile(simple.build, backend="torch-compile", piecewise_enabled=True)


# ---- DecodeGraphs / PiecewiseGraphs with eager capture -----------------------------------------------
class _Recorder:
    """The plain graph, remembering the input_ids tensor of every call."""

    def __init__(self, gm):
        self.gm, self.calls = gm, []

    def __call__(self, *args):
        self.calls.append(args[0])
        return self.gm(*args)


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def _reset(cache):
    for t in cache.caches.values():
        t.zero_()


def _run(fn, cache, info):
    with torch.no_grad():
        return fn(*cache.graph_args(info)).clone()


@pytest.fixture
def setup(simple):
    """The torch-simple build's graph and a cache view with its own page reservation."""
    res = simple.build
    assert res.cache.gathered_logits
    cache = copy.copy(res.cache)
    cache.reserved_pages = 0
    _reset(cache)
    assert isinstance(res.graph, CompiledGraph)  # torch-simple with direct kernels
    return res.graph.graph, cache


def test_decode_graphs_pad_to_buckets(setup):
    gm, cache = setup
    code = gm.code
    allocatable = cache.allocatable_pages
    rec = _Recorder(gm)
    dg = DecodeGraphs(rec, cache, [2, 4, 8], capture=eager_capture)
    assert dg.batch_sizes == [2, 4, 8]
    assert dg.scratch_page == cache.num_pages - 1
    assert cache.allocatable_pages == allocatable - 1  # the scratch page is out of the allocator
    assert dg.scratch_page >= cache.allocatable_pages

    free = list(range(cache.allocatable_pages))
    random.Random(0).shuffle(free)
    lengths = [7, 12, 3, 18, 5]
    prompts = [_ids(n, seed=i) for i, n in enumerate(lengths)]
    tables = [[free.pop() for _ in range(-(-(n + 1) // cache.page_size))] for n in lengths]
    prefill = build_sequence_info(prompts, [0] * 5, tables)
    n_calls = len(rec.calls)
    out = _run(dg, cache, prefill)  # a prefill step falls through to the plain model
    assert len(rec.calls) == n_calls + 1 and rec.calls[-1] is prefill.input_ids
    assert out.shape == (1, 5, 512)
    _reset(cache)
    torch.testing.assert_close(out, _run(gm, cache, prefill), rtol=0, atol=0)

    for batch, bucket in ((1, 2), (3, 4), (5, 8)):
        info = build_sequence_info([[40 + i] for i in range(batch)], lengths[:batch], tables[:batch])
        ref = _run(gm, cache, info)
        n_calls = len(rec.calls)
        got = _run(dg, cache, info)
        assert dg.bucket_for(batch) == bucket
        assert len(rec.calls) == n_calls + 1 and rec.calls[-1] is dg._static[bucket][0]  # replayed
        assert got.shape == ref.shape == (1, batch, 512)
        assert rel_rmse(got, ref) < 1e-5, batch
        # the padding rows wrote only the scratch page: the real sequences' history is intact
        assert rel_rmse(_run(gm, cache, info), ref) < 1e-6
    assert gm.code == code


def test_piecewise_graphs_prefill_and_mixed_steps(setup):
    gm, cache = setup
    code = gm.code
    rec = _Recorder(gm)
    pw = PiecewiseGraphs(rec, gm, cache, [16, 32, 64], capture=eager_capture)
    assert pw.buckets == [16, 32, 64]
    assert pw.scratch_page == cache.num_pages - 1 and cache.allocatable_pages == cache.num_pages - 1
    assert any(isinstance(m, _FrozenPiece) for m in pw.split.children())
    free = list(range(cache.allocatable_pages))
    random.Random(1).shuffle(free)
    tab = {k: [free.pop() for _ in range(4)] for k in "abcde"}

    def compare(history, step, bucket):
        """Run ``history`` steps then ``step`` with the plain graph, reset, replay history
        with the plain graph and ``step`` piecewise."""
        results = []
        for fn in (gm, pw):
            _reset(cache)
            for h in history:
                _run(gm, cache, h)
            n_calls = len(rec.calls)
            results.append(_run(fn, cache, step))
            assert len(rec.calls) == n_calls  # the recorder wraps neither
        ref, got = results
        assert pw.bucket_for(step.num_tokens) == bucket
        assert got.shape == ref.shape == (1, step.logits_index.numel(), 512)
        assert rel_rmse(got, ref) < 1e-5
        frozen = [m for m in pw.split.children() if isinstance(m, _FrozenPiece)]
        assert all(bucket in m.runners for m in frozen)

    a, b, c = _ids(30, 1), _ids(9, 2), _ids(5, 3)
    # two fresh prefills, 14 tokens -> bucket 16
    compare([], build_sequence_info([a[:9], c], [0, 0], [tab["a"], tab["c"]]), 16)
    # a chunked prefill continuing at 9 with two decodes, 21 + 2 tokens -> bucket 32
    first = build_sequence_info([a[:9], b, c], [0, 0, 0], [tab["a"], tab["b"], tab["c"]])
    mixed = build_sequence_info([a[9:], [11], [12]], [9, 9, 5], [tab["a"], tab["b"], tab["c"]])
    compare([first], mixed, 32)
    # the same step scoring the chunk's prompt tokens: 21 + 2 rows of logits (logits_index shifted past the padding)
    scoring = build_sequence_info([a[9:], [11], [12]], [9, 9, 5], [tab["a"], tab["b"], tab["c"]],
                                  all_logits=[True, False, False])
    assert scoring.logits_index.numel() == 23
    compare([first], scoring, 32)
    # 40 tokens of fresh prefills plus a decode -> bucket 64
    big = build_sequence_info([a, _ids(10, 4), [13]], [0, 0, 5], [tab["d"], tab["e"], tab["c"]])
    compare([build_sequence_info([c], [0], [tab["c"]])], big, 64)
    assert gm.code == code


def test_piecewise_graphs_fall_through(setup):
    gm, cache = setup
    rec = _Recorder(gm)
    pw = PiecewiseGraphs(rec, gm, cache, [16, 32, 64], capture=eager_capture)
    free = list(range(cache.allocatable_pages))
    tables = [[free.pop() for _ in range(4)] for _ in range(3)]
    steps = {
        # no room for a padding token in the largest bucket
        "64 tokens": build_sequence_info([_ids(40, 1), _ids(24, 2)], [0, 0], tables[:2]),
        "70 tokens": build_sequence_info([_ids(35, 3), _ids(35, 4)], [0, 0], tables[:2]),
        "decode only": build_sequence_info([[1], [2], [3]], [3, 4, 5], tables),
    }
    for name, info in steps.items():
        assert pw.bucket_for(info.num_tokens) is None or info.num_tokens == info.num_sequences, name
        _reset(cache)
        n_calls = len(rec.calls)
        got = _run(pw, cache, info)
        assert len(rec.calls) == n_calls + 1 and rec.calls[-1] is info.input_ids, name
        _reset(cache)
        torch.testing.assert_close(got, _run(gm, cache, info), rtol=0, atol=0)
    assert all(not m.runners for m in pw.split.children() if isinstance(m, _FrozenPiece))


# ---- torch-simple: direct kernels ----------------------------------------------------------------
def _is_ours(target):
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "autodeploy"


def test_torch_simple_runs_python_kernels_without_dispatch(simple):
    compiled = simple.build.graph
    assert isinstance(compiled, CompiledGraph) and compiled.backend == "torch-simple"
    gm, runner = compiled.graph, compiled.runner
    assert list(compiled.modules()).count(gm) == 1 and runner not in list(compiled.modules())
    swapped = 0
    for ours, sibling in zip(gm.graph.nodes, runner.graph.nodes, strict=True):
        if ours.op == "call_function" and _is_ours(ours.target):
            assert sibling.target is python_kernel(ours.target, "cpu") and callable(sibling.target)
            swapped += 1
        elif ours.op == "get_attr":  # a flat attribute in the sibling's __dict__, the same tensor object
            assert "." not in sibling.target and sibling.target in runner.__dict__
            assert runner.__dict__[sibling.target] is get_attr_value(gm, ours)
            assert "_parameters" not in sibling.target and sibling.target not in dict(runner.named_parameters())
        else:
            assert sibling.target == ours.target
    # the graph keeps its ops: cached attention per layer, rope, norms, fused MLP
    assert swapped >= 4 * simple.build.factory.config.num_hidden_layers
    assert not any(_is_ours(n.target) for n in runner.graph.nodes)
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(attrs) > 10
    # the flattened code reads weights without nn.Module.__getattr__ (no dotted module walks)
    assert "getattr(self.model" not in runner.code and "getattr(self.model" in gm.code


def test_direct_kernels_same_outputs_and_cache_writes(setup):
    gm, cache = setup
    runner, swapped = direct_kernel_graph(gm, "cpu")
    assert swapped > 0
    lengths = [7, 12, 3]
    tables = [[3 * i, 3 * i + 1] for i in range(len(lengths))]
    steps = [build_sequence_info([_ids(n, seed=n) for n in lengths], [0] * 3, tables),  # prefill
             build_sequence_info([[40 + i] for i in range(3)], lengths, tables)]  # decode
    results = {}
    for name, fn in (("dispatched", gm), ("direct", runner)):
        _reset(cache)
        outs = [_run(fn, cache, info) for info in steps]
        results[name] = (outs, {k: t.clone() for k, t in cache.caches.items()})
    (ref_out, ref_cache), (out, caches) = results["dispatched"], results["direct"]
    for a, b in zip(ref_out, out):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert ref_cache.keys() == caches.keys()
    for key in ref_cache:
        torch.testing.assert_close(caches[key], ref_cache[key], rtol=0, atol=0)
    assert any(bool(t.abs().sum() > 0) for t in caches.values())  # the steps did write the cache


def test_python_kernel_leaves_other_ops_alone():
    assert python_kernel(torch.ops.aten.add.Tensor, "cpu") is None
    assert python_kernel(torch.ops.mkldnn._linear_pointwise.default, "cpu") is None

    @torch.library.custom_op("adtest_direct::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert python_kernel(torch.ops.adtest_direct.double.default, "cpu") is None  # not our namespace
    ours = torch.ops.autodeploy.torch_rmsnorm.default
    kernel = python_kernel(ours, "cpu")
    x, w = torch.randn(2, 8), torch.randn(8)
    torch.testing.assert_close(kernel(x, w, 1e-6), ours(x, w, 1e-6), rtol=0, atol=0)


def test_direct_kernels_off_keeps_the_graph(setup):
    gm, cache = setup
    assert compile_graph(gm, cache, "torch-simple", direct_kernels=False) is gm
    on = compile_graph(gm, cache, "torch-simple")
    assert isinstance(on, CompiledGraph) and on.graph is gm
