"""``export_to_gm`` (export): ``torch.export`` with dynamic batch and sequence dims.

Before: ``nn.Module`` (meta). After: ``GraphModule(input_ids [b, s], position_ids [b, s]) ->
logits``, aten ops plus canonical attention/mask ops emitted by the HF attention route.

A model whose sequence dim cannot be dynamic (a Python loop over it, chunk-size arithmetic that
torch.export guards) is exported again with a static length of ``max_seq_len`` tokens (when
``max_seq_len`` was left to the model, at most ``AUTO_STATIC_SEQ_LEN``, and ``max_seq_len`` is
lowered to it) (``gm.meta['autodeploy_export']['static_seq_len']``); such a graph only runs in recompute mode
(``recompute_fallback``), which pads each history on the right and checks the result against the
eager model once.
"""

from typing import Dict, Literal, Optional, Set, Tuple

from pydantic import Field, field_validator
from torch import nn

from ...export.exporter import export_causal_lm
from ...export.patch_registry import export_patches
from ...utils.fx import defer_recompile
from ...utils.logging import get_logger
from ..graph_utils import adopt_traced_values
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)


class ExportToGMConfig(TransformConfig):
    stage: Stage = Stage.EXPORT
    run_per_gm: bool = False
    requires_clean_graph: bool = False
    attn_implementation: Literal["autodeploy", "sdpa", "eager"] = Field(
        default="autodeploy",
        description="HF attention implementation used while tracing: 'autodeploy' emits torch_attention directly; "
        "'sdpa'/'eager' keep HF's functions for the pattern matchers to canonicalise.",
    )
    experts_implementation: Literal["autodeploy", "batched_mm"] = Field(
        default="autodeploy",
        description="HF MoE experts implementation used while tracing: 'autodeploy' emits torch_moe / "
        "torch_moe_fused directly; 'batched_mm' keeps HF's exportable code for match_moe_pattern.",
    )
    experts_layout: Literal["auto", "per_expert"] = Field(
        default="auto",
        description="Parameters of HF MoE experts whose checkpoint stores each expert separately: 'auto' keeps "
        "the module's stacked [E, ...] parameters, which the loader fills from the per-expert tensors (three "
        "parameters per MoE layer instead of 3 x E: export time does not grow with the expert count; expert "
        "parallelism splits the stacks by rows); quantized experts too (the quantize_*_moe_from_config "
        "transforms make one [E, ...] buffer per scale kind), unless the experts' checkpoint tensors differ "
        "from expert to expert or world_size does not divide the experts; 'per_expert' always exports one "
        "parameter per expert tensor, named as the checkpoint names it.",
    )
    static_seq_fallback: bool = Field(
        default=True,
        description="When the sequence dim cannot be exported dynamic (Python loops over it, chunk-size "
        "guards), export with a static length of max_seq_len instead; recompute_fallback then runs the model "
        "in recompute mode.",
    )
    stack_traces: bool = Field(
        default=False,
        description="Record each node's Python source lines in node.meta['stack_trace'] (shown in the "
        "graph's code), for debugging a graph; off by default: recording them costs about a fifth of the "
        "export time.",
    )
    patches: Dict[str, bool] = Field(
        default_factory=dict, description="Switch export patches on/off by name (all registered patches are on)."
    )

    @field_validator("patches")
    @classmethod
    def _known_patches(cls, value: Dict[str, bool]) -> Dict[str, bool]:
        known = sorted(p.name for p in export_patches())
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"unknown export patch(es) {unknown}; known: {known}")
        return value


@TransformRegistry.register("export_to_gm")
class ExportToGM(BaseTransform):
    config_class = ExportToGMConfig
    requires = ("build_model",)

    def _apply_to_full_model(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        if mod is None:
            raise RuntimeError("export_to_gm needs a model; enable build_model")
        cfg: ExportToGMConfig = self.config  # type: ignore[assignment]
        gm = export_causal_lm(
            mod,
            max_batch_size=ctx.max_batch_size,
            # the cached graph runs all tokens of a step in one row: up to max_num_tokens long
            max_seq_len=max(ctx.max_seq_len, ctx.max_num_tokens),
            attn_implementation=cfg.attn_implementation,
            patches=cfg.patches,
            experts_implementation=cfg.experts_implementation,
            checkpoint_keys=_checkpoint_keys(ctx),
            static_seq_len=_static_length(ctx, cfg),
            stack_experts=cfg.experts_layout == "auto",
            world_size=ctx.world_size,
            stack_traces=cfg.stack_traces,
        )
        defer_recompile(gm)  # every transform recompiles; the code is made when the graph runs
        static = (gm.meta.get("autodeploy_export") or {}).get("static_seq_len")
        if static is not None and static < ctx.max_seq_len:
            logger.warning(
                "max_seq_len lowered from the model's %d to %d tokens: the graph has a static length and every "
                "recompute step runs all of it (set max_seq_len to choose another length)", ctx.max_seq_len, static,
            )
            ctx.max_seq_len = static
        # export computed every node's value: the first shape propagation only redoes what changed
        adopt_traced_values(gm)
        # The export graph is functional but carries dead mask nodes and export checks.
        return gm, TransformInfo(num_matches=1, is_clean=False, has_valid_shapes=True)


# A static-length graph runs all of its length at every recompute step: with max_seq_len left to
# the model (often thousands of tokens) the length is capped here, where it was before max_seq_len
# followed the model.
AUTO_STATIC_SEQ_LEN = 512


def _static_length(ctx: PipelineContext, cfg: ExportToGMConfig) -> Optional[int]:
    if not cfg.static_seq_fallback:
        return None
    return min(ctx.max_seq_len, AUTO_STATIC_SEQ_LEN) if ctx.auto_seq_len else ctx.max_seq_len


def _checkpoint_keys(ctx: PipelineContext) -> Optional[Set[str]]:
    """The checkpoint's tensor names, when the factory knows a checkpoint (MoE experts export as the
    checkpoint stores them: per expert or stacked)."""
    factory = ctx.factory
    if factory is None or not hasattr(factory, "checkpoint_index"):
        return None
    try:
        return set(factory.checkpoint_index().weight_map)
    except Exception:  # noqa: BLE001 - no checkpoint yet: the conversion mapping decides
        return None
