/* RMSNorm over bfloat16 rows, optionally fused with the residual add before it, with the
 * reference's roundings (ops/normalization.py, torch_rmsnorm_impl on bf16 tensors):
 *   s = bf16(x + residual);  n = bf16(s / sqrt(mean(s^2) + eps));  y = bf16(weight * n)
 * every sum and product in float32, the mean of squares too.
 *
 * Why: as rmsnorm_f32.c. In bfloat16 the reference is ten dispatched ops per norm (casts
 * included); on the `small` preset at batch 1 they took ~2.7 ms of a 20 ms decode step.
 *
 * Layouts: as rmsnorm_f32.c, every tensor bf16 as uint16_t.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bfloat16, to nearest, ties to even (a NaN stays a quiet NaN) */
static inline uint16_t to_bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

void ad_rmsnorm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* residual, int64_t ldr, const uint16_t* weight,
                     uint16_t* y, uint16_t* summed, int64_t rows, int64_t H, float eps, int nthreads) {
#pragma omp parallel for schedule(static) if (rows * H >= 65536) num_threads(nthreads)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* xr = x + r * ldx;
        uint16_t* yr = y + r * H;
        const uint16_t* src = xr;
        if (residual) {
            const uint16_t* rr = residual + r * ldr;
            uint16_t* sr = summed + r * H;
            for (int64_t i = 0; i < H; ++i) sr[i] = to_bf(bf(xr[i]) + bf(rr[i]));
            src = sr;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; ++i) ss += bf(src[i]) * bf(src[i]);
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; ++i) yr[i] = to_bf(bf(weight[i]) * bf(to_bf(bf(src[i]) * inv)));
    }
}
