"""build_model (factory): the model source becomes an nn.Module with parameters on meta."""

import os

import pytest
import torch
from safetensors import safe_open
from torch import fx, nn
from transformers import AutoModelForCausalLM

from autodeploy.models.factory import ModelFactory
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.optimizer import build_transform
from helpers import FAMILIES, build, family_checkpoint


def _checkpoint_names(ckpt: str) -> set:
    with safe_open(os.path.join(ckpt, "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_build_model_stage_gives_meta_module():
    ckpt = family_checkpoint("llama")
    result = build(ckpt, up_to=Stage.FACTORY)
    model = result.graph
    assert isinstance(model, nn.Module) and not isinstance(model, fx.GraphModule)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    params = list(model.parameters())
    assert len(params) == len(_checkpoint_names(ckpt))
    assert all(p.is_meta and p.dtype == torch.float32 for p in params)
    # nothing is allocated: the buffers' real values are kept by the factory, not in the module
    assert all(b.is_meta for b in model.buffers())
    inv = result.factory.initial_buffers["model.rotary_emb.inv_freq"]
    assert not inv.is_meta and inv.abs().sum() > 0
    assert model.config.use_cache is False

    statuses = {r.key: r.status for r in result.context.history}
    assert statuses["build_model"] == "ok"
    assert statuses["export_to_gm"] == "disabled" and statuses["load_weights"] == "disabled"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameter_names_are_checkpoint_names(family):
    ckpt = family_checkpoint(family)
    result = build(ckpt, up_to=Stage.FACTORY)
    names = {n for n, _ in result.graph.named_parameters(remove_duplicate=False)}
    tied = result.factory.tied_parameters
    assert names - set(tied) == _checkpoint_names(ckpt)
    assert set(tied) <= names
    assert all(p.is_meta for p in result.graph.parameters())
    assert (family == "gemma") == bool(tied)


def test_matches_hf_architecture():
    ckpt = family_checkpoint("qwen3")
    model = build(ckpt, up_to=Stage.FACTORY).graph
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    ours = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    ref = {n: (tuple(p.shape), p.dtype) for n, p in hf.named_parameters()}
    assert ours == ref


def test_dtype_and_model_kwargs_settings():
    ckpt = family_checkpoint("llama")
    result = build(ckpt, up_to=Stage.FACTORY, dtype="bfloat16", model_kwargs={"num_hidden_layers": 1})
    model = result.graph
    assert len(model.model.layers) == 1
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert result.factory.initial_buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
    assert result.context.dtype == torch.bfloat16


def test_build_model_needs_a_factory():
    transform = build_transform("build_model", {})
    with pytest.raises(RuntimeError, match="factory"):
        transform(None, PipelineContext())


def test_build_model_transform_directly():
    factory = ModelFactory(family_checkpoint("mistral"))
    ctx = PipelineContext(factory=factory)
    model = build_transform("build_model", {})(None, ctx)
    assert type(model).__name__ == "MistralForCausalLM"
    assert model.config.sliding_window == FAMILIES["mistral"]["sliding_window"]
    assert all(p.is_meta for p in model.parameters())
    assert ctx.history[-1].key == "build_model" and ctx.history[-1].num_matches == 1
    assert ctx.history[-1].mem_delta_mb == 0  # meta: no memory allocated by the model


class _LeanLlama(nn.Module):
    """A stand-in custom model: only what build_model needs (it is never exported here)."""

    def __init__(self, config):
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


@pytest.fixture
def lean_llama_registered():
    from autodeploy.models.custom import register_custom_model, unregister_custom_model

    register_custom_model("LlamaConfig")(_LeanLlama)
    try:
        yield _LeanLlama
    finally:
        unregister_custom_model("LlamaConfig")


def test_use_custom_model_false_builds_the_hf_class(lean_llama_registered):
    """A registered custom model is preferred (the factory records it); use_custom_model: false
    builds the HF class although the custom one stays registered."""
    from autodeploy.models.custom import custom_model_for

    ckpt = family_checkpoint("llama")
    on = build(ckpt, up_to=Stage.FACTORY)
    assert isinstance(on.graph, _LeanLlama) and on.factory.custom_model is _LeanLlama
    off = build(ckpt, up_to=Stage.FACTORY, overrides={"build_model": {"use_custom_model": False}})
    assert type(off.graph).__name__ == "LlamaForCausalLM" and off.factory.custom_model is None
    assert custom_model_for(off.factory.config) is _LeanLlama
