"""How HF mixture-of-experts blocks reach the IR during export.

transformers 5 stores the experts of its MoE models (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3,
GPT-OSS, ...) as one module with stacked 3-D weights and lets the expert computation be swapped
through ``ExpertsInterface`` (``config._experts_implementation``), much as attention goes
through ``AttentionInterface``. The default (``grouped_mm``) and eager implementations do not
export with dynamic shapes (the eager one loops over ``nonzero()`` of the routing), so during
export we register our own implementation and route every experts module through it. The
router, the shared experts and the combination with them are left to HF's code: routing
(softmax or sigmoid, top-k, DeepSeek's grouped top-k with correction bias, normalisation,
scaling) stays plain ops in the graph, exactly the model's numerics.

Two things happen per experts module:

* Parameters: stacked, or one per checkpoint tensor. HF checkpoints of most families store
  each expert's weights separately (``experts.<e>.w1.weight`` or ``experts.<e>.gate_proj.weight``)
  and HF stacks them while loading (its ``conversion_mapping``). By default
  (``stack_experts``) the module keeps its stacked parameters and our loader stacks the
  checkpoint's tensors into them by replaying those converters (``conversion_hooks``): three
  parameters per MoE layer instead of 3 x E, which matters because torch.export's time, and
  every later walk over the graph's weights, grows with the number of parameters (a 16-layer,
  128-expert model: 19 s -> 4 s of export); expert parallelism gives each rank its rows of the
  stacks. Quantized experts (the same scale tensors beside every expert's ``weight``) are
  exported stacked too: the float stacks are placeholders that ``quantize_*_moe_from_config``
  replaces by one ``[E, ...]`` buffer per tensor kind and projection, filled at load from the
  per-expert tensors whose names the plan records (``ExpertsPlan.sources``, in
  ``gm.meta[STACKED_EXPERT_SOURCES]``). Experts that differ in what the checkpoint stores,
  packed formats without a ``weight``, and sharded builds whose world size does not divide the
  experts (split inside each expert) need the experts one by one, so there the stacked
  parameters are replaced by per-expert ones named exactly as the checkpoint names them (derived from
  transformers' own conversion mapping, renamings included, e.g. Mixtral's
  ``block_sparse_moe``; the other renamed tensors, such as Mixtral's router, are renamed after
  export by ``hf_names``), and ``fuse_moe`` stacks them once after loading. Modules with no
  such conversion (GPT-OSS stores stacked, transposed, interleaved weights with biases), or
  whose checkpoint (when known) holds the stacked names, keep their parameters.
* The computation becomes canonical (``experts_implementation="autodeploy"``): ``torch_moe``
  over the per-expert parameters, or ``torch_moe_fused`` over the stacked ones, with any layout
  difference (transposed, interleaved gate/up) written as view/cat ops on the parameters, which
  ``fuse_moe`` folds into new parameters at load. The activation is identified by running the
  module's own gate function on a probe tensor and comparing it with the canonical ones, so a
  variant we do not know is never silently replaced: such a module (and every module with
  ``experts_implementation="batched_mm"``) runs transformers' exportable ``batched_mm``
  implementation instead, over weights stacked inside the graph from the per-expert parameters;
  ``match_moe_pattern`` canonicalises that form when it can.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Collection, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from ..ops.moe import expert_activation
from ..utils.logging import get_logger
from .hf_names import checkpoint_key, checkpoint_name, conversions, in_checkpoint, reverted_renamings

logger = get_logger(__name__)

AD_EXPERTS_IMPL = "autodeploy"
# gm.meta key: experts module path -> ExpertsPlan.sources of every stacked experts module with a
# per-expert checkpoint
STACKED_EXPERT_SOURCES = "autodeploy_stacked_expert_sources"
SUPPORTED_EXPERTS_IMPLS = (AD_EXPERTS_IMPL, "batched_mm")


@dataclass
class ExpertsPlan:
    """How one experts module is exported."""

    path: str
    num_experts: int
    act: Optional[str]  # canonical activation, None when the module's gate function is not one we know
    alpha: float = 1.0
    limit: float = 0.0
    canonical: bool = True  # emit torch_moe / torch_moe_fused (False: HF's batched_mm)
    # per-expert parameters (checkpoint names) as (owner module, attribute): gate, up, down lists;
    # empty when stacked. Read at call time: export swaps parameters for traced ones by name.
    gate: List[Tuple[nn.Module, str]] = field(default_factory=list)
    up: List[Tuple[nn.Module, str]] = field(default_factory=list)
    down: List[Tuple[nn.Module, str]] = field(default_factory=list)

    # stacked parameters the loader fills from per-expert checkpoint tensors: the checkpoint names of
    # each expert's gate, up and down weight (quantize_*_moe_from_config reads them: gm.meta)
    sources: Optional[Dict[str, List[str]]] = None

    @property
    def per_expert(self) -> bool:
        return bool(self.gate)

    def weights(self, part: str) -> List[torch.Tensor]:
        return [getattr(owner, leaf) for owner, leaf in getattr(self, part)]


# id(experts module) -> plan, for the duration of one export
_PLANS: Dict[int, ExpertsPlan] = {}


def is_hf_experts_module(module: nn.Module) -> bool:
    """A module decorated with transformers' ``use_experts_implementation`` and gated stacked weights."""
    if not all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "has_bias")):
        return False
    params = module._parameters
    return all(isinstance(params.get(n), nn.Parameter) and params[n].dim() == 3 for n in ("gate_up_proj", "down_proj"))


