# The README's two commands. Both create .venv on first use and install everything.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# two worker processes (pytest-xdist), each taking whole test files so module fixtures are built
# once: 853 -> 691 s on the 2-core CI-sized machine (2026-11-27). PYTEST_ARGS="-q -m 'not slow and
# not gpu'" runs it in one process. Each worker runs torch on its share of the cores (tests/conftest.py);
# three workers measured slower than two (1023 vs 924 s, 2026-11-28, an AVX2-only 2-core EPYC).
# tests/serve is one work unit (tests/conftest.py), so its shared servers start once. 2026-11-29, AVX2-only
# 2-core EPYC, a fresh clone (empty .cache): 734.7 s. --durations lists the slowest tests at the end,
# for whoever has to cut the suite's time. `make install` leaves the `eval` extra (lm-eval) out.
PYTEST_ARGS ?= -q -m "not slow and not gpu" -n 2 --dist loadfile --durations=25

.PHONY: run test test-gpu install clean

install: $(STAMP)

# torch goes first and pinned, so that pip takes the CPU wheel instead of the newest CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/autodeploy run

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# the CUDA paths (tests marked gpu, tests/gpu): on a machine with a GPU; skipped without CUDA
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
