#!/usr/bin/env python
"""Per-transform benchmark: decode and prefill step time with and without each transform.

Every variant is built in the same process from the same checkpoint (default: the ``small``
preset, fp32), then all variants are measured in interleaved rounds so machine noise hits them
alike. Reported: the median step time per variant and its ratio to the full default pipeline.

    python benchmarks/bench_transforms.py                   # small preset, ~6 minutes on 2 cores
    python benchmarks/bench_transforms.py --model tiny-llama --rounds 2   # a quick check

Writes ``benchmarks/results/transforms-<time>.json`` and ``.md``.
"""

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from autodeploy.cache import build_sequence_info  # noqa: E402
from autodeploy.config import load_deploy_config  # noqa: E402
from autodeploy.pipeline import build_graph  # noqa: E402

# Variant name -> transform overrides relative to the default pipeline.
VARIANTS: Dict[str, Dict[str, Dict[str, Any]]] = {
    "default": {},
    "-fuse_gemms": {"fuse_gemms": {"enabled": False}},
    # without the swiglu matcher, fuse_gemms stacks gate/up and fuse_silu_mul takes the activation
    "-match_swiglu/fuse_swiglu (fuse_gemms+fuse_silu_mul)": {"match_swiglu_pattern": {"enabled": False},
                                                             "fuse_swiglu": {"enabled": False}},
    "-fuse_swiglu (swiglu op with 3 linears)": {"fuse_swiglu": {"enabled": False}},
    "-fuse_swiglu -fuse_silu_mul": {"fuse_swiglu": {"enabled": False}, "match_swiglu_pattern": {"enabled": False},
                                    "fuse_silu_mul": {"enabled": False}},
    "-fuse_add_rms_norm": {"fuse_add_rms_norm": {"enabled": False}},
    "fuse_rmsnorm=compile": {"fuse_rmsnorm": {"backend": "compile"}},
    "-optimize_rope": {"optimize_rope": {"enabled": False}},
    "-fold_constants": {"fold_constants": {"enabled": False}},
    "-gather_logits_before_lm_head": {"gather_logits_before_lm_head": {"enabled": False}},
    "compile_backend=torch-compile": {"compile_model": {"backend": "torch-compile"}},
    "linear_backend=torch": {"select_linear_backend": {"backend": "torch"}},
    "linear_backend=blas": {"select_linear_backend": {"backend": "blas"}},
}


def build_variant(model: str, overrides: Dict[str, Dict[str, Any]], args: argparse.Namespace):
    cfg = load_deploy_config(model=model, max_seq_len=args.prefill + 128, max_batch_size=args.batch,
                             max_num_tokens=args.prefill, dtype="float32")
    transforms = copy.deepcopy(cfg.transforms)
    transforms["initialize_cache"] = {"num_pages": args.num_pages}
    for key, fields in overrides.items():
        transforms[key] = {**(transforms.get(key) or {}), **fields}
    cfg = cfg.model_copy(update={"transforms": transforms})
    start = time.perf_counter()
    result = build_graph(cfg, log_summary=False)
    return result, time.perf_counter() - start


def steps(cache, args) -> Dict[str, Any]:
    """The steps measured: decode at batch 1 and ``batch`` with ``context`` cached tokens, and
    one prefill of ``prefill`` tokens."""
    ps = cache.page_size
    per_seq = -(-(args.context + 1) // ps)

    def decode(b):
        tables = [[i * per_seq + j for j in range(per_seq)] for i in range(b)]
        return build_sequence_info([[5]] * b, [args.context] * b, tables)

    prefill = build_sequence_info([[5] * args.prefill], [0], [list(range(-(-args.prefill // ps)))])
    return {"decode_b1": decode(1), f"decode_b{args.batch}": decode(args.batch), f"prefill_{args.prefill}": prefill}


def time_step(model: Callable, cache, info, reps: int) -> List[float]:
    inputs = cache.graph_args(info)
    out = []
    with torch.inference_mode():
        model(*inputs)
        for _ in range(reps):
            start = time.perf_counter()
            model(*inputs)
            out.append(time.perf_counter() - start)
    return out


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--num-pages", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))

    variants = {k: v for k, v in VARIANTS.items() if not args.only or k in args.only or k == "default"}
    built: Dict[str, Any] = {}
    build_s: Dict[str, float] = {}
    for name, overrides in variants.items():
        print(f"building {name} ...", flush=True)
        result, seconds = build_variant(args.model, overrides, args)
        built[name], build_s[name] = result, seconds
        gc.collect()
    samples: Dict[str, Dict[str, List[float]]] = {name: {} for name in built}
    reps = {"decode_b1": 10, f"decode_b{args.batch}": 3, f"prefill_{args.prefill}": 1}
    for r in range(args.rounds):
        for name, result in built.items():
            for step_name, info in steps(result.cache, args).items():
                samples[name].setdefault(step_name, []).extend(
                    time_step(result.graph, result.cache, info, reps[step_name]))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    rows = []
    base = {k: statistics.median(v) for k, v in samples["default"].items()}
    for name in built:
        med = {k: statistics.median(v) for k, v in samples[name].items()}
        rows.append({"variant": name, "build_s": round(build_s[name], 1),
                     **{f"{k}_ms": round(v * 1e3, 2) for k, v in med.items()},
                     **{f"{k}_vs_default": round(v / base[k], 3) for k, v in med.items()},
                     **{f"{k}_range_ms": [round(min(samples[name][k]) * 1e3, 2), round(max(samples[name][k]) * 1e3, 2)]
                        for k in med}})
    meta = {"model": args.model, "dtype": "float32", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": cpu_model(), "commit": git_commit(), "rounds": args.rounds, "batch": args.batch,
            "context": args.context, "prefill": args.prefill, "date": time.strftime("%Y-%m-%d %H:%M")}
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.out, f"transforms-{stamp}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    step_names = list(base)
    lines = [f"# Per-transform step times ({args.model}, fp32, {meta['threads']} threads, {meta['cpu']})", "",
             f"torch {meta['torch']}, commit {meta['commit']}, {meta['date']}; median of {args.rounds} interleaved "
             f"rounds; ratio > 1 means slower than the default pipeline.", "",
             "| variant | build [s] | " + " | ".join(f"{s} [ms] (vs default)" for s in step_names) + " |",
             "|---|---|" + "---|" * len(step_names)]
    for row in rows:
        cells = [f"{row[f'{s}_ms']:.1f} ({row[f'{s}_vs_default']:.2f}x)" for s in step_names]
        lines.append(f"| {row['variant']} | {row['build_s']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, f"transforms-{stamp}.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
