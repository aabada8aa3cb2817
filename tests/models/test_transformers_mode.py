"""The "transformers" mode (``mode: transformers``): the HF module eagerly, its attention on the paged
KV cache, no export. Greedy tokens must equal HF eager's; where the cache cannot serve a model
exactly it must run in recompute mode and say why, never answer wrongly."""

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.config import load_deploy_config
from autodeploy.models.transformers_mode import CACHED_ATTN_IMPL, detect_attention_layers
from autodeploy.utils.errors import ConfigError
from helpers import (FAMILIES, MOE_FAMILIES, family_checkpoint, hf_greedy_tokens, hf_model, moe_family_checkpoint,
                     stateful_checkpoint)

PROMPTS = [[3, 17, 42, 9, 100, 7, 55, 21, 8, 13, 2], [5, 6, 7], [11, 12, 13, 14, 15, 16]]
NEW = 8


def hf_greedy(path: str, prompts=PROMPTS, new: int = NEW) -> list:
    return hf_greedy_tokens(path, prompts, new)


def ours(llm: LLM, prompts=PROMPTS, new: int = NEW) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outputs]


def build(path: str, **settings) -> LLM:
    return LLM(path, mode="transformers", max_seq_len=64, max_batch_size=4, **settings)


# ---- served from the KV cache ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "mistral", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_cached_greedy_tokens_equal_hf(family):
    """Llama (GQA), Mistral (sliding window 8 < the prompts + new tokens) and GPT-OSS (sinks, sliding
    layers, MoE) on the paged cache, with several sequences in one step."""
    path = moe_family_checkpoint(family) if family in MOE_FAMILIES else family_checkpoint(family)
    llm = build(path)
    assert llm.build.context.cache_mode == "paged_kv"
    layers = llm.build.context.hf_attention_layers
    config = MOE_FAMILIES[family] if family in MOE_FAMILIES else FAMILIES[family]
    assert len(layers) == config["num_hidden_layers"]
    assert {layer.num_kv_heads for layer in layers} == {config["num_key_value_heads"]}
    assert len(llm.build.cache.paged_names) == 2 * len(layers)
    assert ours(llm) == hf_greedy(path)


def test_sliding_window_is_honoured():
    """Mistral's window reaches the cached op: the layers report it, and a build whose window is
    dropped gives other tokens than HF (the test above would pass by luck otherwise)."""
    path = family_checkpoint("mistral")
    llm = build(path)
    assert {layer.sliding_window for layer in llm.build.context.hf_attention_layers} == {8}
    runner = llm.build.graph.hf_runner
    original = runner.cached_op

    def no_window(*args):
        return original(*args[:13], None, *args[14:])

    runner.cached_op = no_window
    try:
        assert ours(llm) != hf_greedy(path)
    finally:
        runner.cached_op = original


@pytest.mark.slow
def test_same_tokens_as_the_graph_mode():
    graph = LLM("tiny-llama", max_seq_len=64, max_batch_size=4)
    eager = LLM("tiny-llama", mode="transformers", max_seq_len=64, max_batch_size=4)
    assert ours(eager) == ours(graph)
    summary = eager.build.summary
    assert "export_to_gm" not in summary and "transformers_replace_cached_attn" in summary


# ---- recompute where the cache cannot serve ------------------------------------------------------
def test_state_outside_attention_runs_in_recompute_mode():
    """LFM2's short convolutions keep state the KV cache does not hold: the consistency check sees
    it and the model runs in recompute mode, token-identical to HF."""
    path = stateful_checkpoint("lfm2")
    llm = build(path)
    assert llm.build.context.cache_mode == "recompute"
    assert "disagrees with itself" in llm.build.context.recompute_reason
    assert ours(llm, new=5) == hf_greedy(path, new=5)


def test_probe_records_what_the_cached_op_cannot_honour():
    """A layer whose mask is not causal is recorded with its problem (a near miss: the call goes
    through the attention interface, but the cache would ignore its mask)."""
    model = hf_model(family_checkpoint("llama"))
    layers = detect_attention_layers(model, torch.device("cpu"), 512)
    assert [layer.name for layer in layers] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(not layer.problems for layer in layers)
    attn = model.model.layers[0].self_attn
    attn.is_causal = False
    try:
        layers = detect_attention_layers(model, torch.device("cpu"), 512)
    finally:
        attn.is_causal = True
    assert layers[0].problems == ["the layer is not causal"] and not layers[1].problems


def test_cached_attention_outside_a_step_is_an_error():
    model = hf_model(family_checkpoint("llama"))
    from autodeploy.models.transformers_mode import attn_implementation, register_cached_attention

    register_cached_attention()
    with attn_implementation(model, CACHED_ATTN_IMPL), pytest.raises(RuntimeError, match="outside an autodeploy step"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


# ---- configuration --------------------------------------------------------------------------------
def test_graph_transforms_are_refused_in_transformers_mode():
    with pytest.raises(ConfigError, match="do not run in mode 'transformers'"):
        load_deploy_config(model="tiny-llama", mode="transformers",
                           overrides={"transforms": {"match_rope_pattern": {"enabled": False}}})
    with pytest.raises(ConfigError, match="compile_model"):
        load_deploy_config(model="tiny-llama", mode="transformers", compile_backend="torch-compile")
    config = load_deploy_config(model="tiny-llama", mode="transformers", attn_backend="torch")
    assert config.transforms["transformers_replace_cached_attn"]["backend"] == "torch"
    assert "export_to_gm" not in config.transforms


@pytest.mark.slow
def test_torch_backend_gives_the_same_tokens():
    path = family_checkpoint("llama")
    assert ours(build(path, attn_backend="torch")) == hf_greedy(path)
