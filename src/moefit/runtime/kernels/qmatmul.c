/* Quantized matrix products on the CPU, reading ggml blocks as stored (moefit.runtime.kernels.qmatmul).
 *
 * Activations are quantized per 32 values, as ggml's CPU backend quantizes them to Q8_0 /
 * Q8_K before its vec_dot kernels (ggml-cpu/quants.c): int8 q = round(x / d), d = max|x| / 127
 * (fp32, one per 32 values), with the int32 sums of q per 16 values. A weight row of a quant
 * type is then multiplied block by block in integers: sum(qw * qx), scaled by the weight's
 * block scale(s) and the activation's d. Float weights (F32, F16, BF16) multiply fp32
 * activations in fp32 (no activation quantization).
 *
 * Block layouts: see qmatmul.py / quant.py (ggml-common.h). Exported functions: moefit_kernels.h.
 * Built by moefit.runtime.kernels.native (per x86-64 variant at install, or -march=native at
 * first use); AVX-512 VNNI, AVX-VNNI or AVX2 paths, else plain C.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include "mf_floats.h"
#include "moefit_kernels.h"

#ifndef PREFETCH
#define PREFETCH 8192
#endif
/* bytes of weights below which a product runs on the calling thread alone */
#define SMALL_WORK (256 << 10)

enum { T_F32 = 0, T_F16 = 1, T_BF16 = 2, T_Q8_0 = 3, T_Q4_0 = 4, T_Q4_K = 5, T_Q5_K = 6, T_Q6_K = 7,
       T_Q4_1 = 8, T_Q5_0 = 9, T_Q5_1 = 10, T_IQ4_NL = 11, T_MXFP4 = 12, T_Q2_K = 13, T_Q3_K = 14,
       T_IQ4_XS = 15, T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ2_S = 18, T_IQ3_XXS = 19, T_IQ3_S = 20,
       T_IQ1_S = 21, T_IQ1_M = 22 };
/* the types of 256-value super-blocks read by unpacking (dot_lowbit), and their block bytes */
static inline int is_lowbit(int t) { return t >= T_Q2_K && t <= T_IQ1_M; }
/* activation rows multiplied per unpacking of a low-bit super-block (lb_sb_rows) */
#define LB_MAXR 8
static inline int lb_type_size(int t) {
    static const int16_t ts[] = {84, 110, 136, 66, 74, 82, 98, 110, 50, 56};
    return ts[t - T_Q2_K];
}

static const int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline float e8m0_half(uint8_t e) {   /* ggml_e8m0_to_fp32_half */
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f; memcpy(&f, &bits, 4); return f;
}

/* ---- activations: fp32 [K] -> int8 q [K], fp32 d [K/32], fp32 dsy [K/32] (d x the block's
 * sum of q), int16 s16 [K/16] (sums of q per 16 values); the K-quant form: int8 qk [K], fp32
 * dk [K/256], int16 sk16 [K/16]; q again in the nibble order qn [K]: per 4 blocks (128 values)
 * values 0..15 of each block, then values 16..31 of each, as the low and high nibbles of 4
 * blocks of a 4-bit type lie in one vector (dot_b32_512) ------------------------------------ */
typedef struct { int8_t *q; float *d; float *dsy; int16_t *s16; int8_t *qk; float *dk; int16_t *sk16; int8_t *qn; } qact;

/* max |x[i]| over n values (n a multiple of 16), and round(x[i] * id) of 16 values into q
 * as int8, returning their sum: the scalar loops below, 16 values per instruction (the same
 * IEEE products, and vcvtps2dq rounds to nearest even as lrintf does in the default mode, so
 * the results are the scalar ones bit for bit). A decode step quantizes each activation row
 * on one thread, so this part does not shrink with threads. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QACT512 1
static inline float amax_512(const float *x, int n) {
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    return _mm512_reduce_max_ps(m);
}
static inline int32_t q16_512(const float *x, float id, int8_t *q) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(v));
    return _mm512_reduce_add_epi32(v);
}
#endif

/* The K-quant form (ggml's Q8_K): one scale per 256 values, so a super-block's sub-block
 * products add up in integers; sums per 16 values. Filled when K is a multiple of 256. */
static void quantize_act_k(const float *x, int K, qact a) {
    for (int b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        float amax = 0.f;
#ifdef QACT512
        amax = amax_512(xb, 256);
#else
        for (int i = 0; i < 256; i++) { float v = fabsf(xb[i]); amax = v > amax ? v : amax; }
#endif
        float d = amax / 127.f, id = d ? 1.f / d : 0.f;
        a.dk[b] = d;
        for (int g = 0; g < 16; g++) {
#ifdef QACT512
            a.sk16[16 * b + g] = (int16_t)q16_512(xb + 16 * g, id, a.qk + 256 * b + 16 * g);
#else
            int32_t sg = 0;
            for (int i = 16 * g; i < 16 * g + 16; i++) {
                int q = (int)lrintf(xb[i] * id);
                a.qk[256 * b + i] = (int8_t)q;
                sg += q;
            }
            a.sk16[16 * b + g] = (int16_t)sg;
#endif
        }
    }
}

static void quantize_act(const float *x, int K, qact a) {
    if (K % 256 == 0) quantize_act_k(x, K, a);
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.f;
#ifdef QACT512
        amax = amax_512(xb, 32);
        float d = amax / 127.f, id = d ? 1.f / d : 0.f;
        a.d[b] = d;
        int32_t s0 = q16_512(xb, id, a.q + 32 * b), s1 = q16_512(xb + 16, id, a.q + 32 * b + 16);
#else
        for (int i = 0; i < 32; i++) { float v = fabsf(xb[i]); amax = v > amax ? v : amax; }
        float d = amax / 127.f, id = d ? 1.f / d : 0.f;
        a.d[b] = d;
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < 32; i++) {
            int q = (int)lrintf(xb[i] * id);
            a.q[32 * b + i] = (int8_t)q;
            if (i < 16) s0 += q; else s1 += q;
        }
#endif
        a.s16[2 * b] = (int16_t)s0; a.s16[2 * b + 1] = (int16_t)s1;
        a.dsy[b] = d * (float)(s0 + s1);
    }
    for (int g = 0; g < K / 128; g++)
        for (int k = 0; k < 4; k++) {
            memcpy(a.qn + 128 * g + 16 * k, a.q + 128 * g + 32 * k, 16);
            memcpy(a.qn + 128 * g + 64 + 16 * k, a.q + 128 * g + 32 * k + 16, 16);
        }
}

/* ---- 32-byte integer dot products --------------------------------------------------------- */
#ifdef __AVX2__
/* u8 [32] x s8 [32] -> 8 int32 lanes (lane i: bytes 4i..4i+3). */
static inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
static inline __m256i dot_ss(__m256i a, __m256i b) {   /* s8 x s8 */
    return dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256i nibbles(const uint8_t *p) {  /* 16 bytes -> 32 u8: low nibbles, then high */
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(w, _mm256_set1_epi8(0x0f));
}
static inline __m256i lut16(__m256i idx, const int8_t *tab) {
    __m128i t = _mm_loadu_si128((const __m128i *)tab);
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t), idx);
}
#endif

#ifdef __AVX2__
/* Q4_K / Q5_K: a super-block's 12 bytes of 6-bit scales and mins -> 8 scales in bytes 0..7, 8
 * mins in bytes 8..15 (ggml's kmask unpacking), built in a register: four 4-byte stores read
 * back as one 16-byte load miss the store forwarding (6% of a Q4_K product in the caches);
 * used by the AVX-512 and the AVX2 paths */
static inline __m128i k4_scales(const uint8_t *sc) {
    uint32_t u0, u1, u2;
    memcpy(&u0, sc, 4); memcpy(&u1, sc + 4, 4); memcpy(&u2, sc + 8, 4);
    uint32_t r3 = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
    uint32_t r1 = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    return _mm_setr_epi32((int)(u0 & 0x3f3f3f3fu), (int)r1, (int)(u1 & 0x3f3f3f3fu), (int)r3);
}
#endif

/* ---- AVX-512 (F, BW, VL, DQ, VNNI): 64 bytes of weights per step ------------------------------
 * Unsigned weight values u = stored value + offset (Q4_0: nibble = value + 8; Q8_0: value xor
 * 0x80 = value + 128; IQ4_NL / MXFP4: table value + 128), multiplied by the signed activation
 * q with vpdpbusd; the offset comes back out through dsy (d x sum of q of the block):
 * sum(value * q) * d_w * d = (sum(u * q) - offset * sum(q)) * d_w * d. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__) \
    && defined(__AVX512VBMI__)   /* vpermi2b */
#define HAVE512 1
static const uint8_t KV_IQ4NL_U[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
static const uint8_t KV_MXFP4_U[16] = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116};

static inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }
static inline __m512 pair_scale(float s0, float s1) {
    return _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
}
/* nibbles of two 16-byte runs -> 64 u8 [lo(p0) | hi(p0) | lo(p1) | hi(p1)]: values 0..31 of
 * the block at p0, then those of the block at p1 */
static inline __m512i nib2(const uint8_t *p0, const uint8_t *p1) {
    __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                        _mm_loadu_si128((const __m128i *)p1), 1);
    __m256i m = _mm256_set1_epi8(0x0f);
    __m256i lo = _mm256_and_si256(t, m), hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), m);
    return _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0),
                                     _mm512_castsi256_si512(hi));
}

/* vpermi2b indices of the 4-bit block types (dot_b32_512), per type: the nibbles of 4 blocks,
 * their scales (d's, then m's) and 5th bits, out of [w, w + 64) and [w + 4bs - 64, w + 4bs) */
static uint8_t PERM_IDX[16][192];
static void perm_init(void) {
    static const int types[] = {T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_IQ4_NL, T_MXFP4};
    for (int n = 0; n < 6; n++) {
        int t = types[n];
        int bs = t == T_Q4_0 || t == T_IQ4_NL ? 18 : t == T_Q4_1 ? 20 : t == T_Q5_0 ? 22 : t == T_Q5_1 ? 24 : 17;
        int off = t == T_Q4_1 ? 4 : t == T_MXFP4 ? 1 : t == T_Q5_0 ? 6 : t == T_Q5_1 ? 8 : 2;
        int base2 = 4 * bs - 64;
        uint8_t *ix = PERM_IDX[t];
        for (int j = 0; j < 64; j++) {
            int o = (j / 16) * bs + off + j % 16;
            ix[j] = (uint8_t)(o < 64 ? o : 64 + o - base2);
            int os = ((j / 2) % 4) * bs + (j < 8 ? 0 : 2) + j % 2;   /* d's, then m's */
            ix[64 + j] = (uint8_t)(os < 64 ? os : 64 + os - base2);
            int oh = ((j / 4) % 4) * bs + off - 4 + j % 4;
            ix[128 + j] = (uint8_t)(oh < 64 ? oh : 64 + oh - base2);
        }
    }
}

/* the 32 integer values of one block of a 32-block type (Q4_1 / Q5_1: before the min) */
static __attribute__((noinline)) void block_values(int t, const uint8_t *w, int8_t v[32]) {
    int off = t == T_Q4_1 ? 4 : t == T_MXFP4 ? 1 : t == T_Q5_0 ? 6 : t == T_Q5_1 ? 8 : 2;
    if (t == T_Q8_0) { memcpy(v, w + 2, 32); return; }
    uint32_t qh = 0;
    if (t == T_Q5_0 || t == T_Q5_1) memcpy(&qh, w + off - 4, 4);
    for (int i = 0; i < 16; i++) {
        int lo = w[off + i] & 15, hi = w[off + i] >> 4;
        if (t == T_IQ4_NL) { lo = KV_IQ4NL[lo]; hi = KV_IQ4NL[hi]; }
        else if (t == T_MXFP4) { lo = KV_MXFP4[lo]; hi = KV_MXFP4[hi]; }
        else if (t == T_Q5_0 || t == T_Q5_1) { lo |= ((qh >> i) & 1) << 4; hi |= ((qh >> (i + 16)) & 1) << 4; }
        if (t == T_Q4_0) { lo -= 8; hi -= 8; } else if (t == T_Q5_0) { lo -= 16; hi -= 16; }
        v[i] = (int8_t)lo; v[i + 16] = (int8_t)hi;
    }
}

/* Four blocks of a 4-bit type (not Q8_0) at once, picked out of two 64-byte loads with
 * vpermi2b (nibbles, the 5th bits of Q5_0 / Q5_1, the scales), so no load straddles a block:
 * the constants (b32x4_init, once per row) and the unpacking (b32x4_unpack), shared by
 * dot_b32_512 and dot4_b32_512. */
typedef struct {
    __m512i vnib, vsc, vh, m4, tab;
    __m128i hsplit;              /* the 4 blocks' 5th bits: values 0..15 of each, then 16..31 of each */
    int base2, lut, q5;          /* base2: the second load covers [4bs - 64, 4bs) */
} b32x4_k;

static inline __attribute__((always_inline)) b32x4_k b32x4_init(int t, int bs, __m512i tab) {
    const uint8_t *ix = PERM_IDX[t];
    b32x4_k k;
    k.vnib = _mm512_loadu_si512(ix); k.vsc = _mm512_loadu_si512(ix + 64); k.vh = _mm512_loadu_si512(ix + 128);
    k.m4 = _mm512_set1_epi8(0x0f);
    k.tab = tab;
    k.hsplit = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    k.base2 = 4 * bs - 64;
    k.lut = t == T_IQ4_NL || t == T_MXFP4;
    k.q5 = t == T_Q5_0 || t == T_Q5_1;
    return k;
}

/* the four blocks at w: their values as unsigned bytes (lo: values 0..15 of each block, hi:
 * 16..31; IQ4_NL / MXFP4 through their table, Q5's 5th bit added), the scale words sq (Q4_1
 * / Q5_1's mins at bytes 8..15) and the four scales as fp32 (returned) */
static inline __attribute__((always_inline)) __m128 b32x4_unpack(const b32x4_k *k, int t, const uint8_t *w,
                                                                __m512i *lo, __m512i *hi, __m128i *sq) {
    __m512i la = _mm512_loadu_si512((const void *)w), lb = _mm512_loadu_si512((const void *)(w + k->base2));
    __m512i nib = _mm512_permutex2var_epi8(la, k->vnib, lb);
    *lo = _mm512_and_si512(nib, k->m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(nib, 4), k->m4);
    if (k->lut) { *lo = _mm512_shuffle_epi8(k->tab, *lo); *hi = _mm512_shuffle_epi8(k->tab, *hi); }
    if (k->q5) {
        __m128i hq = _mm_shuffle_epi8(_mm512_castsi512_si128(_mm512_permutex2var_epi8(la, k->vh, lb)), k->hsplit);
        uint64_t hl = (uint64_t)_mm_cvtsi128_si64(hq), hh = (uint64_t)_mm_extract_epi64(hq, 1);
        *lo = _mm512_or_si512(*lo, _mm512_maskz_mov_epi8((__mmask64)hl, _mm512_set1_epi8(16)));
        *hi = _mm512_or_si512(*hi, _mm512_maskz_mov_epi8((__mmask64)hh, _mm512_set1_epi8(16)));
    }
    *sq = _mm512_castsi512_si128(_mm512_permutex2var_epi8(la, k->vsc, lb));
    if (t == T_MXFP4) {
        __m128i e = _mm_cvtepu8_epi32(_mm_shuffle_epi8(*sq, _mm_setr_epi8(0, 2, 4, 6, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1)));
        __m128i big = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);
        __m128i small = _mm_sllv_epi32(_mm_set1_epi32(0x00200000), e);
        return _mm_castsi128_ps(_mm_blendv_epi8(big, small, _mm_cmpgt_epi32(_mm_set1_epi32(2), e)));
    }
    return _mm_cvtph_ps(*sq);
}

/* blocks of 32: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 */
static float dot_b32_512(int t, const uint8_t *w, qact a, int nb) {
    int bs = t == T_Q8_0 ? 34 : t == T_Q4_0 || t == T_IQ4_NL ? 18 : t == T_Q4_1 ? 20 : t == T_Q5_0 ? 22
           : t == T_Q5_1 ? 24 : 17;
    int off = t == T_Q4_1 ? 4 : t == T_MXFP4 ? 1 : t == T_Q5_0 ? 6 : t == T_Q5_1 ? 8 : 2;
    float offset = t == T_Q4_0 ? 8.f : t == T_Q5_0 ? 16.f : (t == T_Q4_1 || t == T_Q5_1) ? 0.f : 128.f;
    int lut = t == T_IQ4_NL || t == T_MXFP4, mins = t == T_Q4_1 || t == T_Q5_1;
    __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(t == T_IQ4_NL ? KV_IQ4NL_U : KV_MXFP4_U)));
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    float corr = 0.f, mcorr = 0.f;
    int b = 0;
    /* 4-bit types (not Q8_0): 4 blocks per step (b32x4_unpack) */
    if (t != T_Q8_0) {
        const b32x4_k k = b32x4_init(t, bs, tab);
        /* int32 lanes 4k .. 4k+3: block k */
        const __m512i sel = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        __m128 cv = _mm_setzero_ps(), mv = _mm_setzero_ps();
        for (; b + 4 <= nb; b += 4, w += 4 * bs) {
            _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);
            __m512i lo, hi;
            __m128i sq;
            __m128 dw = b32x4_unpack(&k, t, w, &lo, &hi, &sq);
            __m128 dsy = _mm_loadu_ps(a.dsy + b);
            cv = _mm_fmadd_ps(dw, dsy, cv);
            if (mins) mv = _mm_fmadd_ps(_mm_cvtph_ps(_mm_srli_si128(sq, 8)), dsy, mv);
            __m512 s4 = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(a.d + b)));
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)(a.qn + 32 * b)));
            p = _mm512_dpbusd_epi32(p, hi, _mm512_loadu_si512((const void *)(a.qn + 32 * b + 64)));
            if (b & 4) acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(sel, s4), acc1);
            else acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(sel, s4), acc0);
        }
        __m128 c2 = _mm_add_ps(cv, _mm_movehl_ps(cv, cv)), m2 = _mm_add_ps(mv, _mm_movehl_ps(mv, mv));
        corr += _mm_cvtss_f32(_mm_add_ss(c2, _mm_movehdup_ps(c2)));
        mcorr += _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
    }
    for (; b + 2 <= nb; b += 2, w += 2 * bs) {
        _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);
        const uint8_t *w1 = w + bs;
        __m512i u;
        if (t == T_Q8_0) {
            u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 2))),
                                   _mm256_loadu_si256((const __m256i *)(w1 + 2)), 1);
            u = _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80));
        } else {
            u = nib2(w + off, w1 + off);
            if (lut) u = _mm512_shuffle_epi8(tab, u);
            if (t == T_Q5_0 || t == T_Q5_1) {
                uint32_t h0, h1; memcpy(&h0, w + off - 4, 4); memcpy(&h1, w1 + off - 4, 4);
                __mmask64 hm = (__mmask64)h0 | ((__mmask64)h1 << 32);
                u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(hm, _mm512_set1_epi8(16)));
            }
        }
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512((const void *)(a.q + 32 * b)));
        float d0 = t == T_MXFP4 ? e8m0_half(w[0]) : mf_h2f(rd16(w));
        float d1 = t == T_MXFP4 ? e8m0_half(w1[0]) : mf_h2f(rd16(w1));
        __m512 sc = pair_scale(d0 * a.d[b], d1 * a.d[b + 1]);
        if (b & 2) acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc1);
        else acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc0);
        corr += d0 * a.dsy[b] + d1 * a.dsy[b + 1];
        if (mins) mcorr += mf_h2f(rd16(w + 2)) * a.dsy[b] + mf_h2f(rd16(w1 + 2)) * a.dsy[b + 1];
    }
    float sum = hsum16(_mm512_add_ps(acc0, acc1)) - offset * corr + mcorr;
    for (; b < nb; b++, w += bs) {        /* an odd last block */
        int8_t v[32];
        block_values(t, w, v);
        int s = 0;
        for (int i = 0; i < 32; i++) s += v[i] * a.q[32 * b + i];
        float d = (t == T_MXFP4 ? e8m0_half(w[0]) : mf_h2f(rd16(w))) * a.d[b];
        sum += d * s;
        if (mins) sum += mf_h2f(rd16(w + 2)) * a.dsy[b];
    }
    return sum;
}

/* Four rows of a 4-bit block type at once (rows w + r * rb), nb a multiple of 4: the
 * activation vectors are loaded once per 4 blocks for the four rows, and the four rows'
 * chains run side by side. out[r] = dot_b32_512(t, w + r * rb, a, nb). */
