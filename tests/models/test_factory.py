"""ModelFactory: model sources (presets, directories, hub ids), safety refusals (remote code,
pickles), building on the meta device, the custom-model registry, config overrides and the
tokenizer. Every checkpoint here is a real one on disk (safetensors / torch.save + HF files)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from autodeploy.config import load_deploy_config
from autodeploy.models.checkpoint import find_checkpoint
from autodeploy.models.custom import custom_model_for, register_custom_model, unregister_custom_model
from autodeploy.models.factory import ModelFactory, resolve_source
from autodeploy.models.presets import PRESETS, write_random_checkpoint
from autodeploy.pipeline import build_graph
from autodeploy.utils.errors import AutoDeployError, ModelSourceError
from autodeploy.transform.interface import Stage
from autodeploy.transform.optimizer import build_transform
from helpers import build, family_checkpoint, rel_rmse

TINY_CFG = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=512,
                max_position_embeddings=128, tie_word_embeddings=False)


def _copy_without_weights(src: str, dst) -> str:
    """Copy config/tokenizer files of a checkpoint (not its weights) into ``dst``."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith((".safetensors", ".bin")) and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return str(dst)


def _config_up_to_weight_load(model: str):
    """The default deploy config with every stage after weight_load switched off."""
    cfg = load_deploy_config(model=model)
    transforms = {
        key: (raw if build_transform(key, raw).config.stage.order <= Stage.WEIGHT_LOAD.order
              else {**(raw or {}), "enabled": False})
        for key, raw in cfg.transforms.items()
    }
    return cfg.model_copy(update={"transforms": transforms})


def _ids(batch: int, seq: int, vocab: int = 512):
    ids = torch.randint(0, vocab, (batch, seq))
    return ids, torch.arange(seq).expand(batch, seq)


# ---- resolve_source ---------------------------------------------------------------------------


def test_preset_resolves_to_full_checkpoint_dir():
    d = resolve_source("tiny-llama")
    assert os.path.isdir(d)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(d, name)), name
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"
    # The preset's weights are a real safetensors file with the model's tensor names.
    tensors = load_file(os.path.join(d, "model.safetensors"))
    assert "model.embed_tokens.weight" in tensors and tensors["model.embed_tokens.weight"].shape == (512, 64)
    assert resolve_source("tiny-llama") == d  # cached, not re-materialised elsewhere


