"""Graceful shutdown: SIGTERM while a stream is in flight lets it finish ([DONE], all its
tokens), then the process exits with status 0 within --shutdown-timeout.

Runs on the second server (``aux_server``) and stops it; keep this module last among the
users of that server (a later user gets a fresh one, at the cost of a restart)."""

import signal
import time

import httpx
import pytest

from serve_utils import LONG_PROMPT, MODEL, SHUTDOWN_TIMEOUT, json_events, read_events, sse_events

N, MAX_TOKENS = 16, 30  # 16 choices of 30 tokens: two batches of 8, well over 0.1 s of work


@pytest.fixture(scope="module")
def shutdown_run(aux_server):
    srv = aux_server
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": MAX_TOKENS, "n": N, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    result = {"events": [], "in_flight_at_signal": None, "error": None}
    with httpx.Client(timeout=60, headers=srv.headers()) as http:
        with http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            result["status"] = r.status_code
            lines = r.iter_lines()
            result["events"] = read_events(lines, 2)
            result["in_flight_at_signal"] = httpx.get(f"{srv.url}/health", timeout=5).json()["in_flight"]
            srv.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            try:
                for line in lines:
                    result["events"] += sse_events([line])
            except httpx.HTTPError as exc:  # the stream was cut
                result["error"] = exc
    try:
        result["returncode"] = srv.proc.wait(timeout=SHUTDOWN_TIMEOUT + 15)
    except Exception:  # noqa: BLE001 - reported by the test
        result["returncode"] = None
    result["exit_after_s"] = time.monotonic() - t0
    result["log"] = srv.log_tail()
    srv.stop()
    return result


def test_sigterm_lets_inflight_stream_finish(shutdown_run):
    res = shutdown_run
    assert res["status"] == 200
    assert res["in_flight_at_signal"] >= 1, "the request had finished before the signal; nothing was tested"
    assert res["error"] is None, res["error"]
    events = res["events"]
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = json_events(events)
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
    finishes = {}
    for ch in chunks:
        for c in ch["choices"]:
            if c["finish_reason"] is not None:
                finishes.setdefault(c["index"], c["finish_reason"])
    assert sorted(finishes) == list(range(N))
    assert set(finishes.values()) == {"length"}
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == N * MAX_TOKENS


def test_sigterm_process_exits_in_time(shutdown_run):
    res = shutdown_run
    assert res["returncode"] is not None, f"still running {SHUTDOWN_TIMEOUT + 15}s after SIGTERM:\n{res['log']}"
    assert res["exit_after_s"] < SHUTDOWN_TIMEOUT + 5
    assert "Traceback" not in res["log"], res["log"]


def test_sigterm_exit_status_zero(shutdown_run):
    res = shutdown_run
    assert res["returncode"] == 0, f"exit status {res['returncode']}:\n{res['log'][-500:]}"
