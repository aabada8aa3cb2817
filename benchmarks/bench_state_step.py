#!/usr/bin/env python
"""One decode step of a cached state op, by the three paths of ``scan_each_sequence``.

    python benchmarks/bench_state_step.py            # one layer of each op at real model sizes
    python benchmarks/bench_state_step.py --smoke    # tiny sizes, a few calls: seconds, no files

``scan_each_sequence`` (``autodeploy/ops/causal_conv.py``) runs an op's one-token sequences either
as one batch gathered from the state cache and scattered back (``scan``: what every device did
before, and what CUDA still does: no host reads) or, on CPU, one by one on their own slots, in
place (``step``), or all of them in one C call (``step_all``, the kernels of
``ops/csrc/state_step_f32.c``). This times the paths for one layer of each op that has a ``step``,
at the sizes of a real model, at batch sizes 1, 8 and 32 (one-token sequences in as many slots), on
the same inputs, interleaved over rounds (median and min-max of the per-call mean); the driver's
rule for when the CPU takes the Python in-place path (``IN_PLACE_ANY_STATE``, ``IN_PLACE_MIN_BYTES``)
comes from it:

- Mamba2 scan: Mamba2-130m's layer, 24 heads of 64, one group, state 128 (a 768 KiB state);
- causal conv: its window, 1792 channels, kernel 4;
- Mamba scan: Mamba-130m's 1536 channels, state 16;
- gated delta rule: Qwen3-Next's layer, 16 key / 32 value heads of 128 (2 MiB);
- linear attention: MiniMax-Text-01's layer, 64 heads of 128 (4 MiB);
- RG-LRU scan: RecurrentGemma-2B's lru width 2560 (10 KiB; no torch in-place step);
- WKV: RWKV-4-430M's 1024 channels (12 KiB; no torch in-place step);
- mLSTM: xLSTM-7b's layer, 8 heads, q/k 256, v 512 (4.0 MiB; no torch in-place step).

Then, with ``--prefill-lens``, one fresh sequence's prefill of 16 to 2048 tokens through each op's
scan (its torch reference) and through the C kernel: the measurement behind linear attention keeping
its chunked scan for prefills.

One thread by default (``--threads``): the ops are small and the per-op overhead is what differs.
Writes ``benchmarks/results/state-step-<time>.json`` (with the machine), a markdown table beside it
and ``benchmarks/state-step.png``. End-to-end numbers with HF eager and HF + torch.compile in the
same run are ``bench_state_decode.py``'s.
"""

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import grouped_bars, write_report  # noqa: E402
from autodeploy.ops import (causal_conv, delta_rule, diagonal_recurrence, linear_attention, mlstm,  # noqa: E402
                            native, native_state, ssm, wkv)

# (inputs, scan, step or None, the C kernel's step_all given the cache or None, state shape)
Case = Tuple[List[torch.Tensor], Callable, Optional[Callable], Optional[Callable], Tuple[int, ...]]
PATHS = ("batched (gather, scan, scatter)", "in place (CPU)", "C kernel (CPU)")


