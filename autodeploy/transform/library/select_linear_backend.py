"""``select_linear_backend`` (post_load_fusion): choose the GEMM implementation of the linears.

Before::

    y = aten.linear(x, w, b)                          # w: float32 parameter [N, K]
    y = autodeploy.torch_fused_swiglu_mlp(x, w_gu, w_d)

After, ``backend: onednn`` (the ``auto`` choice on CPU)::

    y = mkldnn._linear_pointwise(x, w_packed, b, "none", [], "")   # w_packed: oneDNN blocked layout
    y = autodeploy.torch_fused_swiglu_mlp(x, w_gu_packed, w_d_packed)  # the op sees packed weights

After, ``backend: blas``::

    y = autodeploy.blas_linear(x, w, b)        # NumPy's OpenBLAS instead of torch's BLAS

Why oneDNN: on the AMD EPYC (AVX2) machines measured here, the BLAS torch ships (MKL) takes a
slow generic path for fp32 GEMMs: 10-12 GB/s of weight bandwidth for matrix-vector products
(decode at batch 1) and 3-7 GB/s at batch 8-32, while a sum over memory reads 50 GB/s. oneDNN's
JIT kernels over weights packed once at load run the same GEMMs 1.3-3.4x faster at every batch
size (numbers in benchmarks/RESULTS.md). The packed tensor is opaque (``torch._mkldnn`` layout),
so nothing else may read it: a weight that another node also uses (a head tied to the embedding)
stays one shared, unpacked tensor and its linear keeps torch's GEMM. Packing it anyway keeps two
copies (the embedding must gather rows of the plain table): one more embedding table of memory
(+4 MiB on ``demo``, a quarter of its float32 weights; ~1 GiB on a float32 Llama-3.2-1B) for a
faster head (``demo`` batch-1 decode 2.13 vs 2.55 ms/step, one thread, 7 interleaved rounds).
A silent second copy is what the build's memory check exists to catch, so the copy is opt-in
(``pack_shared_weights: true``, which declares the memory change). Inductor cannot
lower the mkldnn op, so graphs for ``torch-compile`` call it through the opaque
``autodeploy.onednn_linear`` custom op (inductor runs it as an external kernel); torch-simple
graphs call it directly, without the custom-op dispatch cost. After packing, the tensors left
unpacked are copied out of the memory-mapped checkpoint so the mapping (and every page the
packing read) can be released.

Why ``blas`` stays opt-in: two thread pools then share the cores: with the default OpenMP wait
policy torch's threads spin while OpenBLAS works (3.7x slower); with ``OMP_WAIT_POLICY=PASSIVE``
set before Python starts it beat MKL at batch 1 but not oneDNN. It warns without that setting.

With ``gemv_dtype`` set, every linear also keeps a second copy of its weight for the rows of
decode at batch 1 (before the backend rewrite)::

    y = aten.linear(x, w, b)
    y = autodeploy.torch_fused_swiglu_mlp(x, w_gu, w_d)

After::

    y = autodeploy.dual_linear(x, w_packed, w_gemv, b, 1)   # <= 1 row: w_gemv, else w_packed
    h = autodeploy.dual_linear(x, w_gu_packed, w_gu_gemv, None, 1)
    y = autodeploy.dual_linear(autodeploy.torch_silu_and_mul(h), w_d_packed, w_d_gemv, None, 1)

Why: a one-row GEMV is bound by the bytes of weight it reads, and oneDNN's GEMV over its packed
layout does not stream them at the memory's speed. ``float32`` (what ``auto``, the default,
chooses after measuring) keeps the plain row-major weight beside the packed one and reads it
with autodeploy's GEMV kernel (``native.gemv``): exact, and on the ``small`` preset batch-1
decode measured 21.5 -> 17.1 ms per step, for a second copy of the linear weights. ``auto``
decides per build (``_gemv_auto``): only for linear weights of at least ``gemv_auto_min_mib``,
only when the copy takes at most a quarter of the free memory, and only when one pass over the
model's own linears is at least 5% faster through the kernel than through oneDNN. A weight that
stays unpacked (a tied head) needs no copy: its "copy" is the same tensor.
``float16``/``bfloat16`` (opt-in, lossy) keep a half-width copy instead: torch's GEMV from them
measured 1.4-2.7x faster than oneDNN's float32 one, at half the float32 weights again in memory,
and it rounds the activations and outputs of those rows to the narrow dtype: float16 keeps 11
bits (measured 3.5e-4 relative error per GEMV), bfloat16 8 bits (2.8e-3) but float32's range.
Hence opt-in, with the accuracy against HF reported by the bench.

bfloat16 weights are packed too where the CPU computes bf16 natively (``onednn_dtypes``: AVX-512
BF16 / AMX, as oneDNN reports it): on such a CPU (an Intel Xeon with AMX, 2 threads) oneDNN's bf16
GEMMs over packed weights took 0.80 vs torch's 1.22 ms for a one-row [8192 x 2048] product and 0.77
vs 1.33 ms for eight rows (0.6-0.9x the time at 512 rows for 2048-wide layers; slower for some
768-wide ones), and the ``small`` preset in bf16 decoded 1.21x (batch 1) and 1.19x (batch 8) faster
(benchmarks/RESULTS.md). Elsewhere oneDNN would emulate bf16 and bf16 linears stay torch's. The
GEMV copies and ``blas`` stay float32-only.

Linears whose weight is not a float32 (or packable bfloat16) ``get_attr`` tensor, and graphs on
another device, are left alone.
"""

