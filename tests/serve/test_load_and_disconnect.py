"""Many concurrent streams, and clients that go away mid-request: every request ends, nothing
leaks (KV pages, running sequences), and the server keeps serving."""

import asyncio
import time

import httpx
import openai
import pytest

from serve_utils import LONG_PROMPT, SERVED_NAME, read_events

N_REQUESTS = 64
ABORTED = 'autodeploy_requests_total{status="aborted"}'
COMPLETED = 'autodeploy_requests_total{status="completed"}'
REJECTED = 'autodeploy_requests_total{status="rejected"}'


# ---- load --------------------------------------------------------------------------------------
async def _one_stream(client: openai.AsyncOpenAI, i: int):
    stream = await client.completions.create(
        model=SERVED_NAME, prompt=f"Request number {i}: once upon a time", max_tokens=4 + i % 5,
        temperature=0 if i % 2 else 0.7, seed=i, stream=True, stream_options={"include_usage": True})
    text, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.text)
            if c.finish_reason is not None:
                assert finish is None, "two final chunks"
                finish = c.finish_reason
    return i, "".join(text), finish, usage


async def _load(server):
    client = server.async_client(timeout=120.0)
    try:
        return await asyncio.gather(*[_one_stream(client, i) for i in range(N_REQUESTS)], return_exceptions=True)
    finally:
        await client.close()


def test_64_concurrent_streams(server):
    before = server.wait_idle()
    results = asyncio.run(_load(server))
    errors = [r for r in results if isinstance(r, BaseException)]
    server_errors = [e for e in errors if isinstance(e, openai.APIStatusError) and e.status_code >= 500]
    assert not server_errors, server_errors[:3]
    assert not errors, errors[:3]
    done = [r for r in results if r[2] is not None]
    assert len(done) == N_REQUESTS
    for i, _text, finish, usage in done:
        assert finish in ("stop", "length")
        assert usage is not None and 1 <= usage.completion_tokens <= 4 + i % 5
        if finish == "length":
            assert usage.completion_tokens == 4 + i % 5
    after = server.wait_idle(timeout=5)
    assert after["autodeploy_kv_pages_used"] == 0
    assert after["autodeploy_requests_running"] == 0
    assert after["autodeploy_kv_pages_free"] == before["autodeploy_kv_pages_free"]
    assert after[COMPLETED] - before[COMPLETED] == N_REQUESTS
    assert after[ABORTED] == before[ABORTED]
    generated = sum(r[3].completion_tokens for r in done)
    assert after["autodeploy_generation_tokens_total"] - before["autodeploy_generation_tokens_total"] == generated


# ---- disconnect --------------------------------------------------------------------------------
def _wait_aborted(server, before, timeout=3.0):
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m[ABORTED] > before[ABORTED] and m["autodeploy_kv_pages_used"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _check_aborted(server, before, max_tokens):
    m = _wait_aborted(server, before)
    assert m["autodeploy_kv_pages_used"] == 0
    assert m[ABORTED] == before[ABORTED] + 1
    assert m.get(REJECTED, 0) == before.get(REJECTED, 0)  # one disconnect is counted once
    assert m[COMPLETED] == before[COMPLETED]
    # the server stopped generating for nobody
    assert m["autodeploy_generation_tokens_total"] - before["autodeploy_generation_tokens_total"] < max_tokens
    m = server.wait_idle(timeout=2)
    assert m["autodeploy_requests_running"] == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_disconnect_frees_pages(healthy, path):
    server = healthy
    before = server.wait_idle()
    body = {"model": SERVED_NAME, "max_tokens": 100, "temperature": 0, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = LONG_PROMPT
    else:
        body["messages"] = [{"role": "user", "content": LONG_PROMPT}]
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}{path}", json=body) as r:
            assert r.status_code == 200
            got = read_events(r.iter_lines(), 3)
        # leaving the block closes the response (and its connection) mid-stream
    assert "[DONE]" not in got
    _check_aborted(server, before, 100)


def test_non_stream_disconnect_frees_pages(healthy):
    server = healthy
    before = server.wait_idle()
    # 16 choices of 120 tokens (two batches of 8): about half a second of work on CPU, which the
    # client leaves after 0.1 s; the server notices within its 0.25 s poll, well before the end
    body = {"model": SERVED_NAME, "prompt": LONG_PROMPT, "max_tokens": 120, "n": 16, "temperature": 0}
    with httpx.Client(timeout=httpx.Timeout(30, read=0.1)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{server.url}/v1/completions", json=body)
    _check_aborted(server, before, 16 * 120)
    time.sleep(0.5)  # asyncio logs an unretrieved exception when the future is collected
    assert "never retrieved" not in server.log_text(), server.log_tail()
