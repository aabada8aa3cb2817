#!/usr/bin/env python
"""How long an element-wise chain must be before one generated C++ kernel beats its aten ops (CPU).

    python benchmarks/bench_mlir_chain_length.py                 # chains of 2..7 ops, 3 shapes
    python benchmarks/bench_mlir_chain_length.py --threads 2

A chain of ``n`` ops (``x * w``, ``+ 0.5``, ``sigmoid``, ``* x``, ``tanh``, ``+ x``, ``* 0.25``, the
first ``n`` of them, ``w`` a ``[D]`` row) is exported, and ``mlir_elementwise_fusion`` (``min_ops: 2``)
turns it into one kernel. Both graphs run as the ``torch-simple`` runtime runs them: aten ops
through the dispatcher, the fused op as a direct Python call (``compile.direct_kernels``).
Medians of ``--reps`` calls, interleaved in blocks; writes
``benchmarks/results/mlir-chain-length-<time>.json``. This is what ``min_ops``' default rests on.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

SHAPES = ((1, 768), (1, 3072), (32, 3072))


class Chain(nn.Module):
    def __init__(self, n: int, d: int):
        super().__init__()
        self.n = n
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = [lambda h: h * self.w, lambda h: h + 0.5, torch.sigmoid, lambda h: h * x, torch.tanh,
                 lambda h: h + x, lambda h: h * 0.25]
        h = x
        for step in steps[: self.n]:
            h = step(h)
        return h


def _median_us(fn, x: torch.Tensor, reps: int) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(20):
            fn(x)
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(10):
                fn(x)
            times.append((time.perf_counter() - start) / 10 * 1e6)
    return statistics.median(times)


def measure(n: int, shape: tuple, reps: int, cache_dir: str) -> Dict[str, float]:
    from helpers import apply_transform, export_gm

    from autodeploy.compile.direct_kernels import direct_kernel_graph

    x = torch.randn(1, *shape)
    example = torch.randn(2, 3, shape[-1])  # exported with dynamic leading dims (sizes of 1 would specialise)
    gm = export_gm(Chain(n, shape[-1]).eval(), example)
    aten_us = _median_us(gm, x, reps)
    fused, record = apply_transform("mlir_elementwise_fusion", export_gm(Chain(n, shape[-1]).eval(), example),
                                    cache_dir=cache_dir, min_ops=2)
    if record.num_matches != 1:
        raise RuntimeError(f"chain of {n} ops: expected one fused subgraph, got {record.num_matches}")
    runner, _ = direct_kernel_graph(fused, "cpu")
    fused_us = _median_us(runner, x, reps)
    return {"ops": n, "shape": list(shape), "aten_us": aten_us, "fused_us": fused_us, "speedup": aten_us / fused_us}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-ops", type=int, default=7)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from _report import write_report

    cache_dir = tempfile.mkdtemp(prefix="mlir-chain-")
    rows: List[Dict[str, float]] = []
    print("| ops | shape | aten [us] | fused [us] | speedup |\n|---|---|---|---|---|")
    for shape in SHAPES:
        for n in range(2, args.max_ops + 1):
            row = measure(n, shape, args.reps, cache_dir)
            rows.append(row)
            print(f"| {n} | {'x'.join(map(str, shape))} | {row['aten_us']:.1f} | {row['fused_us']:.1f} | "
                  f"{row['speedup']:.2f}x |", flush=True)
    print(f"wrote {write_report('mlir-chain-length', {'reps': args.reps, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
