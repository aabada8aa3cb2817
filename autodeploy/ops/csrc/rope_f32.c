/* Llama's rotate-half RoPE over fp32 heads: out = x * cos + rotate_half(x) * sin, with
 * rotate_half(x) = cat(-x[h:], x[:h]) over the head dim D = 2h.
 *
 * Why: torch spells it as ten ops per layer for q and k (mul, two slices, neg, cat, mul, add,
 * each twice, plus the unsqueezes of cos/sin); at decode sizes their dispatches are most of the
 * cost. One call per tensor does it in one pass, reading x in place (q and k are strided views of
 * the fused QKV output) and writing a contiguous result.
 *
 * The two products are rounded before the sum, as torch's three ops round them, so the result
 * equals torch's bit for bit (no contraction into an FMA).
 * Layouts: x [B, S, H, D] with strides sb, ss, sh (the last dim contiguous); cos, sin [B, S, D]
 * contiguous; out [B, S, H, D] contiguous.
 */
#include <stdint.h>

__attribute__((optimize("fp-contract=off"))) void ad_rope_f32(const float* x, int64_t sb, int64_t ss, int64_t sh,
                                                              const float* cos, const float* sin, float* out,
                                                              int64_t B, int64_t S, int64_t H, int64_t D,
                                                              int nthreads) {
    const int64_t h = D / 2;
#pragma omp parallel for collapse(2) schedule(static) if (B * S * H * D >= 65536) num_threads(nthreads)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s) {
            const float* c = cos + (b * S + s) * D;
            const float* n = sin + (b * S + s) * D;
            for (int64_t j = 0; j < H; ++j) {
                const float* xr = x + b * sb + s * ss + j * sh;
                float* o = out + ((b * S + s) * H + j) * D;
#pragma omp simd
                for (int64_t i = 0; i < h; ++i) {
                    const float a = xr[i] * c[i];
                    const float r = -xr[i + h] * n[i];
                    o[i] = a + r;
                }
#pragma omp simd
                for (int64_t i = h; i < D; ++i) {
                    const float a = xr[i] * c[i];
                    const float r = xr[i - h] * n[i];
                    o[i] = a + r;
                }
            }
        }
}
