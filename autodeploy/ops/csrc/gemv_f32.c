/* One-row linear y = x W^T + b over a float32 weight in its plain row-major layout.
 *
 * Why: a decode step at batch 1 multiplies one activation row by every weight matrix, so its
 * time is the weights' bytes over the memory bandwidth. oneDNN's packed GEMM (what batched steps
 * use) reads them at ~24 GB/s here; this loop streams each thread's contiguous block of rows at
 * close to the read bandwidth, four rows at a time so that the activation vector loaded once
 * from L1 serves four weight streams. Accumulation is float32 in 16 lanes per row, then one
 * horizontal sum: a different summation order than oneDNN's, not a different precision.
 *
 * Layouts: x [K] contiguous; w [N, K] with row stride ldw; bias [N] or NULL; y [N].
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static float row_dot_scalar(const float* w, const float* x, int64_t K) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += w[k] * x[k];
    return s;
}

#if defined(__AVX512F__)
/* four rows starting at w (stride ldw) dotted with x */
static void four_rows(const float* w, int64_t ldw, const float* x, int64_t K, float* out) {
    const float *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + k), xv, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + k), xv, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + k), xv, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + k), xv, a3);
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1u);
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w0 + k), xv, a0);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w1 + k), xv, a1);
        a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w2 + k), xv, a2);
        a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w3 + k), xv, a3);
    }
    out[0] = _mm512_reduce_add_ps(a0);
    out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2);
    out[3] = _mm512_reduce_add_ps(a3);
}
#else
static void four_rows(const float* w, int64_t ldw, const float* x, int64_t K, float* out) {
    for (int r = 0; r < 4; ++r) out[r] = row_dot_scalar(w + r * ldw, x, K);
}
#endif

void ad_gemv_f32(const float* x, const float* w, int64_t ldw, const float* bias, float* y, int64_t N, int64_t K,
                 int nthreads) {
    const int64_t blocks = N / 4;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < blocks; ++i) {
        float out[4];
        four_rows(w + 4 * i * ldw, ldw, x, K, out);
        for (int r = 0; r < 4; ++r) y[4 * i + r] = out[r] + (bias ? bias[4 * i + r] : 0.f);
    }
    for (int64_t n = 4 * blocks; n < N; ++n) y[n] = row_dot_scalar(w + n * ldw, x, K) + (bias ? bias[n] : 0.f);
}
