/* The lean decode step's CPU operations (moefit.runtime.layers.lean_step): RMSNorm, RoPE + KV write,
 * attention of one query token per sequence over the KV cache, top-k routing grouped by expert.
 *
 * Built into the same library as qmatmul.c (moefit.runtime.kernels.qmatmul loads both). Each
 * operation follows the torch code it replaces step by step and rounds where that code
 * rounds: a value stored in the compute dtype (bf16 / fp16) is rounded to nearest even at
 * the same point, the arithmetic between is fp32 (torch's CPU kernels compute bf16 ops in
 * fp32); only fp32 summation orders differ.
 *
 * dtype codes (as qmatmul.c's float types): 0 fp32, 1 fp16, 2 bf16.
 * KV codec codes: 0 / 1 / 2 plain fp32 / fp16 / bf16; 8 q8 (GGML block_q8_0); 9 q4
 * (GGML block_q4_0) -- the layouts of moefit.runtime.buffers.kv_codec.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include "mf_floats.h"
#include "moefit_kernels.h"

enum { D_F32 = 0, D_F16 = 1, D_BF16 = 2, C_Q8 = 8, C_Q4 = 9 };

static inline float ld(const void *p, int dt, int64_t i) {
    if (dt == D_BF16) return mf_b2f(((const uint16_t *)p)[i]);
    if (dt == D_F16) return mf_h2f(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}
static inline void st(void *p, int dt, int64_t i, float v) {
    if (dt == D_BF16) ((uint16_t *)p)[i] = mf_f2b(v);
    else if (dt == D_F16) ((uint16_t *)p)[i] = mf_f2h(v);
    else ((float *)p)[i] = v;
}
/* v rounded to dtype dt (as a value stored in a tensor of that dtype and read back) */
static inline float rnd(float v, int dt) {
    if (dt == D_BF16) return mf_b2f(mf_f2b(v));
    if (dt == D_F16) return mf_h2f(mf_f2h(v));
    return v;
}

/* ---- RMSNorm (moefit.runtime.model.rms_norm) ------------------------------------------------
 * rows x dim values of h (dtype dt). With delta (dtype ddt, fp32 = a combine accumulator):
 * first h = h + delta, delta rounded to dt first (the layer output is a tensor of dt) and the
 * sum rounded to dt (hidden.add_(delta)). Then out = w * (h / sqrt(mean(h^2) + eps)):
 * the statistics in fp32, the normalised value rounded to dt, then times w (rounded again);
 * offset 1: times (1 + w) in fp32 before one rounding (Qwen3NextRMSNorm). out may be h.
 * w: dim values of dtype dt. */
#ifdef __AVX512F__
#ifdef __AVX512BF16__
#define HAVE_V16_BF16 1
#else
#define HAVE_V16_BF16 0
#endif
/* 16 values of a 16-bit dtype (bf16 or fp16) at a time: whether dtype dt has a vector path */
static inline int v16(int dt) { return dt == D_F16 || (dt == D_BF16 && HAVE_V16_BF16); }
static inline __m512 ldb16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 ld16(const uint16_t *p, int dt) {     /* 16 values of dt -> fp32 (exact) */
    if (dt == D_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return ldb16(p);
}
static inline __m256i cvt16(__m512 v, int dt) {            /* fp32 -> dt, nearest even */
    if (dt == D_F16) return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#if HAVE_V16_BF16
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    return _mm256_setzero_si256();                         /* not reached: v16(D_BF16) is 0 */
#endif
}
static inline __m512 rnd16(__m512 v, int dt) {             /* round to dt and back */
    if (dt == D_F16) return _mm512_cvtph_ps(cvt16(v, dt));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt16(v, dt)), 16));
}
static inline void st16(uint16_t *p, __m512 v, int dt) { _mm256_storeu_si256((__m256i *)p, cvt16(v, dt)); }

/* mf_rmsnorm for bf16 / fp16 rows (dim a multiple of 16), 16 values per step: the scalar
 * loop's roundings (the same conversions), the sum of squares in 16 lanes */
