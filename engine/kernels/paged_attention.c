/* One layer of a decode step straight over the paged KV pool: write each sequence's new
 * key and value at its slot, then attend its one query token over its blocks, read in
 * place through the block table (no gather, no padding), with fp32 accumulation and
 * softmax for fp32 and bf16 caches.
 *
 * Layouts: q, out [B, H, D]; k_new, v_new [KVH, B, D]; slots [B] (block * BS + offset);
 * k, v [KVH, NB, BS, D]; tables [B, MAXNB]; ctx [B].
 * Query head h uses kv head h / (H / KVH), as transformers' repeat_kv does. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(uint16_t h) {
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* NaN stays NaN */
    x += 0x7fffu + ((x >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(x >> 16);
}

static inline float f32_load(float f) { return f; }
static inline float f32_store(float f) { return f; }

#define PAGED_DECODE(NAME, T, LOAD, STORE, DIM)                                                         \
    static void NAME(const T* q, const T* k_new, const T* v_new, const int64_t* slots, T* k, T* v,      \
              const int64_t* tables, const int64_t* ctx, T* out, int B, int H, int KVH, int D,          \
              int NB, int BS, int MAXNB, float scale, int nthreads) {                                   \
        const int G = H / KVH;                                                                          \
        const int DD = (DIM) > 0 ? (DIM) : D;                                                           \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads)")              \
        for (int b = 0; b < B; b++) {                                                                   \
            for (int kh = 0; kh < KVH; kh++) {                                                          \
                const int L = (int)ctx[b];                                                              \
                const int64_t dst = ((int64_t)kh * NB * BS + slots[b]) * DD;                            \
                memcpy(k + dst, k_new + ((int64_t)kh * B + b) * DD, sizeof(T) * (size_t)DD);            \
                memcpy(v + dst, v_new + ((int64_t)kh * B + b) * DD, sizeof(T) * (size_t)DD);            \
                float* qf = (float*)malloc(sizeof(float) * (size_t)(2 * G * DD + G * L + DD));          \
                float* acc = qf + G * DD;                                                               \
                float* row = acc + G * DD;                                                              \
                float* sc = row + DD;                                                                   \
                for (int g = 0; g < G; g++)                                                             \
                    for (int d = 0; d < DD; d++)                                                        \
                        qf[g * DD + d] = LOAD(q[((int64_t)b * H + kh * G + g) * DD + d]) * scale;       \
                float mx[64];                                                                           \
                for (int g = 0; g < G; g++) mx[g] = -INFINITY;                                          \
                for (int t0 = 0, bi = 0; t0 < L; t0 += BS, bi++) {                                      \
                    const int64_t blk = tables[(int64_t)b * MAXNB + bi];                                \
                    const T* kb = k + ((int64_t)kh * NB + blk) * BS * DD;                               \
                    const int n = L - t0 < BS ? L - t0 : BS;                                            \
                    for (int o = 0; o < n; o++) {                                                       \
                        const T* kr = kb + (int64_t)o * DD;                                             \
                        for (int d = 0; d < DD; d++) row[d] = LOAD(kr[d]);                              \
                        for (int g = 0; g < G; g++) {                                                   \
                            float s = 0.f;                                                              \
                            const float* qg = qf + g * DD;                                              \
                            for (int d = 0; d < DD; d++) s += qg[d] * row[d];                           \
                            sc[g * L + t0 + o] = s;                                                     \
                            if (s > mx[g]) mx[g] = s;                                                   \
                        }                                                                               \
                    }                                                                                   \
                }                                                                                       \
                float sum[64];                                                                          \
                for (int g = 0; g < G; g++) {                                                           \
                    float z = 0.f;                                                                      \
                    for (int t = 0; t < L; t++) {                                                       \
                        float e = expf(sc[g * L + t] - mx[g]);                                          \
                        sc[g * L + t] = e;                                                              \
                        z += e;                                                                         \
                    }                                                                                   \
                    sum[g] = z;                                                                         \
                }                                                                                       \
                memset(acc, 0, sizeof(float) * (size_t)(G * DD));                                       \
                for (int t0 = 0, bi = 0; t0 < L; t0 += BS, bi++) {                                      \
                    const int64_t blk = tables[(int64_t)b * MAXNB + bi];                                \
                    const T* vb = v + ((int64_t)kh * NB + blk) * BS * DD;                               \
                    const int n = L - t0 < BS ? L - t0 : BS;                                            \
                    for (int o = 0; o < n; o++) {                                                       \
                        const T* vr = vb + (int64_t)o * DD;                                             \
                        for (int d = 0; d < DD; d++) row[d] = LOAD(vr[d]);                              \
                        for (int g = 0; g < G; g++) {                                                   \
                            const float p = sc[g * L + t0 + o];                                         \
                            float* ag = acc + g * DD;                                                   \
                            for (int d = 0; d < DD; d++) ag[d] += p * row[d];                           \
                        }                                                                               \
                    }                                                                                   \
                }                                                                                       \
                for (int g = 0; g < G; g++)                                                             \
                    for (int d = 0; d < DD; d++)                                                        \
                        out[((int64_t)b * H + kh * G + g) * DD + d] = STORE(acc[g * DD + d] / sum[g]);  \
                free(qf);                                                                               \
            }                                                                                           \
        }                                                                                               \
    }

PAGED_DECODE(decode_f32_d64, float, f32_load, f32_store, 64)
PAGED_DECODE(decode_f32_d128, float, f32_load, f32_store, 128)
PAGED_DECODE(decode_f32_any, float, f32_load, f32_store, 0)
PAGED_DECODE(decode_bf16_d64, uint16_t, bf16_load, bf16_store, 64)
PAGED_DECODE(decode_bf16_d128, uint16_t, bf16_load, bf16_store, 128)
PAGED_DECODE(decode_bf16_any, uint16_t, bf16_load, bf16_store, 0)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16 with AVX-512: scores 16 tokens at a time with bf16 dot products (fp32 accumulation, no
 * horizontal sum per token: one transposing reduction per 16), a vector exp, and P·V in fp32
 * with the accumulators in registers. D = 16 * NF. */
#include <immintrin.h>
#define HAVE_AVX512_BF16 1

/* Lane j of reduce16's result sums input slot PERM16[j]; PERM16 is its own inverse, so token j's
 * partial sums go into slot PERM16[j] and come out in lane j. */
static const int PERM16[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

static inline __m512 reduce16(const __m512* a) {
    __m512 r8[8], r4[4], r2[2];
    for (int i = 0; i < 8; i++)
        r8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        r4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r8[i], r8[i + 4], 0x88),
                              _mm512_shuffle_f32x4(r8[i], r8[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        r2[i] = _mm512_add_ps(_mm512_shuffle_ps(r4[i], r4[i + 2], 0x44), _mm512_shuffle_ps(r4[i], r4[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(r2[0], r2[1], 0x88), _mm512_shuffle_ps(r2[0], r2[1], 0xDD));
}

/* exp(x) for x <= 0: 2^(x log2 e) as 2^n * 2^f, |f| <= 1/2, degree-6 Taylor (rel. error < 2e-7). */
static inline __m512 exp512(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530393381608e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 bf16x16_to_f32(const uint16_t* src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)src)), 16));
}

#define PAGED_DECODE_AVX512(NAME, NF)                                                                   \
    static void NAME(const uint16_t* q, const uint16_t* k_new, const uint16_t* v_new,                  \
                     const int64_t* slots, uint16_t* k, uint16_t* v, const int64_t* tables,             \
                     const int64_t* ctx, uint16_t* out, int B, int H, int KVH, int NB, int BS,          \
                     int MAXNB, float scale, int nthreads) {                                            \
        enum { D = 16 * (NF), NQ = (NF) / 2 };                                                          \
        const int G = H / KVH;                                                                          \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads)")              \
        for (int b = 0; b < B; b++) {                                                                   \
            for (int kh = 0; kh < KVH; kh++) {                                                          \
                const int L = (int)ctx[b], LP = (L + 15) & ~15;                                         \
                const int64_t dst = ((int64_t)kh * NB * BS + slots[b]) * D;                             \
                memcpy(k + dst, k_new + ((int64_t)kh * B + b) * D, sizeof(uint16_t) * D);               \
                memcpy(v + dst, v_new + ((int64_t)kh * B + b) * D, sizeof(uint16_t) * D);               \
                const int64_t* tb = tables + (int64_t)b * MAXNB;                                        \
                const uint16_t* kbase = k + (int64_t)kh * NB * BS * D;                                  \
                const uint16_t* vbase = v + (int64_t)kh * NB * BS * D;                                  \
                float* sc = (float*)malloc(sizeof(float) * (size_t)(G * LP) + sizeof(int64_t) * (size_t)L); \
                int64_t* row = (int64_t*)(sc + G * LP); /* element offset of token t's row */           \
                for (int t = 0, bi = 0, o = 0; t < L; t++) {                                            \
                    row[t] = (tb[bi] * BS + o) * D;                                                     \
                    if (++o == BS) o = 0, bi++;                                                         \
                }                                                                                       \
                for (int g = 0; g < G; g++) {                                                           \
                    const uint16_t* qg = q + ((int64_t)b * H + kh * G + g) * D;                         \
                    __m512bh qv[NQ];                                                                    \
                    for (int i = 0; i < NQ; i++) qv[i] = (__m512bh)_mm512_loadu_si512(qg + 32 * i);     \
                    __m512 vmax = _mm512_set1_ps(-INFINITY);                                            \
                    for (int t0 = 0; t0 < L; t0 += 16) {                                                \
                        const int m = L - t0 < 16 ? L - t0 : 16;                                        \
                        if (g == 0) { /* blocks are scattered: fetch the next K rows and these V rows */ \
                            const int m2 = L - t0 - 16 < 16 ? L - t0 - 16 : 16;                         \
                            for (int j = 0; j < m2; j++)                                                \
                                for (int c = 0; c < D; c += 32)                                         \
                                    _mm_prefetch((const char*)(kbase + row[t0 + 16 + j] + c), _MM_HINT_T0); \
                            for (int j = 0; j < m; j++)                                                 \
                                for (int c = 0; c < D; c += 32)                                         \
                                    _mm_prefetch((const char*)(vbase + row[t0 + j] + c), _MM_HINT_T1);  \
                        }                                                                               \
                        __m512 acc[16];                                                                 \
                        for (int j = 0; j < 16; j++) {                                                  \
                            __m512 a = _mm512_setzero_ps();                                             \
                            if (j < m) {                                                                \
                                const uint16_t* kr = kbase + row[t0 + j];                               \
                                for (int i = 0; i < NQ; i++)                                            \
                                    a = _mm512_dpbf16_ps(a, qv[i], (__m512bh)_mm512_loadu_si512(kr + 32 * i)); \
                            }                                                                           \
                            acc[PERM16[j]] = a;                                                         \
                        }                                                                               \
                        const __mmask16 mask = (__mmask16)((1u << m) - 1u);                             \
                        const __m512 s = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));           \
                        _mm512_storeu_ps(sc + g * LP + t0, s);                                          \
                        vmax = _mm512_mask_max_ps(vmax, mask, vmax, s);                                 \
                    }                                                                                   \
                    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));                       \
                    __m512 z = _mm512_setzero_ps();                                                     \
                    for (int t0 = 0; t0 < L; t0 += 16) {                                                \
                        const int m = L - t0 < 16 ? L - t0 : 16;                                        \
                        const __mmask16 mask = (__mmask16)((1u << m) - 1u);                             \
                        const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(               \
                            _mm512_loadu_ps(sc + g * LP + t0), mx)));                                   \
                        _mm512_storeu_ps(sc + g * LP + t0, e);                                          \
                        z = _mm512_add_ps(z, e);                                                        \
                    }                                                                                   \
                    const float inv = 1.f / _mm512_reduce_add_ps(z);                                    \
                    __m512 o[NF];                                                                       \
                    for (int i = 0; i < NF; i++) o[i] = _mm512_setzero_ps();                            \
                    for (int t = 0; t < L; t++) {                                                       \
                        const __m512 p = _mm512_set1_ps(sc[g * LP + t]);                                \
                        const uint16_t* vr = vbase + row[t];                                            \
                        for (int i = 0; i < NF; i++) o[i] = _mm512_fmadd_ps(p, bf16x16_to_f32(vr + 16 * i), o[i]); \
                    }                                                                                   \
                    uint16_t* og = out + ((int64_t)b * H + kh * G + g) * D;                             \
                    for (int i = 0; i < NF; i++) {                                                      \
                        float tmp[16];                                                                  \
                        _mm512_storeu_ps(tmp, _mm512_mul_ps(o[i], _mm512_set1_ps(inv)));                \
                        for (int d = 0; d < 16; d++) og[16 * i + d] = bf16_store(tmp[d]);               \
                    }                                                                                   \
                }                                                                                       \
                free(sc);                                                                               \
            }                                                                                           \
        }                                                                                               \
    }

PAGED_DECODE_AVX512(decode_bf16_avx512_d64, 4)
PAGED_DECODE_AVX512(decode_bf16_avx512_d128, 8)
#endif

/* Entry points: pick the variant unrolled for this head dim. */
#define DISPATCH(NAME, T, PREFIX)                                                                       \
    void NAME(const T* q, const T* k_new, const T* v_new, const int64_t* slots, T* k, T* v,             \
              const int64_t* tables, const int64_t* ctx, T* out, int B, int H, int KVH, int D,          \
              int NB, int BS, int MAXNB, float scale, int nthreads) {                                   \
        if (D == 64)                                                                                    \
            PREFIX##_d64(q, k_new, v_new, slots, k, v, tables, ctx, out, B, H, KVH, D, NB, BS, MAXNB,   \
                         scale, nthreads);                                                              \
        else if (D == 128)                                                                              \
            PREFIX##_d128(q, k_new, v_new, slots, k, v, tables, ctx, out, B, H, KVH, D, NB, BS,         \
                          MAXNB, scale, nthreads);                                                      \
        else                                                                                            \
            PREFIX##_any(q, k_new, v_new, slots, k, v, tables, ctx, out, B, H, KVH, D, NB, BS, MAXNB,   \
                         scale, nthreads);                                                              \
    }

DISPATCH(paged_decode_f32, float, decode_f32)
DISPATCH(decode_bf16_portable, uint16_t, decode_bf16)

void paged_decode_bf16(const uint16_t* q, const uint16_t* k_new, const uint16_t* v_new, const int64_t* slots,
                       uint16_t* k, uint16_t* v, const int64_t* tables, const int64_t* ctx, uint16_t* out, int B,
                       int H, int KVH, int D, int NB, int BS, int MAXNB, float scale, int nthreads) {
#ifdef HAVE_AVX512_BF16
    if (D == 64) {
        decode_bf16_avx512_d64(q, k_new, v_new, slots, k, v, tables, ctx, out, B, H, KVH, NB, BS, MAXNB, scale,
                               nthreads);
        return;
    }
    if (D == 128) {
        decode_bf16_avx512_d128(q, k_new, v_new, slots, k, v, tables, ctx, out, B, H, KVH, NB, BS, MAXNB, scale,
                                nthreads);
        return;
    }
#endif
    decode_bf16_portable(q, k_new, v_new, slots, k, v, tables, ctx, out, B, H, KVH, D, NB, BS, MAXNB, scale,
                         nthreads);
}
