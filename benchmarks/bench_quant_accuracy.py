#!/usr/bin/env python
"""Perplexity of the trained ``demo`` model on held-out text, per quantization method (issue 15).

    python benchmarks/bench_quant_accuracy.py                 # every method, all held-out text
    python benchmarks/bench_quant_accuracy.py --max-tokens 2048 --methods int8 int4

The ``demo`` model (a 4M-parameter Llama, ``autodeploy/models/demo``) was trained for ~34 epochs
on 55k tokens of the standard library's pydoc topics (``scripts/train_demo_model.py``): it
knows its training prose well (perplexity ~10) and generalises little. So two texts are scored:

- **held-out**: the module docstrings of standard-library modules, which the training corpus
  does not contain (Python documentation prose the model has not seen; its perplexity is high);
- **training prose**: the first windows of the training corpus itself, where the model is
  confident and quantization error shows as lost knowledge.

Each is tokenized with the demo tokenizer (BOS first, as in training) and cut into windows of
``--window`` tokens; the perplexity is exp(mean negative log-likelihood) over every predicted
token.

Rows, all computed in one process on the same windows:

- ``hf eager fp32``: transformers' own model (the reference);
- ``autodeploy fp32``: autodeploy's graph, default pipeline (float);
- one row per ``quantization`` method (``int8``, ``int4`` with group 128 and 32, ``fp8``), each
  autodeploy's graph with that method (the backends as the default pipeline chooses them on this
  machine, e.g. the packed int4/int8 CPU kernels).

For each row: perplexity, its change against HF, the share of positions whose argmax equals HF's,
and the largest and mean absolute log-probability difference of HF's argmax token. autodeploy's
graphs are the uncached ones (the cache_init and compile stages off): the same weights and ops
the engine runs, evaluated over whole windows. Output: JSON + markdown under
``benchmarks/results/`` and a PNG ``benchmarks/quant-accuracy.png``.
"""

import argparse
import copy
import importlib
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from autodeploy.bench.runner import cpu_name  # noqa: E402
from autodeploy.config import load_deploy_config  # noqa: E402
from autodeploy.pipeline import build_graph  # noqa: E402
from autodeploy.transform.interface import Stage  # noqa: E402
from autodeploy.transform.optimizer import build_transform  # noqa: E402

HELD_OUT_MODULES = (
    "json", "csv", "argparse", "logging", "collections", "itertools", "functools", "pathlib", "subprocess",
    "threading", "asyncio", "unittest", "doctest", "random", "statistics", "decimal", "fractions", "heapq",
    "bisect", "textwrap", "string", "re", "shutil", "tempfile", "zipfile", "tarfile", "pickle", "copy",
    "datetime", "calendar", "email", "http.client", "urllib.parse", "xml.dom", "sqlite3", "configparser",
    "contextlib", "dataclasses", "enum", "typing", "inspect", "ast", "dis", "tokenize", "venv", "zipapp",
)
METHODS: Dict[str, Dict[str, Any]] = {
    "int8": {"quantization": "int8"},
    "int4-g128": {"quantization": "int4"},
    "int4-g32": {"quantization": "int4", "transforms": {"quantize_weights": {"group_size": 32}}},
    "fp8": {"quantization": "fp8"},
}


def held_out_text() -> str:
    docs = []
    for name in HELD_OUT_MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        docs.append(" ".join(doc.split()))
    return "\n\n".join(d for d in docs if d)


def training_prose() -> str:
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from train_demo_model import prose_corpus

    return "\n\n".join(prose_corpus())


def windows(tokenizer: Any, text: str, window: int, max_tokens: int) -> torch.Tensor:
    ids = tokenizer(text)["input_ids"][:max_tokens]
    n = len(ids) // window
    return torch.tensor(ids[: n * window]).reshape(n, window)


def uncached_graph(settings: Dict[str, Any]) -> torch.nn.Module:
    """The float or quantized graph ``(input_ids, position_ids) -> logits``, without the caches."""
    cfg = load_deploy_config(model="demo", **settings)
    transforms = copy.deepcopy(cfg.transforms)
    for key, raw in transforms.items():
        if build_transform(key, raw).config.stage.order >= Stage.CACHE_INIT.order:
            transforms[key] = {**(raw or {}), "enabled": False}
    return build_graph(cfg.model_copy(update={"transforms": transforms}), log_summary=False).graph