static void rmsnorm_v16(int rows, int dim, uint16_t *h, const void *delta, int ddt, const uint16_t *w,
                        int dt, float eps, float offset, uint16_t *out) {
    for (int r = 0; r < rows; r++) {
        int64_t o = (int64_t)r * dim;
        __m512 ss = _mm512_setzero_ps();
        for (int i = 0; i < dim; i += 16) {
            __m512 x = ld16(h + o + i, dt);
            if (delta) {
                __m512 d = ddt == dt ? ld16((const uint16_t *)delta + o + i, dt)
                                     : rnd16(_mm512_loadu_ps((const float *)delta + o + i), dt);
                x = rnd16(_mm512_add_ps(x, d), dt);
                st16(h + o + i, x, dt);
            }
            ss = _mm512_fmadd_ps(x, x, ss);
        }
        float inv = 1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)dim + eps);
        __m512 vi = _mm512_set1_ps(inv), off = _mm512_set1_ps(offset);
        for (int i = 0; i < dim; i += 16) {
            __m512 x = _mm512_mul_ps(ld16(h + o + i, dt), vi), wv = ld16(w + i, dt);
            st16(out + o + i, offset != 0.f ? _mm512_mul_ps(x, _mm512_add_ps(wv, off))
                                            : _mm512_mul_ps(rnd16(x, dt), wv), dt);
        }
    }
}
#endif

void mf_rmsnorm(int rows, int dim, void *h, const void *delta, int ddt, const void *w, int dt,
                float eps, float offset, void *out) {
#ifdef __AVX512F__
    if (v16(dt) && dim % 16 == 0 && (!delta || ddt == dt || ddt == D_F32)) {
        rmsnorm_v16(rows, dim, (uint16_t *)h, delta, ddt, (const uint16_t *)w, dt, eps, offset, (uint16_t *)out);
        return;
    }
#endif
    for (int r = 0; r < rows; r++) {
        int64_t o = (int64_t)r * dim;
        float ss = 0.f;
        for (int i = 0; i < dim; i++) {
            float x = ld(h, dt, o + i);
            if (delta) {
                x = rnd(x + rnd(ld(delta, ddt, o + i), dt), dt);
                st(h, dt, o + i, x);
            }
            ss += x * x;
        }
        float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) {
            float x = ld(h, dt, o + i) * inv;
            if (offset != 0.f) st(out, dt, o + i, x * (ld(w, dt, i) + offset));
            else st(out, dt, o + i, rnd(x, dt) * ld(w, dt, i));
        }
    }
}

/* ---- KV codecs (moefit.runtime.buffers.kv_codec), one head vector ---------------------------------- */
static void kv_encode(const float *x, int d, int codec, uint8_t *dst) {
    if (codec <= D_BF16) { for (int i = 0; i < d; i++) st(dst, codec, i, x[i]); return; }
    int nb = (d + 31) / 32;
    for (int b = 0; b < nb; b++) {
        float xb[32];
        for (int i = 0; i < 32; i++) xb[i] = 32 * b + i < d ? x[32 * b + i] : 0.f;
        if (codec == C_Q8) {
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
            float dd = amax / 127.f, inv = dd > 0.f ? 1.f / dd : 0.f;
            uint16_t hd = mf_f2h(dd);
            uint8_t *o = dst + 34 * b;
            memcpy(o, &hd, 2);
            for (int i = 0; i < 32; i++) {
                float q = rintf(xb[i] * inv);
                q = q < -127.f ? -127.f : q > 127.f ? 127.f : q;
                o[2 + i] = (uint8_t)(int8_t)q;
            }
        } else {
            int im = 0;
            for (int i = 1; i < 32; i++) if (fabsf(xb[i]) > fabsf(xb[im])) im = i;
            float dd = xb[im] / -8.f, inv = dd != 0.f ? 1.f / dd : 0.f;
            uint16_t hd = mf_f2h(dd);
            uint8_t *o = dst + 18 * b, q[32];
            memcpy(o, &hd, 2);
            for (int i = 0; i < 32; i++) {
                float v = floorf(xb[i] * inv + 8.5f);
                q[i] = (uint8_t)(v < 0.f ? 0.f : v > 15.f ? 15.f : v);
            }
            for (int i = 0; i < 16; i++) o[2 + i] = (uint8_t)(q[i] | (q[i + 16] << 4));
        }
    }
}

/* one head vector back, each value rounded to dt (the attention reads K and V blocks into
 * buffers of the compute dtype) */
