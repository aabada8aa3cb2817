"""``select_linear_backend.gemv_dtype: auto``: whether one-row steps read a plain float32 copy
of each packed weight through autodeploy's GEMV kernel, decided on this machine at build time.

Why a decision and not a rule: the gain is the difference between two memory-streaming loops
(oneDNN's GEMV over its packed layout, ``native.gemv`` over the plain row-major layout), which
depends on the CPU, its memory and what else runs on it; measured on the ``small`` preset on one
AMD EPYC (AVX-512) machine, batch-1 decode went from 21.5 to 17.1 ms per step. It costs a second
copy of every packed weight (oneDNN's layout is opaque and batched steps need it), so it is
also bounded by memory. The choice is made on the model's own weights: one pass of one-row
products over every linear through each path, interleaved and repeated, the fastest pass of each
compared. The result, both times and the memory are logged.

Nothing is decided for models whose linear weights fit in a last-level cache (below
``min_bytes``): there a step is bound by dispatch, not by streaming, both paths are close and
the measurement would flip between builds.
"""

import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import fx

from ...ops import native
from ...utils.logging import get_logger
from ...utils.memory import free_memory_bytes
from ..graph_utils import get_attr_value

logger = get_logger(__name__)
ad = torch.ops.autodeploy

# the second copy may take at most this share of the memory free at build time
MAX_FREE_MEMORY_SHARE = 0.25
# the GEMV kernel must beat oneDNN's by this factor to be worth a second copy of the weights
MIN_SPEEDUP = 1.05
ROUNDS = 3


@dataclass
class GemvDecision:
    use: bool
    reason: str


def precheck(copy_bytes: int, min_bytes: int) -> Optional[GemvDecision]:
    """A decision that needs no measurement (None: measure)."""
    if not native.available():
        return GemvDecision(False, f"autodeploy's CPU kernels are off ({native.unavailable_reason()})")
    if copy_bytes < min_bytes:
        return GemvDecision(False, f"the linear weights ({copy_bytes / 2**20:.0f} MiB) are below gemv_auto_min_mib: "
                            "not bound by memory streaming")
    free = free_memory_bytes(torch.device("cpu"))
    if copy_bytes > MAX_FREE_MEMORY_SHARE * free:
        return GemvDecision(False, f"a second copy of the linear weights ({copy_bytes / 2**20:.0f} MiB) would take "
                            f"more than {MAX_FREE_MEMORY_SHARE:.0%} of the free memory ({free / 2**20:.0f} MiB)")
    return None


def _dual_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.dual_linear.default]


def _operands(gm: fx.GraphModule, node: fx.Node) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    weight, gemv = get_attr_value(gm, node.args[1]), get_attr_value(gm, node.args[2])
    bias = node.args[3] if len(node.args) > 3 else None
    return weight, gemv, get_attr_value(gm, bias) if isinstance(bias, fx.Node) and bias.op == "get_attr" else None


def measure(gm: fx.GraphModule) -> Tuple[float, float]:
    """(GEMV kernel, oneDNN) milliseconds of the fastest one-row pass over every ``dual_linear``."""
    operands = [_operands(gm, n) for n in _dual_nodes(gm)]
    inputs = {g.shape[1]: torch.randn(1, g.shape[1]) for _, g, _ in operands}

    def kernel_pass() -> None:
        for _, gemv, bias in operands:
            native.gemv(inputs[gemv.shape[1]], gemv, bias)

    def onednn_pass() -> None:
        for weight, gemv, bias in operands:
            torch.ops.mkldnn._linear_pointwise(inputs[gemv.shape[1]], weight, bias, "none", [], "")

    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        kernel_pass(), onednn_pass()  # warm-up: first touches, oneDNN's kernel generation
        for _ in range(ROUNDS):
            for i, run in enumerate((kernel_pass, onednn_pass)):
                start = time.perf_counter()
                run()
                best[i] = min(best[i], (time.perf_counter() - start) * 1e3)
    return best[0], best[1]


def undo(gm: fx.GraphModule) -> None:
    """Back to one packed weight per linear: every ``dual_linear`` calls oneDNN over its packed
    weight, and the plain copies are dropped."""
    for node in _dual_nodes(gm):
        x, weight, gemv = node.args[0], node.args[1], node.args[2]
        bias = node.args[3] if len(node.args) > 3 else None
        node.target = torch.ops.mkldnn._linear_pointwise.default
        node.args = (x, weight, bias, "none", [], "")
        if not gemv.users:
            gm.graph.erase_node(gemv)
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for prefix, module in gm.named_modules():
        for name in [b for b in module._buffers if b.endswith("_gemv")]:
            if (f"{prefix}.{name}" if prefix else name) not in read:
                del module._buffers[name]


def decide(gm: fx.GraphModule) -> GemvDecision:
    """Measure the built dual graph and keep it only when the kernel is clearly faster."""
    if not _dual_nodes(gm):
        return GemvDecision(False, "no float32 linear to serve")
    kernel_ms, onednn_ms = measure(gm)
    faster = kernel_ms * MIN_SPEEDUP <= onednn_ms
    verdict = "faster" if faster else f"not {MIN_SPEEDUP:.2f}x faster"
    return GemvDecision(faster, f"one-row pass over the linears: GEMV kernel {kernel_ms:.2f} ms, oneDNN "
                        f"{onednn_ms:.2f} ms ({verdict})")
