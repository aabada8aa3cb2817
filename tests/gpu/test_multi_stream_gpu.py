"""The multi-stream transforms on a GPU (``make test-gpu``; skipped without CUDA). What the CPU tests
(``tests/transforms/test_multi_stream.py``) cannot show:

* the rewritten graph computes what the untransformed one does, on CUDA tensors;
* its kernels really run on two CUDA streams (the profiler's kernel records name their stream), and
  the stream ops counted one region per rewritten branch;
* it survives CUDA graph capture (``torch.cuda.graph``) and replays to the same numbers; no MoE op
  of this codebase is capturable (they read routing counts on the host), so the MoE case is
  checked eagerly and capture is checked on the GEMM and MLA graphs and on the raw ops;
* the full pipeline on CUDA (``torch-simple``) with the transforms switched on.

Each case prints the median time of the graph before and after the rewrite, for the report; no
assertion is made on timing (tiny models: the point is correctness, the speeds measured on an H200 are in benchmarks/RESULTS.md).
"""

import json
import os
import random
import statistics
import tempfile
import time
from typing import Callable, Set

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")]

ad = torch.ops.autodeploy


def _apply(key: str, gm) -> int:
    from autodeploy.transform.interface import PipelineContext
    from autodeploy.transform.optimizer import build_transform

    ctx = PipelineContext(device="cuda")
    build_transform(key, {"enabled": True})(gm, ctx)
    record = ctx.history[-1]
    assert record.status == "ok", record
    return record.num_matches


