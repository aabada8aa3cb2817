"""Element-wise fusion through MLIR (xDSL): FX subgraph -> ``linalg.generic`` -> C++ kernel.

``partition`` finds the maximal fusible element-wise subgraphs of an FX graph (no xDSL needed);
``lower`` turns one into an xDSL module, decomposing high-level aten ops into arith/math
primitives; ``cpp`` emits the C++ (OpenMP + SIMD) kernel of that module; ``kernels`` compiles
it once per source into an on-disk cache and provides ``autodeploy::cpu_fused_elementwise``,
the op that runs it. The transform ``mlir_elementwise_fusion`` ties them together.

xDSL is a dependency of autodeploy, but an install without it (``--no-deps``) still works:
``xdsl_missing()`` says why it cannot be imported, and the modules that need it are imported
only after that check.
"""

import os
from typing import List, Optional

from torch import fx

# The fused ops and the file of their kernel directory that the kernel is (re)built from.
_KERNEL_SOURCES = {"autodeploy::cpu_fused_elementwise": "kernel.cpp", "autodeploy::triton_fused_elementwise": "kernel.py"}


def xdsl_missing() -> Optional[str]:
    """None when xDSL imports, else the reason (for the transform's one skip line)."""
    try:
        import xdsl.dialects.linalg  # noqa: F401
    except ImportError as err:
        return f"xdsl is not installed ({err}); pip install xdsl==0.74.0"
    return None


def missing_kernels(graph: fx.Graph) -> List[str]:
    """The generated-kernel directories the fused ops of ``graph`` name whose source or metadata
    is gone (e.g. the kernel cache was cleaned): a graph with any cannot run. The build cache
    checks this before it reuses a stored graph."""
    missing = []
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        source = _KERNEL_SOURCES.get(getattr(schema, "name", ""))
        if source is None:
            continue
        directory = node.args[1]
        if not all(os.path.exists(os.path.join(directory, f)) for f in (source, "kernel.json")):
            missing.append(directory)
    return missing
