/* A whole step of a state op on the CPU: every sequence's tokens (a prefill's many, a decode's one)
 * run through the recurrence on the state in the sequence's own cache slot, updated in place: the
 * Mamba2 (SSD) and Mamba scans, the depthwise causal conv window, and the fast-weight states of
 * decayed linear attention and the delta rules.
 *
 * Why: on CPU the torch form of one token is a handful of ops per sequence (decay the state, add
 * the token's outer product, read it out; shift the window), each a pass over the state plus its
 * dispatch, and the batched decode path gathers every state from the cache and scatters it back.
 * A Mamba2 layer's state is 24 x 64 x 128 floats (768 KiB) per sequence: that was ~0.58 ms a layer
 * at batch 1 batched, ~0.17 ms with torch in place. Here each (sequence, head) reads and writes its
 * state once per token, its read-out summed in the same pass, and the state of one head (32 KiB for
 * Mamba2) stays in the L1 cache for all of a prefill's tokens, which the torch references walk
 * token by token in Python (the delta rules, Mamba) or chunk by chunk.
 *
 * Common arguments: n sequences; cu [n + 1] (int32) their rows' offsets: sequence s is rows
 * cu[s] .. cu[s + 1] - 1 of every per-token input and of the output; rows the number of rows the
 * inputs have; slots [n] (int32) their cache slots; carry [n] (0: the sequence starts from a zero
 * state / window, whatever its slot holds). Output rows of no sequence (from cu[n] on) are zeros.
 * Each kernel returns -1 when a slot is outside the cache and -3 when the offsets do not fit the
 * rows, having written nothing.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

static int check_step(const int32_t* cu, const int32_t* slots, int64_t n, int64_t rows, int64_t num_slots) {
    for (int64_t s = 0; s < n; ++s)
        if (slots[s] < 0 || slots[s] >= num_slots) return -1;
    if (cu[0] < 0 || cu[n] > rows) return -3;
    for (int64_t s = 0; s < n; ++s)
        if (cu[s] > cu[s + 1]) return -3;
    return 0;
}

/* zeros for the output rows from ``from`` on (``width`` floats each) */
static void zero_tail(float* y, int64_t from, int64_t rows, int64_t width) {
    if (rows > from) memset(y + from * width, 0, (size_t)((rows - from) * width) * sizeof(float));
}

/* Mamba2: per sequence s and head h (group g = h / (heads / groups)), state S [head_dim, dstate]:
 *   S = exp(dt A[h]) S + dt x (outer) B[g];  y = S C[g] + D[h] x
 * x [rows, heads, head_dim] (row stride ldx), dt [rows, heads] (lddt, already discretised),
 * B / C [rows, groups, dstate] (ldb / ldc), A / D [heads], state [num_slots, heads, head_dim,
 * dstate] contiguous, y [rows, heads, head_dim] contiguous. */
int ad_mamba2_step_f32(const float* x, int64_t ldx, const float* dt, int64_t lddt, const float* B, int64_t ldb,
                       const float* C, int64_t ldc, const float* A, const float* D, float* state, int64_t num_slots,
                       const int32_t* cu, int64_t rows, const int32_t* slots, const uint8_t* carry, float* y,
                       int64_t n, int64_t heads, int64_t head_dim, int64_t groups, int64_t dstate, int nthreads) {
    const int rc = check_step(cu, slots, n, rows, num_slots);
    if (rc) return rc;
    const int64_t per_group = heads / groups;
#pragma omp parallel for schedule(dynamic, 1) if (cu[n] * heads * head_dim * dstate >= 65536) num_threads(nthreads)
    for (int64_t i = 0; i < n * heads; ++i) {
        const int64_t s = i / heads, h = i % heads, g = h / per_group;
        float* S = state + ((int64_t)slots[s] * heads + h) * head_dim * dstate;
        for (int64_t r = cu[s]; r < cu[s + 1]; ++r) {
            const int keep = carry[s] || r > cu[s];
            const float step = dt[r * lddt + h];
            const float decay = expf(step * A[h]);
            const float* b = B + r * ldb + g * dstate;
            const float* c = C + r * ldc + g * dstate;
            const float* xs = x + r * ldx + h * head_dim;
            float* ys = y + (r * heads + h) * head_dim;
            for (int64_t p = 0; p < head_dim; ++p) {
                float* row = S + p * dstate;
                const float coef = xs[p] * step;
                float acc = 0.f;
                if (keep) {
#pragma omp simd reduction(+ : acc)
                    for (int64_t j = 0; j < dstate; ++j) {
                        const float v = row[j] * decay + coef * b[j];
                        row[j] = v;
                        acc += v * c[j];
                    }
                } else {
#pragma omp simd reduction(+ : acc)
                    for (int64_t j = 0; j < dstate; ++j) {
                        const float v = coef * b[j];
                        row[j] = v;
                        acc += v * c[j];
                    }
                }
                ys[p] = acc + xs[p] * D[h];
            }
        }
    }
    zero_tail(y, cu[n], rows, heads * head_dim);
    return 0;
}

