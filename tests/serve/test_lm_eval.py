"""EleutherAI's lm-evaluation-harness (``lm-eval``, its ``local-completions`` model) against a real
``autodeploy serve`` on loopback, its scores checked against HF eager's loglikelihoods.

lm-eval scores a (context, continuation) pair by sending the token ids of both as one prompt with
``echo: true, logprobs: 1, max_tokens: 1`` and summing ``token_logprobs[ctxlen:-1]``: the prompt
log-probabilities of the continuation. A server that leaves them out gets no error from lm-eval,
only a sum over an empty slice, 0.0: every choice equally likely (accuracy = the share of items
whose answer is listed first) and a perplexity of exactly 1. This test runs lm-eval itself, through
its Python API, on two tiny local tasks (``tests/data/lm_eval/``): a 14-item multiple-choice task
(acc, acc_norm) and a perplexity task (word/byte perplexity, bits per byte; one text is longer
than the context, so lm-eval scores it in rolling windows filling the whole context). It checks
every loglikelihood lm-eval logged, and the aggregate scores, against the same checkpoint in HF
transformers (eager attention, float32), fed exactly the token sequences lm-eval sends:

* a pair: ``tok(context)`` and the rest of ``tok(context + continuation)`` (trailing spaces of the
  context moved to the continuation), without BOS (lm-eval's ``add_bos_token`` is False);
* a rolling text: ``tok(text)`` without BOS, cut into windows of ``max_length - 2`` predicted
  tokens; the first window is conditioned on the BOS token alone (lm-eval's ``prefix_token_id``:
  the tokenizer's BOS, else EOS), each later one on the tokens just before it, so that every
  request fills the context (``max_length - 1`` prompt tokens + the 1 token lm-eval asks for).
"""

import importlib.util
import json
import math
import os
import re
from typing import List, Sequence, Tuple

import httpx
import pytest

from serve_utils import AUTODEPLOY, REPO, ServerProcess

# a mark, not importorskip at import: the default run deselects the slow test without a "skipped"
NEEDS_LM_EVAL = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="needs lm-eval: pip install -e '.[eval]' (not in dev: ~500 MB)")

DATA = os.path.join(REPO, "tests", "data", "lm_eval")
MC_TASK, PPL_TASK = "autodeploy_mc", "autodeploy_ppl"
MODEL = "demo"  # the bundled 4M-parameter Llama trained on Python's docs
MAX_SEQ_LEN = 128

# The server computes in float32 on CPU with a compiled graph: its logits agree with HF eager's to
# ~1e-5 relative (measured: loglikelihoods within 1.1e-5 per choice, 5.4e-5 on a 201-token text).
LL_TOL = dict(rel=1e-4, abs=2e-3)
PPL_REL = 1e-3
# Choices closer than this (in HF's loglikelihoods) would make the exact accuracy check flaky.
MIN_MARGIN = 1e-2


class DemoServer(ServerProcess):
    """``autodeploy serve --model demo`` (the other server tests use the random tiny-llama preset;
    scores of a model that knows something make a better check)."""

    def command(self) -> List[str]:
        return [AUTODEPLOY, "serve", "--model", MODEL, "--port", str(self.port), "--max_seq_len", str(MAX_SEQ_LEN)]

    @property
    def model(self) -> str:
        return MODEL


@pytest.fixture(scope="module")
def demo_server():
    """Started, not yet ready: the test loads lm-eval and the HF reference while it builds."""
    srv = DemoServer("lm-eval", []).start()
    try:
        yield srv
    finally:
        srv.stop()


