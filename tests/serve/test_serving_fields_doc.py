"""``docs/serving_fields.md`` names every field the request models read and every vLLM extra the
server refuses, so the document cannot fall behind the server (a field added without a row fails
here). No server is started: the models are read directly."""

import re
from pathlib import Path

from autodeploy.serve.protocol import _UNSUPPORTED_EXTRAS, ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving_fields.md"


def _named() -> set:
    return set(re.findall(r"`([a-z_]+)`", DOC.read_text()))


def test_every_request_field_has_a_row():
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    missing = sorted(f for f in fields if f not in _named())
    assert not missing, f"docs/serving_fields.md does not name {missing}"


def test_every_refused_extra_is_named():
    missing = sorted(f for f in _UNSUPPORTED_EXTRAS if f not in _named())
    assert not missing, f"docs/serving_fields.md does not name the refused {missing}"
