"""Writing a micro-benchmark's JSON: the machine (CPU and its vector features, threads, torch,
commit) recorded beside the rows, under ``benchmarks/results/<prefix>-<time>.json``."""

import json
import os
import time
from typing import Any, Dict

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