/* Mamba (v1): per sequence s and channel ch, state S [dstate] with its own decay per entry:
 *   S = exp(dt A[ch]) * S + dt x B;  y = S . C + D[ch] x
 * x / dt [rows, c] (row strides ldx / lddt; dt already discretised), B / C [rows, dstate] (ldb /
 * ldc), A [c, dstate], D [c], state [num_slots, c, dstate] contiguous, y [rows, c] contiguous. */
int ad_mamba_step_f32(const float* x, int64_t ldx, const float* dt, int64_t lddt, const float* B, int64_t ldb,
                      const float* C, int64_t ldc, const float* A, const float* D, float* state, int64_t num_slots,
                      const int32_t* cu, int64_t rows, const int32_t* slots, const uint8_t* carry, float* y,
                      int64_t n, int64_t c, int64_t dstate, int nthreads) {
    const int rc = check_step(cu, slots, n, rows, num_slots);
    if (rc) return rc;
#pragma omp parallel for schedule(static) if (cu[n] * c * dstate >= 65536) num_threads(nthreads)
    for (int64_t i = 0; i < n * c; ++i) {
        const int64_t s = i / c, ch = i % c;
        float* S = state + ((int64_t)slots[s] * c + ch) * dstate;
        const float* a = A + ch * dstate;
        for (int64_t r = cu[s]; r < cu[s + 1]; ++r) {
            const int keep = carry[s] || r > cu[s];
            const float step = dt[r * lddt + ch], xv = x[r * ldx + ch], coef = step * xv;
            const float* b = B + r * ldb;
            const float* cc = C + r * ldc;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t j = 0; j < dstate; ++j) {
                const float v = (keep ? ad_exp_nonpos(step * a[j]) * S[j] : 0.f) + coef * b[j];
                S[j] = v;
                acc += v * cc[j];
            }
            y[r * c + ch] = acc + xv * D[ch];
        }
    }
    zero_tail(y, cu[n], rows, c);
    return 0;
}

/* Depthwise causal conv: y[r, ch] = act(sum_j window[j] w[ch, j] + x[r, ch] w[ch, k - 1] + bias[ch]),
 * then the window [k - 1] shifted left by one with x[r, ch] appended. x [rows, c] (row stride ldx),
 * windows [num_slots, c, k - 1] contiguous, w [c, k] contiguous, bias [c] or NULL, silu: 1 applies
 * SiLU, y [rows, c] contiguous. Channels in blocks of 512, each block's tokens in order. */