static void kv_decode(const uint8_t *src, int d, int codec, int dt, float *y) {
    if (codec <= D_BF16 && (codec == dt || dt == D_F32)) {      /* exact: no rounding */
        int i = 0;
#ifdef __AVX512F__
        if (codec == D_BF16)
            for (; i + 16 <= d; i += 16)
                _mm512_storeu_ps(y + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 2 * i))), 16)));
        else if (codec == D_F16)
            for (; i + 16 <= d; i += 16)
                _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * i))));
        else
            for (; i + 16 <= d; i += 16) _mm512_storeu_ps(y + i, _mm512_loadu_ps((const float *)src + i));
#endif
        for (; i < d; i++) y[i] = ld(src, codec, i);
        return;
    }
    if (codec <= D_BF16) { for (int i = 0; i < d; i++) y[i] = rnd(ld(src, codec, i), dt); return; }
    for (int i = 0; i < d; i++) {
        int b = i / 32, j = i % 32;
        if (codec == C_Q8) {
            const uint8_t *o = src + 34 * b;
            uint16_t hd; memcpy(&hd, o, 2);
            y[i] = rnd((float)(int8_t)o[2 + j] * mf_h2f(hd), dt);
        } else {
            const uint8_t *o = src + 18 * b;
            uint16_t hd; memcpy(&hd, o, 2);
            int q = j < 16 ? (o[2 + j] & 15) : (o[2 + j - 16] >> 4);
            y[i] = rnd((float)(q - 8) * mf_h2f(hd), dt);
        }
    }
}

/* ---- RoPE + KV write (moefit.runtime.layers.rope.Rotary, moefit.runtime.buffers.kv_cache.KVCache.write) ----
 * mf_rope_table: cos / sin [T, rot/2] (fp32 values of dtype dt) of the T positions pos[t]:
 * (cos|sin)(pos * inv_freq[i]) * scaling rounded to dt, computed in fp32 as transformers'
 * rotary embedding does; once per step, shared by the layers. */
void mf_rope_table(int T, int half, const float *inv_freq, float scaling, const int64_t *pos, int dt,
                   float *cs, float *sn) {
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            float f = (float)pos[t] * inv_freq[i];
            cs[(int64_t)t * half + i] = rnd(cosf(f) * scaling, dt);
            sn[(int64_t)t * half + i] = rnd(sinf(f) * scaling, dt);
        }
}

/* mf_rope_kv: T tokens, token t at position pos[t] of KV slot slot[t]. q [T, A, D], k [T, Kh, D]
 * (dtype dt) are rotated in place on their first rot channels: x * cos + rotate_half(x) * sin
 * (cos / sin of mf_rope_table, the same for both halves), each product and the sum rounded to
 * dt (r.mul_(c).add_(rot.mul_(s))). Then k and v [T, Kh, Dv] are encoded into the cache: K
 * cells at kc + ((slot * cells + pos % cells) * Kh + h) * krow, V likewise; with a shared KV pool
 * (cells_of [slots, ctx] not NULL: moefit.runtime.buffers.kv_cache.CellPool) the cell of a
 * position is cells_of[slot * ctx + pos]. */
