"""Test helpers: real checkpoints from transformers configs, graph building, comparisons."""

import copy
import os
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch import fx
from torch.export import Dim

import autodeploy.transform.library  # noqa: F401
from autodeploy.config import load_deploy_config
from autodeploy.export.exporter import export_to_graph_module
from autodeploy.models.presets import write_random_checkpoint
from autodeploy.pipeline import BuildResult, build_graph
from autodeploy.transform.cleanups import cleanup_for_matching
from autodeploy.transform.graph_utils import count_op
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.optimizer import build_transform

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT_CACHE = os.path.join(REPO, ".cache", "test-checkpoints")

# Tiny configs of the families the graph pipeline must canonicalise (issue acceptance list).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
            tie_word_embeddings=False)
FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": dict(model_type="llama", **TINY),
    "mistral": dict(model_type="mistral", sliding_window=8, **TINY),
    "qwen2": dict(model_type="qwen2", **TINY),
    "qwen3": dict(model_type="qwen3", **TINY),
    "gemma": dict(model_type="gemma", **{**TINY, "tie_word_embeddings": True}),
    "phi3": dict(model_type="phi3", pad_token_id=0, **TINY),
}
# RMSNorms per layer (+1 final): Qwen3 adds q_norm and k_norm.
NORMS_PER_LAYER = {"qwen3": 4}


def family_checkpoint(family: str) -> str:
    """A real checkpoint directory (safetensors + tokenizer) for a tiny config, cached on disk."""
    path = os.path.join(CKPT_CACHE, family)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        os.makedirs(CKPT_CACHE, exist_ok=True)
        tmp = path + f".tmp{os.getpid()}"
        write_random_checkpoint(FAMILIES[family], tmp, seed=1)
        os.replace(tmp, path)
    return path


def build(model: str, *, up_to: Optional[Stage] = None, route: str = "autodeploy",
          overrides: Optional[Dict[str, Any]] = None, **settings: Any) -> BuildResult:
    """Build with the default pipeline, optionally stopping after ``up_to`` (later stages off)."""
    cfg = load_deploy_config(model=model, **settings)
    transforms = copy.deepcopy(cfg.transforms)
    transforms["export_to_gm"] = {**(transforms.get("export_to_gm") or {}), "attn_implementation": route}
    if up_to is not None:
        for key, raw in transforms.items():
            stage = build_transform(key, raw).config.stage
            if stage.order > up_to.order:
                transforms[key] = {**(raw or {}), "enabled": False}
    for key, raw in (overrides or {}).items():
        transforms[key] = {**(transforms.get(key) or {}), **raw}
    cfg = cfg.model_copy(update={"transforms": transforms})
    return build_graph(cfg, log_summary=False)


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def export_gm(
    module: torch.nn.Module, *args: torch.Tensor, dynamic: Sequence[Dict[int, Any]] | None = None, clean: bool = True
) -> fx.GraphModule:
    """Export a small module with the given dims dynamic (default: every dim but the last).

    ``clean=True`` applies the post-export cleanups, i.e. the graph is what a pattern_matcher
    transform sees in the pipeline; cleanup-transform tests pass ``clean=False``.
    """
    if dynamic is None:
        dynamic = [{i: Dim.DYNAMIC for i in range(a.dim() - 1)} for a in args]
    gm = export_to_graph_module(module.eval(), tuple(args), dynamic_shapes=tuple(dynamic))
    if clean:
        cleanup_for_matching(gm)
    return gm


def apply_transform(key: str, gm: fx.GraphModule, **config: Any) -> Tuple[fx.GraphModule, Any]:
    """Run one transform (through the base class, so cleanup/shape-prop happen as in a pipeline)."""
    ctx = PipelineContext()
    transform = build_transform(key, config)
    out = transform(gm, ctx)
    return out, ctx.history[-1]


def ops_of(gm: fx.GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def assert_same_outputs(ref: Callable, new: Callable, inputs: Iterable[Tuple[torch.Tensor, ...]], tol: float = 1e-5) -> None:
    for args in inputs:
        with torch.no_grad():
            a, b = ref(*args), new(*args)
        a = a if isinstance(a, (tuple, list)) else (a,)
        b = b if isinstance(b, (tuple, list)) else (b,)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.shape == y.shape, (x.shape, y.shape)
            assert rel_rmse(y, x) < tol, f"rel rmse {rel_rmse(y, x)} at input shapes {[t.shape for t in args]}"


__all__ = ["FAMILIES", "NORMS_PER_LAYER", "family_checkpoint", "build", "rel_rmse", "export_gm", "apply_transform",
           "ops_of", "assert_same_outputs", "count_op"]
