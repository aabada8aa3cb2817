"""``torch.export`` of a causal LM into a plain ``GraphModule``.

The exported graph has the interface ``(input_ids [b, s], position_ids [b, s]) -> logits
[b, s, vocab]`` with dynamic ``b`` and ``s`` (``s`` may be 1, so one graph serves prefill and
decode). It is returned with plain FX codegen (no pytree specs, no guard module), parameters
under their checkpoint names, and ``meta['val']`` on every node.
"""

import operator
import re
from contextlib import contextmanager
from typing import Any, Callable, Collection, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import fx, nn
from torch.export import Dim
from torch.overrides import TorchFunctionMode

from ..utils.errors import ExportError
from ..utils.fx import lazy_graph_modules
from ..utils.logging import get_logger
from .hf_attention import AD_ATTN_IMPL, RouteUnsupportedError, hf_attention_route
from .hf_moe import STACKED_EXPERT_SOURCES, hf_experts_route
from .hf_names import conversions, rename_to_checkpoint
from .patch_registry import apply_export_patches
from .patches import real_value_of_meta_constant
from .run_time_checks import export_with_run_time_checks

logger = get_logger(__name__)

INPUT_NAMES = ("input_ids", "position_ids")


class _UnchangedGradModeSkipped(TorchFunctionMode):
    """Drops ``torch._C._set_grad_enabled(mode)`` calls that would not change the grad mode.

    Why: export records every such call as a graph node (HF's rotary embedding is decorated with
    ``torch.no_grad()``, and we export under ``no_grad`` already), and one recorded node makes
    ``torch.export`` split and re-inline the whole graph (``replace_set_grad_with_hop_pass``),
    which is quadratic in the number of parameters: 4.9 s of a 16-layer, 128-expert MoE's
    24 s export, 0.2 s of ``small``'s. A call that does change the mode (an ``enable_grad``
    region) still reaches export, so the graph means exactly what the model wrote. Pushed inside
    the traced forward, this mode sees each call before export's own pre-dispatch mode does.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch._C._set_grad_enabled and len(args) == 1 and not kwargs and (
            bool(args[0]) == torch.is_grad_enabled()
        ):
            return None
        return func(*args, **(kwargs or {}))


@contextmanager
def _logits_only_forward(model: nn.Module) -> Iterator[None]:
    """Export a forward that takes (input_ids, position_ids) and returns only the logits."""
    original = model.forward

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        with _UnchangedGradModeSkipped():
            out = original(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        if hasattr(out, "logits"):
            return out.logits
        return out[0] if isinstance(out, (tuple, list)) else out

    model.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.forward  # the instance attribute; the class method shows through again


@contextmanager
def _module_tracker(model: nn.Module, stack: List[str]) -> Iterator[None]:
    """Keep the stack of modules being executed, to name the one where export fails."""
    names = {id(m): name for name, m in model.named_modules()}

    def pre(module: nn.Module, args: Any) -> None:
        stack.append(f"{names.get(id(module), '?') or '<root>'} ({type(module).__name__})")

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _describe_failure(exc: BaseException, stack: List[str]) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    ops = sorted(set(re.findall(r"aten\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?", text)))
    where = f" in module {stack[-1]}" if stack else ""
    op_text = f" (op: {', '.join(ops[:3])})" if ops else ""
    return f"torch.export failed{where}{op_text}: {type(exc).__name__}: {first}"


WEIGHT_CONVERSIONS = "autodeploy_weight_conversions"  # gm.meta: transformers' converters for the model
CONSTANT_VALUES = "autodeploy_constant_values"  # gm.meta: attribute path -> CPU value for load_weights


def _meta_constant_values(ep: torch.export.ExportedProgram) -> Dict[str, torch.Tensor]:
    """The real (CPU) values of constants the forward built on the meta device, by constant
    name. They stay meta in the graph (next to meta parameters) until load_weights puts them
    on the target device."""
    values = {}
    for name, value in ep.constants.items():
        if isinstance(value, torch.Tensor) and value.is_meta:
            real = real_value_of_meta_constant(value)
            if real is not None:
                values[name] = real
    return values


def _caused_by(exc: BaseException, cls: type) -> Optional[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, cls):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def _fallback_attn_implementation(model: nn.Module) -> str:
    """The HF attention route for a model whose attention our route cannot express: sdpa, unless
    the model says it does not support it (its attention passes what HF's sdpa function drops,
    e.g. Inkling2's per-token sinks); then the model's own eager attention."""
    return "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"


def _symbolic_seq_min(ep: torch.export.ExportedProgram) -> Optional[int]:
    """The smallest sequence length the program accepts, or None if its seq dim was specialised."""
    ph = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name.endswith("input_ids"))
    size = ph.meta["val"].shape[1]
    if isinstance(size, int):
        return None
    for symbol, bounds in ep.range_constraints.items():
        if str(symbol) == str(size.node.expr):
            return max(1, int(bounds.lower))
    return None


def _seq_constraint_violated(exc: BaseException) -> bool:
    """torch.export found that the model cannot take every sequence length (it specialised the
    seq dim, or guards it with chunk-size arithmetic)."""
    text = str(exc)
    return "Constraints violated (seq)" in text or ("seq" in text and "specialized it to be a constant" in text)


@contextmanager
def lean_tracing(stack_traces: bool = False) -> Iterator[None]:
    """Export without FakeTensorMode's dispatch cache and, unless asked, without node stack traces.

    Why: with symbolic shapes a fake-tensor cache hit rebuilds its output through ``empty_strided``
    and ``set_`` on symbolic sizes, which costs more than running the meta kernel again (the cache is
    a pure memo: switching it off changes no value; the fake mode left on the graph keeps the
    setting, so later shape propagations run uncached too). Recording ``node.meta['stack_trace']``
    walks and symbolizes the Python stack for every traced op. Measured (torch 2.13, 2-core EPYC,
    AVX2): without the cache a 2-layer Llama's export 1.7 -> 0.9 s and its pipeline up to cache_init
    2.3-4.2 -> 1.6-2.0 s, a tiny DeepSeek-V3 3.5-5.1 -> 2.2-2.6 s, ``small`` unchanged within noise;
    without stack traces ``small``'s export a further 4.8 -> 3.7 s (the 2-layer Llama 1.2 -> 0.9 s).
    """
    import torch._dynamo.config as dynamo_config  # imported by torch.export already
    import torch.fx.config as fx_config

    saved = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = not stack_traces
    try:
        with dynamo_config.patch(fake_tensor_cache_enabled=False):
            yield
    finally:
        fx_config.do_not_emit_stack_traces = saved


def export_causal_lm(
    model: nn.Module,
    *,
    max_batch_size: int,
    max_seq_len: int,
    attn_implementation: str = "autodeploy",
    patches: Optional[Mapping[str, bool]] = None,
    example_batch: int = 2,
    example_seq: int = 8,
    experts_implementation: str = "autodeploy",
    checkpoint_keys: Optional[Collection[str]] = None,
    static_seq_len: Optional[int] = None,
    stack_experts: bool = False,
    world_size: int = 1,
    stack_traces: bool = False,
) -> fx.GraphModule:
    """Export ``model`` (any device, usually meta) with dynamic batch and sequence dims.

    When torch's solver rejects the named sequence dim, the model is exported again with the guards
    it could not prove as run-time checks, taken when each holds on a grid of shapes
    (``run_time_checks``; the graph then serves one-token steps as usual). Else, when
    ``static_seq_len`` is given, the model is
    exported again with an automatic dynamic dim (``Dim.DYNAMIC``: chunk-size guards often only
    trip the named-dim solver; ``meta['autodeploy_export']['min_seq_len']`` is its lower bound,
    usually 2), else with the fixed length ``static_seq_len``
    (``meta['autodeploy_export']['static_seq_len']``). Either graph only runs in recompute
    mode; shorter histories are right-padded.
    ``experts_implementation``, ``checkpoint_keys``, ``stack_experts`` and ``world_size`` steer HF
    MoE experts (``hf_moe``); ``stack_traces`` records each node's source lines
    (``node.meta['stack_trace']``, ``lean_tracing``)."""
    device = next(iter(model.parameters())).device
    batch = min(example_batch, max(max_batch_size, 2))
    b = Dim("batch", min=1, max=max(max_batch_size, 2))
    s = Dim("seq", min=1, max=max(max_seq_len, 2))
    seq = min(example_seq, max(max_seq_len, 2))

    def run(seq: int, seq_dim: Any, deferred: bool = False) -> torch.export.ExportedProgram:
        nonlocal attn_implementation
        try:
            return run_route(seq, seq_dim, attn_implementation, deferred)
        except ExportError as err:
            cause = _caused_by(err, RouteUnsupportedError)
            if attn_implementation != AD_ATTN_IMPL or cause is None:
                raise
            attn_implementation = _fallback_attn_implementation(model)
            logger.warning("%s; exporting with HF's %s attention for the pattern matchers instead", cause,
                           attn_implementation)
            return run_route(seq, seq_dim, attn_implementation, deferred)

    def run_route(seq: int, seq_dim: Any, attn_implementation: str,
                  deferred: bool = False) -> torch.export.ExportedProgram:
        input_ids = torch.zeros((batch, seq), dtype=torch.long, device=device)
        position_ids = torch.arange(seq, device=device).expand(batch, seq).contiguous()
        dims = {0: b, 1: seq_dim} if seq_dim is not None else {0: b}
        stack: List[str] = []
        try:
            with apply_export_patches(model, dict(patches or {})), hf_attention_route(
                model, attn_implementation
            ), hf_experts_route(
                model, experts_implementation, checkpoint_keys, stack_experts, world_size
            ) as expert_plans, _logits_only_forward(
                model
            ), _module_tracker(model, stack), lazy_graph_modules(), lean_tracing(stack_traces):
                ep = torch.export.export(
                    model, args=(), kwargs={"input_ids": input_ids, "position_ids": position_ids},
                    dynamic_shapes={"input_ids": dims, "position_ids": dims}, strict=False,
                    prefer_deferred_runtime_asserts_over_guards=deferred,
                )
                ep.graph_module.meta[CONSTANT_VALUES] = _meta_constant_values(ep)
                ep.graph_module.meta[STACKED_EXPERT_SOURCES] = {p.path: p.sources for p in expert_plans if p.sources}
                return ep
        except Exception as exc:  # noqa: BLE001 - every export failure becomes one actionable message
            raise ExportError(_describe_failure(exc, stack)) from exc

    static, min_seq = None, None
    try:
        ep = run(seq, s)
    except ExportError as err:
        if not _seq_constraint_violated(err.__cause__ or err):
            raise
        checked = export_with_run_time_checks(run, seq, s, max_batch_size, max_seq_len)
        if checked is not None:
            ep = checked
        elif static_seq_len is None:
            raise
        else:
            reason = str(err).split(": ", 1)[-1][:200]
            ep, min_seq, static = _export_for_recompute(run, seq, static_seq_len, reason, err)
    constant_values = ep.graph_module.meta.get(CONSTANT_VALUES, {})
    expert_sources = ep.graph_module.meta.get(STACKED_EXPERT_SOURCES, {})
    gm = _plain_graph_module(ep)
    if expert_sources:
        gm.meta[STACKED_EXPERT_SOURCES] = expert_sources
    if constant_values:
        gm.meta[CONSTANT_VALUES] = dict(constant_values)  # ep.module() keeps the constants' names as paths
    if static is not None:
        gm.meta["autodeploy_export"]["static_seq_len"] = static
    if min_seq is not None:
        gm.meta["autodeploy_export"]["min_seq_len"] = min_seq
    rename_to_checkpoint(gm, model, checkpoint_keys)
    gm.meta[WEIGHT_CONVERSIONS] = conversions(model)  # load_weights replays the converters
    return gm


def _export_for_recompute(
    run: Callable[..., torch.export.ExportedProgram], seq: int, static_seq_len: int, reason: str, err: ExportError,
) -> Tuple[torch.export.ExportedProgram, Optional[int], Optional[int]]:
    """The fallbacks for a model the named seq dim rejects: ``(program, min_seq_len, static_seq_len)``,
    a graph that only runs in recompute mode."""
    # Chunk-size arithmetic often only trips the named-Dim constraint solver: an automatic
    # dynamic dim accepts it. Usable when seq stayed symbolic (a loop specialises it).
    try:
        ep = run(seq, Dim.DYNAMIC)
        min_seq = _symbolic_seq_min(ep)
    except ExportError:
        min_seq = None
    if min_seq is not None:
        logger.warning(
            "the model does not export with a named dynamic sequence dim (%s); exported with an automatic one "
            "(sequences of at least %d tokens), which runs in recompute mode", reason, min_seq,
        )
        return ep, min_seq, None
    logger.warning(
        "the model does not export with a dynamic sequence length (%s); exporting it with a static length "
        "of %d tokens instead, which only runs in recompute mode", reason, static_seq_len,
    )
    try:
        return run(static_seq_len, None), None, static_seq_len
    except ExportError as static_err:
        raise ExportError(f"{err} (and with a static length of {static_seq_len}: {static_err})") from static_err


def export_to_graph_module(
    module: nn.Module,
    args: tuple,
    dynamic_shapes: Any = None,
    patches: Optional[Mapping[str, bool]] = None,
) -> fx.GraphModule:
    """Export any module to a plain GraphModule (used for small modules: tests, custom code)."""
    with apply_export_patches(module, dict(patches or {})), lean_tracing():
        ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    return _plain_graph_module(ep, check_inputs=False)


def _plain_graph_module(ep: torch.export.ExportedProgram, check_inputs: bool = True) -> fx.GraphModule:
    """``ep.module()`` without pytree codegen, guard module, or tuple output."""
    gm = ep.module()
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            graph.erase_node(node)
    for name in [n for n, _ in gm.named_children() if n.startswith("_guards")]:
        delattr(gm, name)
    graph._codegen = fx.graph.CodeGen()
    # Inputs first (ep.module() lists parameters before them), so inputs can be appended later.
    first = next(iter(graph.nodes))
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        if ph is not first:
            first.prepend(ph)
        first = ph.next if ph is first else first
    # ep.module() checks inputs against its pytree spec in a pre-hook; the plain module has none.
    gm._forward_pre_hooks.clear()
    _inline_mode_regions(gm)
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    if isinstance(result, (tuple, list)) and len(result) == 1:
        output.args = (result[0],)
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    if check_inputs and tuple(placeholders) != INPUT_NAMES:
        raise ExportError(f"exported graph has inputs {placeholders}, expected {list(INPUT_NAMES)}")
    gm.meta["autodeploy_export"] = {"dynamic_dims": {"batch": 0, "seq": 1}}
    gm.recompile()
    return gm


def _mode_region_operands(node: fx.Node) -> Optional[tuple]:
    """(subgraph node, operands) of a grad-mode or autocast-off region, else None.

    Exported with grad enabled (the ``no_grad`` patch off), a ``torch.no_grad()`` region of the
    model (HF's rotary embedding) becomes ``wrap_with_set_grad_enabled(False, submod, *args)``,
    and an ``autocast(enabled=False)`` region ``wrap_with_autocast(..., False, ..., submod, *args)``.
    Both are no-ops for inference outside autocast, which is the only way graphs run here.
    """
    hop = torch.ops.higher_order
    if node.op != "call_function":
        return None
    if node.target is getattr(hop, "wrap_with_set_grad_enabled", None):
        return node.args[1], node.args[2:]
    if node.target is getattr(hop, "wrap_with_autocast", None) and node.args[2] is False:
        return node.args[4], node.args[5:]
    return None


def _inline_mode_regions(gm: fx.GraphModule) -> None:
    """Copy the body of every grad-mode / autocast-off region into the graph itself.

    Why: every later step (cleanups, pattern matchers, shape propagation, weight loading)
    walks one flat graph. Left as a subgraph, the region keeps what they would have rewritten:
    its ``_assert_tensor_metadata(device=meta)`` checks, kept from tracing on the meta device,
    then fail the first run on CPU ("Tensor device mismatch! Expected: meta, Got: cpu"), and
    its RoPE is never matched.
    """
    graph = gm.graph
    while True:
        found = next(((n, r) for n in graph.nodes if (r := _mode_region_operands(n)) is not None), None)
        if found is None:
            break
        node, (sub_node, operands) = found
        sub: fx.GraphModule = getattr(gm, str(sub_node.target))
        env: Dict[fx.Node, Any] = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], operands))
        result: Any = None
        with graph.inserting_before(node):
            for inner in sub.graph.nodes:
                if inner.op == "output":
                    result = fx.map_arg(inner.args[0], env.__getitem__)
                elif inner.op == "get_attr":
                    name = _free_attr_name(gm, f"{sub_node.target}_{inner.target}")
                    setattr(gm, name, getattr(sub, str(inner.target)))
                    env[inner] = graph.get_attr(name)
                elif inner.op != "placeholder":
                    env[inner] = graph.node_copy(inner, env.__getitem__)
        for user in [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]:
            user.replace_all_uses_with(result[user.args[1]])  # getitem(region, i) -> its i-th output
            graph.erase_node(user)
        if node.users:
            node.replace_all_uses_with(result)
        graph.erase_node(node)
        if not sub_node.users:
            graph.erase_node(sub_node)
            delattr(gm, str(sub_node.target))


def _free_attr_name(gm: fx.GraphModule, base: str) -> str:
    name, i = base.replace(".", "_"), 0
    while hasattr(gm, name):
        i += 1
        name = f"{base.replace('.', '_')}_{i}"
    return name


def graph_input_values(gm: fx.GraphModule) -> Dict[str, Any]:
    return {n.name: n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"}
