"""A model with state caches behind the server (Mamba2, the coverage sweep's tiny checkpoint):
prefix caching resumes it from copies of its state, and ``/metrics`` counts those copies.

Three prompts share a 40-token head (two whole 16-token pages): the first leaves the pages, the
second finds them without a copy of the state, computes the head again and leaves a copy after
page 2, the third resumes from that copy. The copies counter fails with the metric unwired, and
the hit tokens with prefix caching off for state models.
"""

import httpx
import pytest

from helpers import coverage_checkpoint
from serve_utils import ServerProcess

NAME = "mamba2-tiny"
PAGE = 16  # the server's default page_size


@pytest.fixture(scope="module")
def state_server():
    path, vocab = coverage_checkpoint("mamba2")
    srv = ServerProcess("state", ["--model", path, "--served-model-name", NAME]).start().wait_ready()
    srv.vocab = vocab
    yield srv
    srv.stop()


def _copies(metrics, op):
    return metrics[f'autodeploy_prefix_cache_state_copies_total{{op="{op}"}}']


def test_state_copies_are_counted_and_resumed_prompts_hit(state_server):
    head = [(7 * i) % (state_server.vocab - 3) + 3 for i in range(40)]
    before = state_server.wait_idle()
    for tail in ([5, 6], [7], [8, 9, 10]):
        r = httpx.post(f"{state_server.url}/v1/completions", timeout=60, json={
            "model": NAME, "prompt": head + tail, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
    after = state_server.wait_idle()
    # saved: where the second prompt parted from the first, and each request's final state (its
    # next turn would resume there)
    assert (_copies(after, "saved") - _copies(before, "saved"), _copies(after, "restored") -
            _copies(before, "restored")) == (1 + 3, 1)
    hit = after["autodeploy_prefix_cache_hit_tokens_total"] - before["autodeploy_prefix_cache_hit_tokens_total"]
    assert hit == 2 * PAGE  # the third prompt's head, from the copy; the second one computed it again


def test_ignore_eos_generates_past_the_end_of_sequence(state_server):
    """vLLM's ``ignore_eos`` extension: a prompt whose greedy answer ends early (found among 64 on
    this tiny checkpoint: its 512-token vocabulary makes the EOS token likely enough) runs to
    ``max_tokens`` with it."""
    prompts = [[3 + (11 * i + 5 * j) % (state_server.vocab - 3) for j in range(6)] for i in range(64)]
    body = {"model": NAME, "prompt": prompts, "max_tokens": 24, "temperature": 0}
    choices = httpx.post(f"{state_server.url}/v1/completions", timeout=120, json=body).json()["choices"]
    ended = [c["index"] for c in choices if c["finish_reason"] == "stop"]
    assert ended, "no prompt of 64 ends before 24 tokens on this checkpoint: choose others"
    r = httpx.post(f"{state_server.url}/v1/completions", timeout=60,
                   json={**body, "prompt": prompts[ended[0]], "ignore_eos": True}).json()
    assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("length", 24)