static void dot4_b32_512(int t, const uint8_t *w, int64_t rb, qact a, int nb, float *out) {
    int bs = t == T_Q4_0 || t == T_IQ4_NL ? 18 : t == T_Q4_1 ? 20 : t == T_Q5_0 ? 22 : t == T_Q5_1 ? 24 : 17;
    float offset = t == T_Q4_0 ? 8.f : t == T_Q5_0 ? 16.f : (t == T_Q4_1 || t == T_Q5_1) ? 0.f : 128.f;
    int mins = t == T_Q4_1 || t == T_Q5_1;
    const b32x4_k k = b32x4_init(t, bs, _mm512_broadcast_i32x4(
        _mm_loadu_si128((const __m128i *)(t == T_IQ4_NL ? KV_IQ4NL_U : KV_MXFP4_U))));
    const __m512i sel = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[4];
    __m128 cv[4], mv[4];
    for (int r = 0; r < 4; r++) { acc[r] = _mm512_setzero_ps(); cv[r] = mv[r] = _mm_setzero_ps(); }
    for (int b = 0; b < nb; b += 4) {
        __m512i ylo = _mm512_loadu_si512((const void *)(a.qn + 32 * b));
        __m512i yhi = _mm512_loadu_si512((const void *)(a.qn + 32 * b + 64));
        __m128 d4 = _mm_loadu_ps(a.d + b), dsy = _mm_loadu_ps(a.dsy + b);
        for (int r = 0; r < 4; r++) {
            const uint8_t *wr = w + r * rb + (int64_t)b / 4 * 4 * bs;
            _mm_prefetch((const char *)(wr + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(wr + PREFETCH + 64), _MM_HINT_T0);
            __m512i lo, hi;
            __m128i sq;
            __m128 dw = b32x4_unpack(&k, t, wr, &lo, &hi, &sq);
            cv[r] = _mm_fmadd_ps(dw, dsy, cv[r]);
            if (mins) mv[r] = _mm_fmadd_ps(_mm_cvtph_ps(_mm_srli_si128(sq, 8)), dsy, mv[r]);
            __m512 s4 = _mm512_castps128_ps512(_mm_mul_ps(dw, d4));
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, ylo);
            p = _mm512_dpbusd_epi32(p, hi, yhi);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(sel, s4), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) {
        __m128 c2 = _mm_add_ps(cv[r], _mm_movehl_ps(cv[r], cv[r])), m2 = _mm_add_ps(mv[r], _mm_movehl_ps(mv[r], mv[r]));
        float corr = _mm_cvtss_f32(_mm_add_ss(c2, _mm_movehdup_ps(c2)));
        float mcorr = _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
        out[r] = hsum16(acc[r]) - offset * corr + mcorr;
    }
}

/* Q8_0: 4 blocks of one row (wr) against the activation's blocks b .. b+3 (y0, y1: their int8
 * values, d4 / dsy: their scales and scaled sums): adds to *acc and the offset term to *cv (the
 * int8 values xor 0x80 are value + 128, dot4_b32_512's plan for the 8-bit type) */
static inline __attribute__((always_inline)) void q80_step(const uint8_t *wr, __m512i y0, __m512i y1, __m128 d4,
                                                           __m128 dsy, __m512 *acc, __m128 *cv) {
    const __m512i sel01 = _mm512_inserti64x4(_mm512_set1_epi32(0), _mm256_set1_epi32(1), 1);
    const __m512i sel23 = _mm512_inserti64x4(_mm512_set1_epi32(2), _mm256_set1_epi32(3), 1);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i u01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wr + 2))),
                                     _mm256_loadu_si256((const __m256i *)(wr + 36)), 1);
    __m512i u23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wr + 70))),
                                     _mm256_loadu_si256((const __m256i *)(wr + 104)), 1);
    __m128i sq = _mm_setr_epi16((short)rd16(wr), (short)rd16(wr + 34), (short)rd16(wr + 68),
                                (short)rd16(wr + 102), 0, 0, 0, 0);
    __m128 dw = _mm_cvtph_ps(sq);
    *cv = _mm_fmadd_ps(dw, dsy, *cv);
    __m512 s4 = _mm512_castps128_ps512(_mm_mul_ps(dw, d4));
    __m512i p01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(u01, flip), y0);
    __m512i p23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(u23, flip), y1);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p01), _mm512_permutexvar_ps(sel01, s4), *acc);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p23), _mm512_permutexvar_ps(sel23, s4), *acc);
}
static inline float q80_sum(__m512 acc, __m128 cv) {
    __m128 c2 = _mm_add_ps(cv, _mm_movehl_ps(cv, cv));
    return hsum16(acc) - 128.f * _mm_cvtss_f32(_mm_add_ss(c2, _mm_movehdup_ps(c2)));
}

/* Four Q8_0 rows at once (rows w + r * rb), nb a multiple of 4: the activation loaded once per
 * 4 blocks for the four rows */
static void dot4_q80_512(const uint8_t *w, int64_t rb, qact a, int nb, float *out) {
    __m512 acc[4];
    __m128 cv[4];
    for (int r = 0; r < 4; r++) { acc[r] = _mm512_setzero_ps(); cv[r] = _mm_setzero_ps(); }
    for (int b = 0; b < nb; b += 4) {
        __m512i y0 = _mm512_loadu_si512((const void *)(a.q + 32 * b));
        __m512i y1 = _mm512_loadu_si512((const void *)(a.q + 32 * b + 64));
        __m128 d4 = _mm_loadu_ps(a.d + b), dsy = _mm_loadu_ps(a.dsy + b);
        for (int r = 0; r < 4; r++) {
            const uint8_t *wr = w + r * rb + (int64_t)b * 34;
            _mm_prefetch((const char *)(wr + PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(wr + PREFETCH + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(wr + PREFETCH + 128), _MM_HINT_T0);
            q80_step(wr, y0, y1, d4, dsy, &acc[r], &cv[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = q80_sum(acc[r], cv[r]);
}

/* One Q8_0 row, nb a multiple of 4: the same sums in the same order as a row of dot4_q80_512
 * (bit for bit), reading one row after the other. A matrix that streams from memory once (a
 * decode step) is read faster as one sequential run than as the four interleaved runs of
 * dot4_q80_512: 0.87x the time on a 151936 x 2048 matrix, one thread (a loaded machine); from
 * the caches 1.06x. */
static float dot_q80_512(const uint8_t *w, qact a, int nb) {
    __m512 acc = _mm512_setzero_ps();
    __m128 cv = _mm_setzero_ps();
    for (int b = 0; b < nb; b += 4) {
        const uint8_t *wr = w + (int64_t)b * 34;
        if (!(b & 4))           /* 272 bytes ahead per 8 blocks */
            for (int c = 0; c < 272; c += 64) _mm_prefetch((const char *)(wr + PREFETCH + c), _MM_HINT_T0);
        q80_step(wr, _mm512_loadu_si512((const void *)(a.q + 32 * b)), _mm512_loadu_si512((const void *)(a.q + 32 * b + 64)),
                 _mm_loadu_ps(a.d + b), _mm_loadu_ps(a.dsy + b), &acc, &cv);
    }
    return q80_sum(acc, cv);
}

/* Q4_K, Q5_K: 8 sub-blocks of 32 per super-block (k45_sb) */
/* one super-block of a Q4_K / Q5_K row (w) against the K-quant activation's super-block sb:
 * adds its sub-block products to *acc and its mins term to *macc */
static inline __attribute__((always_inline)) void k45_sb(int t, const uint8_t *w, qact a, int sb, __m512 *acc,
                                                         __m256 *macc) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    /* int16 lane i of the scale vector of sub-blocks (2p, 2p+1): scale 2p for lanes 0..15 */
    const __m512i sel0 = _mm512_set_epi16(1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1, 0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0);
    int bs = t == T_Q4_K ? 144 : 176;
    for (int c = 0; c < bs; c += 64) _mm_prefetch((const char *)(w + PREFETCH + c), _MM_HINT_T0);
    float dy = a.dk[sb], d = mf_h2f(rd16(w)) * dy, dmin = mf_h2f(rd16(w + 2)) * dy;
    const uint8_t *qh = w + 16, *qs = w + (t == T_Q4_K ? 16 : 48);
    const int8_t *y = a.qk + 256 * sb;
    __m128i s8 = k4_scales(w + 4);
    __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(s8));     /* 8 scales as int16 */
    /* mins: sum_j m_j * (sum of q over sub-block j) = madd(m per 16 values, sums per 16) */
    __m128i m16 = _mm_cvtepu8_epi16(_mm_srli_si128(s8, 8));
    __m256i mm = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(m16, m16)),
                                         _mm_unpackhi_epi16(m16, m16), 1);
    __m256i ms = _mm256_madd_epi16(mm, _mm256_loadu_si256((const __m256i *)(a.sk16 + 16 * sb)));
    *macc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(dmin), *macc);
    __m512i isum = _mm512_setzero_si512();
    __m256i hb = t == T_Q5_K ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
#define K45_STEP(P)                                                                                   \
    {                                                                                                 \
        __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * (P)));                              \
        __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4); \
        __m512i va = _mm512_shuffle_i64x2(lo, hi, 0x44), vb = _mm512_shuffle_i64x2(lo, hi, 0xEE);      \
        if (t == T_Q5_K) {                                                                            \
            __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(hb, 4 * (P))),      \
                                           _mm256_srli_epi16(hb, 4 * (P) + 1), 1);                    \
            __m512i h2 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(hb, 4 * (P) + 2)), \
                                            _mm256_srli_epi16(hb, 4 * (P) + 3), 1);                   \
            va = _mm512_or_si512(va, _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(1)), 4));  \
            vb = _mm512_or_si512(vb, _mm512_slli_epi16(_mm512_and_si512(h2, _mm512_set1_epi8(1)), 4)); \
        }                                                                                             \
        __m512i pa = _mm512_maddubs_epi16(va, _mm512_loadu_si512((const void *)(y + 128 * (P))));      \
        __m512i pb = _mm512_maddubs_epi16(vb, _mm512_loadu_si512((const void *)(y + 128 * (P) + 64))); \
        __m512i sa = _mm512_permutexvar_epi16(_mm512_add_epi16(sel0, _mm512_set1_epi16(4 * (P))), sc16); \
        __m512i sbv = _mm512_permutexvar_epi16(_mm512_add_epi16(sel0, _mm512_set1_epi16(4 * (P) + 2)), sc16); \
        isum = _mm512_dpwssd_epi32(isum, pa, sa);                                                     \
        isum = _mm512_dpwssd_epi32(isum, pb, sbv);                                                    \
    }
    K45_STEP(0)
    K45_STEP(1)
#undef K45_STEP
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d), *acc);
}

static float dot_k45_512(int t, const uint8_t *w, qact a, int K) {
    int bs = t == T_Q4_K ? 144 : 176;
    __m512 acc = _mm512_setzero_ps();
    __m256 macc = _mm256_setzero_ps();
    for (int sb = 0; sb < K / 256; sb++, w += bs) k45_sb(t, w, a, sb, &acc, &macc);
    return hsum16(acc) - hsum8(macc);
}

/* four Q4_K / Q5_K rows at once (rows w + r * rb): the super-blocks of the four rows in turn,
 * four independent chains of sums against one activation super-block */
static void dot4_k45_512(int t, const uint8_t *w, int64_t rb, qact a, int K, float *out) {
    int bs = t == T_Q4_K ? 144 : 176;
    __m512 acc[4];
    __m256 macc[4];
    for (int r = 0; r < 4; r++) { acc[r] = _mm512_setzero_ps(); macc[r] = _mm256_setzero_ps(); }
    for (int sb = 0; sb < K / 256; sb++)
        for (int r = 0; r < 4; r++) k45_sb(t, w + r * rb + (int64_t)sb * bs, a, sb, &acc[r], &macc[r]);
    for (int r = 0; r < 4; r++) out[r] = hsum16(acc[r]) - hsum8(macc[r]);
}

/* Q6_K: 16 sub-blocks of 16, int8 scales, values q - 32 */
static inline __attribute__((always_inline)) void q6k_sb(const uint8_t *w, qact a, int sb, __m512 *acc, __m256 *oacc) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3);
    /* int16 lane i of the scale vector of values 64g .. 64g+63: scale 4g + i / 8 */
    const __m512i sel = _mm512_set_epi16(3,3,3,3,3,3,3,3, 2,2,2,2,2,2,2,2, 1,1,1,1,1,1,1,1, 0,0,0,0,0,0,0,0);
    for (int c = 0; c < 210; c += 64) _mm_prefetch((const char *)(w + PREFETCH + c), _MM_HINT_T0);
    const uint8_t *ql = w, *qh = w + 128;
    float d = mf_h2f(rd16(w + 208)) * a.dk[sb];
    const int8_t *y = a.qk + 256 * sb;
    __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));   /* 16 scales */
    __m256i os = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(a.sk16 + 16 * sb)));
    *oacc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(os), _mm256_set1_ps(32.f * d), *oacc);
    __m512i scw = _mm512_castsi256_si512(sc16);
    __m512i isum = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        __m512i L = _mm512_loadu_si512((const void *)(ql + 64 * h));
        __m256i H = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        __m512i ha = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1);
        __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(H, 4)), _mm256_srli_epi16(H, 6), 1);
        __m512i va = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(ha, m2), 4));
        __m512i vb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                     _mm512_slli_epi16(_mm512_and_si512(hb, m2), 4));
        __m512i pa = _mm512_maddubs_epi16(va, _mm512_loadu_si512((const void *)(y + 128 * h)));
        __m512i pb = _mm512_maddubs_epi16(vb, _mm512_loadu_si512((const void *)(y + 128 * h + 64)));
        __m512i sa = _mm512_permutexvar_epi16(_mm512_add_epi16(sel, _mm512_set1_epi16(8 * h)), scw);
        __m512i sbv = _mm512_permutexvar_epi16(_mm512_add_epi16(sel, _mm512_set1_epi16(8 * h + 4)), scw);
        isum = _mm512_dpwssd_epi32(isum, pa, sa);
        isum = _mm512_dpwssd_epi32(isum, pb, sbv);
    }
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d), *acc);
}

static float dot_q6k_512(const uint8_t *w, qact a, int K) {
    __m512 acc = _mm512_setzero_ps();
    __m256 oacc = _mm256_setzero_ps();
    for (int sb = 0; sb < K / 256; sb++, w += 210) q6k_sb(w, a, sb, &acc, &oacc);
    return hsum16(acc) - hsum8(oacc);
}

/* four Q6_K rows at once (rows w + r * rb), as dot4_k45_512 */
static void dot4_q6k_512(const uint8_t *w, int64_t rb, qact a, int K, float *out) {
    __m512 acc[4];
    __m256 oacc[4];
    for (int r = 0; r < 4; r++) { acc[r] = _mm512_setzero_ps(); oacc[r] = _mm256_setzero_ps(); }
    for (int sb = 0; sb < K / 256; sb++)
        for (int r = 0; r < 4; r++) q6k_sb(w + r * rb + (int64_t)sb * 210, a, sb, &acc[r], &oacc[r]);
    for (int r = 0; r < 4; r++) out[r] = hsum16(acc[r]) - hsum8(oacc[r]);
}

/* One Q6_K row against NA activation rows (NA <= Q6K_MAXT): each super-block unpacked into
 * registers once (values and scale vectors, as q6k_sb) and multiplied by every activation
 * row, so a prefill step whose tokens share an expert unpacks each row once per Q6K_MAXT
 * tokens rather than once per token. Each activation row gets q6k_sb's float operations in
 * q6k_sb's order (a super-block's sums in integers, then one fmadd per super-block), so its
 * value is bit for bit dot_q6k_512's. out[i * ldo] = the row's product with acts[i]. */
#define Q6K_MAXT 8
static inline __attribute__((always_inline)) void q6k_tok_t(const uint8_t *w, int K, const qact *acts, const int NA,
                                                            float *out, int64_t ldo) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3);
    const __m512i sel = _mm512_set_epi16(3,3,3,3,3,3,3,3, 2,2,2,2,2,2,2,2, 1,1,1,1,1,1,1,1, 0,0,0,0,0,0,0,0);
    __m512 acc[Q6K_MAXT];
    __m256 oacc[Q6K_MAXT];
    for (int i = 0; i < NA; i++) { acc[i] = _mm512_setzero_ps(); oacc[i] = _mm256_setzero_ps(); }
    for (int sb = 0; sb < K / 256; sb++, w += 210) {
        for (int c = 0; c < 210; c += 64) _mm_prefetch((const char *)(w + PREFETCH + c), _MM_HINT_T0);
        const uint8_t *ql = w, *qh = w + 128;
        float dw = mf_h2f(rd16(w + 208));
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
        __m512i scw = _mm512_castsi256_si512(sc16);
        __m512i v[4], s[4];
        for (int h = 0; h < 2; h++) {
            __m512i L = _mm512_loadu_si512((const void *)(ql + 64 * h));
            __m256i H = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m512i ha = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1);
            __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(H, 4)), _mm256_srli_epi16(H, 6), 1);
            v[2 * h] = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(ha, m2), 4));
            v[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                           _mm512_slli_epi16(_mm512_and_si512(hb, m2), 4));
            s[2 * h] = _mm512_permutexvar_epi16(_mm512_add_epi16(sel, _mm512_set1_epi16(8 * h)), scw);
            s[2 * h + 1] = _mm512_permutexvar_epi16(_mm512_add_epi16(sel, _mm512_set1_epi16(8 * h + 4)), scw);
        }
        for (int i = 0; i < NA; i++) {
            float d = dw * acts[i].dk[sb];
            const int8_t *y = acts[i].qk + 256 * sb;
            __m256i os = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(acts[i].sk16 + 16 * sb)));
            oacc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(os), _mm256_set1_ps(32.f * d), oacc[i]);
            __m512i isum = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++)
                isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(v[k], _mm512_loadu_si512((const void *)(y + 64 * k))),
                                           s[k]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d), acc[i]);
        }
    }
    for (int i = 0; i < NA; i++) out[i * ldo] = hsum16(acc[i]) - hsum8(oacc[i]);
}

/* (q6k_tok_t) na activation rows, any na >= 0: runs of Q6K_MAXT, then the rest at once */
static void q6k_tok(const uint8_t *w, int K, const qact *acts, int na, float *out, int64_t ldo) {
    for (; na >= Q6K_MAXT; na -= Q6K_MAXT, acts += Q6K_MAXT, out += Q6K_MAXT * ldo)
        q6k_tok_t(w, K, acts, Q6K_MAXT, out, ldo);
    switch (na) {
    case 7: q6k_tok_t(w, K, acts, 7, out, ldo); break;
    case 6: q6k_tok_t(w, K, acts, 6, out, ldo); break;
    case 5: q6k_tok_t(w, K, acts, 5, out, ldo); break;
    case 4: q6k_tok_t(w, K, acts, 4, out, ldo); break;
    case 3: q6k_tok_t(w, K, acts, 3, out, ldo); break;
    case 2: q6k_tok_t(w, K, acts, 2, out, ldo); break;
    case 1: q6k_tok_t(w, K, acts, 1, out, ldo); break;
    default: break;
    }
}
#define HAVE_Q6K_TOK 1

static qact qact_at(uint8_t *base, int K);

/* ---- Q6_K against many activation rows (a prompt's tokens on one expert, a dense product of
 * a prompt): Q6K_TILE_ROWS = 16 weight rows at a time. Each super-block of the 16 rows is
 * unpacked once into a transposed layout (q6k_pack16: 32-bit lane r of vector 4s + k holds
 * values 16s + 4k .. 16s + 4k + 3 of row r, unsigned 0..63), so one vpdpbusd multiplies 4
 * values of 16 rows by 4 values of one activation row (broadcast) and a lane sums a whole
 * 16-value sub-block in integers; the sub-block's int8 scale then multiplies the 16 lanes
 * (vpmulld), the offset 32 entering as the sub-block's start value -32 * (sum of its 16
 * activation values). Per super-block each (row, activation row) gets the exact integer
 * I = sum_s sc_s * sum_{k in s} (q_k - 32) * y_k, then acc = fmadd(float(I), d_w * d_y, acc)
 * in super-block order: the value does not depend on how many activation rows share the call
 * (a row alone == in a batch), and differs from the one-row kernel (dot_q6k_512, per-lane
 * float sums) by fp32 rounding only. */