def _kernel_streams(fn: Callable[[], object]) -> Set[int]:
    """The CUDA streams the kernels launched by ``fn`` ran on (from the profiler's trace)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: lazy initialisations out of the trace
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    streams = {e["args"]["stream"] for e in events
               if str(e.get("cat", "")).lower() == "kernel" and "stream" in e.get("args", {})}
    assert streams, "the profiler recorded no CUDA kernels (CUPTI unavailable?)"
    return streams


def _median_ms(fn: Callable[[], object], runs: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _report(name: str, before: Callable[[], object], after: Callable[[], object]) -> None:
    b, a = _median_ms(before), _median_ms(after)
    print(f"\n{name} on {torch.cuda.get_device_name()}: median {b:.3f} ms before, {a:.3f} ms after "
          f"({b / a:.2f}x)")


def _check_two_streams(reference: Callable[[], object], rewritten: Callable[[], object], regions: int) -> None:
    from autodeploy.ops.streams import regions_run

    assert len(_kernel_streams(reference)) == 1
    count = regions_run()
    streams = _kernel_streams(rewritten)  # runs it twice
    assert len(streams) == 2, streams
    assert regions_run() - count == 2 * regions


def _captured(fn: Callable[..., torch.Tensor], *static: torch.Tensor) -> torch.Tensor:
    """Capture ``fn(*static)`` in a CUDA graph (as compile_model's CUDA-graph backend does), replay
    it and return the replayed output."""
    from autodeploy.compile.cuda_graph import cuda_graph_capture

    replay, out = cuda_graph_capture(fn, list(static))
    out.zero_()
    replay()
    torch.cuda.synchronize()
    return out.clone()


def test_stream_ops_fork_and_join_for_real():
    """The raw ops: the aux stream is current inside a region, the main stream after it, the join
    orders a slow aux branch before its reader, the aux stream is one per device, and the whole
    thing is capturable."""
    from autodeploy.ops.streams import aux_stream

    torch.manual_seed(0)
    a = torch.randn(2048, 2048, device="cuda") / 45
    w1, w2 = (torch.randn(2048, 2048, device="cuda") / 45 for _ in range(2))

    def serial(x):
        y = x
        for _ in range(8):  # long enough that a missing join would be read too early
            y = torch.tanh(y @ w1)
        return y + x @ w2

    def forked(x):
        main = torch.cuda.current_stream()
        ad.fork_to_aux([x])
        assert torch.cuda.current_stream() == aux_stream(x.device) != main
        y = x
        for _ in range(8):
            y = torch.tanh(y @ w1)
        ad.end_aux([y])
        assert torch.cuda.current_stream() == main
        z = x @ w2
        ad.join_from_aux([y])
        return y + z

    torch.testing.assert_close(forked(a), serial(a), rtol=1e-5, atol=1e-5)
    assert aux_stream(a.device) is aux_stream(torch.device("cuda", a.device.index))
    assert len(_kernel_streams(lambda: forked(a))) == 2
    torch.testing.assert_close(_captured(forked, a), serial(a), rtol=1e-5, atol=1e-5)


class Projections(nn.Module):
    """Three GEMMs of different sizes on one input (fuse_gemms is not run on this graph: the shape of
    what it leaves apart in a build, e.g. weights of different dtypes)."""

    def __init__(self, hidden=2048):
        super().__init__()
        self.big = nn.Linear(hidden, 4 * hidden)
        self.small = nn.Linear(hidden, hidden // 2)
        self.other = nn.Linear(hidden, hidden // 2)

    def forward(self, x):
        h = torch.tanh(x)
        return self.big(h), self.small(h), self.other(h)


def test_multi_stream_gemm_on_gpu():
    from autodeploy.utils.fx import copy_graph_module
    from helpers import export_gm

    gm = export_gm(Projections(), torch.randn(2, 5, 2048))
    reference = copy_graph_module(gm)
    assert _apply("multi_stream_gemm", gm) == 1  # a graph-level rewrite, then both graphs to the GPU
    gm, reference = gm.to("cuda"), reference.to("cuda")
    x = torch.randn(4, 32, 2048, device="cuda")
    with torch.no_grad():
        for out, ref in zip(gm(x), reference(x)):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        _check_two_streams(lambda: reference(x), lambda: gm(x), regions=1)
        captured = _captured(lambda t: gm(t)[1], x)
        torch.testing.assert_close(captured, reference(x)[1], rtol=1e-5, atol=1e-5)
        _report("multi_stream_gemm (2048 -> 8192 | 1024 | 1024, 128 tokens, fp32)",
                lambda: reference(x), lambda: gm(x))
        xb, gm, reference = x.bfloat16(), gm.bfloat16(), reference.bfloat16()
        for out, ref in zip(gm(xb), reference(xb)):
            torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
        _report("multi_stream_gemm (same, bf16)", lambda: reference(xb), lambda: gm(xb))


def test_multi_stream_moe_on_gpu():
    from autodeploy.utils.fx import copy_graph_module
    from helpers import export_moe_block, moe_block

    gm = export_moe_block(moe_block("qwen2_moe"), "autodeploy")
    reference = copy_graph_module(gm)
    assert _apply("multi_stream_moe", gm) == 1
    gm, reference = gm.to("cuda"), reference.to("cuda")
    x = torch.randn(4, 16, 64, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(gm(x), reference(x), rtol=1e-5, atol=1e-5)
        _check_two_streams(lambda: reference(x), lambda: gm(x), regions=1)
        _report("multi_stream_moe (tiny Qwen2-MoE block, 64 tokens, fp32)", lambda: reference(x), lambda: gm(x))


def test_multi_stream_mla_attn_on_gpu():
    """One DeepSeek-V3 layer as exported (q_a and kv_a apart): kv_a on the aux stream."""
    from autodeploy.transform.interface import Stage
    from autodeploy.utils.fx import copy_graph_module
    from helpers import build, moe_family_checkpoint

    gm = build(moe_family_checkpoint("deepseek_v3", num_hidden_layers=1), up_to=Stage.WEIGHT_LOAD,
               device="cuda", dtype="float32").graph
    reference = copy_graph_module(gm)
    assert _apply("multi_stream_mla_attn", gm) == 1
    for b, s in ((1, 7), (3, 4)):
        ids = torch.randint(0, 512, (b, s), device="cuda")
        pos = torch.arange(s, device="cuda").expand(b, s).contiguous()
        with torch.no_grad():
            torch.testing.assert_close(gm(ids, pos), reference(ids, pos), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        _check_two_streams(lambda: reference(ids, pos), lambda: gm(ids, pos), regions=1)
        torch.testing.assert_close(_captured(gm, ids, pos), reference(ids, pos), rtol=1e-5, atol=1e-5)
        _report("multi_stream_mla_attn (tiny DeepSeek-V3 layer, 12 tokens, fp32)",
                lambda: reference(ids, pos), lambda: gm(ids, pos))


def test_pipeline_on_gpu_with_the_transforms_on():
    """The default pipeline on CUDA (torch-simple: the graph run node by node, autodeploy's ops as
    direct Python calls) with multi_stream_moe and multi_stream_mla_attn enabled: their match
    counts, and the same logits as the build without them."""
    from autodeploy.cache import build_sequence_info
    from helpers import build, moe_family_checkpoint

    checkpoint = moe_family_checkpoint("deepseek_v3")
    limits = dict(device="cuda", dtype="float32", compile_backend="torch-simple", max_seq_len=32,
                  max_num_tokens=32, max_batch_size=3, page_size=4)
    fixed_pool = {"resize_kv_cache": {"enabled": False}}
    on = build(checkpoint, overrides={**fixed_pool, "multi_stream_moe": {"enabled": True},
                                      "multi_stream_mla_attn": {"enabled": True}}, **limits)
    off = build(checkpoint, overrides=fixed_pool, **limits)
    matches = {r.key: r.num_matches for r in on.context.history
               if r.key.startswith("multi_stream") and r.status == "ok"}
    assert matches == {"multi_stream_moe": 1, "multi_stream_mla_attn": 2}
    rng = random.Random(0)
    seqs = [[rng.randrange(512) for _ in range(12)] for _ in range(2)]

    def prefill_then_decode(res):
        """A prefill of both sequences' first 5 / 3 tokens, then three decode steps (metadata on the GPU)."""
        cache = res.cache
        cache.allocate(cache.num_pages)
        tables = [[2 * i, 2 * i + 1, 2 * i + 4, 2 * i + 5] for i in range(2)]  # 4 pages of 4 tokens each
        steps = [([s[:n] for s, n in zip(seqs, (5, 3))], [0, 0])]
        steps += [([[s[n + e]] for s, n in zip(seqs, (5, 3))], [5 + e, 3 + e]) for e in range(3)]
        rows = []
        for tokens, starts in steps:
            info = build_sequence_info(tokens, starts, tables, device=cache.device)
            rows.append(res.graph(*cache.graph_args(info))[0])
        return torch.cat(rows)

    with torch.no_grad():
        torch.testing.assert_close(prefill_then_decode(on), prefill_then_decode(off), rtol=1e-5, atol=1e-5)