int ad_conv_step_f32(const float* x, int64_t ldx, float* windows, int64_t num_slots, const int32_t* cu, int64_t rows,
                     const int32_t* slots, const uint8_t* carry, const float* w, const float* bias, int silu, float* y,
                     int64_t n, int64_t c, int64_t k, int nthreads) {
    const int rc = check_step(cu, slots, n, rows, num_slots);
    if (rc) return rc;
    const int64_t width = k - 1, block = 512, blocks = (c + block - 1) / block;
#pragma omp parallel for schedule(static) if (cu[n] * c * k >= 262144) num_threads(nthreads)
    for (int64_t i = 0; i < n * blocks; ++i) {
        const int64_t s = i / blocks, lo = (i % blocks) * block, hi = lo + block < c ? lo + block : c;
        float* W = windows + (int64_t)slots[s] * c * width;
        for (int64_t r = cu[s]; r < cu[s + 1]; ++r) {
            const int keep = carry[s] || r > cu[s];
            const float* xs = x + r * ldx;
            float* ys = y + r * c;
            if (width == 3) { /* kernel 4 (every Mamba, most short convs): the window in registers */
#pragma omp simd
                for (int64_t ch = lo; ch < hi; ++ch) {
                    float* win = W + ch * 3;
                    const float* taps = w + ch * 4;
                    const float w0 = keep ? win[0] : 0.f, w1 = keep ? win[1] : 0.f, w2 = keep ? win[2] : 0.f;
                    const float xv = xs[ch];
                    ys[ch] = w0 * taps[0] + w1 * taps[1] + w2 * taps[2] + xv * taps[3] + (bias ? bias[ch] : 0.f);
                    win[0] = w1;
                    win[1] = w2;
                    win[2] = xv;
                }
            } else {
                for (int64_t ch = lo; ch < hi; ++ch) {
                    float* win = W + ch * width;
                    const float* taps = w + ch * k;
                    float acc = 0.f;
                    if (keep)
                        for (int64_t j = 0; j < width; ++j) acc += win[j] * taps[j];
                    acc += xs[ch] * taps[width];
                    if (bias) acc += bias[ch];
                    for (int64_t j = 0; j + 1 < width; ++j) win[j] = keep ? win[j + 1] : 0.f;
                    if (width > 0) win[width - 1] = xs[ch];
                    ys[ch] = acc;
                }
            }
            if (silu) { /* a second, vectorised pass: the activation is most of the arithmetic */
#pragma omp simd
                for (int64_t ch = lo; ch < hi; ++ch) ys[ch] = ad_silu(ys[ch]);
            }
        }
    }
    zero_tail(y, cu[n], rows, c);
    return 0;
}

/* Decayed linear attention (MiniMax lightning) and the delta rule (DeltaNet, Gated DeltaNet, Kimi
 * Delta Attention), per sequence s and value head h with the fast-weight state S [dk, dv] and
 * decay d = exp(g) (per head, per key channel, or none), token by token:
 *   linear attention:  S' = d S + k v^T                          y = S'^T q
 *   delta rule:        S' = d S + k (beta (v - (d S)^T k))^T      y = S'^T q
 * q and k first L2-normalised (eps 1e-6) when l2norm, q then scaled. Linear attention takes one pass
 * over S per token (read, update, read out). The delta rule takes two, not the four reads and two
 * writes of the torch form: the first only reads, (d S)^T k and (d S)^T q together; since
 * y = (d S)^T q + delta (k . q), the second writes S' and is done.
 * q / k [rows, hk, dk] (row strides ldq / ldk; value head h reads q/k head h / (h_total / hk)),
 * v [rows, h, dv] (ldv), beta [rows, h] (ldb; NULL for linear attention), g [rows, h, gw] (ldg;
 * gw 1 per head, dk per channel; NULL: no decay), state [num_slots, h, dk, dv] contiguous,
 * y [rows, h, dv] contiguous. dk and dv at most 1024 (-2 otherwise, nothing written). */
