"""``kv_cache_dtype: fp8`` end to end.

* On the tiny llama (no calibrated scales: 1.0): the pool holds 4x the pages of the float32 cache
  at the same memory budget, the cached graph still passes recompute_fallback's consistency check
  (paged KV, not recompute), and greedy generation gives the float cache's tokens, with the
  chosen tokens' log-probabilities within ``LOGPROB_TOL``.
* On a ModelOpt FP8 checkpoint that declares ``kv_cache_quant_algo: FP8`` and stores
  ``self_attn.k_proj.k_scale`` / ``self_attn.v_proj.v_scale``: each layer's cached attention gets
  that layer's scales, and only a deployment that leaves them unused warns about them.
* The top-level ``kv_cache_dtype`` shortcut writes the transform field.
"""

import contextlib
import json
import logging
import os
import shutil
from types import SimpleNamespace
from typing import Dict, Iterator, List

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import fx

from autodeploy import LLM, SamplingParams
from autodeploy.config import load_deploy_config
from autodeploy.models.checkpoint import find_checkpoint
from autodeploy.models.quantization import QuantizationInfo
from autodeploy.pipeline import build_graph
from autodeploy.transform.library.insert_cached_attention import kv_cache_scales
from autodeploy.utils.errors import ConfigError, ModelSourceError
from helpers import family_checkpoint
from quant_checkpoints import quantized_checkpoint

ad = torch.ops.autodeploy
# A 1 MiB pool: below what 64 full-length sequences could use, so the budget (not the batch cap)
# sizes both pools.
LIMITS = dict(max_seq_len=256, max_batch_size=64, max_num_tokens=32,
              transforms={"resize_kv_cache": {"cpu_max_cache_gb": 1 / 1024}})
PROMPT_LENGTHS = (5, 17, 40, 9)  # the 40-token prompt is prefilled in two chunks
NEW_TOKENS = 16
# Largest |log p(fp8) - log p(float32)| of a chosen token allowed (measured: < 6e-3).
LOGPROB_TOL = 2e-2
NUM_LAYERS = 2
SCALES = {layer: (0.0213 * (layer + 1), 0.0117 * (layer + 1)) for layer in range(NUM_LAYERS)}


@contextlib.contextmanager
def _logs() -> Iterator[List[logging.LogRecord]]:
    """The autodeploy tree's records while the block runs (its logger does not propagate)."""
    records: List[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger("autodeploy")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _text(records: List[logging.LogRecord], level: int = logging.INFO) -> str:
    return "\n".join(r.getMessage() for r in records if r.levelno >= level)


@pytest.fixture(scope="module")
def engines():
    float_llm = LLM(family_checkpoint("llama"), **LIMITS)
    with _logs() as records:
        fp8_llm = LLM(family_checkpoint("llama"), kv_cache_dtype="fp8", **LIMITS)
    return float_llm, fp8_llm, records


def _cached_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "cached_attention_with_cache" in str(n.target)]


def _layer(node: fx.Node) -> int:
    return int(str(node.args[9].name).rpartition("_")[2])  # its k_cache input: k_cache_<layer>


def test_fp8_pool_holds_four_times_the_pages(engines):
    float_llm, fp8_llm, records = engines
    f32, f8 = float_llm.build.cache, fp8_llm.build.cache
    assert {t.dtype for t in f8.caches.values()} == {torch.float8_e4m3fn}
    assert {t.dtype for t in f32.caches.values()} == {torch.float32}
    assert f32.bytes_per_page() == 4 * f8.bytes_per_page() == 4 * NUM_LAYERS * 2 * 16 * 2 * 16
    assert f8.num_pages == 4 * f32.num_pages  # 512 vs 128 pages of 16 tokens in 1 MiB
    assert f8.paged_bytes() == f32.paged_bytes()
    assert fp8_llm.build.context.cache_mode == "paged_kv"  # the consistency check passed
    nodes = _cached_nodes(fp8_llm.build.graph_module)
    assert len(nodes) == NUM_LAYERS and all(n.args[-2:] == (1.0, 1.0) for n in nodes)
    assert all(len(n.args) == 15 for n in _cached_nodes(float_llm.build.graph_module))  # no scale arguments
    assert "no calibrated FP8 KV-cache scales" in _text(records)


def test_greedy_generation_matches_the_float_cache(engines):
    float_llm, fp8_llm, _ = engines
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    exact, narrow = float_llm.generate(prompts, params), fp8_llm.generate(prompts, params)
    for a, b in zip(exact, narrow):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        lp_a = [next(iter(step.values())) for step in a.outputs[0].logprobs]
        lp_b = [next(iter(step.values())) for step in b.outputs[0].logprobs]
        diffs = [abs(x - y) for x, y in zip(lp_a, lp_b)]
        assert max(diffs) < LOGPROB_TOL
        assert max(diffs) > 0  # the fp8 cache did round something


