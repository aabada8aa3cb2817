"""Load hooks replayed from transformers' weight converters (stack experts, concatenate convs,
split fused projections, de-interleave fused gate/up experts), on transformers' own converter
objects; and a real checkpoint whose experts only load through such a converter (Inkling2: its
``w13_weight`` is de-interleaved into ``gate_up_proj``) matching HF eager."""

import pytest
import torch
from transformers import AutoConfig
from transformers.core_model_loading import (
    Chunk, Concatenate, Interleave, MergeModulelist, PermuteForRope, Transpose, WeightConverter,
)

from autodeploy.models.conversion_hooks import conversion_hooks
from autodeploy.transform.interface import Stage
from helpers import assert_matches_hf, build, coverage_checkpoint


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


def test_a_rank_reads_only_the_experts_of_its_rows():
    """Expert parallelism over stacked experts: part 1 of 2 of the stacked gate_up is made of
    experts 2 and 10 (numeric order) only; the other part's keys are named, not read. A converter
    that does not stack along dim 0 first has no row-wise form."""
    tensors = {f"model.layers.0.mlp.experts.{e}.{w}.weight": torch.full((2, 3), 10.0 * e + i)
               for e in (0, 1, 10, 2) for i, w in enumerate(("gate_proj", "up_proj"))}
    conv = WeightConverter([r"\.experts.*.gate_proj.weight", r"\.experts.*.up_proj.weight"],
                           [".experts.gate_up_proj"], [MergeModulelist(0), Concatenate(1)])
    (hook,) = _hooks(conv, tensors)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    keys, others, combine = hook.resolve_rows(name, 1, 2)
    assert {k.split(".experts.")[1].split(".")[0] for k in keys} == {"2", "10"}
    assert {k.split(".experts.")[1].split(".")[0] for k in others} == {"0", "1"}
    assert set(keys) | set(others) == set(tensors)
    torch.testing.assert_close(combine([tensors[k] for k in keys]), _load([hook], tensors, name)[2:])
    assert hook.resolve_rows(name, 0, 3) is None  # 4 experts in 3 parts: no equal rows
    transposed = WeightConverter([r"\.experts.*.gate_proj.weight"], [".experts.gate_proj"],
                                 [MergeModulelist(0), Transpose(0, 1)])
    (hook,) = _hooks(transposed, tensors)
    assert hook.resolve_rows("model.layers.0.mlp.experts.gate_proj", 0, 2) is None


def test_the_loader_reads_a_rank_s_stacked_rows_without_the_other_experts(tmp_path):
    """load_weights for a rank holding rows [2, 4) of a stacked [4, 4, 3] parameter: the other
    experts' tensors are stored as int32 here, so reading any of them would fail the dtype check;
    they are accounted for (not reported unused), and the rows equal the whole stack's."""
    from safetensors.torch import save_file

    from autodeploy.models.checkpoint import find_checkpoint
    from autodeploy.models.weight_loader import load_into_module
    from autodeploy.transform.library._sharding import WeightShard

    tensors = {f"experts.{e}.{w}.weight": torch.full((2, 3), 10.0 * e + i)
               for e in range(4) for i, w in enumerate(("gate_proj", "up_proj"))}
    whole = torch.cat([torch.stack([tensors[f"experts.{e}.{w}.weight"] for e in range(4)]) for w in
                       ("gate_proj", "up_proj")], dim=1)
    stored = {k: (v.to(torch.int32) if k.split(".")[1] in ("0", "1") else v) for k, v in tensors.items()}
    save_file(stored, str(tmp_path / "model.safetensors"))
    conv = WeightConverter([r"experts.*.gate_proj.weight", r"experts.*.up_proj.weight"], ["experts.gate_up_proj"],
                           [MergeModulelist(0), Concatenate(1)])
    module = torch.nn.Module()
    module.experts = torch.nn.Module()
    module.experts.gate_up_proj = torch.nn.Parameter(torch.empty(2, 4, 3), requires_grad=False)
    report = load_into_module(module, find_checkpoint(str(tmp_path)), device=torch.device("cpu"),
                              dtype=torch.float32, hooks=_hooks(conv, stored), base_prefixes=(),
                              shards={"experts.gate_up_proj": WeightShard(dim=0, index=1, parts=2)})
    torch.testing.assert_close(module.experts.gate_up_proj, whole[2:])
    assert report.unused == [] and report.from_hooks == 1


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


def test_interleaved_experts_are_deinterleaved_as_transformers_loads_them():
    """Inkling2's converter: the checkpoint's fused experts hold gate and up rows alternately;
    the parameter has all gate rows, then all up rows. The hook undoes what save_pretrained did."""
    gate_up = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # (experts, 2 * inter, hidden)
    conv = WeightConverter(r"mlp\.experts\.w13_weight", r"mlp.experts.gate_up_proj", [Interleave(dim=1)])
    saved = conv.reverse_transform().operations[0].convert({"x": [gate_up]}, ["x"], ["y"])["y"]
    assert not torch.equal(saved, gate_up)  # the layout on disk differs, so a plain rename would be wrong
    tensors = {"model.llm.layers.0.mlp.experts.w13_weight": saved}
    hooks = _hooks(conv, tensors, lambda n: n.replace("model.", "model.llm."))
    assert torch.equal(_load(hooks, tensors, "model.layers.0.mlp.experts.gate_up_proj"), gate_up)
    assert _load(hooks, tensors, "model.layers.0.mlp.experts.gate_up_proj_scale_inv") is None


