/* Small float helpers shared by the CPU kernels, written so that GCC vectorises the loops that
 * call them (no library calls, no errno): compile with -O3 -march=native -fopenmp.
 */
#ifndef AD_VEC_MATH_H
#define AD_VEC_MATH_H

#include <stdint.h>
#include <string.h>

/* e^c for c in [-87, 88], relative error ~2 ulp. Cody-Waite range reduction c = n ln2 + r with
 * |r| <= ln2/2, then a degree-6 polynomial for e^r and 2^n put into the exponent bits. Why not
 * expf: a call per element does not vectorise without -ffast-math, and -ffast-math in a shared
 * library may switch the whole process to flush-to-zero when the library loads. Shared with the
 * kernels mlir_elementwise_fusion generates (autodeploy/compile/mlir/cpp.py embeds this file). */
static inline float ad_exp_clamped(float c) {
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (c * 1.44269504088896341f + shifter) - shifter;
    float r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* exp(x) for x <= 0 (softmax after subtracting the row maximum). Inputs below -87 return ~1e-38
 * (not 0): harmless in a softmax whose largest term is 1. */
static inline float ad_exp_nonpos(float x) {
    return ad_exp_clamped(x < -87.0f ? -87.0f : x);
}

/* silu(g) = g / (1 + exp(-g)), with exp of a non-positive argument only (so no overflow):
 * e = exp(-|g|); g >= 0: g / (1 + e); g < 0: g * e / (1 + e). */
static inline float ad_silu(float g) {
    const float e = ad_exp_nonpos(g >= 0.f ? -g : g);
    return (g >= 0.f ? g : g * e) / (1.0f + e);
}

#endif
