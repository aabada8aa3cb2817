#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it has its own torch, Triton and an older transformers, and
# no network): gathered here into .whl/ (git-ignored through .git/info/exclude) so that a device
# call carries them. On the GPU machine (python 3.12):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '.whl/' .git/info/exclude 2>/dev/null || echo '.whl/' >> .git/info/exclude
PY=${PY:-.venv/bin/python}
# pure Python: transformers (the version the tests pin), xdsl (mlir_elementwise_fusion) and their
# pure-Python dependencies the GPU image may lack
$PY -m pip download -q --no-deps -d .whl transformers==5.23.0 pydantic==2.14.3 annotated-types typing_extensions \
    typing-inspection xdsl==0.74.0 immutabledict ordered-set
# pydantic's compiled core for the GPU machine's python
CORE=$($PY -c "import importlib.metadata as m; print(m.version('pydantic-core'))")
$PY -m pip download -q --no-deps -d .whl --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 "pydantic-core==$CORE"
ls -1 .whl