def log_probs(model: Any, batch: torch.Tensor, hf: bool) -> torch.Tensor:
    pos = torch.arange(batch.shape[1]).expand(*batch.shape)
    with torch.no_grad():
        out = model(input_ids=batch, position_ids=pos)
    logits = out.logits if hf else (out[0] if isinstance(out, (tuple, list)) else out)
    return torch.log_softmax(logits.float(), dim=-1)


def evaluate(model: Any, data: torch.Tensor, hf: bool, ref: List[torch.Tensor]) -> Tuple[Dict[str, float], List]:
    nll, count, agree, diffs, lps = 0.0, 0, 0, [], []
    for i, batch in enumerate(data.split(4)):
        lp = log_probs(model, batch, hf)
        lps.append(lp)
        target = batch[:, 1:]
        nll -= lp[:, :-1].gather(-1, target[..., None]).sum().item()
        count += target.numel()
        if ref:
            r = ref[i]
            best = r.argmax(-1)
            agree += (lp.argmax(-1) == best).sum().item()
            diffs.append((lp.gather(-1, best[..., None]) - r.gather(-1, best[..., None])).abs().flatten())
    row = {"perplexity": math.exp(nll / count), "tokens": count}
    if ref:
        d = torch.cat(diffs)
        row.update(argmax_agree=agree / d.numel(), max_logprob_diff=d.max().item(), mean_logprob_diff=d.mean().item())
    return row, lps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=1 << 20)
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    demo = os.path.join(REPO, "autodeploy", "models", "demo")
    tok = AutoTokenizer.from_pretrained(demo)
    texts = {"held-out": windows(tok, held_out_text(), args.window, args.max_tokens),
             "training prose": windows(tok, training_prose(), args.window, args.max_tokens)}
    hf = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    results: Dict[str, Dict[str, Dict[str, float]]] = {text: {} for text in texts}
    refs = {}
    for text, data in texts.items():
        results[text]["hf eager fp32"], refs[text] = evaluate(hf, data, True, [])
    for name, settings in [("autodeploy fp32", {})] + [(m, METHODS[m]) for m in args.methods]:
        graph = uncached_graph(settings)
        for text, data in texts.items():
            results[text][name] = evaluate(graph, data, False, refs[text])[0]
    for rows in results.values():
        base = rows["hf eager fp32"]["perplexity"]
        for row in rows.values():
            row["vs_hf"] = row["perplexity"] / base - 1.0
    write(results, args, texts)


def write(results: Dict[str, Dict[str, Dict[str, float]]], args: argparse.Namespace,
          texts: Dict[str, torch.Tensor]) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(), "window": args.window,
            "tokens": {t: int(d.numel()) for t, d in texts.items()}, "modules": len(HELD_OUT_MODULES), "time": stamp}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"quant-accuracy-{stamp}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    lines = [f"CPU: {meta['cpu']}; windows of {args.window} tokens; held-out: {meta['tokens']['held-out']} tokens "
             f"of {meta['modules']} standard-library module docstrings; training prose: "
             f"{meta['tokens']['training prose']} tokens.", "",
             "| engine | held-out ppl | vs HF | training-prose ppl | vs HF | argmax = HF (prose) "
             "| max / mean abs log-prob diff (prose) |", "|---|---|---|---|---|---|---|"]
    held, prose = results["held-out"], results["training prose"]
    for name in held:
        h, r = held[name], prose[name]
        agree = f"{100 * r['argmax_agree']:.1f}%" if "argmax_agree" in r else "-"
        diff = f"{r['max_logprob_diff']:.2e} / {r['mean_logprob_diff']:.2e}" if "max_logprob_diff" in r else "-"
        lines.append(f"| {name} | {h['perplexity']:.1f} | {100 * h['vs_hf']:+.2f}% | {r['perplexity']:.3f} "
                     f"| {100 * r['vs_hf']:+.2f}% | {agree} | {diff} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, f"quant-accuracy-{stamp}.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
        for ax, (text, rows) in zip(axes, results.items()):
            ax.bar(list(rows), [r["perplexity"] for r in rows.values()], color="tab:blue")
            ax.set_ylabel("perplexity")
            ax.set_title(f"demo model, {text}")
            plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
        fig.tight_layout()
        fig.savefig(os.path.join(REPO, "benchmarks", "quant-accuracy.png"), dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
