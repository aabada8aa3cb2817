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

# Each pytest-xdist worker gets its share of the cores (make test runs two workers on the 2-core
# machines, where two workers of two threads each oversubscribe them). Measured 2026-11-28 on an
# AVX2-only 2-core EPYC at one thread per worker: tests/runtime 157 -> 140 s, the whole suite
# 1015 -> 924 s. Processes the tests start (servers, CLI runs, ranks) get no OMP_NUM_THREADS from
# here; those that import this conftest inherit the worker count and so take the same share.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

# A test's own Python subprocess (it imports this conftest) keeps the no-op mutation of the
# pytest process that started it (see noop_mutation.py; only that plugin sets the variable).
if os.environ.get("_AUTODEPLOY_NOOP_ACTIVE"):
    import noop_mutation  # noqa: E402

    noop_mutation.install(noop_mutation.parse_keys(os.environ["_AUTODEPLOY_NOOP_ACTIVE"]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# ---- work units of `make test`'s two workers (--dist loadfile) --------------------------------
# The server tests share three `autodeploy serve` processes (tests/serve/conftest.py: main, aux,
# tight), which a worker starts the first time one of its tests asks. Scheduled by file, the files
# using them landed on both workers, and each started its own main and aux server (~15-20 s of CPU
# apiece on the 2-core machine). tests/serve is one work unit instead; every other file is its own.
SHARED_SCOPES = ("tests/serve/",)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: no error where xdist is not loaded
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((scope for scope in SHARED_SCOPES if path.startswith(scope)), path)

    return SharedServerScheduling(config, log)