import os
from typing import Dict, List, Literal, Optional, Set, Tuple

import torch
from pydantic import Field, model_validator
from torch import fx, nn

from ...utils.cpu import native_bf16
from ...utils.hugepages import huge_page_copies
from ...utils.logging import get_logger
from ..graph_utils import get_attr_value, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from . import _gemv_auto as gemv_auto

aten = torch.ops.aten
ad = torch.ops.autodeploy
logger = get_logger(__name__)

# (op, argument positions that hold weights a packed tensor may replace)
_WEIGHT_SLOTS: Tuple[Tuple[object, Tuple[int, ...]], ...] = (
    (aten.linear.default, (1,)),
    (ad.torch_fused_swiglu_mlp.default, (1, 2)),
    (ad.torch_swiglu_mlp.default, (1, 2, 3)),
    (ad.dual_linear.default, (1,)),
)
# compile backends that trace the graph again and cannot handle the opaque packed weights
_RETRACING_BACKENDS = ("torch-compile",)


class SelectLinearBackendConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    backend: Literal["auto", "torch", "onednn", "blas"] = Field(
        default="auto",
        description="GEMM implementation of the linears: auto (onednn on CPU, torch otherwise), torch (torch's "
        "BLAS), onednn (oneDNN over float32 weights packed at load, CPU), "
        "blas (NumPy's OpenBLAS, CPU; needs OMP_WAIT_POLICY=PASSIVE).",
    )
    gemv_dtype: Optional[Literal["auto", "float32", "float16", "bfloat16"]] = Field(
        default="auto",
        description="CPU: keep a copy of every float32 linear weight in this dtype and read it for inputs of at "
        "most gemv_max_rows rows (decode at batch 1). float32: exact, a plain row-major copy beside oneDNN's "
        "packed one, read by autodeploy's GEMV kernel (small preset: 21.5 -> 17.1 ms per batch-1 decode step "
        "measured) for 2x the weight memory. auto (default): float32 when the linear weights are at least "
        "gemv_auto_min_mib, the copy takes at most a quarter of the free memory and a build-time measurement on "
        "the model's weights finds the kernel faster than oneDNN; else none. float16/bfloat16: opt-in and lossy, "
        "1.5x the weight memory; those rows' activations and outputs are rounded to it (float16: 11 bits, "
        "bfloat16: 8 bits but float32's range). null: no copies. Not with backend blas.",
    )
    gemv_auto_min_mib: float = Field(
        default=64.0, ge=0,
        description="auto: consider the float32 GEMV copies only when the linear weights total at least this "
        "many MiB (smaller models fit in the caches, where streaming speed does not decide a step)",
    )
    pack_shared_weights: bool = Field(
        default=False,
        description="onednn: also pack a weight that other ops read too (a head tied to the embedding), "
        "as a second copy beside the one they read: a faster head (demo batch-1 decode measured 2.13 vs 2.55 "
        "ms/step) for one more copy of that tensor (the embedding table: +4 MiB on demo, ~1 GiB on a float32 "
        "Llama-3.2-1B). Off: the tied weight stays one shared tensor and its linear keeps torch's GEMM.",
    )
    gemv_max_rows: int = Field(
        default=1, ge=1,
        description="largest row count (tokens in a step) served from the gemv_dtype copy; from two rows on "
        "the narrow GEMV measured slower than float32 here",
    )

    @model_validator(mode="after")
    def _gemv_needs_a_torch_linear(self) -> "SelectLinearBackendConfig":
        if self.gemv_dtype not in (None, "auto") and self.backend == "blas":
            raise ValueError("gemv_dtype works with backend auto, onednn or torch, not blas: drop one of the two")
        # the gemv copies (half the linear weights again) and packed copies of shared weights
        copies = self.gemv_dtype is not None or self.pack_shared_weights
        if copies and "expect_mem_change" not in self.model_fields_set:
            object.__setattr__(self, "expect_mem_change", True)
        return self


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@TransformRegistry.register("select_linear_backend")
class SelectLinearBackend(BaseTransform):
    config_class = SelectLinearBackendConfig
    run_after = ("fuse_gemms", "fuse_gemms_mixed_children", "fuse_swiglu", "fuse_silu_mul", "quantize_weights",
                 "fuse_fp8_linear", "fuse_finegrained_fp8_linear", "fuse_nvfp4_linear", "fuse_int4_linear",
                 "fuse_int8_linear")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        backend = self._resolve(ctx)
        gemv_dtype, auto = self._gemv_dtype(gm, ctx, backend)
        if backend == "torch" and gemv_dtype is None:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                 reason="backend torch, no narrow GEMV: linears stay as they are")
        count = 0
        if gemv_dtype is not None:
            count = _use_gemv_copies(gm, gemv_dtype, self.config.gemv_max_rows)  # type: ignore[attr-defined]
        if backend == "onednn":
            retraced = ctx.compile_backend in _RETRACING_BACKENDS
            count = _use_onednn(gm, as_custom_op=retraced,
                                pack_shared=self.config.pack_shared_weights)  # type: ignore[attr-defined]
        elif backend == "blas":
            count = _use_blas(gm)
        if gemv_dtype is not None:
            _copies_to_huge_pages(gm)
        if auto:
            decision = gemv_auto.decide(gm)
            if not decision.use:
                gemv_auto.undo(gm)
            logger.info("gemv_dtype auto: %s float32 GEMV copies: %s", "using" if decision.use else "no", decision.reason)
        gm.recompile()
        # the split fused MLPs add nodes that shape propagation has not seen
        return TransformInfo(num_matches=count, is_clean=True, has_valid_shapes=gemv_dtype is None)

    def _gemv_dtype(self, gm: fx.GraphModule, ctx: PipelineContext, backend: str) -> Tuple[Optional[torch.dtype], bool]:
        """The dtype of the GEMV copies (None: no copies), and whether ``auto`` chose it (then
        the transform measures before keeping them)."""
        name = self.config.gemv_dtype  # type: ignore[attr-defined]
        if name is None:
            return None, False
        if torch.device(ctx.device).type != "cpu":
            if name != "auto":
                logger.warning("gemv_dtype is for CPU decode; device %s keeps float32 weights only", ctx.device)
            return None, False
        if name != "auto":
            return getattr(torch, name), False
        if backend != "onednn":
            return None, False  # the copies pay against oneDNN's GEMV; torch's and blas's were not measured
        copy_bytes = sum(t.numel() * t.element_size() for t in _linear_weights(gm))
        early = gemv_auto.precheck(copy_bytes, int(self.config.gemv_auto_min_mib * 2**20))  # type: ignore[attr-defined]
        if early is not None:
            logger.debug("gemv_dtype auto: no float32 GEMV copies: %s", early.reason)
            return None, False
        return torch.float32, True

    def _resolve(self, ctx: PipelineContext) -> str:
        backend: str = self.config.backend  # type: ignore[attr-defined]
        on_cpu = torch.device(ctx.device).type == "cpu"
        if backend == "auto":
            return "onednn" if on_cpu and onednn_available() else "torch"
        if backend != "torch" and not on_cpu:
            logger.warning("linear backend '%s' is CPU-only; device %s keeps torch's linears", backend, ctx.device)
            return "torch"
        if backend == "onednn" and not onednn_available():
            logger.warning("linear backend 'onednn' asked for, but this torch build has no oneDNN; keeping torch's")
            return "torch"
        if backend == "blas" and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
            logger.warning(
                "linear backend 'blas' without OMP_WAIT_POLICY=PASSIVE in the environment: torch's and "
                "OpenBLAS's threads will contend (measured 3.7x slower); set it before starting Python"
            )
        return backend