def _cases(scale: int, batch: int) -> Dict[str, Case]:
    """name -> ``Case`` for ``batch`` tokens (inputs [1, batch, ...]), sizes divided by ``scale``."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def tok(*shape: int) -> torch.Tensor:  # one token per sequence, [1, batch, *shape]
        return rand(1, batch, *shape)

    h2, p2, n2 = 24 // scale, 64 // scale, 128 // scale
    A2, D2 = -rand(h2).abs(), rand(h2)
    c1, n1 = 1536 // scale, 16
    A1, D1 = -rand(c1, n1).abs(), rand(c1)
    cc = 1792 // scale
    w, b = rand(cc, 1, 4), rand(cc)
    hk, hv, d = 16 // scale, 32 // scale, 128 // scale
    hl, dl = 64 // scale, 128 // scale
    lru, rw = 2560 // scale, 1024 // scale
    xh, xk, xv = 8 // scale if scale < 8 else 2, 256 // scale, 512 // scale
    decay, first = rand(rw), rand(rw)
    return {
        "mamba2 scan": ([tok(h2, p2), tok(h2).abs(), tok(1, n2), tok(1, n2)],
                        lambda t, s: ssm._mamba2_scan(t[0], t[1], A2, t[2], t[3], D2, s),
                        lambda t, s: ssm._mamba2_step_in_place(*t, A2, D2, s),
                        lambda cache: lambda t, cu, slots, carry: native_state.mamba2_step(*t, A2, D2, cache, cu,
                                                                                       slots, carry),
                        (h2, p2, n2)),
        "causal conv": ([tok(cc)], lambda t, s: causal_conv._conv_scan(t[0], s, w, b, "silu"),
                        lambda t, s: causal_conv._conv_step(t[0], s, w, b, "silu"),
                        lambda cache: lambda t, cu, slots, carry: native_state.conv_step(t[0], cache, w, b, "silu", cu,
                                                                                     slots, carry),
                        (cc, 3)),
        "mamba scan": ([tok(c1), tok(c1).abs(), tok(n1), tok(n1)],
                       lambda t, s: ssm._mamba1_scan(t[0], t[1], A1, t[2], t[3], D1, s),
                       lambda t, s: ssm._mamba1_step_in_place(*t, A1, D1, s),
                       lambda cache: lambda t, cu, slots, carry: native_state.mamba_step(*t, A1, D1, cache, cu,
                                                                                     slots, carry),
                       (c1, n1)),
        "gated delta rule": ([tok(hv, d), tok(hk, d), tok(hk, d), tok(hv).sigmoid(), -tok(hv, 1).abs()],
                             lambda t, s: delta_rule._recurrence(t[1], t[2], t[0], t[4], t[3], s, None, True),
                             lambda t, s: delta_rule._step_in_place(t[1], t[2], t[0], t[4], t[3], s, None, True),
                             lambda cache: lambda t, cu, slots, carry: native_state.fast_weight_step(
                                 t[1], t[2], t[0], t[4], t[3], cache, cu, slots, carry, None, True),
                             (hv, d, d)),
        "linear attention": ([tok(hl, dl), tok(hl, dl), tok(hl, dl), -tok(hl).abs()],
                             lambda t, s: linear_attention._scan(t[1], t[2], t[0], t[3], s, None),
                             lambda t, s: linear_attention._step_in_place(t[1], t[2], t[0], t[3], s, None),
                             lambda cache: lambda t, cu, slots, carry: native_state.fast_weight_step(
                                 t[1], t[2], t[0], t[3], None, cache, cu, slots, carry, None, False),
                             (hl, dl, dl)),
        "RG-LRU scan": ([tok(lru), tok(lru).sigmoid()], lambda t, s: diagonal_recurrence._scan(t[0], t[1], s), None,
                        lambda cache: lambda t, cu, slots, carry: native_state.diagonal_recurrence_step(
                            t[0], t[1], cache, cu, slots, carry),
                        (lru,)),
        "WKV": ([tok(rw), tok(rw)], lambda t, s: wkv._scan(decay, first, t[0], t[1], s), None,
                lambda cache: lambda t, cu, slots, carry: native_state.wkv_step(decay, first, t[0], t[1], cache, cu,
                                                                                slots, carry),
                (3, rw)),
        "mLSTM": ([tok(xh, xv), tok(xh, xk), tok(xh, xk), tok(xh), tok(xh)],
                  lambda t, s: mlstm._steps(t[1], t[2], t[0], t[3], t[4], s, 1e-6), None,
                  lambda cache: lambda t, cu, slots, carry: native_state.mlstm_step(t[1], t[2], t[0], t[3], t[4], cache,
                                                                                    cu, slots, carry, 1e-6),
                  (xh, xk + 1, xv + 1)),
    }


def _metadata(batch: int) -> List[torch.Tensor]:
    """``batch`` decodes, sequence i continuing in slot i + 1."""
    i32 = dict(dtype=torch.int32)
    return [torch.tensor([0, 0, batch], **i32), torch.ones(batch, **i32), torch.arange(batch + 1, **i32),
            torch.arange(batch, **i32) + 1, torch.ones(batch, dtype=torch.bool)]


def _drive(scan: Callable, tokens: List[torch.Tensor], meta: List[torch.Tensor], cache: torch.Tensor,
           step: Any, step_all: Any = None) -> None:
    """One step through the driver: neither ``step`` nor ``step_all`` forces the batched path;
    ``step`` the in-place one (its size rule lifted, so the paths are timed at every batch size);
    ``step_all`` the C kernel."""
    saved = causal_conv.IN_PLACE_ANY_STATE
    causal_conv.IN_PLACE_ANY_STATE = 1 << 30
    try:
        causal_conv.scan_each_sequence(scan, tokens, *meta, cache, step=step, step_all=step_all)
    finally:
        causal_conv.IN_PLACE_ANY_STATE = saved


def _prefill_metadata(length: int) -> List[torch.Tensor]:
    """One fresh sequence of ``length`` tokens in slot 1."""
    i32 = dict(dtype=torch.int32)
    return [torch.tensor([1, length, 0], **i32), torch.tensor([length], **i32), torch.tensor([0, length], **i32),
            torch.tensor([1], **i32), torch.tensor([False])]


def _prefill_rows(lengths: List[int], scale: int, rounds: int) -> List[Dict[str, Any]]:
    """One sequence's prefill of each length: the op's scan (its torch reference, chunked for Mamba2
    and linear attention, token by token in Python for the delta rule and Mamba) vs the C kernel."""
    rows = []
    for length in lengths:
        for name, (tokens, scan, _, step_all, shape) in _cases(scale, length).items():
            cache = torch.zeros(2, *shape)
            meta = _prefill_metadata(length)
            times: Dict[str, List[float]] = {"scan (torch)": [], "C kernel (CPU)": []}
            for _ in range(rounds):
                for path, fn_all in zip(times, (None, step_all(cache))):
                    times[path].append(_mean_ms(lambda: _drive(scan, tokens, meta, cache, None, fn_all),
                                                max(1, 256 // length)))
            for path, ms in times.items():
                rows.append({"op": name, "tokens": length, "engine": path, "ms": statistics.median(ms),
                             "min_ms": min(ms), "max_ms": max(ms)})
    return rows


def _prefill_table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| op | prompt tokens | scan (torch) ms | C kernel ms (speed-up) |", "|---|---|---|---|"]
    for torch_row, c_row in zip(rows[::2], rows[1::2]):
        lines.append(f"| {torch_row['op']} | {torch_row['tokens']} | {torch_row['ms']:.3f} "
                     f"({torch_row['min_ms']:.3f}-{torch_row['max_ms']:.3f}) | {c_row['ms']:.3f} "
                     f"({c_row['min_ms']:.3f}-{c_row['max_ms']:.3f}) [{torch_row['ms'] / c_row['ms']:.2f}x] |")
    return "\n".join(lines)


def _mean_ms(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def _table(rows: List[Dict[str, Any]]) -> str:
    """One line per op and batch size: each path's ms (min-max) and its speed-up over the batched path."""
    lines = ["| op | state per sequence | batch | batched ms | in place ms (speed-up) | C kernel ms (speed-up) |",
             "|---|---|---|---|---|---|"]
    groups: Dict[Tuple[str, int], Dict[str, Dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["op"], row["batch"]), {})[row["engine"]] = row
    for (op, batch), paths in groups.items():
        base = paths[PATHS[0]]
        cells = [f"{base['ms']:.3f} ({base['min_ms']:.3f}-{base['max_ms']:.3f})"]
        for path in PATHS[1:]:
            row = paths.get(path)
            cells.append("-" if row is None else f"{row['ms']:.3f} ({row['min_ms']:.3f}-{row['max_ms']:.3f}) "
                                                 f"[{base['ms'] / row['ms']:.2f}x]")
        lines.append(f"| {op} | {base['state_kib']:.0f} KiB | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few calls, nothing written")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=200, help="calls per path and round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[16, 128, 512, 2048],
                   help="also time one sequence's prefill of these lengths, scan vs C kernel (none: skip)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rounds, calls = (1, 3) if args.smoke else (args.rounds, args.calls)
    rows = []
    for batch in [1] if args.smoke else args.batch_sizes:
        meta = _metadata(batch)
        for name, (tokens, scan, step, step_all, shape) in _cases(8 if args.smoke else 1, batch).items():
            cache = torch.zeros(batch + 1, *shape)
            drivers = {PATHS[0]: (None, None)}
            if step is not None:
                drivers[PATHS[1]] = (step, None)
            if step_all is not None and native.available():
                drivers[PATHS[2]] = (None, step_all(cache))
            times: Dict[str, List[float]] = {path: [] for path in drivers}
            for _ in range(rounds):
                for path, (fn, fn_all) in drivers.items():
                    times[path].append(_mean_ms(lambda: _drive(scan, tokens, meta, cache, fn, fn_all),
                                                max(3, calls // batch)))
            state_kib = cache[0].numel() * 4 / 1024
            for path, ms in times.items():
                rows.append({"op": name, "batch": batch, "engine": path, "state_kib": state_kib,
                             "ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)})
    table = _table(rows)
    print(table, flush=True)
    prefill = []
    if native.available() and args.prefill_lens:
        prefill = _prefill_rows([16] if args.smoke else args.prefill_lens, 8 if args.smoke else 1, rounds)
        table += "\n\nPrefill of one sequence:\n\n" + _prefill_table(prefill)
        print("\n" + _prefill_table(prefill), flush=True)
    if args.smoke:
        return
    path = write_report("state-step", {"rounds": rounds, "calls": calls, "rows": rows, "prefill": prefill})
    with open(path[:-5] + ".md", "w") as f:
        f.write(table + "\n")
    print(f"wrote {path} and .md", flush=True)
    ops = list(dict.fromkeys(r["op"] for r in rows))
    one = [dict(r, group=ops.index(r["op"])) for r in rows if r["batch"] == rows[0]["batch"]]
    grouped_bars(os.path.join(os.path.dirname(os.path.abspath(__file__)), "state-step.png"), one, "group", "ms",
                 ops, f"ms a decode step, one layer, batch {rows[0]['batch']}",
                 "scan_each_sequence: batched vs in place vs C kernel (CPU)", log=True)


if __name__ == "__main__":
    main()
