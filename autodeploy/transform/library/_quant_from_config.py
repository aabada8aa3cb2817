"""Shared by the ``quantize_*_linear_from_config`` transforms: a checkpoint's quantized linears
become canonical quantized ops before the weights load.

Which linears are quantized is read from the checkpoint itself, not from the format's exclusion
list: a linear is quantized when the checkpoint holds the format's *marker* tensor next to its
weight (``weight_scale`` for ModelOpt FP8, ``weight_scale_inv`` for fine-grained FP8, ``qweight``
for GPTQ/AWQ, ...). The exclusion lists come in several syntaxes (ModelOpt's wildcards,
compressed-tensors' ``re:`` patterns, substrings); the tensors are the one unambiguous record.

Every quantized linear is checked against the safetensors headers before anything loads: each
tensor the format needs is present, in one of the format's dtypes, with the shape the linear's
(N, K) implies. A mismatch is one error naming the tensor, what it is and what was expected.

The op's tensors become buffers on the linear's module (they keep their dtype when loaded;
parameters would be cast to the deployment dtype). A buffer either has the checkpoint tensor's
name (ModelOpt's ``weight`` / ``weight_scale`` / ``input_scale`` are already the op's form) or
is produced at load by a :class:`~autodeploy.models.load_hooks.LoadHook` from the format's
tensors (GPTQ's ``qweight`` -> canonical nibbles), once, never per step.
"""

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import fx

from ...export.hf_moe import STACKED_EXPERT_SOURCES
from ...models.load_hooks import LoadHook, StackExperts
from ...models.quantization import SAFETENSORS_DTYPE_NAMES
from ...utils.errors import ModelSourceError
from ...utils.logging import get_logger
from ..graph_utils import arg, is_op
from ..interface import PipelineContext

aten = torch.ops.aten
logger = get_logger(__name__)

# gm.meta keys read by load_weights: extra load hooks, and checkpoint tensors a transform accounts for
# without loading them (the loader otherwise refuses unused tensors of quantization formats)
GRAPH_LOAD_HOOKS = "autodeploy_load_hooks"
GRAPH_IGNORED_TENSORS = "autodeploy_ignored_checkpoint_tensors"

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class CheckpointTensor:
    """A tensor the format stores per quantized linear, as the headers must show it."""

    suffix: str  # the name after the linear's module path: "weight_scale"
    dtypes: Tuple[str, ...]  # safetensors dtype names accepted ("F8_E4M3", "F32", ...)
    shape: Optional[Callable[[int, int], Shape]]  # from the linear's (N, K); None: a scalar (one element)
    what: str  # words for errors: "per-tensor weight scale"


@dataclass(frozen=True)
class Buffer:
    """One tensor argument of the quantized op, a buffer on the linear's module."""

    name: str
    dtype: torch.dtype
    shape: Optional[Callable[[int, int], Shape]]  # None: the checkpoint tensor's own shape (a scalar)
    sources: Tuple[str, ...] = ()  # checkpoint suffixes a load hook makes it from; () = same-named tensor
    convert: Optional[Callable[[List[torch.Tensor]], torch.Tensor]] = None


@dataclass(frozen=True)
class LinearFormat:
    """How one quantization format stores a linear, and the canonical op it becomes."""

    name: str  # "ModelOpt FP8", for logs and errors
    op: Any
    marker: str  # checkpoint suffix whose presence means "this linear is quantized"
    tensors: Tuple[CheckpointTensor, ...]
    buffers: Tuple[Buffer, ...]  # the op's tensor arguments after (x, ..., bias), in order
    # the op's trailing non-tensor arguments (block or group sizes), or a function of (N, K) giving them
    constants: Union[Tuple[Any, ...], Callable[[int, int], Tuple[Any, ...]]] = ()
    shape_error: Optional[Callable[[int, int], Optional[str]]] = None  # why (N, K) cannot be this format