def test_transposes_and_rope_permutations_are_replayed_with_the_config():
    tensors = {"m.mlp.w.weight": torch.arange(6.0).reshape(2, 3)}
    conv = WeightConverter(["mlp.w.weight"], ["mlp.v.weight"], [Transpose(0, 1)])
    assert torch.equal(_load(_hooks(conv, tensors), tensors, "m.mlp.v.weight"), tensors["m.mlp.w.weight"].T)

    config = AutoConfig.for_model("llama", num_attention_heads=2, hidden_size=8)
    q = {"m.attn.wq.weight": torch.arange(8.0)[:, None].repeat(1, 8)}
    rope = WeightConverter(["attn.wq.weight"], ["attn.q_proj.weight"], [PermuteForRope()])
    hooks = conversion_hooks([rope], set(q), lambda n: n, config)
    expected = PermuteForRope().convert({"x": [q["m.attn.wq.weight"]]}, ["x"], ["y"], config=config)["y"]
    assert torch.equal(_load(hooks, q, "m.attn.q_proj.weight"), expected)
    assert not torch.equal(expected, q["m.attn.wq.weight"])


def test_converters_that_need_more_than_the_tensors_are_not_replayed():
    """Near misses: a shape-checking transpose asks the live model for the parameter's shape, and
    a RoPE permutation without the config would assume one head; neither becomes a hook."""
    conv = WeightConverter(["mlp.w.weight"], ["mlp.v.weight"], [Transpose(0, 1, check_dims=True)])
    assert conversion_hooks([conv], {"mlp.w.weight"}, lambda n: n) == []
    rope = WeightConverter(["attn.wq.weight"], ["attn.q_proj.weight"], [PermuteForRope()])
    assert conversion_hooks([rope], {"attn.wq.weight"}, lambda n: n) == []


@pytest.mark.slow  # ~24 s (HF's Inkling2 reference); the replayed operations have fast tests above, and the
# coverage sweep checks inkling2_text end to end
def test_inkling2_checkpoint_loads_and_matches_hf():
    """A real save_pretrained checkpoint: the experts are stored interleaved under the checkpoint's
    names (model.llm.layers.N.mlp.experts.w13_weight); the graph's gate_up_proj is found and
    de-interleaved through the converter, and the logits equal HF eager's. The graph takes
    sequences of at least 4 tokens (see exporter: named seq dim rejected)."""
    path, _ = coverage_checkpoint("inkling2_text")
    result = build(path, up_to=Stage.WEIGHT_LOAD, dtype="float32", max_seq_len=64, max_batch_size=2)
    load = next(r for r in result.context.history if r.key == "load_weights")
    assert load.num_matches > 0
    assert_matches_hf(result.graph, path, shapes=((1, 6), (2, 5)))


def test_stacked_quantized_experts_read_only_a_rank_s_experts(tmp_path):
    """``StackExperts`` (a stacked quantized experts buffer, one checkpoint tensor per expert):
    whole, the experts' tensors stacked in order and cast to the buffer's dtype (bf16 scales ->
    float32); for rows [2, 4) only experts 2 and 3 are read (the others are int32 here, so reading
    one fails the dtype check) and the others are accounted for."""
    from safetensors.torch import save_file

    from autodeploy.models.checkpoint import find_checkpoint
    from autodeploy.models.load_hooks import StackExperts
    from autodeploy.models.weight_loader import load_into_module
    from autodeploy.transform.library._sharding import WeightShard

    scales = {f"experts.{e}.down_proj.weight_scale": torch.full((2,), 0.5 * e, dtype=torch.bfloat16) for e in range(4)}
    keys = tuple(scales)
    hook = StackExperts("experts.down_weight_scale", keys, torch.float32)
    assert hook.resolve("experts.down_weight_scale")[0] == list(keys) and hook.resolve("experts.other") is None
    assert hook.resolve_rows("experts.down_weight_scale", 1, 2)[:2] == (list(keys[2:]), list(keys[:2]))
    assert hook.resolve_rows("experts.down_weight_scale", 0, 3) is None  # 4 experts do not split in 3
    whole = torch.stack(list(scales.values())).float()
    stored = {k: (v.to(torch.int32) if k.split(".")[1] in ("0", "1") else v) for k, v in scales.items()}
    save_file(stored, str(tmp_path / "model.safetensors"))
    module = torch.nn.Module()
    module.experts = torch.nn.Module()
    module.experts.register_buffer("down_weight_scale", torch.empty(2, 2))
    report = load_into_module(module, find_checkpoint(str(tmp_path)), device=torch.device("cpu"),
                              dtype=torch.float32, hooks=[hook], base_prefixes=(),
                              shards={"experts.down_weight_scale": WeightShard(dim=0, index=1, parts=2)})
    assert module.experts.down_weight_scale.dtype == torch.float32
    torch.testing.assert_close(module.experts.down_weight_scale, whole[2:])
    assert report.unused == [] and report.from_hooks == 1