def test_shortcut_sets_the_transform_field():
    config = load_deploy_config(model="tiny-llama", kv_cache_dtype="fp8")
    assert config.transforms["insert_cached_attention"]["kv_cache_dtype"] == "fp8"
    plain = load_deploy_config(model="tiny-llama")
    assert plain.kv_cache_dtype is None
    assert (plain.transforms.get("insert_cached_attention") or {}).get("kv_cache_dtype", "auto") == "auto"
    with pytest.raises(ConfigError, match="kv_cache_dtype.*transforms.insert_cached_attention.kv_cache_dtype"):
        load_deploy_config(model="tiny-llama", kv_cache_dtype="fp8",
                           transforms={"insert_cached_attention": {"kv_cache_dtype": "auto"}})
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        load_deploy_config(model="tiny-llama", kv_cache_dtype="int8")


# ---- a ModelOpt FP8 checkpoint with calibrated KV-cache scales ---------------------------------
def _scale_names(layer: int) -> Dict[str, str]:
    attn = f"model.layers.{layer}.self_attn"
    return {"k": f"{attn}.k_proj.k_scale", "v": f"{attn}.v_proj.v_scale"}


@pytest.fixture(scope="module")
def modelopt_kv(tmp_path_factory) -> str:
    """``quantized_checkpoint("llama", "fp8")`` plus ModelOpt's KV-cache scales (one float32 scalar
    per layer for K and V, under the names ModelOpt exports) and ``kv_cache_quant_algo: FP8``."""
    directory = str(tmp_path_factory.mktemp("modelopt-kv") / "ckpt")
    shutil.copytree(quantized_checkpoint("llama", "fp8"), directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    for layer, (k, v) in SCALES.items():
        names = _scale_names(layer)
        tensors[names["k"]] = torch.tensor(k, dtype=torch.float32)
        tensors[names["v"]] = torch.tensor(v, dtype=torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    quant_path = os.path.join(directory, "hf_quant_config.json")
    with open(quant_path) as f:
        quant = json.load(f)
    quant["quantization"]["kv_cache_quant_algo"] = "FP8"
    with open(quant_path, "w") as f:
        json.dump(quant, f, indent=2)
    return directory


def _build(directory: str, **settings):
    config = load_deploy_config(model=directory, max_seq_len=64, max_batch_size=2, max_num_tokens=32, **settings)
    with _logs() as records:
        result = build_graph(config, log_summary=False)
    return result, records


@pytest.mark.parametrize("route", ["autodeploy", "sdpa"])  # sdpa: the attention made by match_sdpa_attention
def test_modelopt_kv_scales_reach_each_layer(modelopt_kv, route):
    """Each layer's scales are found by the attention node's module path (its nn_module_stack),
    on either export route."""
    result, records = _build(modelopt_kv, kv_cache_dtype="fp8",
                             transforms={"export_to_gm": {"attn_implementation": route}})
    assert result.context.cache_mode == "paged_kv"
    nodes = _cached_nodes(result.graph_module)
    assert sorted(_layer(n) for n in nodes) == list(range(NUM_LAYERS))
    for node in nodes:
        k, v = SCALES[_layer(node)]
        expected = (float(torch.tensor(k, dtype=torch.float32)), float(torch.tensor(v, dtype=torch.float32)))
        assert node.args[-2:] == expected
    assert "calibrated KV-cache scales for 2 layers" in _text(records)
    assert "not applied" not in _text(records, logging.WARNING)


def test_unused_modelopt_kv_scales_warn_how_to_use_them(modelopt_kv):
    result, records = _build(modelopt_kv, transforms={"recompute_fallback": {"check_consistency": False}})
    assert all(len(n.args) == 15 for n in _cached_nodes(result.graph_module))
    warning = _text(records, logging.WARNING)
    assert "kv_cache_quant_algo FP8, 4 k_scale/v_scale tensors) is not applied" in warning
    assert "set kv_cache_dtype: fp8" in warning


def _attention_node(graph: fx.Graph, path: str) -> fx.Node:
    node = graph.placeholder(f"attn_{len(graph.nodes)}")
    node.meta["nn_module_stack"] = {"L__self__model.layers.0": ("model.layers.0", "LlamaDecoderLayer"),
                                    f"L__self__{path}": (path, "LlamaAttention")} if path else {}
    return node


def test_a_layer_without_scales_is_an_error_naming_it(modelopt_kv):
    info = QuantizationInfo("modelopt", "FP8", config={"kv_cache_quant_algo": "FP8"})
    factory = SimpleNamespace(quantization=info, base_model_prefix="model",
                              checkpoint_index=lambda: find_checkpoint(modelopt_kv))
    ctx = SimpleNamespace(factory=factory)
    graph = fx.Graph()
    found = kv_cache_scales(ctx, [_attention_node(graph, "model.layers.1.self_attn")])  # type: ignore[arg-type]
    assert found == [(float(torch.tensor(SCALES[1][0])), float(torch.tensor(SCALES[1][1])))]
    with pytest.raises(ModelSourceError, match="no k_scale for the attention in 'model.layers.7.self_attn'"):
        kv_cache_scales(ctx, [_attention_node(graph, "model.layers.7.self_attn")])  # type: ignore[arg-type]
    with pytest.raises(ModelSourceError, match="no nn_module_stack"):
        kv_cache_scales(ctx, [_attention_node(graph, "")])  # type: ignore[arg-type]
