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


def test_a_too_long_text_prompt_gets_one_error_and_no_transformers_warning(capfd, caplog):
    """The demo tokenizer's model_max_length is 512: tokenizing a longer prompt used to print
    transformers' own "Token indices sequence length is longer ..." warning before ours."""
    from autodeploy import InvalidRequestError

    llm = LLM("demo", max_seq_len=128)
    assert llm.tokenizer.model_max_length <= 2048  # the warning's precondition: a finite limit
    prompt = "word " * (llm.tokenizer.model_max_length + 50)
    capfd.readouterr()
    caplog.clear()
    with caplog.at_level("WARNING"):
        try:
            llm.generate([prompt], SamplingParams(max_tokens=2))
        except InvalidRequestError as exc:
            assert exc.code == "context_length_exceeded"
        else:
            raise AssertionError("a prompt longer than max_seq_len must be refused")
    # transformers logs through its own stderr handler (not propagated): look at both
    assert not [r for r in caplog.records if "Token indices sequence length" in r.getMessage()]
    assert "Token indices sequence length" not in capfd.readouterr().err