void mf_rope_kv(int T, void *q, int A, void *k, int Kh, const void *v, int D, int Dv, int rot,
                const float *cs, const float *sn, const int64_t *pos, const int64_t *slot, int dt,
                uint8_t *kc, uint8_t *vc, int cells, int kcodec, int vcodec, int krow, int vrow,
                const int64_t *cells_of, int64_t ctx) {
    int half = rot / 2;
    float x[1024];
    for (int t = 0; t < T; t++) {
        const float *c = cs + (int64_t)t * half, *sv = sn + (int64_t)t * half;
        for (int pass = 0; pass < 2; pass++) {
            void *base = pass ? k : q;
            int heads = pass ? Kh : A;
            for (int hh = 0; hh < heads; hh++) {
                int64_t o = ((int64_t)t * heads + hh) * D;
#ifdef __AVX512F__
                if (v16(dt) && half % 16 == 0) {
                    uint16_t *r = (uint16_t *)base + o;
                    for (int i = 0; i < half; i += 16) {
                        __m512 lo = ld16(r + i, dt), hi = ld16(r + half + i, dt);
                        __m512 cv = _mm512_loadu_ps(c + i), sw = _mm512_loadu_ps(sv + i);
                        /* first half: lo c - hi s; second half: hi c + lo s (rotate_half) */
                        __m512 nlo = _mm512_add_ps(rnd16(_mm512_mul_ps(lo, cv), dt),
                                                   rnd16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), sw), dt));
                        __m512 nhi = _mm512_add_ps(rnd16(_mm512_mul_ps(hi, cv), dt), rnd16(_mm512_mul_ps(lo, sw), dt));
                        st16(r + i, nlo, dt);
                        st16(r + half + i, nhi, dt);
                    }
                    continue;
                }
#endif
                float r[1024];
                for (int i = 0; i < rot; i++) r[i] = ld(base, dt, o + i);
                for (int i = 0; i < rot; i++) {
                    float rh = i < half ? -r[i + half] : r[i - half];
                    st(base, dt, o + i, rnd(r[i] * c[i % half], dt) + rnd(rh * sv[i % half], dt));
                }
            }
        }
        int64_t cell = (cells_of ? cells_of[slot[t] * ctx + pos[t]]
                                 : slot[t] * (int64_t)cells + pos[t] % cells) * Kh;
        for (int hh = 0; hh < Kh; hh++) {
            const uint8_t *ks = (const uint8_t *)k + ((int64_t)t * Kh + hh) * D * (dt == D_F32 ? 4 : 2);
            const uint8_t *vs = (const uint8_t *)v + ((int64_t)t * Kh + hh) * Dv * (dt == D_F32 ? 4 : 2);
            if (kcodec == dt) memcpy(kc + (cell + hh) * krow, ks, (size_t)krow);      /* plain, same dtype */
            else {
                for (int i = 0; i < D; i++) x[i] = ld(k, dt, ((int64_t)t * Kh + hh) * D + i);
                kv_encode(x, D, kcodec, kc + (cell + hh) * krow);
            }
            if (vcodec == dt) memcpy(vc + (cell + hh) * vrow, vs, (size_t)vrow);
            else {
                for (int i = 0; i < Dv; i++) x[i] = ld(v, dt, ((int64_t)t * Kh + hh) * Dv + i);
                kv_encode(x, Dv, vcodec, vc + (cell + hh) * vrow);
            }
        }
    }
}

/* ---- attention of one query token per sequence (moefit.runtime.layers.attention.attend) -----------
 * Token t (query q [T, A, D], dtype dt) at position pos[t] of slot slot[t] attends to the
 * cached positions lo .. pos[t] (lo = pos - window + 1 on a sliding layer, window 0: 0);
 * query head a reads KV head a / (A / Kh) (GQA). Scores q . k * scale and the softmax in fp32
 * (the running max and sum of an online softmax over blocks of ATT_BLOCK positions), K and V
 * read as values of dt, out [T, A, Dv] = sum p v / sum p rounded to dt. One work item per
 * (token, KV head), split over the threads; each block of K and V is decoded once for the
 * G query heads that share it. */
#define ATT_BLOCK 32

#ifdef __AVX512F__
/* e^x for x <= 0 (scores minus their running max), 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <=
 * ln2 / 2, p the degree-6 Taylor polynomial of e^r (relative error under 2e-7, the size of
 * fp32 rounding); 0 below -87 (e^-87 is below fp32's normal range) */
static inline __m512 exp512(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2hi = _mm512_set1_ps(0.693359375f),
                 ln2lo = _mm512_set1_ps(-2.12194440e-4f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2hi, x);
    r = _mm512_fnmadd_ps(n, ln2lo, r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    __m512 y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
    return _mm512_maskz_mov_ps(~tiny, y);
}
#endif

/* the cache lines of one K or V row (bytes bytes at p) requested ahead of their use: a
 * (token, KV head) item reads one row per cell, cells Kh rows apart, a stride the hardware
 * prefetchers do not follow far enough ahead */
static inline void prefetch_row(const uint8_t *p, int bytes) {
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch(p + c, 0, 3);
}

/* s[g][j] = q_g . k_j * scale for the gn query heads and n keys of a block (fp32). Four heads
 * at a time share each load of a key row; the remainder one by one. */
static void att_scores(float (*qv)[512], int gn, float (*kb)[512], int n, int D, float scale,
                       float (*s)[ATT_BLOCK]) {
    int g = 0;
#ifdef __AVX512F__
    if (D % 16 == 0)
        for (; g + 4 <= gn; g += 4)
            for (int j = 0; j < n; j++) {
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int i = 0; i < D; i += 16) {
                    __m512 k = _mm512_loadu_ps(kb[j] + i);
                    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qv[g] + i), k, a0);
                    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qv[g + 1] + i), k, a1);
                    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qv[g + 2] + i), k, a2);
                    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qv[g + 3] + i), k, a3);
                }
                s[g][j] = _mm512_reduce_add_ps(a0) * scale;
                s[g + 1][j] = _mm512_reduce_add_ps(a1) * scale;
                s[g + 2][j] = _mm512_reduce_add_ps(a2) * scale;
                s[g + 3][j] = _mm512_reduce_add_ps(a3) * scale;
            }
