"""``autodeploy serve --mode transformers``: the same server and engine over the HF module with
cached attention. The OpenAI client gets the greedy text the graph-mode build gives in process,
streamed and not, and the server stops cleanly on SIGTERM."""

import signal

import pytest
from autodeploy import SamplingParams

from serve_utils import MODEL, ServerProcess

PROMPT = "Hello there"


@pytest.fixture(scope="module")
def transformers_server():
    srv = ServerProcess("transformers", ["--mode", "transformers"]).start().wait_ready()
    yield srv
    srv.stop()


def test_completions_equal_the_graph_build_and_stream(transformers_server, llm):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    client = transformers_server.client()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == ref.text
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert "2 attention layers on the paged KV cache" in transformers_server.log_tail(100_000)


def test_sigterm_stops_the_server(transformers_server):
    transformers_server.proc.send_signal(signal.SIGTERM)
    assert transformers_server.proc.wait(timeout=30) == 0, transformers_server.log_tail()
