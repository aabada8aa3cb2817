"""Mixture of experts: the canonical MoE ops and their fused CPU implementation.

One computation, three ops::

    out[t] = sum_k  routing_weights[t, k] * expert_{selected_experts[t, k]}(x[t])
    expert_e(v) = down_e(act(gate_e(v), up_e(v)))

* ``torch_moe``: per-expert weight lists (``gate_weights[e]`` ``[I, H]``, ``up_weights[e]``
  ``[I, H]``, ``down_weights[e]`` ``[H, I]``). The IR where experts must be seen one by one:
  quantized experts of checkpoints that store each expert separately (Mixtral, Qwen-MoE,
  OLMoE, DeepSeek), and sharded builds whose world size does not divide the experts; the
  graph's parameters are then the checkpoint's tensors.
* ``torch_moe_fused``: the same with stacked weights, ``gate_up_weight`` ``[E, 2I, H]`` (gate
  rows first, then up rows) and ``down_weight`` ``[E, H, I]``. The IR of plain (unquantized)
  experts, whether the checkpoint stores them stacked or per expert (the loader stacks them),
  and what ``fuse_moe`` produces from ``torch_moe`` at load time.
* ``grouped_moe_fused``: ``torch_moe_fused``'s signature and numerics, the fast implementation
  ``fuse_moe`` chooses (see its docstring for the two strategies and the measurements).

Routing is not part of these ops: the router logits, softmax or sigmoid, (grouped) top-k,
correction bias, normalisation and scaling stay plain ops in the graph, exactly as the model
wrote them, and arrive here as ``selected_experts`` ``[T, K]`` (int) and ``routing_weights``
``[T, K]``. Shared experts stay ordinary MLPs beside the op.

Activations (``act``): ``"silu"`` is ``silu(gate) * up``; ``"swiglu_oai"`` is GPT-OSS's clamped
variant ``g = min(gate, limit); u = clamp(up, -limit, limit); (u + 1) * g * sigmoid(alpha * g)``;
``"silu_clamp"`` is DeepSeek-V4's ``silu(min(gate, limit)) * clamp(up, -limit, limit)``.
Optional biases (GPT-OSS) come per expert (lists) or stacked (``[E, 2I]``, ``[E, H]``).

Dtypes: the expert GEMMs run in ``x``'s dtype; the routing weights may be float32 (HF routes in
fp32), so each expert's output is multiplied in the promoted dtype, the ``K`` contributions of a
token are summed in at least float32, in ``k`` order, and the result is cast to ``x``'s dtype,
as transformers' ``grouped_mm`` / ``batched_mm`` expert implementations do.
"""

from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

MOE_ACTIVATIONS = ("silu", "swiglu_oai", "silu_clamp")