int ad_fast_weight_step_f32(const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv,
                            const float* beta, int64_t ldb, const float* g, int64_t ldg, int64_t gw, float* state,
                            int64_t num_slots, const int32_t* cu, int64_t rows, const int32_t* slots,
                            const uint8_t* carry, float* y, int64_t n, int64_t h, int64_t hk, int64_t dk, int64_t dv,
                            float scale, int l2norm, int nthreads) {
    const int rc = check_step(cu, slots, n, rows, num_slots);
    if (rc) return rc;
    if (dk > 1024 || dv > 1024 || dk < 1 || dv < 1) return -2;
    const int64_t per_qk = h / hk;
#pragma omp parallel for schedule(dynamic, 1) if (cu[n] * h * dk * dv >= 65536) num_threads(nthreads)
    for (int64_t i = 0; i < n * h; ++i) {
        const int64_t s = i / h, head = i % h, kh = head / per_qk;
        float* S = state + ((int64_t)slots[s] * h + head) * dk * dv;
        float qs[dk], ks[dk], decay[dk], recalled[dv], read[dv], delta[dv];
        for (int64_t r = cu[s]; r < cu[s + 1]; ++r) {
            const int keep = carry[s] || r > cu[s];
            const float* qr = q + r * ldq + kh * dk;
            const float* kr = k + r * ldk + kh * dk;
            const float* vr = v + r * ldv + head * dv;
            float* out = y + (r * h + head) * dv;
            float qq = 0.f, kk = 0.f;
            for (int64_t c = 0; c < dk; ++c) {
                qq += qr[c] * qr[c];
                kk += kr[c] * kr[c];
            }
            const float qn = l2norm ? 1.0f / sqrtf(qq + 1e-6f) : 1.0f, kn = l2norm ? 1.0f / sqrtf(kk + 1e-6f) : 1.0f;
            float kq = 0.f;
            for (int64_t c = 0; c < dk; ++c) {
                qs[c] = qr[c] * qn * scale;
                ks[c] = kr[c] * kn;
                kq += ks[c] * qs[c];
                decay[c] = g == NULL ? 1.0f : expf(g[r * ldg + head * gw + (gw == 1 ? 0 : c)]);
            }
            if (beta == NULL) { /* linear attention: S' = d S + k v^T and y = S'^T q in one pass */
                for (int64_t j = 0; j < dv; ++j) out[j] = 0.f;
                for (int64_t c = 0; c < dk; ++c) {
                    float* row = S + c * dv;
                    const float d = keep ? decay[c] : 0.f, kc = ks[c], qc = qs[c];
#pragma omp simd
                    for (int64_t j = 0; j < dv; ++j) {
                        const float next = (keep ? d * row[j] : 0.f) + kc * vr[j];
                        row[j] = next;
                        out[j] += qc * next;
                    }
                }
                continue;
            }
            for (int64_t j = 0; j < dv; ++j) recalled[j] = read[j] = 0.f;
            if (keep) {
                for (int64_t c = 0; c < dk; ++c) {
                    const float* row = S + c * dv;
                    const float a = decay[c] * ks[c], b = decay[c] * qs[c];
#pragma omp simd
                    for (int64_t j = 0; j < dv; ++j) {
                        recalled[j] += a * row[j];
                        read[j] += b * row[j];
                    }
                }
            }
            const float bt = beta[r * ldb + head];
            for (int64_t j = 0; j < dv; ++j) {
                delta[j] = (vr[j] - recalled[j]) * bt;
                out[j] = read[j] + delta[j] * kq;
            }
            for (int64_t c = 0; c < dk; ++c) {
                float* row = S + c * dv;
                const float d = decay[c], kc = ks[c];
                if (keep) {
#pragma omp simd
                    for (int64_t j = 0; j < dv; ++j) row[j] = d * row[j] + kc * delta[j];
                } else {
#pragma omp simd
                    for (int64_t j = 0; j < dv; ++j) row[j] = kc * delta[j];
                }
            }
        }
    }
    zero_tail(y, cu[n], rows, h * dv);
    return 0;
}

/* RecurrentGemma's RG-LRU scan: per channel h = a h + x, y = h. x / a [rows, w] (row strides ldx /
 * lda), state [num_slots, w] contiguous, y [rows, w] contiguous. Channels in blocks of 512 (the
 * block's h in a local array, vectorised across channels), each block's tokens in order. */
