#!/usr/bin/env python
"""End-to-end benchmark against HF eager and HF + torch.compile: ``autodeploy bench`` as a script.

    python benchmarks/bench_e2e.py                     # small preset, fp32, CPU, ~15 minutes on 2 cores
    python benchmarks/bench_e2e.py --model medium --rounds 2
    python benchmarks/bench_e2e.py --yaml my-variant.yaml   # also measure a pipeline variant
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autodeploy.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
