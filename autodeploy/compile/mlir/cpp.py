"""xDSL module (one ``linalg.generic`` over arith/math) -> C++ source of one CPU kernel.

The kernel's C ABI, the same for every subgraph: one array of int64 (one ctypes argument, no
argument conversion: at decode sizes the call's own cost is what fusing saves)::

    extern "C" void ad_ew_kernel(const int64_t* args);
    // args = [outer, inner, nthreads, input pointers..., output pointers...]

inputs are contiguous (float32, or bool for a ``where`` condition), outputs contiguous float32
of ``outer * inner`` elements each. The
loop nest comes from the generic's indexing maps: when every input is read through the full
view or as a scalar, one flat ``#pragma omp parallel for simd`` loop over ``outer * inner``;
when a row or column broadcast is read, ``omp parallel for`` over rows and ``omp simd`` over
the last dim, a row input indexed by ``i``, a column input by ``o``. Threads only for tensors
of at least ``PARALLEL_MIN`` elements (a decode step's vectors are far below: one core, no
fork/join).

Math: ``exp``, ``tanh`` and ``erf`` are inline polynomial versions that GCC vectorises (a libm
call per element does not vectorise without ``-ffast-math``, and ``-ffast-math`` in a shared
library can switch the whole process to flush-to-zero when it loads; glibc's ``erff`` measured
~130 ns per element); ``log`` and a general ``pow`` call libm (correct, scalar). ``sqrt`` is an instruction with ``-fno-math-errno``. ``maximumf``
and ``minimumf`` propagate NaN like torch's ``maximum``/``clamp``.
"""

import os
from typing import Dict, List

from xdsl.dialects.builtin import FloatAttr, IntegerType, ModuleOp
from xdsl.ir import SSAValue

from ...ops.native import SOURCE_DIR
from .kernels import SYMBOL
from .lower import generic_of, map_dims

PARALLEL_MIN = 1 << 15

with open(os.path.join(SOURCE_DIR, "vec_math.h")) as _f:
    # the native kernels' float helpers (ad_exp_clamped), embedded: the kernel source, and so its
    # cache key, then carries the header's text
    VEC_MATH = _f.read()

PRELUDE = r"""#include <stdint.h>
#include <math.h>  /* the C headers: <cmath> alone doubles the compile time of a kernel */
""" + VEC_MATH + r"""
/* exp(x) in float, ~2 ulp (ad_exp_clamped); x > 88.72 gives inf, x < -87.33 gives 0 (libm gives
 * denormals there), NaN stays NaN. */
static inline float ad_exp(float x) {
    const bool big = x > 88.7228391f, tiny = x < -87.3365479f;
    float y = ad_exp_clamped(x > 88.0f ? 88.0f : (x < -87.0f ? -87.0f : x));
    y = big ? INFINITY : (tiny ? 0.0f : y);
    return x != x ? x : y;
}

/* tanh: an odd Taylor polynomial below |x| = 0.25 (no cancellation), else
 * sign(x) (1 - e) / (1 + e) with e = exp(-2|x|). */
static inline float ad_tanh(float x) {
    const float a = fabsf(x);
    const float x2 = x * x;
    const float small = x * (1.0f + x2 * (-0.333333333f + x2 * (0.133333333f + x2 * (-0.0539682540f
                        + x2 * 0.0218694885f))));
    const float e = ad_exp(-2.0f * a);
    const float t = (1.0f - e) / (1.0f + e);
    const float big = x < 0.0f ? -t : t;
    return a < 0.25f ? small : big;
}

/* erf: an odd Taylor polynomial below |x| = 0.5, else Abramowitz-Stegun 7.1.26,
 * 1 - t (a1 + t (a2 + ...)) exp(-x^2), t = 1 / (1 + p |x|) (absolute error 1.5e-7, i.e. about
 * an ulp of the result there). glibc's erff costs ~130 ns per element here and does not vectorise. */
static inline float ad_erf(float x) {
    const float a = fabsf(x);
    const float x2 = x * x;
    const float small = x * (1.12837917f + x2 * (-0.376126389f + x2 * (0.112837917f + x2 * (-0.0268661706f
                        + x2 * (0.00522397762f - x2 * 0.000854832702f)))));
    const float t = 1.0f / (1.0f + 0.3275911f * a);
    const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f
                       + t * 1.061405429f))));
    const float y = 1.0f - poly * ad_exp(-x2);
    const float big = x < 0.0f ? -y : y;
    return a < 0.5f ? small : big;
}

static inline float ad_maximum(float a, float b) { return (a > b || a != a) ? a : b; }
static inline float ad_minimum(float a, float b) { return (a < b || a != a) ? a : b; }
"""