int ad_diagonal_recurrence_f32(const float* x, int64_t ldx, const float* a, int64_t lda, float* state,
                               int64_t num_slots, const int32_t* cu, int64_t rows, const int32_t* slots,
                               const uint8_t* carry, float* y, int64_t n, int64_t w, int nthreads) {
    const int rc = check_step(cu, slots, n, rows, num_slots);
    if (rc) return rc;
    enum { BLOCK = 512 };
    const int64_t blocks = (w + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (cu[n] * w >= 65536) num_threads(nthreads)
    for (int64_t i = 0; i < n * blocks; ++i) {
        const int64_t s = i / blocks, lo = (i % blocks) * BLOCK, len = lo + BLOCK < w ? BLOCK : w - lo;
        float* S = state + (int64_t)slots[s] * w + lo;
        float h[BLOCK];
        for (int64_t j = 0; j < len; ++j) h[j] = carry[s] ? S[j] : 0.f;
        for (int64_t r = cu[s]; r < cu[s + 1]; ++r) {
            const float* xr = x + r * ldx + lo;
            const float* ar = a + r * lda + lo;
            float* yr = y + r * w + lo;
#pragma omp simd
            for (int64_t j = 0; j < len; ++j) {
                h[j] = ar[j] * h[j] + xr[j];
                yr[j] = h[j];
            }
        }
        if (cu[s + 1] > cu[s])
            for (int64_t j = 0; j < len; ++j) S[j] = h[j];
    }
    zero_tail(y, cu[n], rows, w);
    return 0;
}

/* RWKV-4's WKV (wkv.py), per channel with the running numerator a, denominator b and exponent p
 * (state [num_slots, 3, c]: a, b, p rows; a zero denominator is the empty state, p = -1e38 there),
 * w = -exp(time_decay), u = time_first:
 *   q = max(p, u + k);  y = (e^{p-q} a + e^{u+k-q} v) / (e^{p-q} b + e^{u+k-q})
 *   q = max(p + w, k);  a = e^{p+w-q} a + e^{k-q} v;  b = e^{p+w-q} b + e^{k-q};  p = q
 * k / v [rows, c] (row strides ldk / ldv), time_decay / time_first [c], y [rows, c] contiguous. */
int ad_wkv_f32(const float* time_decay, const float* time_first, const float* k, int64_t ldk, const float* v,
               int64_t ldv, float* state, int64_t num_slots, const int32_t* cu, int64_t rows, const int32_t* slots,
               const uint8_t* carry, float* y, int64_t n, int64_t c, int nthreads) {
    const int rc = check_step(cu, slots, n, rows, num_slots);
    if (rc) return rc;
    enum { BLOCK = 256 };
    const int64_t blocks = (c + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (cu[n] * c >= 16384) num_threads(nthreads)
    for (int64_t i = 0; i < n * blocks; ++i) {
        const int64_t s = i / blocks, lo = (i % blocks) * BLOCK, len = lo + BLOCK < c ? BLOCK : c - lo;
        float* S = state + (int64_t)slots[s] * 3 * c;
        float num[BLOCK], den[BLOCK], p[BLOCK], wd[BLOCK];
        for (int64_t j = 0; j < len; ++j) {
            num[j] = carry[s] ? S[lo + j] : 0.f;
            den[j] = carry[s] ? S[c + lo + j] : 0.f;
            p[j] = den[j] == 0.f ? -1e38f : S[2 * c + lo + j];
            wd[j] = -expf(time_decay[lo + j]);
        }
        for (int64_t r = cu[s]; r < cu[s + 1]; ++r) {
            const float* kr = k + r * ldk + lo;
            const float* vr = v + r * ldv + lo;
            float* yr = y + r * c + lo;
#pragma omp simd
            for (int64_t j = 0; j < len; ++j) {
                const float uk = time_first[lo + j] + kr[j];
                float top = p[j] > uk ? p[j] : uk;
                float e1 = ad_exp_nonpos(p[j] - top), e2 = ad_exp_nonpos(uk - top);
                yr[j] = (e1 * num[j] + e2 * vr[j]) / (e1 * den[j] + e2);
                const float pw = p[j] + wd[j];
                top = pw > kr[j] ? pw : kr[j];
                e1 = ad_exp_nonpos(pw - top);
                e2 = ad_exp_nonpos(kr[j] - top);
                num[j] = e1 * num[j] + e2 * vr[j];
                den[j] = e1 * den[j] + e2;
                p[j] = top;
            }
        }
        if (cu[s + 1] > cu[s])
            for (int64_t j = 0; j < len; ++j) {
                S[lo + j] = num[j];
                S[c + lo + j] = den[j];
                S[2 * c + lo + j] = p[j];
            }
    }
    zero_tail(y, cu[n], rows, c);
    return 0;
}

/* log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)), no overflow either way */
static inline float log_sigmoid(float x) {
    return (x < 0.f ? x : 0.f) - log1pf(expf(-fabsf(x)));
}

/* xLSTM's mLSTM (mlstm.py), per sequence s and head h with the state packed as [dqk + 1, dv + 1]
 * (C in [:dqk, :dv], n in column dv, m in the corner [dqk, dv]; zeros are the empty state):
 *   m' = max(log sigmoid(f) + m, i);  a = exp(log sigmoid(f) + m - m');  b = exp(i - m')
 *   C' = a C + b k v^T;  n' = a n + b k;  y = (q~ C') / (max(|q~ . n'|, exp(-m')) + eps),  q~ = q / sqrt(dqk)
 * one pass over C per token. q / k [rows, nh, dqk] (row strides ldq / ldk), v [rows, nh, dv] (ldv),
 * i / f [rows, nh] (ldi / ldf), state [num_slots, nh, dqk + 1, dv + 1] contiguous, y [rows, nh, dv]
 * contiguous. */
int ad_mlstm_f32(const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv,
                 const float* ig, int64_t ldi, const float* fg, int64_t ldf, float* state, int64_t num_slots,
                 const int32_t* cu, int64_t rows, const int32_t* slots, const uint8_t* carry, float* y, int64_t n,
                 int64_t nh, int64_t dqk, int64_t dv, float eps, int nthreads) {
    const int rc = check_step(cu, slots, n, rows, num_slots);
    if (rc) return rc;
    const int64_t width = dv + 1;
    const float scale = 1.0f / sqrtf((float)dqk);
#pragma omp parallel for schedule(dynamic, 1) if (cu[n] * nh * dqk * dv >= 65536) num_threads(nthreads)
    for (int64_t i = 0; i < n * nh; ++i) {
        const int64_t s = i / nh, h = i % nh;
        float* S = state + ((int64_t)slots[s] * nh + h) * (dqk + 1) * width;
        if (!carry[s] && cu[s + 1] > cu[s]) memset(S, 0, (size_t)((dqk + 1) * width) * sizeof(float));
        for (int64_t r = cu[s]; r < cu[s + 1]; ++r) {
            const float* qr = q + r * ldq + h * dqk;
            const float* kr = k + r * ldk + h * dqk;
            const float* vr = v + r * ldv + h * dv;
            float* out = y + (r * nh + h) * dv;
            const float m = S[dqk * width + dv], lf = log_sigmoid(fg[r * ldf + h]), in = ig[r * ldi + h];
            const float m_new = lf + m > in ? lf + m : in;
            const float a = expf(lf + m - m_new), b = expf(in - m_new);
            float qn = 0.f;
            for (int64_t j = 0; j < dv; ++j) out[j] = 0.f;
            for (int64_t c = 0; c < dqk; ++c) {
                float* row = S + c * width;
                const float kc = b * kr[c], qc = qr[c] * scale;
#pragma omp simd
                for (int64_t j = 0; j < dv; ++j) {
                    const float next = a * row[j] + kc * vr[j];
                    row[j] = next;
                    out[j] += qc * next;
                }
                row[dv] = a * row[dv] + kc;
                qn += qc * row[dv];
            }
            S[dqk * width + dv] = m_new;
            const float floor = expf(-m_new), denominator = (fabsf(qn) > floor ? fabsf(qn) : floor) + eps;
            for (int64_t j = 0; j < dv; ++j) out[j] /= denominator;
        }
        /* the packing's unused entries [dqk, :dv] are zeros, as the torch path stores them */
        if (cu[s + 1] > cu[s]) memset(S + dqk * width, 0, (size_t)dv * sizeof(float));
    }
    zero_tail(y, cu[n], rows, nh * dv);
    return 0;
}
