#!/usr/bin/env python
"""MLA cache (issue 18): a ~150M-parameter DeepSeek-V3-style model with its latent cache against the
expanded per-head KV cache, HF eager and HF + torch.compile.

    python benchmarks/bench_mla.py                    # full run: fp32, CPU
    python benchmarks/bench_mla.py --smoke            # tiny model: seconds

What it measures, in one process and one run (interleaved rounds; each number the median over the
rounds with its min-max range):

- KV-cache bytes per token of both autodeploy builds (``cache.bytes_per_token()``): the latent
  cache holds ``kv_lora_rank + qk_rope_head_dim`` values per token and layer, the expanded one
  ``heads x (qk_nope + qk_rope + v_head)``;
- the largest batch of ``--pool-seq-len``-token sequences a fixed pool (``--pool-mib``) holds:
  each build made with ``resize_kv_cache.cpu_max_cache_gb`` at that size, its pages divided by the
  pages one such sequence needs;
- decode tokens/s at batch 1 and 32 after a ``--history``-token prompt, for
  ``autodeploy-mla`` (the default pipeline: latent cache, absorbed decode), ``autodeploy-expanded``
  (export patch ``mla_latent_attention`` off: HF's expansion cached per head), HF eager's cached
  ``generate`` and HF + torch.compile. Steps are timed one by one as in
  ``bench_state_decode.py`` (whose engines this script reuses).

The model (144M parameters): hidden 1024, 6 layers (the first dense, then MoE with 8 routed experts of 384, top-2,
one shared), 16 heads, q LoRA 384, kv LoRA 256, qk_nope 64, qk_rope 32, v_head 64, vocab 32000,
random weights, written once under ``.cache/bench/``. Output: JSON and markdown in
``benchmarks/results/`` and a PNG, ``benchmarks/mla-decode.png``.
"""

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import torch  # noqa: E402

from autodeploy.bench.runner import cpu_name  # noqa: E402
from bench_state_decode import (AutoDeployDecoder, HFDecoder, _cell, _fmt, _params, checkpoint,  # noqa: E402
                                parameter_count, prompts_for)

FULL_MODEL = dict(model_type="deepseek_v3", hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                  num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256,
                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=384, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                  routed_scaling_factor=1.0, norm_topk_prob=True, vocab_size=32000, max_position_embeddings=4096,
                  tie_word_embeddings=False, rope_interleave=True)
SMOKE_MODEL = dict(FULL_MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
                   v_head_dim=8, n_routed_experts=4, moe_intermediate_size=32, vocab_size=512)
PROFILES = {"full": dict(history=256, batch_sizes=[1, 32], steps=16, rounds=3, pool_mib=256, pool_seq_len=1024,
                         out=os.path.join(REPO, "benchmarks", "results"),
                         png=os.path.join(REPO, "benchmarks", "mla-decode.png"), compile=True),
            "smoke": dict(history=16, batch_sizes=[1, 2], steps=3, rounds=1, pool_mib=4, pool_seq_len=64,
                          out=os.path.join(REPO, ".cache", "bench", "smoke-results"), png=None, compile=False)}
ENGINES = ("autodeploy-mla", "autodeploy-expanded", "hf-eager", "hf+torch.compile")
SEED = 0


class MLADecoder(AutoDeployDecoder):
    """autodeploy's engine with the latent cache (``expanded`` False) or HF's expansion cached per head."""

    def __init__(self, name: str, path: str, max_seq_len: int, max_batch_size: Optional[int], expanded: bool,
                 pool_mib: Optional[float] = None):
        from autodeploy import LLM, SamplingParams
        from autodeploy.transform import library  # noqa: F401  (module imports are not build time)

        self.name, self._params = name, SamplingParams
        transforms: Dict[str, Any] = {}
        if expanded:
            transforms["export_to_gm"] = {"patches": {"mla_latent_attention": False}}
        if pool_mib is not None:
            transforms["resize_kv_cache"] = {"cpu_max_cache_gb": pool_mib / 1024}
        limits = {"max_batch_size": max_batch_size} if max_batch_size else {}
        start = time.perf_counter()
        self.llm = LLM(path, dtype="float32", max_seq_len=max_seq_len, transforms=transforms, log_summary=False,
                       **limits)
        self.build_s = time.perf_counter() - start
        cache = self.llm.build.cache
        latent = any(n.startswith("mla_cache_") for n in cache.paged_names)
        if latent == expanded or self.llm.build.context.cache_mode != "paged_kv":
            raise SystemExit(f"{name}: cache mode {self.llm.build.context.cache_mode}, caches {cache.paged_names}: "
                             "not the cache this engine measures")
        self.info = {"build_s": round(self.build_s, 2), "kv_bytes_per_token": cache.bytes_per_token(),
                     "pages": cache.num_pages, "page_size": cache.page_size, "max_batch_size": cache.max_batch_size,
                     "max_seq_len": cache.max_seq_len, "caches": len(cache.paged_names)}


