#!/usr/bin/env python
"""Time to first token when requests share a long prefix (a system prompt): prefix caching on
and off, against HF eager and HF + torch.compile.

    python benchmarks/bench_prefix_caching.py                      # small preset, prefixes of 256 and 1024 tokens
    python benchmarks/bench_prefix_caching.py --prefixes 512 --questions 4 --no-compile
    python benchmarks/bench_prefix_caching.py --smoke              # tiny-llama, seconds
    python benchmarks/bench_prefix_caching.py --next-turn --model DIR   # a conversation's next turn

Each engine answers the same requests one after another, each alone: per round and prefix
length, ``--questions`` prompts that share one prefix (``--prefixes`` tokens of random ids, new
in every round) and end in ``--question-len`` tokens of their own, one new token each (greedy),
so the time is the time to the first token. The first request of a round's prefix finds nothing
cached ("first", median over rounds); the others find its pages in autodeploy's prefix cache
("later", median; "second": the second request alone). A model with state caches (Mamba2:
``--model`` a checkpoint of one) resumes only from a kept copy of its state, which the second
request of a prefix leaves where the prompts part: that request computes the prefix again (its
time is "second"), the ones after it start from the copy. autodeploy runs with its defaults
except ``enable_prefix_caching``; HF has no prefix cache (its ``generate`` computes every
prompt). The engines take turns on each round's requests, so machine noise hits them alike.

``--next-turn``: conversations instead of a shared prefix. Per round and length, ``--questions``
conversations of their own: a first turn of ``--prefixes`` tokens ("first"), then the next turn
(that prompt, the token the first turn sampled and a ``--question-len``-token question:
"later"), each with one new token. The next turn goes on from everything the first computed, so
autodeploy starts from the first turn's pages and its partly filled last page (a state-cache
model: from the copy of its final state, README "Prefix caching"); HF computes it whole.
Writes JSON and markdown to ``benchmarks/results/`` and a PNG, ``benchmarks/prefix-caching.png``
(``--png`` elsewhere).
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import torch  # noqa: E402

from _report import add_output_args, grouped_bars, resolve_outputs, write_results  # noqa: E402

from autodeploy.bench.engines import AutoDeployEngine, HFEngine  # noqa: E402
from autodeploy.bench.runner import cpu_name, git_commit  # noqa: E402


def _prompts(prefix_len: int, questions: int, question_len: int, vocab: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(question_len)] for _ in range(questions)]


def _hit_tokens(engine: Any) -> int:
    return engine.llm.engine.scheduler.prefix_hit_tokens if isinstance(engine, AutoDeployEngine) else 0


def _next_turn_pairs(length: int, conversations: int, question_len: int, vocab: int, seed: int
                     ) -> List[List[List[int]]]:
    """[first turn, next turn] per conversation; the next turn's prompt goes on from the first's
    (its one new token, which the first turn sampled but never computed, may be any token)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(conversations):
        first = [rng.randrange(3, vocab) for _ in range(length)]
        pairs.append([first, first + [rng.randrange(3, vocab) for _ in range(1 + question_len)]])
    return pairs


def measure(engines: Dict[str, Any], prefixes: List[int], args: argparse.Namespace, vocab: int,
            hits: Dict[str, Dict[int, int]]) -> Dict[str, Any]:
    """{engine: {prefix_len: {"first": [s, ...], "later": [s, ...]}}}; ``hits`` gets the tokens
    each autodeploy engine read from its prefix cache per prefix length."""
    times: Dict[str, Dict[int, Dict[str, List[float]]]] = {
        name: {p: {"first": [], "later": [], "second": []} for p in prefixes} for name in engines}
    for r in range(args.rounds):
        for p in prefixes:
            seed = 1000 * p + r + 2
            if args.next_turn:
                turns = _next_turn_pairs(p, args.questions, args.question_len, vocab, seed)
            else:
                turns = [_prompts(p, args.questions, args.question_len, vocab, seed)]
            for name, engine in engines.items():
                before = _hit_tokens(engine)
                for prompts in turns:
                    for i, prompt in enumerate(prompts):
                        elapsed = engine.generate([prompt], 1)
                        times[name][p]["first" if i == 0 else "later"].append(elapsed)
                        if i == 1 and not args.next_turn:
                            times[name][p]["second"].append(elapsed)
                hits.setdefault(name, {})[p] = hits.get(name, {}).get(p, 0) + _hit_tokens(engine) - before
            print(f"round {r + 1}, prefix {p}: " + ", ".join(
                f"{n} {statistics.median(times[n][p]['later']) * 1e3:.0f} ms" for n in engines), flush=True)
    return times


def _name(model: str) -> str:
    """A preset's name, or a checkpoint directory's last component (titles stay short)."""
    return os.path.basename(model.rstrip("/")) or model