def _linear_parts(node: fx.Node) -> Optional[Tuple[fx.Node, Optional[Any]]]:
    if not is_op(node, aten.linear):
        return None
    weight = node.args[1]
    if not isinstance(weight, fx.Node) or weight.op != "get_attr" or not str(weight.target).endswith(".weight"):
        return None
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return weight, bias


_PLAIN_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _describe(dtypes: Sequence[str]) -> str:
    names = {**_PLAIN_DTYPE_NAMES, **SAFETENSORS_DTYPE_NAMES}
    return " or ".join(names.get(d, d.lower()) for d in dtypes)


def validate_linear(
    fmt: LinearFormat, prefix: str, n: int, k: int, names: Sequence[str], dtypes: Dict[str, str],
    shapes: Dict[str, Shape],
) -> None:
    """Refuse a quantized linear whose checkpoint tensors do not match ``fmt`` (headers only)."""
    if fmt.shape_error is not None:
        reason = fmt.shape_error(n, k)
        if reason:
            raise ModelSourceError(f"'{prefix}' ({n} outputs, {k} inputs) cannot be {fmt.name}: {reason}")
    for tensor in fmt.tensors:
        key = f"{prefix}.{tensor.suffix}"
        if key not in names:
            raise ModelSourceError(
                f"checkpoint tensor '{key}' is missing: {fmt.name} stores a {tensor.what} ({_describe(tensor.dtypes)}) "
                f"next to every quantized weight, and '{prefix}' has a '{fmt.marker}'. Is the checkpoint complete?"
            )
        if key in dtypes and dtypes[key] not in tensor.dtypes:
            raise ModelSourceError(
                f"checkpoint tensor '{key}' is {_describe([dtypes[key]])}; {fmt.name} stores its {tensor.what} "
                f"as {_describe(tensor.dtypes)}"
            )
        if key not in shapes:
            continue
        expected = tensor.shape(n, k) if tensor.shape is not None else None
        got = shapes[key]
        ok = (got == expected) if expected is not None else (torch.Size(got).numel() == 1)
        if not ok:
            want = list(expected) if expected is not None else "one element"
            raise ModelSourceError(
                f"checkpoint tensor '{key}' has shape {list(got)}; for a linear of {n} outputs and {k} inputs "
                f"{fmt.name} expects its {tensor.what} to have shape {want}"
            )


def _load_hook(fmt: LinearFormat, buffer: Buffer) -> LoadHook:
    sources = [rf"\1.{s}" for s in buffer.sources]
    assert buffer.convert is not None
    return LoadHook(rf"(.*)\.{re.escape(buffer.name)}", sources, buffer.convert,
                    f"{fmt.name}: {', '.join(buffer.sources)} -> {buffer.name}", decodes=True)


def quantize_linears(gm: fx.GraphModule, ctx: PipelineContext, fmt: LinearFormat) -> int:
    """Rewrite every ``aten.linear`` whose checkpoint weight is in ``fmt`` into ``fmt.op``.

    Before::

        y = aten.linear(x, P.weight, P.bias)          # P.weight: float parameter [N, K] on meta

    After::

        y = fmt.op(x, P.<buffer 0>, P.bias, P.<buffer 1>, ..., *fmt.constants)   # buffers on meta
    """
    index = ctx.factory.checkpoint_index()
    names = set(index.weight_map)
    headers = index.headers()  # one read of the safetensors headers for dtypes and shapes
    dtypes = {name: dtype for name, (dtype, _) in headers.items()}
    shapes = {name: shape for name, (_, shape) in headers.items()}
    hooks: List[LoadHook] = gm.meta.setdefault(GRAPH_LOAD_HOOKS, [])
    count = 0
    for node in list(gm.graph.nodes):
        parts = _linear_parts(node)
        if parts is None:
            continue
        weight, bias = parts
        prefix = str(weight.target)[: -len(".weight")]
        if f"{prefix}.{fmt.marker}" not in names:
            continue  # a float linear (lm_head, router, excluded modules)
        if len(weight.users) > 1:
            raise ModelSourceError(
                f"'{prefix}.weight' is quantized ({fmt.name}) but the graph also uses it outside the linear "
                f"(e.g. an embedding tied to it); autodeploy cannot share a quantized weight"
            )
        args, constants = _quantized_weight(gm, fmt, prefix, node, names, dtypes, shapes)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(fmt.op, (node.args[0], args[0], bias, *args[1:], *constants))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(weight)
        count += 1
    if count:
        _register_load_hooks(fmt, hooks)
        logger.info("%s: %d linears quantized (the rest stay float)", fmt.name, count)
    gm.graph.lint()
    gm.recompile()
    return count


