"""``benchmarks/bench_state_step.py --smoke``: the script runs end to end in a subprocess and
reports both decode paths for every op that has an in-place ``step`` (timings never asserted)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_state_step.py")


def test_smoke_run():
    done = subprocess.run([sys.executable, SCRIPT, "--smoke"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "KiB" in line]
    assert [r.split(" | ")[0][2:] for r in rows] == ["mamba2 scan", "causal conv", "mamba scan", "gated delta rule",
                                                     "linear attention"]
