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
DISPATCH(paged_decode_bf16, uint16_t, decode_bf16)
