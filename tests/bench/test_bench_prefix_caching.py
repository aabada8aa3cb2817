"""``benchmarks/bench_prefix_caching.py --smoke``: the script runs end to end in a subprocess.

Timing values are never asserted (the machines are noisy); the test checks that the run reports
every engine at every prefix, with the ratio against HF eager from the same run, and that the
prefix-caching engine really read cached pages (its "later" requests computed less: checked on
the engine's own counters through the JSON, not on time).
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_prefix_caching.py")


@pytest.mark.slow  # ~15 s: the benchmark script end to end in a subprocess (benchmarks run on their own)
def test_smoke_run(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path), "--png", str(tmp_path / "p.png")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    data = json.load(open(tmp_path / result))
    engines = {r["engine"] for r in data["rows"]}
    assert engines == {"autodeploy (prefix caching)", "autodeploy (no prefix caching)", "hf-eager"}
    assert {r["prefix"] for r in data["rows"]} == {48}
    hf = next(r for r in data["rows"] if r["engine"] == "hf-eager")
    assert hf["vs_hf_eager"] == 1.0
    cached = next(r for r in data["rows"] if r["engine"] == "autodeploy (prefix caching)")
    assert cached["hit_tokens"] == 48 * data["meta"]["rounds"] * (data["meta"]["questions"] - 1)
    plain = next(r for r in data["rows"] if r["engine"] == "autodeploy (no prefix caching)")
    assert plain["hit_tokens"] == 0
    assert os.path.exists(tmp_path / "p.png") or "matplotlib missing" in done.stdout


@pytest.mark.slow  # ~15 s, as above
def test_next_turn_smoke_run(tmp_path):
    """``--next-turn``: each next turn reads every token its first turn computed (the 48-token
    prompt: three whole pages of 16), and no others."""
    done = subprocess.run([sys.executable, SCRIPT, "--smoke", "--next-turn", "--out", str(tmp_path), "--png",
                           str(tmp_path / "p.png")], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    data = json.load(open(tmp_path / result))
    assert data["meta"]["next_turn"] is True
    cached = next(r for r in data["rows"] if r["engine"] == "autodeploy (prefix caching)")
    assert cached["hit_tokens"] == 48 * data["meta"]["rounds"] * data["meta"]["questions"]
    assert "a conversation's next turn" in open(tmp_path / result.replace(".json", ".md")).read()
