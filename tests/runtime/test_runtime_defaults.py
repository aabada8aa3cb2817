"""The runtime's defaults as a new user meets them, on checkpoints written with plain
``save_pretrained`` (no tokenizer files, no autodeploy helpers).

Each test is one trap a user fell into: ``max_seq_len`` larger than the model's position table
(a crash inside the graph), a batch cap of 8 that split 32 prompts into four waves, a checkpoint
without tokenizer files that could not be loaded at all, and a top-level ``compile_backend`` that
silently overwrote the per-transform setting.
"""

import os

import pytest
import torch
import transformers

from autodeploy import LLM, InvalidRequestError, SamplingParams
from autodeploy.cache.limits import MIN_AUTO_BATCH_SIZE
from autodeploy.config import load_deploy_config
from autodeploy.utils.errors import ConfigError

POSITIONS = 256
SMALL = dict(vocab_size=512)

# One tiny config per family whose position table (or ALiBi length) is a hard limit.
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=POSITIONS, **SMALL),
    "gptj": lambda: transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=POSITIONS,
                                            **SMALL),
    "codegen": lambda: transformers.CodeGenConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=POSITIONS,
                                                  n_ctx=POSITIONS, **SMALL),
    "mpt": lambda: transformers.MptConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=POSITIONS, **SMALL),
    "opt": lambda: transformers.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                                          word_embed_proj_dim=64, max_position_embeddings=POSITIONS, **SMALL),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{family: directory}`` written by ``save_pretrained`` alone: config + safetensors, no tokenizer."""
    root = tmp_path_factory.mktemp("save_pretrained")
    out = {}
    for family, make in CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make())
        model.save_pretrained(root / family)
        out[family] = str(root / family)
    return out


def _hf_greedy(directory, prompt, new_tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ---- trap 1: max_seq_len comes from the model -------------------------------------------------------
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_default_max_seq_len_is_the_model_limit_and_the_table_end_is_reached(checkpoints, family):
    llm = LLM(checkpoints[family])
    assert llm.engine.max_seq_len == POSITIONS
    # a prompt that ends 6 positions before the table's end: generation runs to the last position
    prompt = [(7 * i) % 500 + 3 for i in range(POSITIONS - 6)]
    out = llm.generate([prompt], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 6  # stopped at max_seq_len, not at max_tokens
    assert out.token_ids == _hf_greedy(checkpoints[family], prompt, 6)


@pytest.mark.parametrize("family", ["gpt2", "mpt"])
def test_max_seq_len_above_the_model_limit_is_refused_naming_both(checkpoints, family):
    with pytest.raises(ConfigError) as err:
        LLM(checkpoints[family], max_seq_len=512)
    message = str(err.value)
    assert "512" in message and str(POSITIONS) in message


def test_max_seq_len_below_the_limit_is_kept(checkpoints):
    llm = LLM(checkpoints["gpt2"], max_seq_len=64)
    assert llm.engine.max_seq_len == 64


# ---- trap 2: the batch cap comes from the pool ------------------------------------------------------
def test_default_batch_cap_runs_32_prompts_in_one_wave(checkpoints):
    llm = LLM(checkpoints["gpt2"])
    assert llm.engine.scheduler.max_batch_size >= MIN_AUTO_BATCH_SIZE
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(32):
        llm.engine.add_request(llm.processor.prepare([3 + i, 4, 5], params))
    llm.engine.step()
    assert llm.engine.num_running == 32 and llm.engine.num_waiting == 0
    while llm.engine.has_unfinished():
        llm.engine.step()


def test_a_user_batch_cap_is_kept(checkpoints):
    llm = LLM(checkpoints["gpt2"], max_batch_size=3)
    assert llm.engine.scheduler.max_batch_size == 3


# ---- trap 3: no tokenizer files ---------------------------------------------------------------------
def test_a_checkpoint_without_tokenizer_files_serves_token_ids(checkpoints, caplog):
    directory = checkpoints["opt"]
    assert not any(name.startswith("tokenizer") for name in os.listdir(directory))
    llm = LLM(directory)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=5, temperature=0,
                                                                          ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.text == ""
    assert out.token_ids == _hf_greedy(directory, [5, 6, 7], 5)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate(["a text prompt"])
    with pytest.raises(InvalidRequestError, match="stop string"):
        llm.generate([[5, 6]], SamplingParams(stop=["x"]))


def test_skip_tokenizer_init_never_loads_the_tokenizer():
    llm = LLM("tiny-llama", skip_tokenizer_init=True, max_seq_len=64)
    assert llm.tokenizer is None
    out = llm.generate([[1, 5, 6]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text == ""
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init"):
        llm.generate(["The for statement"])


def test_the_tokenizer_loads_on_first_text_prompt():
    llm = LLM("tiny-llama", max_seq_len=64)
    assert llm.tokenizer_handle._tried is False  # building did not need it
    out = llm.generate(["The for statement"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert llm.tokenizer is not None and out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


# ---- trap 4: shortcuts never overwrite a transform setting ---------------------------------------------
def test_a_transform_backend_set_alone_is_kept():
    config = load_deploy_config(model="tiny-llama", overrides=["--transforms.compile_model.backend", "torch-compile"])
    assert config.transforms["compile_model"]["backend"] == "torch-compile"
    config = load_deploy_config(model="tiny-llama", overrides=["--transforms.insert_cached_attention.backend", "torch"])
    assert config.transforms["insert_cached_attention"]["backend"] == "torch"


def test_a_shortcut_set_alone_is_applied():
    config = load_deploy_config(model="tiny-llama", compile_backend="torch-compile", attn_backend="torch")
    assert config.transforms["compile_model"]["backend"] == "torch-compile"
    assert config.transforms["insert_cached_attention"]["backend"] == "torch"


def test_unset_shortcuts_leave_the_transform_defaults():
    config = load_deploy_config(model="tiny-llama")
    assert "backend" not in (config.transforms["compile_model"] or {})
    assert "backend" not in (config.transforms["insert_cached_attention"] or {})


def test_a_shortcut_and_its_transform_field_disagreeing_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="compile_backend.*transforms.compile_model.backend"):
        load_deploy_config(model="tiny-llama", compile_backend="torch-simple",
                           overrides=["--transforms.compile_model.backend", "torch-compile"])
    yaml_file = tmp_path / "a.yaml"
    yaml_file.write_text("attn_backend: sdpa\ntransforms:\n  insert_cached_attention:\n    backend: torch\n")
    with pytest.raises(ConfigError, match="attn_backend"):
        load_deploy_config([str(yaml_file)], model="tiny-llama")


def test_a_shortcut_and_its_transform_field_agreeing_is_fine():
    config = load_deploy_config(model="tiny-llama", compile_backend="torch-compile",
                                overrides=["--transforms.compile_model.backend", "torch-compile"])
    assert config.transforms["compile_model"]["backend"] == "torch-compile"


# ---- trap 5: the output text is built incrementally ---------------------------------------------------
class CountingTokenizer:
    """The real tokenizer, counting the token ids the engine asks it to decode."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.decoded_ids = 0

    def decode(self, ids, *args, **kwargs):
        self.decoded_ids += len(ids)
        return self._tokenizer.decode(ids, *args, **kwargs)

    def convert_ids_to_tokens(self, ids, *args, **kwargs):
        self.decoded_ids += len(ids) if isinstance(ids, list) else 1
        return self._tokenizer.convert_ids_to_tokens(ids, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self):
        return len(self._tokenizer)


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-llama")