def expert_activation(gate: Tensor, up: Tensor, act: str, alpha: float, limit: float) -> Tensor:
    """The gated activation between an expert's gate/up GEMMs and its down GEMM."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "swiglu_oai":
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if act == "silu_clamp":  # DeepSeek-V4: silu's gate clamped from above, up clamped both ways
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    raise ValueError(f"unknown MoE activation '{act}'; known: {MOE_ACTIVATIONS}")


def _flatten(x: Tensor, selected_experts: Tensor, routing_weights: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    hidden = x.shape[-1]
    k = selected_experts.shape[-1]
    return x.reshape(-1, hidden), selected_experts.reshape(-1, k), routing_weights.reshape(-1, k)


def _acc_dtype(x: Tensor, routing_weights: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, routing_weights.dtype), torch.float32)


def per_expert_reference(x: Tensor, selected_experts: Tensor, routing_weights: Tensor, num_experts: int,
                          expert_fn) -> Tensor:
    """Loop over experts; ``expert_fn(e, rows)`` computes expert ``e`` on the rows routed to it."""
    shape = x.shape
    x2, sel, w = _flatten(x, selected_experts, routing_weights)
    tokens, k = sel.shape
    acc = _acc_dtype(x, routing_weights)
    pair_out = torch.zeros(tokens, k, x2.shape[-1], dtype=acc, device=x.device)
    for e in range(num_experts):
        token_idx, k_idx = torch.where(sel == e)
        if token_idx.numel() == 0:
            continue
        y = expert_fn(e, x2[token_idx])
        pair_out[token_idx, k_idx] = (y * w[token_idx, k_idx, None]).to(acc)
    return pair_out.sum(dim=1).to(x.dtype).reshape(shape)


def stacked_experts_reference(x: Tensor, selected_experts: Tensor, routing_weights: Tensor, num_experts: int,
                              weights: Callable[[int], Tuple[Tensor, Tensor]], gate_up_bias: Optional[Tensor],
                              down_bias: Optional[Tensor], act: str, alpha: float, limit: float) -> Tensor:
    """The reference loop over stacked experts; ``weights(e)`` gives expert ``e``'s gate_up
    ``[2I, H]`` (gate rows first) and down ``[H, I]`` weights in ``x``'s dtype, so quantized
    variants decode an expert only when it has tokens."""

    def expert(e: int, rows: Tensor) -> Tensor:
        gate_up_w, down_w = weights(e)
        inter = gate_up_w.shape[0] // 2
        gate_up = F.linear(rows, gate_up_w, None if gate_up_bias is None else gate_up_bias[e].to(rows.dtype))
        h = expert_activation(gate_up[:, :inter], gate_up[:, inter:], act, alpha, limit)
        return F.linear(h, down_w, None if down_bias is None else down_bias[e].to(rows.dtype))

    return per_expert_reference(x, selected_experts, routing_weights, num_experts, expert)


def _opt(tensors: List[Tensor], e: int) -> Optional[Tensor]:
    return tensors[e] if tensors else None


@torch.library.custom_op("autodeploy::torch_moe", mutates_args=())
def torch_moe(
    x: Tensor,
    selected_experts: Tensor,
    routing_weights: Tensor,
    gate_weights: List[Tensor],
    up_weights: List[Tensor],
    down_weights: List[Tensor],
    gate_biases: List[Tensor],
    up_biases: List[Tensor],
    down_biases: List[Tensor],
    act: str = "silu",
    alpha: float = 1.0,
    limit: float = 0.0,
) -> Tensor:
    """Reference MoE over per-expert weights (see the module docstring).

    ``x`` ``[..., H]``; ``selected_experts`` / ``routing_weights`` ``[..., K]`` with the same
    leading dims. Bias lists are empty or hold one tensor per expert.
    """
    num_experts = len(gate_weights)
    if not (len(up_weights) == len(down_weights) == num_experts):
        raise ValueError("torch_moe: gate, up and down weight lists must have one entry per expert")
    for name, biases in (("gate", gate_biases), ("up", up_biases), ("down", down_biases)):
        if biases and len(biases) != num_experts:
            raise ValueError(f"torch_moe: {name}_biases has {len(biases)} entries for {num_experts} experts")

    def expert(e: int, rows: Tensor) -> Tensor:
        gate = F.linear(rows, gate_weights[e], _opt(gate_biases, e))
        up = F.linear(rows, up_weights[e], _opt(up_biases, e))
        return F.linear(expert_activation(gate, up, act, alpha, limit), down_weights[e], _opt(down_biases, e))

    return per_expert_reference(x, selected_experts, routing_weights, num_experts, expert)


@torch_moe.register_fake
def _torch_moe_fake(x, selected_experts, routing_weights, gate_weights, up_weights, down_weights,
                    gate_biases, up_biases, down_biases, act="silu", alpha=1.0, limit=0.0):
    return torch.empty_like(x)


def _check_stacked(gate_up_weight: Tensor, down_weight: Tensor) -> int:
    if gate_up_weight.dim() != 3 or down_weight.dim() != 3 or gate_up_weight.shape[1] % 2:
        raise ValueError(
            f"stacked MoE weights must be [E, 2I, H] and [E, H, I], got {tuple(gate_up_weight.shape)} and "
            f"{tuple(down_weight.shape)}"
        )
    return gate_up_weight.shape[1] // 2


@torch.library.custom_op("autodeploy::torch_moe_fused", mutates_args=())
def torch_moe_fused(
    x: Tensor,
    selected_experts: Tensor,
    routing_weights: Tensor,
    gate_up_weight: Tensor,
    down_weight: Tensor,
    gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    act: str = "silu",
    alpha: float = 1.0,
    limit: float = 0.0,
) -> Tensor:
    """Reference MoE over stacked weights: ``gate_up_weight`` ``[E, 2I, H]`` (gate rows, then up
    rows), ``down_weight`` ``[E, H, I]``, optional ``gate_up_bias`` ``[E, 2I]``, ``down_bias``
    ``[E, H]``."""
    _check_stacked(gate_up_weight, down_weight)
    return stacked_experts_reference(x, selected_experts, routing_weights, gate_up_weight.shape[0],
                                     lambda e: (gate_up_weight[e], down_weight[e]), gate_up_bias, down_bias,
                                     act, alpha, limit)


@torch_moe_fused.register_fake
def _torch_moe_fused_fake(x, selected_experts, routing_weights, gate_up_weight, down_weight, gate_up_bias=None,
                          down_bias=None, act="silu", alpha=1.0, limit=0.0):
    return torch.empty_like(x)


# Quantizes a GEMM's input rows the way a quantized checkpoint's runtime does: ``(rows, expert,
# gemm)`` with ``expert`` the expert index of every row (a tensor) or of all of them (an int) and
# ``gemm`` 0 for gate/up, 1 for down; returns the rows as that GEMM sees them, in their dtype.
InputQuantizer = Callable[[Tensor, Union[int, Tensor], int], Tensor]


def grouped_moe(x: Tensor, selected_experts: Tensor, routing_weights: Tensor, gate_up_weight: Tensor,
                down_weight: Tensor, gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], act: str,
                alpha: float, limit: float, bmm_max_pairs: int, quantize: Optional[InputQuantizer] = None) -> Tensor:
    """The fused path (see ``grouped_moe_fused``); ``quantize``, when given, rounds each GEMM's
    input rows per expert (``autodeploy.ops.quant.moe``'s decoded quantized experts)."""
    quant = quantize or (lambda rows, expert, gemm: rows)
    inter = _check_stacked(gate_up_weight, down_weight)
    shape = x.shape
    x2, sel, w = _flatten(x, selected_experts, routing_weights)
    tokens, k = sel.shape
    pairs = tokens * k
    acc = _acc_dtype(x, routing_weights)
    flat = sel.reshape(-1)
    if pairs <= bmm_max_pairs:
        # Few (token, expert) pairs (decode): gather each pair's weights and run one batched GEMM.
        rows = quant(x2.repeat_interleave(k, dim=0), flat, 0).unsqueeze(-1)  # [P, H, 1]
        gate_up = torch.bmm(gate_up_weight[flat], rows).squeeze(-1)  # [P, 2I]
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[flat]
        h = quant(expert_activation(gate_up[:, :inter], gate_up[:, inter:], act, alpha, limit), flat, 1)
        out = torch.bmm(down_weight[flat], h.unsqueeze(-1)).squeeze(-1)  # [P, H]
        if down_bias is not None:
            out = out + down_bias[flat]
        weighted = (out * w.reshape(-1, 1)).to(acc)
        return weighted.view(tokens, k, -1).sum(dim=1).to(x.dtype).reshape(shape)
    # Many pairs (prefill): sort pairs by expert, one GEMM per expert on a contiguous slice.
    def expert(e: int, seg: Tensor) -> Tensor:
        gate_up = F.linear(quant(seg, e, 0), gate_up_weight[e], None if gate_up_bias is None else gate_up_bias[e])
        h = quant(expert_activation(gate_up[:, :inter], gate_up[:, inter:], act, alpha, limit), e, 1)
        return F.linear(h, down_weight[e], None if down_bias is None else down_bias[e])

    return sorted_experts(x, selected_experts, routing_weights, gate_up_weight.shape[0], down_weight.shape[1], expert)


def sorted_experts(x: Tensor, selected_experts: Tensor, routing_weights: Tensor, num_experts: int, hidden: int,
                   expert: Callable[[int, Tensor], Tensor]) -> Tensor:
    """The sorted strategy over any expert implementation: (token, expert) pairs sorted by expert,
    ``expert(e, rows)`` once per expert that has rows (a contiguous slice), the weighted outputs
    summed per token in ``k`` order. One host sync, for the per-expert counts."""
    shape = x.shape
    x2, sel, w = _flatten(x, selected_experts, routing_weights)
    tokens, k = sel.shape
    acc = _acc_dtype(x, routing_weights)
    flat = sel.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # -1: the pair's expert lives on another rank (expert parallelism); those sort first and are skipped
    skipped, *counts = torch.bincount(flat + 1, minlength=num_experts + 1).tolist()
    rows = x2[order // k]
    out = torch.empty(tokens * k, hidden, dtype=x.dtype, device=x.device)
    out[:skipped] = 0
    start = skipped
    for e, n in enumerate(counts):
        if n == 0:
            continue
        out[start:start + n] = expert(e, rows[start:start + n])
        start += n
    weighted = torch.empty(tokens * k, hidden, dtype=acc, device=x.device)
    weighted[order] = (out * w.reshape(-1)[order, None]).to(acc)
    return weighted.view(tokens, k, -1).sum(dim=1).to(x.dtype).reshape(shape)


@torch.library.custom_op("autodeploy::grouped_moe_fused", mutates_args=())
def grouped_moe_fused(
    x: Tensor,
    selected_experts: Tensor,
    routing_weights: Tensor,
    gate_up_weight: Tensor,
    down_weight: Tensor,
    gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    act: str = "silu",
    alpha: float = 1.0,
    limit: float = 0.0,
    bmm_max_pairs: int = 0,
) -> Tensor:
    """``torch_moe_fused`` computed the fast way.

    With at most ``bmm_max_pairs`` (token, expert) pairs, each pair's expert weights are gathered
    and two batched GEMMs run (no host sync, no per-expert loop). Otherwise pairs are sorted by
    expert and each expert runs one GEMM for gate+up and one for down on its contiguous slice of
    rows (one host sync for the per-expert counts). Both sum a token's contributions in ``k``
    order, like the reference.
    """
    return grouped_moe(x, selected_experts, routing_weights, gate_up_weight, down_weight, gate_up_bias, down_bias,
                       act, alpha, limit, bmm_max_pairs)


@grouped_moe_fused.register_fake
def _grouped_moe_fused_fake(x, selected_experts, routing_weights, gate_up_weight, down_weight, gate_up_bias=None,
                            down_bias=None, act="silu", alpha=1.0, limit=0.0, bmm_max_pairs=0):
    return torch.empty_like(x)
