"""``benchmarks/bench_state_step.py --smoke``: the script runs end to end in a subprocess and
reports the decode paths of every op (torch in place where it has a ``step``, the C kernel where it
builds) and one sequence's prefill through the scan and the kernel (timings never asserted)."""

import os
import subprocess
import sys

from autodeploy.ops import native

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_state_step.py")


def test_smoke_run():
    done = subprocess.run([sys.executable, SCRIPT, "--smoke"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "KiB" in line]
    ops = ["mamba2 scan", "causal conv", "mamba scan", "gated delta rule", "linear attention", "RG-LRU scan", "WKV",
           "mLSTM"]
    assert [r.split(" | ")[0][2:] for r in rows] == ops
    # the torch in-place column for the ops that have a step, the C kernel's for all (when it builds)
    assert [r.split(" | ")[4] == "-" for r in rows] == [False] * 5 + [True] * 3
    if native.available():
        assert all(r.split(" | ")[5].endswith("x] |") for r in rows)
        prefill = [line for line in done.stdout.splitlines() if line.startswith("| ") and " | 16 | " in line]
        assert [r.split(" | ")[0][2:] for r in prefill] == ops
