"""The "transformers" mode: the HF module runs eagerly, its attention served by the paged KV cache.

Export is the fast path, but some models do not export (value-dependent control flow, Python
loops over the sequence) and some users want the HF module itself. In this mode nothing is
exported: the factory's HF model runs as transformers wrote it, and only its attention changes.
transformers 5 routes the attention of most models through ``AttentionInterface``; registering
``autodeploy_cached`` there hands us each layer's ``query`` / ``key`` / ``value`` after their
projections and RoPE, and we answer with our cached attention op over the paged KV cache. The
model is called on the step's flattened row (``input_ids [1, T]`` holding every scheduled
sequence's new tokens, ``position_ids`` their positions); the step's metadata and this layer's
caches reach the attention function through a step context set around the call.

What this mode cannot see it refuses rather than guesses: a layer whose mask is not plain
causal (or causal with a sliding window, or chunked-local), a tensor argument the cached op does not express (an
additive position bias), a non-causal layer, state outside attention (``detect_hf_attn_layers``
records the first three; the cache consistency check catches the last). Those models run in
recompute mode instead: the HF module with its own attention over each sequence's whole history.
"""

import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import fx, nn

from ..cache.sequence_info import METADATA_NAMES
from ..utils.logging import get_logger

logger = get_logger(__name__)

CACHED_ATTN_IMPL = "autodeploy_cached"


# ---- what one attention layer looks like (detect_hf_attn_layers) --------------------------------
@dataclass
class HFAttentionLayer:
    """One attention module the HF model calls through the attention interface, in call order."""

    name: str  # the module's qualified name in the HF model
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sliding_window: Optional[int] = None
    problems: List[str] = field(default_factory=list)  # why the cached op cannot serve this layer
    attention_chunk: Optional[int] = None  # chunked-local attention (Llama 4)


@dataclass
class _StepContext:
    """What the attention function needs during one call of the HF model."""

    layer_of: Dict[int, int]  # id(module) -> layer index (its caches)
    metadata: Dict[str, torch.Tensor] = field(default_factory=dict)
    slots: Optional[torch.Tensor] = None  # each new token's cache slot (prepare_metadata)
    caches: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer (k, v)
    cached_op: Optional[Callable] = None
    probe: Optional[List[Tuple[nn.Module, HFAttentionLayer]]] = None  # detect mode: record, attend plainly


_STATE = threading.local()
# Masks our builder emitted during the current call: id(marker) -> (marker, sliding window, attention
# chunk, why the cached op cannot honour it)
_MASKS: Dict[int, Tuple[torch.Tensor, Optional[int], Optional[int], Optional[str]]] = {}


def _context() -> Optional[_StepContext]:
    return getattr(_STATE, "context", None)


@contextmanager
def _step(ctx: _StepContext) -> Iterator[None]:
    previous = _context()
    _STATE.context = ctx
    try:
        yield
    finally:
        _STATE.context = previous
        _MASKS.clear()


# ---- the mask builder: no O(T^2) mask, only what it means ----------------------------------------
def _mask_builder(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                  mask_function: Optional[Callable] = None, attention_mask: Optional[torch.Tensor] = None,
                  dtype: torch.dtype = torch.float32, device: Any = "cpu", **kwargs: Any) -> torch.Tensor:
    """HF asks for the mask of a layer type; we return an empty marker tensor that stands for its
    meaning (causal, its window) or for why the cached op cannot honour it. The cached op knows
    each sequence's extent from the step metadata, so a dense mask over the row would be wrong
    anyway (it would let sequences see each other)."""
    from ..export.hf_attention import chunk_of_mask_function, classify_mask_function

    understood, window = classify_mask_function(mask_function) if mask_function is not None else (False, None)
    chunk = chunk_of_mask_function(mask_function) if mask_function is not None and not understood else None
    problem = None
    if not understood and chunk is None:
        problem = (f"mask {getattr(mask_function, '__qualname__', mask_function)} is not causal, sliding-window or "
                   "chunked-local")
    elif attention_mask is not None and not bool(attention_mask.all()):
        problem = "a padding mask"
    marker = torch.empty(0, device=device)
    _MASKS[id(marker)] = (marker, window, chunk, problem)
    return marker


