"""Shared fixtures. Presets and test checkpoints are real safetensors checkpoints on disk."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Materialised presets are reused across runs (and across CI steps) from the repo's cache dir.
os.environ.setdefault("AUTODEPLOY_CACHE", os.path.join(REPO, ".cache", "autodeploy"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# A test's own Python subprocess (it imports this conftest) keeps the no-op mutation of the
# pytest process that started it (see noop_mutation.py; only that plugin sets the variable).
if os.environ.get("_AUTODEPLOY_NOOP_ACTIVE"):
    import noop_mutation  # noqa: E402

    noop_mutation.install(noop_mutation.parse_keys(os.environ["_AUTODEPLOY_NOOP_ACTIVE"]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