def _use_gemv_copies(gm: fx.GraphModule, dtype: torch.dtype, max_rows: int) -> int:
    """Turn every linear over float32 weights into ``dual_linear`` reading a ``dtype`` copy for
    few rows; fused MLPs are split into their linears so each gets its copy. Returns the number
    of ``dual_linear`` nodes made."""
    copies: Dict[str, str] = {}  # weight target -> copy target (one copy per tensor, even if tied)

    def copy_of(weight: fx.Node, user: fx.Node) -> fx.Node:
        target = str(weight.target)
        if target not in copies:
            owner, leaf = _owner(gm, target)
            owner.register_buffer(f"{leaf}_gemv", get_attr_value(gm, weight).detach().to(dtype), persistent=False)
            copies[target] = f"{target}_gemv"
        with gm.graph.inserting_before(user):
            return gm.graph.get_attr(copies[target])

    def dual(user: fx.Node, x: object, weight: fx.Node, bias: object) -> fx.Node:
        gemv = copy_of(weight, user)
        with gm.graph.inserting_before(user):
            return gm.graph.call_function(ad.dual_linear.default, (x, weight, gemv, bias, max_rows))

    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        args = list(node.args) + [None] * 7
        if node.target == aten.linear.default and _packable(gm, args[1]):
            bias = args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            out = dual(node, args[0], args[1], bias)
            count += 1
        elif node.target == ad.torch_fused_swiglu_mlp.default and all(_packable(gm, w) for w in args[1:3]) \
                and not node.kwargs:
            gate_up = dual(node, args[0], args[1], args[3])
            with gm.graph.inserting_before(node):
                act = gm.graph.call_function(ad.torch_silu_and_mul.default, (gate_up,))
            out = dual(node, act, args[2], args[4])
            count += 2
        elif node.target == ad.torch_swiglu_mlp.default and all(_packable(gm, w) for w in args[1:4]) \
                and not node.kwargs:
            gate, up = dual(node, args[0], args[1], args[4]), dual(node, args[0], args[2], args[5])
            with gm.graph.inserting_before(node):
                act = gm.graph.call_function(aten.mul.Tensor, (gm.graph.call_function(aten.silu.default, (gate,)), up))
            out = dual(node, act, args[3], args[6])
            count += 3
        else:
            continue
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    logger.debug("gemv: %d linears read %s copies of %d weights for <= %d rows", count, dtype, len(copies), max_rows)
    return count