# Tensor kwargs HF passes that the cached op has no use for (positions are applied already; the
# step metadata says where each sequence is), plus sinks, which it honours.
_IGNORED_TENSOR_KWARGS = frozenset({"position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k", "sinks"})


def _problems(module: nn.Module, attention_mask: Optional[torch.Tensor], kwargs: Dict[str, Any]) -> Tuple[
        List[str], Optional[int], Optional[int]]:
    """Why the cached op cannot compute this call exactly, and the window and chunk its mask implies."""
    problems: List[str] = []
    window = chunk = None
    if attention_mask is not None:
        emitted = _MASKS.get(id(attention_mask))
        if emitted is None:
            problems.append("the model builds its own attention mask")
        else:
            window, chunk = emitted[1], emitted[2]
            if emitted[3]:
                problems.append(emitted[3])
    if not bool(getattr(module, "is_causal", True)):
        problems.append("the layer is not causal")
    unknown = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _IGNORED_TENSOR_KWARGS)
    if unknown:
        problems.append(f"it passes {', '.join(unknown)}, which the cached attention does not take")
    return problems, window, chunk


def cached_hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                        scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                        softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                        **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """The ``autodeploy_cached`` attention-interface function: q/k/v arrive ``[1, heads, T, d]``
    (keys and values not repeated for GQA), the output leaves ``[1, T, heads, d_v]``."""
    ctx = _context()
    if ctx is None:
        raise RuntimeError(f"{type(module).__name__} called the '{CACHED_ATTN_IMPL}' attention outside an autodeploy "
                           "step; run the model through autodeploy (LLM / the engine)")
    problems, mask_window, chunk = _problems(module, attention_mask, kwargs)
    window = sliding_window if sliding_window is not None else mask_window
    sinks = kwargs.get("sinks", s_aux)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    extra = {"attention_chunk": chunk} if chunk is not None else {}
    if ctx.probe is not None:
        layer = HFAttentionLayer("", int(k.shape[2]), int(k.shape[3]), int(v.shape[3]), window, problems, chunk)
        ctx.probe.append((module, layer))
        out = torch.ops.autodeploy.torch_attention(q, k, v, None, 0.0, True, scaling, sinks, window, softcap, **extra)
        return out, None
    if problems:  # detect_hf_attn_layers saw none of these at build time, so the model changed course
        raise RuntimeError(f"attention {type(module).__name__} cannot be served from the KV cache: {'; '.join(problems)}")
    index = ctx.layer_of.get(id(module))
    if index is None:
        raise RuntimeError(f"attention module {type(module).__name__} was not seen by detect_hf_attn_layers")
    k_cache, v_cache = ctx.caches[index]
    m = ctx.metadata
    out = ctx.cached_op(q.contiguous(), k.contiguous(), v.contiguous(), m["batch_info"], m["seq_len"], m["input_pos"],
                        m["cu_seqlen"], m["page_table"], ctx.slots, k_cache, v_cache, scaling, sinks, window, softcap,
                        **extra)
    return out, None


