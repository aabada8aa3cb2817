"""``autodeploy bench`` end to end on the tiny preset: every engine measured, report written.

Timing values are never asserted (the machines are noisy); the test checks that the run
measures what the report claims (every metric for every engine, ratios against HF eager
computed from the same run), that each autodeploy engine's accuracy against HF is in it, and that
the JSON, table and chart are written.
"""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from autodeploy import LLM
from autodeploy.bench.accuracy import compare_with_hf, random_prompts
from autodeploy.bench.report import markdown, write
from autodeploy.bench.runner import BenchConfig, run
from autodeploy.cli import main
from helpers import family_checkpoint


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    # one round and two short accuracy prompts: this fixture checks the report's shape, not speed
    cfg = BenchConfig(model="tiny-llama", batch_sizes=[1, 2], new_tokens=4, prefill_lens=[8], rounds=1,
                      prefill_reps=1, accuracy_prompts=2, accuracy_tokens=12,
                      engines=["autodeploy", "hf-eager"], out_dir=str(tmp_path_factory.mktemp("bench")))
    return cfg, run(cfg)


def test_every_engine_has_every_metric(result):
    _, data = result
    assert set(data["results"]) == {"autodeploy", "hf-eager"}
    for row in data["results"].values():
        for key in ("prefill_tok_s_8", "ttft_ms_8", "decode_tok_s_b1", "decode_tok_s_b2", "decode_ms_per_step_b2"):
            cell = row[key]
            assert cell["min"] <= cell["median"] <= cell["max"] and cell["min"] > 0
        assert row["build_s"] > 0 and 0 < row["bandwidth_floor_fraction_b1"]
    ours, hf = data["results"]["autodeploy"], data["results"]["hf-eager"]
    expected = ours["decode_tok_s_b2"]["median"] / hf["decode_tok_s_b2"]["median"]
    assert ours["decode_tok_s_b2_vs_hf_eager"] == pytest.approx(expected)
    assert hf["decode_tok_s_b1_vs_hf_eager"] == pytest.approx(1.0)
    meta = data["meta"]
    for key in ("torch", "transformers", "autodeploy_commit", "cpu", "threads", "dtype", "read_bandwidth_gbs"):
        assert meta[key] not in (None, "")


def test_accuracy_of_the_autodeploy_engine(result):
    _, data = result
    acc = data["results"]["autodeploy"]["accuracy_vs_hf_eager"]
    assert "accuracy_vs_hf_eager" not in data["results"]["hf-eager"]
    assert acc["prompts"] == 2 and acc["new_tokens"] == 12
    # the default pipeline is float32 throughout: HF's tokens at every step, log-probs to rounding
    assert acc["greedy_step_match"] == 1.0 and acc["prompts_equal_hf"] == 2
    assert acc["max_logprob_abs_err"] < 1e-4
    assert "continuations equal HF greedy" in markdown(data)


def test_accuracy_loads_hf_when_it_is_not_measured(tmp_path):
    cfg = BenchConfig(model="tiny-llama", batch_sizes=[1], new_tokens=2, prefill_lens=[8], rounds=1, prefill_reps=1,
                      engines=["autodeploy"], accuracy_prompts=2, accuracy_tokens=6, out_dir=str(tmp_path))
    data = run(cfg)
    acc = data["results"]["autodeploy"]["accuracy_vs_hf_eager"]
    assert acc["prompts"] == 2 and acc["new_tokens"] == 6 and acc["greedy_step_match"] == 1.0
    assert set(data["results"]) == {"autodeploy"}


def test_accuracy_comparison_sees_a_different_model():
    """The comparison can fail: against HF with perturbed weights the tokens and log-probs differ."""
    llm = LLM(family_checkpoint("llama"), max_seq_len=64, max_batch_size=2, max_num_tokens=64)
    reference = AutoModelForCausalLM.from_pretrained(family_checkpoint("llama"), dtype=torch.float32).eval()
    prompts = random_prompts(3, 8, reference.config.vocab_size)
    exact = compare_with_hf(llm, reference, prompts, 8)
    assert exact["greedy_step_match"] == 1.0 and exact["max_logprob_abs_err"] < 1e-4
    with torch.no_grad():
        for p in reference.model.layers[0].mlp.parameters():
            p.mul_(3.0)
    wrong = compare_with_hf(llm, reference, prompts, 8)
    assert wrong["max_logprob_abs_err"] > 0.1 and wrong["greedy_step_match"] < 1.0 and wrong["prompts_equal_hf"] < 3


def test_report_files_and_targets(result):
    cfg, data = result
    paths = write(data, cfg.out_dir)
    with open(paths["json"]) as f:
        assert json.load(f)["results"].keys() == data["results"].keys()
    table = markdown(data)
    assert "| autodeploy |" in table and "| hf-eager |" in table
    assert "Batch-1 decode bandwidth floor" in table
    assert "decode b1 >= 2x HF eager" in table  # the target lines say met or missed by how much
    assert os.path.getsize(paths["png"]) > 1000


def test_cli_rejects_unknown_engine(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--engines", "vllm"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_warm_up_says_what_it_runs_before_it_starts(caplog, monkeypatch):
    """HF + torch.compile compiles each shape in the warm-up (28 s on ``small``): a line before
    it names the engine, the number of runs and why it is slow; then every shape runs once."""
    import logging

    from autodeploy.bench.engines import BenchEngine

    class Recorder(BenchEngine):
        name = "recorder"
        exact_warmup = True
        warmup_note = " (compiles)"

        def __init__(self):
            self.calls = []

        def generate(self, prompts, new_tokens):
            self.calls.append((len(prompts), len(prompts[0]), new_tokens))
            return 0.0

    monkeypatch.setattr(logging.getLogger("autodeploy"), "propagate", True)
    engine = Recorder()
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        engine.warm_up(prompt_len=3, batch_sizes=[1, 4], new_tokens=6, prefill_lens=[16])
    assert engine.calls == [(1, 3, 1), (1, 3, 6), (4, 3, 1), (4, 3, 6), (1, 16, 1)]
    lines = [r.getMessage() for r in caplog.records]
    assert "warming up recorder: 5 runs, one per measured shape (compiles) ..." in lines
    assert engine.warmup_s >= 0.0