def test_long_generation_text_is_exact_and_decoding_is_linear(tiny):
    real = tiny.tokenizer
    counting = CountingTokenizer(real)
    tiny.tokenizer_handle._tokenizer = counting
    try:
        n = 900
        out = tiny.generate(["The for statement"], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
    finally:
        tiny.tokenizer_handle._tokenizer = real
    assert len(out.token_ids) == n
    assert out.text == real.decode(out.token_ids, skip_special_tokens=True)
    # the old engine decoded the whole output at every token: n * (n + 1) / 2 = 405,450 ids here
    assert counting.decoded_ids <= 20 * n


def test_stop_string_spanning_a_token_boundary_cuts_exactly(tiny):
    params = dict(temperature=0, ignore_eos=True)
    full = tiny.generate(["The for statement"], SamplingParams(max_tokens=40, **params))[0]
    tok = tiny.tokenizer
    ends = [len(tok.decode(full.token_ids[:k], skip_special_tokens=True)) for k in range(1, 41)]
    # a stop string made of the last 2 characters of token k and the first 2 of token k + 1
    k = next(i for i in range(5, 39) if ends[i] - ends[i - 1] >= 2 and ends[i + 1] - ends[i] >= 2
             and full.text.find(full.text[ends[i] - 2: ends[i] + 2]) == ends[i] - 2)
    stop = full.text[ends[k] - 2: ends[k] + 2]
    out = tiny.generate(["The for statement"], SamplingParams(max_tokens=40, stop=[stop], **params))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: ends[k] - 2]
    assert out.token_ids == full.token_ids[: k + 2]  # stopped at the token that completed it