#define HAVE_Q6K_TILE 1
#define Q6K_TILE_ROWS 16
#define Q6K_TILE_TOK 8       /* activation rows per register tile (the rest switches cover 1..7) */
#define Q6K_TILE_MAXA 128    /* activation rows per pass over the weight rows (accumulators on the stack) */
/* tokens of an expert (activation rows of a product) from which q6k_tile runs rather than
 * q6k_tok: one above the 24 up to which the C kernels ran Q6_K before it (the batches that gave
 * each row its one-row value bit for bit still do). The tile is faster from 8 rows (a 512 x 1024
 * matrix, one thread, loaded machine: 0.039 against 0.057 ms at 8, 0.062 / 0.101 at 16) but its
 * fp32 sums are another order's than the one-row kernel's. */
#ifndef Q6K_TILE_MIN
#define Q6K_TILE_MIN 25
#endif
/* Q5_K (q5k_tile) likewise from Q5K_TILE_MIN rows */
#ifndef Q5K_TILE_MIN
#define Q5K_TILE_MIN 25
#endif
static inline int is_ktile(int t, int64_t n) { return t == T_Q6_K ? n >= Q6K_TILE_MIN : t == T_Q5_K && n >= Q5K_TILE_MIN; }

/* r[j] lane i <- r[i] lane j (16 x 16 32-bit lanes) */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

/* super-block sb of the 16 rows w + r * rb into P [64][64] (the transposed values), SC [16][16]
 * (int32 scale of sub-block s, row r at 16 s + r) and DW [16] (the rows' d) */
static void q6k_pack16(const uint8_t *w, int64_t rb, int sb, uint8_t *P, int32_t *SC, float *DW) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3);
    uint8_t tmp[16 * 256] __attribute__((aligned(64)));
    __m512i r[16];
    /* the next 16 rows (contiguous after these), a K/256-th of them per super-block */
    const uint8_t *nx = w + 16 * rb + (int64_t)sb * 16 * 210;
    for (int c = 0; c < 16 * 210; c += 64) _mm_prefetch((const char *)(nx + c), _MM_HINT_T0);
    for (int j = 0; j < 16; j++) {
        const uint8_t *b = w + j * rb + (int64_t)sb * 210, *ql = b, *qh = b + 128;
        DW[j] = mf_h2f(rd16(b + 208));
        r[j] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)));
        for (int h = 0; h < 2; h++) {
            __m512i L = _mm512_loadu_si512((const void *)(ql + 64 * h));
            __m256i H = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m512i ha = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1);
            __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(H, 4)), _mm256_srli_epi16(H, 6), 1);
            _mm512_store_si512((void *)(tmp + 256 * j + 128 * h),
                               _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(ha, m2), 4)));
            _mm512_store_si512((void *)(tmp + 256 * j + 128 * h + 64),
                               _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                               _mm512_slli_epi16(_mm512_and_si512(hb, m2), 4)));
        }
    }
    transpose16_epi32(r);
    for (int s = 0; s < 16; s++) _mm512_store_si512((void *)(SC + 16 * s), r[s]);
    for (int g = 0; g < 4; g++) {
        for (int j = 0; j < 16; j++) r[j] = _mm512_load_si512((const void *)(tmp + 256 * j + 64 * g));
        transpose16_epi32(r);
        for (int j = 0; j < 16; j++) _mm512_store_si512((void *)(P + 64 * (16 * g + j)), r[j]);
    }
}

/* NA (<= Q6K_TILE_TOK) activation rows (their super-block sb's values y[i], the offsets
 * off[16 i + s] = -32 * (sum of sub-block s of y[i])) against a packed super-block: facc [NA][16]
 * += the super-block's products (see above) */
static inline __attribute__((always_inline)) void q6k_tile_t(const uint8_t *P, const int32_t *SC, const float *DW,
                                                             const int8_t *const *y, const int32_t *off, const float *dy,
                                                             const int NA, float *facc) {
    __m512i isb[Q6K_TILE_TOK];
    for (int i = 0; i < NA; i++) isb[i] = _mm512_setzero_si512();
    for (int s = 0; s < 16; s++) {
        __m512i w0 = _mm512_load_si512((const void *)(P + 64 * (4 * s))), w1 = _mm512_load_si512((const void *)(P + 64 * (4 * s + 1)));
        __m512i w2 = _mm512_load_si512((const void *)(P + 64 * (4 * s + 2))), w3 = _mm512_load_si512((const void *)(P + 64 * (4 * s + 3)));
        __m512i sc = _mm512_load_si512((const void *)(SC + 16 * s));
        for (int i = 0; i < NA; i++) {
            const int8_t *yi = y[i] + 16 * s;
            int32_t y0, y1, y2, y3;
            memcpy(&y0, yi, 4); memcpy(&y1, yi + 4, 4); memcpy(&y2, yi + 8, 4); memcpy(&y3, yi + 12, 4);
            __m512i a = _mm512_set1_epi32(off[16 * i + s]);
            a = _mm512_dpbusd_epi32(a, w0, _mm512_set1_epi32(y0));
            a = _mm512_dpbusd_epi32(a, w1, _mm512_set1_epi32(y1));
            a = _mm512_dpbusd_epi32(a, w2, _mm512_set1_epi32(y2));
            a = _mm512_dpbusd_epi32(a, w3, _mm512_set1_epi32(y3));
            isb[i] = _mm512_add_epi32(isb[i], _mm512_mullo_epi32(a, sc));
        }
    }
    __m512 dw = _mm512_load_ps(DW);
    for (int i = 0; i < NA; i++) {
        __m512 f = _mm512_load_ps(facc + 16 * i);
        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isb[i]), _mm512_mul_ps(dw, _mm512_set1_ps(dy[i])), f);
        _mm512_store_ps(facc + 16 * i, f);
    }
}

/* 16 Q6_K rows (w + r * rb) against na activation rows (na <= Q6K_TILE_MAXA): out[i * ldo + r]
 * = row r . acts[i] */
static void q6k_tile(const uint8_t *w, int64_t rb, int K, const qact *acts, int na, float *out, int64_t ldo) {
    uint8_t P[64 * 64] __attribute__((aligned(64)));
    int32_t SC[256] __attribute__((aligned(64)));
    float DW[16] __attribute__((aligned(64)));
    float facc[Q6K_TILE_MAXA * 16] __attribute__((aligned(64)));
    int32_t off[Q6K_TILE_MAXA * 16] __attribute__((aligned(64)));
    const int8_t *y[Q6K_TILE_MAXA];
    float dy[Q6K_TILE_MAXA];
    memset(facc, 0, sizeof(float) * 16 * na);
    for (int sb = 0; sb < K / 256; sb++) {
        q6k_pack16(w, rb, sb, P, SC, DW);
        for (int i = 0; i < na; i++) {
            y[i] = acts[i].qk + 256 * sb;
            dy[i] = acts[i].dk[sb];
            __m512i s16 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(acts[i].sk16 + 16 * sb)));
            _mm512_store_si512((void *)(off + 16 * i), _mm512_mullo_epi32(s16, _mm512_set1_epi32(-32)));
        }
        int i = 0;
        for (; i + Q6K_TILE_TOK <= na; i += Q6K_TILE_TOK)
            q6k_tile_t(P, SC, DW, y + i, off + 16 * i, dy + i, Q6K_TILE_TOK, facc + 16 * i);
        switch (na - i) {
#define Q6K_TILE_REST(n) case n: q6k_tile_t(P, SC, DW, y + i, off + 16 * i, dy + i, n, facc + 16 * i); break;
        Q6K_TILE_REST(7) Q6K_TILE_REST(6) Q6K_TILE_REST(5) Q6K_TILE_REST(4) Q6K_TILE_REST(3) Q6K_TILE_REST(2)
        Q6K_TILE_REST(1)
#undef Q6K_TILE_REST
        default: break;
        }
    }
    for (int i = 0; i < na; i++) memcpy(out + i * ldo, facc + 16 * i, 16 * sizeof(float));
}

/* Q5_K the same way (q5k_tile): 16 rows' super-block unpacked to values 0..31 in q6k_pack16's
 * transposed layout, 8 sub-blocks of 32 (vectors 8s .. 8s + 7), so a lane sums a sub-block of 32
 * in integers before its 6-bit scale multiplies it; the mins term sum_s m_s * (sum of sub-block
 * s of y) by vpdpwssd on the activation's sums per 16. Per super-block the exact integers
 * I = sum_s sc_s * sum_{k in s} q_k y_k and M = sum_s m_s * sum_{k in s} y_k, then
 * acc = fmadd(float(I), d * d_y, acc), acc = fnmadd(float(M), dmin * d_y, acc). */
static void q5k_pack16(const uint8_t *w, int64_t rb, int sb, uint8_t *P, int32_t *SC, int32_t *MN, float *DW,
                       float *DM) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
    uint8_t tmp[16 * 256] __attribute__((aligned(64)));
    __m512i r[16];
    const uint8_t *nx = w + 16 * rb + (int64_t)sb * 16 * 176;
    for (int c = 0; c < 16 * 176; c += 64) _mm_prefetch((const char *)(nx + c), _MM_HINT_T0);
    for (int j = 0; j < 16; j++) {
        const uint8_t *b = w + j * rb + (int64_t)sb * 176, *qs = b + 48;
        DW[j] = mf_h2f(rd16(b));
        DM[j] = mf_h2f(rd16(b + 2));
        r[j] = _mm512_cvtepu8_epi32(k4_scales(b + 4));     /* lanes 0..7 scales, 8..15 mins */
        __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 16));
        for (int p = 0; p < 2; p++) {
            __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * p));
            __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
            __m512i va = _mm512_shuffle_i64x2(lo, hi, 0x44), vb = _mm512_shuffle_i64x2(lo, hi, 0xEE);
            __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(hb, 4 * p)), _mm256_srli_epi16(hb, 4 * p + 1), 1);
            __m512i h2 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(hb, 4 * p + 2)),
                                            _mm256_srli_epi16(hb, 4 * p + 3), 1);
            va = _mm512_or_si512(va, _mm512_slli_epi16(_mm512_and_si512(h, one), 4));
            vb = _mm512_or_si512(vb, _mm512_slli_epi16(_mm512_and_si512(h2, one), 4));
            _mm512_store_si512((void *)(tmp + 256 * j + 128 * p), va);
            _mm512_store_si512((void *)(tmp + 256 * j + 128 * p + 64), vb);
        }
    }
    transpose16_epi32(r);
    for (int s = 0; s < 8; s++) {
        _mm512_store_si512((void *)(SC + 16 * s), r[s]);
        /* the min as the two int16 halves of a lane (vpdpwssd against two sums per 16) */
        _mm512_store_si512((void *)(MN + 16 * s), _mm512_or_si512(r[8 + s], _mm512_slli_epi32(r[8 + s], 16)));
    }
    for (int g = 0; g < 4; g++) {
        for (int j = 0; j < 16; j++) r[j] = _mm512_load_si512((const void *)(tmp + 256 * j + 64 * g));
        transpose16_epi32(r);
        for (int j = 0; j < 16; j++) _mm512_store_si512((void *)(P + 64 * (16 * g + j)), r[j]);
    }
}

static inline __attribute__((always_inline)) void q5k_tile_t(const uint8_t *P, const int32_t *SC, const int32_t *MN,
                                                             const float *DW, const float *DM, const int8_t *const *y,
                                                             const int16_t *const *ys, const float *dy, const int NA,
                                                             float *facc) {
    __m512i isb[Q6K_TILE_TOK];
    for (int i = 0; i < NA; i++) isb[i] = _mm512_setzero_si512();
    for (int s = 0; s < 8; s++) {
        __m512i wv[8];
        for (int k = 0; k < 8; k++) wv[k] = _mm512_load_si512((const void *)(P + 64 * (8 * s + k)));
        __m512i sc = _mm512_load_si512((const void *)(SC + 16 * s));
        /* unrolled so that isb stays in registers (else gcc keeps it on the stack: 0.7x) */
#pragma GCC unroll 8
        for (int i = 0; i < NA; i++) {
            const int8_t *yi = y[i] + 32 * s;
            __m512i a = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                int32_t v;
                memcpy(&v, yi + 4 * k, 4);
                a = _mm512_dpbusd_epi32(a, wv[k], _mm512_set1_epi32(v));
            }
            isb[i] = _mm512_add_epi32(isb[i], _mm512_mullo_epi32(a, sc));
        }
    }
    __m512 dw = _mm512_load_ps(DW), dm = _mm512_load_ps(DM);
    for (int i = 0; i < NA; i++) {
        __m512i msb = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            int32_t v;
            memcpy(&v, ys[i] + 2 * s, 4);
            msb = _mm512_dpwssd_epi32(msb, _mm512_load_si512((const void *)(MN + 16 * s)), _mm512_set1_epi32(v));
        }
        __m512 f = _mm512_load_ps(facc + 16 * i), d = _mm512_set1_ps(dy[i]);
        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isb[i]), _mm512_mul_ps(dw, d), f);
        f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msb), _mm512_mul_ps(dm, d), f);
        _mm512_store_ps(facc + 16 * i, f);
    }
}

/* 16 Q5_K rows (w + r * rb) against na activation rows (na <= Q6K_TILE_MAXA), as q6k_tile */
static void q5k_tile(const uint8_t *w, int64_t rb, int K, const qact *acts, int na, float *out, int64_t ldo) {
    uint8_t P[64 * 64] __attribute__((aligned(64)));
    int32_t SC[128] __attribute__((aligned(64))), MN[128] __attribute__((aligned(64)));
    float DW[16] __attribute__((aligned(64))), DM[16] __attribute__((aligned(64)));
    float facc[Q6K_TILE_MAXA * 16] __attribute__((aligned(64)));
    const int8_t *y[Q6K_TILE_MAXA];
    const int16_t *ys[Q6K_TILE_MAXA];
    float dy[Q6K_TILE_MAXA];
    memset(facc, 0, sizeof(float) * 16 * na);
    for (int sb = 0; sb < K / 256; sb++) {
        q5k_pack16(w, rb, sb, P, SC, MN, DW, DM);
        for (int i = 0; i < na; i++) {
            y[i] = acts[i].qk + 256 * sb;
            ys[i] = acts[i].sk16 + 16 * sb;
            dy[i] = acts[i].dk[sb];
        }
        int i = 0;
        for (; i + Q6K_TILE_TOK <= na; i += Q6K_TILE_TOK)
            q5k_tile_t(P, SC, MN, DW, DM, y + i, ys + i, dy + i, Q6K_TILE_TOK, facc + 16 * i);
        switch (na - i) {
#define Q5K_TILE_REST(n) case n: q5k_tile_t(P, SC, MN, DW, DM, y + i, ys + i, dy + i, n, facc + 16 * i); break;
        Q5K_TILE_REST(7) Q5K_TILE_REST(6) Q5K_TILE_REST(5) Q5K_TILE_REST(4) Q5K_TILE_REST(3) Q5K_TILE_REST(2)
        Q5K_TILE_REST(1)
#undef Q5K_TILE_REST
        default: break;
        }
    }
    for (int i = 0; i < na; i++) memcpy(out + i * ldo, facc + 16 * i, 16 * sizeof(float));
}

/* q6k_tile / q5k_tile (t: T_Q6_K or T_Q5_K) over any number of activation rows: row i's quantized
 * form at base + idx[i] * qb (idx NULL: base + i * qb), out[i * ldo + r] */
static void ktile_rows(int t, const uint8_t *w, int64_t rb, int K, const uint8_t *base, int64_t qb, const int64_t *idx,
                       int64_t n, float *out, int64_t ldo) {
    qact acts[Q6K_TILE_MAXA];
    for (int64_t i0 = 0; i0 < n; i0 += Q6K_TILE_MAXA) {
        int na = (int)(n - i0 < Q6K_TILE_MAXA ? n - i0 : Q6K_TILE_MAXA);
        for (int i = 0; i < na; i++) acts[i] = qact_at((uint8_t *)base + (idx ? idx[i0 + i] : i0 + i) * qb, K);
        if (t == T_Q6_K) q6k_tile(w, rb, K, acts, na, out + i0 * ldo, ldo);
        else q5k_tile(w, rb, K, acts, na, out + i0 * ldo, ldo);
    }
}

#endif


#if defined(HAVE512) && defined(__AVX512BF16__)
#define HAVE_BF16DOT 1
/* BF16 weights . bf16 activations: vdpbf16ps (pairs of exact bf16 products, fp32 sums) */
static float dot_bf16x_512(const uint8_t *w, const uint16_t *x, int K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 64 <= K; i += 64) {
        _mm_prefetch((const char *)(w + 2 * i + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 2 * i + PREFETCH + 64), _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w + 2 * i)),
                              (__m512bh)_mm512_loadu_si512((const void *)(x + i)));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w + 2 * i + 64)),
                              (__m512bh)_mm512_loadu_si512((const void *)(x + i + 32)));
    }
    for (; i + 32 <= K; i += 32)
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w + 2 * i)),
                              (__m512bh)_mm512_loadu_si512((const void *)(x + i)));
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; i < K; i++) sum += mf_b2f(rd16(w + 2 * i)) * mf_b2f(x[i]);
    return sum;
}

/* dot_bf16x_512 of one weight row against 4 activation rows (x, x + ldx, ...): each row's
 * weights loaded once for the 4 (a step of 4 sequences reads a dense matrix once and
 * multiplies it from registers), every output summed in exactly dot_bf16x_512's order */
static void dot_bf16x4_512(const uint8_t *w, const uint16_t *x, int64_t ldx, int K, float *out) {
    __m512 a0[4], a1[4];
    for (int j = 0; j < 4; j++) a0[j] = a1[j] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 64 <= K; i += 64) {
        _mm_prefetch((const char *)(w + 2 * i + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 2 * i + PREFETCH + 64), _MM_HINT_T0);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(w + 2 * i));
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(w + 2 * i + 64));
        for (int j = 0; j < 4; j++) {
            a0[j] = _mm512_dpbf16_ps(a0[j], w0, (__m512bh)_mm512_loadu_si512((const void *)(x + j * ldx + i)));
            a1[j] = _mm512_dpbf16_ps(a1[j], w1, (__m512bh)_mm512_loadu_si512((const void *)(x + j * ldx + i + 32)));
        }
    }
    for (; i + 32 <= K; i += 32) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(w + 2 * i));
        for (int j = 0; j < 4; j++)
            a0[j] = _mm512_dpbf16_ps(a0[j], w0, (__m512bh)_mm512_loadu_si512((const void *)(x + j * ldx + i)));
    }
    for (int j = 0; j < 4; j++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0[j], a1[j]));
        for (int k = i; k < K; k++) sum += mf_b2f(rd16(w + 2 * k)) * mf_b2f(x[j * ldx + k]);
        out[j] = sum;
    }
}
#endif

#ifdef __AVX512F__
/* F16 weights, one row . one fp32 activation row: 16 weights at a time converted as two 8-wide
 * halves (vcvtph2ps ymm, exact) joined for one 16-wide fused multiply-add, two accumulators,
 * fp32 sums, the tail one by one. The row is read alone, front to back, as the BF16 rows are:
 * measured on the CI machine (AMD EPYC, AVX-512 BF16, one thread, 1024-wide rows), 16-wide
 * vcvtph2ps from memory ran at 5.4 G weights/s on rows streamed from DRAM and the former four
 * rows side by side at 5.5, against 8-10 G/s for this loop and 9-10 G/s for vdpbf16ps on BF16
 * rows; on rows in the caches 20-22 G/s against the four rows' 17 (BF16: 40-47). */
static inline __m512 f16x16_ps(const uint8_t *p) {     /* 16 fp16 at p, as two 8-wide halves */
    __m256d lo = _mm256_castps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
    __m256d hi = _mm256_castps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
}

