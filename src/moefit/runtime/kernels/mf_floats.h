/* fp16 / bf16 <-> fp32 conversions and the fp32 dot product shared by the C kernels
 * (qmatmul.c, decode_step.c).
 *
 * Rounding is to nearest even, as torch's casts (c10/util/Half.h, c10/util/BFloat16.h
 * round_to_nearest_even); a bf16 NaN stays a NaN. With F16C the fp16 conversions are the
 * hardware's (vcvtph2ps / vcvtps2ph, the same results).
 */
#ifndef MF_FLOATS_H
#define MF_FLOATS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float mf_h2f(uint16_t h) {          /* fp16 -> fp32 (exact) */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) u = s;
        else { float f = ldexpf((float)m, -24); memcpy(&u, &f, 4); u |= s; }
    } else if (e == 31) u = s | 0x7f800000 | (m << 13);
    else u = s | ((e + 112) << 23) | (m << 13);
    float f; memcpy(&f, &u, 4); return f;
#endif
}

static inline uint16_t mf_f2h(float f) {          /* fp32 -> fp16, nearest even */
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t s = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a > 0x7f800000) return (uint16_t)(s | 0x7e00);
    if (a >= 0x477ff000) return (uint16_t)(s | 0x7c00);
    if (a < 0x38800000) {            /* subnormal half */
        float v; memcpy(&v, &a, 4);
        return (uint16_t)(s | (uint32_t)lrintf(v * 16777216.f));
    }
    uint32_t r = a + 0x0fff + ((a >> 13) & 1) - 0x38000000;
    return (uint16_t)(s | (r >> 13));
#endif
}

static inline float mf_b2f(uint16_t h) {          /* bf16 -> fp32 (exact) */
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}

static inline uint16_t mf_f2b(float f) {          /* fp32 -> bf16, nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* sum of a[i] * b[i] over n fp32 values: 16 lanes of fused multiply-adds, their sum, then
 * the tail one by one */
static inline float mf_dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    float d = 0.f;
#ifdef __AVX512F__
    __m512 s = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s);
    d = _mm512_reduce_add_ps(s);
#endif
    for (; i < n; i++) d += a[i] * b[i];
    return d;
}

#endif
