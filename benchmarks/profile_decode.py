#!/usr/bin/env python
"""Where one decode step's time goes: the graph's ops vs Python outside them.

    python benchmarks/profile_decode.py                       # small preset, batch 1 and 32
    python benchmarks/profile_decode.py --batch-sizes 1 --steps 40 --yaml my-variant.yaml

For each batch size: ``B`` prompts of 32 tokens are prefilled, then decode steps run one at a
time. First without the profiler (wall time per step), then under ``torch.profiler`` with each
``Engine.step`` in a ``record_function`` region. "ops" is the CPU time of the top-level torch
ops called inside the step (the graph's ops, the sampler's, building the step's inputs);
"python" is the rest of the step's wall time: the engine, scheduler, graph code, the Python
kernels' glue. The profiler adds ~1-2 us per op (and each labelled C-kernel call a
``record_function`` region), so two readings are printed: the profiled run's split, whose
"python" includes that overhead (an upper bound), and the unprofiled step time minus the ops'
profiled time (a lower bound). autodeploy's C kernels (``autodeploy.ops.native``) are not
torch ops; each call is wrapped in a ``record_function`` region named ``native::<kernel>`` here
so that it counts as an op. Prints one table per batch size plus the top ops.

``--ab-native`` also measures the step with the C kernels switched off (``native.disabled()``:
the same graph, each native op taking its torch path), interleaved in blocks of 10 steps so that
a noisy machine affects both alike.
"""

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _decode_steps(llm: Any, batch: int, steps: int, prompt_len: int = 32) -> List[Any]:
    from autodeploy import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i in range(batch):
        engine.add_request(llm.processor.prepare({"prompt_token_ids": [5 + i % 7] * prompt_len}, params))
    while engine.scheduler.waiting or any(not s.is_decode for s in engine.scheduler.running):
        engine.step()  # prefill
    for _ in range(4):  # warm-up decodes
        engine.step()
    return list(engine.requests)


def _label_native_kernels() -> None:
    """Wrap the C kernels' entry points so the profiler sees each call as a named region."""
    from torch.profiler import record_function

    from autodeploy.ops import native

    lib = native.load()
    if lib is None:
        return
    for name in ("ad_rmsnorm_f32", "ad_paged_decode_attention_f32", "ad_gemv_f32", "ad_rope_f32",
                 "ad_silu_and_mul_f32"):
        kernel = getattr(lib, name)

        def labelled(*args: Any, _kernel: Any = kernel, _name: str = name) -> Any:
            with record_function(f"native::{_name[3:]}"):
                return _kernel(*args)

        setattr(lib, name, labelled)


def ab_native(llm: Any, batch: int, rounds: int = 4, block: int = 10) -> Dict[str, float]:
    """Median ms/step with and without the C kernels, interleaved blocks of ``block`` steps."""
    import statistics

    from autodeploy.ops import native

    rids = _decode_steps(llm, batch, 2 * rounds * block + 8)
    times: Dict[str, List[float]] = {"native": [], "torch": []}
    for _ in range(rounds):
        for label in ("native", "torch"):
            ctx = native.disabled() if label == "torch" else contextlib.nullcontext()
            with ctx:
                llm.engine.step()  # one untimed step after the switch
                start = time.perf_counter()
                for _ in range(block):
                    llm.engine.step()
                times[label].append((time.perf_counter() - start) / block * 1e3)
    for rid in rids:
        llm.engine.abort(rid)
    return {k: statistics.median(v) for k, v in times.items()}


def profile(llm: Any, batch: int, steps: int, top: int) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    rids = _decode_steps(llm, batch, 2 * steps + 8)
    engine = llm.engine
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("engine_step"):
                engine.step()
    for rid in rids:
        engine.abort(rid)
    events = prof.events()
    step_events = [e for e in events if e.name == "engine_step"]
    profiled_ms = sum(e.cpu_time_total for e in step_events) / len(step_events) / 1e3
    ids = {e.id for e in step_events}
    children = [e for e in events if e.cpu_parent is not None and e.cpu_parent.id in ids]
    ops_ms = sum(e.cpu_time_total for e in children) / len(step_events) / 1e3
    by_name: Dict[str, float] = {}
    for e in children:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.cpu_time_total / len(step_events) / 1e3
    share_ops = ops_ms / profiled_ms
    return {"batch": batch, "wall_ms": wall_ms, "profiled_ms": profiled_ms, "ops_ms": ops_ms,
            "python_share": 1 - share_ops, "python_ms": wall_ms * (1 - share_ops),
            "top": sorted(by_name.items(), key=lambda kv: -kv[1])[:top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--yaml", action="append", default=[])
    parser.add_argument("--ab-native", action="store_true", help="also time the step without the C kernels")
    args = parser.parse_args()
    from autodeploy import LLM
    from autodeploy.bench.runner import cpu_name

    llm = LLM(args.model, yaml=args.yaml)
    print(f"# decode step profile: {args.model}, {cpu_name()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    if args.ab_native:
        for b in args.batch_sizes:
            r = ab_native(llm, b)
            print(f"batch {b}: {r['native']:.2f} ms/step with autodeploy's C kernels, {r['torch']:.2f} ms/step "
                  f"without (median of interleaved blocks)")
    _label_native_kernels()
    for b in args.batch_sizes:
        r = profile(llm, b, args.steps, args.top)
        outside = max(r["wall_ms"] - r["ops_ms"], 0.0)
        print(f"\nbatch {b}: {r['wall_ms']:.2f} ms/step unprofiled; profiled {r['profiled_ms']:.2f} ms = ops "
              f"{r['ops_ms']:.2f} ms + python {r['profiled_ms'] - r['ops_ms']:.2f} ms "
              f"({100 * r['python_share']:.1f}% python, with the profiler's own per-op cost); unprofiled step minus "
              f"the ops: {outside:.2f} ms ({100 * outside / r['wall_ms']:.1f}%)")
        print("| op | ms/step |\n|---|---|")
        for name, ms in r["top"]:
            print(f"| {name} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
