"""``trust_remote_code``: a checkpoint whose config.json ``auto_map`` names its own modeling code
is built, exported and served with that code's class (and refused without the opt-in).

The checkpoints are real: the tiny-llama preset's safetensors weights and tokenizer, plus a
``configuration_mymodel.py`` / ``modeling_mymodel.py`` pair in the directory. The remote class
is a Llama whose logits are multiplied by ``SIGN``: with ``SIGN = -1`` greedy decoding picks the
least likely token of the stock model, so which class ran shows in the generated tokens.
"""

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from autodeploy import LLM
from autodeploy.cli import main
from autodeploy.models.factory import ModelFactory
from autodeploy.models.presets import preset_dir
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.utils.errors import ModelSourceError

PROMPT = [5, 17, 99, 3, 42]
NEW_TOKENS = 8
REMOTE_CLASS = "modeling_mymodel.MyModelForCausalLM"

CONFIGURATION_PY = '''
from transformers import LlamaConfig


class MyConfig(LlamaConfig):
    model_type = "mymodel"
'''

MODELING_PY = '''
from transformers import LlamaForCausalLM

from .configuration_mymodel import MyConfig


class MyModelForCausalLM(LlamaForCausalLM):
    config_class = MyConfig
    SIGN = {sign}

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.SIGN
        return out
'''


def remote_checkpoint(directory, sign: float = -1.0, modeling_file: str = "modeling_mymodel") -> str:
    """tiny-llama's weights and tokenizer with config.json's auto_map naming the directory's own code."""
    directory = str(directory)
    shutil.copytree(preset_dir("tiny-llama"), directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(model_type="mymodel", architectures=["MyModelForCausalLM"],
               auto_map={"AutoConfig": "configuration_mymodel.MyConfig",
                         "AutoModelForCausalLM": f"{modeling_file}.MyModelForCausalLM"})
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(directory, "configuration_mymodel.py"), "w") as f:
        f.write(CONFIGURATION_PY)
    with open(os.path.join(directory, "modeling_mymodel.py"), "w") as f:
        f.write(MODELING_PY.format(sign=sign))
    return directory


def greedy(model: torch.nn.Module) -> list:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def remote_eager(directory: str) -> torch.nn.Module:
    """The directory's own class, loaded eagerly straight from its modeling file (by content,
    not through transformers' auto-class registry)."""
    cls = get_class_from_dynamic_module(REMOTE_CLASS, directory)
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def engine_greedy(directory: str) -> list:
    llm = LLM(directory, trust_remote_code=True, max_seq_len=64, max_batch_size=2)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def stock_tokens():
    stock = AutoModelForCausalLM.from_pretrained(preset_dir("tiny-llama"), dtype=torch.float32).eval()
    return greedy(stock)


def test_remote_class_is_built_and_served(tmp_path, stock_tokens):
    d = remote_checkpoint(tmp_path / "ckpt")
    model = ModelFactory(d, trust_remote_code=True).build_model()
    assert type(model).__name__ == "MyModelForCausalLM" and type(model).SIGN == -1.0
    expected = greedy(remote_eager(d))
    assert expected != stock_tokens, "the remote class must differ detectably from the stock one"
    assert engine_greedy(d) == expected


def test_each_checkpoint_gets_its_own_modeling_code(tmp_path, stock_tokens):
    """Two checkpoints whose configuration code is identical (same file, same directory name:
    transformers then gives them one config class) but whose modeling code differs, built in one
    process: each runs its own class. transformers' auto-class registry maps the shared config
    class to the class built first, so ``AutoModelForCausalLM.from_config`` would build the first
    checkpoint's class for the second without ever importing its modeling file."""
    first = remote_checkpoint(tmp_path / "a" / "ckpt", sign=1.0)
    second = remote_checkpoint(tmp_path / "b" / "ckpt", sign=-1.0)
    assert engine_greedy(first) == greedy(remote_eager(first)) == stock_tokens
    model = ModelFactory(second, trust_remote_code=True).build_model()
    assert type(model).SIGN == -1.0, "the second checkpoint was built with the first one's modeling code"
    expected = greedy(remote_eager(second))
    assert expected != stock_tokens
    assert engine_greedy(second) == expected


def test_refused_without_the_opt_in(tmp_path, capsys):
    d = remote_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ModelSourceError, match="trust_remote_code"):
        ModelFactory(d).build_model()
    assert main(["export", "--model", d]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autodeploy: error:") and "--trust-remote-code" in err


def test_missing_modeling_file_is_a_user_error(tmp_path, capsys):
    d = remote_checkpoint(tmp_path / "ckpt", modeling_file="modeling_absent")
    assert main(["export", "--model", d, "--trust-remote-code", "--max_seq_len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autodeploy: error:") and "modeling_absent" in err, err
    assert len(err.splitlines()) == 1