static float dot_f16_512(const uint8_t *w, const float *x, int K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= K; i += 32) {
        _mm_prefetch((const char *)(w + 2 * i + PREFETCH), _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(f16x16_ps(w + 2 * i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(f16x16_ps(w + 2 * i + 32), _mm512_loadu_ps(x + i + 16), a1);
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; i < K; i++) sum += mf_h2f(rd16(w + 2 * i)) * x[i];
    return sum;
}
#endif

/* v[0..n) rounded to fp16 (nearest even) and back: the fp16 tensor torch holds, 16 at a time
 * where AVX-512 is (vcvtps2ph / vcvtph2ps, the scalar conversions' results) */
static inline void round_f16(float *v, int n) {
    int j = 0;
#ifdef __AVX512F__
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(v + j, _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_loadu_ps(v + j),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
#endif
    for (; j < n; j++) v[j] = mf_h2f(mf_f2h(v[j]));
}

/* ---- Q2_K, Q3_K, IQ4_XS and the IQ grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
 * IQ1_M): 256-value super-blocks, unpacked one at a time ----------------------------------------
 * Each super-block is unpacked (lb_unpack) into signed int8 values v [256], an integer scale per
 * 16 values sc [16] and one fp32 factor f, with (Q2_K) an integer min per 16 values mn [16] and
 * a factor fmin, such that the dequantized value i is f * sc[i/16] * v[i] - fmin * mn[i/16]
 * exactly (ggml-quants.c dequantize_row_*; gguf/quants.py): the scales' constant factors, powers
 * of two, go into f (IQ2: d (0.5 + s) / 4 = d / 8 * (2s + 1); IQ1's grid value + delta is
 * (8 g +- 1) / 8), so v and sc are integers. The product with the K-quant activation (ggml's
 * Q8_K: qk, dk per 256, sums per 16) is then sum_g sc[g] * sum(v q) in integers, times f * dk,
 * less fmin * dk * sum_g mn[g] * sk16[g] (ggml_vec_dot_*_q8_K). The grid and sign tables come
 * from the gguf package at build time (MF_IQ_TABLES, generated by native.py); without them the
 * grid types are not built. */
#if MF_IQ_TABLES
#include "mf_iq_tables.h"
#endif

static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* 8 grid values with 8 sign bits (bit j set: value j negated) -> v */
static inline void lb_signed8(int8_t *v, uint64_t g, uint8_t signs) {
#if MF_IQ_TABLES
    /* bytes of (g ^ m) + (m & 1): a byte negated where its mask byte is 0xff (grid values are
     * never 0, so no byte carries into the next) */
    uint64_t m = MF_SIGN_MASK[signs];
    g = (g ^ m) + (m & 0x0101010101010101ull);
#else
    (void)signs;
#endif
    memcpy(v, &g, 8);
}

/* returns 1 when the type has mins (Q2_K), else 0 */
static int lb_unpack(int t, const uint8_t *w, int8_t *v, int32_t *sc, int32_t *mn, float *f, float *fmin) {
    switch (t) {
    case T_Q2_K: {
        const uint8_t *qs = w + 16;
        for (int n = 0; n < 2; n++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) v[128 * n + 32 * j + l] = (int8_t)((qs[32 * n + l] >> (2 * j)) & 3);
        for (int g = 0; g < 16; g++) { sc[g] = w[g] & 15; mn[g] = w[g] >> 4; }
        *f = mf_h2f(rd16(w + 80)); *fmin = mf_h2f(rd16(w + 82));
        return 1; }
    case T_Q3_K: {
        const uint8_t *hm = w, *qs = w + 32, *s = w + 96;
        for (int n = 0; n < 2; n++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++)
                    v[128 * n + 32 * j + l] = (int8_t)(((qs[32 * n + l] >> (2 * j)) & 3) - ((hm[l] >> (4 * n + j)) & 1 ? 0 : 4));
        for (int k = 0; k < 16; k++) {
            int lo = k < 8 ? s[k] & 15 : s[k - 8] >> 4, hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
            sc[k] = (lo | (hi << 4)) - 32;
        }
        *f = mf_h2f(rd16(w + 108));
        return 0; }
    case T_IQ4_XS: {
        uint16_t sh = rd16(w + 2);
        const uint8_t *sl = w + 4, *qs = w + 8;
        for (int ib = 0; ib < 8; ib++) {
            int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
            sc[2 * ib] = sc[2 * ib + 1] = ls - 32;
            for (int i = 0; i < 16; i++) {
                v[32 * ib + i] = KV_IQ4NL[qs[16 * ib + i] & 15];
                v[32 * ib + 16 + i] = KV_IQ4NL[qs[16 * ib + i] >> 4];
            }
        }
        *f = mf_h2f(rd16(w));
        return 0; }
#if MF_IQ_TABLES
    case T_IQ2_XXS: {
        for (int ib = 0; ib < 8; ib++) {
            uint32_t a0 = rd32(w + 2 + 8 * ib), a1 = rd32(w + 6 + 8 * ib);
            sc[2 * ib] = sc[2 * ib + 1] = 2 * (int32_t)(a1 >> 28) + 1;
            for (int l = 0; l < 4; l++)
                lb_signed8(v + 32 * ib + 8 * l, MF_IQ2XXS_GRID[(a0 >> (8 * l)) & 255], MF_KSIGNS[(a1 >> (7 * l)) & 127]);
        }
        *f = mf_h2f(rd16(w)) * 0.125f;
        return 0; }
    case T_IQ2_XS: {
        for (int k = 0; k < 32; k++) {
            uint16_t q = rd16(w + 2 + 2 * k);
            lb_signed8(v + 8 * k, MF_IQ2XS_GRID[q & 511], MF_KSIGNS[q >> 9]);
        }
        for (int g = 0; g < 16; g++) sc[g] = 2 * ((w[66 + g / 2] >> (4 * (g % 2))) & 15) + 1;
        *f = mf_h2f(rd16(w)) * 0.125f;
        return 0; }
    case T_IQ2_S: {
        const uint8_t *qs = w + 2, *sg = w + 34, *qh = w + 66, *s = w + 74;
        for (int k = 0; k < 32; k++)
            lb_signed8(v + 8 * k, MF_IQ2S_GRID[qs[k] | (((qh[k / 4] >> (2 * (k % 4))) & 3) << 8)], sg[k]);
        for (int g = 0; g < 16; g++) sc[g] = 2 * ((s[g / 2] >> (4 * (g % 2))) & 15) + 1;
        *f = mf_h2f(rd16(w)) * 0.125f;
        return 0; }
    case T_IQ3_XXS: {
        const uint8_t *qs = w + 2;
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux = rd32(w + 66 + 4 * ib);
            sc[2 * ib] = sc[2 * ib + 1] = 2 * (int32_t)(aux >> 28) + 1;
            for (int l = 0; l < 4; l++) {
                uint64_t g = (uint64_t)MF_IQ3XXS_GRID[qs[8 * ib + 2 * l]] | ((uint64_t)MF_IQ3XXS_GRID[qs[8 * ib + 2 * l + 1]] << 32);
                lb_signed8(v + 32 * ib + 8 * l, g, MF_KSIGNS[(aux >> (7 * l)) & 127]);
            }
        }
        *f = mf_h2f(rd16(w)) * 0.25f;
        return 0; }
    case T_IQ3_S: {
        const uint8_t *qs = w + 2, *qh = w + 66, *sg = w + 74, *s = w + 106;
        for (int k = 0; k < 32; k++) {
            int i0 = qs[2 * k] | (((qh[(2 * k) / 8] >> ((2 * k) % 8)) & 1) << 8);
            int i1 = qs[2 * k + 1] | (((qh[(2 * k + 1) / 8] >> ((2 * k + 1) % 8)) & 1) << 8);
            lb_signed8(v + 8 * k, (uint64_t)MF_IQ3S_GRID[i0] | ((uint64_t)MF_IQ3S_GRID[i1] << 32), sg[k]);
        }
        for (int ib = 0; ib < 8; ib++) sc[2 * ib] = sc[2 * ib + 1] = 1 + 2 * ((s[ib / 2] >> (4 * (ib % 2))) & 15);
        *f = mf_h2f(rd16(w));
        return 0; }
    case T_IQ1_S: {
        const uint8_t *qs = w + 2;
        for (int ib = 0; ib < 8; ib++) {
            uint16_t h = rd16(w + 34 + 2 * ib);
            int delta = h & 0x8000 ? -1 : 1;
            sc[2 * ib] = sc[2 * ib + 1] = 2 * ((h >> 12) & 7) + 1;
            for (int l = 0; l < 4; l++) {
                const int8_t *g = MF_IQ1S_GRID[qs[4 * ib + l] | (((h >> (3 * l)) & 7) << 8)];
                for (int j = 0; j < 8; j++) v[32 * ib + 8 * l + j] = (int8_t)(8 * g[j] + delta);
            }
        }
        *f = mf_h2f(rd16(w)) * 0.125f;
        return 0; }
    case T_IQ1_M: {
        const uint8_t *qs = w, *qh = w + 32;
        uint16_t s[4];
        for (int i = 0; i < 4; i++) s[i] = rd16(w + 48 + 2 * i);
        uint16_t dh = (uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0xf0) | ((s[2] >> 4) & 0xf00) | (s[3] & 0xf000));
        for (int g = 0; g < 16; g++) sc[g] = 2 * ((s[g / 4] >> (3 * (g % 4))) & 7) + 1;
        for (int k = 0; k < 32; k++) {
            int h = (qh[k / 2] >> (4 * (k % 2))) & 15, delta = h & 8 ? -1 : 1;
            const int8_t *g = MF_IQ1S_GRID[qs[k] | ((h & 7) << 8)];
            for (int j = 0; j < 8; j++) v[8 * k + j] = (int8_t)(8 * g[j] + delta);
        }
        *f = mf_h2f(dh) * 0.125f;
        return 0; }
#endif
    }
    return 0;
}

/* sum over the 16 groups of 16 of sc[g] * sum(v q), in integers (the scalar reference) */
static inline int32_t lb_isum(const int8_t *v, const int8_t *y, const int32_t *sc) {
    int32_t isum = 0;
    for (int g = 0; g < 16; g++) {
        int32_t s = 0;
        for (int i = 16 * g; i < 16 * g + 16; i++) s += v[i] * y[i];
        isum += sc[g] * s;
    }
    return isum;
}

#ifdef __AVX2__
/* The AVX2 form of dot_lowbit (lb_sb_rows): each super-block unpacked into registers, 32 values
 * at a time (unsigned magnitudes u < 128, the signs moved onto the activations: sign(q, v)),
 * multiplied with vpmaddubsw into int16 pairs and by the int16 scales of the two 16-value
 * groups with vpmaddwd (ggml's ggml_vec_dot_*_q8_K plan). */
static inline __m256i lb_s16(int a, int b) {   /* int16 lanes 0..7: a, 8..15: b */
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)a)), _mm_set1_epi16((short)b), 1);
}
/* the same from a vector of 16 int16 scales s: lanes 0..7 s[2c], 8..15 s[2c+1] (a word
 * permute and a byte shuffle, instead of two scalar loads and broadcasts) */
static inline __m256i lb_pick(__m256i s, int c) {
    const __m256i half = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
                                          2, 3, 2, 3);
    return _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(s, _mm256_set1_epi32(c)), half);
}
static inline __m256i lb_mac(__m256i acc, __m256i u, __m256i q, int a, int b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), lb_s16(a, b)));
}
static inline int32_t hsum_i32(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}
/* sum_g s[g] * sk16[g] over 16 groups (s as 16 int16) */
static inline int32_t lb_sdot16(__m256i s, const int16_t *sk16) {
    return hsum_i32(_mm256_madd_epi16(s, _mm256_loadu_si256((const __m256i *)sk16)));
}
#if MF_IQ_TABLES
/* signs as +-1 bytes from 4 sign bytes (bit j of byte k: value 8k + j negated) */
static inline __m256i lb_pm(uint8_t s0, uint8_t s1, uint8_t s2, uint8_t s3) {
    __m256i m = _mm256_set_epi64x((long long)MF_SIGN_MASK[s3], (long long)MF_SIGN_MASK[s2],
                                  (long long)MF_SIGN_MASK[s1], (long long)MF_SIGN_MASK[s0]);
    return _mm256_or_si256(m, _mm256_set1_epi8(1));
}
#endif

/* 32 values 32c .. 32c+31 of the super-block w of type t (a constant once inlined): the unsigned
 * magnitudes *u, for the signed types the signs *sg to put on the activation, and the int16
 * scales of the two 16-value groups *scv (lanes 0..7, 8..15); hm, sv, s4: lb_sb_rows' per
 * super-block state (Q3_K high bits, Q2_K / Q3_K scales, IQ1_M scales) */
static inline __attribute__((always_inline)) void lb_chunk(const int t, const uint8_t *w, const int c, const __m256i hm,
                                                           const __m256i sv, const uint16_t *s4, __m256i *u_,
                                                           __m256i *sg_, __m256i *scv_) {
    const __m256i m3 = _mm256_set1_epi8(3);
    __m256i u = _mm256_setzero_si256(), sg = _mm256_setzero_si256();
    int a = 0, b = 0;
    (void)s4;
    switch (t) {
    case T_Q2_K:
        u = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(w + 16 + 32 * (c / 4))), 2 * (c % 4)), m3);
        break;
    case T_Q3_K: {
        /* u = 2-bit value | (high bit << 2), 0..7: the value is u - 4 */
        __m256i h = _mm256_and_si256(_mm256_srli_epi16(hm, c), _mm256_set1_epi8(1));
        u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 + 32 * (c / 4))),
                                                               2 * (c % 4)), m3), _mm256_slli_epi16(h, 2));
        break; }
    case T_IQ4_XS: {
        a = b = (((w[4 + c / 2] >> (4 * (c % 2))) & 15) | (((rd16(w + 2) >> (2 * c)) & 3) << 4)) - 32;
        sg = lut16(nibbles(w + 8 + 16 * c), KV_IQ4NL);
        u = _mm256_sign_epi8(sg, sg);
        break; }
#if MF_IQ_TABLES
    case T_IQ2_XXS: {
        uint32_t a0 = rd32(w + 2 + 8 * c), a1 = rd32(w + 6 + 8 * c);
        u = _mm256_set_epi64x((long long)MF_IQ2XXS_GRID[a0 >> 24], (long long)MF_IQ2XXS_GRID[(a0 >> 16) & 255],
                              (long long)MF_IQ2XXS_GRID[(a0 >> 8) & 255], (long long)MF_IQ2XXS_GRID[a0 & 255]);
        sg = lb_pm(MF_KSIGNS[a1 & 127], MF_KSIGNS[(a1 >> 7) & 127], MF_KSIGNS[(a1 >> 14) & 127], MF_KSIGNS[(a1 >> 21) & 127]);
        a = b = 2 * (int)(a1 >> 28) + 1;
        break; }
    case T_IQ2_XS: {
        uint16_t q[4];
        memcpy(q, w + 2 + 8 * c, 8);
        u = _mm256_set_epi64x((long long)MF_IQ2XS_GRID[q[3] & 511], (long long)MF_IQ2XS_GRID[q[2] & 511],
                              (long long)MF_IQ2XS_GRID[q[1] & 511], (long long)MF_IQ2XS_GRID[q[0] & 511]);
        sg = lb_pm(MF_KSIGNS[q[0] >> 9], MF_KSIGNS[q[1] >> 9], MF_KSIGNS[q[2] >> 9], MF_KSIGNS[q[3] >> 9]);
        a = 2 * (w[66 + c] & 15) + 1; b = 2 * (w[66 + c] >> 4) + 1;
        break; }
    case T_IQ2_S: {
        const uint8_t *q = w + 2 + 4 * c, *sgb = w + 34 + 4 * c;
        int h = w[66 + c];
        u = _mm256_set_epi64x((long long)MF_IQ2S_GRID[q[3] | ((h << 2) & 0x300)], (long long)MF_IQ2S_GRID[q[2] | ((h << 4) & 0x300)],
                              (long long)MF_IQ2S_GRID[q[1] | ((h << 6) & 0x300)], (long long)MF_IQ2S_GRID[q[0] | ((h << 8) & 0x300)]);
        sg = lb_pm(sgb[0], sgb[1], sgb[2], sgb[3]);
        a = 2 * (w[74 + c] & 15) + 1; b = 2 * (w[74 + c] >> 4) + 1;
        break; }
    case T_IQ3_XXS: {
        const uint8_t *q = w + 2 + 8 * c;
        uint32_t aux = rd32(w + 66 + 4 * c);
        u = _mm256_set_epi32((int)MF_IQ3XXS_GRID[q[7]], (int)MF_IQ3XXS_GRID[q[6]], (int)MF_IQ3XXS_GRID[q[5]],
                             (int)MF_IQ3XXS_GRID[q[4]], (int)MF_IQ3XXS_GRID[q[3]], (int)MF_IQ3XXS_GRID[q[2]],
                             (int)MF_IQ3XXS_GRID[q[1]], (int)MF_IQ3XXS_GRID[q[0]]);
        sg = lb_pm(MF_KSIGNS[aux & 127], MF_KSIGNS[(aux >> 7) & 127], MF_KSIGNS[(aux >> 14) & 127], MF_KSIGNS[(aux >> 21) & 127]);
        a = b = 2 * (int)(aux >> 28) + 1;
        break; }
    case T_IQ3_S: {
        const uint8_t *q = w + 2 + 8 * c, *sgb = w + 74 + 4 * c;
        int h = w[66 + c];
        int32_t g[8];
        for (int k = 0; k < 8; k++) g[k] = (int32_t)MF_IQ3S_GRID[q[k] | (((h >> k) & 1) << 8)];
        u = _mm256_loadu_si256((const __m256i *)g);
        sg = lb_pm(sgb[0], sgb[1], sgb[2], sgb[3]);
        a = b = 1 + 2 * ((w[106 + c / 2] >> (4 * (c % 2))) & 15);
        break; }
    case T_IQ1_S: case T_IQ1_M: {
        /* v = 8 g + delta (g in -1..1 from the 8 g grid, delta +-1 per 8 values), |v| <= 9 */
        int idx[4];
        long long dl[4];
        if (t == T_IQ1_S) {
            int h = rd16(w + 34 + 2 * c);
            const uint8_t *q = w + 2 + 4 * c;
            idx[0] = q[0] | ((h << 8) & 0x700); idx[1] = q[1] | ((h << 5) & 0x700);
            idx[2] = q[2] | ((h << 2) & 0x700); idx[3] = q[3] | ((h >> 1) & 0x700);
            dl[0] = dl[1] = dl[2] = dl[3] = h & 0x8000 ? -1 : 0x0101010101010101ll;
            a = b = 2 * ((h >> 12) & 7) + 1;
        } else {
            for (int l = 0; l < 4; l++) {
                int h = (w[32 + 2 * c + l / 2] >> (4 * (l % 2))) & 15;
                idx[l] = w[4 * c + l] | ((h & 7) << 8);
                dl[l] = h & 8 ? -1 : 0x0101010101010101ll;
            }
            a = 2 * ((s4[c / 2] >> (6 * (c % 2))) & 7) + 1;
            b = 2 * ((s4[c / 2] >> (6 * (c % 2) + 3)) & 7) + 1;
        }
        sg = _mm256_add_epi8(_mm256_set_epi64x((long long)MF_IQ1S_GRID8[idx[3]], (long long)MF_IQ1S_GRID8[idx[2]],
                                               (long long)MF_IQ1S_GRID8[idx[1]], (long long)MF_IQ1S_GRID8[idx[0]]),
                             _mm256_set_epi64x(dl[3], dl[2], dl[1], dl[0]));
        u = _mm256_sign_epi8(sg, sg);
        break; }
#endif
    }
    *u_ = u; *sg_ = sg;
    *scv_ = t == T_Q2_K || t == T_Q3_K ? lb_pick(sv, c) : lb_s16(a, b);
}

/* One super-block of type t (a constant once inlined: lb_rows_t) against nr activation rows
 * (y[j]: the row's 256 K-quant values, sk[j]: its 16 sums per 16): the super-block is unpacked
 * once, 32 values at a time (u, and for the signed types the signs sg to put on the
 * activation), and each 32 values multiply the nr rows from registers, so a batch of tokens
 * unpacks each weight super-block once per nr rows (ggml's vec_dot unpacks it once per row).
 * s[j]: row j's sum in units of dk, f * sum_g sc[g] sum(v q) - fmin * sum_g mn[g] sk16[g]
 * (Q3_K: f * (sum(u q) - 4 sum_g sc[g] sk16[g]), u = v + 4), the same integers as lb_unpack's
 * and the same fp32 operations for every nr, so a row's value does not depend on the batch. */
