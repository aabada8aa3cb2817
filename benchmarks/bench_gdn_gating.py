#!/usr/bin/env python
"""Gated DeltaNet gating per layer and step: HF's six elementwise ops against ``torch_fused_gdn_gating``.

    python benchmarks/bench_gdn_gating.py [--iters 1000] [--rounds 30] [--threads 1]

Each variant is a graph run the way the ``torch-simple`` backend runs it (``direct_kernel_graph``:
autodeploy ops called as Python functions), on the inputs a layer sees in the flattened step graph
(``a`` and ``b`` slices of one projection output ``[1, T, 2h]``):

- ``unfused``: the exported aten ops (sigmoid, exp, neg, add, softplus, mul);
- ``fused``: the op with ``-exp(A_log)`` precomputed at load (what ``fuse_gdn_gating`` emits);
- ``fused_no_pre``: the op computing ``-exp(A_log)`` itself (``precompute_decay: false``);
- ``fused_dispatch``: the fused op through the dispatcher (``direct_kernels: false``).

Timed in this thread's CPU time (``time.thread_time``, one torch thread: time the process spends
descheduled by other load does not count) over many short interleaved rounds; the number printed is
the minimum over rounds of the mean time per call, the least disturbed estimate.
"""

import argparse
import operator
import time

import torch
import torch.nn.functional as F
from torch import fx, nn

import autodeploy.ops  # noqa: F401
from autodeploy.compile.direct_kernels import direct_kernel_graph
from autodeploy.export.exporter import export_to_graph_module
from autodeploy.transform.cleanups import cleanup_for_matching
from torch.export import Dim


class Gating(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.h = h
        self.A_log = nn.Parameter(torch.empty(h).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(torch.randn(h))

    def forward(self, ba):
        b, a = ba[..., : self.h], ba[..., self.h:]
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return g, beta


def graphs(h: int):
    module = Gating(h).eval()
    unfused = export_to_graph_module(module, (torch.randn(1, 4, 2 * h),), dynamic_shapes=({1: Dim.DYNAMIC},))
    cleanup_for_matching(unfused)

    def fused_graph(precompute: bool) -> fx.GraphModule:
        root = nn.Module()
        root.A_log, root.dt_bias = module.A_log, module.dt_bias
        root.register_buffer("neg_exp", -module.A_log.detach().float().exp())
        graph = fx.Graph()
        ba = graph.placeholder("ba")
        b = graph.call_function(torch.ops.aten.slice.Tensor, (ba, -1, 0, h))
        a = graph.call_function(torch.ops.aten.slice.Tensor, (ba, -1, h, 2 * h))
        neg_exp = graph.get_attr("neg_exp") if precompute else None
        fused = graph.call_function(torch.ops.autodeploy.torch_fused_gdn_gating.default,
                                    (graph.get_attr("A_log"), a, b, graph.get_attr("dt_bias"), neg_exp))
        graph.output((graph.call_function(operator.getitem, (fused, 0)), graph.call_function(operator.getitem, (fused, 1))))
        return fx.GraphModule(root, graph)

    fused, fused_no_pre = fused_graph(True), fused_graph(False)
    return {
        "unfused": direct_kernel_graph(unfused, "cpu")[0],
        "fused": direct_kernel_graph(fused, "cpu")[0],
        "fused_no_pre": direct_kernel_graph(fused_no_pre, "cpu")[0],
        "fused_dispatch": fused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (decode-size ops use one anyway)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| h | tokens T | unfused us | fused us | fused_no_pre us | fused_dispatch us | unfused / fused |")
    print("|---|---|---|---|---|---|---|")
    for h, tokens in [(4, 1), (32, 1), (32, 32), (32, 512), (64, 2048)]:
        variants = graphs(h)
        x = torch.randn(1, tokens, 2 * h)
        ref = variants["unfused"](x)
        for name, gm in variants.items():
            out = gm(x)
            assert all(torch.equal(o, r) for o, r in zip(out, ref)), name
        iters = max(50, args.iters // max(1, tokens // 32))
        times = {name: [] for name in variants}
        with torch.no_grad():
            for _ in range(args.rounds):
                for name, gm in variants.items():
                    for _ in range(20):
                        gm(x)
                    start = time.thread_time()
                    for _ in range(iters):
                        gm(x)
                    times[name].append((time.thread_time() - start) / iters * 1e6)
        med = {name: min(t) for name, t in times.items()}
        print(f"| {h} | {tokens} | {med['unfused']:.1f} | {med['fused']:.1f} | {med['fused_no_pre']:.1f} | "
              f"{med['fused_dispatch']:.1f} | {med['unfused'] / med['fused']:.2f}x |")


if __name__ == "__main__":
    main()
