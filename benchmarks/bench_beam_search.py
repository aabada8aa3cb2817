#!/usr/bin/env python
"""Beam search: autodeploy's ``LLM.beam_search`` with and without tail pages, against HF eager's
and HF + torch.compile's ``generate(num_beams=k)``.

    python benchmarks/bench_beam_search.py                 # small preset, beam 4, 32 new tokens
    python benchmarks/bench_beam_search.py --no-compile --beam-widths 2 4 8
    python benchmarks/bench_beam_search.py --smoke         # tiny-llama, seconds

Each engine searches the same prompts one after another, each alone (``--prompts`` prompts of
``--prompt-len`` random token ids per round, new in every round; ``--max-tokens`` new tokens, no
EOS: every hypothesis runs to the end). autodeploy drives the search as vLLM does, one one-token
request per live beam and step; prefix caching lets the beams share their history's whole pages,
and tail pages (``PagePool.match_tail``) let each step start from a copy of the parent beam's
partly filled last page. "no tail pages" is the same build with the pool's tail pages switched off
after the build (``engine.pool.tail_pages = False``): each step then computes the tokens of every
beam's last page again. HF reorders its KV cache each step. The engines take turns on each round's
prompts. Reported: the median time of one search over prompts and rounds (with its range), the
ratio to HF eager, and how many searches' best hypothesis equals HF eager's. Writes JSON and
markdown to ``benchmarks/results/`` and a PNG, ``benchmarks/beam-search.png``.
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import torch  # noqa: E402

from _report import add_output_args, grouped_bars, resolve_outputs, write_results  # noqa: E402

from autodeploy.bench.runner import cpu_name, git_commit  # noqa: E402

Search = Callable[[List[int], int], List[int]]  # (prompt ids, beam width) -> the best hypothesis's new tokens


def autodeploy_search(model: str, max_seq_len: int, max_tokens: int, tail_pages: bool) -> Search:
    from autodeploy import LLM
    from autodeploy.runtime.beam_search import BeamSearchParams

    llm = LLM(model, dtype="float32", max_seq_len=max_seq_len)
    llm.engine.pool.tail_pages = tail_pages and llm.engine.pool.tail_pages

    def search(prompt: List[int], width: int) -> List[int]:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
        (out,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
        return list(out.sequences[0].token_ids)

    return search


def hf_search(checkpoint: str, max_tokens: int, compile: bool) -> Search:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if compile:
        from torch import _dynamo

        _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, 64)
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, fullgraph=True)

    def search(prompt: List[int], width: int) -> List[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 early_stopping=False, length_penalty=1.0)
        return out[0, len(prompt):].tolist()

    return search


def measure(engines: Dict[str, Search], args: argparse.Namespace, vocab: int) -> Dict[str, Any]:
    """{engine: {width: [seconds, ...]}} and {engine: {width: searches equal to HF eager's best}}."""
    times = {name: {w: [] for w in args.beam_widths} for name in engines}
    same = {name: {w: 0 for w in args.beam_widths} for name in engines}
    for r in range(args.rounds):
        rng = random.Random(r + 7)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        for width in args.beam_widths:
            for prompt in prompts:
                best: Dict[str, List[int]] = {}
                for name, search in engines.items():
                    start = time.perf_counter()
                    best[name] = search(prompt, width)
                    times[name][width].append(time.perf_counter() - start)
                for name in engines:
                    same[name][width] += best[name] == best["hf-eager"]
            print(f"round {r + 1}, beam {width}: " + ", ".join(
                f"{n} {statistics.median(times[n][width]) * 1e3:.0f} ms" for n in engines), flush=True)
    return {"times": times, "same": same}


def table(data: Dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [f"# Beam search ({meta['model']}, float32, {meta['cpu']}, {meta['threads']} threads)", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, commit {meta['commit']}, {meta['date']}; "
             f"{meta['prompts']} prompts of {meta['prompt_len']} tokens per round, {meta['rounds']} rounds, "
             f"{meta['max_tokens']} new tokens, no EOS; time of one search, median over prompts and rounds (range); "
             "'same best': searches whose best hypothesis equals HF eager's.", "",
             "| engine | beam width | search [ms] | new tokens/s (per beam x width) | vs HF eager | same best |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        spread = f"{row['ms']:.0f} ({row['min_ms']:.0f}-{row['max_ms']:.0f})"
        lines.append(f"| {row['engine']} | {row['beam_width']} | {spread} | {row['tok_s']:.0f} | "
                     f"{row['vs_hf_eager']:.2f}x | {row['same_best']}/{row['searches']} |")
    return "\n".join(lines) + "\n"


def plot(data: Dict[str, Any], path: str) -> None:
    widths = sorted({r["beam_width"] for r in data["rows"]})
    grouped_bars(path, data["rows"], "beam_width", "ms", [f"beam {w}" for w in widths],
                 f"one search of {data['meta']['max_tokens']} tokens [ms]",
                 f"beam search ({data['meta']['model']}, {data['meta']['prompt_len']}-token prompts)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--beam-widths", type=int, nargs="+", default=[4])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also HF + torch.compile (static cache; compiles at the warm-up)")
    p.add_argument("--smoke", action="store_true", help="tiny-llama, one round, no compile: seconds")
    add_output_args(p, "beam-search")
    args = p.parse_args()
    if args.smoke:
        args.model, args.max_tokens, args.prompts, args.rounds, args.compile = "tiny-llama", 8, 1, 1, False
    resolve_outputs(args, "beam-search")
    from autodeploy.models.factory import resolve_source

    checkpoint = resolve_source(args.model)
    with open(os.path.join(checkpoint, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    max_seq_len = args.prompt_len + args.max_tokens + 16
    engines: Dict[str, Search] = {
        "autodeploy": autodeploy_search(args.model, max_seq_len, args.max_tokens, tail_pages=True),
        "autodeploy (no tail pages)": autodeploy_search(args.model, max_seq_len, args.max_tokens, tail_pages=False),
        "hf-eager": hf_search(checkpoint, args.max_tokens, compile=False),
    }
    if args.compile:
        engines["hf+torch.compile"] = hf_search(checkpoint, args.max_tokens, compile=True)
    warm = list(range(3, 3 + args.prompt_len))
    for width in args.beam_widths:  # warm-up: HF + torch.compile compiles here
        for name, search in engines.items():
            start = time.perf_counter()
            search(warm, width)
            print(f"warm-up {name}, beam {width}: {time.perf_counter() - start:.1f} s", flush=True)
    result = measure(engines, args, vocab)
    rows = []
    searches = args.prompts * args.rounds
    for width in args.beam_widths:
        hf = statistics.median(result["times"]["hf-eager"][width])
        for name in engines:
            t = result["times"][name][width]
            rows.append({"engine": name, "beam_width": width, "ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3,
                         "max_ms": max(t) * 1e3, "tok_s": args.max_tokens * width / statistics.median(t),
                         "vs_hf_eager": hf / statistics.median(t), "same_best": result["same"][name][width],
                         "searches": searches})
    import transformers

    meta = {"model": args.model, "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "prompts": args.prompts, "prompt_len": args.prompt_len, "rounds": args.rounds,
            "max_tokens": args.max_tokens, "beam_widths": args.beam_widths}
    data = {"meta": meta, "rows": rows}
    write_results(args.out, "beam-search", data, table(data))
    plot(data, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
