"""load_weights (weight_load): real checkpoint tensors into the exported graph.

Checkpoints are derived from a real tiny llama/gemma checkpoint by rewriting its safetensors
(sharding, renaming, splitting, dropping the base prefix); the reference is always HF's model
loaded from the original checkpoint.
"""

import copy
import json
import os
import shutil
from typing import Callable, Dict, List, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from autodeploy.config import load_deploy_config
from autodeploy.models import load_hooks
from autodeploy.models.checkpoint import find_checkpoint
from autodeploy.models.factory import ModelFactory
from autodeploy.models.weight_loader import load_into_module
from autodeploy.pipeline import build_graph
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.errors import ModelSourceError
from helpers import assert_matches_hf, build, family_checkpoint, rel_rmse

SHAPES = [(2, 7), (1, 1)]


@pytest.fixture(scope="module")
def hf_llama():
    return AutoModelForCausalLM.from_pretrained(family_checkpoint("llama"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exported_llama():
    """The llama graph as export leaves it (meta weights, device='meta' args): one export
    serves every test that only varies the checkpoint; each loads into its own copy."""
    return build(family_checkpoint("llama"), up_to=Stage.EXPORT).graph


def _load(gm, directory: str, hooks=None, **config):
    """Run the load_weights transform on a copy of ``gm`` with a factory for ``directory``."""
    factory = ModelFactory(directory, load_hooks=hooks)
    factory.build_model()  # what the pipeline's build_model leaves in the factory
    ctx = PipelineContext(factory=factory, dtype=torch.float32)
    out = build_transform("load_weights", config)(copy.deepcopy(gm), ctx)
    assert ctx.history[-1].key == "load_weights" and ctx.history[-1].status == "ok"
    return out


def _tensors(family: str = "llama") -> Dict[str, torch.Tensor]:
    return load_file(os.path.join(family_checkpoint(family), "model.safetensors"))


def _derive(tmp_path, name: str, edit: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]],
            family: str = "llama") -> str:
    """A copy of a family checkpoint whose model.safetensors is rewritten by ``edit``."""
    src = family_checkpoint(family)
    dst = tmp_path / name
    dst.mkdir()
    for f in os.listdir(src):
        if f != "model.safetensors" and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst / f)
    tensors = {k: v.contiguous() for k, v in edit(_tensors(family)).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _config_up_to_weight_load(model: str, **settings):
    cfg = load_deploy_config(model=model, **settings)
    transforms = {
        key: (raw if build_transform(key, raw).config.stage.order <= Stage.WEIGHT_LOAD.order
              else {**(raw or {}), "enabled": False})
        for key, raw in cfg.transforms.items()
    }
    return cfg.model_copy(update={"transforms": transforms})


def _build_with_hooks(directory: str, hooks: Optional[List[load_hooks.LoadHook]]):
    """The whole pipeline up to weight load, with a factory that carries ``hooks``."""
    factory = ModelFactory(directory, load_hooks=hooks)
    return build_graph(_config_up_to_weight_load(directory), factory=factory, log_summary=False).graph


def _assert_matches_hf(gm, hf) -> None:
    assert_matches_hf(gm, hf, SHAPES)


def _device_args(gm) -> List[torch.device]:
    found: List[torch.device] = []

    def walk(value):
        if isinstance(value, torch.device):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    for node in gm.graph.nodes:
        walk(node.args)
        walk(node.kwargs)
    return found


# ---- checkpoint layouts -----------------------------------------------------------------------


def test_sharded_safetensors_with_index(tmp_path, hf_llama, exported_llama):
    tensors = _tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    d = _derive(tmp_path, "sharded", lambda t: t)
    os.remove(os.path.join(d, "model.safetensors"))
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, os.path.join(d, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)

    index = find_checkpoint(d)
    assert len(index.files) == 2 and set(index.weight_map) == set(tensors)

    gm = _load(exported_llama, d)
    params = dict(gm.named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        assert torch.equal(params[name], tensors[name]), name
    _assert_matches_hf(gm, hf_llama)


def test_index_naming_a_missing_shard(tmp_path):
    d = _derive(tmp_path, "broken", lambda t: t)
    os.remove(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}, f)
    with pytest.raises(ModelSourceError, match="model-00001-of-00002.safetensors"):
        find_checkpoint(d)


def test_checkpoint_without_base_prefix(tmp_path, hf_llama, exported_llama):
    def strip(t):
        return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in t.items()}

    d = _derive(tmp_path, "noprefix", strip)
    assert "norm.weight" in find_checkpoint(d).weight_map and "model.norm.weight" not in find_checkpoint(d).weight_map
    _assert_matches_hf(_load(exported_llama, d), hf_llama)