#endif
    for (; g < gn; g++)
        for (int j = 0; j < n; j++) s[g][j] = mf_dot_f32(qv[g], kb[j], D) * scale;
}

/* acc[g] += sum_j s[g][j] v_j for the gn heads over the n value rows of a block (fp32). Four
 * heads at a time share each load of a value row, 32 outputs of each in registers. */
static void att_values(float (*s)[ATT_BLOCK], int gn, float (*kb)[512], int n, int Dv,
                       float (*acc)[512]) {
    int g = 0;
#ifdef __AVX512F__
    if (Dv % 32 == 0)
        for (; g + 4 <= gn; g += 4)
            for (int i = 0; i < Dv; i += 32) {
                __m512 a[4][2];
                for (int h = 0; h < 4; h++) {
                    a[h][0] = _mm512_loadu_ps(acc[g + h] + i);
                    a[h][1] = _mm512_loadu_ps(acc[g + h] + i + 16);
                }
                for (int j = 0; j < n; j++) {
                    __m512 v0 = _mm512_loadu_ps(kb[j] + i), v1 = _mm512_loadu_ps(kb[j] + i + 16);
                    for (int h = 0; h < 4; h++) {
                        __m512 pj = _mm512_set1_ps(s[g + h][j]);
                        a[h][0] = _mm512_fmadd_ps(pj, v0, a[h][0]);
                        a[h][1] = _mm512_fmadd_ps(pj, v1, a[h][1]);
                    }
                }
                for (int h = 0; h < 4; h++) {
                    _mm512_storeu_ps(acc[g + h] + i, a[h][0]);
                    _mm512_storeu_ps(acc[g + h] + i + 16, a[h][1]);
                }
            }
#endif
    for (; g < gn; g++) {
        int i = 0;
#ifdef __AVX512F__
        for (; i + 64 <= Dv; i += 64) {     /* 64 outputs in registers over the block */
            __m512 a0 = _mm512_loadu_ps(acc[g] + i), a1 = _mm512_loadu_ps(acc[g] + i + 16);
            __m512 a2 = _mm512_loadu_ps(acc[g] + i + 32), a3 = _mm512_loadu_ps(acc[g] + i + 48);
            for (int j = 0; j < n; j++) {
                __m512 pj = _mm512_set1_ps(s[g][j]);
                a0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(kb[j] + i), a0);
                a1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(kb[j] + i + 16), a1);
                a2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(kb[j] + i + 32), a2);
                a3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(kb[j] + i + 48), a3);
            }
            _mm512_storeu_ps(acc[g] + i, a0); _mm512_storeu_ps(acc[g] + i + 16, a1);
            _mm512_storeu_ps(acc[g] + i + 32, a2); _mm512_storeu_ps(acc[g] + i + 48, a3);
        }
#endif
        for (; i < Dv; i++)
            for (int j = 0; j < n; j++) acc[g][i] += s[g][j] * kb[j][i];
    }
}

/* the cells of positions [b0, b0 + n) of one sequence (n <= ATT_BLOCK): with a cell table
 * (crow, the slot's row of moefit.runtime.buffers.kv_cache.CellPool.table) the row itself;
 * own cells sbase + position % cells, written to own (one modulo per block unless the ring
 * wraps inside it) */
static inline const int64_t *block_cells(const int64_t *crow, int64_t sbase, int cells, int64_t b0, int n,
                                         int64_t *own) {
    if (crow) return crow + b0;
    int64_t c0 = b0 % cells;
    if (c0 + n <= cells) for (int j = 0; j < n; j++) own[j] = sbase + c0 + j;
    else for (int j = 0; j < n; j++) own[j] = sbase + (b0 + j) % cells;
    return own;
}

