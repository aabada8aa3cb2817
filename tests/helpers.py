"""Test helpers: real checkpoints from transformers configs, graph building, comparisons."""

import copy
import os
import shutil
import random
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

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

# MoE families (issue 7): 4 experts, top-2. Kept apart from FAMILIES, whose tests assume dense
# MLPs and GQA. DeepSeek-V3 uses MLA (k/v heads = query heads after the up-projection, so
# num_key_value_heads is 4), one dense layer first (first_k_dense_replace), grouped top-k over 2
# groups of 2 with a correction bias, and a shared expert; Qwen2-MoE has a sigmoid-gated shared
# expert; GPT-OSS has biased, interleaved experts with the clamped SwiGLU, attention sinks and
# alternating sliding-window layers.
MOE_FAMILIES: Dict[str, Dict[str, Any]] = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **TINY),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128, **TINY),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True, **TINY),
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, **TINY),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        **{**TINY, "num_key_value_heads": 4, "head_dim": 8}),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    **{**TINY, "intermediate_size": 64}),
}
# MoE layers per model (DeepSeek's first layer is dense)
MOE_LAYERS = {family: 1 if family == "deepseek_v3" else 2 for family in MOE_FAMILIES}


def _cached_checkpoint(name: str, config: Dict[str, Any]) -> str:
    """A real checkpoint directory for ``config`` under ``CKPT_CACHE/name``, written once (atomically,
    so parallel test processes never see half a checkpoint)."""
    path = os.path.join(CKPT_CACHE, name)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        os.makedirs(CKPT_CACHE, exist_ok=True)
        tmp = path + f".tmp{os.getpid()}"
        write_random_checkpoint(config, tmp, seed=1)
        try:
            os.replace(tmp, path)
        except OSError:  # another process wrote the same checkpoint first (same config, same seed)
            if not os.path.exists(os.path.join(path, "model.safetensors")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def moe_family_checkpoint(family: str, **overrides: Any) -> str:
    """Like ``family_checkpoint`` for ``MOE_FAMILIES`` (experts saved per expert, as transformers saves them);
    ``overrides`` change config entries (e.g. the expert count) and name their own directory."""
    suffix = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    return _cached_checkpoint(f"moe-{family}{suffix}", {**MOE_FAMILIES[family], **overrides})


# Models with state outside attention (issue 7): LFM2's short-convolution layers next to an
# attention layer. The KV cache cannot hold the convolution state, so these run in recompute mode.
STATEFUL_FAMILIES: Dict[str, Dict[str, Any]] = {
    "lfm2": dict(model_type="lfm2", layer_types=["conv", "full_attention"], conv_L_cache=3,
                 **{k: v for k, v in TINY.items() if k != "head_dim"}),
}


def stateful_checkpoint(family: str) -> str:
    """Like ``family_checkpoint`` for ``STATEFUL_FAMILIES``."""
    return _cached_checkpoint(f"stateful-{family}", STATEFUL_FAMILIES[family])


def coverage_checkpoint(model_type: str) -> Tuple[str, int]:
    """(checkpoint, vocab size) of the coverage sweep's tiny config (recipe a) for ``model_type``:
    the state-space and hybrid families, whose configs have too many fields to write by hand."""
    from autodeploy.coverage.configs import tiny_config

    config = tiny_config(model_type, "a")
    text = config.get("text_config", config)
    return _cached_checkpoint(f"coverage-{model_type}", config), int(text["vocab_size"])


def family_checkpoint(family: str) -> str:
    """A real checkpoint directory (safetensors + tokenizer) for a tiny config, cached on disk."""
    return _cached_checkpoint(family, FAMILIES[family])


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


def prefill_then_decode(res: BuildResult, seqs: Sequence[Sequence[int]], lengths: Sequence[int],
                        decodes: int = 3) -> torch.Tensor:
    """Run a cached build on a fresh pool (pages from a shuffled free list): one step prefilling
    every sequence's first ``lengths`` tokens, then ``decodes`` steps decoding the next token of
    each; the logits rows of all steps, concatenated."""
    from autodeploy.cache import build_sequence_info

    cache = res.cache
    cache.allocate(cache.num_pages)
    free = list(range(cache.num_pages))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-len(s) // cache.page_size))] for s in seqs]
    steps = [([list(s[:n]) for s, n in zip(seqs, lengths)], [0] * len(seqs))]
    steps += [([[s[n + e]] for s, n in zip(seqs, lengths)], [n + e for n in lengths]) for e in range(decodes)]
    rows = []
    for tokens, starts in steps:
        with torch.no_grad():
            rows.append(res.graph(*cache.graph_args(build_sequence_info(tokens, starts, tables)))[0])
    return torch.cat(rows)


def moe_config(family: str, **overrides: Any) -> Any:
    """The transformers config of a MoE family; experts run HF's eager reference loop."""
    from transformers import AutoConfig

    raw = {**MOE_FAMILIES[family], **overrides}
    cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    cfg._experts_implementation = "eager"
    return cfg


def moe_block(family: str, **overrides: Any) -> torch.nn.Module:
    """The family's sparse MoE block with random weights (and a random DeepSeek correction bias)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    blocks = {"mixtral": MixtralSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock,
              "qwen3_moe": Qwen3MoeSparseMoeBlock, "olmoe": OlmoeSparseMoeBlock, "deepseek_v3": DeepseekV3MoE,
              "gpt_oss": GptOssMLP}
    torch.manual_seed(0)
    module = blocks[family](moe_config(family, **overrides)).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
        for name, b in module.named_buffers():
            if "e_score_correction_bias" in name:
                b.uniform_(-0.3, 0.3)
    return module


def export_moe_block(module: torch.nn.Module, route: str, hidden: int = TINY["hidden_size"]) -> fx.GraphModule:
    """Export a MoE block through the HF experts route ``route`` (``autodeploy`` or ``batched_mm``)."""
    from autodeploy.export.hf_moe import hf_experts_route

    with hf_experts_route(module, route):
        return export_gm(module, torch.randn(2, 5, hidden))


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


_HF_MODELS: Dict[str, torch.nn.Module] = {}


def hf_model(checkpoint: str) -> torch.nn.Module:
    """transformers' own model for a checkpoint directory (float32, eval), loaded once per process."""
    if checkpoint not in _HF_MODELS:
        from transformers import AutoModelForCausalLM

        _HF_MODELS[checkpoint] = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return _HF_MODELS[checkpoint]


def hf_greedy_tokens(checkpoint: str, prompts: Sequence[Sequence[int]], new_tokens: int) -> List[List[int]]:
    """HF eager's greedy continuation of each prompt (one at a time, EOS ignored: the tests' side
    passes ``ignore_eos``; ``min_new_tokens`` would instead forbid EOS, another answer where EOS is
    the argmax)."""
    model = hf_model(checkpoint)
    out = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def assert_matches_hf(graph: Callable, reference: Union[str, torch.nn.Module],
                      shapes: Sequence[Tuple[int, int]] = ((1, 5), (3, 2)), tol: float = 1e-5) -> None:
    """A pipeline graph ``(input_ids, position_ids) -> logits`` equals the HF model ``reference``
    (a module, or a checkpoint whose unmodified HF model is loaded) at each ``(batch, seq)``."""
    hf = hf_model(reference) if isinstance(reference, str) else reference
    vocab = hf.config.vocab_size
    for b, s in shapes:
        ids = torch.randint(0, vocab, (b, s))
        pos = torch.arange(s).expand(b, s)
        with torch.no_grad():
            ref = hf(input_ids=ids, position_ids=pos).logits
            out = graph(ids, pos)
        assert out.shape == ref.shape, (out.shape, ref.shape)
        assert rel_rmse(out, ref) < tol, f"rel rmse {rel_rmse(out, ref)} against HF at (batch, seq) = {(b, s)}"


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


class Nested(torch.nn.Module):
    """``block`` one level down, where a decoder's layers sit (``layers.0``)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.layers = torch.nn.ModuleList([block])

    # named inputs, not *args: torch.export takes *args as one tuple input
    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> Any:
        return self.layers[0](x) if y is None else self.layers[0](x, y)


def attention_sources(gm: fx.GraphModule) -> List[Tuple[str, str]]:
    """(module path, class name) of each ``torch_attention`` node, from its ``nn_module_stack``
    (innermost module; ``("", "")`` where the node has none)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == torch.ops.autodeploy.torch_attention.default:
            stack = list((n.meta.get("nn_module_stack") or {}).values())
            path, cls = stack[-1] if stack else ("", "")
            out.append((path, cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]))
    return out


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


__all__ = ["coverage_checkpoint", "FAMILIES", "NORMS_PER_LAYER", "MOE_FAMILIES", "MOE_LAYERS", "moe_family_checkpoint", "moe_config",
           "moe_block", "export_moe_block", "family_checkpoint", "build", "rel_rmse", "export_gm", "apply_transform",
           "ops_of", "assert_same_outputs", "count_op", "hf_model", "assert_matches_hf"]


def graph_logits(gm: Any, ids: "torch.Tensor") -> "torch.Tensor":
    """Logits of an uncached graph (or module) called as ``gm(input_ids, position_ids)``."""
    import torch

    pos = torch.arange(ids.shape[1]).expand(*ids.shape)
    with torch.no_grad():
        out = gm(input_ids=ids, position_ids=pos)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return getattr(out, "logits", out)
