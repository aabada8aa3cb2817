"""``benchmarks/bench_state_decode.py --smoke``: the script runs end to end in a subprocess.

Timing values are never asserted (the machines are noisy); the test checks that the run
measures what its report claims: every engine at every point it plans, autodeploy in cache mode
``state`` and in ``recompute``, ratios against HF eager from the same run, and the JSON, table
and chart written.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_state_decode.py")


def _module():
    spec = importlib.util.spec_from_file_location("bench_state_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_and_profiles():
    bench = _module()
    args = bench.parse_args([])
    assert args.histories == [64, 512, 2048] and args.batch_sizes == [1, 8] and args.batch_history == 512
    assert not args.smoke and args.png.endswith(os.path.join("benchmarks", "state-decode.png"))
    points = bench.plan(args)
    # the batch-1 sweep has the three history engines, the batch sweep adds HF + torch.compile; (512, 1) once
    assert list(points) == [(64, 1), (512, 1), (2048, 1), (512, 8)]
    assert points[(64, 1)] == ["autodeploy", "autodeploy-recompute", "hf-eager"]
    assert points[(512, 1)] == list(bench.ENGINES)
    assert points[(512, 8)] == ["autodeploy", "hf-eager", "hf+torch.compile"]
    assert list(bench.plan(bench.parse_args(["--no-compile"])).values())[-1] == ["autodeploy", "hf-eager"]
    smoke = bench.parse_args(["--smoke", "--steps", "3", "--histories", "16", "8", "16"])
    assert smoke.steps == 3 and smoke.histories == [8, 16] and smoke.png is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "0"])
    minimax = bench.parse_args(["--model", "minimax"])
    assert minimax.png.endswith(os.path.join("benchmarks", "state-decode-minimax.png"))
    full, smoke_cfg, label, _ = bench.MODELS["minimax"]
    assert full["layer_types"].count("full_attention") == 1 and len(full["layer_types"]) == full["num_hidden_layers"]
    assert "lightning attention" in bench.describe(full) and label == "MiniMax"


@pytest.mark.slow  # 17 s: the benchmark script end to end in a subprocess (benchmarks run on their own)
def test_smoke_run(tmp_path):
    png = tmp_path / "plot.png"
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--rounds", "2", "--steps", "3", "--out", str(tmp_path),
                           "--png", str(png)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [path] = [p for p in os.listdir(tmp_path) if p.endswith(".json")]
    with open(tmp_path / path) as f:
        data = json.load(f)
    meta, results = data["meta"], data["results"]
    assert meta["smoke"] and meta["steps"] == 3 and meta["rounds"] == 2
    for k in ("cpu", "threads", "torch", "transformers", "autodeploy_commit"):
        assert meta[k] not in (None, "")
    assert data["model"]["parameters"] > 0 and os.path.isfile(os.path.join(data["model"]["checkpoint"], "config.json"))
    assert results["autodeploy"]["info"]["cache_mode"] == "state"
    assert results["autodeploy-recompute"]["info"]["cache_mode"] == "recompute"
    both = {"h8_b1", "h24_b1", "h40_b1", "h24_b2"}  # the history sweep and the batch sweep at 24
    expected = {"autodeploy": both, "hf-eager": both, "autodeploy-recompute": {"h8_b1", "h40_b1"}}
    for name, keys in expected.items():
        assert {k for k in results[name] if k != "info"} == keys
        for k in keys:
            cell = results[name][k]
            for metric in ("ms_per_step", "tok_s"):
                assert 0 < cell[metric]["min"] <= cell[metric]["median"] <= cell[metric]["max"]
            assert 2 <= cell["steps"] <= 3
    ours, hf = results["autodeploy"]["h24_b2"], results["hf-eager"]["h24_b2"]
    assert ours["tok_s_vs_hf_eager"] == pytest.approx(hf["ms_per_step"]["median"] / ours["ms_per_step"]["median"])
    assert results["hf-eager"]["h8_b1"]["tok_s_vs_hf_eager"] == pytest.approx(1.0)
    flat = data["checks"]["autodeploy"]
    assert flat["flat"] == (flat["slowest_over_fastest"] <= flat["flat_claim"])
    assert "| autodeploy | state |" in proc.stdout and "| autodeploy-recompute | recompute |" in proc.stdout
    assert "State cache flat in the history" in proc.stdout
    assert os.path.getsize(png) > 1000
