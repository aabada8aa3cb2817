"""The shutdown contract of ``autodeploy serve`` (README, "Serving"), on a real server process:
after SIGTERM the server keeps listening and answers new API requests with a 503 while the
requests in flight drain; a stream still running when ``--shutdown-timeout`` runs out ends with
an error event in OpenAI's shape and ``[DONE]`` (not a cut connection), a non-streamed request
gets an error response; the process exits with status 0 and logs no traceback.

Its own server (``--shutdown-timeout 3``), started by this module and stopped by it: the
signal ends it. ``test_shutdown`` covers the other half (a stream that finishes in time)."""

import json
import signal
import threading
import time

import httpx
import pytest

from serve_utils import LONG_PROMPT, MODEL, ServerProcess, json_events, read_events, sse_events

SHUTDOWN_TIMEOUT = 3.0
# A stream far longer than the timeout: 40 prompts run one after another, each 16 choices of 100
# tokens (two batches of 8): thousands of engine steps, minutes of work even on a fast machine.
LONG_BODY = {"model": MODEL, "prompt": [LONG_PROMPT] * 40, "max_tokens": 100, "n": 16, "temperature": 0}
LONG_CHOICES = 40 * 16  # more than the default --max-choices-per-request: these servers allow it


@pytest.fixture(scope="module")
def drained():
    """Start a server, start a long stream and a long plain request, SIGTERM the server, try new
    requests while it drains, and record how everything ended."""
    srv = ServerProcess("shutdown-contract", ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                                               "--max-choices-per-request", str(LONG_CHOICES)]).start()
    try:
        srv.wait_ready()
        result = _drain(srv)
    finally:
        srv.stop()
    return result


def _drain(srv: ServerProcess) -> dict:
    result: dict = {"events": [], "stream_error": None, "plain": None, "new": [], "new_errors": []}

    def plain_request() -> None:  # a non-streamed request in flight at the signal
        try:
            r = httpx.post(f"{srv.url}/v1/completions", json=LONG_BODY, timeout=120)
            result["plain"] = (r.status_code, r.text)
        except httpx.HTTPError as exc:
            result["plain"] = exc

    plain = threading.Thread(target=plain_request, daemon=True)
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{srv.url}/v1/completions", json={**LONG_BODY, "stream": True}) as r:
            result["status"] = r.status_code
            lines = r.iter_lines()
            result["events"] = read_events(lines, 2)
            plain.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and httpx.get(f"{srv.url}/health", timeout=5).json()["in_flight"] < 2:
                time.sleep(0.05)
            result["in_flight_at_signal"] = httpx.get(f"{srv.url}/health", timeout=5).json()["in_flight"]
            srv.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            time.sleep(0.3)  # the signal is handled within a tick of the server's loop
            # new requests while the two drain: each on a new connection (the listener is still open)
            for _ in range(3):
                try:
                    r_new = httpx.post(f"{srv.url}/v1/completions", timeout=10,
                                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
                    result["new"].append((r_new.status_code, r_new.json()))
                except (httpx.HTTPError, ValueError) as exc:
                    result["new_errors"].append(repr(exc))
                time.sleep(0.2)
            try:
                for line in lines:
                    result["events"] += sse_events([line])
            except httpx.HTTPError as exc:  # the stream was cut without an ending
                result["stream_error"] = repr(exc)
            result["stream_ended_after_s"] = time.monotonic() - t0
    plain.join(timeout=SHUTDOWN_TIMEOUT + 30)
    try:
        result["returncode"] = srv.proc.wait(timeout=SHUTDOWN_TIMEOUT + 30)
    except Exception:  # noqa: BLE001 - reported by the test
        result["returncode"] = None
    result["exit_after_s"] = time.monotonic() - t0
    result["log"] = srv.log_tail(20000)
    return result


def test_new_requests_get_503_while_draining(drained):
    assert drained["status"] == 200
    assert drained["in_flight_at_signal"] >= 2, "the requests had finished before the signal; nothing was tested"
    assert not drained["new_errors"], f"new requests were not answered: {drained['new_errors']}"
    assert drained["new"], "no new request was tried"
    for status, body in drained["new"]:
        assert status == 503, (status, body)
        assert body["error"]["type"] == "server_error" and "shutting down" in body["error"]["message"], body


def test_stream_cut_by_the_timeout_ends_with_error_event_and_done(drained):
    assert drained["stream_error"] is None, f"the stream broke off: {drained['stream_error']}"
    events = drained["events"]
    assert events and events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert set(last) == {"error"}, last
    assert last["error"]["message"] and last["error"]["type"] == "server_error", last
    assert "shut" in last["error"]["message"], last
    # the cut came at the timeout, not at once and not at the end of the work
    assert SHUTDOWN_TIMEOUT - 0.5 <= drained["stream_ended_after_s"] < SHUTDOWN_TIMEOUT + 10
    assert [c for c in json_events(events[:-2]) if "error" in c] == []


def test_plain_request_cut_by_the_timeout_gets_an_error_response(drained):
    plain = drained["plain"]
    assert not isinstance(plain, BaseException) and plain is not None, f"the plain request got no answer: {plain!r}"
    status, text = plain
    assert status == 503, (status, text)
    assert "shut" in json.loads(text)["error"]["message"]


def test_exit_status_zero_without_traceback(drained):
    assert drained["returncode"] == 0, f"exit status {drained['returncode']}:\n{drained['log'][-3000:]}"
    assert drained["exit_after_s"] < SHUTDOWN_TIMEOUT + 15
    log = drained["log"]
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


@pytest.mark.slow  # ~9 s, a server of its own; SIGTERM's drain (the fixture above) runs by default
def test_sigint_drains_too_and_a_second_signal_cuts_at_once():
    """Ctrl+C is a graceful shutdown as well (503s, then exit 0); a second one does not wait out
    a long --shutdown-timeout: the stream is cut at once, still with its error event and [DONE]."""
    srv = ServerProcess("shutdown-sigint", ["--shutdown-timeout", "120", "--max-choices-per-request",
                                               str(LONG_CHOICES)]).start()
    try:
        srv.wait_ready()
        events, new_status = [], None
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", f"{srv.url}/v1/completions", json={**LONG_BODY, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                events = read_events(lines, 2)
                srv.proc.send_signal(signal.SIGINT)
                time.sleep(0.3)
                new_status = httpx.post(f"{srv.url}/v1/completions", timeout=10,
                                        json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code
                srv.proc.send_signal(signal.SIGINT)
                t0 = time.monotonic()
                events += sse_events(lines)
                cut_after = time.monotonic() - t0
        returncode = srv.proc.wait(timeout=30)
        log = srv.log_tail(20000)
    finally:
        srv.stop()
    assert new_status == 503
    assert cut_after < 10, cut_after
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