/* the (token, KV head) items of mf_attn_decode taken by the calling thread: an orphaned
 * worksharing loop, so on one thread it runs outside any parallel region, with no barrier
 * (see qmatmul.c's gemm_ex_body) */
static void attn_items(int T, const void *q, int A, int Kh, int D, int Dv, float scale,
                       const uint8_t *kc, const uint8_t *vc, int kcodec, int vcodec, int krow, int vrow,
                       const int64_t *pos, const int64_t *slot, int cells, int window, int dt, void *out,
                       const int64_t *cells_of, int64_t ctx) {
    int G = A / Kh;
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < T * Kh; item++) {
        int t = item / Kh, kh = item % Kh;
        float qv[16][512], acc[16][512], m[16], l[16], s[16][ATT_BLOCK], kb[ATT_BLOCK][512];
        int g_n = G > 16 ? 16 : G;
        for (int g0 = 0; g0 < G; g0 += g_n) {
            int gn = G - g0 < g_n ? G - g0 : g_n;
            for (int g = 0; g < gn; g++) {
                int a = kh * G + g0 + g;
                for (int i = 0; i < D; i++) qv[g][i] = ld(q, dt, ((int64_t)t * A + a) * D + i);
                for (int i = 0; i < Dv; i++) acc[g][i] = 0.f;
                m[g] = -INFINITY; l[g] = 0.f;
            }
            int64_t p = pos[t], lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            const int64_t sbase = slot[t] * (int64_t)cells;
            const int64_t *crow = cells_of ? cells_of + slot[t] * ctx : NULL;
            /* the cells of a block of positions, looked up once per block (not per K / V row
             * and prefetch): with a cell table its row is already the block's cells in
             * position order; own cells are slot x cells, contiguous unless the ring wraps */
            int64_t own[2][ATT_BLOCK];
            int n0 = (int)(p + 1 - lo < ATT_BLOCK ? p + 1 - lo : ATT_BLOCK);
            const int64_t *cb = block_cells(crow, sbase, cells, lo, n0, own[0]);
            for (int j = 0; j < n0; j++) {
                prefetch_row(kc + (cb[j] * Kh + kh) * krow, krow);
                prefetch_row(vc + (cb[j] * Kh + kh) * vrow, vrow);
            }
            for (int64_t b0 = lo, k = 0; b0 <= p; b0 += ATT_BLOCK, k ^= 1) {
                int n = (int)(p + 1 - b0 < ATT_BLOCK ? p + 1 - b0 : ATT_BLOCK);
                int64_t b1 = b0 + ATT_BLOCK;        /* the next block, fetched while this one runs */
                int n1 = b1 > p ? 0 : (int)(p + 1 - b1 < ATT_BLOCK ? p + 1 - b1 : ATT_BLOCK);
                const int64_t *nb = n1 ? block_cells(crow, sbase, cells, b1, n1, own[k ^ 1]) : NULL;
                for (int j = 0; j < n; j++) {
                    if (j < n1) prefetch_row(kc + (nb[j] * Kh + kh) * krow, krow);
                    kv_decode(kc + (cb[j] * Kh + kh) * krow, D, kcodec, dt, kb[j]);
                }
                att_scores(qv, gn, kb, n, D, scale, s);
                for (int g = 0; g < gn; g++) {
                    float mx = m[g];
                    for (int j = 0; j < n; j++) mx = fmaxf(mx, s[g][j]);
                    float alpha = expf(m[g] - mx), sum = 0.f;
                    int j = 0;
#ifdef __AVX512F__
                    __m512 vs = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
                    for (; j + 16 <= n; j += 16) {
                        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s[g] + j), vmx));
                        _mm512_storeu_ps(s[g] + j, e);
                        vs = _mm512_add_ps(vs, e);
                    }
                    sum = _mm512_reduce_add_ps(vs);
#endif
                    for (; j < n; j++) { s[g][j] = expf(s[g][j] - mx); sum += s[g][j]; }
                    l[g] = l[g] * alpha + sum;
                    if (alpha != 1.f) for (int i = 0; i < Dv; i++) acc[g][i] *= alpha;
                    m[g] = mx;
                }
                for (int j = 0; j < n; j++) {       /* the V block, in kb (K is done with) */
                    if (j < n1) prefetch_row(vc + (nb[j] * Kh + kh) * vrow, vrow);
                    kv_decode(vc + (cb[j] * Kh + kh) * vrow, Dv, vcodec, dt, kb[j]);
                }
                att_values(s, gn, kb, n, Dv, acc);
                cb = nb;
            }
            for (int g = 0; g < gn; g++) {
                int a = kh * G + g0 + g;
                for (int i = 0; i < Dv; i++) st(out, dt, ((int64_t)t * A + a) * Dv + i, acc[g][i] / l[g]);
            }
        }
    }
}

