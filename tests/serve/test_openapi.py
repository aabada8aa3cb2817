"""The published OpenAPI schema is true: Schemathesis (an outside OpenAPI fuzzer) runs against
the live ``autodeploy serve`` on loopback and finds no 5xx, no response that breaks the schema
(JSON bodies and every server-sent event of a stream), no undocumented status code, no invalid
request accepted, and a 405 with an ``Allow`` header for a wrong method.

Left out on purpose: ``positive_data_acceptance``. A few rules span two fields (``best_of`` must
equal ``n``; ``top_logprobs`` needs ``logprobs``; ``max_tokens`` plus the prompt must fit the
context), which JSON Schema does not express, so a schema-valid body can still be a 400; the
schema's descriptions say so.
"""

import json
import os
import subprocess
import sys

import httpx

from serve_utils import SERVED_NAME

ST = os.path.join(os.path.dirname(sys.executable), "st")
CHECKS = ["not_a_server_error", "response_schema_conformance", "status_code_conformance", "unsupported_method",
          "allow_header_conformance", "negative_data_rejection"]
# Fixed, so that CI is reproducible; set AUTODEPLOY_SCHEMATHESIS_SEED to explore other examples.
SEED = int(os.environ.get("AUTODEPLOY_SCHEMATHESIS_SEED", "20261124"))
MAX_EXAMPLES = int(os.environ.get("AUTODEPLOY_SCHEMATHESIS_EXAMPLES", "30"))


# A body over --max-request-bytes (4 KiB on this server) is refused with 413 before it is parsed,
# valid or not: for an invalid body that is a rejection too.
CONFIG = """
[checks.negative_data_rejection]
expected-statuses = [400, 401, 404, 405, 406, 413, 415]
"""


def _schemathesis(location, base_url, workdir, *extra):
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    cmd = [ST, "--config-file", str(config), "run", location, "--checks", ",".join(CHECKS), "--max-examples", str(MAX_EXAMPLES),
           "--seed", str(SEED), "--workers", "1", "--request-timeout", "60", "--no-color",
           "--generation-database", "none", *extra]
    if not location.startswith("http"):
        cmd += ["--url", base_url]
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)


def test_schema_is_published(server):
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    ops = {(path, method) for path, item in schema["paths"].items() for method in item}
    assert ops == {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                   ("/health", "get"), ("/metrics", "get"), ("/tokenize", "post"), ("/detokenize", "post")}
    for path in ("/tokenize", "/detokenize"):
        op = schema["paths"][path]["post"]
        assert set(op["responses"]) == {"200", "400", "401", "404", "413", "503"}
        assert op["requestBody"]["content"]["application/json"]["example"]["model"] == SERVED_NAME
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = schema["paths"][path]["post"]
        assert set(op["responses"]) == {"200", "400", "401", "404", "413", "503"}  # no FastAPI 422
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert op["requestBody"]["content"]["application/json"]["example"]["model"] == SERVED_NAME
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components
    # parameters rejected on purpose are visible as such
    assert components["ChatTool"]["properties"]["function"] == {"$ref": "#/components/schemas/FunctionDefinition"}
    assert "tool_calls" in components["AssistantMessage"]["properties"]
    assert components["CompletionRequest"]["properties"]["suffix"]["maxLength"] == 0


def test_wrong_method_is_405_with_allow(server):
    r = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_schemathesis_finds_nothing(server, tmp_path):
    proc = _schemathesis(f"{server.url}/openapi.json", server.url, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "No issues found" in out, out[-3000:]
    assert server.alive


def test_schemathesis_would_see_a_false_schema(server, tmp_path):
    """The suite can fail: against the same server, a schema that requires one more field of each
    whole response (and of each streamed chunk) is reported as violated."""
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    for name in ("CompletionResponse", "ChatCompletionResponse", "CompletionChunk", "ChatCompletionChunk"):
        component = schema["components"]["schemas"][name]
        component["properties"]["system_fingerprint"] = {"type": "string"}
        component["required"].append("system_fingerprint")
    path = tmp_path / "false-openapi.json"
    path.write_text(json.dumps(schema))
    proc = _schemathesis(str(path), server.url, tmp_path, "--include-path", "/v1/completions")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "system_fingerprint" in out and "violates schema" in out, out[-3000:]