static inline __attribute__((always_inline)) void lb_sb_rows(const int t, const uint8_t *w, const int8_t *const *y,
                                                             const int16_t *const *sk, const int nr, float *s) {
    __m256i acc[LB_MAXR];
    for (int j = 0; j < nr; j++) acc[j] = _mm256_setzero_si256();
    const int sgn = t != T_Q2_K && t != T_Q3_K;      /* signs on the activation */
    float f = 0.f, fmin = 0.f;
    int8_t sc3[16];                                  /* Q3_K: the 16 scales */
    /* Q3_K high bits; Q2_K mins, Q3_K scales as int16; Q2_K / Q3_K scales as int16 */
    __m256i hm = _mm256_setzero_si256(), mv = hm, sv = hm;
    uint16_t s4[4] = {0, 0, 0, 0};
    switch (t) {
    case T_Q2_K:
        mv = _mm256_cvtepu8_epi16(_mm_srli_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)w), _mm_set1_epi8((char)0xf0)), 4));
        sv = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)w), _mm_set1_epi8(15)));
        f = mf_h2f(rd16(w + 80)); fmin = mf_h2f(rd16(w + 82));
        break;
    case T_Q3_K: {
        /* the 16 6-bit scales, 4 per 32-bit word (ggml's kmask unpacking of lb_unpack's loop) */
        uint32_t u4[4];
        memcpy(u4, w + 96, 12);
        uint32_t hi = u4[2];
        u4[2] = ((u4[0] >> 4) & 0x0f0f0f0fu) | (((hi >> 4) & 0x03030303u) << 4);
        u4[3] = ((u4[1] >> 4) & 0x0f0f0f0fu) | (((hi >> 6) & 0x03030303u) << 4);
        u4[0] = (u4[0] & 0x0f0f0f0fu) | ((hi & 0x03030303u) << 4);
        u4[1] = (u4[1] & 0x0f0f0f0fu) | (((hi >> 2) & 0x03030303u) << 4);
        memcpy(sc3, u4, 16);
        for (int k = 0; k < 16; k++) sc3[k] -= 32;
        mv = sv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc3));
        hm = _mm256_loadu_si256((const __m256i *)w);
        f = mf_h2f(rd16(w + 108));
        break; }
    case T_IQ4_XS: case T_IQ3_S: f = mf_h2f(rd16(w)); break;
    case T_IQ3_XXS: f = mf_h2f(rd16(w)) * 0.25f; break;
    case T_IQ1_M:
        memcpy(s4, w + 48, 8);
        f = mf_h2f((uint16_t)((s4[0] >> 12) | ((s4[1] >> 8) & 0xf0) | ((s4[2] >> 4) & 0xf00) | (s4[3] & 0xf000))) * 0.125f;
        break;
    default: f = mf_h2f(rd16(w)) * 0.125f;        /* IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S */
    }
    int c = 0;
#ifdef HAVE512
    /* a batch: 64 values a step in 512-bit registers (two lb_chunk halves), so each activation
     * row costs half the instructions; the signs go on with a masked negation (no vpsignb in
     * AVX-512); the same integer sums as the 256-bit steps */
    if (nr > 1) {
        __m512i acc5[LB_MAXR];
        for (int j = 0; j < nr; j++) acc5[j] = _mm512_setzero_si512();
        for (; c < 8; c += 2) {
            __m256i u0, u1, g0, g1, s0, s1;
            lb_chunk(t, w, c, hm, sv, s4, &u0, &g0, &s0);
            lb_chunk(t, w, c + 1, hm, sv, s4, &u1, &g1, &s1);
            const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
            const __m512i scv = _mm512_inserti64x4(_mm512_castsi256_si512(s0), s1, 1);
            const __mmask64 neg = sgn ? _mm512_movepi8_mask(_mm512_inserti64x4(_mm512_castsi256_si512(g0), g1, 1)) : 0;
            for (int j = 0; j < nr; j++) {
                __m512i q = _mm512_loadu_si512((const void *)(y[j] + 32 * c));
                if (sgn) q = _mm512_mask_sub_epi8(q, neg, _mm512_setzero_si512(), q);
                acc5[j] = _mm512_add_epi32(acc5[j], _mm512_madd_epi16(_mm512_maddubs_epi16(u, q), scv));
            }
        }
        for (int j = 0; j < nr; j++)
            acc[j] = _mm256_add_epi32(_mm512_castsi512_si256(acc5[j]), _mm512_extracti64x4_epi64(acc5[j], 1));
    }
#endif
    for (; c < 8; c++) {                             /* values 32c .. 32c+31 */
        __m256i u, sg, scv;
        lb_chunk(t, w, c, hm, sv, s4, &u, &sg, &scv);
        for (int j = 0; j < nr; j++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(y[j] + 32 * c));
            if (sgn) q = _mm256_sign_epi8(q, sg);
            acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), scv));
        }
    }
    for (int j = 0; j < nr; j++) {
        if (t == T_Q2_K) s[j] = f * (float)hsum_i32(acc[j]) - fmin * (float)lb_sdot16(mv, sk[j]);
        else if (t == T_Q3_K) s[j] = f * (float)(hsum_i32(acc[j]) - 4 * lb_sdot16(mv, sk[j]));
        else s[j] = f * (float)hsum_i32(acc[j]);
    }
}

/* out[j] = the product of one row (w) with activation rows a[j], j < na, super-block by
 * super-block in order (sum += dk * s: dot_lowbit's fp32 operations for every na), na split
 * into runs of LB_MAXR, 4 and 1 rows per unpacking */
static inline __attribute__((always_inline)) void lb_rows_t(const int t, const uint8_t *w, int K, const qact *a, int na,
                                                            float *out) {
    const int ts = lb_type_size(t);
    if (na == 1) {          /* a decode step: the sum in a register, the same operations */
        float sum = 0.f;
        for (int sb = 0; sb < K / 256; sb++, w += ts) {
            for (int c = 0; c < ts; c += 64) _mm_prefetch((const char *)(w + PREFETCH + c), _MM_HINT_T0);
            const int8_t *y = a->qk + 256 * sb;
            const int16_t *sk = a->sk16 + 16 * sb;
            float s;
            lb_sb_rows(t, w, &y, &sk, 1, &s);
            sum += a->dk[sb] * s;
        }
        *out = sum;
        return;
    }
    for (int j = 0; j < na; j++) out[j] = 0.f;
    for (int sb = 0; sb < K / 256; sb++, w += ts) {
        for (int c = 0; c < ts; c += 64) _mm_prefetch((const char *)(w + PREFETCH + c), _MM_HINT_T0);
        const int8_t *y[LB_MAXR];
        const int16_t *sk[LB_MAXR];
        float s[LB_MAXR];
        int j = 0;
#define LB_RUN(R)                                                                                              \
        for (; j + (R) <= na; j += (R)) {                                                                      \
            for (int k = 0; k < (R); k++) { y[k] = a[j + k].qk + 256 * sb; sk[k] = a[j + k].sk16 + 16 * sb; }  \
            lb_sb_rows(t, w, y, sk, (R), s);                                                                   \
            for (int k = 0; k < (R); k++) out[j + k] += a[j + k].dk[sb] * s[k];                                \
        }
        LB_RUN(LB_MAXR)
        LB_RUN(4)
        LB_RUN(1)
#undef LB_RUN
    }
}
#endif

/* out[j] = dot of the low-bit row w (K values) with the quantized activations a[j], j < na;
 * the same value for a row alone and in a batch (lb_sb_rows) */
static void lowbit_rows(int t, const uint8_t *w, int K, const qact *a, int na, float *out) {
#ifdef __AVX2__
    switch (t) {
    case T_Q2_K: lb_rows_t(T_Q2_K, w, K, a, na, out); return;
    case T_Q3_K: lb_rows_t(T_Q3_K, w, K, a, na, out); return;
    case T_IQ4_XS: lb_rows_t(T_IQ4_XS, w, K, a, na, out); return;
#if MF_IQ_TABLES
    case T_IQ2_XXS: lb_rows_t(T_IQ2_XXS, w, K, a, na, out); return;
    case T_IQ2_XS: lb_rows_t(T_IQ2_XS, w, K, a, na, out); return;
    case T_IQ2_S: lb_rows_t(T_IQ2_S, w, K, a, na, out); return;
    case T_IQ3_XXS: lb_rows_t(T_IQ3_XXS, w, K, a, na, out); return;
    case T_IQ3_S: lb_rows_t(T_IQ3_S, w, K, a, na, out); return;
    case T_IQ1_S: lb_rows_t(T_IQ1_S, w, K, a, na, out); return;
    case T_IQ1_M: lb_rows_t(T_IQ1_M, w, K, a, na, out); return;
#endif
    }
#else
    int8_t v[256];
    int32_t sc[16], mn[16];
    for (int j = 0; j < na; j++) {
        const uint8_t *wb = w;
        float sum = 0.f;
        for (int sb = 0; sb < K / 256; sb++, wb += lb_type_size(t)) {
            float f, fmin = 0.f;
            int mins = lb_unpack(t, wb, v, sc, mn, &f, &fmin);
            float dy = a[j].dk[sb];
            sum += f * dy * (float)lb_isum(v, a[j].qk + 256 * sb, sc);
            if (mins) {
                int32_t m = 0;
                for (int g = 0; g < 16; g++) m += mn[g] * a[j].sk16[16 * sb + g];
                sum -= fmin * dy * (float)m;
            }
        }
        out[j] = sum;
    }
#endif
}

static float dot_lowbit(int t, const uint8_t *w, qact a, int K) {
    float out;
    lowbit_rows(t, w, K, &a, 1, &out);
    return out;
}

/* out[i * ldo + j] = the product of low-bit weight row j (j < nr, rows rb bytes apart) with the
 * activation acts[i] (i < na <= LB_MAXR): the na rows share each super-block's unpacking */
static void lowbit_block(int t, const uint8_t *w, int64_t rb, int nr, int K, const qact *acts, int na, float *out,
                         int64_t ldo) {
    float v[LB_MAXR];
    for (int j = 0; j < nr; j++) {
        lowbit_rows(t, w + j * rb, K, acts, na, v);
        for (int i = 0; i < na; i++) out[i * ldo + j] = v[i];
    }
}

/* one super-block -> y [256], bit for bit gguf's dequantize: (f sc) v - fmin mn, the products
 * ggml's dequantize_row_* rounds (d sc, then times the value; a power of two changes no
 * rounding) */
static void dequant_lowbit(int t, const uint8_t *w, float *y) {
    int8_t v[256];
    int32_t sc[16], mn[16];
    float f, fmin = 0.f;
    int mins = lb_unpack(t, w, v, sc, mn, &f, &fmin);
    for (int g = 0; g < 16; g++) {
        float dl = f * (float)sc[g], ml = mins ? fmin * (float)mn[g] : 0.f;
        for (int i = 16 * g; i < 16 * g + 16; i++) y[i] = mins ? dl * (float)v[i] - ml : dl * (float)v[i];
    }
}

#ifdef HAVE512
/* ---- Q2_K / Q3_K against one activation row, AVX-512: four rows at once (dot4_q23_512) or one
 * (dot_q23_512). ggml's vec_dot_q2_K_q8_K / q3_K_q8_K plan in 64-value steps: step j (0..3)
 * takes the 2-bit fields at bit 2j of a super-block's 64 qs bytes, values 32j .. 32j+31
 * (bytes 0..31) and 128+32j .. 159+32j (bytes 32..63; Q3_K: with their high bits from hmask,
 * u = value + 4 in 0..7), against the K-quant activation's values in that order (q23_acts:
 * built once per super-block for the four rows); vpmaddubsw into int16 pairs, vpdpwssd by the
 * int16 scale of each 16 values. The super-block's integers are lb_sb_rows' (the scaled sum,
 * and the sum over sk16 of the mins / of the scales for Q3_K's offset 4) and the fp32
 * operations after them lb_rows_t's, in the same order (s = f isum - fmin msum, Q3_K
 * s = f (isum - 4 msum); sum += dk s from 0), so a row's value is bit for bit what the batch
 * path (lowbit_rows) and the generic one-row path give it. A decode step reads Q2_K / Q3_K
 * four rows at once, from memory too (one row after the other took 1.4-1.8x the time on
 * 128 MB matrices of K = 1024, one thread, interleaved on a loaded machine). Against the
 * generic path (lb_rows_t, 32 values a step, the activation reloaded for every row), one
 * thread, interleaved, a loaded machine: 0.44-0.48x the time from memory (128 MB), 0.4-0.7x in
 * the caches. */

/* the activation's 256 values of one super-block (q) in step order: y[j] = values 32j ..
 * 32j+31, then 128+32j .. 159+32j */
static inline __attribute__((always_inline)) void q23_acts(const int8_t *q, __m512i *y) {
    for (int j = 0; j < 4; j++)
        y[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 32 * j))),
                                  _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * j)), 1);
}

/* one super-block w of a Q2_K / Q3_K row (t, a constant once inlined) against the activation's
 * values y (q23_acts) and its 16 sums per 16 values sk: *iv = 8 int32 lanes adding up to the
 * scaled sum sum_g sc[g] sum(u q) (Q3_K: minus 4 sum_g sc[g] sk[g]), *mv = 8 lanes adding up
 * to sum_g mn[g] sk[g] (Q2_K's mins) */
static inline __attribute__((always_inline)) void q23_row(const int t, const uint8_t *w, const __m512i *y, __m256i sk,
                                                          __m256i *iv, __m256i *mv) {
    const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(4);
    /* int16 lane i of step j's scale vector: scale 2j (lanes 0..7), 2j+1, 8+2j, 9+2j */
    const __m512i sel = _mm512_set_epi16(9,9,9,9,9,9,9,9, 8,8,8,8,8,8,8,8, 1,1,1,1,1,1,1,1, 0,0,0,0,0,0,0,0);
    __m256i sc16, ms;
    __m512i raw, hb = _mm512_setzero_si512();
    if (t == T_Q2_K) {
        __m128i s = _mm_loadu_si128((const __m128i *)w);
        sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s, _mm_set1_epi8(15)));
        ms = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(15))), sk);
        raw = _mm512_loadu_si512((const void *)(w + 16));
    } else {
        /* the 16 6-bit scales (ggml's kmask unpacking), built in a register as k4_scales */
        uint32_t u0, u1, u2;
        memcpy(&u0, w + 96, 4); memcpy(&u1, w + 100, 4); memcpy(&u2, w + 104, 4);
        uint32_t r0 = (u0 & 0x0f0f0f0fu) | ((u2 & 0x03030303u) << 4);
        uint32_t r1 = (u1 & 0x0f0f0f0fu) | (((u2 >> 2) & 0x03030303u) << 4);
        uint32_t r2 = ((u0 >> 4) & 0x0f0f0f0fu) | (((u2 >> 4) & 0x03030303u) << 4);
        uint32_t r3 = ((u1 >> 4) & 0x0f0f0f0fu) | (((u2 >> 6) & 0x03030303u) << 4);
        sc16 = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_setr_epi32((int)r0, (int)r1, (int)r2, (int)r3), _mm_set1_epi8(32)));
        ms = _mm256_madd_epi16(sc16, sk);
        __m256i h = _mm256_loadu_si256((const __m256i *)w);       /* hmask: bit 4n+j of byte l */
        hb = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 4), 1);
        raw = _mm512_loadu_si512((const void *)(w + 32));
    }
    const __m512i scz = _mm512_castsi256_si512(sc16);
    __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m512i u = _mm512_and_si512(_mm512_srli_epi16(raw, 2 * j), m3);
        if (t == T_Q3_K) {      /* the high bit j (of hb's bytes) to bit 2 */
            __m512i h = j < 2 ? _mm512_slli_epi16(hb, 2 - j) : j == 2 ? hb : _mm512_srli_epi16(hb, 1);
            u = _mm512_or_si512(u, _mm512_and_si512(h, m4));
        }
        __m512i sc = _mm512_permutexvar_epi16(_mm512_add_epi16(sel, _mm512_set1_epi16((short)(2 * j))), scz);
        isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(u, y[j]), sc);
    }
    __m256i f = _mm256_add_epi32(_mm512_castsi512_si256(isum), _mm512_extracti64x4_epi64(isum, 1));
    if (t == T_Q3_K) f = _mm256_sub_epi32(f, _mm256_slli_epi32(ms, 2));
    *iv = f;
    *mv = ms;
}

/* lane r of the result: the sum of the 8 int32 lanes of v[r], r < 4 */
static inline __m128i q23_hsum4(const __m256i *v) {
    __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

static inline __attribute__((always_inline)) void q23_dot4_t(const int t, const uint8_t *w, int64_t rb, qact a, int K,
                                                             float *out) {
    const int bs = t == T_Q2_K ? 84 : 110;
    __m128 sum = _mm_setzero_ps();
    for (int sb = 0; sb < K / 256; sb++) {
        __m512i y[4];
        q23_acts(a.qk + 256 * sb, y);
        const __m256i sk = _mm256_loadu_si256((const __m256i *)(a.sk16 + 16 * sb));
        __m256i iv[4], mv[4];
        uint32_t fh[4];         /* Q2_K: d | dmin << 16; Q3_K: d */
        for (int r = 0; r < 4; r++) {
            const uint8_t *wr = w + r * rb + (int64_t)sb * bs;
            for (int c = 0; c < bs; c += 64) _mm_prefetch((const char *)(wr + PREFETCH + c), _MM_HINT_T0);
            q23_row(t, wr, y, sk, &iv[r], &mv[r]);
            fh[r] = t == T_Q2_K ? rd32(wr + 80) : rd16(wr + 108);
        }
        /* f (and fmin) of the four rows (set in a register: a store of 4 and a load of 16 bytes
         * would miss the store forwarding), then lb_rows_t's fp32 operations lane by lane */
        __m128i fq = _mm_setr_epi32((int)fh[0], (int)fh[1], (int)fh[2], (int)fh[3]);
        __m128 s;
        if (t == T_Q2_K) {
            __m256 fv = _mm256_permutexvar_ps(_mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), _mm256_cvtph_ps(fq));
            s = _mm_sub_ps(_mm_mul_ps(_mm256_castps256_ps128(fv), _mm_cvtepi32_ps(q23_hsum4(iv))),
                           _mm_mul_ps(_mm256_extractf128_ps(fv, 1), _mm_cvtepi32_ps(q23_hsum4(mv))));
        } else s = _mm_mul_ps(_mm_cvtph_ps(_mm_packus_epi32(fq, fq)), _mm_cvtepi32_ps(q23_hsum4(iv)));
        sum = _mm_add_ps(sum, _mm_mul_ps(_mm_set1_ps(a.dk[sb]), s));
    }
    _mm_storeu_ps(out, sum);
}

/* four Q2_K / Q3_K rows at once (rows w + r * rb) against one activation row: the activation's
 * vectors of each super-block built once for the four rows */
static void dot4_q23_512(int t, const uint8_t *w, int64_t rb, qact a, int K, float *out) {
    if (t == T_Q2_K) q23_dot4_t(T_Q2_K, w, rb, a, K, out);
    else q23_dot4_t(T_Q3_K, w, rb, a, K, out);
}

static inline __attribute__((always_inline)) float q23_dot_t(const int t, const uint8_t *w, qact a, int K) {
    const int bs = t == T_Q2_K ? 84 : 110;
    float sum = 0.f;
    for (int sb = 0; sb < K / 256; sb++, w += bs) {
        for (int c = 0; c < bs; c += 64) _mm_prefetch((const char *)(w + PREFETCH + c), _MM_HINT_T0);
        __m512i y[4];
        q23_acts(a.qk + 256 * sb, y);
        __m256i iv, mv;
        q23_row(t, w, y, _mm256_loadu_si256((const __m256i *)(a.sk16 + 16 * sb)), &iv, &mv);
        float s = t == T_Q2_K ? mf_h2f(rd16(w + 80)) * (float)hsum_i32(iv) - mf_h2f(rd16(w + 82)) * (float)hsum_i32(mv)
                              : mf_h2f(rd16(w + 108)) * (float)hsum_i32(iv);
        sum += a.dk[sb] * s;
    }
    return sum;
}

/* one Q2_K / Q3_K row against one activation row (the same value as a row of dot4_q23_512) */
static float dot_q23_512(int t, const uint8_t *w, qact a, int K) {
    return t == T_Q2_K ? q23_dot_t(T_Q2_K, w, a, K) : q23_dot_t(T_Q3_K, w, a, K);
}
#endif

