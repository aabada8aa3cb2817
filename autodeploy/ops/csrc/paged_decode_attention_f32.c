/* Decode attention straight from a paged fp32 KV cache: one new query per sequence.
 *
 * Why: torch has no attention over paged memory, so the torch path first copies every
 * sequence's pages into one padded tensor (index_select), builds a mask and then calls SDPA:
 * at 32 sequences that copy and the padded SDPA cost more per layer than the attention's own
 * arithmetic. Here each sequence reads its keys and values once, in place, a token's row of all
 * heads at a time, and the query heads that share a kv head (GQA) reuse its key row from L1.
 *
 * Layouts (all contiguous): q [B, Hq, D]; k_cache [pages, page_size, Hkv, D]; v_cache
 * [pages, page_size, Hkv, Dv]; page_table [B, W] int32; input_pos, seq_len [B] int32 (the
 * sequence's cached length before this step and its new tokens, 1 here; the new key is already
 * written); out [B, Hq, Dv]. Sequence b attends positions [max(0, L - window), L) with
 * L = input_pos[b] + seq_len[b]; window <= 0 means no window. Scores, softmax and sums are fp32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

static float dot(const float* a, const float* b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

/* one sequence, kv heads [h0, h1) and their query heads: each token's key (then value) row of
 * those heads is one contiguous read, and each key row serves its `group` query heads */
static void attend(const float* q, const float* k_cache, const float* v_cache, const int32_t* pages, int64_t page_size,
                   int64_t n_kv, int64_t h0, int64_t h1, int64_t D, int64_t Dv, int64_t group, int64_t start,
                   int64_t end, float scale, float* scores /* [heads][end - start] */, float* out /* [heads][Dv] */) {
    const int64_t n = end - start, heads = (h1 - h0) * group;
    for (int64_t t = start; t < end; ++t) {
        const int64_t slot = (int64_t)pages[t / page_size] * page_size + t % page_size;
        const float* k = k_cache + (slot * n_kv + h0) * D;
        for (int64_t j = 0; j < heads; ++j) scores[j * n + (t - start)] = dot(q + j * D, k + (j / group) * D, D) * scale;
    }
    for (int64_t j = 0; j < heads; ++j) {
        float* s = scores + j * n;
        float m = s[0];
        for (int64_t i = 1; i < n; ++i) m = s[i] > m ? s[i] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
            s[i] = ad_exp_nonpos(s[i] - m);
            sum += s[i];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < n; ++i) s[i] *= inv;
        memset(out + j * Dv, 0, sizeof(float) * Dv);
    }
    for (int64_t t = start; t < end; ++t) {
        const int64_t slot = (int64_t)pages[t / page_size] * page_size + t % page_size;
        const float* v = v_cache + (slot * n_kv + h0) * Dv;
        for (int64_t j = 0; j < heads; ++j) {
            const float p = scores[j * n + (t - start)];
            const float* vj = v + (j / group) * Dv;
            float* o = out + j * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) o[d] += p * vj[d];
        }
    }
}

/* When k_new is not NULL, first writes the step's keys and values (k_new [B, Hkv, D] and
 * v_new [B, Hkv, Dv], heads contiguous, token strides ldk and ldv) into cache slots slots[B]
 * (page * page_size + offset), as the torch path's index_copy_ does.
 * Returns 0, or -1 when a sequence has no position to attend or scratch memory ran out. */
int ad_paged_decode_attention_f32(const float* q, float* k_cache, float* v_cache, const int32_t* page_table,
                                  const int32_t* input_pos, const int32_t* seq_len, float* out, int64_t B, int64_t n_q,
                                  int64_t n_kv, int64_t D, int64_t Dv, int64_t page_size, int64_t width, float scale,
                                  int64_t window, const float* k_new, int64_t ldk, const float* v_new, int64_t ldv,
                                  const int64_t* slots, int nthreads) {
    const int64_t group = n_q / n_kv;
    if (k_new)
        for (int64_t b = 0; b < B; ++b) {
            memcpy(k_cache + slots[b] * n_kv * D, k_new + b * ldk, sizeof(float) * n_kv * D);
            memcpy(v_cache + slots[b] * n_kv * Dv, v_new + b * ldv, sizeof(float) * n_kv * Dv);
        }
    /* whole sequences per work item when there are enough of them (contiguous reads of all
     * heads' rows), else one kv head each so that a single sequence still uses every thread */
    const int64_t per_item = B >= 2 * (int64_t)nthreads ? n_kv : 1;
    const int64_t chunks = n_kv / per_item;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed) num_threads(nthreads)
    for (int64_t item = 0; item < B * chunks; ++item) {
        const int64_t b = item / chunks, h0 = (item % chunks) * per_item;
        const int64_t end = (int64_t)input_pos[b] + seq_len[b];
        const int64_t start = window > 0 && end > window ? end - window : 0;
        if (end <= start || end > width * page_size) {
            failed = 1;
            continue;
        }
        float* scores = (float*)malloc(sizeof(float) * per_item * group * (end - start));
        if (!scores) {
            failed = 1;
            continue;
        }
        attend(q + (b * n_q + h0 * group) * D, k_cache, v_cache, page_table + b * width, page_size, n_kv, h0,
               h0 + per_item, D, Dv, group, start, end, scale, scores, out + (b * n_q + h0 * group) * Dv);
        free(scores);
    }
    return failed ? -1 : 0;
}
