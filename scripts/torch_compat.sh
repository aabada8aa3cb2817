#!/usr/bin/env bash
# The default CPU suite under another torch than the pinned one, by default 2.11.0: the version of
# the lent GPU machines, whose sessions are short. Its PyPI wheel is a CUDA build (~4.6 GB with its
# CUDA libraries) that runs on a machine without a GPU, so differences of that torch show up here
# before a GPU session spends its minutes on them (2026-11-28: shape propagation specialised the
# sequence dim under 2.11; see graph_utils.run_shape_prop). The venv is made once, with the other
# packages at the versions of .venv; the repository is imported from the working tree.
#   scripts/torch_compat.sh [pytest args...]        e.g. scripts/torch_compat.sh tests/transforms
#   TORCH=2.12.0 scripts/torch_compat.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.11.0}
VENV=${VENV:-/tmp/venv-torch-$TORCH}
if [ ! -x "$VENV/bin/autodeploy" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "torch==$TORCH"
    .venv/bin/python -m pip freeze | grep -v -i -E '^(torch|triton|autodeploy|-e |nvidia|cuda)' > "$VENV/requirements.txt"
    "$VENV/bin/pip" install -q --no-deps -r "$VENV/requirements.txt"
    # the console script the CLI tests run (the package itself is imported from this tree)
    printf '#!%s\nimport sys\nfrom autodeploy.cli import main\nsys.exit(main())\n' "$VENV/bin/python" > "$VENV/bin/autodeploy"
    chmod +x "$VENV/bin/autodeploy"
fi
if [ $# -eq 0 ]; then
    set -- -m "not slow and not gpu" -n 2 --dist loadfile
fi
PYTHONPATH=$PWD exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
