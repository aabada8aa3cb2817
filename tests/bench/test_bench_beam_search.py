"""``benchmarks/bench_beam_search.py --smoke``: the script runs end to end in a subprocess.

Timing values are never asserted (the machines are noisy); the test checks that every engine is
reported, with the ratio against HF eager from the same run, and that autodeploy's best
hypothesis, with and without tail pages, equals HF eager's in every search.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_beam_search.py")


@pytest.mark.slow  # ~20 s: the benchmark script end to end in a subprocess (benchmarks run on their own)
def test_smoke_run(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path), "--png", str(tmp_path / "b.png")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    rows = json.load(open(tmp_path / result))["rows"]
    assert [r["engine"] for r in rows] == ["autodeploy", "autodeploy (no tail pages)", "hf-eager"]
    assert next(r for r in rows if r["engine"] == "hf-eager")["vs_hf_eager"] == 1.0
    assert all(r["same_best"] == r["searches"] > 0 for r in rows)
    assert os.path.exists(tmp_path / "b.png") or "matplotlib missing" in done.stdout
