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

from typing import Optional


def xdsl_missing() -> Optional[str]:
    """None when xDSL imports, else the reason (for the transform's one skip line)."""
    try:
        import xdsl.dialects.linalg  # noqa: F401
    except ImportError as err:
        return f"xdsl is not installed ({err}); pip install xdsl==0.74.0"
    return None