def _intermediate(module: nn.Module) -> int:
    w = module.gate_up_proj
    return int((w.shape[2] if module.is_transposed else w.shape[1]) // 2)


def identify_activation(module: nn.Module) -> Tuple[Optional[str], float, float]:
    """``(act, alpha, limit)`` whose canonical activation equals the module's gate function, else
    ``(None, 1, 0)``. The module's ``_apply_gate`` runs on a probe in its own gate/up layout."""
    if not module.has_gate or getattr(module, "has_post_expert_norm", False):
        return None, 1.0, 0.0
    inter = _intermediate(module)
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(16, 2 * inter, generator=gen) * 6.0  # wide enough to hit GPT-OSS's clamps
    if module.is_concatenated:
        gate, up = probe[:, :inter], probe[:, inter:]
    else:
        gate, up = probe[:, 0::2], probe[:, 1::2]
    try:
        with torch.no_grad():
            reference = module._apply_gate(probe)
    except Exception as exc:  # noqa: BLE001 - an unknown gate function is simply not canonical
        logger.info("experts gate of %s could not be probed (%s)", type(module).__name__, exc)
        return None, 1.0, 0.0
    candidates = [("silu", 1.0, 0.0)]
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if isinstance(alpha, (int, float)) and isinstance(limit, (int, float)):
        candidates.append(("swiglu_oai", float(alpha), float(limit)))
    swiglu_limit = getattr(module, "swiglu_limit", None)  # HY-V4's clamped SiLU gate (DeepSeek-V4's op)
    if isinstance(swiglu_limit, (int, float)) and swiglu_limit > 0:
        candidates.append(("silu_clamp", 1.0, float(swiglu_limit)))
    for act, a, lim in candidates:
        ours = expert_activation(gate, up, act, a, lim)
        if reference.shape == ours.shape and torch.allclose(reference, ours, rtol=1e-6, atol=1e-6):
            return act, a, lim
    return None, 1.0, 0.0


def per_expert_checkpoint_names(model: nn.Module, path: str, num_experts: int) -> Optional[Dict[str, List[str]]]:
    """The checkpoint names of each expert's gate, up and down weights, as transformers saves them
    (``save_pretrained`` reverts its conversions), or None when it keeps them stacked."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    convs = conversions(model)
    found: Dict[str, List[str]] = {}
    for param, ops, parts in (("gate_up_proj", [(MergeModulelist, 0), (Concatenate, 1)], ("gate", "up")),
                              ("down_proj", [(MergeModulelist, 0)], ("down",))):
        fqn = f"{path}.{param}" if path else param
        for conv in convs:
            if not isinstance(conv, WeightConverter):
                continue
            targets, sources = conv._original_target_patterns, conv._original_source_patterns
            if len(targets) != 1 or len(sources) != len(parts) or not all("*" in s for s in sources):
                continue
            conv_ops = [(type(op), getattr(op, "dim", None)) for op in conv.operations]
            target = targets[0].lstrip(".")
            if conv_ops != ops or not (fqn == target or fqn.endswith("." + target)):
                continue
            prefix = fqn[: len(fqn) - len(target)]
            for part, source in zip(parts, sources):
                found[part] = [prefix + source.lstrip(".").replace("*", str(e), 1) for e in range(num_experts)]
            break
    if set(found) != {"gate", "up", "down"}:
        return None
    # save_pretrained applies the reversed renamings after the converters
    renamings = reverted_renamings(convs)
    return {part: [checkpoint_name(n, renamings) for n in names] for part, names in found.items()}


Undo = List[Tuple[nn.Module, str, str]]


def _install(root: nn.Module, fqn: str, param: nn.Parameter, undo: Undo) -> Tuple[nn.Module, str]:
    """Register ``param`` at ``fqn`` under ``root``, creating plain holder modules on the way."""
    path, _, leaf = fqn.rpartition(".")
    owner = root
    for part in path.split(".") if path else []:
        child = owner._modules.get(part)
        if child is None:
            if hasattr(owner, part):
                raise RuntimeError(f"cannot place checkpoint tensor {fqn}: '{part}' is already an attribute")
            child = nn.Module()
            owner.add_module(part, child)
            undo.append((owner, part, "module"))
        owner = child
    if leaf in owner._parameters or leaf in owner._modules or hasattr(owner, leaf):
        raise RuntimeError(f"cannot place checkpoint tensor {fqn}: the name is taken")
    owner.register_parameter(leaf, param)
    undo.append((owner, leaf, "param"))
    return owner, leaf


def _stacked_views(module: nn.Module) -> Tuple[torch.Tensor, ...]:
    """The module's stacked weights in the canonical layout ([E, 2I, H] gate rows first, [E, H, I]),
    written as ops on its parameters (folded into new parameters by ``fuse_moe``)."""
    gate_up, down = module.gate_up_proj, module.down_proj
    gate_up_bias = module.gate_up_proj_bias if module.has_bias else None
    down_bias = module.down_proj_bias if module.has_bias else None
    if module.is_transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if not module.is_concatenated:
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        if gate_up_bias is not None:
            gate_up_bias = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1)
    return gate_up, down, gate_up_bias, down_bias


def autodeploy_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """HF experts-interface function used during export (see the module docstring)."""
    from transformers.integrations.moe import batched_mm_experts_forward

    plan = _PLANS.get(id(module))
    if plan is None:  # an experts module sharing the config that we do not handle (e.g. no gate)
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    if plan.canonical and plan.act is not None:
        if plan.per_expert:
            return torch.ops.autodeploy.torch_moe(
                hidden_states, top_k_index, top_k_weights, plan.weights("gate"), plan.weights("up"),
                plan.weights("down"), [], [], [], plan.act, plan.alpha, plan.limit,
            )
        gate_up, down, gate_up_bias, down_bias = _stacked_views(module)
        return torch.ops.autodeploy.torch_moe_fused(
            hidden_states, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
            plan.act, plan.alpha, plan.limit,
        )
    if not plan.per_expert:
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    # HF's code reads module.gate_up_proj / down_proj: give it the stack of the per-expert weights
    stacked = {
        "gate_up_proj": torch.stack(
            [torch.cat([g, u], dim=0) for g, u in zip(plan.weights("gate"), plan.weights("up"))]
        ),
        "down_proj": torch.stack(plan.weights("down")),
    }
    for name, value in stacked.items():
        module.__dict__[name] = value
    try:
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    finally:
        for name in stacked:
            module.__dict__.pop(name, None)


def _extra_leaves(checkpoint_keys: Collection[str]) -> Dict[str, Set[str]]:
    """Checkpoint module path -> the names of its tensors other than ``weight`` (quantization
    formats store scales, zero points or packed weights next to an expert's weight)."""
    extra: Dict[str, Set[str]] = {}
    for key in checkpoint_keys:
        path, _, leaf = key.rpartition(".")
        if leaf != "weight":
            extra.setdefault(path, set()).add(leaf)
    return extra


def _stackable(names: Dict[str, List[str]], extra: Dict[str, Set[str]], checkpoint_keys: Collection[str]) -> bool:
    """Whether a layer's per-expert checkpoint tensors can fill stacked tensors: every expert's
    gate/up/down is a plain ``weight`` (the loader stacks them into the module's parameters), or
    every one is a ``weight`` with the same tensors beside it (a quantization format's scales:
    ``quantize_*_moe_from_config`` stacks each kind into an ``[E, ...]`` buffer; tensors no
    transform claims stay unused, and quantized weights no transform claims are refused by the
    loader's dtype check, as they were per expert). A layer whose experts differ (some quantized,
    some not, a scale missing) stays per expert, where the quantizers say what is wrong."""
    leaves = {frozenset(extra.get(name.rpartition(".")[0], ())) for ns in names.values() for name in ns}
    if leaves == {frozenset()}:
        return True
    return len(leaves) == 1 and all(in_checkpoint(n, checkpoint_keys) for ns in names.values() for n in ns)


def _plan_module(
    model: nn.Module, path: str, module: nn.Module, mode: str, checkpoint_keys: Optional[Collection[str]],
    undo: Undo, removed: List[Tuple[nn.Module, str, nn.Parameter]],
    extra_leaves: Optional[Dict[str, Set[str]]] = None,
    world_size: int = 1,
) -> ExpertsPlan:
    act, alpha, limit = identify_activation(module)
    num_experts = int(module.gate_up_proj.shape[0])
    plan = ExpertsPlan(path, num_experts, act, alpha, limit, canonical=mode == AD_EXPERTS_IMPL and act is not None)
    if act is None and mode == AD_EXPERTS_IMPL:
        logger.warning("experts %s (%s): gate function is not a canonical MoE activation; exported with HF's "
                       "batched_mm", path, type(module).__name__)
    names = None
    if module.is_concatenated and not module.is_transposed and not module.has_bias:
        names = per_expert_checkpoint_names(model, path, num_experts)
    if names is not None and checkpoint_keys is not None:
        stacked_names = [f"{path}.gate_up_proj", f"{path}.down_proj"]
        if not all(in_checkpoint(n, checkpoint_keys) for ns in names.values() for n in ns) and all(
            in_checkpoint(n, checkpoint_keys) for n in stacked_names
        ):
            names = None  # the checkpoint was saved stacked (transformers' new format)
        elif (extra_leaves is not None and num_experts % world_size == 0
              and _stackable(names, extra_leaves, checkpoint_keys)):
            # stacked from the per-expert tensors at load: their keys as the checkpoint spells them
            plan.sources = {part: [checkpoint_key(n, checkpoint_keys) or n for n in ns] for part, ns in names.items()}
            names = None
    if names is None:
        return plan
    inter = _intermediate(module)
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    slices = {
        "gate": [gate_up[e, :inter] for e in range(num_experts)],
        "up": [gate_up[e, inter:] for e in range(num_experts)],
        "down": [down[e] for e in range(num_experts)],
    }
    for part, fqns in names.items():
        for fqn, tensor in zip(fqns, slices[part]):
            param = nn.Parameter(tensor.clone(), requires_grad=False)
            getattr(plan, part).append(_install(model, fqn, param, undo))
    for name in ("gate_up_proj", "down_proj"):
        removed.append((module, name, module._parameters.pop(name)))
    return plan


@contextmanager
def hf_experts_route(
    model: nn.Module, experts_implementation: str = AD_EXPERTS_IMPL, checkpoint_keys: Optional[Collection[str]] = None,
    stack_experts: bool = False, world_size: int = 1,
) -> Iterator[List[ExpertsPlan]]:
    """Export ``model``'s HF experts modules through ``experts_implementation`` (see module doc).

    ``checkpoint_keys`` (the checkpoint's tensor names, when known) decides between per-expert
    and stacked parameters; without it, transformers' conversion mapping decides. With
    ``stack_experts`` a checkpoint of plain per-expert weights is exported stacked too (the
    loader stacks them; expert parallelism splits the stacks by rows); without it, when the
    experts' tensors are quantized, or when ``world_size`` does not divide the experts (they are
    then split inside each expert, which needs them one by one), per expert.
    """
    if experts_implementation not in SUPPORTED_EXPERTS_IMPLS:
        raise ValueError(
            f"experts_implementation must be one of {SUPPORTED_EXPERTS_IMPLS}, got '{experts_implementation}'"
        )
    experts = [(name, m) for name, m in model.named_modules() if is_hf_experts_module(m)]
    if not experts:
        yield []
        return
    from transformers.integrations.moe import ExpertsInterface

    undo: Undo = []
    removed: List[Tuple[nn.Module, str, nn.Parameter]] = []
    plans: List[ExpertsPlan] = []
    mapping = ExpertsInterface._global_mapping
    saved_fn = mapping.get(AD_EXPERTS_IMPL)
    configs = {id(m.config): m.config for _, m in experts if getattr(m, "config", None) is not None}
    saved_impls = {k: getattr(c, "_experts_implementation_internal", None) for k, c in configs.items()}
    # None: never stacked by the loader; else what the checkpoint stores beside weights (quantized experts)
    extra_leaves = _extra_leaves(checkpoint_keys) if stack_experts and checkpoint_keys is not None else None
    try:
        for name, module in experts:
            plan = _plan_module(model, name, module, experts_implementation, checkpoint_keys, undo, removed,
                                extra_leaves, world_size)
            _PLANS[id(module)] = plan
            plans.append(plan)
        ExpertsInterface.register(AD_EXPERTS_IMPL, autodeploy_experts_forward)
        for cfg in configs.values():
            cfg._experts_implementation_internal = AD_EXPERTS_IMPL
        n_per_expert = sum(p.per_expert for p in plans)
        logger.info("experts route '%s': %d experts modules (%d per-expert, %d stacked, %d canonical)",
                    experts_implementation, len(plans), n_per_expert, len(plans) - n_per_expert,
                    sum(p.canonical for p in plans))
        yield plans
    finally:
        for key, cfg in configs.items():
            cfg._experts_implementation_internal = saved_impls[key]
        if saved_fn is None:
            mapping.pop(AD_EXPERTS_IMPL, None)
        else:
            mapping[AD_EXPERTS_IMPL] = saved_fn
        for owner, name, kind in reversed(undo):
            if kind == "param":
                del owner._parameters[name]
            else:
                del owner._modules[name]
        for module, name, param in removed:
            module._parameters[name] = param
        for _, module in experts:
            _PLANS.pop(id(module), None)


__all__ = ["AD_EXPERTS_IMPL", "STACKED_EXPERT_SOURCES", "SUPPORTED_EXPERTS_IMPLS", "ExpertsPlan", "hf_experts_route", "is_hf_experts_module",
           "identify_activation", "per_expert_checkpoint_names", "autodeploy_experts_forward"]