def _copies_to_huge_pages(gm: fx.GraphModule) -> None:
    """Move the GEMV copies into memory on huge pages (``utils.hugepages``: the one-row pass
    streams them, and on 4 KiB pages it waits on a TLB miss every 4 KiB). A copy that is the same
    tensor as a weight others read (a float32 "copy" of an unpacked tied head) stays where it is:
    moving it would make it a real second copy."""
    others = {t.data_ptr() for n, t in list(gm.named_parameters()) + list(gm.named_buffers())
              if not n.endswith("_gemv") and not t.is_mkldnn}
    owners, tensors = [], []
    for prefix, module in gm.named_modules():
        for name, tensor in module._buffers.items():
            if name.endswith("_gemv") and tensor is not None and tensor.data_ptr() not in others:
                owners.append((module, name))
                tensors.append(tensor)
    for (module, name), copy in zip(owners, huge_page_copies(tensors)):
        module._buffers[name] = copy


def _linear_weights(gm: fx.GraphModule) -> List[torch.Tensor]:
    """The distinct float32 weights ``_use_gemv_copies`` would give a copy: those of the weight
    slots (``_weight_slots``, the same walk the packing uses)."""
    return [get_attr_value(gm, uses[0][0].args[uses[0][1]]) for uses in _weight_slots(gm).values()]