void mf_attn_decode(int T, const void *q, int A, int Kh, int D, int Dv, float scale,
                    const uint8_t *kc, const uint8_t *vc, int kcodec, int vcodec, int krow, int vrow,
                    const int64_t *pos, const int64_t *slot, int cells, int window, int dt, void *out,
                    int nthreads, const int64_t *cells_of, int64_t ctx) {
    int G = A / Kh;
    int64_t work = 0;
    for (int t = 0; t < T; t++) work += pos[t] + 1;
    int nt = work * Kh * (D + Dv) * G < 200000 ? 1 : nthreads;   /* a short context: one thread */
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        attn_items(T, q, A, Kh, D, Dv, scale, kc, vc, kcodec, vcodec, krow, vrow, pos, slot, cells, window, dt, out, cells_of, ctx);
    } else attn_items(T, q, A, Kh, D, Dv, scale, kc, vc, kcodec, vcodec, krow, vrow, pos, slot, cells, window, dt, out, cells_of, ctx);
}

/* ---- top-k routing, pairs grouped by expert (moefit.runtime.model.route, moe_batch.run_layer) ----
 * logits [T, E] (dtype dt): softmax in fp32, the k largest (ties: the lower expert first),
 * renormalised to sum 1 when renorm, then rounded to dt (the combine weights are a tensor of
 * dt). The T x k (token, expert) pairs sorted by expert, tokens in order within one: expert i
 * of the n used (n = stats[0]) is at blob address table[e] and serves pairs bounds[i] ..
 * bounds[i+1]-1, whose tokens are tok[] and weights w[]. stats[1], stats[2]: used experts that
 * are resident (resident[e] != 0) and not. */
void mf_route(int T, int E, int k, const void *logits, int dt, int renorm, const int64_t *table,
              const uint8_t *resident, int64_t *ptrs, int64_t *bounds, int64_t *tok, float *w,
              int64_t *stats) {
    int ids[64 * 16];
    float wt[64 * 16], pr[1024];
    for (int t = 0; t < T; t++) {
        float mx = -INFINITY, sum = 0.f;
        for (int e = 0; e < E; e++) { pr[e] = ld(logits, dt, (int64_t)t * E + e); mx = fmaxf(mx, pr[e]); }
        for (int e = 0; e < E; e++) { pr[e] = expf(pr[e] - mx); sum += pr[e]; }
        for (int e = 0; e < E; e++) pr[e] /= sum;
        float tot = 0.f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= ids[t * k + i] == e;
                if (!taken && (best < 0 || pr[e] > pr[best])) best = e;
            }
            ids[t * k + j] = best;
            wt[t * k + j] = pr[best];
            tot += pr[best];
        }
        for (int j = 0; j < k; j++) wt[t * k + j] = rnd(renorm ? wt[t * k + j] / tot : wt[t * k + j], dt);
    }
    /* counting sort by expert: tokens stay in order within an expert */
    int n = 0, hits = 0, misses = 0;
    int64_t p = 0;
    for (int e = 0; e < E; e++) {
        int64_t start = p;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++)
                if (ids[t * k + j] == e) { tok[p] = t; w[p] = wt[t * k + j]; p++; }
        if (p > start) {
            bounds[n] = start;
            ptrs[n] = table[e];
            if (resident[e]) hits++; else misses++;
            n++;
        }
    }
    bounds[n] = p;
    stats[0] = n; stats[1] = hits; stats[2] = misses;
}