def _read_jsonl(name: str) -> List[dict]:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- the reference: HF eager on exactly the token sequences lm-eval sends ---------------------
class HFScorer:
    def __init__(self, checkpoint: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(checkpoint)
        self.model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, attn_implementation="eager").eval()

    def encode(self, text: str) -> List[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        assert whole[:len(ctx)] == ctx, (context, continuation)
        return ctx, whole[len(ctx):]

    def score(self, ctx: Sequence[int], cont: Sequence[int]) -> Tuple[float, bool, float]:
        """log p(cont | ctx), whether cont is the greedy path, and the smallest gap on that path
        between the continuation's token and the best other token (an argmax near a tie)."""
        torch = self.torch
        ids = torch.tensor([list(ctx) + list(cont)])
        with torch.no_grad():
            logits = self.model(ids).logits[0].double()
        lp = torch.log_softmax(logits[len(ctx) - 1:-1], dim=-1)
        target = torch.tensor(list(cont))
        chosen = lp[torch.arange(len(cont)), target]
        others = lp.clone()
        others[torch.arange(len(cont)), target] = -math.inf
        gap = chosen - others.max(dim=-1).values
        return float(chosen.sum()), bool((gap > 0).all()), float(gap.abs().min())


def rolling_windows(tokens: List[int], prefix: int, window: int) -> List[Tuple[List[int], List[int]]]:
    """lm-eval's loglikelihood_rolling requests (get_rolling_token_windows with context_len=1,
    then make_disjoint_window) for a window of ``window`` predicted tokens."""
    first = min(window, len(tokens))
    out = [([prefix], tokens[:first])]
    done = first
    while done < len(tokens):
        k = min(len(tokens) - done, window)
        end = done + k
        out.append((tokens[end - window - 1:end - k], tokens[end - k:end]))
        done = end
    return out


# ---- the test ----------------------------------------------------------------------------------
@pytest.mark.slow  # 16 s; suite time: the completions and prompt-logprob contract it reads is tested in tests/serve and tests/runtime/test_prompt_logprobs.py
@NEEDS_LM_EVAL
def test_lm_eval_scores_match_hf(demo_server, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from autodeploy.models.presets import preset_dir

    checkpoint = preset_dir(MODEL)
    task_manager = TaskManager(include_path=DATA, include_defaults=False)
    hf = HFScorer(checkpoint)
    mc_docs, ppl_docs = _read_jsonl("mc.jsonl"), _read_jsonl("ppl.jsonl")

    srv = demo_server.wait_ready()
    models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    max_length = models[0]["max_model_len"]
    assert max_length == MAX_SEQ_LEN

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(base_url=f"{srv.url}/v1/completions", model=MODEL, tokenizer=checkpoint,
                        tokenizer_backend="huggingface", tokenized_requests=True,
                        # 4 prompts a request, 2 requests at a time: batched in the server's steps
                        batch_size=4, num_concurrent=2, max_retries=1, max_length=max_length, timeout=120),
        tasks=[MC_TASK, PPL_TASK], task_manager=task_manager, log_samples=True, bootstrap_iters=0)
    assert out is not None, srv.log_tail()
    results, samples = out["results"], out["samples"]
    assert srv.alive, srv.log_tail()

    # ---- multiple choice: every choice's loglikelihood, then acc / acc_norm ----
    mc = sorted(samples[MC_TASK], key=lambda s: s["doc_id"])
    assert len(mc) == len(mc_docs)
    acc, acc_norm, gold_first = [], [], []
    for s, doc in zip(mc, mc_docs):
        context = f"Question: {doc['question']}\nAnswer:"
        assert [tuple(a) for a in s["arguments"]] == [(context, " " + c) for c in doc["choices"]]
        got = [tuple(r) for r in s["filtered_resps"]]  # (loglikelihood, is_greedy) per choice
        ref = [hf.score(*hf.encode_pair(context, " " + c)) for c in doc["choices"]]
        for choice, (ll, greedy), (ref_ll, ref_greedy, gap) in zip(doc["choices"], got, ref):
            assert ll == pytest.approx(ref_ll, **LL_TOL), \
                f"{doc['question']!r} / {choice!r}: lm-eval got loglikelihood {ll}, HF {ref_ll}"
            if gap > MIN_MARGIN:  # is_greedy compares token_logprobs with top_logprobs
                assert greedy == ref_greedy, (doc["question"], choice, greedy, ref_greedy)
        ref_lls = [r[0] for r in ref]
        for lls in (ref_lls, [ll / len(c) for ll, c in zip(ref_lls, doc["choices"])]):
            top2 = sorted(lls)[-2:]
            assert top2[1] - top2[0] > MIN_MARGIN, f"near-tie in the data, the check could flake: {doc}"
        pred = max(range(len(ref_lls)), key=ref_lls.__getitem__)
        pred_norm = max(range(len(ref_lls)), key=lambda i: ref_lls[i] / len(doc["choices"][i]))
        acc.append(float(pred == doc["answer"]))
        acc_norm.append(float(pred_norm == doc["answer"]))
        gold_first.append(float(doc["answer"] == 0))
        assert s["acc"] == acc[-1] and s["acc_norm"] == acc_norm[-1], (doc, got, ref_lls)
    expected_acc, expected_acc_norm = sum(acc) / len(acc), sum(acc_norm) / len(acc_norm)
    # What lm-eval reports when every loglikelihood is 0.0 (no prompt logprobs): the data must
    # tell the two apart.
    degenerate = sum(gold_first) / len(gold_first)
    assert expected_acc != degenerate and expected_acc_norm != degenerate
    assert results[MC_TASK]["acc,none"] == pytest.approx(expected_acc, abs=1e-12)
    assert results[MC_TASK]["acc_norm,none"] == pytest.approx(expected_acc_norm, abs=1e-12)

    # ---- perplexity: each text's rolling loglikelihood, then the weighted perplexities ----
    ppl = sorted(samples[PPL_TASK], key=lambda s: s["doc_id"])
    assert len(ppl) == len(ppl_docs)
    prefix = hf.tok.bos_token_id if hf.tok.bos_token_id is not None else hf.tok.eos_token_id
    window = max_length - 2  # lm-eval: max_seq_len = (max_length - 1) - 1 predicted tokens
    total_ll = total_words = total_bytes = 0
    n_windows, full_context = [], False
    for s, doc in zip(ppl, ppl_docs):
        text = doc["text"]
        assert [tuple(a) for a in s["arguments"]] == [(text,)]
        windows = rolling_windows(hf.encode(text), prefix, window)
        assert all(len(c) + len(p) <= max_length - 1 for c, p in windows)
        n_windows.append(len(windows))
        full_context |= any(len(c) + len(p) == max_length - 1 for c, p in windows)
        ref_ll = sum(hf.score(c, p)[0] for c, p in windows)
        got = s["filtered_resps"][0]
        assert got == pytest.approx(ref_ll, **LL_TOL), \
            f"text {s['doc_id']} ({len(windows)} windows): lm-eval got loglikelihood {got}, HF {ref_ll}"
        total_ll += ref_ll
        total_words += len(re.split(r"\s+", text))
        total_bytes += len(text.encode("utf-8"))
    assert max(n_windows) >= 2, "the long text must span several rolling windows"
    assert full_context, "some request must fill the context (max_length - 1 prompt tokens + 1)"
    r = results[PPL_TASK]
    expected = {"word_perplexity": math.exp(-total_ll / total_words),
                "byte_perplexity": math.exp(-total_ll / total_bytes),
                "bits_per_byte": -total_ll / total_bytes / math.log(2)}
    assert expected["byte_perplexity"] > 1.5  # not the 1.0 of missing prompt logprobs
    for name, value in expected.items():
        assert r[f"{name},none"] == pytest.approx(value, rel=PPL_REL), (name, r, expected)