def _use_blas(gm: fx.GraphModule) -> int:
    count = 0
    for node in gm.graph.nodes:
        if not is_op(node, aten.linear) or not isinstance(node.args[1], fx.Node) or node.args[1].op != "get_attr":
            continue
        if get_attr_value(gm, node.args[1]).dtype != torch.float32:
            continue
        node.target = ad.blas_linear.default
        count += 1
    return count


def onednn_dtypes() -> Tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs: float32, and bfloat16 where the CPU computes it natively
    (AVX-512 BF16 / AMX; elsewhere oneDNN's bf16 would be emulated, slower than torch's)."""
    return (torch.float32,) + ((torch.bfloat16,) if native_bf16() else ())


def _packable(gm: fx.GraphModule, node: object, dtypes: Tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    value = get_attr_value(gm, node)
    return (isinstance(value, torch.Tensor) and value.dtype in dtypes and value.dim() == 2
            and value.device.type == "cpu" and not value.is_mkldnn)


def _use_onednn(gm: fx.GraphModule, as_custom_op: bool = False, pack_shared: bool = False) -> int:
    """Pack every weight of ``onednn_dtypes()`` that only linears read, once per tensor; rewrite
    the linears over packed weights. A weight that other ops read too (a tied head's embedding
    table) stays shared and unpacked unless ``pack_shared``: packing it would keep a second copy."""
    slots = _weight_slots(gm, onednn_dtypes())
    slot_users: Set[Tuple[fx.Node, int]] = {s for uses in slots.values() for s in uses}
    readers_of: Dict[str, List[fx.Node]] = {}  # one walk, not one per weight
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            readers_of.setdefault(str(n.target), []).append(n)
    packed_names: Dict[str, str] = {}
    for target, uses in slots.items():
        exclusive = all(_only_weight_slots(r, slot_users) for r in readers_of.get(target, []))
        if not exclusive and not pack_shared:
            logger.debug("onednn: %s is also read by other ops; left unpacked and shared", target)
            continue
        packed_names[target] = _pack(gm, target, in_place=exclusive)
        _point_uses_at(gm, uses, packed_names[target])
    users = {user for target in packed_names for user, _ in slots[target]}
    linears = [n for n in gm.graph.nodes if n in users and n.target == aten.linear.default]
    for node in linears:
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if as_custom_op:
            node.target = ad.onednn_linear.default
            node.args = (x, w, b)
        else:
            node.target = torch.ops.mkldnn._linear_pointwise.default
            node.args = (x, w, b, "none", [], "")
        node.kwargs = {}
    gm.graph.eliminate_dead_code()
    _drop_unread(gm, [t for t, name in packed_names.items() if name != t])
    if packed_names:
        _copy_out_of_checkpoint_mapping(gm)
    logger.debug("onednn: packed %d weights for %d linears and %d other ops",
                 len(packed_names), len(linears), len(users) - len(linears))
    return len(users)


def _weight_slots(gm: fx.GraphModule, dtypes: Tuple[torch.dtype, ...] = (torch.float32,)
                  ) -> Dict[str, List[Tuple[fx.Node, int]]]:
    """Weight target -> every (op node, argument index) where a packed tensor may replace it."""
    slots: Dict[str, List[Tuple[fx.Node, int]]] = {}
    for node in gm.graph.nodes:
        for op, positions in _WEIGHT_SLOTS:
            if node.op != "call_function" or node.target != op:
                continue
            for i in positions:
                if i < len(node.args) and _packable(gm, node.args[i], dtypes):
                    slots.setdefault(str(node.args[i].target), []).append((node, i))
    return slots


def _point_uses_at(gm: fx.GraphModule, uses: List[Tuple[fx.Node, int]], name: str) -> None:
    """Make each (user, argument index) read the attribute ``name`` (the packed tensor)."""
    for user, i in uses:
        old = user.args[i]
        if str(old.target) != name:
            with gm.graph.inserting_before(user):
                new = gm.graph.get_attr(name)
            new.meta.update(old.meta)
            user.update_arg(i, new)


def _only_weight_slots(reader: fx.Node, slot_users: Set[Tuple[fx.Node, int]]) -> bool:
    """Whether every use of ``reader`` is a weight slot that will take the packed tensor."""
    for user in reader.users:
        positions = [i for i, a in enumerate(user.args) if a is reader]
        if not positions or reader in user.kwargs.values():
            return False
        if any((user, i) not in slot_users for i in positions):
            return False
    return True


def _owner(gm: fx.GraphModule, target: str) -> Tuple[nn.Module, str]:
    *path, leaf = target.split(".")
    owner: nn.Module = gm
    for part in path:
        owner = getattr(owner, part)
    return owner, leaf


def _pack(gm: fx.GraphModule, target: str, in_place: bool) -> str:
    """Store the packed weight in place of the original, or beside it when others read it."""
    owner, leaf = _owner(gm, target)
    weight = getattr(owner, leaf)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    if in_place:
        owner._parameters.pop(leaf, None)
        owner._buffers.pop(leaf, None)
        owner.register_buffer(leaf, packed, persistent=False)
        return target
    name = f"{leaf}_onednn"
    owner.register_buffer(name, packed, persistent=False)
    return target.rsplit(".", 1)[0] + f".{name}" if "." in target else name


def _copy_out_of_checkpoint_mapping(gm: fx.GraphModule) -> None:
    """Give the tensors left unpacked their own memory.

    Loaded weights are views of the memory-mapped checkpoint file. Once most of them are
    packed, the few left (embedding, norms) would keep the whole mapping, and with it every
    page the packing read, resident: measured +412 MiB of RSS on the ``small`` preset. Copying
    what is left (93 MiB there) lets the mapping go.
    """
    copies: Dict[Tuple, torch.Tensor] = {}
    for module in gm.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None or tensor.is_mkldnn or tensor.device.type != "cpu":
                    continue
                key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
                if key not in copies:
                    copies[key] = tensor.detach().clone()
                copy = copies[key]
                store[name] = nn.Parameter(copy, requires_grad=False) if isinstance(tensor, nn.Parameter) else copy


def _drop_unread(gm: fx.GraphModule, targets: List[str]) -> None:
    """Free originals whose every reader moved to the packed copy."""
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for target in targets:
        if target in read:
            continue
        owner, leaf = _owner(gm, target)
        owner._parameters.pop(leaf, None)
        owner._buffers.pop(leaf, None)