def test_tied_embeddings_gemma():
    ckpt = family_checkpoint("gemma")
    assert "lm_head.weight" not in find_checkpoint(ckpt).weight_map  # the tie is what fills it
    gm = build(ckpt, up_to=Stage.WEIGHT_LOAD).graph
    assert not any(p.is_meta for p in gm.parameters())
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    _assert_matches_hf(gm, hf)


def test_tied_embeddings_stored_under_lm_head_name(tmp_path):
    def only_head(t):
        t["lm_head.weight"] = t.pop("model.embed_tokens.weight")
        return t

    d = _derive(tmp_path, "headonly", only_head, family="gemma")
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(family_checkpoint("gemma"), dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (1, 4))
    with torch.no_grad():  # HF ties in either direction: same model as the original checkpoint
        assert torch.equal(hf(input_ids=ids).logits, ref(input_ids=ids).logits)
    gm = build(d, up_to=Stage.WEIGHT_LOAD).graph
    _assert_matches_hf(gm, ref)


# ---- load hooks ---------------------------------------------------------------------------------


def test_renamed_tensor_missing_then_rename_hook(tmp_path, hf_llama, exported_llama):
    def rename_norm(t):
        t["model.final_norm.weight"] = t.pop("model.norm.weight")
        return t

    d = _derive(tmp_path, "renamed", rename_norm)
    with pytest.raises(ModelSourceError) as exc:
        _load(exported_llama, d)
    msg = str(exc.value)
    assert "model.norm.weight" in msg and "no tensor" in msg and d in msg
    assert "model.layers.0" not in msg  # only what is actually missing

    gm = _build_with_hooks(d, [load_hooks.rename(r"model\.norm\.weight", "model.final_norm.weight")])
    assert torch.equal(dict(gm.named_parameters())["model.norm.weight"], hf_llama.model.norm.weight)
    _assert_matches_hf(gm, hf_llama)


def test_concat_hook(tmp_path, hf_llama, exported_llama):
    def split_q(t):
        for i in range(2):
            w = t.pop(f"model.layers.{i}.self_attn.q_proj.weight")
            t[f"model.layers.{i}.self_attn.q_a.weight"] = w[:40].clone()
            t[f"model.layers.{i}.self_attn.q_b.weight"] = w[40:].clone()
        return t

    d = _derive(tmp_path, "split", split_q)
    with pytest.raises(ModelSourceError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        _load(exported_llama, d)
    hook = load_hooks.concat(r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight",
                             [r"model.layers.\1.self_attn.q_a.weight", r"model.layers.\1.self_attn.q_b.weight"])
    gm = _load(exported_llama, d, hooks=[hook])
    _assert_matches_hf(gm, hf_llama)


def test_stack_hook(tmp_path, hf_llama, exported_llama):
    rows = hf_llama.model.layers[0].self_attn.k_proj.weight.shape[0]

    def rows_of_k(t):
        for i in range(2):
            w = t.pop(f"model.layers.{i}.self_attn.k_proj.weight")
            for r in range(rows):
                t[f"model.layers.{i}.self_attn.k_rows.{r}"] = w[r].clone()
        return t

    d = _derive(tmp_path, "rows", rows_of_k)
    hook = load_hooks.stack(r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight",
                            [rf"model.layers.\1.self_attn.k_rows.{r}" for r in range(rows)])
    gm = _load(exported_llama, d, hooks=[hook])
    _assert_matches_hf(gm, hf_llama)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.empty(3, 4, 5, device="meta"))