def table(data: Dict[str, Any]) -> str:
    meta, rows = data["meta"], data["rows"]
    if meta.get("next_turn"):
        what, legend = "a conversation's next turn", (
            f"{meta['questions']} conversations per length and round, {meta['rounds']} rounds; 'first': a first "
            "turn of 'prefix tokens' (median); 'later': the next turn (that prompt, the token it sampled and a "
            f"{meta['question_len']}-token question; median (ms), with its range); the ratio is HF eager's time "
            "over the engine's ('later').")
    else:
        what, legend = "a shared prefix", (
            f"{meta['questions']} questions of {meta['question_len']} tokens per prefix and round, {meta['rounds']} "
            "rounds; 'first': the first request of a round's prefix (nothing cached), median over rounds; 'later': "
            "median over the others (ms), with its range; 'second': the second request of a round (median); "
            "the ratio is HF eager's time over the engine's ('later').")
    lines = [f"# Time to first token with {what} ({_name(meta['model'])}, {meta['dtype']}, {meta['cpu']}, "
             f"{meta['threads']} threads)", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, commit {meta['commit']}, {meta['date']}; "
             + legend, "",
             "| engine | prefix tokens | first request [ms] | second [ms] | later requests [ms] | vs HF eager |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        second = f"{row['second_ms']:.0f}" if row.get("second_ms") is not None else "-"
        lines.append(f"| {row['engine']} | {row['prefix']} | {row['first_ms']:.0f} | {second} | {row['later_ms']:.0f} "
                     f"({row['later_min_ms']:.0f}-{row['later_max_ms']:.0f}) | {row['vs_hf_eager']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(data: Dict[str, Any], path: str) -> None:
    prefixes = sorted({r["prefix"] for r in data["rows"]})
    grouped_bars(path, data["rows"], "prefix", "later_ms", [f"prefix {p}" for p in prefixes],
                 "time to first token [ms]",
                 f"shared prefix + {data['meta']['question_len']}-token question ({_name(data['meta']['model'])})",
                 log=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--prefixes", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--next-turn", action="store_true",
                   help="conversations: time a next turn going on from a first one (module docstring)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also HF + torch.compile (static cache; compiles each prompt length once)")
    p.add_argument("--smoke", action="store_true", help="tiny-llama, short prefixes, one round: seconds")
    add_output_args(p, "prefix-caching")
    args = p.parse_args()
    if args.smoke:
        args.model, args.prefixes, args.questions, args.question_len, args.rounds = "tiny-llama", [48], 2, 8, 1
        args.compile = False
    resolve_outputs(args, "prefix-caching")
    from autodeploy.models.factory import resolve_source

    checkpoint = resolve_source(args.model)
    with open(os.path.join(checkpoint, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    max_seq_len = max(args.prefixes) + args.question_len + 8  # (a next turn: + 1 token, within the 8)
    engines: Dict[str, Any] = {
        "autodeploy (prefix caching)": AutoDeployEngine(args.model, label="autodeploy (prefix caching)", dtype="float32",
                                                        max_seq_len=max_seq_len, enable_prefix_caching=True),
        "autodeploy (no prefix caching)": AutoDeployEngine(args.model, label="autodeploy (no prefix caching)",
                                                           dtype="float32", max_seq_len=max_seq_len),
        "hf-eager": HFEngine(checkpoint, torch.float32),
    }
    if args.compile:
        engines["hf+torch.compile"] = HFEngine(checkpoint, torch.float32, compile=True)
    # warm-up: every engine runs each prompt length once (HF + torch.compile compiles it here)
    for p_len in args.prefixes:
        warm = _prompts(p_len, 1, args.question_len, vocab, seed=1)[0]
        for engine in engines.values():
            engine.generate([warm], 1)
    hits: Dict[str, Dict[int, int]] = {}
    times = measure(engines, args.prefixes, args, vocab, hits)
    rows = []
    for p_len in args.prefixes:
        hf = statistics.median(times["hf-eager"][p_len]["later"])
        for name in engines:
            later = times[name][p_len]["later"]
            rows.append({"engine": name, "prefix": p_len, "first_ms": statistics.median(times[name][p_len]["first"]) * 1e3,
                         "later_ms": statistics.median(later) * 1e3, "later_min_ms": min(later) * 1e3,
                         "later_max_ms": max(later) * 1e3, "vs_hf_eager": hf / statistics.median(later),
                         "second_ms": (statistics.median(times[name][p_len]["second"]) * 1e3
                                       if times[name][p_len]["second"] else None),
                         "hit_tokens": hits.get(name, {}).get(p_len)})
    import transformers

    meta = {"model": args.model, "dtype": "float32", "cpu": cpu_name(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "questions": args.questions, "question_len": args.question_len,
            "rounds": args.rounds, "prefixes": args.prefixes, "next_turn": args.next_turn}
    data = {"meta": meta, "rows": rows}
    write_results(args.out, "prefix-caching", data, table(data))
    plot(data, args.png)
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
