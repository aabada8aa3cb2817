#!/usr/bin/env python
"""mlir_elementwise_fusion on CPU: ops per decode step, numerics and batch-1 decode time, off vs on.

    python benchmarks/bench_mlir_fusion.py                          # tiny-llama and small
    python benchmarks/bench_mlir_fusion.py --models small --rounds 8
    python benchmarks/bench_mlir_fusion.py --models small-gpt2 --pipelines default --prefill-len 256

For each model, two pipelines:

* ``default``: default.yaml as shipped (the pattern fusions already turn RMSNorm, SwiGLU, RoPE
  and the residual adds into hand-written kernels, so few element-wise aten ops are left);
* ``no-patterns``: ``match_rmsnorm_pattern`` and ``match_swiglu_pattern`` off, i.e. a model
  whose norms and MLP activations the pattern matchers do not know; element-wise aten ops stay.

and each pipeline with the transform off and on. Reported per pair: the transform's match count,
the final graph's op count (call_function nodes; ``getitem`` counted apart: it is a Python
subscript, not a kernel call), the build time (the "on" build once with an empty kernel cache,
cold, and once warm), the logits' relative RMSE between off and on (uncached graphs at two
shapes), and the batch-1 decode ms/step (one request, interleaved blocks of steps, medians);
with ``--prefill-len N`` also the time of one N-token prefill (one request, ``max_tokens=1``,
off and on interleaved, medians of ``--rounds``), where each element-wise op streams N rows.
Writes ``benchmarks/results/mlir-fusion-<time>.json``. ``--threads`` (default 1) sets torch's
thread count for every step of both variants.
"""

import argparse
import json
import operator
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

PIPELINES = {"default": {}, "no-patterns": {"match_rmsnorm_pattern": {"enabled": False},
                                            "match_swiglu_pattern": {"enabled": False}}}


MIN_OPS: Dict[str, int] = {}  # --min-ops (empty: the transform's default)


def _transforms(pipeline: str, on: bool, cache_dir: str) -> Dict[str, Any]:
    return {**PIPELINES[pipeline], "mlir_elementwise_fusion": {"enabled": on, "cache_dir": cache_dir, **MIN_OPS}}


def _op_counts(compiled: Any) -> Dict[str, int]:
    """Counts over the graph the runtime runs (the compiled wrapper's GraphModule)."""
    from autodeploy.transform.graph_utils import graph_modules

    gms = list(graph_modules(compiled))
    calls = [n for gm in gms for n in gm.graph.nodes if n.op == "call_function"]
    getitems = sum(n.target is operator.getitem for n in calls)
    fused = sum("cpu_fused_elementwise" in str(n.target) for n in calls)
    return {"ops": len(calls) - getitems, "getitems": getitems, "fused_kernels": fused}


def _matches(build: Any) -> int:
    return sum(r.num_matches for r in build.context.history if r.key == "mlir_elementwise_fusion")


def _logit_error(model: str, pipeline: str, cache_dir: str) -> List[float]:
    from helpers import build, graph_logits, rel_rmse

    from autodeploy.transform.interface import Stage

    off = build(model, up_to=Stage.POST_LOAD_FUSION, overrides=_transforms(pipeline, False, cache_dir)).graph
    on = build(model, up_to=Stage.POST_LOAD_FUSION, overrides=_transforms(pipeline, True, cache_dir)).graph
    errors = []
    for b, s in ((1, 7), (3, 4)):
        ids = torch.randint(0, 500, (b, s))
        errors.append(rel_rmse(graph_logits(on, ids), graph_logits(off, ids)))
    return errors


def _start_decode(llm: Any, steps: int) -> None:
    from autodeploy import SamplingParams

    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    engine.add_request(llm.processor.prepare({"prompt_token_ids": [5, 9, 13, 7] * 8}, params))
    while engine.scheduler.waiting or any(not s.is_decode for s in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()


def _decode_ms(llms: Dict[str, Any], rounds: int, block: int) -> Dict[str, float]:
    for llm in llms.values():
        _start_decode(llm, rounds * (block + 1))
    times: Dict[str, List[float]] = {k: [] for k in llms}
    for r in range(rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for label in order:
            engine = llms[label].engine
            engine.step()
            start = time.perf_counter()
            for _ in range(block):
                engine.step()
            times[label].append((time.perf_counter() - start) / block * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _prefill_ms(llms: Dict[str, Any], rounds: int, length: int) -> Dict[str, float]:
    from autodeploy import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [(7 * i) % 400 + 5 for i in range(length)]}
    for llm in llms.values():  # untimed: first allocation of the step's buffers
        llm.generate(prompt, params)
    times: Dict[str, List[float]] = {k: [] for k in llms}
    for r in range(rounds):
        for label in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            start = time.perf_counter()
            llms[label].generate(prompt, params)
            times[label].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def run_model(model: str, pipeline: str, rounds: int, block: int, prefill_len: int = 0) -> Dict[str, Any]:
    from autodeploy import LLM

    cold = tempfile.mkdtemp(prefix="mlir-kernels-")
    out: Dict[str, Any] = {"model": model, "pipeline": pipeline}
    llms, build_s = {}, {}
    for label, on, cache in (("off", False, cold), ("on_cold", True, cold), ("on", True, cold)):
        start = time.perf_counter()
        llm = LLM(model, transforms=_transforms(pipeline, on, cache), log_summary=False)
        build_s[label] = time.perf_counter() - start
        if label != "on_cold":
            llms[label] = llm
        else:
            del llm
    out["build_s"] = build_s
    out["matches"] = _matches(llms["on"].build)
    out["graph_ops"] = {k: _op_counts(v.build.graph) for k, v in llms.items()}
    out["decode_ms_per_step"] = _decode_ms(llms, rounds, block)
    if prefill_len:
        out["prefill_len"] = prefill_len
        out["prefill_ms"] = _prefill_ms(llms, rounds, prefill_len)
    del llms
    out["logits_rel_rmse_on_vs_off"] = _logit_error(model, pipeline, cold)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "small"])
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--prefill-len", type=int, default=0,
                        help="also time one prefill of this many tokens, off vs on (default 0: decode only)")
    parser.add_argument("--min-ops", type=int, default=None,
                        help="the transform's min_ops for the 'on' builds (default: the transform's default, 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch/OpenMP threads (default 1: on a shared machine, OpenMP barriers across "
                             "oversubscribed cores make step times swing by 10x; the kernels run one thread at "
                             "decode sizes anyway)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.min_ops is not None:
        MIN_OPS["min_ops"] = args.min_ops
    from _report import write_report

    from autodeploy import LLM

    LLM("tiny-llama", log_summary=False)  # untimed: the first build of a process pays its imports
    rows = []
    for model in args.models:
        for pipeline in args.pipelines:
            row = run_model(model, pipeline, args.rounds, args.block, args.prefill_len)
            print(json.dumps(row), flush=True)
            rows.append(row)
    path = write_report("mlir-fusion", {"rounds": args.rounds, "block": args.block, "min_ops": args.min_ops,
                                        "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