def test_stack_hook_builds_expert_tensor(tmp_path):
    """Per-expert 2-D tensors stacked into one 3-D parameter (the MoE case)."""
    parts = {f"experts.{e}.weight": torch.randn(4, 5) for e in range(3)}
    save_file(parts, str(tmp_path / "model.safetensors"))
    module = Experts()
    hook = load_hooks.stack(r"experts\.w", [f"experts.{e}.weight" for e in range(3)])
    report = load_into_module(module, find_checkpoint(str(tmp_path)), device=torch.device("cpu"),
                              dtype=torch.float32, hooks=[hook])
    assert report.from_hooks == 1 and report.unused == []
    assert torch.equal(module.experts.w, torch.stack([parts[f"experts.{e}.weight"] for e in range(3)]))
    # A dim other than 0 stacks along it.
    module = Experts()
    save_file({f"experts.{e}.weight": torch.randn(3, 5) for e in range(4)}, str(tmp_path / "model.safetensors"))
    hook = load_hooks.stack(r"experts\.w", [f"experts.{e}.weight" for e in range(4)], dim=1)
    load_into_module(module, find_checkpoint(str(tmp_path)), device=torch.device("cpu"), dtype=torch.float32,
                     hooks=[hook])
    assert module.experts.w.shape == (3, 4, 5)


def test_shape_mismatch_names_both_shapes(tmp_path, exported_llama):
    def widen(t):
        t["model.norm.weight"] = torch.ones(65)
        return t

    d = _derive(tmp_path, "wide", widen)
    with pytest.raises(ModelSourceError) as exc:
        _load(exported_llama, d)
    msg = str(exc.value)
    assert "model.norm.weight" in msg and "(65,)" in msg and "(64,)" in msg


# ---- the loaded graph ---------------------------------------------------------------------------


def test_nothing_left_on_meta_after_load(hf_llama, exported_llama):
    before = exported_llama
    assert torch.device("meta") in _device_args(before), "export should bake device='meta' into the graph"
    assert all(p.is_meta for p in before.parameters())
    gm = _load(before, family_checkpoint("llama"))
    assert torch.device("meta") not in _device_args(gm)
    assert all(not p.is_meta and p.device.type == "cpu" for p in gm.parameters())
    assert all(not b.is_meta for b in gm.buffers())
    buffers = dict(gm.named_buffers())
    assert torch.equal(buffers["model.rotary_emb.inv_freq"], hf_llama.model.rotary_emb.inv_freq)
    _assert_matches_hf(gm, hf_llama)


def test_dtype_override_keeps_rope_buffers_fp32(hf_llama):
    result = build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD, dtype="bfloat16")
    gm = result.graph
    assert result.context.dtype == torch.bfloat16
    params = dict(gm.named_parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params.values())
    inv = dict(gm.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv.dtype == torch.float32
    assert torch.equal(inv, hf_llama.model.rotary_emb.inv_freq)
    ids = torch.randint(0, 512, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        out = gm(ids, pos)
        ref = hf_llama(input_ids=ids, position_ids=pos).logits
    assert out.dtype == torch.bfloat16
    assert rel_rmse(out, ref) < 5e-2


def test_progress_bar_when_forced(capfd, exported_llama):
    ckpt = family_checkpoint("llama")
    capfd.readouterr()
    _load(exported_llama, ckpt)
    assert "loading weights" not in capfd.readouterr().err  # tiny checkpoint: below the threshold
    _load(exported_llama, ckpt, progress_threshold_mb=0)
    assert "loading weights" in capfd.readouterr().err
    # forced, as overrides={"load_weights": {"show_progress": True}} sets it in the pipeline
    _load(exported_llama, ckpt, show_progress=True)
    assert "loading weights" in capfd.readouterr().err
