"""Lean DeepSeek-V4 (``DeepseekV4Config``), written with the canonical ops.

Why a custom model: HF's V4 attention compresses the keys window by window with Python branches
on the sequence length (``if chunk_kv.shape[1] > 0``, ``if n_windows > 1``) and ranks the
compressed entries with ``topk(min(index_topk, T))``, whose width follows the length. Export
guards on those sizes and cannot keep the sequence dim dynamic (torch then fails while
printing the violated constraint: "Cannot create Dim with inconsistent min=2, max=2").

This module computes the same thing without branches on sizes:

* every compressor cuts the sequence into ``S // rate + 2`` windows by a gather (the last two
  partial or empty; their missing slots get a gate of ``-max`` so they weigh nothing). A query at
  position ``p`` only sees entries ``w < (p + 1) // rate``, i.e. complete windows that end at or
  before ``p``, so the extra windows never reach a query: HF's stateless prefill, exactly;
* the Lightning Indexer pads its scores with ``index_topk`` ``-inf`` columns and takes a
  constant-width ``topk(index_topk)``, then keeps the picks that are causal (HF's ``-1``);
* attention is one ``torch_attention`` per layer over ``[sliding-window keys | compressed
  entries]`` with V4's per-head sinks. Sliding-only layers pass ``is_causal`` and
  ``sliding_window`` (KV-cacheable); compressed layers need an explicit boolean mask, so a model
  with them runs in recompute mode (the compressed entries are state no KV cache holds).

Manifold-constrained hyper-connections (``hc_mult`` residual streams mixed by Sinkhorn-projected
weights), the grouped low-rank output projection, hash-routed and top-k routed MoE (experts as
``torch_moe_fused`` with the ``silu_clamp`` activation) and the shared expert are plain ops.
"""

import logging
from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ... import ops  # noqa: F401  (registers torch.ops.autodeploy)
from . import register_custom_model

logger = logging.getLogger(__name__)
ad = torch.ops.autodeploy

SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "sigmoid": torch.sigmoid,
}
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


class Tables(NamedTuple):
    """What every layer reads, computed once per forward from ``position_ids``.

    ``cos``/``sin``: per rope label (``main``, ``compress``), ``[b, s, rope_dim / 2]``.
    ``window_cos``/``window_sin``: per compress rate, the compress rope at the window starts
    ``w * rate``, ``[n_windows, rope_dim / 2]``. ``local``: the sliding-window causal mask
    ``[b, 1, s, s]``. ``causal``: per rate, which compressed entries each query may see ``[b, s, n]``.
    """

    cos: Dict[str, Tensor]
    sin: Dict[str, Tensor]
    window_cos: Dict[int, Tensor]
    window_sin: Dict[int, Tensor]
    local: Tensor
    causal: Dict[int, Tensor]


