/* The moefit kernel library's interface: every exported function and structure.
 *
 * The library is qmatmul.c (quantized products, dequantization), decode_step.c (the lean decode
 * step's operations) and abi.c (what the loader checks), built into one shared object: at
 * install into the wheel, one per x86-64 variant (setup.py), or at first use with
 * -march=native (moefit.runtime.kernels.native). The Python side mirrors it in
 * moefit.runtime.kernels.native (PROTOTYPES, the prototypes below) and
 * moefit.runtime.kernels.lean_abi (the structures, same field order and types); at load the
 * loader compares MF_ABI_VERSION and every structure's sizeof / offsetof (mf_abi_fields) with
 * that mirror and refuses a library that differs.
 *
 * Codes: ggml types as qmatmul.c's T_* (moefit.memory.cpu_kernels.CTYPES); float dtypes 0 fp32,
 * 1 fp16, 2 bf16; KV codecs 0 / 1 / 2 plain, 8 q8 (block_q8_0), 9 q4 (block_q4_0).
 */
#ifndef MOEFIT_KERNELS_H
#define MOEFIT_KERNELS_H

#include <stdint.h>

/* raised whenever a prototype or a structure below changes (and with it the Python mirror's
 * ABI_VERSION) */
#define MF_ABI_VERSION 2

/* ---- structures (the lean decode step, decode_step.c) ----------------------------------- */
typedef struct { const uint8_t *p; int32_t type, rows, cols, pad; } mf_mat;

typedef struct {
    const void *in_norm, *post_norm;
    mf_mat q, k, v, o, router;
    const void *qb, *kb, *vb, *ob, *qn, *kn;           /* biases, q / k norm weights (NULL: none) */
    uint8_t *kc, *vc;                                  /* the layer's K / V cache */
    int32_t heads, kvh, d, dv, cells, window, kcode, vcode, knb, vnb;
    float scale;
    int32_t e, topk, inter, gt, ut, dt;                /* experts, top-k, width, ggml types */
    int64_t up_off, down_off, pchunk;
    const int64_t *table;                              /* blob address per expert */
    const uint8_t *mask;                               /* resident per expert */
    int64_t hits, misses;                              /* added to (the caller takes them) */
    const int64_t *cells_of;                           /* shared KV pool: [slots, ctx] cell per
                                                          position (NULL: slot x cells + p % cells) */
    int64_t ctx;
} mf_lean_layer;

typedef struct {
    int32_t t, h, ad, threads, qk_norm, renorm, rot, pdt;   /* qk_norm 0 none, 1 per head, 2 full */
    float eps, off, clip;                              /* clip: clip_qkv (0: none) */
    void *hidden, *normed, *delta;
    float *acc;
    uint8_t *gscratch;
    void *q, *k, *v, *o;
    const int64_t *pos, *slot;
    const float *cs, *sn;
    void *rlog;
    int64_t *bptr, *bounds, *tok;
    float *wsel;
    int64_t *stats;
    uint8_t *mscratch;
    const void *pending;                               /* in / out: the sublayer output not yet added */
} mf_lean_step;

/* one entry of mf_abi_fields: a field's byte offset and size in its structure; field "" is
 * the structure itself (offset 0, size its sizeof) */
typedef struct { const char *type, *field; int64_t offset, size; } mf_abi_field;

/* ---- abi.c: what the loader checks ------------------------------------------------------- */
int mf_abi_version(void);
const mf_abi_field *mf_abi_fields(int *n);
/* the hash of the sources the library was built from (the loader's key: a library built from
 * other sources than those beside it is not used while a compiler can rebuild it) */
const char *mf_sources(void);

/* ---- qmatmul.c: products, dequantization ------------------------------------------------ */
int64_t mf_row_bytes(int t, int K);
int64_t mf_qact_bytes(int K);
void mf_quantize_act(const float *x, int K, uint8_t *out);
void mf_gemm_ex(int t, const uint8_t *W, int N, int K, const void *x, int xdt, int n, void *y, int ydt,
                const void *bias, uint8_t *scratch, int nthreads);
void mf_gemm(int t, const uint8_t *W, int N, int K, const void *x, int xbf16, int n, float *y,
             uint8_t *scratch, int nthreads);
void mf_moe(int n_exp, const uint8_t *const *blobs, const int64_t *bounds, const int64_t *tok,
            const float *wt, const void *x, int xdt, float *acc, int T, int H, int I, int tg, int tu, int td,
            int64_t off_u, int64_t off_d, uint8_t *scratch, int pchunk, int nthreads);
void mf_dequant(int t, const uint8_t *W, int64_t nrows, int K, uint16_t *out16, float *out32, int nthreads);
/* the vector path compiled in: 0 scalar, 1 avx2, 2 avx-vnni, 3 avx512-vnni */
int mf_simd(void);
/* 1 when built with the IQ grid types' tables (MF_IQ_TABLES: the gguf package was there) */
int mf_iq_tables(void);

/* ---- decode_step.c: the lean decode step ------------------------------------------------ */
void mf_rmsnorm(int rows, int dim, void *h, const void *delta, int ddt, const void *w, int dt,
                float eps, float offset, void *out);
void mf_rope_table(int T, int half, const float *inv_freq, float scaling, const int64_t *pos, int dt,
                   float *cs, float *sn);
void mf_rope_kv(int T, void *q, int A, void *k, int Kh, const void *v, int D, int Dv, int rot,
                const float *cs, const float *sn, const int64_t *pos, const int64_t *slot, int dt,
                uint8_t *kc, uint8_t *vc, int cells, int kcodec, int vcodec, int krow, int vrow,
                const int64_t *cells_of, int64_t ctx);
void mf_attn_decode(int T, const void *q, int A, int Kh, int D, int Dv, float scale,
                    const uint8_t *kc, const uint8_t *vc, int kcodec, int vcodec, int krow, int vrow,
                    const int64_t *pos, const int64_t *slot, int cells, int window, int dt, void *out,
                    int nthreads, const int64_t *cells_of, int64_t ctx);
void mf_route(int T, int E, int k, const void *logits, int dt, int renorm, const int64_t *table,
              const uint8_t *resident, int64_t *ptrs, int64_t *bounds, int64_t *tok, float *w,
              int64_t *stats);
void mf_lean_layers(int n, mf_lean_layer *layers, mf_lean_step *s);

#endif
