/* RMSNorm over fp32 rows, optionally fused with the residual add before it:
 *   s = x + residual (when residual is given);  y = weight * (s / sqrt(mean(s^2) + eps))
 *
 * Why: torch spells RMSNorm as six elementwise/reduction ops (pow, mean, add, rsqrt, mul, mul),
 * each a dispatch and a pass over the row; at decode sizes (one to a few rows of 768) the
 * dispatches cost more than the arithmetic, and a decoder runs two norms per layer. One call
 * does it in one pass plus one. Same formula as Llama's: the mean of squares in fp32, then the
 * normalised row times the weight.
 *
 * Layouts: x, residual, y, summed are [rows, H] with row strides ldx, ldr (inputs) and H
 * (outputs); weight is [H]. residual and summed are NULL for the plain norm.
 */
#include <math.h>
#include <stdint.h>

void ad_rmsnorm_f32(const float* x, int64_t ldx, const float* residual, int64_t ldr, const float* weight, float* y,
                    float* summed, int64_t rows, int64_t H, float eps, int nthreads) {
#pragma omp parallel for schedule(static) if (rows * H >= 65536) num_threads(nthreads)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        float* yr = y + r * H;
        const float* src = xr;
        if (residual) {
            const float* rr = residual + r * ldr;
            float* sr = summed + r * H;
#pragma omp simd
            for (int64_t i = 0; i < H; ++i) sr[i] = xr[i] + rr[i];
            src = sr;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; ++i) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) yr[i] = weight[i] * (src[i] * inv);
    }
}