def register_cached_attention() -> None:
    """Make ``autodeploy_cached`` an attention implementation (and its mask builder) in transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CACHED_ATTN_IMPL, cached_hf_attention)
    AttentionMaskInterface.register(CACHED_ATTN_IMPL, _mask_builder)


@contextmanager
def attn_implementation(model: nn.Module, impl: str) -> Iterator[None]:
    """Every config of ``model`` set to the attention implementation ``impl`` for the block."""
    from ..export.hf_attention import _attn_configs

    configs = _attn_configs(model)
    saved = [(cfg, getattr(cfg, "_attn_implementation", None)) for cfg in configs]
    try:
        for cfg in configs:
            cfg._attn_implementation = impl
        yield
    finally:
        for cfg, previous in saved:
            cfg._attn_implementation = previous


def _forward_kwargs(model: nn.Module) -> frozenset:
    try:
        return frozenset(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0] if isinstance(output, tuple) else output


# ---- detection: one probe forward ----------------------------------------------------------------
def detect_attention_layers(model: nn.Module, device: torch.device, vocab_size: int) -> List[HFAttentionLayer]:
    """Run the model once on a short prompt with the cached implementation in probe mode: every
    attention-interface call is recorded (its module, k/v geometry, window, and what the cached op
    could not honour), in call order, which is the layer order."""
    register_cached_attention()
    names = {id(m): n for n, m in model.named_modules()}
    ctx = _StepContext(layer_of={}, probe=[])
    ids = torch.arange(5, device=device)[None] % max(1, vocab_size)
    accepted = _forward_kwargs(model)
    kwargs: Dict[str, Any] = {"position_ids": torch.arange(5, device=device)[None]} if "position_ids" in accepted else {}
    with torch.inference_mode(), attn_implementation(model, CACHED_ATTN_IMPL), _step(ctx):
        model(input_ids=ids, use_cache=False, **kwargs)
    layers, seen = [], set()
    for module, layer in ctx.probe or []:
        if id(module) in seen:
            layers[-1].problems.append("a module is called twice in one forward")
            continue
        seen.add(id(module))
        layer.name = names.get(id(module), type(module).__name__)
        layers.append(layer)
    return layers


# ---- the modules the runtime calls ----------------------------------------------------------------
class CachedHFRunner(nn.Module):
    """Calls the HF model on one step: ``(input_ids, position_ids, <metadata>, k_0, v_0, k_1, ...)``
    -> the logits of the rows ``logits_index`` names, ``[1, R, V]``."""

    def __init__(self, model: nn.Module, layers: List[HFAttentionLayer], cached_op: Callable,
                 prepare_metadata: Callable, page_size: int):
        super().__init__()
        self.model = model
        self.layer_names = [layer.name for layer in layers]
        self.cached_op = cached_op
        self.prepare_metadata = prepare_metadata
        self.page_size = page_size
        modules = dict(model.named_modules())
        self._layer_of = {id(modules[name]): i for i, name in enumerate(self.layer_names)}
        accepted = _forward_kwargs(model)
        self.takes_positions = "position_ids" in accepted
        self.takes_logits_to_keep = "logits_to_keep" in accepted

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        n = len(METADATA_NAMES)
        metadata = dict(zip(METADATA_NAMES, rest[:n]))
        caches = rest[n:]
        ctx = _StepContext(
            layer_of=self._layer_of, metadata=metadata, cached_op=self.cached_op,
            caches=[(caches[2 * i], caches[2 * i + 1]) for i in range(len(self.layer_names))],
            slots=self.prepare_metadata(position_ids, metadata["seq_len"], metadata["cu_seqlen"],
                                        metadata["page_table"], self.page_size),
        )
        rows = metadata["logits_index"].long()
        kwargs: Dict[str, Any] = {"use_cache": False}
        if self.takes_positions:
            kwargs["position_ids"] = position_ids
        if self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = rows
        with attn_implementation(self.model, CACHED_ATTN_IMPL), _step(ctx):
            logits = _logits(self.model(input_ids=input_ids, **kwargs))
        return logits if self.takes_logits_to_keep else logits.index_select(1, rows)


class UncachedHFModel(nn.Module):
    """``(input_ids [b, s], position_ids [b, s]) -> logits [b, s, V]`` with the model's own
    attention: what recompute mode runs over each sequence's history."""

    def __init__(self, model: nn.Module, impl: Optional[str]):
        super().__init__()
        self.model = model
        self.impl = impl or "sdpa"
        self.takes_positions = "position_ids" in _forward_kwargs(model)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        kwargs = {"position_ids": position_ids} if self.takes_positions else {}
        with attn_implementation(self.model, self.impl):
            return _logits(self.model(input_ids=input_ids, use_cache=False, **kwargs))


def runner_graph(runner: nn.Module, input_names: List[str], meta: Optional[Dict[str, Any]] = None) -> fx.GraphModule:
    """A GraphModule with the cached interface's inputs whose one node calls ``runner``, so the
    cache transforms and the runtime treat the HF model like any cached graph."""
    root = nn.Module()
    root.hf_runner = runner
    graph = fx.Graph()
    args = [graph.placeholder(name) for name in input_names]
    graph.output(graph.call_module("hf_runner", tuple(args)))
    gm = fx.GraphModule(root, graph)
    gm.meta.update(meta or {})
    return gm