def _quantized_weight(gm: fx.GraphModule, fmt: LinearFormat, prefix: str, before: fx.Node, names: Sequence[str],
                      dtypes: Dict[str, str], shapes: Dict[str, Shape]) -> Tuple[List[fx.Node], Tuple[Any, ...]]:
    """Replace the float parameter ``prefix.weight`` by the format's buffers (checked against the
    headers first); returns their ``get_attr`` nodes (inserted before ``before``) and the op's
    constants."""
    owner = gm.get_submodule(prefix)
    n, k = owner.weight.shape
    validate_linear(fmt, prefix, n, k, names, dtypes, shapes)
    del owner._parameters["weight"]
    args = []
    with gm.graph.inserting_before(before):
        for buf in fmt.buffers:
            shape = buf.shape(n, k) if buf.shape is not None else shapes.get(f"{prefix}.{buf.name}", ())
            owner.register_buffer(buf.name, torch.empty(shape, dtype=buf.dtype, device="meta"))
            args.append(gm.graph.get_attr(f"{prefix}.{buf.name}"))
    return args, fmt.constants(n, k) if callable(fmt.constants) else fmt.constants


def _register_load_hooks(fmt: LinearFormat, hooks: List[LoadHook]) -> None:
    registered = {h.description for h in hooks}
    for buf in fmt.buffers:
        if buf.sources and _load_hook(fmt, buf).description not in registered:
            hooks.append(_load_hook(fmt, buf))


def quantize_moe_experts(gm: fx.GraphModule, ctx: PipelineContext, fmt: LinearFormat, op: Any,
                         stacked_op: Any) -> int:
    """Rewrite every ``torch_moe`` whose experts the checkpoint stores in ``fmt`` into ``op``, the
    per-expert quantized MoE op (``autodeploy.ops.quant.moe``): each expert projection is ``fmt``'s
    quantized linear, with the same per-linear checkpoint tensors and checks. Every
    ``torch_moe_fused`` exported stacked over such experts becomes ``stacked_op`` (see
    :func:`_quantize_stacked_layer`).

    Before::

        y = autodeploy.torch_moe(x, sel, w, [E.0.gate_proj.weight, ..], [E.0.up_proj.weight, ..],
                                 [E.0.down_proj.weight, ..], [], [], [], act, alpha, limit)

    After::

        y = op(x, sel, w, [gate <buffer 0>s], [up <buffer 0>s], [down <buffer 0>s], [gate <buffer 1>s], ...,
               *fmt.constants, act, alpha, limit)

    A layer none of whose experts has the format's marker stays float. A layer quantized only in
    part, or with expert biases, is refused (no checkpoint of these formats has either).
    """
    index = ctx.factory.checkpoint_index()
    names = set(index.weight_map)
    headers = index.headers()
    dtypes = {name: dtype for name, (dtype, _) in headers.items()}
    shapes = {name: shape for name, (_, shape) in headers.items()}
    count = 0
    sources = gm.meta.get(STACKED_EXPERT_SOURCES, {})
    for node in list(gm.graph.nodes):
        if is_op(node, torch.ops.autodeploy.torch_moe_fused):
            count += _quantize_stacked_layer(gm, node, fmt, stacked_op, sources, names, dtypes, shapes)
        elif is_op(node, torch.ops.autodeploy.torch_moe):
            count += _quantize_expert_layer(gm, node, fmt, op, names, dtypes, shapes)
    if count:
        _register_load_hooks(fmt, gm.meta.setdefault(GRAPH_LOAD_HOOKS, []))
        logger.info("%s: %d MoE layers run on %s experts", fmt.name, count, fmt.name)
    gm.graph.lint()
    gm.recompile()
    return count


