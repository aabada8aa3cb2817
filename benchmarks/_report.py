"""Writing a micro-benchmark's JSON: the machine (CPU and its vector features, threads, torch,
commit) recorded beside the rows, under ``benchmarks/results/<prefix>-<time>.json``; and the
grouped bar chart several benchmarks draw."""

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
    sorted; ``labels`` names them in that order), its height ``row[value]``; a PNG at ``path``
    (nothing, with a line, when matplotlib is missing)."""
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
        vals = [next(r[value] for r in rows if r["engine"] == name and r[group] == g) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], vals, width, label=name)
    ax.set_xticks([x + width * (len(engines) - 1) / 2 for x in range(len(groups))])
    ax.set_xticklabels(list(labels))
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)
