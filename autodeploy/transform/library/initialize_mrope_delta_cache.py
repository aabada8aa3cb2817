"""``initialize_mrope_delta_cache`` (cache_init): a per-sequence position delta for multimodal RoPE.

Multimodal RoPE (mRoPE: the text stacks of Qwen3.5 / Qwen3.5-MoE, Cohere Compass, Qwen4-Exp in
transformers' causal-LM mapping; Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Ernie-4.5-VL in their
multimodal models) rotates with three position rows (temporal, height, width sections of the
rotary dims). The text model takes ``position_ids [b, s]`` and expands them to three equal rows
itself (``position_ids.expand(3, -1, -1)`` in the rotary embedding; Qwen3.5 and Cohere Compass
first expand to four rows and keep row 0, the text positions, for the mask), so on text every
section sees the same position and mRoPE equals plain RoPE. After a prompt with images, HF's
``get_rope_index`` gives the prompt 3-D grid positions and a per-sequence ``rope_delta``
(``max position + 1 - prompt length``, how much the image tokens compressed the position
range); every later token of that sequence rotates at ``cache position + rope_delta`` in all
three rows, while the attention mask and the KV cache keep the plain positions.

This transform gives the cached graph that delta as a per-slot state cache ``mrope_delta``
(``StateHandler((1,), int32)``, ``[num_slots, 1]``) and adds it to the positions on the rotary
path only: the readers of ``position_ids`` whose results feed nothing but the cos/sin (or
freqs) inputs of the canonical RoPE ops read ``position_ids + delta`` instead; its other
readers (the cached attention's cache-slot computation) keep the plain positions. A reader
feeding both (a shared subexpression) cannot be shifted alone: the graph is then left alone.

Before (after ``optimize_rope`` and the other cache transforms)::

    graph(input_ids, position_ids, batch_info, seq_len, ..., slot_idx, use_initial_state, <caches>)
    cos = aten.embedding(rope_cos_table_0, position_ids); sin = aten.embedding(rope_sin_table_0, position_ids)
    q2, k2 = autodeploy.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)

After::

    graph(input_ids, position_ids, batch_info, seq_len, ..., slot_idx, use_initial_state, <caches>, mrope_delta)
    stored = aten.index(mrope_delta, [slot_idx])                          # [B, 1] int32
    delta = aten.where(use_initial_state[:, None], stored, 0)             # a sequence's first chunk reads 0 ...
    aten.index_put_(mrope_delta, [slot_idx], delta)                       # ... and clears its slot
    per_token = aten.repeat_interleave(delta[:, 0], seq_len, 0, output_size=position_ids.size(1))
    rope_positions = aten.add(position_ids, per_token)                    # [1, T] int64
    cos = aten.embedding(rope_cos_table_0, rope_positions); sin = aten.embedding(rope_sin_table_0, rope_positions)
    q2, k2 = autodeploy.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)

Without ``optimize_rope`` the shifted reader is the head of the model's own rotary subgraph
(``unsqueeze(position_ids, 0)``, expanded to four rows, rows 1-3 times ``inv_freq``, cos/sin,
the sections interleaved by in-place copies between the rows); the shift is the same in every
row, so the rows stay equal and that interleave stays exact.

What it does for text: nothing changes. autodeploy takes text only, so nothing writes a
non-zero delta: the slots are allocated zero, and the graph itself writes 0 into a sequence's
slot at its first prefill chunk (``use_initial_state`` false: a new, reused or preempted
sequence), so no sequence ever reads a delta another sequence left in its slot. Every position
is then ``position_ids + 0`` and text-only outputs are exactly those of the graph without the
transform. A future multimodal runtime builds the prompt's 3-D positions itself and writes the
sequence's delta into its slot after that first chunk; later chunks and decodes then rotate at
the shifted positions. A model running in recompute mode uses the uncached graph (no delta).

Detection (from the model, via ``ctx.factory``): the text rotary embedding class of the model's
modeling module, built from the text config, has ``mrope_section`` (Qwen3.5 defaults it to
``[11, 11, 10]`` even when the config names none); for models whose classes cannot be read that
way, the text config's rope parameters naming ``mrope_section``. Plain-RoPE models, graphs
without a canonical RoPE op or whose RoPE tables do not come from ``position_ids``, and graphs
left for recompute mode (static-length export, uncacheable attention) are left alone.
"""

import sys
from typing import Any, List, Optional, Set, Tuple

import torch
from torch import fx, nn

from ...cache.resources import StateHandler
from ...utils.logging import get_logger
from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._cache_inputs import add_cache_input, step_inputs
from .recompute_fallback import export_shape_problem

logger = get_logger(__name__)
aten = torch.ops.aten

CACHE_NAME = "mrope_delta"
SHAPE_OPS = (aten.sym_size, aten.sym_numel, aten.sym_stride, aten.sym_storage_offset)


def _rope_ops() -> tuple:
    ops = torch.ops.autodeploy
    return (ops.torch_rope_with_explicit_cos_sin, ops.torch_rope_with_qk_interleaving,
            ops.torch_rope_with_complex_freqs)


def _table_args(node: fx.Node) -> List[int]:
    """Argument indices of a RoPE op's position-dependent tables (cos, sin / freqs_cis)."""
    return [2] if is_op(node, torch.ops.autodeploy.torch_rope_with_complex_freqs) else [2, 3]


# ---- detection ----------------------------------------------------------------------------------
def _names_sections(params: Any) -> bool:
    """A rope-parameters dict (possibly one per layer type) that names ``mrope_section``."""
    if not isinstance(params, dict):
        return False
    return params.get("mrope_section") is not None or any(_names_sections(v) for v in params.values())