def _quantize_expert_layer(gm: fx.GraphModule, node: fx.Node, fmt: LinearFormat, op: Any, names: Set[str],
                           dtypes: Dict[str, str], shapes: Dict[str, Shape]) -> int:
    """One per-expert ``torch_moe`` over ``fmt`` experts -> ``op`` (1), or left alone (0: float)."""
    weights = [list(node.args[i]) for i in (3, 4, 5)]
    prefixes = [[_expert_prefix(w) for w in projection] for projection in weights]
    if not _quantized_layer(fmt, prefixes, names, any(node.args[i] for i in (6, 7, 8))):
        return 0
    lists: List[List[List[fx.Node]]] = [[[] for _ in fmt.buffers] for _ in weights]
    constants: Tuple[Any, ...] = ()
    for j, projection in enumerate(weights):
        for w, prefix in zip(projection, prefixes[j]):
            if len(w.users) > 1:
                raise ModelSourceError(f"'{prefix}.weight' is quantized ({fmt.name}) but the graph also uses it "
                                       "outside its MoE layer; autodeploy cannot share a quantized weight")
            args, constants = _quantized_weight(gm, fmt, prefix, node, names, dtypes, shapes)
            for b, a in enumerate(args):
                lists[j][b].append(a)
    tail = [arg(node, 9, "act", "silu"), arg(node, 10, "alpha", 1.0), arg(node, 11, "limit", 0.0)]
    per_buffer = [lists[j][b] for b in range(len(fmt.buffers)) for j in range(len(weights))]
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(op, (*node.args[:3], *per_buffer, *constants, *tail))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    for w in (w for projection in weights for w in projection):
        gm.graph.erase_node(w)
    return 1


