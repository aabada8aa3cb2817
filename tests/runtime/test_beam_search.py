"""Beam search (``LLM.beam_search``, ``BeamSearchParams``) against HF transformers'
``generate(num_beams=k, num_return_sequences=k)`` on the same checkpoint (the trained ``demo``
preset): every returned hypothesis's tokens and score (its sum of log-probabilities over
``generated_length ** length_penalty``) equal HF's, best first. The preset's answers never reach
its EOS in 16 tokens, so a copy whose EOS is one of its most frequent tokens makes hypotheses end
at different lengths (where the length penalty reorders them); ``ignore_eos`` is HF without an EOS."""

import json
import shutil

import pytest
import torch

from autodeploy import LLM, InvalidRequestError, SamplingParams
from autodeploy.models.presets import preset_dir
from autodeploy.runtime.beam_search import BeamSearchParams
from helpers import hf_model

# the last two: an EOS among the 2k best continuations but not the first k, which HF does not finish
PROMPTS = ["def add(a, b):", "The for statement", "import os", "class Foo:", "Exceptions are raised when"]
NEW = 12
FREQUENT = 267  # a token the demo model writes often (" the"-like): the EOS of the copy
SETTINGS = dict(max_seq_len=64, max_batch_size=16, max_num_tokens=256, page_size=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(name, LLM, HF model) for the preset and for its copy whose EOS is a frequent token."""
    copy = tmp_path_factory.mktemp("demo-eos") / "demo"
    shutil.copytree(preset_dir("demo"), copy)
    for name in ("config.json", "generation_config.json"):
        path = copy / name
        data = json.loads(path.read_text())
        data["eos_token_id"] = FREQUENT
        path.write_text(json.dumps(data))
    return {"preset": (LLM("demo", **SETTINGS), hf_model(preset_dir("demo"))),
            "frequent-eos": (LLM(str(copy), **SETTINGS), hf_model(str(copy)))}


def _hf_beams(hf, ids, k, length_penalty, ignore_eos):
    kw = dict(num_beams=k, num_return_sequences=k, do_sample=False, max_new_tokens=NEW, length_penalty=length_penalty,
              early_stopping=False, output_scores=True, return_dict_in_generate=True)
    if ignore_eos:
        kw["eos_token_id"] = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), **kw)
    return out.sequences[:, len(ids):].tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("model, k, length_penalty, ignore_eos", [
    ("preset", 3, 1.0, False), ("frequent-eos", 3, 1.0, False), ("frequent-eos", 4, 0.0, False),
    ("frequent-eos", 2, 2.0, False), ("frequent-eos", 3, 1.0, True)])
def test_beams_equal_hf_num_beams(models, model, k, length_penalty, ignore_eos):
    llm, hf = models[model]
    params = BeamSearchParams(beam_width=k, max_tokens=NEW, length_penalty=length_penalty, ignore_eos=ignore_eos)
    outs = llm.beam_search(PROMPTS, params)
    lengths = set()
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        tokens, scores = _hf_beams(hf, ids, k, length_penalty, ignore_eos)
        assert len(out.sequences) == k
        for seq, want, score in zip(out.sequences, tokens, scores):
            assert seq.token_ids == want[:len(seq.token_ids)]
            assert seq.score == pytest.approx(score, abs=1e-4)
            assert seq.score == pytest.approx(seq.cum_logprob / len(seq.token_ids) ** length_penalty, rel=1e-6)
            assert seq.text == llm.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
            ends_on_eos = seq.token_ids[-1] in llm.engine.eos_token_ids and not ignore_eos
            assert seq.finish_reason == ("stop" if ends_on_eos else "length")
            assert ends_on_eos or len(seq.token_ids) == NEW
            lengths.add(len(seq.token_ids))
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    # the EOS path is exercised: hypotheses of several lengths (none with ignore_eos or the preset)
    assert (len(lengths) > 1) == (model == "frequent-eos" and not ignore_eos)


def test_beam_width_1_is_greedy(models):
    llm, _ = models["preset"]
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))[0]
    [out] = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=1, max_tokens=NEW, ignore_eos=True))
    assert out.sequences[0].token_ids == greedy.token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0), "beam_width must be an integer in"), (dict(beam_width=11), "at most 20"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be"),
    (dict(beam_width=2, length_penalty="x"), "length_penalty"),
])
def test_bad_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        BeamSearchParams(**kwargs)


def test_without_prefix_caching_the_same_beams_and_a_warning(models, caplog):
    """The search is the same without prefix caching (only slower: every step computes every beam's
    whole history), and says so."""
    llm, _ = models["preset"]
    plain = LLM("demo", **SETTINGS, enable_prefix_caching=False)
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    with caplog.at_level("WARNING"):
        [got] = plain.beam_search(PROMPTS[0], params)
    assert "without prefix caching" in caplog.text
    [want] = llm.beam_search(PROMPTS[0], params)
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in want.sequences]


def test_a_prompt_that_cannot_grow_is_refused_before_any_step(models):
    llm, _ = models["preset"]
    with pytest.raises(InvalidRequestError, match="prompt 1: .* do not fit in max_seq_len 64"):
        llm.beam_search([PROMPTS[0], {"prompt_token_ids": [5] * 60}], BeamSearchParams(beam_width=2, max_tokens=8))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("model_type", ["mamba2", "lfm2"])
def test_state_models_beams_equal_hf_and_resume_from_whole_tails(model_type):
    """Mamba2 (state caches only) and LFM2 (a convolution beside attention): each step's
    continuations go on from everything their beam computed, so they start from its whole tail
    (its last page copied, the copy of its final state restored; README "Prefix caching"). The
    hypotheses and scores equal HF's ``num_beams``. With that restore skipped Mamba2's differ (the
    tiny random LFM2 hardly feels its state, as in test_state_prefix_caching_sweep)."""
    from helpers import coverage_checkpoint

    path, vocab = coverage_checkpoint(model_type)
    llm = LLM(path, dtype="float32", max_seq_len=64, max_batch_size=8, page_size=4, max_num_tokens=64)
    ids = [3 + (17 * i) % (vocab - 3) for i in range(9)]
    k, new = 3, 8
    out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=k, max_tokens=new,
                                                                       ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf_model(path).generate(torch.tensor([ids]), num_beams=k, num_return_sequences=k, do_sample=False,
                                      max_new_tokens=new, early_stopping=False, output_scores=True,
                                      return_dict_in_generate=True, eos_token_id=None)
    assert [s.token_ids for s in out.sequences] == ref.sequences[:, len(ids):].tolist()
    assert [s.score for s in out.sequences] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
    assert llm.engine.pool.num_tail_hits > 0 and llm.engine.snapshots.num_restored > 0