def test_existing_directory_resolves_to_abspath(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_source("ckpt") == str(tmp_path / "ckpt")
    assert resolve_source("./ckpt") == str(tmp_path / "ckpt")


def test_missing_absolute_path(tmp_path):
    missing = str(tmp_path / "no" / "such" / "dir")
    with pytest.raises(ModelSourceError, match="does not exist") as exc:
        resolve_source(missing)
    assert missing in str(exc.value)


def test_file_path_is_rejected(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ModelSourceError) as exc:
        resolve_source(str(f))
    msg = str(exc.value)
    assert "is a file" in msg and "directory" in msg


@pytest.mark.parametrize("source", ["not a model!", "tiny-llamma", "a/b/c"])
def test_neither_preset_nor_dir_nor_hub_id_lists_presets(source):
    with pytest.raises(ModelSourceError) as exc:
        resolve_source(source)
    msg = str(exc.value)
    assert source in msg and "preset" in msg
    for name in PRESETS:
        assert name in msg


def test_hub_id_offline_points_to_local_alternative():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    with pytest.raises(ModelSourceError) as exc:
        resolve_source("someorg/somemodel")
    msg = str(exc.value)
    assert "someorg/somemodel" in msg
    assert "hub" in msg.lower()
    assert "local checkpoint directory" in msg and "preset" in msg


def test_factory_dir_without_config_json(tmp_path):
    with pytest.raises(ModelSourceError, match="config.json"):
        ModelFactory(str(tmp_path)).config


def test_dir_without_weights(tmp_path):
    with pytest.raises(ModelSourceError, match="no weights found"):
        find_checkpoint(str(tmp_path))


# ---- presets are deterministic ------------------------------------------------------------------


def test_random_checkpoint_is_deterministic(tmp_path):
    a = write_random_checkpoint(TINY_CFG, str(tmp_path / "a"), seed=3)
    b = write_random_checkpoint(TINY_CFG, str(tmp_path / "b"), seed=3)
    c = write_random_checkpoint(TINY_CFG, str(tmp_path / "c"), seed=4)
    ta, tb, tc = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, c))
    assert ta.keys() == tb.keys() and len(ta) > 0
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    # The seed matters (otherwise the comparison above proves nothing).
    assert any(not torch.equal(ta[k], tc[k]) for k in ta if ta[k].dim() == 2)
    with open(os.path.join(a, "tokenizer.json"), "rb") as fa, open(os.path.join(b, "tokenizer.json"), "rb") as fb:
        assert fa.read() == fb.read()
    with open(os.path.join(a, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 1


# ---- trust_remote_code ----------------------------------------------------------------------------


def _remote_code_checkpoint(tmp_path) -> str:
    d = _copy_without_weights(family_checkpoint("llama"), tmp_path / "remote")
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["auto_map"] = {"AutoConfig": "configuration_foo.FooConfig",
                       "AutoModelForCausalLM": "modeling_foo.FooForCausalLM"}
    with open(path, "w") as f:
        json.dump(cfg, f)
    shutil.copy(os.path.join(family_checkpoint("llama"), "model.safetensors"), d)
    return d


def test_auto_map_is_refused_without_trust_remote_code(tmp_path):
    d = _remote_code_checkpoint(tmp_path)
    with pytest.raises(ModelSourceError) as exc:
        ModelFactory(d).config
    msg = str(exc.value)
    assert "auto_map" in msg and "trust_remote_code" in msg
    # the whole pipeline refuses too, before building anything
    with pytest.raises(ModelSourceError, match="trust_remote_code"):
        build(d)


def test_auto_map_with_trust_remote_code_is_not_refused(tmp_path):
    d = _remote_code_checkpoint(tmp_path)
    # There is no configuration_foo.py, so it may fail, but not with the refusal.
    try:
        ModelFactory(d, trust_remote_code=True).config
    except Exception as exc:  # noqa: BLE001
        assert "needs custom model code" not in str(exc)
        assert "Opt in with trust_remote_code" not in str(exc)


# ---- pickled weights ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_llama():
    return AutoModelForCausalLM.from_pretrained(family_checkpoint("llama"), dtype=torch.float32).eval()


def test_pickle_refused_unless_allowed_then_matches_hf(tmp_path, hf_llama):
    d = _copy_without_weights(family_checkpoint("llama"), tmp_path / "pickled")
    torch.save(hf_llama.state_dict(), os.path.join(d, "pytorch_model.bin"))

    with pytest.raises(ModelSourceError) as exc:
        find_checkpoint(d)
    msg = str(exc.value)
    assert "pytorch_model.bin" in msg and "allow_pickle" in msg
    with pytest.raises(ModelSourceError, match="allow_pickle"):
        ModelFactory(d).checkpoint_index()

    index = find_checkpoint(d, allow_pickle=True)
    assert index.format == "pickle"
    assert set(index.weight_map) == set(hf_llama.state_dict())

    gm = build(d, up_to=Stage.WEIGHT_LOAD, allow_pickle=True).graph
    ids, pos = _ids(2, 9)
    with torch.no_grad():
        ref = hf_llama(input_ids=ids, position_ids=pos).logits
        out = gm(ids, pos)
    assert out.shape == ref.shape
    assert rel_rmse(out, ref) < 1e-5


def test_safetensors_preferred_over_pickle(tmp_path, hf_llama):
    d = _copy_without_weights(family_checkpoint("llama"), tmp_path / "both")
    shutil.copy(os.path.join(family_checkpoint("llama"), "model.safetensors"), d)
    torch.save(hf_llama.state_dict(), os.path.join(d, "pytorch_model.bin"))
    index = find_checkpoint(d)  # no allow_pickle needed: the pickle is never touched
    assert index.format == "safetensors"
    assert all(p.endswith("model.safetensors") for p in index.files)


# ---- build_model ---------------------------------------------------------------------------------


def test_build_model_meta_params_real_initial_buffers(hf_llama):
    factory = ModelFactory(family_checkpoint("llama"))
    model = factory.build_model()
    params = list(model.named_parameters())
    assert params and all(p.is_meta for _, p in params)
    assert not model.training
    assert factory.tied_parameters == {}
    assert factory.base_model_prefix == "model"
    inv = factory.initial_buffers["model.rotary_emb.inv_freq"]
    assert not inv.is_meta and inv.dtype == torch.float32
    assert torch.isfinite(inv).all() and inv.abs().sum() > 0
    torch.testing.assert_close(inv, hf_llama.model.rotary_emb.inv_freq, rtol=0, atol=0)
    # The build reads no weights: the module's tensor names are the checkpoint's.
    assert {n for n, _ in params} == set(load_file(os.path.join(factory.directory, "model.safetensors")))


def test_build_model_records_tied_parameters():
    factory = ModelFactory(family_checkpoint("gemma"))
    model = factory.build_model()
    assert factory.tied_parameters == {"lm_head.weight": "model.embed_tokens.weight"}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.is_meta


def test_build_model_dtype():
    factory = ModelFactory(family_checkpoint("llama"))
    model = factory.build_model(dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.is_meta for p in model.parameters())
    assert factory.initial_buffers["model.rotary_emb.inv_freq"].dtype == torch.float32


# ---- custom model registry -----------------------------------------------------------------------


class TinyEmbedHead(nn.Module):
    """A lean model using the checkpoint's names for the embedding and head only."""

    built_with = None

    def __init__(self, config):
        super().__init__()
        TinyEmbedHead.built_with = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids=None, use_cache=False, **kwargs):
        return self.lm_head(self.model.embed_tokens(input_ids))


def test_custom_model_registry_builds_and_deploys():
    ckpt = family_checkpoint("llama")
    assert custom_model_for(ModelFactory(ckpt).config) is None
    register_custom_model("LlamaConfig")(TinyEmbedHead)
    try:
        factory = ModelFactory(ckpt)
        assert custom_model_for(factory.config) is TinyEmbedHead
        model = factory.build_model()
        assert isinstance(model, TinyEmbedHead)
        assert TinyEmbedHead.built_with is factory.config
        assert all(p.is_meta for p in model.parameters())
        assert {n for n, _ in model.named_parameters()} == {"model.embed_tokens.weight", "lm_head.weight"}

        # Through the whole pipeline: the graph is the custom model with the checkpoint's weights.
        result = build_graph(_config_up_to_weight_load(ckpt), factory=ModelFactory(ckpt), log_summary=False)
        weights = load_file(os.path.join(ckpt, "model.safetensors"))
        ids, pos = _ids(2, 5)
        with torch.no_grad():
            ref = weights["model.embed_tokens.weight"][ids] @ weights["lm_head.weight"].T
            out = result.graph(ids, pos)
        torch.testing.assert_close(out, ref)
    finally:
        unregister_custom_model("LlamaConfig")
    assert custom_model_for(ModelFactory(ckpt).config) is None
    assert not isinstance(ModelFactory(ckpt).build_model(), TinyEmbedHead)


# ---- model_kwargs ---------------------------------------------------------------------------------


def test_model_kwargs_override():
    ckpt = family_checkpoint("llama")
    factory = ModelFactory(ckpt, model_kwargs={"num_hidden_layers": 1})
    assert factory.config.num_hidden_layers == 1
    model = factory.build_model()
    assert len(model.model.layers) == 1
    assert len(ModelFactory(ckpt).build_model().model.layers) == 2


def test_model_kwargs_unknown_key():
    with pytest.raises(ModelSourceError) as exc:
        ModelFactory(family_checkpoint("llama"), model_kwargs={"num_hidden_layer": 1}).config
    msg = str(exc.value)
    assert "num_hidden_layer" in msg and "LlamaConfig" in msg
    assert isinstance(exc.value, AutoDeployError)


# ---- tokenizer -----------------------------------------------------------------------------------


def test_preset_tokenizer_roundtrip_bos_and_chat_template():
    factory = ModelFactory("tiny-llama")
    tok = factory.tokenizer()
    text = "Hello world, this is a test of the tokenizer."
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == factory.config.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert len(ids) > 2 and max(ids) < factory.vocab_size
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids).startswith(tok.bos_token)
    assert tok.eos_token_id == factory.config.eos_token_id == factory.generation_config()["eos_token_id"]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    encoded = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    chat_ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
    assert tok.convert_tokens_to_ids("<|assistant|>") in chat_ids
    assert tok.decode(chat_ids) .replace(tok.bos_token, "") == prompt


def test_tokenizer_source_missing(tmp_path):
    factory = ModelFactory("tiny-llama", tokenizer=str(tmp_path / "nothing-here"))
    with pytest.raises(ModelSourceError, match="tokenizer"):
        factory.tokenizer()