# ---- small numerics shared by the blocks ----------------------------------------------------------
def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """V4's RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x``, pairs ``(x0, x1), ..``
    interleaved and *kept* interleaved (K is also V here, so the layout must survive; the
    canonical interleaved op de-interleaves). ``cos``/``sin`` broadcast against ``x[..., :d/2]``.
    HF's ``x * cos + rotate_half(x) * sin`` in fp32, computed per pair (the same numbers)."""
    half = cos.shape[-1]
    nope, rope = x[..., : -2 * half], x[..., -2 * half:].float().unflatten(-1, (half, 2))
    even, odd = rope[..., 0], rope[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def unweighted_rmsnorm(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without a weight (V4's ``q_b_norm`` and the hyper-connection input norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_inv_freq(config, label: str) -> Tuple[Tensor, float]:
    """``(inv_freq, attention_scaling)`` of rope label ``main`` or ``compress``, as HF builds them."""
    params = config.rope_parameters[label]
    rope_type = params.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"DeepSeek-V4 custom model: rope_type '{rope_type}' (sequence-length dependent "
                                  "frequencies) is not supported")
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=label)
    dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


class RMSNorm(nn.Module):
    """Weighted RMSNorm as the canonical op, cast back to the input dtype (HF keeps the weight fp32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ad.torch_rmsnorm(x, self.weight, self.eps).to(x.dtype)


class GroupedLinear(nn.Module):
    """``o_a_proj``: each of ``groups`` head groups projected by its own block of ``weight``."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: Tensor) -> Tensor:  # [b, s, groups, in] -> [b, s, groups, out / groups]
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("bsgi,goi->bsgo", x, w)


# ---- compressors -----------------------------------------------------------------------------------
def num_windows(seq: int, rate: int) -> int:
    """Windows a compressor forms over ``seq`` tokens: every complete one plus two that are never
    visible (partial or empty). Two, not one: a size that is >= 2 for every length keeps torch.export
    from guarding on the tensor being a single element, which would bound the sequence length."""
    return seq // rate + 2


def windows(x: Tensor, rate: int, back: int = 0) -> Tuple[Tensor, Tensor]:
    """``[b, s, c]`` -> ``([b, n, rate, c], valid [n, rate])`` with ``n = num_windows(s, rate)``:
    slot ``[w, j]`` holds token ``(w - back) * rate + j``; slots outside the sequence hold some
    token and are not valid. A gather, not a view or a shifted slice, so no size is guarded."""
    s = x.shape[1]
    starts = (torch.arange(num_windows(s, rate), device=x.device) - back) * rate
    slots = starts[:, None] + torch.arange(rate, device=x.device)  # [n, rate]
    return x[:, slots.clamp(min=0, max=s - 1)], (slots >= 0) & (slots < s)


class Compressor(nn.Module):
    """One compressed entry per window of ``rate`` tokens: ``norm(sum_j softmax_j(gate + bias) * kv)``,
    roped at the window start (HF's ``DeepseekV4HCACompressor``; with ``overlap`` the CSA form,
    whose entry ``w`` also pools window ``w - 1``'s first ``dim`` channels: HF's CSA compressor
    and the indexer's own compressor)."""

    def __init__(self, config, rate: int, dim: int, overlap: bool):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.rate, self.dim, self.overlap = rate, dim, overlap
        self.kv_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(dim, config.rms_norm_eps)

    def compress(self, x: Tensor, tables: Tables) -> Tensor:
        """``[b, num_windows(s, rate), dim]`` compressed entries (the last two never visible)."""
        kv_tokens, gate_tokens = self.kv_proj(x), self.gate_proj(x)
        kv, gate = self._gated_windows(kv_tokens, gate_tokens, self.position_bias, 0)
        if self.overlap:  # slots [0, rate): window w-1's first half (Ca); [rate, 2 rate): window w's Cb
            d = self.dim
            kv_prev, gate_prev = self._gated_windows(kv_tokens[..., :d], gate_tokens[..., :d],
                                                     self.position_bias[:, :d], 1)
            kv = torch.cat([kv_prev, kv[..., d:]], dim=2)
            gate = torch.cat([gate_prev, gate[..., d:]], dim=2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        compressed = self.kv_norm((kv * weights).sum(dim=2))
        return rope_interleaved(compressed, tables.window_cos[self.rate], tables.window_sin[self.rate])

    def _gated_windows(self, kv: Tensor, gate: Tensor, bias: Tensor, back: int) -> Tuple[Tensor, Tensor]:
        """Windowed kv and gate logits (plus the per-slot bias); slots outside the sequence get the
        lowest gate, i.e. softmax weight 0 (HF's ``-inf`` before window 0)."""
        kv, valid = windows(kv, self.rate, back)
        gate, _ = windows(gate, self.rate, back)
        gate = (gate + bias).masked_fill(~valid[:, :, None], torch.finfo(gate.dtype).min)
        return kv, gate


class Indexer(Compressor):
    """Lightning Indexer: ranks the CSA entries per query with
    ``sum_h w[s, h] * relu(q[s, h] . k[t]) / sqrt(d)`` and keeps the ``index_topk`` best causal ones."""

    def __init__(self, config, rate: int):
        super().__init__(config, rate, config.index_head_dim, overlap=True)
        self.num_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)

    def forward(self, x: Tensor, q_residual: Tensor, tables: Tables) -> Tensor:
        """``bool [b, s, n]``: the entries each query attends to."""
        b, s, _ = x.shape
        keys = self.compress(x, tables)  # [b, n, d]
        q = self.q_b_proj(q_residual).view(b, s, self.num_heads, self.dim)
        q = rope_interleaved(q, tables.cos["compress"].unsqueeze(2), tables.sin["compress"].unsqueeze(2))
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))) * self.dim ** -0.5
        weights = self.scorer.weights_proj(x).float() * self.num_heads ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [b, s, n]
        causal = tables.causal[self.rate]
        scores = scores.masked_fill(~causal, float("-inf"))
        # Constant width: -inf columns make topk(index_topk) valid for any n (HF: topk(min(k, n))).
        # Exactly equal scores (all heads' relu at 0) are ranked as torch.topk ranks ties, which
        # depends on the row length: with few indexer heads HF's and this row may then differ.
        padded = torch.cat([scores, scores.new_full((b, s, self.topk), float("-inf"))], dim=-1)
        picked = padded.topk(self.topk, dim=-1).indices
        keep = torch.zeros_like(padded, dtype=torch.bool).scatter(-1, picked, True)
        return keep[..., : scores.shape[-1]] & causal