# op name -> C++ expression over its operands' names
PRIMITIVES: Dict[str, str] = {
    "arith.addf": "{0} + {1}",
    "arith.subf": "{0} - {1}",
    "arith.mulf": "{0} * {1}",
    "arith.divf": "{0} / {1}",
    "arith.negf": "-{0}",
    "arith.maximumf": "ad_maximum({0}, {1})",
    "arith.minimumf": "ad_minimum({0}, {1})",
    "arith.select": "{0} ? {1} : {2}",
    "math.exp": "ad_exp({0})",
    "math.tanh": "ad_tanh({0})",
    "math.erf": "ad_erf({0})",
    "math.log": "logf({0})",
    "math.absf": "fabsf({0})",
    "math.sqrt": "sqrtf({0})",
    "math.rsqrt": "1.0f / sqrtf({0})",
    "math.powf": "powf({0}, {1})",
}


def _literal(x: float) -> str:
    if x != x:
        return "NAN"
    if x in (float("inf"), float("-inf")):
        return "INFINITY" if x > 0 else "-INFINITY"
    return f"{x.hex()}f"  # exact: the value is already a float32


def _index(map_results, flat: bool) -> str:
    full = "j" if flat else "o * inner + i"
    return {(): "0", (0, 1): full, (1,): "i", (0,): "o"}[map_dims(map_results)]


def emit_cpp(module: ModuleOp) -> str:
    """The C++ source of the module's kernel (``SYMBOL`` with the ABI above)."""
    generic = generic_of(module)
    maps = [m.data for m in generic.indexing_maps.data]
    n_in, n_out = len(generic.inputs), len(generic.outputs)
    flat = all(len(m.results) in (0, 2) for m in maps)
    body = generic.body.block
    names: Dict[SSAValue, str] = {}
    lines: List[str] = []
    decls: List[str] = []
    for k, (arg, amap) in enumerate(zip(body.args[:n_in], maps[:n_in])):
        ctype = "bool" if isinstance(arg.type, IntegerType) else "float"
        decls.append(f"    const {ctype}* __restrict in{k} = reinterpret_cast<const {ctype}*>(args[{3 + k}]);")
        lines.append(f"const {ctype} a{k} = in{k}[{_index(amap.results, flat)}];")
        names[arg] = f"a{k}"
    for k in range(n_out):
        decls.append(f"    float* __restrict out{k} = reinterpret_cast<float*>(args[{3 + n_in + k}]);")
    count = 0
    for op in body.ops:
        if op.name == "linalg.yield":
            for k, value in enumerate(op.operands):
                lines.append(f"out{k}[{'j' if flat else 'o * inner + i'}] = {names[value]};")
            continue
        if op.name == "arith.constant":
            names[op.results[0]] = _literal(op.value.value.data) if isinstance(op.value, FloatAttr) else "0"
            continue
        if op.name not in PRIMITIVES:
            raise NotImplementedError(f"no C++ for primitive '{op.name}'")
        expr = PRIMITIVES[op.name].format(*(names[v] for v in op.operands))
        ctype = "bool" if isinstance(op.results[0].type, IntegerType) else "float"
        lines.append(f"const {ctype} v{count} = {expr};")
        names[op.results[0]] = f"v{count}"
        count += 1
    cond = f"outer * inner >= {PARALLEL_MIN}"
    if flat:
        inner_loop = ["for (int64_t j = 0; j < outer * inner; ++j) {", *(f"    {line}" for line in lines), "}"]
        parallel = [f"#pragma omp parallel for simd schedule(static) num_threads(nthreads)", *inner_loop]
        serial = ["#pragma omp simd", *inner_loop]
    else:
        rows = ["for (int64_t o = 0; o < outer; ++o) {", "    #pragma omp simd",
                "    for (int64_t i = 0; i < inner; ++i) {", *(f"        {line}" for line in lines), "    }", "}"]
        parallel = ["#pragma omp parallel for schedule(static) num_threads(nthreads)", *rows]
        serial = rows
    # the serial branch is separate code, not an ``if`` clause: an omp parallel region that the
    # clause turns off still costs a runtime call, measurable at decode sizes
    loop = [f"    if ({cond}) {{", *(f"        {line}" for line in parallel), "    } else {",
            *(f"        {line}" for line in serial), "    }"]
    head = [f'extern "C" void {SYMBOL}(const int64_t* args) {{', "    const int64_t outer = args[0], inner = args[1];",
            "    const int nthreads = static_cast<int>(args[2]);"]
    return "\n".join([PRELUDE, *head, *decls, *loop, "}", ""])
