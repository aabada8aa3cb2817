#!/usr/bin/env python
"""Fused vs unfused all-reduce + residual add + RMSNorm at world size 2 (``fuse_allreduce_residual_rmsnorm``).

    python benchmarks/bench_allreduce_norm.py [--model small] [--rounds 20] [--iters 30] [--threads 1]
    python benchmarks/bench_allreduce_norm.py --smoke      # tiny-llama, a few iterations: seconds

Starts two gloo ranks on this machine (``torch.multiprocessing`` spawn, loopback rendezvous) and
measures on each, rank 0 reporting:

- ``op``: one layer's step, ``torch_dist_all_reduce`` then ``native_fused_add_rmsnorm`` (what the
  graph runs with the fusion off) against ``native_dist_all_reduce_fused_add_rmsnorm`` (on), at
  1 and 32 rows of the model's hidden size;
- ``graph``: the model's whole uncached graph (post_load_fusion, ``graph(input_ids, position_ids)``)
  at batch 1 and 32 of one token each (a decode step's shape without the KV cache), built twice
  at world size 2: with ``fuse_allreduce_residual_rmsnorm`` and with it disabled. Their logits
  are checked equal before timing.

Timed in wall-clock time (``time.perf_counter``): an all-reduce waits on the other rank, and that
wait is part of what the fusion can or cannot save, so thread CPU time would undercount it. Each
timed block starts with a barrier so the ranks run in lockstep; the number printed is the minimum
over rounds of the mean per call (the least disturbed estimate on a shared machine). What to
expect on CPU: the fusion saves one op dispatch and one allocation per all-reduce (the op reduces
in a scratch buffer it owns), i.e. microseconds against an all-reduce over loopback of tens of
microseconds; a large gain needs a one-kernel fused collective on a GPU, not written here.

Writes ``benchmarks/results/allreduce-norm-<model>-<time>.json`` and ``.md`` (not with
``--smoke``, which only checks that the script works).
"""

import argparse
import json
import logging
import os
import sys
import time
from datetime import datetime
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import run_ranks  # noqa: E402

logger = logging.getLogger("bench_allreduce_norm")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
KEY = "fuse_allreduce_residual_rmsnorm"
WORLD = 2


def _checkpoint(model: str) -> str:
    from autodeploy.models.presets import PRESETS, preset_dir

    return preset_dir(model) if model in PRESETS else model


def _build(checkpoint: str, fused: bool) -> torch.fx.GraphModule:
    """The post_load_fusion graph at world size 2, the fusion on or off (later stages off)."""
    from autodeploy.config import load_deploy_config
    from autodeploy.pipeline import build_graph
    from autodeploy.transform.interface import Stage
    from autodeploy.transform.optimizer import build_transform

    cfg = load_deploy_config(model=checkpoint, world_size=WORLD)
    transforms = dict(cfg.transforms)
    for key, raw in transforms.items():
        if build_transform(key, raw).config.stage.order > Stage.POST_LOAD_FUSION.order:
            transforms[key] = {**(raw or {}), "enabled": False}
    # the fusion is off by default (measured not faster on CPU): each build says which it wants
    transforms[KEY] = {**(transforms.get(KEY) or {}), "enabled": fused}
    return build_graph(cfg.model_copy(update={"transforms": transforms}), log_summary=False).graph_module


def _time(fn: Callable[[], Any], rounds: int, iters: int) -> float:
    """Minimum over rounds of the mean wall time per call, in microseconds (ranks in lockstep)."""
    best = float("inf")
    for _ in range(3):
        fn()
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def _logits(gm: torch.fx.GraphModule, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).expand(*ids.shape)
    out = gm(input_ids=ids, position_ids=pos)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return getattr(out, "logits", out)


def _measure(rank: int, args: argparse.Namespace) -> List[Dict[str, Any]]:
    ad = torch.ops.autodeploy
    checkpoint = _checkpoint(args.model)
    graphs = {"unfused": _build(checkpoint, fused=False), "fused": _build(checkpoint, fused=True)}
    if not any(n.target == ad.native_dist_all_reduce_fused_add_rmsnorm.default for n in graphs["fused"].graph.nodes):
        raise RuntimeError("the fused graph has no native_dist_all_reduce_fused_add_rmsnorm: nothing to compare "
                           "(is fuse_rmsnorm on the native backend?)")
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    rows: List[Dict[str, Any]] = []
    with torch.no_grad():
        for tokens in (1, 32):
            x = torch.randn(tokens, hidden) * (rank + 1)
            residual, weight = torch.randn(tokens, hidden), torch.randn(hidden)
            unfused = lambda: ad.native_fused_add_rmsnorm(ad.torch_dist_all_reduce(x), residual, weight, 1e-6)  # noqa: E731
            fused = lambda: ad.native_dist_all_reduce_fused_add_rmsnorm(x, residual, weight, 1e-6)  # noqa: E731
            assert all(torch.equal(a, b) for a, b in zip(unfused(), fused()))
            rows.append({"what": "op", "rows": tokens, "hidden": hidden,
                         "unfused_us": _time(unfused, args.rounds, args.iters * 10),
                         "fused_us": _time(fused, args.rounds, args.iters * 10)})
        for batch in (1, 32):
            torch.manual_seed(batch)  # the same tokens on both ranks
            ids = torch.randint(0, vocab, (batch, 1))
            if not torch.equal(_logits(graphs["fused"], ids), _logits(graphs["unfused"], ids)):
                raise RuntimeError(f"fused and unfused logits differ at batch {batch}")
            row: Dict[str, Any] = {"what": "graph", "rows": batch, "hidden": hidden}
            for name, gm in graphs.items():
                row[f"{name}_us"] = _time(lambda gm=gm: _logits(gm, ids), args.rounds, args.iters)
            rows.append(row)
    return rows


def _rank_main(rank: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    from autodeploy.distributed import process_group

    try:
        torch.set_num_threads(args.threads)
        process_group.initialize(rank=rank, world_size=WORLD, master_port=port, timeout_s=120)
        rows = _measure(rank, args)
        queue.put((rank, rows))
    except BaseException as err:  # noqa: BLE001 - reported by the parent
        queue.put((rank, f"{type(err).__name__}: {err}"))
        raise
    finally:
        process_group.shutdown()


def _table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| what | rows (tokens) | hidden | unfused us | fused us | unfused / fused |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['rows']} | {r['hidden']} | {r['unfused_us']:.1f} | {r['fused_us']:.1f} | "
                     f"{r['unfused_us'] / r['fused_us']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="preset name or checkpoint directory")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--iters", type=int, default=30, help="graph calls per round (op calls: 10x)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama, 2 rounds of 2 iterations, no files")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.smoke:
        args.model, args.rounds, args.iters = "tiny-llama", 2, 2
    results = run_ranks(_rank_main, WORLD, (args,))
    rows = results[0]
    table = _table(rows)
    logger.info("torch %s, world size %d (gloo, loopback), %d thread(s) per rank, model %s\n%s",
                torch.__version__, WORLD, args.threads, args.model, table)
    if args.smoke:
        return
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"allreduce-norm-{args.model}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    meta = {"model": args.model, "world_size": WORLD, "threads": args.threads, "torch": torch.__version__,
            "rounds": args.rounds, "iters": args.iters}
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(f"# fused vs unfused all-reduce + add + RMSNorm, world size {WORLD}, {args.model}\n\n{table}\n")
    logger.info("wrote %s.json and .md", stem)


if __name__ == "__main__":
    main()