def _quantize_stacked_layer(gm: fx.GraphModule, node: fx.Node, fmt: LinearFormat, op: Any,
                            sources: Dict[str, Dict[str, List[str]]], names: Set[str], dtypes: Dict[str, str],
                            shapes: Dict[str, Shape]) -> int:
    """One ``torch_moe_fused`` over stacked placeholders of per-expert ``fmt`` experts -> ``op``
    (1), or left alone (0: float experts, or stacks not read straight from the module).

    Before (``P`` the experts module, its stacked float parameters on meta)::

        y = autodeploy.torch_moe_fused(x, sel, w, P.gate_up_proj, P.down_proj, None, None, act, alpha, limit)

    After (one ``[E, ...]`` buffer per tensor kind and projection, each loaded by a ``StackExperts``
    hook from ``<expert e's checkpoint prefix>.<kind>``, e.g. ``...experts.3.up_proj.weight_scale_inv``)::

        y = op(x, sel, w, P.gate_weight, P.up_weight, P.down_weight, P.gate_<buffer 1>, ..., *constants,
               act, alpha, limit)
    """
    gate_up, down = node.args[3], node.args[4]
    prefixes = _stacked_prefixes(gate_up, down, sources)
    if prefixes is None or not _quantized_layer(fmt, prefixes, names,
                                                any(node.args[i] is not None for i in (5, 6) if i < len(node.args))):
        return 0
    made = [buf.name for buf in fmt.buffers if buf.sources]
    if made:
        raise NotImplementedError(f"{fmt.name}: stacked experts whose {made} a load hook makes; export them with "
                                  "export_to_gm.experts_layout: per_expert")
    owner_path = str(gate_up.target).rpartition(".")[0]
    owner = gm.get_submodule(owner_path)
    _, two_inter, hidden = owner.gate_up_proj.shape  # (the expert count: the recorded prefixes)
    dims = [(two_inter // 2, hidden), (two_inter // 2, hidden), (hidden, two_inter // 2)]  # (N, K) per projection
    for j, projection in enumerate(prefixes):
        for prefix in projection:
            validate_linear(fmt, prefix, *dims[j], names, dtypes, shapes)
    with gm.graph.inserting_before(node):
        buffers = _stacked_buffers(gm, owner_path, fmt, prefixes, dims, shapes)
        constants = fmt.constants(*dims[0]) if callable(fmt.constants) else fmt.constants
        tail = [arg(node, 7, "act", "silu"), arg(node, 8, "alpha", 1.0), arg(node, 9, "limit", 0.0)]
        new = gm.graph.call_function(op, (*node.args[:3], *buffers, *constants, *tail))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    for placeholder in (gate_up, down):  # the float stacks (on meta) go unless something else reads them
        if not placeholder.users:
            gm.graph.erase_node(placeholder)
            del owner._parameters[str(placeholder.target).rpartition(".")[2]]
    return 1


def _stacked_prefixes(gate_up: Any, down: Any, sources: Dict[str, Dict[str, List[str]]]
                      ) -> Optional[List[List[str]]]:
    """Each expert's checkpoint prefix per projection (gate, up, down) of the experts module whose
    stacks ``gate_up`` and ``down`` read, as the export recorded them; None when they are not
    read straight from one exported-stacked module."""
    if not all(isinstance(a, fx.Node) and a.op == "get_attr" for a in (gate_up, down)):
        return None
    owner_path = str(gate_up.target).rpartition(".")[0]
    names_of = sources.get(owner_path)
    if names_of is None or str(down.target).rpartition(".")[0] != owner_path:
        return None
    return [[n[: -len(".weight")] for n in names_of[part]] for part in ("gate", "up", "down")]


def _stacked_buffers(gm: fx.GraphModule, owner_path: str, fmt: LinearFormat, prefixes: List[List[str]],
                     dims: List[Tuple[int, int]], shapes: Dict[str, Shape]) -> List[fx.Node]:
    """Register one ``[E, ...]`` meta buffer per tensor kind of ``fmt`` and projection on the
    experts module, each with a ``StackExperts`` load hook, and return their ``get_attr`` nodes
    in the op's order (kind-major: gate, up, down of the first kind, then the next kind)."""
    owner = gm.get_submodule(owner_path)
    experts = len(prefixes[0])
    hooks: List[Any] = gm.meta.setdefault(GRAPH_LOAD_HOOKS, [])
    nodes: List[fx.Node] = []
    for buf in fmt.buffers:
        for j, part in enumerate(("gate", "up", "down")):
            keys = tuple(f"{p}.{buf.name}" for p in prefixes[j])
            shape = buf.shape(*dims[j]) if buf.shape is not None else shapes.get(keys[0], ())
            leaf = f"{part}_{buf.name}"
            owner.register_buffer(leaf, torch.empty((experts, *shape), dtype=buf.dtype, device="meta"))
            hooks.append(StackExperts(f"{owner_path}.{leaf}", keys, buf.dtype,
                                      f"{fmt.name}: {experts} experts' {part} {buf.name} stacked"))
            nodes.append(gm.graph.get_attr(f"{owner_path}.{leaf}"))
    return nodes


def _quantized_layer(fmt: LinearFormat, prefixes: List[List[Optional[str]]], names: Set[str], has_bias: bool) -> bool:
    """Whether the checkpoint stores this MoE layer's experts in ``fmt`` (every one of them, or none)."""
    marked = [(p, p is not None and f"{p}.{fmt.marker}" in names) for projection in prefixes for p in projection]
    if not any(m for _, m in marked):
        return False
    if any(p is None for p, _ in marked):
        raise ModelSourceError(f"a {fmt.name} MoE layer computes an expert weight in the graph instead of reading "
                               "it as a parameter; autodeploy loads quantized experts only as stored")
    unmarked = next((p for p, m in marked if not m), None)
    if unmarked is not None and f"{unmarked}.weight" not in names:
        raise ModelSourceError(f"checkpoint tensor '{unmarked}.weight' is missing (nor has it {fmt.name} scales), "
                               f"while other experts of its layer are {fmt.name}: the model's config declares more "
                               f"experts than the checkpoint stores. Does the checkpoint match its config.json?")
    if unmarked is not None or has_bias:
        what = (f"'{unmarked}' has no '{fmt.marker}' while other experts of its layer are {fmt.name}"
                if unmarked is not None else "its experts have biases")
        raise ModelSourceError(f"autodeploy cannot load this {fmt.name} MoE layer: {what}")
    return True


def _expert_prefix(weight: Any) -> Optional[str]:
    """``P`` for an expert weight read as ``get_attr P.weight``; None otherwise."""
    if isinstance(weight, fx.Node) and weight.op == "get_attr" and str(weight.target).endswith(".weight"):
        return str(weight.target)[: -len(".weight")]
    return None


def ignore_checkpoint_tensors(gm: fx.GraphModule, names: Sequence[str]) -> None:
    """Tell ``load_weights`` these checkpoint tensors are accounted for (e.g. KV-cache scales of a
    KV-cache quantization autodeploy does not apply), so it does not refuse them as unused."""
    gm.meta.setdefault(GRAPH_IGNORED_TENSORS, set()).update(names)


__all__ = [
    "Buffer", "CheckpointTensor", "GRAPH_IGNORED_TENSORS", "GRAPH_LOAD_HOOKS", "LinearFormat",
    "ignore_checkpoint_tensors", "quantize_linears", "quantize_moe_experts", "skip_kv_cache_scales", "validate_linear",
    "warn_unused_kv_cache_scales", "GRAPH_KV_CACHE_SCALES", "KV_SCALE_LEAVES",
]


KV_SCALE_LEAVES = ("k_scale", "v_scale")
# gm.meta key: the checkpoint's KV-cache scales, left by skip_kv_cache_scales for
# insert_cached_attention, which uses them (kv_cache_dtype fp8) or warns that they are unused
GRAPH_KV_CACHE_SCALES = "autodeploy_kv_cache_scales"


def skip_kv_cache_scales(gm: fx.GraphModule, ctx: PipelineContext, info: Any) -> None:
    """A ModelOpt checkpoint with ``kv_cache_quant_algo`` stores ``k_scale``/``v_scale`` for an FP8
    KV cache (``...self_attn.k_proj.k_scale``, ``...self_attn.v_proj.v_scale``). They are not
    model weights: they are marked as accounted for (``load_weights`` loads none of them), and
    noted in ``gm.meta`` for ``insert_cached_attention``, the one transform that knows
    ``kv_cache_dtype``: with ``fp8`` it reads them into each layer's cached attention; with
    ``auto`` the KV cache stays in the model's dtype and :func:`warn_unused_kv_cache_scales`
    says once how to use them. The warning is deferred to it because this transform runs before
    the setting can be known, and must not warn when ``fp8`` is set."""
    names = [n for n in ctx.factory.checkpoint_index().weight_map if n.rpartition(".")[2] in KV_SCALE_LEAVES]
    if not names:
        return
    ignore_checkpoint_tensors(gm, names)
    gm.meta[GRAPH_KV_CACHE_SCALES] = {"algo": info.config.get("kv_cache_quant_algo"), "count": len(names)}


def warn_unused_kv_cache_scales(gm: fx.GraphModule) -> None:
    """The warning for a checkpoint whose KV-cache scales the deployment does not use
    (``kv_cache_dtype: auto``); nothing when the checkpoint has none."""
    note = gm.meta.get(GRAPH_KV_CACHE_SCALES)
    if not note:
        return
    algo = note["algo"]
    if str(algo or "").upper() == "FP8":
        hint = "set kv_cache_dtype: fp8 to use them (an FP8 KV cache: a quarter of fp32's memory, half of bf16's)"
    else:
        hint = "autodeploy quantizes a KV cache to FP8 only (kv_cache_dtype: fp8), and these scales are for another format"
    logger.warning(
        "the checkpoint's KV-cache quantization (kv_cache_quant_algo %s, %d k_scale/v_scale tensors) is not "
        "applied: the KV cache stays in the model's dtype; %s", algo, note["count"], hint,
    )
