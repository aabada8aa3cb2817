"""Writing a micro-benchmark's JSON: the machine (CPU and its vector features, threads, torch,
commit) recorded beside the rows, under ``benchmarks/results/<prefix>-<time>.json``; and the
grouped bar chart several benchmarks draw."""

import argparse
import json
import os
import time
from typing import Any, Dict, List, Sequence

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_report(prefix: str, fields: Dict[str, Any]) -> str:
    """Write ``fields`` plus the machine's description; returns the file's path."""
    from autodeploy.bench.runner import cpu_name, git_commit

    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "commit": git_commit(), **fields}
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return path


def grouped_bars(path: str, rows: List[Dict[str, Any]], group: str, value: str, labels: Sequence[str], ylabel: str,
                 title: str, log: bool = False) -> None:
    """One bar per engine (``row["engine"]``, in first-seen order) in each group (``row[group]``,
    sorted; ``labels`` names them in that order), its height ``row[value]`` (no bar where an engine
    has no row in a group); a PNG at ``path`` (nothing, with a line, when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    groups = sorted({r[group] for r in rows})
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(engines)
    for i, name in enumerate(engines):
        vals = [next((r[value] for r in rows if r["engine"] == name and r[group] == g), float("nan")) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], vals, width, label=name)
    ax.set_xticks([x + width * (len(engines) - 1) / 2 for x in range(len(groups))])
    if len(groups) > 5:  # long lists of labels: slanted, so that they do not run into each other
        ax.set_xticklabels(list(labels), rotation=30, ha="right")
    else:
        ax.set_xticklabels(list(labels))
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def add_output_args(p: argparse.ArgumentParser, name: str) -> None:
    """``--out`` and ``--png`` of a benchmark whose files are named ``name`` (see ``resolve_outputs``)."""
    p.add_argument("--out", help="directory of the JSON and markdown (default: benchmarks/results; with --smoke "
                   ".cache/bench/smoke-results)")
    p.add_argument("--png", help=f"where the plot goes (default: benchmarks/{name}.png; with --smoke beside the "
                   "results)")


def resolve_outputs(args: argparse.Namespace, name: str) -> None:
    """Fill in ``args.out`` and ``args.png``: a smoke run's files go under ``.cache`` (never into the
    repository's results)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args.out = args.out or os.path.join(repo, *((".cache", "bench", "smoke-results") if args.smoke
                                               else ("benchmarks", "results")))
    args.png = args.png or (os.path.join(args.out, f"{name}.png") if args.smoke
                            else os.path.join(repo, "benchmarks", f"{name}.png"))


def write_results(out: str, name: str, data: Dict[str, Any], markdown: str) -> str:
    """``data`` as ``<out>/<name>-<time>.json`` and ``markdown`` beside it (also printed); returns the
    path without its extension."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown)
    print(markdown, flush=True)
    return stem