def _model_class(factory: Any, config: Any) -> Optional[type]:
    from ...models.custom import custom_model_for

    cls = custom_model_for(config)
    if cls is None and getattr(factory, "trust_remote_code", False):
        try:
            cls = factory.remote_model_class()
        except Exception:  # noqa: BLE001 - detection only; the build already imported it
            cls = None
    if cls is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        except (KeyError, ValueError):
            return None
    return cls


def _rotary_has_sections(cls: type, text_config: Any) -> Optional[bool]:
    """Whether the text rotary embedding of ``cls``' modeling module is sectioned (None: no such
    class could be built from the config)."""
    module = sys.modules.get(cls.__module__)
    answers = []
    for name, obj in vars(module or object()).items():
        if not (isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == cls.__module__):
            continue
        if not name.endswith("RotaryEmbedding") or "Vision" in name:
            continue
        try:
            with torch.device("meta"):
                rotary = obj(text_config)
        except Exception:  # noqa: BLE001 - not a text rotary embedding taking the config
            continue
        answers.append(bool(getattr(rotary, "mrope_section", None)))
    return any(answers) if answers else None


def is_multimodal_rope(factory: Any) -> bool:
    """Whether the model ``factory`` builds rotates with multimodal (sectioned) RoPE."""
    if factory is None:
        return False
    config = factory.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cls = _model_class(factory, config)
    found = _rotary_has_sections(cls, text) if cls is not None else None
    if found is not None:
        return found
    return any(_names_sections(getattr(text, f, None)) for f in ("rope_parameters", "rope_scaling"))


# ---- graph --------------------------------------------------------------------------------------
def _reach(reader: fx.Node, tables: Set[fx.Node]) -> Tuple[bool, bool]:
    """Walk forward from ``reader``, stopping at the RoPE tables: (reaches a table, reaches the
    graph output some other way)."""
    seen: Set[fx.Node] = {reader}
    stack = [reader]
    to_table = to_output = False
    while stack:
        node = stack.pop()
        if node in tables:
            to_table = True
            continue
        if node.op == "output":
            to_output = True
            continue
        if is_op(node, SHAPE_OPS):
            continue  # reads a shape, not the positions
        for user in node.users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return to_table, to_output


def rotary_readers(position_ids: fx.Node, ropes: List[fx.Node]) -> Optional[List[fx.Node]]:
    """The readers of ``position_ids`` whose results only feed the RoPE ops' tables (cos/sin or
    freqs); None when a reader feeds both the tables and something else (it cannot be shifted
    without shifting the other)."""
    tables = {n.args[i] for n in ropes for i in _table_args(n) if isinstance(n.args[i], fx.Node)}
    readers = []
    for reader in position_ids.users:
        if is_op(reader, SHAPE_OPS):
            continue
        to_table, to_output = _reach(reader, tables)
        if to_table and to_output:
            return None
        if to_table:
            readers.append(reader)
    return readers


class InitializeMropeDeltaCacheConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT


@TransformRegistry.register("initialize_mrope_delta_cache")
class InitializeMropeDeltaCache(BaseTransform):
    config_class = InitializeMropeDeltaCacheConfig
    run_after = ("optimize_rope", "insert_cached_attention", "insert_cached_causal_conv", "insert_cached_ssm_attention",
                 "insert_cached_delta_rule", "insert_cached_gated_delta_rule",
                 "insert_cached_linear_attention", "insert_cached_diagonal_recurrence", "insert_cached_wkv",
                 "insert_cached_mlstm", "insert_cached_cca_conv")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        skip = TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason="no multimodal RoPE")
        graph = gm.graph
        position_ids = next((n for n in graph.nodes if n.op == "placeholder" and n.name == "position_ids"), None)
        ropes = [n for n in graph.nodes if is_op(n, _rope_ops())]
        if position_ids is None or not ropes or not is_multimodal_rope(ctx.factory):
            return skip
        if export_shape_problem(gm) is not None or ctx.uncached_reason:
            return skip  # recompute mode runs the uncached graph: no delta (it is always 0 today)
        readers = rotary_readers(position_ids, ropes)
        if not readers:
            why = "they do not depend on it" if readers is not None else "a reader also feeds other ops"
            logger.warning("initialize_mrope_delta_cache: cannot shift the positions of the RoPE tables (%s); "
                           "no delta", why)
            return skip
        meta = step_inputs(gm, ctx)
        delta_cache = add_cache_input(gm, ctx, CACHE_NAME, StateHandler((1,), torch.int32))
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            stored = graph.call_function(aten.index.Tensor, (delta_cache, [meta["slot_idx"]]))
            continues = graph.call_function(aten.unsqueeze.default, (meta["use_initial_state"], 1))
            delta = graph.call_function(aten.where.ScalarOther, (continues, stored, 0))
            graph.call_function(aten.index_put_.default, (delta_cache, [meta["slot_idx"]], delta))
            per_sequence = graph.call_function(aten.squeeze.dim, (delta, 1))
            tokens = graph.call_function(aten.sym_size.int, (position_ids, 1))
            per_token = graph.call_function(aten.repeat_interleave.self_Tensor, (per_sequence, meta["seq_len"], 0),
                                            {"output_size": tokens})
            shifted = graph.call_function(aten.add.Tensor, (position_ids, per_token))
        for reader in readers:
            reader.replace_input_with(position_ids, shifted)
        return TransformInfo(num_matches=1, is_clean=False, has_valid_shapes=False)
