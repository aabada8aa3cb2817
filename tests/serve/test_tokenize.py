"""vLLM's ``POST /tokenize`` and ``/detokenize`` on the real server: the ids are those a
completion (text prompt) or a chat completion (messages) of the same input runs on, checked
through the usage the completion reports and the in-process tokenizer; errors are 400s and 404s
in OpenAI's shape (the API key guards them as it guards /v1: ``test_bad_input``, beside the
other API-key tests, whose server this file would otherwise start a second time)."""

import httpx
import pytest

from serve_utils import MAX_SEQ_LEN, SERVED_NAME
from test_bad_input import assert_error

TEXT = "The quick brown fox"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def _post(server, path, body, **kw):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def test_tokenize_a_prompt_as_a_completion_does(server, llm):
    out = _post(server, "/tokenize", {"model": SERVED_NAME, "prompt": TEXT}).json()
    ids = llm.tokenizer(TEXT)["input_ids"]
    assert out == {"count": len(ids), "max_model_len": MAX_SEQ_LEN, "tokens": ids}
    usage = _post(server, "/v1/completions", {"model": SERVED_NAME, "prompt": TEXT, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == out["count"]
    bare = _post(server, "/tokenize", {"model": SERVED_NAME, "prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == llm.tokenizer(TEXT, add_special_tokens=False)["input_ids"] != ids


def test_tokenize_messages_as_a_chat_completion_does(server, llm):
    out = _post(server, "/tokenize", {"model": SERVED_NAME, "messages": MSGS}).json()
    text = llm.tokenizer.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert out["tokens"] == llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    usage = _post(server, "/v1/chat/completions", {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 1}).json()
    assert usage["usage"]["prompt_tokens"] == out["count"]


def test_detokenize_gives_the_text_back(server, llm):
    ids = llm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert _post(server, "/detokenize", {"model": SERVED_NAME, "tokens": ids}).json() == {"prompt": TEXT}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": SERVED_NAME}, 400, "prompt"),
    ("/tokenize", {"model": SERVED_NAME, "prompt": "a", "messages": MSGS}, 400, "messages"),
    ("/tokenize", {"model": SERVED_NAME, "messages": []}, 400, "messages"),
    ("/tokenize", {"model": SERVED_NAME, "prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"model": SERVED_NAME, "tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"model": SERVED_NAME, "tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"model": SERVED_NAME, "tokens": "1 2"}, 400, "tokens"),
])
def test_bad_tokenize_requests(healthy, path, body, status, param):
    assert_error(_post(healthy, path, body), status, param=param)
