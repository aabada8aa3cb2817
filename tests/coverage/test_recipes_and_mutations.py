"""The coverage sweep's two size recipes, and a mutation test of the sweep itself: with a
transform broken on purpose the sweep must report failures."""

import os

import pytest

from autodeploy.cli import main
from autodeploy.coverage.check import LOGITS_RTOL, PROMPT_LENGTHS, CheckResult, run_check
from autodeploy.coverage.configs import tiny_config
from autodeploy.coverage.mutations import validate_mutation
from autodeploy.coverage.recipes import ODD, REGULAR
from autodeploy.coverage.report import markdown, summarize
from autodeploy.coverage.sweep import run_sweep

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(REPO, ".cache", "coverage")


def test_recipe_b_puts_sizes_where_models_are_sensitive():
    llama = tiny_config("llama", "b")
    assert llama["hidden_size"] == 96 and llama["num_attention_heads"] == 6 and llama["head_dim"] == 24
    assert llama["head_dim"] != llama["hidden_size"] // llama["num_attention_heads"]
    assert llama["num_attention_heads"] // llama["num_key_value_heads"] == 3  # recipe a: 2 per group
    assert llama["max_position_embeddings"] == 256
    moe = tiny_config("qwen2_moe", "b")
    assert moe["num_experts"] > 2 * moe["num_experts_per_tok"]
    mamba2 = tiny_config("mamba2", "b")
    assert mamba2["n_groups"] == 2 and mamba2["chunk_size"] == 4 < max(PROMPT_LENGTHS)
    assert mamba2["num_heads"] * mamba2["head_dim"] == 2 * mamba2["hidden_size"]  # expand 2
    falcon_h1 = tiny_config("falcon_h1", "b")
    assert falcon_h1["mamba_n_groups"] == 2 and falcon_h1["mamba_chunk_size"] == 4
    gemma3 = tiny_config("gemma3_text", "b")
    assert gemma3["sliding_window"] < min(PROMPT_LENGTHS)
    assert gemma3["query_pre_attn_scalar"] == gemma3["head_dim"] == 24
    assert tiny_config("xlstm", "b")["chunk_size"] == 4  # xLSTM's chunkwise scan
    assert "chunk_size" not in tiny_config("mamba2", "a")  # recipe a keeps the config's own


def test_recipes_differ_in_every_sensitive_size():
    for field in ("hidden", "heads", "head_dim", "experts", "top_k", "ssm_groups", "window", "vocab"):
        assert getattr(REGULAR, field) != getattr(ODD, field), field
    assert ODD.hidden % 64 and ODD.heads & (ODD.heads - 1)  # not powers of two
    assert tiny_config("llama", "a")["hidden_size"] == 64


def test_unknown_recipe_and_mutation_are_clear_errors(capsys):
    with pytest.raises(ValueError, match="unknown coverage recipe 'z'"):
        tiny_config("llama", "z")
    with pytest.raises(ValueError, match="unknown mutation 'flip'"):
        validate_mutation("flip")
    with pytest.raises(ValueError, match="no transform is registered under 'nope'"):
        validate_mutation("noop:nope")
    assert main(["coverage", "--only", "llama", "--recipes", "a,z"]) != 0
    assert "unknown recipe(s) ['z']" in capsys.readouterr().err


def test_a_type_passes_only_if_every_recipe_passes():
    results = [
        CheckResult("both", recipe="a", status="pass", stage="compare", logits_rel_rmse=1e-7, cache_mode="paged_kv"),
        CheckResult("both", recipe="b", status="pass", stage="compare", logits_rel_rmse=2e-7, cache_mode="paged_kv"),
        CheckResult("only_a", recipe="a", status="pass", stage="compare", logits_rel_rmse=1e-7, cache_mode="recompute"),
        CheckResult("only_a", recipe="b", status="error", stage="cache_init", failed_transform="recompute_fallback",
                    error="RuntimeError: shape '[1, 7, -1]' is invalid"),
    ]
    s = summarize(results)
    assert s["decoder_only"] == 2 and s["passed"] == 1
    assert s["failed_only_at"] == {"b": 1}
    assert s["per_recipe"]["a"]["passed"] == 2 and s["per_recipe"]["b"]["passed"] == 1
    md = markdown(results)
    assert "| both | pass | pass | pass | paged KV | 1.0e-07 / 2.0e-07 |  |" in md
    assert ("| only_a | FAIL | pass | FAIL: error at cache_init (recompute_fallback) | recompute / - | 1.0e-07 / - | "
            "b: RuntimeError: shape '[1, 7, -1]' is invalid |") in md
    assert "* **only_a** (b): not investigated yet." in md  # every failure gets a cause line
    named = markdown([CheckResult("blt", recipe="b", status="error", stage="export", error="x")])
    assert "* **blt** (b): the byte patcher chooses patch boundaries from the data" in named


@pytest.mark.parametrize("model_type", ["llama", "falcon", pytest.param("qwen3", marks=pytest.mark.slow),
                                        pytest.param("gemma2", marks=pytest.mark.slow)])
def test_fast_families_pass_at_the_odd_recipe(model_type):
    result = run_check(model_type, CACHE, recipe="b")
    assert result.status == "pass", f"{model_type}: {result.outcome} at {result.stage}: {result.error}"
    assert result.recipe == "b" and result.cache_mode == "paged_kv"


ROPE_FAMILIES = ["llama", "qwen2", "gemma", "phi3"]


@pytest.mark.slow  # 22 s: four families through the sweep's child processes (the suite's 15-minute budget)
def test_sweep_reports_every_type_when_rope_rotates_the_wrong_way():
    """The mutation test of the sweep: RoPE with the wrong sign must fail every RoPE model, as
    wrong output (not a crash), and the child's log shows the mutation ran. The logits catch it
    everywhere; the greedy tokens of a tiny random model do not always change (gemma's stay the
    same, its logits move by a relative 8e-4), which is why the check compares both."""
    results = run_sweep(ROPE_FAMILIES, jobs=2, cache_dir=CACHE, recipes=["a"], mutate="rope_sign")
    assert [r.model_type for r in results] == sorted(ROPE_FAMILIES)
    for r in results:
        assert r.status == "mismatch" and r.stage == "compare", (r.model_type, r.outcome, r.stage, r.error)
        assert r.logits_rel_rmse > LOGITS_RTOL and "logits rel. RMSE" in r.error
        with open(os.path.join(CACHE, "logs", f"{r.model_type}.a.log")) as f:
            assert "mutation rope_sign: flipped the rotation of 2 RoPE op(s)" in f.read()
    assert summarize(results)["passed"] == 0


@pytest.mark.slow  # ~8 s: a whole coverage run of one type; the recipe/mutation tests above run by default
def test_a_transform_that_finds_nothing_is_reported_as_recompute_not_hidden():
    """Without cached attention the model still answers right (recompute_fallback serves it),
    so the check passes, but the report must say it ran in recompute mode."""
    (result,) = run_sweep(["llama"], cache_dir=CACHE, recipes=["a"], mutate="noop:insert_cached_attention")
    assert result.status == "pass" and result.cache_mode == "recompute", (result.outcome, result.error)
