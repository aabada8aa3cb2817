#!/usr/bin/env python
"""Guided decoding: the time to build the token mask of a state not seen before, by the two
builders (``token_masks``' sorted walk, ``dense_masks``' tensor steps), on a small and a large
vocabulary.

    python benchmarks/bench_guided_masks.py                  # the demo preset's tokenizer and a 128k BPE
    python benchmarks/bench_guided_masks.py --big-vocab 0    # the demo tokenizer only (seconds)

The states are those a sample output passes through (a JSON object for the schema, a quoted
string for the string regex): each is a state an engine meets the first time a request with that
constraint gets there, and its mask build stalls that step for the whole batch. The large
vocabulary is a byte-level BPE trained here on the Python sources of this environment (no
download: no real 128k tokenizer ships offline); it is cached under ``.cache/autodeploy``.
Each state's mask is built (the mask cache is emptied before each) while the transitions
computed for earlier states stay, as in an engine; reported per state: median and maximum, and the total over the
output. Writes JSON and markdown to ``benchmarks/results/`` and ``benchmarks/guided-masks.png``.
"""

import argparse
import glob
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _report import write_report  # noqa: E402
from autodeploy.runtime.guided.params import GuidedDecodingParams, _compile  # noqa: E402
from autodeploy.runtime.guided.token_masks import TokenMasks  # noqa: E402
from autodeploy.runtime.guided.vocab import TokenVocab  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["name", "age", "email", "tags"]}
TREE = {"$defs": {"Node": {"type": "object", "required": ["value"], "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}},
    "$ref": "#/$defs/Node"}
CONSTRAINTS = {
    "json_schema": ({"json": SCHEMA}, '{"name": "Ada Lovelace, Countess", "age": 36, "email": "ada@example.org", '
                                      '"tags": ["a", "c"]}'),
    "string_regex": ({"regex": r'"([^"\\]|\\["\\n])*"'}, '"a free text answer, \\"quoted\\" in places, naïve"'),
    # JSON mode: a pushdown recognizer (states are stacks), so always the walk
    "json_object": ({"json_object": True}, '{"name": "Ada Lovelace, Countess", "age": 36, "tags": ["a", {"b": null}]}'),
    # a recursive schema (a tree): the grammars' pushdown recognizer, the walk too
    "recursive_schema": ({"json": TREE}, '{"value": 1, "children": [{"value": 20, "children": [{"value": 3}]}, '
                                         '{"value": 4}]}'),
}
PUSHDOWN = {"json_object", "recursive_schema"}  # states are stacks: no transition table, no dense builder


def big_tokenizer(size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(REPO, ".cache", "autodeploy", "bench-tokenizers", f"bpe{size}")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        files = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "**", "*.py"), recursive=True))

        def texts():
            total = 0
            for name in files:
                try:
                    with open(name, encoding="utf-8") as f:
                        text = f.read()
                except (OSError, UnicodeDecodeError):
                    continue
                total += len(text)
                yield text
                if total > 150e6:
                    return

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(texts(), trainers.BpeTrainer(
            vocab_size=size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def states_along(automaton: Any, text: str) -> List[Any]:
    """The distinct states the automaton passes through reading ``text`` (the initial one first)."""
    state, seen = automaton.initial, [automaton.initial]
    for byte in text.encode():
        state = automaton.step(state, byte)
        assert state is not None, text
        if state not in seen:
            seen.append(state)
    return seen


def measure(vocab: TokenVocab, guided: Dict[str, Any], sample: str, dense: bool) -> Dict[str, Any]:
    params = GuidedDecodingParams(**guided)
    _compile.cache_clear()  # each builder gets its own automaton, with no transitions computed yet
    automaton = params.automaton()
    states = states_along(automaton, sample)
    t0 = time.perf_counter()
    TokenMasks(automaton, vocab, dense=dense)  # the vocabulary's token order (once per tokenizer)
    setup = time.perf_counter() - t0
    times = []
    allowed = []
    masks = TokenMasks(automaton, vocab, dense=dense)
    for state in states:
        masks._cache.clear()  # every mask is built (the transitions the automaton computed stay, as in an engine)
        t0 = time.perf_counter()
        mask = masks.mask(state, False, len(vocab))
        times.append(time.perf_counter() - t0)
        allowed.append(int(mask.sum()))
    return {"states": len(states), "median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times),
            "total_ms": 1e3 * sum(times), "setup_ms": 1e3 * setup, "allowed_median": statistics.median(allowed),
            "allowed_max": max(allowed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-vocab", type=int, default=128000, help="size of the trained BPE (0: skip it)")
    parser.add_argument("--png", default=os.path.join(REPO, "benchmarks", "guided-masks.png"))
    args = parser.parse_args()
    from autodeploy.models.presets import preset_dir
    from transformers import AutoTokenizer

    tokenizers = {"demo": AutoTokenizer.from_pretrained(preset_dir("demo"))}
    if args.big_vocab:
        tokenizers[f"bpe{args.big_vocab // 1000}k"] = big_tokenizer(args.big_vocab)
    rows = []
    for tok_name, tok in tokenizers.items():
        vocab = TokenVocab.from_tokenizer(tok)
        for kind, (guided, sample) in CONSTRAINTS.items():
            for dense in (False, True) if kind not in PUSHDOWN else (False,):
                row = {"vocab": tok_name, "vocab_size": len(vocab), "constraint": kind,
                       "builder": "dense" if dense else "walk", **measure(vocab, guided, sample, dense)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    path = write_report("guided-masks", {"rows": rows})
    lines = ["| vocabulary | constraint | builder | states | median ms | max ms | total ms | token order ms |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['vocab']} ({r['vocab_size']}) | {r['constraint']} | {r['builder']} | {r['states']} | "
              f"{r['median_ms']:.2f} | {r['max_ms']:.2f} | {r['total_ms']:.0f} | {r['setup_ms']:.0f} |" for r in rows]
    table = "\n".join(lines)
    with open(path.replace(".json", ".md"), "w") as f:
        f.write(table + "\n")
    print(table)
    _plot(rows, args.png)


def _plot(rows: List[Dict[str, Any]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["vocab"], r["constraint"]) for r in rows}, key=lambda g: (g[0] != "demo", g))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for k, builder in enumerate(("walk", "dense")):
        values = [next((r["total_ms"] for r in rows if (r["vocab"], r["constraint"]) == g and r["builder"] == builder),
                       0.0) for g in groups]
        ax.bar([i + (k - 0.5) * width for i in range(len(groups))], values, width, label=builder)
    ax.set_xticks(range(len(groups)), [f"{v}\n{c}" for v, c in groups])
    ax.set_yscale("log")
    ax.set_ylabel("ms to build every mask of one sample output")
    ax.set_title("Guided decoding: token masks of new states")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