/* ---- whole layers in one call (moefit.runtime.layers.lean_step.LeanStep.run) --------------------
 * A run of layers whose every operation is above: RMSNorm (+ the pending residual), q / k / v
 * (+ biases), q/k norm, RoPE + KV write, attention, the output projection (+ bias), RMSNorm
 * (+ residual), the router, top-k routing and the routed experts. The same calls in the same
 * order as the Python loop makes them (clip_qkv too), so the result is the same bit for bit; one foreign
 * call per step instead of about a dozen per layer (each a Python-side conversion of its
 * arguments and a release and re-take of the interpreter lock, which a serving thread on the
 * other core may hold). Layout: mf_lean_layer / mf_lean_step, mirrored by ctypes structures
 * in kernels/lean_abi.py (same field order and types); both are declared in moefit_kernels.h. */

/* x = clamp(x, -c, c) over n values of dtype dt (torch's clamp_: exact in any dtype) */
static void clamp_vals(void *x, int dt, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) {
        float v = ld(x, dt, i);
        st(x, dt, i, v < -c ? -c : v > c ? c : v);
    }
}

static void mm(const mf_mat *m, const mf_lean_step *s, const void *x, void *out, const void *bias) {
    mf_gemm_ex(m->type, m->p, m->rows, m->cols, x, s->ad, s->t, out, s->ad, bias, s->gscratch, s->threads);
}

void mf_lean_layers(int n, mf_lean_layer *layers, mf_lean_step *s) {
    int t = s->t, h = s->h, ad = s->ad;
    for (int i = 0; i < n; i++) {
        mf_lean_layer *L = layers + i;
        mf_rmsnorm(t, h, s->hidden, s->pending, s->pdt, L->in_norm, ad, s->eps, s->off, s->normed);
        mm(&L->q, s, s->normed, s->q, L->qb);
        mm(&L->k, s, s->normed, s->k, L->kb);
        mm(&L->v, s, s->normed, s->v, L->vb);
        if (s->qk_norm == 2) {
            mf_rmsnorm(t, L->heads * L->d, s->q, NULL, ad, L->qn, ad, s->eps, 0.f, s->q);
            mf_rmsnorm(t, L->kvh * L->d, s->k, NULL, ad, L->kn, ad, s->eps, 0.f, s->k);
        }
        if (s->clip > 0.f) {
            clamp_vals(s->q, ad, (int64_t)t * L->heads * L->d, s->clip);
            clamp_vals(s->k, ad, (int64_t)t * L->kvh * L->d, s->clip);
            clamp_vals(s->v, ad, (int64_t)t * L->kvh * L->dv, s->clip);
        }
        if (s->qk_norm == 1) {
            mf_rmsnorm(t * L->heads, L->d, s->q, NULL, ad, L->qn, ad, s->eps, s->off, s->q);
            mf_rmsnorm(t * L->kvh, L->d, s->k, NULL, ad, L->kn, ad, s->eps, s->off, s->k);
        }
        mf_rope_kv(t, s->q, L->heads, s->k, L->kvh, s->v, L->d, L->dv, s->rot, s->cs, s->sn, s->pos, s->slot, ad,
                   L->kc, L->vc, L->cells, L->kcode, L->vcode, L->knb, L->vnb, L->cells_of, L->ctx);
        mf_attn_decode(t, s->q, L->heads, L->kvh, L->d, L->dv, L->scale, L->kc, L->vc, L->kcode, L->vcode,
                       L->knb, L->vnb, s->pos, s->slot, L->cells, L->window, ad, s->o, s->threads,
                       L->cells_of, L->ctx);
        mm(&L->o, s, s->o, s->delta, L->ob);
        mf_rmsnorm(t, h, s->hidden, s->delta, ad, L->post_norm, ad, s->eps, s->off, s->normed);
        mm(&L->router, s, s->normed, s->rlog, NULL);
        mf_route(t, L->e, L->topk, s->rlog, ad, s->renorm, L->table, L->mask, s->bptr, s->bounds, s->tok, s->wsel,
                 s->stats);
        L->hits += s->stats[1];
        L->misses += s->stats[2];
        memset(s->acc, 0, (size_t)t * h * sizeof(float));
        mf_moe((int)s->stats[0], (const uint8_t *const *)s->bptr, s->bounds, s->tok, s->wsel, s->normed, ad, s->acc,
               t, h, L->inter, L->gt, L->ut, L->dt, L->up_off, L->down_off, s->mscratch, (int)L->pchunk, s->threads);
        s->pending = s->acc;
        s->pdt = D_F32;
    }
}