#ifdef HAVE512
/* ---- IQ4_XS, 16 weight rows at a time (AVX-512 VNNI) ---------------------------------------
 * The 16 rows' 4-bit indices of one 32-value sub-block are transposed in registers so that
 * int32 lane r of a vector holds 4 consecutive values of row r (4x4 dword transposes within
 * the 128-bit lanes of 4 vectors, then the nibbles split and looked up in KV_IQ4NL_U, the
 * table + 128); one activation row's 4 values, broadcast, then meet the 16 rows in one
 * vpdpbusd, 8 of them per sub-block, so a weight row is unpacked once for all the activation
 * rows of a call (iq4x_rows16) and its 6-bit scale multiplies 16 rows' sums at once. The
 * offset comes back out through the activation's sums per 16 values (sk16): sum(v q) =
 * sum((v + 128) q) - 128 sum(q), the second term by vpdpwssd against the scale pair (-128 sc,
 * -128 sc). The integer sum of a row and super-block is therefore lb_sb_rows' (sum_ib sc_ib
 * sum(v q), exact in int32: |sum| < 2^28), and its fp32 operations are lb_rows_t's (s = f x
 * (float) isum, then sum += dk x s, super-block by super-block, no FMA): every output is bit
 * for bit the one-row kernel's, alone or in a batch, for any number of rows. */
#define HAVE_IQ4X 1
#define IQ4X_MAXT 64          /* activation rows of one iq4x_rows16 call */
/* prefetch distance in rows: the next panel's rows at the super-block being read (rows read
 * 16 side by side; row + PREFETCH bytes would land in this panel's own later rows) */
#define IQ4X_PF 16

/* out[i * ldo + r] = IQ4_XS row r (w + r * rb, r < nr <= 16) . acts[i] (i < na <= IQ4X_MAXT) */
static void iq4x_rows16(const uint8_t *w, int64_t rb, int nr, int K, const qact *acts, int na, float *out,
                        int64_t ldo) {
    __m512i isum[IQ4X_MAXT];
    __m512 acc[IQ4X_MAXT];
    int32_t corr[8 * IQ4X_MAXT];
    const uint8_t *rp[16];
    int32_t off[16];
    for (int r = 0; r < 16; r++) {            /* rows past nr read row 0 again; their lanes are dropped */
        rp[r] = w + (r < nr ? r : 0) * rb;
        off[r] = (int32_t)((r < nr ? r : 0) * rb);
    }
    const __m512i vidx = _mm512_loadu_si512((const void *)off);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KV_IQ4NL_U));
    const __m512i m4 = _mm512_set1_epi8(0x0f), m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
    for (int i = 0; i < na; i++) acc[i] = _mm512_setzero_ps();
    for (int sb = 0; sb < K / 256; sb++) {
        const int64_t o = (int64_t)sb * 136;
        for (int r = 0; r < 16; r++) {      /* the next panel's rows, at this super-block */
            _mm_prefetch((const char *)(rp[r] + IQ4X_PF * rb + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(rp[r] + IQ4X_PF * rb + o + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(rp[r] + IQ4X_PF * rb + o + 128), _MM_HINT_T0);
        }
        /* d | scales_h, then scales_l, of the 16 rows */
        const __m512i h0 = _mm512_i32gather_epi32(vidx, (const void *)(w + o), 1);
        const __m512i h1 = _mm512_i32gather_epi32(vidx, (const void *)(w + o + 4), 1);
        const __m512 F = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h0));
        const __m512i SH = _mm512_srli_epi32(h0, 16);
        __m512i SC[8];
        for (int ib = 0; ib < 8; ib++) {
            __m512i s = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h1, 4 * ib), m15),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(SH, 2 * ib), m3), 4));
            s = _mm512_sub_epi32(s, _mm512_set1_epi32(32));
            SC[ib] = s;
        }
        /* 128 x the activations' sums per 32 values of this super-block, as int32 */
        for (int i = 0; i < na; i++) {
            isum[i] = _mm512_setzero_si512();
            __m256i p = _mm256_loadu_si256((const __m256i *)(acts[i].sk16 + 16 * sb));
            __m256i s2 = _mm256_add_epi32(_mm256_srai_epi32(_mm256_slli_epi32(p, 16), 16), _mm256_srai_epi32(p, 16));
            _mm256_storeu_si256((__m256i *)(corr + 8 * i), _mm256_slli_epi32(s2, 7));
        }
        for (int ib = 0; ib < 8; ib++) {
            const int64_t q = o + 8 + 16 * ib;
            __m512i W[4];
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[j] + q)));
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rp[4 + j] + q)), 1);
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rp[8 + j] + q)), 2);
                W[j] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rp[12 + j] + q)), 3);
            }
            const __m512i t0 = _mm512_unpacklo_epi32(W[0], W[1]), t1 = _mm512_unpackhi_epi32(W[0], W[1]);
            const __m512i t2 = _mm512_unpacklo_epi32(W[2], W[3]), t3 = _mm512_unpackhi_epi32(W[2], W[3]);
            __m512i T[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                            _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
            __m512i P[8];
            for (int g = 0; g < 4; g++) {
                P[g] = _mm512_shuffle_epi8(lut, _mm512_and_si512(T[g], m4));
                P[g + 4] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(T[g], 4), m4));
            }
            const __m512i sc = SC[ib];
            for (int i = 0; i < na; i++) {
                const int8_t *y = acts[i].qk + 256 * sb + 32 * ib;
                __m512i a0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), P[0], _mm512_set1_epi32((int)rd32((const uint8_t *)y)));
                __m512i a1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), P[1], _mm512_set1_epi32((int)rd32((const uint8_t *)y + 4)));
                a0 = _mm512_dpbusd_epi32(a0, P[2], _mm512_set1_epi32((int)rd32((const uint8_t *)y + 8)));
                a1 = _mm512_dpbusd_epi32(a1, P[3], _mm512_set1_epi32((int)rd32((const uint8_t *)y + 12)));
                a0 = _mm512_dpbusd_epi32(a0, P[4], _mm512_set1_epi32((int)rd32((const uint8_t *)y + 16)));
                a1 = _mm512_dpbusd_epi32(a1, P[5], _mm512_set1_epi32((int)rd32((const uint8_t *)y + 20)));
                a0 = _mm512_dpbusd_epi32(a0, P[6], _mm512_set1_epi32((int)rd32((const uint8_t *)y + 24)));
                a1 = _mm512_dpbusd_epi32(a1, P[7], _mm512_set1_epi32((int)rd32((const uint8_t *)y + 28)));
                const __m512i a = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(corr[8 * i + ib]));
                isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(a, sc));
            }
        }
        for (int i = 0; i < na; i++)
            acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_set1_ps(acts[i].dk[sb]),
                                                         _mm512_mul_ps(F, _mm512_cvtepi32_ps(isum[i]))));
    }
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int i = 0; i < na; i++) _mm512_mask_storeu_ps(out + i * ldo, keep, acc[i]);
}
#endif

/* ---- one row . one activation, per type ---------------------------------------------------- */
static float dot_row(int t, const uint8_t *w, const float *xf, qact a, int K) {
    float sum = 0.f;
    int nb = K / 32;
#ifdef HAVE512
    if (t == T_Q2_K || t == T_Q3_K) return dot_q23_512(t, w, a, K);
#endif
    if (is_lowbit(t)) return dot_lowbit(t, w, a, K);
#ifdef HAVE512
    switch (t) {
    case T_Q8_0: if (nb % 4 == 0) return dot_q80_512(w, a, nb);
        /* fall through */
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_IQ4_NL: case T_MXFP4:
        return dot_b32_512(t, w, a, nb);
    case T_Q4_K: case T_Q5_K: return dot_k45_512(t, w, a, K);
    case T_Q6_K: return dot_q6k_512(w, a, K);
    }
#endif
    switch (t) {
    case T_F32: return mf_dot_f32((const float *)w, xf, K);
    case T_BF16: case T_F16: { int i = 0;
#ifdef __AVX512F__
        if (t == T_F16) return dot_f16_512(w, xf, K);
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (; i + 32 <= K; i += 32) {
            _mm_prefetch((const char *)(w + 2 * i + PREFETCH), _MM_HINT_T0);
            __m256i h0 = _mm256_loadu_si256((const __m256i *)(w + 2 * i));
            __m256i h1 = _mm256_loadu_si256((const __m256i *)(w + 2 * i + 32));
            __m512 f0, f1;
            if (t == T_BF16) {
                f0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16));
                f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16));
            } else { f0 = _mm512_cvtph_ps(h0); f1 = _mm512_cvtph_ps(h1); }
            acc0 = _mm512_fmadd_ps(f0, _mm512_loadu_ps(xf + i), acc0);
            acc1 = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xf + i + 16), acc1);
        }
        sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
        for (; i < K; i++) sum += (t == T_BF16 ? mf_b2f(rd16(w + 2 * i)) : mf_h2f(rd16(w + 2 * i))) * xf[i];
        return sum; }
    case T_Q8_0: {
#ifdef __AVX2__
        __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int b = 0;
        for (; b + 2 <= nb; b += 2, w += 68) {
            _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
            __m256i p0 = dot_ss(_mm256_loadu_si256((const __m256i *)(w + 2)), _mm256_loadu_si256((const __m256i *)(a.q + 32 * b)));
            __m256i p1 = dot_ss(_mm256_loadu_si256((const __m256i *)(w + 36)), _mm256_loadu_si256((const __m256i *)(a.q + 32 * b + 32)));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(mf_h2f(rd16(w)) * a.d[b]), acc);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(mf_h2f(rd16(w + 34)) * a.d[b + 1]), acc1);
        }
        for (; b < nb; b++, w += 34) {
            __m256i p = dot_ss(_mm256_loadu_si256((const __m256i *)(w + 2)), _mm256_loadu_si256((const __m256i *)(a.q + 32 * b)));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(mf_h2f(rd16(w)) * a.d[b]), acc);
        }
        return hsum8(_mm256_add_ps(acc, acc1));
#else
        for (int b = 0; b < nb; b++, w += 34) {
            int s = 0; for (int i = 0; i < 32; i++) s += (int8_t)w[2 + i] * a.q[32 * b + i];
            sum += mf_h2f(rd16(w)) * a.d[b] * s;
        }
        return sum;
#endif
    }
    case T_Q4_0: case T_Q4_1: case T_IQ4_NL: case T_MXFP4: {
        int bs = t == T_Q4_0 ? 18 : t == T_Q4_1 ? 20 : t == T_IQ4_NL ? 18 : 17;
        int off = t == T_Q4_1 ? 4 : t == T_MXFP4 ? 1 : 2;
#ifdef __AVX2__
        __m256 acc = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++, w += bs) {
            _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
            __m256i u = nibbles(w + off), y = _mm256_loadu_si256((const __m256i *)(a.q + 32 * b));
            int32_t sy = a.s16[2 * b] + a.s16[2 * b + 1];
            if (t == T_Q4_0) {
                __m256i v = _mm256_sub_epi8(u, _mm256_set1_epi8(8));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_ss(v, y)), _mm256_set1_ps(mf_h2f(rd16(w)) * a.d[b]), acc);
            } else if (t == T_Q4_1) {
                float d = mf_h2f(rd16(w)) * a.d[b];
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us(u, y)), _mm256_set1_ps(d), acc);
                sum += mf_h2f(rd16(w + 2)) * a.d[b] * sy;
            } else {
                float d = (t == T_IQ4_NL ? mf_h2f(rd16(w)) : e8m0_half(w[0])) * a.d[b];
                __m256i v = lut16(u, t == T_IQ4_NL ? KV_IQ4NL : KV_MXFP4);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_ss(v, y)), _mm256_set1_ps(d), acc);
            }
        }
        return sum + hsum8(acc);
#else
        for (int b = 0; b < nb; b++, w += bs) {
            int s = 0, sy = a.s16[2 * b] + a.s16[2 * b + 1];
            for (int i = 0; i < 32; i++) {
                int q = i < 16 ? (w[off + i] & 15) : (w[off + i - 16] >> 4);
                if (t == T_IQ4_NL) q = KV_IQ4NL[q]; else if (t == T_MXFP4) q = KV_MXFP4[q];
                s += q * a.q[32 * b + i];
            }
            if (t == T_Q4_0) sum += mf_h2f(rd16(w)) * a.d[b] * (s - 8 * sy);
            else if (t == T_Q4_1) sum += mf_h2f(rd16(w)) * a.d[b] * s + mf_h2f(rd16(w + 2)) * a.d[b] * sy;
            else sum += (t == T_IQ4_NL ? mf_h2f(rd16(w)) : e8m0_half(w[0])) * a.d[b] * s;
        }
        return sum;
#endif
    }
    case T_Q5_0: case T_Q5_1: {
        int bs = t == T_Q5_0 ? 22 : 24, off = t == T_Q5_0 ? 2 : 4;
        for (int b = 0; b < nb; b++, w += bs) {
            uint32_t qh; memcpy(&qh, w + off, 4);
            const uint8_t *qs = w + off + 4;
            int s = 0, sy = a.s16[2 * b] + a.s16[2 * b + 1];
            for (int i = 0; i < 32; i++) {
                int q = (i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4)) | (((qh >> i) & 1) << 4);
                s += q * a.q[32 * b + i];
            }
            float d = mf_h2f(rd16(w)) * a.d[b];
            sum += t == T_Q5_0 ? d * (s - 16 * sy) : d * s + mf_h2f(rd16(w + 2)) * a.d[b] * sy;
        }
        return sum;
    }
    case T_Q4_K: case T_Q5_K: {
        int bs = t == T_Q4_K ? 144 : 176;
#ifdef __AVX2__
        __m256 acc = _mm256_setzero_ps();
        for (int sb = 0; sb < K / 256; sb++, w += bs) {
            for (int c = 0; c < bs; c += 64) _mm_prefetch((const char *)(w + PREFETCH + c), _MM_HINT_T0);
            float dy = a.dk[sb], d = mf_h2f(rd16(w)) * dy, dmin = mf_h2f(rd16(w + 2)) * dy;
            const uint8_t *sc = w + 4, *qh = w + 16, *qs = w + (t == T_Q4_K ? 16 : 48);
            const int8_t *y = a.qk + 256 * sb;
            const int16_t *bsum = a.sk16 + 16 * sb;
            __m256i isum = _mm256_setzero_si256();
            uint8_t scm[16];                       /* 8 scales, then 8 mins */
            _mm_storeu_si128((__m128i *)scm, k4_scales(sc));
            int32_t msum = 0;
            for (int j = 0; j < 8; j++) msum += scm[8 + j] * (bsum[2 * j] + bsum[2 * j + 1]);
            __m256i hbits = t == T_Q5_K ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                __m256i raw4 = _mm256_loadu_si256((const __m256i *)(qs + 16 * j));
                __m256i u0 = _mm256_and_si256(raw4, _mm256_set1_epi8(0x0f));
                __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(raw4, 4), _mm256_set1_epi8(0x0f));
                if (t == T_Q5_K) {
                    u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, j), _mm256_set1_epi8(1)), 4));
                    u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, j + 1), _mm256_set1_epi8(1)), 4));
                }
                __m256i p0 = dot_us(u0, _mm256_loadu_si256((const __m256i *)(y + 32 * j)));
                __m256i p1 = dot_us(u1, _mm256_loadu_si256((const __m256i *)(y + 32 * j + 32)));
                isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(p0, _mm256_set1_epi32(scm[j])));
                isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(p1, _mm256_set1_epi32(scm[j + 1])));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d), acc);
            sum -= dmin * (float)msum;
        }
        return sum + hsum8(acc);
#else
        for (int sb = 0; sb < K / 256; sb++, w += bs) {
            float d = mf_h2f(rd16(w)), dmin = mf_h2f(rd16(w + 2));
            const uint8_t *sc = w + 4, *qh = w + 16, *qs = w + (t == T_Q4_K ? 16 : 48);
            for (int j = 0; j < 8; j++) {
                int scj, mj;
                if (j < 4) { scj = sc[j] & 63; mj = sc[j + 4] & 63; }
                else { scj = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4); mj = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4); }
                int b = sb * 8 + j;
                const int8_t *y = a.q + 32 * b;
                float dy = a.d[b];
                int32_t sy = a.s16[2 * b] + a.s16[2 * b + 1];
                sum -= dmin * mj * dy * sy;
                const uint8_t *q4 = qs + 32 * (j / 2);
                int s = 0;
                for (int i = 0; i < 32; i++) {
                    int q = (j & 1 ? q4[i] >> 4 : q4[i] & 15);
                    if (t == T_Q5_K) q |= ((qh[i] >> j) & 1) << 4;
                    s += q * y[i];
                }
                sum += d * scj * dy * s;
            }
        }
        return sum;
#endif
    }
    case T_Q6_K: {
#ifdef __AVX2__
        __m256 acc = _mm256_setzero_ps();
        for (int sb = 0; sb < K / 256; sb++, w += 210) {
            for (int c = 0; c < 210; c += 64) _mm_prefetch((const char *)(w + PREFETCH + c), _MM_HINT_T0);
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *scales = (const int8_t *)(w + 192);
            float d = mf_h2f(rd16(w + 208)) * a.dk[sb];
            const int8_t *y = a.qk + 256 * sb;
            const int16_t *bsum = a.sk16 + 16 * sb;
            __m256i isum = _mm256_setzero_si256();
            int32_t osum = 0;
            for (int g = 0; g < 16; g++) osum += scales[g] * bsum[g];
            for (int j = 0; j < 8; j++) {
                int h = j / 4, r0 = 32 * (j % 4), ls = 4 * (r0 / 64), hs = 2 * (r0 / 32);
                const uint8_t *l = ql + 64 * h + (r0 % 64), *hh = qh + 32 * h;
                __m256i lo = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)l), ls), _mm256_set1_epi8(0x0f));
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)hh), hs), _mm256_set1_epi8(3));
                __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                __m256i p = dot_us(u, _mm256_loadu_si256((const __m256i *)(y + 32 * j)));
                __m256i scv = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi32(scales[2 * j])),
                                                      _mm_set1_epi32(scales[2 * j + 1]), 1);
                isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(p, scv));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d), acc);
            sum -= d * 32.f * (float)osum;
        }
        return sum + hsum8(acc);
#else
        for (int sb = 0; sb < K / 256; sb++, w += 210) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *scales = (const int8_t *)(w + 192);
            float d = mf_h2f(rd16(w + 208));
            for (int j = 0; j < 8; j++) {
                int h = j / 4, r0 = 32 * (j % 4), b = sb * 8 + j;
                const int8_t *y = a.q + 32 * b;
                float dy = a.d[b];
                const uint8_t *l = ql + 64 * h + (r0 % 64), *hh = qh + 32 * h;
                int ls = 4 * (r0 / 64), hs = 2 * (r0 / 32);
                float s0 = d * scales[2 * j] * dy, s1 = d * scales[2 * j + 1] * dy;
                sum -= 32.f * (s0 * a.s16[2 * b] + s1 * a.s16[2 * b + 1]);
                int p0 = 0, p1 = 0;
                for (int i = 0; i < 32; i++) {
                    int q = ((l[i] >> ls) & 15) | (((hh[i] >> hs) & 3) << 4);
                    if (i < 16) p0 += q * y[i]; else p1 += q * y[i];
                }
                sum += s0 * p0 + s1 * p1;
            }
        }
        return sum;
#endif
    }
    }
    return 0.f;
}

static int is_float_type(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }

/* bytes of one row of K values */
static int64_t row_bytes(int t, int K) {
    switch (t) {
    case T_F32: return 4 * (int64_t)K;
    case T_F16: case T_BF16: return 2 * (int64_t)K;
    case T_Q8_0: return K / 32 * 34;
    case T_Q4_0: case T_IQ4_NL: return K / 32 * 18;
    case T_Q4_1: return K / 32 * 20;
    case T_Q5_0: return K / 32 * 22;
    case T_Q5_1: return K / 32 * 24;
    case T_MXFP4: return K / 32 * 17;
    case T_Q4_K: return K / 256 * 144;
    case T_Q5_K: return K / 256 * 176;
    case T_Q6_K: return K / 256 * 210;
    }
    if (is_lowbit(t)) return K / 256 * lb_type_size(t);
    return 0;
}

int64_t mf_row_bytes(int t, int K) { return row_bytes(t, K); }

/* scratch bytes of one quantized activation of K values (qact above) */
static int64_t qact_bytes(int K) { return 3 * (int64_t)K + K / 32 * 8 + K / 16 * 4 + K / 256 * 4; }
int64_t mf_qact_bytes(int K) { return qact_bytes(K); }

static qact qact_at(uint8_t *base, int K) {
    qact a; int64_t o = 0;
    a.q = (int8_t *)base; o += K;
    a.qk = (int8_t *)(base + o); o += K;
    a.d = (float *)(base + o); o += K / 32 * 4;
    a.dsy = (float *)(base + o); o += K / 32 * 4;
    a.dk = (float *)(base + o); o += K / 256 * 4;
    a.s16 = (int16_t *)(base + o); o += K / 16 * 2;
    a.sk16 = (int16_t *)(base + o); o += K / 16 * 2;
    a.qn = (int8_t *)(base + o);
    return a;
}

