"""How a chat request is rendered, on a server started with ``--chat_template`` (the tools
server; ``serve_utils.TOOLS_TEMPLATE``): the setting's template is the one used, and vLLM's
``chat_template_kwargs``, ``documents``, ``add_generation_prompt`` and ``continue_final_message``
reach it, for ``/tokenize`` and ``/v1/chat/completions`` alike (the ids equal the tokenizer's
``apply_chat_template`` with the same arguments, computed here); a request's own ``chat_template``
renders where the server trusts them (``--trust-request-chat-template``) and is a 400 elsewhere.
What cannot be rendered is a 400."""

import json

import httpx
import pytest
from transformers import AutoTokenizer

from autodeploy.models.presets import preset_dir

from serve_utils import MODEL, SERVED_NAME, TOOLS_TEMPLATE

MSGS = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, or"}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(preset_dir(MODEL))
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def _ids(tokenizer, messages, **kw):
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _post(server, path, body):
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


CASES = [
    pytest.param({}, {"add_generation_prompt": True}, id="default"),
    pytest.param({"chat_template_kwargs": {"greeting": "Hello there"}},
                 {"add_generation_prompt": True, "greeting": "Hello there"}, id="chat_template_kwargs"),
    pytest.param({"documents": [{"title": "Colours", "text": "..."}]},
                 {"add_generation_prompt": True, "documents": [{"title": "Colours", "text": "..."}]}, id="documents"),
    pytest.param({"add_generation_prompt": False}, {"add_generation_prompt": False}, id="no_generation_prompt"),
    pytest.param({"add_generation_prompt": False, "continue_final_message": True},
                 {"add_generation_prompt": False, "continue_final_message": True}, id="continue_final_message"),
]


@pytest.mark.parametrize("fields, kw", CASES)
def test_tokenize_and_chat_render_as_the_template_does(tools_server, tokenizer, fields, kw):
    expected = _ids(tokenizer, MSGS, **kw)
    r = _post(tools_server, "/tokenize", {"messages": MSGS, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected
    r = _post(tools_server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
    if fields:  # each field changes the prompt (so the test would see it ignored)
        assert expected != _ids(tokenizer, MSGS, add_generation_prompt=True)


def _streamed_content(server, body):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={"model": MODEL, **body, "stream": True},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


@pytest.mark.parametrize("last", ["assistant", "user"])
def test_echo_starts_the_answer_with_the_assistants_last_message(tools_server, last):
    """vLLM's chat ``echo`` (a 400 before): with the conversation ending on the assistant's
    message (continue_final_message), the answer starts with it; after a user's, nothing is added."""
    msgs = MSGS if last == "assistant" else MSGS[:1]
    render = {"add_generation_prompt": False, "continue_final_message": True} if last == "assistant" else {}
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0, **render}
    plain = _post(tools_server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = _post(tools_server, "/v1/chat/completions", {**body, "echo": True}).json()
    prefix = "Blue, or" if last == "assistant" else ""
    assert echoed["choices"][0]["message"]["content"] == prefix + plain
    assert _streamed_content(tools_server, {**body, "echo": True}) == prefix + plain


REQUEST_TEMPLATE = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")


def test_a_requests_own_template_renders_on_a_server_that_trusts_them(tools_server, tokenizer):
    """vLLM's ``chat_template`` with ``--trust-request-chat-template`` (the tools server has it):
    the request's template renders its conversation, ``/tokenize`` and chat alike."""
    expected = tokenizer(tokenizer.apply_chat_template(MSGS, tokenize=False, chat_template=REQUEST_TEMPLATE,
                                                       add_generation_prompt=True), add_special_tokens=False)
    assert tokenizer.decode(expected["input_ids"]).startswith("[USER] Name a colour.\n[ASSISTANT] Blue, or")
    r = _post(tools_server, "/tokenize", {"messages": MSGS, "chat_template": REQUEST_TEMPLATE})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected["input_ids"]
    r = _post(tools_server, "/v1/chat/completions",
              {"messages": MSGS, "max_tokens": 1, "chat_template": REQUEST_TEMPLATE})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(expected["input_ids"])
    r = _post(tools_server, "/tokenize", {"messages": MSGS})  # the next request: the server's own again
    assert r.json()["tokens"] == _ids(tokenizer, MSGS, add_generation_prompt=True)


def test_a_requests_own_template_is_a_400_on_a_server_that_does_not_trust_them(server):
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(f"{server.url}{path}", json={"model": SERVED_NAME, "messages": MSGS, "max_tokens": 1,
                                                     "chat_template": REQUEST_TEMPLATE}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"], r.text


def test_the_servers_chat_template_is_used(tools_server, tokenizer):
    r = _post(tools_server, "/tokenize", {"messages": MSGS[:1], "chat_template_kwargs": {"greeting": "Hi"}})
    assert tokenizer.decode(r.json()["tokens"]).startswith("Hi\n<|user|>")  # the preset's own has no greeting


@pytest.mark.parametrize("fields, param, words", [
    ({"chat_template_kwargs": {"greeting": "fail"}}, "messages", "no such greeting"),  # the template raises
    ({"continue_final_message": True}, "messages", "add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ({"chat_template": "{{ raise_exception('not this one') }}"}, "messages", "not this one"),
    ({"chat_template": "{% for m in messages %}{{ m.content }"}, "messages", "cannot render"),  # syntax error
])
def test_what_cannot_be_rendered_is_a_400(tools_server, fields, param, words):
    for path in ("/v1/chat/completions", "/tokenize"):
        r = _post(tools_server, path, {"messages": MSGS, "max_tokens": 1, **fields})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], (path, r.text)