class CompressorBlock(Compressor):
    """``self_attn.compressor``: entries plus which of them each query sees ``(kv, keep)``."""

    def __init__(self, config, layer_type: str):
        rate = config.compress_rates[layer_type]
        sparse = layer_type == "compressed_sparse_attention"
        super().__init__(config, rate, config.head_dim, overlap=sparse)
        self.indexer = Indexer(config, rate) if sparse else None

    def forward(self, x: Tensor, q_residual: Tensor, tables: Tables) -> Tuple[Tensor, Tensor]:
        kv = self.compress(x, tables)
        keep = tables.causal[self.rate] if self.indexer is None else self.indexer(x, q_residual, tables)
        return kv, keep


# ---- attention ---------------------------------------------------------------------------------------
class DeepseekV4Attention(nn.Module):
    """Shared-KV MQA (one head read as K and V), partial interleaved RoPE undone on the output,
    per-head sinks, grouped low-rank output projection; plus the compressed entries of CSA/HCA."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        layer_type = config.layer_types[layer_idx]
        self.rope_label = "main" if layer_type == "sliding_attention" else "compress"
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.groups, self.window, self.eps = config.o_groups, config.sliding_window, config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        h = config.hidden_size
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(h, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(self.num_heads * self.head_dim // self.groups,
                                      self.groups * config.o_lora_rank, self.groups)
        self.o_b_proj = nn.Linear(self.groups * config.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.compressor = None if layer_type == "sliding_attention" else CompressorBlock(config, layer_type)

    def forward(self, x: Tensor, tables: Tables) -> Tensor:
        b, s, _ = x.shape
        cos = tables.cos[self.rope_label].unsqueeze(2)
        sin = tables.sin[self.rope_label].unsqueeze(2)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rmsnorm(self.q_b_proj(q_residual).view(b, s, self.num_heads, self.head_dim), self.eps)
        q = rope_interleaved(q, cos, sin)
        kv = rope_interleaved(self.kv_norm(self.kv_proj(x)).view(b, s, 1, self.head_dim), cos, sin)
        if self.compressor is None:
            out = ad.torch_attention(q, kv, kv, None, 0.0, True, self.scale, self.sinks, self.window, None, None)
        else:
            entries, keep = self.compressor(x, q_residual, tables)
            kv = torch.cat([kv, entries.unsqueeze(2)], dim=1)
            mask = torch.cat([tables.local, keep.unsqueeze(1)], dim=-1)
            out = ad.torch_attention(q, kv, kv, mask, 0.0, False, self.scale, self.sinks, None, None, None)
        out = rope_interleaved(out, cos, -sin)  # V carried K's rope: rotate back to the query position
        grouped = self.o_a_proj(out.reshape(b, s, self.groups, -1))
        return self.o_b_proj(grouped.flatten(2))


# ---- MoE ---------------------------------------------------------------------------------------------
class SharedExpert(nn.Module):
    """V4's MLP: SwiGLU with the gate clamped from above and up clamped both ways at ``swiglu_limit``."""

    def __init__(self, config):
        super().__init__()
        h, i, bias = config.hidden_size, config.moe_intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.limit = config.swiglu_limit

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """``mlp.gate``: learned scores; the experts come from ``topk(scores + bias)`` or, for
    ``hash_moe`` layers, from the frozen ``tid2eid[input_ids]`` table."""

    def __init__(self, config, hashed: bool):
        super().__init__()
        self.top_k, self.scale = config.num_experts_per_tok, config.routed_scaling_factor
        self.score = SCORE_FUNCTIONS[config.scoring_func]
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))
        self.hashed = hashed

    def forward(self, flat: Tensor, input_ids: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """``(experts [t, k], weights [t, k])`` for the ``t`` rows of ``flat``."""
        scores = self.score(F.linear(flat, self.weight))
        if self.hashed:
            experts = self.tid2eid[input_ids.reshape(-1)].long()
        else:
            experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scale


class SparseMoe(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = Router(config, config.mlp_layer_types[layer_idx] == "hash_moe")
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # gate rows, then up rows
        self.experts.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.shared_experts = SharedExpert(config)
        self.limit = config.swiglu_limit

    def forward(self, x: Tensor, input_ids: Optional[Tensor]) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(flat, input_ids)
        routed = ad.torch_moe_fused(flat, experts, weights, self.experts.gate_up_proj, self.experts.down_proj,
                                    None, None, "silu_clamp", 1.0, self.limit)
        return routed.view_as(x) + self.shared_experts(x)


# ---- hyper-connections -------------------------------------------------------------------------------
class HyperConnection(nn.Module):
    """mHC: from the ``hc`` residual streams ``[b, s, hc, d]``, the weights that collapse them
    into the block input (pre), spread the block output back (post) and mix the streams (comb,
    projected towards a doubly stochastic matrix by ``hc_sinkhorn_iters`` Sinkhorn steps)."""

    def __init__(self, config):
        super().__init__()
        hc = self.hc = config.hc_mult
        self.iters, self.hc_eps, self.eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + hc) * hc, hc * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(post [b, s, hc], comb [b, s, hc, hc], collapsed [b, s, d])``."""
        hc = self.hc
        flat = unweighted_rmsnorm(streams.flatten(2).float(), self.eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):  # a fixed count: unrolled by export
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """``model.hc_head``: the final collapse of the streams before the last norm."""

    def __init__(self, config):
        super().__init__()
        hc = config.hc_mult
        self.eps, self.hc_eps = config.rms_norm_eps, config.hc_eps
        self.hc_fn = nn.Parameter(torch.empty(hc, hc * config.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        mixes = F.linear(unweighted_rmsnorm(x.flatten(2).float(), self.eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


def mix_streams(streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """``post * out + comb^T @ streams``: the block output spread over the streams plus the mixed
    residual (comb is not symmetric: HF sums over its first axis)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                 streams)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, layer_idx)
        self.mlp = SparseMoe(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, hidden_states: Tensor, input_ids: Optional[Tensor], tables: Tables) -> Tensor:
        """``hidden_states``: the ``[b, s, hc_mult, d]`` residual streams."""
        post, comb, collapsed = self.attn_hc(hidden_states)
        out = self.self_attn(self.input_layernorm(collapsed), tables)
        hidden_states = mix_streams(hidden_states, out, post, comb)
        post, comb, collapsed = self.ffn_hc(hidden_states)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return mix_streams(hidden_states, out, post, comb)