/* the quantized form of the fp32 activation x [K] into out (qact_bytes(K) bytes, qact_at's
 * layout): for tests */
void mf_quantize_act(const float *x, int K, uint8_t *out) { quantize_act(x, K, qact_at(out, K)); }

/* one-time tables of the vector paths (idempotent: concurrent first callers write the same bytes) */
static void kernels_init(void) {
#ifdef HAVE512
    static int ready;
    if (!ready) { perm_init(); ready = 1; }
#endif
}

/* x row of dtype xdt (0 fp32, 1 fp16, 2 bf16) -> fp32 */
static void load_row(const void *x, int xdt, int64_t row, int K, float *dst) {
    if (xdt == T_BF16) { const uint16_t *p = (const uint16_t *)x + row * K; for (int i = 0; i < K; i++) dst[i] = mf_b2f(p[i]); }
    else if (xdt == T_F16) {
        const uint16_t *p = (const uint16_t *)x + row * K;
        int i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= K; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + i))));
#endif
        for (; i < K; i++) dst[i] = mf_h2f(p[i]);
    }
    else memcpy(dst, (const float *)x + row * K, sizeof(float) * K);
}

/* out[i] = v in dtype ydt (0 fp32, 1 fp16, 2 bf16, rounded to nearest even); with a bias b
 * (dtype ydt) the product is rounded first, then the sum (torch: mm into out, out.add_(b)) */
static inline void store_y(void *y, int ydt, int64_t i, float v, const void *b, int64_t j) {
    if (ydt == T_BF16) {
        uint16_t r = mf_f2b(v);
        if (b) r = mf_f2b(mf_b2f(r) + mf_b2f(((const uint16_t *)b)[j]));
        ((uint16_t *)y)[i] = r;
    } else if (ydt == T_F16) {
        uint16_t r = mf_f2h(v);
        if (b) r = mf_f2h(mf_h2f(r) + mf_h2f(((const uint16_t *)b)[j]));
        ((uint16_t *)y)[i] = r;
    } else ((float *)y)[i] = b ? v + ((const float *)b)[j] : v;
}

/* out[r] = dot_row(t, w + r * rb, ...) for the nr rows r < nr (nr <= 4). stream: the rows are
 * read once (one activation row: a decode step), so Q8_0 / Q6_K rows are read one after the
 * other, one sequential run through memory, rather than four rows side by side (the four-row
 * kernels, faster when the rows stay in the caches for several activation rows: 0.85x the time
 * of the one-row kernel for Q4_K and Q6_K, Q8_0 0.95x). Q4_K / Q5_K take the four-row kernel
 * in a decode step too: its four independent chains of sums beat the one sequential run even
 * from DRAM (1 thread, 256 MiB of 1024x1024 and 2048x1024 matrices: 0.86-0.90x the one-row
 * kernel's time; Q6_K the other way, 1.12-1.17x; docs/benchmarks.md). These four-row kernels
 * give bit for bit the one-row kernel's sums, so a row's value does not depend on how many
 * activation rows a step has. */
static inline void dot_rows(int t, const uint8_t *w, int64_t rb, int nr, const float *xf, qact a, int K, float *out,
                            int stream) {
#ifdef HAVE512
    if (nr == 4 && K % 128 == 0 && (t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_IQ4_NL || t == T_MXFP4)) {
        dot4_b32_512(t, w, rb, a, K / 32, out);
        return;
    }
    if (nr == 4 && !stream && K % 128 == 0 && t == T_Q8_0) { dot4_q80_512(w, rb, a, K / 32, out); return; }
    if (nr == 4 && (t == T_Q4_K || t == T_Q5_K)) { dot4_k45_512(t, w, rb, a, K, out); return; }
    if (nr == 4 && (t == T_Q2_K || t == T_Q3_K)) { dot4_q23_512(t, w, rb, a, K, out); return; }
    if (nr == 4 && !stream && t == T_Q6_K) { dot4_q6k_512(w, rb, a, K, out); return; }
#endif
    for (int r = 0; r < nr; r++) out[r] = dot_row(t, w + r * rb, xf, a, K);
}

#ifdef HAVE_IQ4X
/* rows of IQ4_XS weights taken together by the dense and the MoE products: each chunk of
 * IQ4X_MAXT activation rows meets the group's 4 panels of 16 rows in turn while it is in the
 * caches (the activations of a 512-token chunk of a 2048-wide model are 1.7 MB) */
#define IQ4X_GROUP 64

/* iq4x_rows16 of the nr (<= IQ4X_GROUP) IQ4_XS rows at w against n quantized activation rows
 * (qb bytes apart from xq; with tok, rows tok[0..n) of xq), IQ4X_MAXT at a time:
 * out[i * ldo + r] */
static void iq4x_acts_rows(const uint8_t *w, int64_t rb, int nr, int K, uint8_t *xq, int64_t qb, const int64_t *tok,
                           int64_t n, float *out, int64_t ldo) {
    for (int64_t i0 = 0; i0 < n; i0 += IQ4X_MAXT) {
        int na = (int)(n - i0 < IQ4X_MAXT ? n - i0 : IQ4X_MAXT);
        qact acts[IQ4X_MAXT];
        for (int i = 0; i < na; i++) acts[i] = qact_at(xq + (tok ? tok[i0 + i] : i0 + i) * qb, K);
        for (int r = 0; r < nr; r += 16)
            iq4x_rows16(w + r * rb, rb, nr - r < 16 ? nr - r : 16, K, acts, na, out + i0 * ldo + r, ldo);
    }
}

/* (gemm_rows) rows r .. r + nr - 1 (nr <= IQ4X_GROUP) of an IQ4_XS matrix W against the n rows
 * of xq, into y */
static void iq4x_gemm(const uint8_t *W, int64_t rb, int r, int nr, int K, uint8_t *xq, int64_t qb, int n, void *y,
                      int ydt, int ldy, const void *bias) {
    float v[IQ4X_MAXT * IQ4X_GROUP];
    for (int i0 = 0; i0 < n; i0 += IQ4X_MAXT) {
        int na = n - i0 < IQ4X_MAXT ? n - i0 : IQ4X_MAXT;
        iq4x_acts_rows(W + r * rb, rb, nr, K, xq + i0 * qb, qb, NULL, na, v, IQ4X_GROUP);
        for (int i = 0; i < na; i++)
            for (int j = 0; j < nr; j++)
                store_y(y, ydt, (int64_t)(i0 + i) * ldy + r + j, v[IQ4X_GROUP * i + j], bias, r + j);
    }
}
#endif

/* rows of y [n, N] (dtype ydt, row stride ldy, plus bias [N] when not NULL) = x [n, K] . W^T,
 * inside a parallel region whose end is the only barrier after it (nowait: its one caller,
 * gemm_ex_body, ends there): chunks of rows taken as the threads come (a thread whose core is
 * shared with another process takes fewer, where a static split would wait for it). xb: the bf16 rows of x when x is bf16 (BF16
 * weights then multiply them with vdpbf16ps), else NULL. */
#ifdef HAVE_Q6K_TILE
/* q6k_tile of 16 rows (row r0 .. r0 + 15 of W, wr its first) against the n quantized rows of
 * xq (qb bytes each) into y (store_y: dtype ydt, row stride ldy, bias) */
static void ktile_store(int t, const uint8_t *wr, int64_t rb, int K, uint8_t *xq, int64_t qb, int n, void *y, int ydt,
                           int ldy, const void *bias, int r0) {
    float v[Q6K_TILE_MAXA * 16];
    for (int i0 = 0; i0 < n; i0 += Q6K_TILE_MAXA) {
        int na = n - i0 < Q6K_TILE_MAXA ? n - i0 : Q6K_TILE_MAXA;
        ktile_rows(t, wr, rb, K, xq + (int64_t)i0 * qb, qb, NULL, na, v, 16);
        for (int i = 0; i < na; i++)
            for (int j = 0; j < 16; j++) store_y(y, ydt, (int64_t)(i0 + i) * ldy + r0 + j, v[16 * i + j], bias, r0 + j);
    }
}
#endif

static void gemm_rows(int t, const uint8_t *W, int N, int K, int n, const float *xf, uint8_t *xq, void *y, int ydt,
                      int ldy, const void *bias, const uint16_t *xb) {
    int64_t rb = row_bytes(t, K), qb = qact_bytes(K);
#ifdef HAVE_BF16DOT
    if (t == T_BF16 && xb) {
#pragma omp for schedule(dynamic, 128) nowait
        for (int r = 0; r < N; r++) {
            int i = 0;
            for (; i + 4 <= n; i += 4) {      /* 4 sequences of a step: the row read once */
                float v[4];
                dot_bf16x4_512(W + r * rb, xb + (int64_t)i * K, K, K, v);
                for (int j = 0; j < 4; j++) store_y(y, ydt, (int64_t)(i + j) * ldy + r, v[j], bias, r);
            }
            for (; i < n; i++)
                store_y(y, ydt, (int64_t)i * ldy + r, dot_bf16x_512(W + r * rb, xb + (int64_t)i * K, K), bias, r);
        }
        return;
    }
#endif
    (void)xb;
#pragma omp for schedule(dynamic, 32) nowait
    for (int r4 = 0; r4 < (N + 3) / 4; r4++) {
        int r = 4 * r4, nr = N - r < 4 ? N - r : 4;
        const uint8_t *wr = W + r * rb;
#ifdef HAVE_IQ4X
        if (t == T_IQ4_XS) {          /* IQ4X_GROUP rows at a time: the first r4 of each group takes them */
            if (r % IQ4X_GROUP == 0) iq4x_gemm(W, rb, r, N - r < IQ4X_GROUP ? N - r : IQ4X_GROUP, K, xq, qb, n, y, ydt, ldy, bias);
            continue;
        }
#endif
        if (is_lowbit(t) && n > 1) {
            /* LB_MAXR activation rows at a time against each of the (up to 4) weight rows: each
             * super-block unpacked once per LB_MAXR rows, the activations reused from L1 */
            for (int i0 = 0; i0 < n; i0 += LB_MAXR) {
                int na = n - i0 < LB_MAXR ? n - i0 : LB_MAXR;
                qact acts[LB_MAXR];
                for (int i = 0; i < na; i++) acts[i] = qact_at(xq + (i0 + i) * qb, K);
                for (int j = 0; j < nr; j++) {
                    float v[LB_MAXR];
                    lowbit_rows(t, wr + j * rb, K, acts, na, v);
                    for (int i = 0; i < na; i++) store_y(y, ydt, (int64_t)(i0 + i) * ldy + r + j, v[i], bias, r + j);
                }
            }
            continue;
        }
#ifdef HAVE_Q6K_TILE
        if (is_ktile(t, n) && N % 16 == 0) {   /* 16 rows per group of 4 r4 */
            if (r % 16 == 0) ktile_store(t, wr, rb, K, xq, qb, n, y, ydt, ldy, bias, r);
            continue;
        }
#endif
#ifdef HAVE_Q6K_TOK
        if (t == T_Q6_K && n > 1) {
            /* each weight row unpacked once per Q6K_MAXT activation rows (q6k_tok) */
            for (int i0 = 0; i0 < n; i0 += Q6K_MAXT) {
                int na = n - i0 < Q6K_MAXT ? n - i0 : Q6K_MAXT;
                qact acts[Q6K_MAXT];
                for (int i = 0; i < na; i++) acts[i] = qact_at(xq + (i0 + i) * qb, K);
                for (int j = 0; j < nr; j++) {
                    float v[Q6K_MAXT];
                    q6k_tok(wr + j * rb, K, acts, na, v, 1);
                    for (int i = 0; i < na; i++) store_y(y, ydt, (int64_t)(i0 + i) * ldy + r + j, v[i], bias, r + j);
                }
            }
            continue;
        }
#endif
        for (int i = 0; i < n; i++) {
            float v[4];
            dot_rows(t, wr, rb, nr, xf + (int64_t)i * K, qact_at(xq + i * qb, K), K, v, n == 1);
            for (int j = 0; j < nr; j++) store_y(y, ydt, (int64_t)i * ldy + r + j, v[j], bias, r + j);
        }
    }
}

/* The work of one thread of mf_gemm_ex (its worksharing loops are orphaned: on the calling
 * thread alone, outside a parallel region, they run whole with no barrier. A parallel region
 * of one thread would still end every loop with a barrier, which this libgomp ends with a
 * futex wake-up syscall: a tenth of a one-thread decode step went there.) */
static void load_rows(const void *x, int xdt, int i0, int i1, int K, float *xf, uint8_t *xq, int fl) {
    for (int i = i0; i < i1; i++) {
        load_row(x, xdt, i, K, xf + (int64_t)i * K);
        if (!fl) quantize_act(xf + (int64_t)i * K, K, qact_at(xq + i * qact_bytes(K), K));
    }
}

/* rows of a decode step (a few) are converted and quantized by the calling thread before the
 * parallel region, sparing the region a barrier (a microsecond of work against a barrier's
 * futex syscall and the other threads' wait) */
#define SERIAL_ROWS 4

static void gemm_ex_body(int t, const uint8_t *W, int N, int K, const void *x, int xdt, int n, void *y, int ydt,
                         const void *bias, float *xf, uint8_t *xq, int fl) {
    if (n > SERIAL_ROWS) {
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) load_rows(x, xdt, i, i + 1, K, xf, xq, fl);
    }
    gemm_rows(t, W, N, K, n, xf, xq, y, ydt, N, bias, xdt == T_BF16 ? (const uint16_t *)x : NULL);
}

/* y [n, N] (dtype ydt: 0 fp32, 1 fp16, 2 bf16) = x [n, K] (dtype xdt) . W [N, K]^T (+ bias [N],
 * dtype ydt), W rows of type t. scratch: n * (4K + qact_bytes(K)) bytes. */
void mf_gemm_ex(int t, const uint8_t *W, int N, int K, const void *x, int xdt, int n, void *y, int ydt,
                const void *bias, uint8_t *scratch, int nthreads) {
    float *xf = (float *)scratch;
    uint8_t *xq = scratch + (int64_t)n * K * 4;
    int fl = is_float_type(t);
    kernels_init();
    /* a small matrix (a router, a K/V projection of a small model) is not worth a fork */
    int nt = (int64_t)N * row_bytes(t, K) * n < SMALL_WORK ? 1 : nthreads;
    if (n <= SERIAL_ROWS) load_rows(x, xdt, 0, n, K, xf, xq, fl);
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        gemm_ex_body(t, W, N, K, x, xdt, n, y, ydt, bias, xf, xq, fl);
    } else gemm_ex_body(t, W, N, K, x, xdt, n, y, ydt, bias, xf, xq, fl);
}

/* y [n, N] fp32 = x [n, K] (fp32, or bf16 when xbf16) . W [N, K]^T, W rows of type t.
 * scratch: n * (4K + qact_bytes(K)) bytes. */
void mf_gemm(int t, const uint8_t *W, int N, int K, const void *x, int xbf16, int n, float *y,
             uint8_t *scratch, int nthreads) {
    mf_gemm_ex(t, W, N, K, x, xbf16 ? T_BF16 : T_F32, n, y, T_F32, NULL, scratch, nthreads);
}

static inline float silu(float v) { return v / (1.f + expf(-v)); }

#ifdef HAVE512
/* exp(x), 16 values: 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in two parts (Cody and
 * Waite), exp(r) by Cephes' expf polynomial (within 2 ulp of expf); x clamped to [-104, 89]
 * first (expf is 0 below, inf above; a NaN stays NaN) */
