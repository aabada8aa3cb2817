"""The bundled demo model: loads from the committed checkpoint, speaks English about Python,
and our engine generates exactly HF's greedy tokens for it."""

import os

import torch
from transformers import AutoModelForCausalLM

from autodeploy import LLM, SamplingParams
from autodeploy.models.presets import preset_dir


def test_demo_checkpoint_is_small_and_complete():
    d = preset_dir("demo")
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert os.path.exists(os.path.join(d, name)), name
    assert os.path.getsize(os.path.join(d, "model.safetensors")) < 10 * 2**20


def test_demo_greedy_output_matches_hf_and_reads_as_english():
    llm = LLM("demo", max_seq_len=128)
    prompt = "The for statement"
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(preset_dir("demo"), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = llm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    ref = hf.generate(ids, max_new_tokens=40, do_sample=False, attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
    assert out.token_ids == ref.tolist()
    words = out.text.split()
    assert len(words) >= 20
    # English about Python: mostly plain words, and the vocabulary of the language reference
    assert sum(w.strip('".,()').isalpha() for w in words) / len(words) > 0.7
    assert any(w.strip('".,') in {"statement", "class", "function", "clause", "expression", "exception"} for w in words)
