"""Fixtures for the OpenAI-compatible server tests: real ``autodeploy serve`` processes on
loopback, the official ``openai`` client, raw ``httpx``, and an in-process ``LLM`` as reference.

Server processes are started as soon as collection shows a test needs them (so they load in
parallel with each other and with the reference model), and every process started here is
terminated at the end of the session, whatever happened.
"""

import os
import signal
from typing import Dict

import httpx
import pytest

from serve_utils import FIXTURE_OF, MAX_BATCH_SIZE, MAX_SEQ_LEN, MODEL, SERVER_ARGS, ServerProcess

# ---- process management ----------------------------------------------------------------------
_SERVERS: Dict[str, ServerProcess] = {}


def _get_server(name: str) -> ServerProcess:
    srv = _SERVERS.get(name)
    if srv is None or (srv.proc is not None and srv.proc.poll() is not None):
        if srv is not None:
            srv.stop()
        srv = ServerProcess(name, SERVER_ARGS[name]).start()
        _SERVERS[name] = srv
    return srv


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(session, config, items):
    """Start the servers the selected tests need right away, so they load in parallel. Not in a
    pytest-xdist worker: every worker collects every test but runs only some files, so each
    would start every server (``make test``'s two workers started six where three are used);
    there a server starts when a test first asks for it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    wanted = {FIXTURE_OF[f] for item in items for f in getattr(item, "fixturenames", ()) if f in FIXTURE_OF}
    for name in sorted(wanted):
        _get_server(name)


def pytest_sessionfinish(session, exitstatus):
    for srv in list(_SERVERS.values()):
        srv.stop()
    _SERVERS.clear()


def _kill_all_on_signal(signum, frame):  # e.g. the run is interrupted: leave no servers behind
    for srv in list(_SERVERS.values()):
        srv.stop()
    raise KeyboardInterrupt


if hasattr(signal, "SIGTERM"):
    try:
        signal.signal(signal.SIGTERM, _kill_all_on_signal)
    except ValueError:  # not the main thread
        pass


@pytest.fixture(scope="session")
def server():
    """The main server: --served-model-name tiny-served --max-request-bytes 4096."""
    srv = _get_server("main").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def aux_server():
    """The second server: --api-key secret --max-tokens-limit 32 --shutdown-timeout 20
    (``test_shutdown`` SIGTERMs it; it is restarted if a later test needs it again)."""
    return _get_server("aux").wait_ready()


@pytest.fixture(scope="module")
def tight_server():
    """A server with a KV pool of 12 pages (192 tokens), where concurrent requests preempt each
    other, and --max-choices-per-request 4."""
    return _get_server("tight").wait_ready()


@pytest.fixture(scope="module")
def tools_server():
    """A server with --tool-call-parser hermes, --max_seq_len 512 (room for the tools' text),
    --chat_template (serve_utils.TOOLS_TEMPLATE), --scheduling_policy priority and
    --trust-request-chat-template."""
    return _get_server("tools").wait_ready()


@pytest.fixture(scope="session")
def llm():
    """The reference: the same preset built in this process through the Python API."""
    from autodeploy import LLM

    return LLM(MODEL, max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH_SIZE)


@pytest.fixture
def healthy(server):
    """Use in tests that send bad input: the server must still serve a real request after."""
    yield server
    assert server.alive, server.log_tail()
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": server.model, "prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