static inline __m512 exp_512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), _mm512_min_ps(_mm512_set1_ps(89.f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif

/* h[j] = silu(g[j]) * u[j] for j < n (SwiGLU); with AVX-512 16 values a step, exp by exp_512
 * (the scalar expf was a fifth of a batched prefill layer's time), the rest as silu */
static void swiglu(const float *g, const float *u, float *h, int n) {
    int j = 0;
#ifdef HAVE512
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(g + j);
        __m512 e = exp_512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        __m512 sv = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(h + j, _mm512_mul_ps(sv, _mm512_loadu_ps(u + j)));
    }
#endif
    for (; j < n; j++) h[j] = silu(g[j]) * u[j];
}

/* Routed experts of one MoE layer, SwiGLU, combined: acc [T, H] += sum over pairs p of
 * wt[p] * down(silu(gate(x[tok[p]])) * up(x[tok[p]])), pairs grouped by expert:
 * expert i (blob blobs[i]) serves pairs bounds[i] .. bounds[i+1]-1.
 * Blob: gate [I, H] type tg at 0, up [I, H] type tu at off_u, down [H, I] type td at off_d.
 * x [T, H] of dtype xdt (0 fp32, 1 fp16, 2 bf16).
 * scratch: T * (4H + qact(H)) bytes for the token rows (converted and quantized once), then
 * pchunk * (8I + 4I + qact(I) + 4H) for pchunk pairs at a time (gate/up outputs, SwiGLU
 * product and its quantized form -- for bf16 experts in a bf16 model the product rounded to
 * bf16, in an fp16 model to fp16, as the torch expert holds it --, down output).
 * Work is split over the threads by chunks of rows of the chunk's experts, taken as they come
 * (gate and up rows, then down rows); each row is read once and multiplied by every token of its expert in the chunk, so
 * the tokens of a batch routed to one expert share one read of its weights, and a layer costs
 * a few barriers, not a few per expert. */
static void moe_body(int n_exp, const uint8_t *const *blobs, const int64_t *bounds, const int64_t *tok,
                     const float *wt, const void *x, int xdt, float *acc, int T, int H, int I, int tg, int tu,
                     int td, int64_t off_u, int64_t off_d, uint8_t *scratch, int pchunk) {
    int64_t qh = qact_bytes(H), qi = qact_bytes(I), P = bounds[n_exp];
    int64_t rbg = row_bytes(tg, H), rbu = row_bytes(tu, H), rbd = row_bytes(td, I);
    float *xf = (float *)scratch;                                  /* [T, H] */
    uint8_t *xq = scratch + (int64_t)T * H * 4;                    /* [T] qact(H) */
    float *gu = (float *)(xq + (int64_t)T * qh);                   /* [pc, 2I] */
    float *hf = gu + (int64_t)pchunk * 2 * I;                      /* [pc, I] */
    uint8_t *hq = (uint8_t *)(hf + (int64_t)pchunk * I);           /* [pc] qact(I) */
    float *yd = (float *)(hq + (int64_t)pchunk * qi);              /* [pc, H] */
    int qx = !is_float_type(tg) || !is_float_type(tu), qd = !is_float_type(td);
    const uint16_t *xb = xdt == T_BF16 ? (const uint16_t *)x : NULL;
#ifdef HAVE_BF16DOT
    int hb16 = td == T_BF16 && xdt == T_BF16;
#else
    int hb16 = 0;
#endif
    {
        if (T > SERIAL_ROWS) {         /* else done by mf_moe before the region */
#pragma omp for schedule(static)
            for (int i = 0; i < T; i++) load_rows(x, xdt, i, i + 1, H, xf, xq, !qx);
        }
        int e = 0;
        for (int64_t p0 = 0; p0 < P; p0 += pchunk) {
            int n = (int)(P - p0 < pchunk ? P - p0 : pchunk);
            while (bounds[e + 1] <= p0) e++;                       /* expert of pair p0 */
            int e1 = e;
            while (bounds[e1 + 1] < p0 + n) e1++;                  /* expert of the chunk's last pair */
            int ne = e1 - e + 1;
            /* gate and up rows, 4 at a time (I is a multiple of 32: a group never straddles them) */
#pragma omp for schedule(dynamic, 32)
            for (int64_t idx = 0; idx < (int64_t)ne * (2 * I / 4); idx++) {
                int ee = e + (int)(idx / (2 * I / 4)), r = 4 * (int)(idx % (2 * I / 4));
                int64_t pa = bounds[ee] > p0 ? bounds[ee] : p0, pb = bounds[ee + 1] < p0 + n ? bounds[ee + 1] : p0 + n;
                int tt = r < I ? tg : tu;
                int64_t rbt = r < I ? rbg : rbu;
                const uint8_t *w = r < I ? blobs[ee] + r * rbg : blobs[ee] + off_u + (r - I) * rbu;
#ifdef HAVE_IQ4X
                if (tt == T_IQ4_XS) {     /* IQ4X_GROUP rows of gate or up at a time (iq4x_rows16) */
                    int rr = r < I ? r : r - I;
                    if (rr % IQ4X_GROUP == 0)
                        iq4x_acts_rows(w, rbt, I - rr < IQ4X_GROUP ? I - rr : IQ4X_GROUP, H, xq, qh, tok + pa, pb - pa,
                                       gu + (pa - p0) * 2 * I + r, 2 * I);
                    continue;
                }
#endif
                if (is_lowbit(tt) && pb - pa > 1) {
                    for (int64_t q0 = pa; q0 < pb; q0 += LB_MAXR) {
                        int na = (int)(pb - q0 < LB_MAXR ? pb - q0 : LB_MAXR);
                        qact acts[LB_MAXR];
                        for (int i = 0; i < na; i++) acts[i] = qact_at(xq + tok[q0 + i] * qh, H);
                        lowbit_block(tt, w, rbt, 4, H, acts, na, gu + (q0 - p0) * 2 * I + r, 2 * I);
                    }
                    continue;
                }
#ifdef HAVE_Q6K_TILE
                if (is_ktile(tt, pb - pa) && I % 16 == 0) {   /* 16 rows per group of 4 idx */
                    if (r % 16 == 0) ktile_rows(tt, w, rbt, H, xq, qh, tok + pa, pb - pa, gu + (pa - p0) * 2 * I + r, 2 * I);
                    continue;
                }
#endif
#ifdef HAVE_Q6K_TOK
                if (tt == T_Q6_K && pb - pa > 1) {      /* each row unpacked once per Q6K_MAXT tokens */
                    for (int64_t q0 = pa; q0 < pb; q0 += Q6K_MAXT) {
                        int na = (int)(pb - q0 < Q6K_MAXT ? pb - q0 : Q6K_MAXT);
                        qact acts[Q6K_MAXT];
                        for (int i = 0; i < na; i++) acts[i] = qact_at(xq + tok[q0 + i] * qh, H);
                        for (int j = 0; j < 4; j++)
                            q6k_tok(w + j * rbt, H, acts, na, gu + (q0 - p0) * 2 * I + r + j, 2 * I);
                    }
                    continue;
                }
#endif
                for (int64_t p = pa; p < pb; p++) {
                    int64_t t = tok[p];
                    float *dst = gu + (p - p0) * 2 * I + r;
#ifdef HAVE_BF16DOT
                    if (tt == T_BF16 && xb) {
                        for (int j = 0; j < 4; j++) dst[j] = dot_bf16x_512(w + j * rbt, xb + t * H, H);
                        continue;
                    }
#endif
                    dot_rows(tt, w, rbt, 4, xf + t * H, qact_at(xq + t * qh, H), H, dst, pb - pa == 1);
                }
            }
#pragma omp for schedule(static)
            for (int i = 0; i < n; i++) {
                float *g = gu + (int64_t)i * 2 * I, *h = hf + (int64_t)i * I;
                swiglu(g, g + I, h, I);
                if (xdt == T_F16)    /* fp16 compute: the product as the fp16 tensor the torch expert holds */
                    round_f16(h, I);
                if (qd) quantize_act(h, I, qact_at(hq + i * qi, I));
                else if (hb16) {     /* bf16 experts, bf16 compute: the product as a bf16 tensor */
                    uint16_t *hb = (uint16_t *)(hq + i * qi);
                    for (int j = 0; j < I; j++) hb[j] = mf_f2b(h[j]);
                }
            }
#pragma omp for schedule(dynamic, 32)
            for (int64_t idx = 0; idx < (int64_t)ne * (H / 4); idx++) {
                int ee = e + (int)(idx / (H / 4)), r = 4 * (int)(idx % (H / 4));
                int64_t pa = bounds[ee] > p0 ? bounds[ee] : p0, pb = bounds[ee + 1] < p0 + n ? bounds[ee + 1] : p0 + n;
                const uint8_t *w = blobs[ee] + off_d + r * rbd;
#ifdef HAVE_IQ4X
                if (td == T_IQ4_XS) {
                    if (r % IQ4X_GROUP == 0)
                        iq4x_acts_rows(w, rbd, H - r < IQ4X_GROUP ? H - r : IQ4X_GROUP, I, hq + (pa - p0) * qi, qi, NULL, pb - pa,
                                       yd + (pa - p0) * H + r, H);
                    continue;
                }
#endif
                if (is_lowbit(td) && pb - pa > 1) {
                    for (int64_t q0 = pa; q0 < pb; q0 += LB_MAXR) {
                        int na = (int)(pb - q0 < LB_MAXR ? pb - q0 : LB_MAXR);
                        qact acts[LB_MAXR];
                        for (int i = 0; i < na; i++) acts[i] = qact_at(hq + (q0 - p0 + i) * qi, I);
                        lowbit_block(td, w, rbd, 4, I, acts, na, yd + (q0 - p0) * H + r, H);
                    }
                    continue;
                }
#ifdef HAVE_Q6K_TILE
                if (is_ktile(td, pb - pa) && H % 16 == 0) {
                    if (r % 16 == 0) ktile_rows(td, w, rbd, I, hq + (pa - p0) * qi, qi, NULL, pb - pa, yd + (pa - p0) * H + r, H);
                    continue;
                }
#endif
#ifdef HAVE_Q6K_TOK
                if (td == T_Q6_K && pb - pa > 1) {
                    for (int64_t q0 = pa; q0 < pb; q0 += Q6K_MAXT) {
                        int na = (int)(pb - q0 < Q6K_MAXT ? pb - q0 : Q6K_MAXT);
                        qact acts[Q6K_MAXT];
                        for (int i = 0; i < na; i++) acts[i] = qact_at(hq + (q0 - p0 + i) * qi, I);
                        for (int j = 0; j < 4; j++) q6k_tok(w + j * rbd, I, acts, na, yd + (q0 - p0) * H + r + j, H);
                    }
                    continue;
                }
#endif
                for (int64_t p = pa; p < pb; p++) {
                    int64_t i = p - p0;
#ifdef HAVE_BF16DOT
                    if (hb16) {
                        for (int j = 0; j < 4; j++)
                            yd[i * H + r + j] = dot_bf16x_512(w + j * rbd, (const uint16_t *)(hq + i * qi), I);
                        continue;
                    }
#endif
                    dot_rows(td, w, rbd, 4, hf + i * I, qact_at(hq + i * qi, I), I, yd + i * H + r, pb - pa == 1);
                }
            }
            /* no barrier after the combine: the next chunk's gate / up loop writes gu only, and
             * its barrier comes before yd is written again */
#pragma omp for schedule(static) nowait
            for (int c = 0; c < H; c += 64) {
                int c1 = c + 64 < H ? c + 64 : H;
                for (int i = 0; i < n; i++) {
                    float *dst = acc + tok[p0 + i] * (int64_t)H, w = wt[p0 + i];
                    const float *src = yd + (int64_t)i * H;
                    for (int k = c; k < c1; k++) dst[k] += w * src[k];
                }
            }
        }
    }
}

/* (see moe_body) the work of one thread; a parallel region only for two threads or more, as
 * in mf_gemm_ex */
void mf_moe(int n_exp, const uint8_t *const *blobs, const int64_t *bounds, const int64_t *tok,
            const float *wt, const void *x, int xdt, float *acc, int T, int H, int I, int tg, int tu, int td,
            int64_t off_u, int64_t off_d, uint8_t *scratch, int pchunk, int nthreads) {
    kernels_init();
    if (T <= SERIAL_ROWS) {
        int qx = !is_float_type(tg) || !is_float_type(tu);
        load_rows(x, xdt, 0, T, H, (float *)scratch, scratch + (int64_t)T * H * 4, !qx);
    }
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        moe_body(n_exp, blobs, bounds, tok, wt, x, xdt, acc, T, H, I, tg, tu, td, off_u, off_d, scratch, pchunk);
    } else moe_body(n_exp, blobs, bounds, tok, wt, x, xdt, acc, T, H, I, tg, tu, td, off_u, off_d, scratch, pchunk);
}

/* ---- dequantization: rows of W -> fp32 / bf16, bit for bit as ggml's dequantize_row_* -------
 * (the same fp32 operations in the same order: built with -ffp-contract=off, no FMA) */
/* one block (32 values, or 256 for the K-quants) -> y */
static void dequant_block(int t, const uint8_t *w, float *y) {
    if (is_lowbit(t)) { dequant_lowbit(t, w, y); return; }
    switch (t) {
    case T_Q8_0: { float d = mf_h2f(rd16(w)); for (int i = 0; i < 32; i++) y[i] = (int8_t)w[2 + i] * d; return; }
    case T_Q4_0: { float d = mf_h2f(rd16(w)); const uint8_t *q = w + 2;
        for (int i = 0; i < 16; i++) { y[i] = ((q[i] & 15) - 8) * d; y[i + 16] = ((q[i] >> 4) - 8) * d; } return; }
    case T_Q4_1: { float d = mf_h2f(rd16(w)), m = mf_h2f(rd16(w + 2)); const uint8_t *q = w + 4;
        for (int i = 0; i < 16; i++) { y[i] = (q[i] & 15) * d + m; y[i + 16] = (q[i] >> 4) * d + m; } return; }
    case T_Q5_0: case T_Q5_1: {
        int off = t == T_Q5_0 ? 2 : 4; float d = mf_h2f(rd16(w)), m = t == T_Q5_1 ? mf_h2f(rd16(w + 2)) : 0.f;
        uint32_t qh; memcpy(&qh, w + off, 4); const uint8_t *q = w + off + 4;
        for (int i = 0; i < 16; i++) {
            int x0 = (q[i] & 15) | (((qh >> i) & 1) << 4), x1 = (q[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
            if (t == T_Q5_0) { y[i] = (x0 - 16) * d; y[i + 16] = (x1 - 16) * d; }
            else { y[i] = x0 * d + m; y[i + 16] = x1 * d + m; }
        }
        return; }
    case T_IQ4_NL: { float d = mf_h2f(rd16(w)); const uint8_t *q = w + 2;
        for (int i = 0; i < 16; i++) { y[i] = d * KV_IQ4NL[q[i] & 15]; y[i + 16] = d * KV_IQ4NL[q[i] >> 4]; } return; }
    case T_MXFP4: { float d = e8m0_half(w[0]); const uint8_t *q = w + 1;
        for (int i = 0; i < 16; i++) { y[i] = KV_MXFP4[q[i] & 15] * d; y[i + 16] = KV_MXFP4[q[i] >> 4] * d; } return; }
    case T_Q4_K: case T_Q5_K: {
        float d = mf_h2f(rd16(w)), dmin = mf_h2f(rd16(w + 2));
        const uint8_t *sc = w + 4, *qh = w + 16, *qs = w + (t == T_Q4_K ? 16 : 48);
        for (int j = 0; j < 8; j++) {
            int scj, mj;
            if (j < 4) { scj = sc[j] & 63; mj = sc[j + 4] & 63; }
            else { scj = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4); mj = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4); }
            float d1 = d * scj, m1 = dmin * mj;
            const uint8_t *q4 = qs + 32 * (j / 2);
            int sh = 4 * (j & 1);
            for (int i = 0; i < 32; i++) {
                int q = (q4[i] >> sh) & 15;
                if (t == T_Q5_K) q |= ((qh[i] >> j) & 1) << 4;
                y[32 * j + i] = d1 * q - m1;
            }
        }
        return; }
    case T_Q6_K: {
        const uint8_t *ql = w, *qh = w + 128; const int8_t *sc = (const int8_t *)(w + 192);
        float d = mf_h2f(rd16(w + 208));
        for (int j = 0; j < 8; j++) {
            int h = j / 4, r0 = 32 * (j % 4), ls = 4 * (r0 / 64), hs = 2 * (r0 / 32);
            const uint8_t *l = ql + 64 * h + (r0 % 64), *hh = qh + 32 * h;
            float d0 = d * sc[2 * j], d1 = d * sc[2 * j + 1];
            for (int i = 0; i < 32; i++) {
                int q = (((l[i] >> ls) & 15) | (((hh[i] >> hs) & 3) << 4)) - 32;
                y[32 * j + i] = (i < 16 ? d0 : d1) * q;
            }
        }
        return; }
    }
}

/* nrows rows of K values of type t -> out16 (bf16) or out32 (fp32), whichever is not NULL. */
#ifdef HAVE512
/* fp32 -> bf16 of 16 lanes, mf_f2b's rounding (nearest even; NaN stays NaN, quiet bit set) */
static inline __m256i f2b_512(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* one Q6_K super-block (w) as 256 bf16 (o): dequant_block's values (d * scale, then times
 * q - 32, each an fp32 product), 16 at a time (one scale each), rounded as mf_f2b: bit for
 * bit the scalar path's. The values' order in the block is q6k_sb's (low nibbles of 64
 * bytes of ql with two bits of qh each, then the high nibbles). */
static void dequant_q6k_bf16_512(const uint8_t *w, uint16_t *o) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3), o32 = _mm512_set1_epi8(32);
    const int8_t *sc = (const int8_t *)(w + 192);
    float d = mf_h2f(rd16(w + 208));
    for (int h = 0; h < 2; h++) {
        __m512i L = _mm512_loadu_si512((const void *)(w + 64 * h));
        __m256i H = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
        __m512i ha = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1);
        __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(H, 4)), _mm256_srli_epi16(H, 6), 1);
        __m512i v[2];
        v[0] = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(ha, m2), 4)), o32);
        v[1] = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                               _mm512_slli_epi16(_mm512_and_si512(hb, m2), 4)), o32);
        for (int g = 0; g < 2; g++)
            for (int c = 0; c < 4; c++) {
                int k = 8 * h + 4 * g + c;                      /* the 16 values' sub-block */
                __m128i q8 = _mm512_extracti32x4_epi32(v[g], 0);
                if (c == 1) q8 = _mm512_extracti32x4_epi32(v[g], 1);
                if (c == 2) q8 = _mm512_extracti32x4_epi32(v[g], 2);
                if (c == 3) q8 = _mm512_extracti32x4_epi32(v[g], 3);
                __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8));
                _mm256_storeu_si256((__m256i *)(o + 16 * k), f2b_512(_mm512_mul_ps(q, _mm512_set1_ps(d * sc[k]))));
            }
    }
}

/* one low-bit super-block (Q2_K, Q3_K, IQ4_XS, the IQ grids) as 256 bf16 (o): lb_unpack's
 * values, then dequant_lowbit's fp32 operations (dl = f sc, dl v, minus fmin mn for Q2_K; a
 * product and a difference, no FMA) 16 at a time, rounded as mf_f2b: bit for bit the scalar
 * path's. */
static void dequant_lowbit_bf16_512(int t, const uint8_t *w, uint16_t *o) {
    int8_t v[256];
    int32_t sc[16], mn[16];
    float f, fmin = 0.f;
    int mins = lb_unpack(t, w, v, sc, mn, &f, &fmin);
    for (int g = 0; g < 16; g++) {
        __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + 16 * g))));
        __m512 y = _mm512_mul_ps(_mm512_set1_ps(f * (float)sc[g]), q);
        if (mins) y = _mm512_sub_ps(y, _mm512_set1_ps(fmin * (float)mn[g]));
        _mm256_storeu_si256((__m256i *)(o + 16 * g), f2b_512(y));
    }
}

/* one IQ4_XS super-block as 256 bf16 (o), without lb_unpack's scalar loop: per 32 values the 16
 * index bytes split into nibbles and looked up in KV_IQ4NL with vpshufb, then
 * dequant_lowbit's fp32 operations (dl = d x (ls - 32), dl x v, no FMA) 16 at a time, rounded
 * as mf_f2b: bit for bit the scalar path's. */
static void dequant_iq4xs_bf16_512(const uint8_t *w, uint16_t *o) {
    const __m128i tab = _mm_loadu_si128((const __m128i *)KV_IQ4NL), m4 = _mm_set1_epi8(0x0f);
    float d = mf_h2f(rd16(w));
    uint16_t sh = rd16(w + 2);
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((w[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
        __m512 dl = _mm512_set1_ps(d * (float)(ls - 32));
        __m128i q = _mm_loadu_si128((const __m128i *)(w + 8 + 16 * ib));
        __m128i lo = _mm_shuffle_epi8(tab, _mm_and_si128(q, m4)), hi = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
        _mm256_storeu_si256((__m256i *)(o + 32 * ib), f2b_512(_mm512_mul_ps(dl, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)))));
        _mm256_storeu_si256((__m256i *)(o + 32 * ib + 16),
                            f2b_512(_mm512_mul_ps(dl, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)))));
    }
}

/* one Q4_K / Q5_K super-block as 256 bf16 (o): dequant_block's fp32 operations (d1 = d sc,
 * m1 = dmin m, d1 q - m1: a product and a difference, no FMA) 16 at a time, rounded as
 * mf_f2b: bit for bit the scalar path's. */
static void dequant_k45_bf16_512(int t, const uint8_t *w, uint16_t *o) {
    float d = mf_h2f(rd16(w)), dmin = mf_h2f(rd16(w + 2));
    const uint8_t *sc = w + 4, *qh = w + 16, *qs = w + (t == T_Q4_K ? 16 : 48);
    for (int j = 0; j < 8; j++) {
        int scj, mj;
        if (j < 4) { scj = sc[j] & 63; mj = sc[j + 4] & 63; }
        else { scj = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4); mj = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4); }
        __m512 d1 = _mm512_set1_ps(d * scj), m1 = _mm512_set1_ps(dmin * mj);
        const uint8_t *q4 = qs + 32 * (j / 2);
        int sh = 4 * (j & 1);
        for (int h = 0; h < 2; h++) {
            __m512i q = _mm512_and_si512(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q4 + 16 * h))), sh),
                                         _mm512_set1_epi32(15));
            if (t == T_Q5_K)
                q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * h))), j), _mm512_set1_epi32(1)), 4));
            __m512 y = _mm512_sub_ps(_mm512_mul_ps(d1, _mm512_cvtepi32_ps(q)), m1);
            _mm256_storeu_si256((__m256i *)(o + 32 * j + 16 * h), f2b_512(y));
        }
    }
}
#endif

void mf_dequant(int t, const uint8_t *W, int64_t nrows, int K, uint16_t *out16, float *out32, int nthreads) {
    int64_t rb = row_bytes(t, K);
    int bs = (t == T_Q4_K || t == T_Q5_K || t == T_Q6_K || is_lowbit(t)) ? 256 : 32;
    int64_t tb = row_bytes(t, bs);
#pragma omp parallel num_threads(nthreads)
    {
        float y[256];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < nrows; r++) {
            const uint8_t *wr = W + r * rb;
            for (int b = 0; b < K / bs; b++) {
#ifdef HAVE512
                if (t == T_Q6_K && out16 && !out32) {   /* prefill's expert matrices: half the scalar path's time */
                    dequant_q6k_bf16_512(wr + b * tb, out16 + r * K + (int64_t)b * bs);
                    continue;
                }
                if ((t == T_Q4_K || t == T_Q5_K) && out16 && !out32) {
                    dequant_k45_bf16_512(t, wr + b * tb, out16 + r * K + (int64_t)b * bs);
                    continue;
                }
                if (t == T_IQ4_XS && out16 && !out32) {
                    dequant_iq4xs_bf16_512(wr + b * tb, out16 + r * K + (int64_t)b * bs);
                    continue;
                }
                if (is_lowbit(t) && out16 && !out32) {
                    dequant_lowbit_bf16_512(t, wr + b * tb, out16 + r * K + (int64_t)b * bs);
                    continue;
                }
#endif
                float *dst = out32 ? out32 + r * K + (int64_t)b * bs : y;
                if (is_float_type(t)) {
                    for (int i = 0; i < bs; i++) {
                        const uint8_t *p = wr + (int64_t)(b * bs + i) * (t == T_F32 ? 4 : 2);
                        float v; if (t == T_F32) memcpy(&v, p, 4); else v = t == T_BF16 ? mf_b2f(rd16(p)) : mf_h2f(rd16(p));
                        dst[i] = v;
                    }
                } else dequant_block(t, wr + b * tb, dst);
                if (out16) { uint16_t *o = out16 + r * K + (int64_t)b * bs; for (int i = 0; i < bs; i++) o[i] = mf_f2b(dst[i]); }
            }
        }
    }
}

int mf_simd(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 3;
#elif defined(__AVXVNNI__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

int mf_iq_tables(void) {
#if MF_IQ_TABLES
    return 1;
#else
    return 0;
#endif
}