# ---- the model -----------------------------------------------------------------------------------------
def check_config(config) -> None:
    """Raise for the options this model does not implement (everything else HF handles is)."""
    if config.hidden_act not in ("silu", "swish"):
        raise NotImplementedError(f"DeepSeek-V4 custom model: hidden_act '{config.hidden_act}' (the experts' "
                                  "clamped SwiGLU is only defined for silu)")
    if config.scoring_func not in SCORE_FUNCTIONS:
        raise NotImplementedError(f"DeepSeek-V4 custom model: scoring_func '{config.scoring_func}'")
    unknown = set(config.layer_types) - set(LAYER_TYPES)
    if unknown:
        raise NotImplementedError(f"DeepSeek-V4 custom model: layer types {sorted(unknown)}")


class DeepseekV4Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        check_config(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)
        self.rope_scaling: Dict[str, float] = {}
        for label in ("main", "compress"):
            inv_freq, scaling = rope_inv_freq(config, label)
            self.register_buffer(f"{label}_inv_freq", inv_freq, persistent=False)  # not in the checkpoint
            self.rope_scaling[label] = float(scaling)
        self.rates = sorted({config.compress_rates[t] for t in config.layer_types if t != "sliding_attention"})
        if self.rates:
            logger.info("DeepSeek-V4: %d of %d layers attend to compressed entries (rates %s), state that no KV cache "
                        "holds; the pipeline serves such a model in recompute mode",
                        sum(t != "sliding_attention" for t in config.layer_types), len(config.layer_types), self.rates)

    def _angles(self, label: str, positions: Tensor) -> Tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * getattr(self, f"{label}_inv_freq")
        return freqs.cos() * self.rope_scaling[label], freqs.sin() * self.rope_scaling[label]

    def tables(self, position_ids: Tensor, dtype: torch.dtype) -> Tables:
        """RoPE angles and masks for this forward (see ``Tables``), computed once for all layers."""
        cos, sin, window_cos, window_sin, causal = {}, {}, {}, {}, {}
        for label in ("main", "compress"):
            c, s = self._angles(label, position_ids)
            cos[label], sin[label] = c.to(dtype), s.to(dtype)
        seq = position_ids.shape[1]
        for rate in self.rates:
            entry = torch.arange(num_windows(seq, rate), device=position_ids.device)
            c, s = self._angles("compress", entry * rate)
            window_cos[rate], window_sin[rate] = c.to(dtype), s.to(dtype)
            # entry w pools tokens [w * rate, (w + 1) * rate): a query at p sees it once p + 1 >= (w + 1) * rate
            causal[rate] = entry.view(1, 1, -1) < ((position_ids + 1) // rate).unsqueeze(-1)
        q, k = position_ids.unsqueeze(-1), position_ids.unsqueeze(-2)
        local = ((k <= q) & (k > q - self.config.sliding_window)).unsqueeze(1)
        return Tables(cos, sin, window_cos, window_sin, local, causal)


@register_custom_model("DeepseekV4Config")
class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 with the checkpoint's parameter names (``model.layers.N.self_attn.compressor...``)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.hashed = "hash_moe" in config.mlp_layer_types

    def forward(self, input_ids: Optional[Tensor], position_ids: Tensor, inputs_embeds: Optional[Tensor] = None,
                **unused) -> Tensor:
        """Logits ``[b, s, vocab]``; ``unused`` absorbs what callers pass HF models (``use_cache``)."""
        if input_ids is None and self.hashed:
            raise ValueError("DeepSeek-V4's hash-routed MoE layers pick experts from input_ids; pass input_ids")
        embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        tables = self.model.tables(position_ids, embeds.dtype)
        hidden = embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer in self.model.layers:
            hidden = layer(hidden, input_ids, tables)
        return self.lm_head(self.model.norm(self.model.hc_head(hidden)))