def pool_capacity(path: str, expanded: bool, pool_mib: float, seq_len: int) -> Dict[str, Any]:
    """What a ``pool_mib`` pool holds at ``seq_len`` tokens a sequence, as the builder sizes it."""
    engine = MLADecoder("pool", path, seq_len, None, expanded, pool_mib)
    info = engine.info
    del engine
    pages_per_sequence = -(-seq_len // info["page_size"])
    return {"pool_mib": pool_mib, "seq_len": seq_len, "kv_bytes_per_token": info["kv_bytes_per_token"],
            "pages": info["pages"], "tokens": info["pages"] * info["page_size"],
            "sequences": info["pages"] // pages_per_sequence}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import transformers

    model_config = SMOKE_MODEL if args.smoke else FULL_MODEL
    params = parameter_count(model_config)
    print(f"model: DeepSeek-V3-style {params:,} parameters ({_params(params)})", flush=True)
    path = checkpoint(model_config)
    capacity = {name: pool_capacity(path, name == "autodeploy-expanded", args.pool_mib, args.pool_seq_len)
                for name in ENGINES[:2]}
    print(f"pool of {args.pool_mib} MiB: {capacity}", flush=True)

    names = [n for n in ENGINES if args.compile or n != "hf+torch.compile"]
    max_seq_len = args.history + args.steps + 64
    engines: Dict[str, Any] = {}
    for name in names:
        print(f"building {name}", flush=True)
        engines[name] = (HFDecoder(path, compile=name == "hf+torch.compile") if name.startswith("hf") else
                         MLADecoder(name, path, max_seq_len, max(args.batch_sizes), name == "autodeploy-expanded"))
        print(f"  {name}: {engines[name].info}", flush=True)
    for b in args.batch_sizes:  # warm-up (and torch.compile's compilation)
        for name in names:
            engines[name].decode_steps(prompts_for(args.history, b, model_config["vocab_size"], SEED), 2)
    samples: Dict[str, Dict[int, List[float]]] = {n: {b: [] for b in args.batch_sizes} for n in names}
    for r in range(args.rounds):
        for b in args.batch_sizes:
            prompts = prompts_for(args.history, b, model_config["vocab_size"], SEED + 1 + r)
            for name in names:
                times = engines[name].decode_steps(prompts, args.steps)
                samples[name][b].append(sum(times) / len(times))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    results: Dict[str, Any] = {}
    for name in names:
        row: Dict[str, Any] = {"info": engines[name].info}
        for b in args.batch_sizes:
            per_step = samples[name][b]
            row[f"b{b}"] = {"ms_per_step": _cell([s * 1e3 for s in per_step]), "tok_s": _cell([b / s for s in per_step]),
                            "tok_s_vs_hf_eager": statistics.median(samples["hf-eager"][b]) / statistics.median(per_step)}
        results[name] = row
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "dtype": "float32",
            "smoke": args.smoke, "history": args.history, "batch_sizes": args.batch_sizes, "steps": args.steps,
            "rounds": args.rounds}
    return {"meta": meta, "model": {"config": model_config, "parameters": params, "checkpoint": path},
            "capacity": capacity, "results": results}


def markdown(data: Dict[str, Any]) -> str:
    meta, cap, res = data["meta"], data["capacity"], data["results"]
    mla, exp = cap["autodeploy-mla"], cap["autodeploy-expanded"]
    lines = [f"DeepSeek-V3-style model, {_params(data['model']['parameters'])} parameters, fp32, {meta['cpu']}, "
             f"{meta['threads']} threads, {meta['date']}.", "",
             "| cache | KV bytes / token | pages in a {} MiB pool | tokens | largest batch at {} tokens |".format(
                 mla["pool_mib"], mla["seq_len"]), "|---|---|---|---|---|"]
    for name, c in cap.items():
        lines.append(f"| {name} | {c['kv_bytes_per_token']:,} | {c['pages']} | {c['tokens']:,} | {c['sequences']} |")
    lines += ["", f"Latent over expanded: {exp['kv_bytes_per_token'] / mla['kv_bytes_per_token']:.2f}x fewer bytes "
              f"per token.", "",
              "| engine | " + " | ".join(f"decode tok/s b{b} (vs HF eager)" for b in meta["batch_sizes"]) + " |",
              "|---|" + "---|" * len(meta["batch_sizes"])]
    for name, row in res.items():
        cells = [f"{_fmt(row[f'b{b}']['tok_s'])} [{row[f'b{b}']['tok_s_vs_hf_eager']:.2f}x]" for b in meta["batch_sizes"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"\nDecode after a {meta['history']}-token prompt, {meta['steps']} steps timed per point, "
                 f"median (min-max) over {meta['rounds']} interleaved rounds.")
    return "\n".join(lines) + "\n"


def plot(data: Dict[str, Any], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    meta, res, cap = data["meta"], data["results"], data["capacity"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(cap)
    left.bar(names, [cap[n]["kv_bytes_per_token"] / 1024 for n in names], color=["tab:blue", "tab:orange"])
    left.set_ylabel("KV cache KiB / token (all layers)")
    for i, n in enumerate(names):
        left.annotate(f"{cap[n]['sequences']} sequences fit", (i, cap[n]["kv_bytes_per_token"] / 1024),
                      ha="center", va="bottom", fontsize=8)
    left.set_title(f"cache size ({cap[names[0]]['pool_mib']} MiB pool, {cap[names[0]]['seq_len']}-token sequences)")
    batches = meta["batch_sizes"]
    width = 0.8 / len(res)
    for i, name in enumerate(res):
        xs = [j + i * width for j in range(len(batches))]
        vals = [res[name][f"b{b}"]["tok_s"]["median"] for b in batches]
        right.bar(xs, vals, width, label=name)
    right.set_xticks([j + width * (len(res) - 1) / 2 for j in range(len(batches))])
    right.set_xticklabels([f"batch {b}" for b in batches])
    right.set_yscale("log")
    right.set_ylabel("decode tokens / s")
    right.set_title(f"decode after a {meta['history']}-token prompt")
    right.legend(fontsize=8)
    fig.suptitle(f"DeepSeek-V3-style, {_params(data['model']['parameters'])} parameters, fp32, {meta['cpu']}, "
                 f"{meta['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, a few steps: checks the script in seconds")
    p.add_argument("--history", type=int, help="prompt tokens before the timed decode steps (full: 256)")
    p.add_argument("--batch-sizes", type=int, nargs="+", help="decode batch sizes (full: 1 32)")
    p.add_argument("--steps", type=int, help="decode steps timed per point and round (full: 16)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (full: 3)")
    p.add_argument("--pool-mib", type=float, help="the fixed KV pool of the capacity comparison (full: 256)")
    p.add_argument("--pool-seq-len", type=int, help="sequence length of the capacity comparison (full: 1024)")
    p.add_argument("--out", help="directory of the JSON and markdown (full: benchmarks/results)")
    p.add_argument("--png", help="the plot (full: benchmarks/mla-decode.png)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure HF + torch.compile (full: on)")
    args = p.parse_args(argv)
    for name, value in PROFILES["smoke" if args.smoke else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    data = run(args)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"mla-decode{'-smoke' if args.smoke else ''}-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2)
    text = markdown(data)
    with open(stem + ".md", "w") as f:
        f.write(text)
    png = plot(data, args.png or stem + ".png")
    print("\n" + text + f"written: {stem}.json, {stem}.md" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
