"""Load hooks replayed from transformers' weight converters (stack experts, concatenate convs,
split fused projections), on transformers' own converter objects."""

import torch
from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, Transpose, WeightConverter

from autodeploy.models.conversion_hooks import conversion_hooks


def _hooks(converter, tensors, rename=lambda n: n):
    return conversion_hooks([converter], set(tensors), rename)


def _load(hooks, tensors, name):
    for hook in hooks:
        resolved = hook.resolve(name)
        if resolved is not None:
            keys, combine = resolved
            return combine([tensors[k] for k in keys])
    return None


def test_experts_are_stacked_and_gate_up_concatenated_in_expert_order():
    tensors = {f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": torch.full((2, 3), 10.0 * e + i)
               for e in (0, 1, 10, 2) for i, w in enumerate(("w1", "w3"))}
    conv = WeightConverter([r"\.experts.*.w1.weight", r"\.experts.*.w3.weight"], [".experts.gate_up_proj"],
                           [MergeModulelist(0), Concatenate(1)])
    hooks = _hooks(conv, tensors, lambda n: n.replace(".mlp.", ".block_sparse_moe."))
    out = _load(hooks, tensors, "model.layers.0.mlp.experts.gate_up_proj")
    assert out.shape == (4, 4, 3)
    assert out[:, 0, 0].tolist() == [0.0, 10.0, 20.0, 100.0]  # numeric expert order, not string order
    assert out[:, 2, 0].tolist() == [1.0, 11.0, 21.0, 101.0]  # w3 after w1
    assert _load(hooks, tensors, "model.layers.1.mlp.experts.gate_up_proj") is None  # no sources: left missing


def test_concatenated_convolutions_and_chunked_projections():
    tensors = {f"m.l.0.attn.{x}_conv1d.weight": torch.full((2, 1, 4), float(i)) for i, x in enumerate("qkv")}
    conv = WeightConverter(["attn.q_conv1d.weight", "attn.k_conv1d.weight", "attn.v_conv1d.weight"],
                           ["attn.conv1d.weight"], [Concatenate(0)])
    out = _load(_hooks(conv, tensors), tensors, "m.l.0.attn.conv1d.weight")
    assert out[:, 0, 0].tolist() == [0, 0, 1, 1, 2, 2]

    fused = {"m.mlp.gate_up_proj.weight": torch.arange(8.0).reshape(4, 2)}
    split = WeightConverter(["mlp.gate_up_proj.weight"], ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(0)])
    hooks = _hooks(split, fused)
    assert _load(hooks, fused, "m.mlp.gate_proj.weight").tolist() == [[0, 1], [2, 3]]
    assert _load(hooks, fused, "m.mlp.up_proj.weight").tolist() == [[4, 5], [6, 7]]


def test_converters_with_other_operations_are_not_replayed():
    """Near miss: a transpose is not one of the replayed operations, so no hook is made."""
    conv = WeightConverter(["mlp.w.weight"], ["mlp.v.weight"], [Transpose(0, 1)])
    assert conversion_hooks([conv], {"mlp.w.weight"}, lambda n: n) == []
