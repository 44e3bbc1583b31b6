/* pdserve's CPU kernels: paged decode attention (below), small-batch linear layers
 * (`pdserve_linear_f32` and `pdserve_linear_bf16`, at the end), the attention of prompts and prompt
 * chunks over their cached context in place in the pool (`pdserve_prefill_attn_f32` with AVX2 + FMA,
 * `pdserve_prefill_attn_bf16` with AVX-512 BF16, on AMX tiles in the AMX build) and linear layers on a
 * blocked copy of the weight (`pdserve_linear_f32_blocked` with AVX2 + FMA, `pdserve_linear_bf16_blocked`
 * with AVX-512 BF16), greedy picks (`pdserve_argmax_*`), and the pointwise parts of an eager step's decoder layers
 * (`pdserve_rms_norm_*`, `pdserve_silu_mul_*`, with AVX2 or AVX-512).
 *
 * One layer of a decode step straight over the paged KV pool: write each sequence's new
 * key and value at its slot, then attend its one query token over its blocks, read in
 * place through the block table (no gather, no padding), with fp32 accumulation and
 * softmax for fp32 and bf16 caches.
 *
 * Layouts: q, out [B, H, D]; k_new, v_new [KVH, B, D]; slots [B] (block * BS + offset);
 * k, v [KVH, NB, BS, D]; tables [B, MAXNB]; ctx [B].
 * Query head h uses kv head h / (H / KVH), as transformers' repeat_kv does. */
#include <math.h>
#include <omp.h>
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

/* 2^f for |f| <= 1/2, Horner coefficients of the degree-6 Taylor polynomial, highest first (the
 * vector exps below share it). */
static const float EXP2_POLY[7] = {1.5403530393381608e-4f, 1.3333558146428443e-3f, 9.618129107628477e-3f,
                                   5.550410866482158e-2f,  2.402265069591007e-1f,  6.931471805599453e-1f, 1.f};

/* The prefill attention kernels' online softmax: a row's running maximum moves only when a score passes it by
 * this, so P <= e^8 (far inside fp32 and bf16) and most key tiles skip the reduction and the rescaling. */
#define PX_SLACK 8.0f

/* The decode kernels' tasks (sequence b, kv head kh; task b * KVH + kh) split into `nt` contiguous ranges
 * of about equal work (a task's work: its context plus a fixed part), [*lo, *hi) for thread `id`. Being
 * contiguous, a thread knows its next task and prefetches that task's keys while it finishes the current
 * one; dynamic scheduling hands tasks out in an order no thread knows ahead. */
static void task_range(const int64_t* ctx, int B, int KVH, int nt, int id, int* lo, int* hi) {
    int64_t total = 0, acc = 0;
    for (int b = 0; b < B; b++) total += (ctx[b] + 16) * KVH;
    *lo = *hi = 0;
    for (int i = 0, first = 1; i < B * KVH; i++) {
        const int64_t w = ctx[i / KVH] + 16;
        const int owner = (int)((2 * acc + w) * nt / (2 * total)); /* by the task's midpoint: non-decreasing */
        if (owner == id) {
            if (first) *lo = i, first = 0;
            *hi = i + 1;
        }
        acc += w;
    }
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
/* Every build with AVX-512 (F, BW, VL, DQ): the helpers below, and decode attention over fp32 or bf16
 * caches 16 tokens at a time (bf16 widened to fp32 by a shift: no bf16 instructions needed). */
#include <immintrin.h>
#define HAVE_AVX512 1

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

/* exp(x) for -87 <= x <= 88.3 (x clamped up to -87; past 88.3, n passes 127, where exp256 builds no 2^n): 2^(x
 * log2 e) as 2^n * 2^f, |f| <= 1/2, degree-6 Taylor (rel. error < 2e-7 for |x| of a few units; x log2 e rounds in
 * fp32, so ~3e-6 near |x| = 88). Softmax calls it for x <= 0, SiLU for -e^-a up to 88.3 (PW_EXP_MAX). */
static inline __m512 exp512(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 bf16x16_to_f32(const uint16_t* src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)src)), 16));
}

/* Lanes that interleave an even-dims and an odd-dims vector back into dims order: the low 16, the high 16. */
#define INTERLEAVE_LO _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0)
#define INTERLEAVE_HI _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8)

/* 16 floats rounded to bf16 (nearest even, NaN kept a quiet NaN) with integer ops: bf16_store in vector. */
static inline void st16_bf16(uint16_t* dst, __m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i h = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i*)dst, _mm512_cvtepi32_epi16(h));
}

/* How PAGED_DECODE_AVX512 reads a cache: a way WAY names
 *   WAY##_T         the cache's element type,
 *   WAY##_qv        a vector of a query or key row as the dot product takes it, WAY##_PER elements of the row,
 *   WAY##_ld(p)     one such vector loaded, WAY##_zero() a zero one,
 *   WAY##_dot(a, q, k)  a + q . k, lane by lane in fp32 (a lane sums WAY##_PER / 16 products),
 *   WAY##_ldv(vv, p, nf)     a V row widened to nf fp32 vectors, in the order WAY##_sto stores them,
 *   WAY##_sto(p, o, s, nf)   nf fp32 vectors times s stored as one output row.
 * f32w (fp32 cache) and bf16w (bf16 widened to fp32 by a shift) take AVX-512 F; bf16dp (bf16 pairs in
 * dot products) takes AVX-512 BF16 and is defined with its build below. */
#define AVX512_INLINE static inline __attribute__((always_inline))

#define f32w_PER 16
typedef float f32w_T;
typedef __m512 f32w_qv;
AVX512_INLINE __m512 f32w_ld(const float* p) { return _mm512_loadu_ps(p); }
AVX512_INLINE __m512 f32w_zero(void) { return _mm512_setzero_ps(); }
AVX512_INLINE __m512 f32w_dot(__m512 a, __m512 q, __m512 k) { return _mm512_fmadd_ps(q, k, a); }
AVX512_INLINE void f32w_ldv(__m512* vv, const float* p, int nf) {
    for (int i = 0; i < nf; i++) vv[i] = _mm512_loadu_ps(p + 16 * i);
}
AVX512_INLINE void f32w_sto(float* p, const __m512* o, __m512 s, int nf) {
    for (int i = 0; i < nf; i++) _mm512_storeu_ps(p + 16 * i, _mm512_mul_ps(o[i], s));
}

#define bf16w_PER 16
typedef uint16_t bf16w_T;
typedef __m512 bf16w_qv;
AVX512_INLINE __m512 bf16w_ld(const uint16_t* p) { return bf16x16_to_f32(p); }
#define bf16w_zero f32w_zero /* fp32 vectors, as f32w's */
#define bf16w_dot f32w_dot
AVX512_INLINE void bf16w_ldv(__m512* vv, const uint16_t* p, int nf) {
    for (int i = 0; i < nf; i++) vv[i] = bf16x16_to_f32(p + 16 * i);
}
AVX512_INLINE void bf16w_sto(uint16_t* p, const __m512* o, __m512 s, int nf) {
    for (int i = 0; i < nf; i++) st16_bf16(p + 16 * i, _mm512_mul_ps(o[i], s));
}

/* Decode attention on AVX-512, any way of reading the cache (WAY, above). D = 16 * NF.
 * Query heads are taken GB at a time (grouped queries: 4 at D = 64, or 3 where the group is a multiple
 * of 3 but not of 4; 2 at D = 128; one without grouping): each K and V row is read once for all of them.
 * Scores: TPR = 16 / GB tokens x GB heads fill the slots of one transposing reduction (lane h * TPR + t:
 * head h, token t), a vector exp, and P.V with GB x NF fp32 accumulators in registers. Each thread runs a
 * contiguous range of tasks (`task_range`) and, while it sums the last head group's values, prefetches its
 * next task's keys. */
#define PAGED_DECODE_AVX512(NAME, WAY, NF, HEADS)                                                       \
    static void NAME(const WAY##_T* q, const WAY##_T* k_new, const WAY##_T* v_new, const int64_t* slots, \
                     WAY##_T* k, WAY##_T* v, const int64_t* tables, const int64_t* ctx, WAY##_T* out,   \
                     int B, int H, int KVH, int NB, int BS, int MAXNB, float scale, int nthreads) {     \
        typedef WAY##_T T;                                                                              \
        enum { D = 16 * (NF), NQ = D / WAY##_PER, GB = (HEADS), TPR = 16 / GB, LINE = 64 / (int)sizeof(T) }; \
        const int G = H / KVH;                                                                          \
        _Pragma("omp parallel num_threads(nthreads)")                                                   \
        {                                                                                               \
            int lo, hi;                                                                                 \
            task_range(ctx, B, KVH, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);             \
            for (int task = lo; task < hi; task++) {                                                    \
                const int b = task / KVH, kh = task % KVH;                                              \
                const int L = (int)ctx[b], LP = (L + TPR + 15) & ~15;                                   \
                const int64_t dst = ((int64_t)kh * NB * BS + slots[b]) * D;                             \
                memcpy(k + dst, k_new + ((int64_t)kh * B + b) * D, sizeof(T) * D);                      \
                memcpy(v + dst, v_new + ((int64_t)kh * B + b) * D, sizeof(T) * D);                      \
                const int64_t* tb = tables + (int64_t)b * MAXNB;                                        \
                const T* kbase = k + (int64_t)kh * NB * BS * D;                                         \
                const T* vbase = v + (int64_t)kh * NB * BS * D;                                         \
                /* the next task's keys, prefetched while this one finishes (none past the range) */   \
                const int nb = (task + 1) / KVH, nL = task + 1 < hi ? (int)ctx[nb] : 0;                 \
                const int64_t* ntb = tables + (int64_t)nb * MAXNB;                                      \
                const T* nk = k + (int64_t)((task + 1) % KVH) * NB * BS * D;                            \
                float* sc = (float*)malloc(sizeof(float) * (size_t)(GB * LP) + sizeof(int64_t) * (size_t)L); \
                int64_t* row = (int64_t*)(sc + GB * LP); /* element offset of token t's row */          \
                for (int t = 0, bi = 0, o = 0; t < L; t++) {                                            \
                    row[t] = (tb[bi] * BS + o) * D;                                                     \
                    if (++o == BS) o = 0, bi++;                                                         \
                }                                                                                       \
                for (int g0 = 0; g0 < G; g0 += GB) {                                                    \
                    const int hb = G - g0 < GB ? G - g0 : GB; /* heads in this block */                 \
                    WAY##_qv qv[GB][NQ];                                                                \
                    for (int h = 0; h < GB; h++)                                                        \
                        for (int i = 0; i < NQ; i++)                                                    \
                            qv[h][i] = h < hb ? WAY##_ld(q + ((int64_t)b * H + kh * G + g0 + h) * D + WAY##_PER * i) \
                                              : WAY##_zero();                                           \
                    __mmask16 heads = 0; /* lanes of the block's real heads */                           \
                    for (int h = 0; h < hb; h++) heads |= (__mmask16)(((1u << TPR) - 1u) << (h * TPR)); \
                    __m512 vmax = _mm512_set1_ps(-INFINITY);                                            \
                    for (int t0 = 0; t0 < L; t0 += TPR) {                                               \
                        const int m = L - t0 < TPR ? L - t0 : TPR;                                      \
                        const int c16 = (t0 + 15) & ~15; /* a 16-token chunk starts in this slice */     \
                        if (g0 == 0 && c16 < t0 + TPR && c16 < L) { /* the next chunk's K rows, this V */ \
                            const int m2 = L - c16 - 16 < 16 ? L - c16 - 16 : 16;                       \
                            for (int j = 0; j < m2; j++)                                                \
                                for (int c = 0; c < D; c += LINE)                                       \
                                    _mm_prefetch((const char*)(kbase + row[c16 + 16 + j] + c), _MM_HINT_T0); \
                            const int m1 = L - c16 < 16 ? L - c16 : 16;                                 \
                            for (int j = 0; j < m1; j++)                                                \
                                for (int c = 0; c < D; c += LINE)                                       \
                                    _mm_prefetch((const char*)(vbase + row[c16 + j] + c), _MM_HINT_T1); \
                        }                                                                               \
                        __m512 acc[16];                                                                 \
                        for (int j = GB * TPR; j < 16; j++) acc[PERM16[j]] = _mm512_setzero_ps();       \
                        for (int t = 0; t < TPR; t++) {                                                 \
                            WAY##_qv kr[NQ];                                                            \
                            for (int i = 0; i < NQ; i++)                                                \
                                kr[i] = t < m ? WAY##_ld(kbase + row[t0 + t] + WAY##_PER * i) : WAY##_zero(); \
                            for (int h = 0; h < GB; h++) {                                              \
                                __m512 a = _mm512_setzero_ps();                                         \
                                for (int i = 0; i < NQ; i++) a = WAY##_dot(a, qv[h][i], kr[i]);         \
                                acc[PERM16[h * TPR + t]] = a;                                           \
                            }                                                                           \
                        }                                                                               \
                        const __m512 s = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));           \
                        float lanes[16];                                                                \
                        _mm512_storeu_ps(lanes, s);                                                     \
                        for (int h = 0; h < hb; h++) memcpy(sc + h * LP + t0, lanes + h * TPR, sizeof(float) * TPR); \
                        __mmask16 valid = 0;                                                            \
                        for (int h = 0; h < GB; h++) valid |= (__mmask16)(((1u << m) - 1u) << (h * TPR)); \
                        vmax = _mm512_mask_max_ps(vmax, valid & heads, vmax, s);                        \
                    }                                                                                   \
                    float maxes[16], inv[GB];                                                           \
                    _mm512_storeu_ps(maxes, vmax);                                                      \
                    for (int h = 0; h < hb; h++) {                                                      \
                        float mh = -INFINITY;                                                           \
                        for (int t = 0; t < TPR; t++) mh = maxes[h * TPR + t] > mh ? maxes[h * TPR + t] : mh; \
                        const __m512 mx = _mm512_set1_ps(mh);                                           \
                        __m512 z = _mm512_setzero_ps();                                                 \
                        for (int t0 = 0; t0 < L; t0 += 16) {                                            \
                            const int m = L - t0 < 16 ? L - t0 : 16;                                    \
                            const __mmask16 mask = (__mmask16)((1u << m) - 1u);                         \
                            const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(           \
                                _mm512_loadu_ps(sc + h * LP + t0), mx)));                               \
                            _mm512_storeu_ps(sc + h * LP + t0, e);                                      \
                            z = _mm512_add_ps(z, e);                                                    \
                        }                                                                               \
                        inv[h] = 1.f / _mm512_reduce_add_ps(z);                                         \
                    }                                                                                   \
                    __m512 o[GB][NF];                                                                   \
                    for (int h = 0; h < GB; h++)                                                        \
                        for (int i = 0; i < NF; i++) o[h][i] = _mm512_setzero_ps();                     \
                    const int last = g0 + GB >= G;                                                      \
                    for (int t = 0; t < L; t++) {                                                       \
                        if (last && t < nL) {                                                           \
                            const T* nr = nk + (ntb[t / BS] * BS + t % BS) * D;                         \
                            for (int c = 0; c < D; c += LINE) _mm_prefetch((const char*)(nr + c), _MM_HINT_T1); \
                        }                                                                               \
                        __m512 vv[NF];                                                                  \
                        WAY##_ldv(vv, vbase + row[t], NF);                                              \
                        for (int h = 0; h < GB; h++) {                                                  \
                            if (h >= hb) break;                                                         \
                            const __m512 p = _mm512_set1_ps(sc[h * LP + t]);                            \
                            for (int i = 0; i < NF; i++) o[h][i] = _mm512_fmadd_ps(p, vv[i], o[h][i]);  \
                        }                                                                               \
                    }                                                                                   \
                    for (int h = 0; h < hb; h++)                                                        \
                        WAY##_sto(out + ((int64_t)b * H + kh * G + g0 + h) * D, o[h], _mm512_set1_ps(inv[h]), NF); \
                }                                                                                       \
                free(sc);                                                                               \
            }                                                                                           \
        }                                                                                               \
    }

PAGED_DECODE_AVX512(decode_f32_avx512_d64, f32w, 4, 4)
PAGED_DECODE_AVX512(decode_f32_avx512_d64_g3, f32w, 4, 3)
PAGED_DECODE_AVX512(decode_f32_avx512_d128, f32w, 8, 2)
PAGED_DECODE_AVX512(decode_f32_avx512_d64_mha, f32w, 4, 1)
PAGED_DECODE_AVX512(decode_f32_avx512_d128_mha, f32w, 8, 1)
PAGED_DECODE_AVX512(decode_bf16_avx512f_d64, bf16w, 4, 4)
PAGED_DECODE_AVX512(decode_bf16_avx512f_d64_g3, bf16w, 4, 3)
PAGED_DECODE_AVX512(decode_bf16_avx512f_d128, bf16w, 8, 2)
PAGED_DECODE_AVX512(decode_bf16_avx512f_d64_mha, bf16w, 4, 1)
PAGED_DECODE_AVX512(decode_bf16_avx512f_d128_mha, bf16w, 8, 1)
#endif

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
/* bf16 with AVX-512 BF16: PAGED_DECODE_AVX512 with scores from bf16 dot products (fp32 accumulation, two
 * products a lane), so a key row is read as it is stored. V's bf16 pairs are widened in place (even dims by a
 * shift, odd ones by a mask: no cross-lane shuffle), so vector 2i holds dims 32i, 32i + 2, ... and 2i + 1 the
 * odd ones, interleaved back when stored. */
#define HAVE_AVX512_BF16 1

#define bf16dp_PER 32
typedef uint16_t bf16dp_T;
typedef __m512bh bf16dp_qv;
AVX512_INLINE __m512bh bf16dp_ld(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
AVX512_INLINE __m512bh bf16dp_zero(void) { return (__m512bh)_mm512_setzero_si512(); }
AVX512_INLINE __m512 bf16dp_dot(__m512 a, __m512bh q, __m512bh k) { return _mm512_dpbf16_ps(a, q, k); }
AVX512_INLINE void bf16dp_ldv(__m512* vv, const uint16_t* p, int nf) {
    for (int i = 0; i < nf / 2; i++) {
        const __m512i x = _mm512_loadu_si512(p + 32 * i);
        vv[2 * i] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        vv[2 * i + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
}
AVX512_INLINE void bf16dp_sto(uint16_t* p, const __m512* o, __m512 s, int nf) {
    for (int i = 0; i < nf / 2; i++) {
        const __m512 ev = _mm512_mul_ps(o[2 * i], s), od = _mm512_mul_ps(o[2 * i + 1], s);
        _mm256_storeu_si256((__m256i*)(p + 32 * i), (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(ev, INTERLEAVE_LO, od)));
        _mm256_storeu_si256((__m256i*)(p + 32 * i + 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(ev, INTERLEAVE_HI, od)));
    }
}

PAGED_DECODE_AVX512(decode_bf16_avx512_d64, bf16dp, 4, 4)
PAGED_DECODE_AVX512(decode_bf16_avx512_d64_g3, bf16dp, 4, 3)
PAGED_DECODE_AVX512(decode_bf16_avx512_d128, bf16dp, 8, 2)
PAGED_DECODE_AVX512(decode_bf16_avx512_d64_mha, bf16dp, 4, 1)
PAGED_DECODE_AVX512(decode_bf16_avx512_d128_mha, bf16dp, 8, 1)
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* fp32 and bf16 caches with AVX2 + FMA: 8 tokens scored at a time (their K rows loaded once for
 * every query head of the group, one transposing reduction per 8), a vector exp, and P·V with
 * fp32 accumulators in registers, 64 columns at a time. D = 8 * n. */
#include <immintrin.h>
#define HAVE_AVX2 1

static inline __m256 ld8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline void st8_f32(float* dst, __m256 x) { _mm256_storeu_ps(dst, x); }
static inline void st8_bf16(uint16_t* dst, __m256 x) {
    float tmp[8];
    _mm256_storeu_ps(tmp, x);
    for (int i = 0; i < 8; i++) dst[i] = bf16_store(tmp[i]);
}

/* Lane j of the result is the sum of a[j]'s eight lanes. */
static inline __m256 reduce8(const __m256* a) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* exp(x) as exp512 (the same domain and polynomial): 2^n * 2^f, 2^n built in the exponent bits. */
static inline __m256 exp256(__m256 x) {
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(1.4426950408889634f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Lanes [0, m) set: the tokens of a chunk of 8 that exist. */
static inline __m256 lanes_below(int m) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

#define PAGED_DECODE_AVX2(NAME, T, LD8, ST8, LOAD, DIM)                                                 \
    static void NAME(const T* q, const T* k_new, const T* v_new, const int64_t* slots, T* k, T* v,      \
                     const int64_t* tables, const int64_t* ctx, T* out, int B, int H, int KVH, int D,   \
                     int NB, int BS, int MAXNB, float scale, int nthreads) {                            \
        const int G = H / KVH;                                                                          \
        const int DD = (DIM) > 0 ? (DIM) : D;                                                           \
        _Pragma("omp parallel num_threads(nthreads)")                                                   \
        {                                                                                               \
            int lo, hi;                                                                                 \
            task_range(ctx, B, KVH, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);             \
            for (int task = lo; task < hi; task++) {                                                    \
                const int b = task / KVH, kh = task % KVH;                                              \
                const int L = (int)ctx[b], LP = (L + 7) & ~7;                                           \
                const int64_t dst = ((int64_t)kh * NB * BS + slots[b]) * DD;                            \
                memcpy(k + dst, k_new + ((int64_t)kh * B + b) * DD, sizeof(T) * (size_t)DD);            \
                memcpy(v + dst, v_new + ((int64_t)kh * B + b) * DD, sizeof(T) * (size_t)DD);            \
                const int64_t* tb = tables + (int64_t)b * MAXNB;                                        \
                const T* kbase = k + (int64_t)kh * NB * BS * DD;                                        \
                const T* vbase = v + (int64_t)kh * NB * BS * DD;                                        \
                /* the next task's keys, prefetched while this one finishes (none past the range) */   \
                const int nb = (task + 1) / KVH, nL = task + 1 < hi ? (int)ctx[nb] : 0;                 \
                const int64_t* ntb = tables + (int64_t)nb * MAXNB;                                      \
                const T* nk = k + (int64_t)((task + 1) % KVH) * NB * BS * DD;                           \
                int64_t* row = (int64_t*)malloc(sizeof(int64_t) * (size_t)L                             \
                                                + sizeof(float) * (size_t)(G * DD + G * LP));           \
                float* qf = (float*)(row + L);                                                          \
                float* sc = qf + G * DD;                                                                \
                for (int t = 0, bi = 0, o = 0; t < L; t++) {                                            \
                    row[t] = (tb[bi] * BS + o) * DD;                                                    \
                    if (++o == BS) o = 0, bi++;                                                         \
                }                                                                                       \
                for (int g = 0; g < G; g++)                                                             \
                    for (int d = 0; d < DD; d++)                                                        \
                        qf[g * DD + d] = LOAD(q[((int64_t)b * H + kh * G + g) * DD + d]) * scale;       \
                for (int t0 = 0; t0 < L; t0 += 8) {                                                     \
                    const int m = L - t0 < 8 ? L - t0 : 8;                                              \
                    for (int j = 0; j < 8 && t0 + 8 + j < L; j++) /* the next chunk's scattered rows */ \
                        for (int c = 0; c < DD; c += 64 / (int)sizeof(T))                               \
                            _mm_prefetch((const char*)(kbase + row[t0 + 8 + j] + c), _MM_HINT_T0);       \
                    for (int g = 0; g < G; g++) {                                                       \
                        const float* qg = qf + g * DD;                                                  \
                        __m256 acc[8];                                                                  \
                        for (int j = 0; j < 8; j++) {                                                   \
                            __m256 a = _mm256_setzero_ps();                                             \
                            if (j < m) {                                                                \
                                const T* kr = kbase + row[t0 + j];                                      \
                                for (int i = 0; i < DD; i += 8)                                         \
                                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), LD8(kr + i), a);       \
                            }                                                                           \
                            acc[j] = a;                                                                 \
                        }                                                                               \
                        _mm256_storeu_ps(sc + g * LP + t0, reduce8(acc));                               \
                    }                                                                                   \
                }                                                                                       \
                const __m256 tail = lanes_below(L - (LP - 8));                                          \
                for (int g = 0; g < G; g++) {                                                           \
                    float* sg = sc + g * LP;                                                            \
                    __m256 vmax = _mm256_set1_ps(-INFINITY);                                            \
                    for (int t0 = 0; t0 < LP; t0 += 8) {                                                \
                        const __m256 s = _mm256_loadu_ps(sg + t0);                                      \
                        vmax = _mm256_max_ps(vmax, t0 + 8 < LP ? s                                      \
                                             : _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, tail));   \
                    }                                                                                   \
                    float mx8[8], mx = -INFINITY;                                                       \
                    _mm256_storeu_ps(mx8, vmax);                                                        \
                    for (int i = 0; i < 8; i++) mx = mx8[i] > mx ? mx8[i] : mx;                         \
                    __m256 z = _mm256_setzero_ps();                                                     \
                    for (int t0 = 0; t0 < LP; t0 += 8) {                                                \
                        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t0), _mm256_set1_ps(mx))); \
                        if (t0 + 8 >= LP) e = _mm256_and_ps(e, tail);                                   \
                        _mm256_storeu_ps(sg + t0, e);                                                   \
                        z = _mm256_add_ps(z, e);                                                        \
                    }                                                                                   \
                    float z8[8], zs = 0.f;                                                              \
                    _mm256_storeu_ps(z8, z);                                                            \
                    for (int i = 0; i < 8; i++) zs += z8[i];                                            \
                    const __m256 inv = _mm256_set1_ps(1.f / zs);                                        \
                    T* og = out + ((int64_t)b * H + kh * G + g) * DD;                                   \
                    for (int c = 0; c < DD; c += 64) {                                                  \
                        const int nv = DD - c < 64 ? (DD - c) / 8 : 8;                                  \
                        __m256 o[8];                                                                    \
                        for (int i = 0; i < 8; i++) o[i] = _mm256_setzero_ps();                         \
                        const int ahead = g == G - 1 && c == 0 ? nL : 0;                                \
                        for (int t = 0; t < L; t++) {                                                   \
                            if (t < ahead) {                                                            \
                                const T* nr = nk + (ntb[t / BS] * BS + t % BS) * DD;                    \
                                for (int x = 0; x < DD; x += 64 / (int)sizeof(T))                       \
                                    _mm_prefetch((const char*)(nr + x), _MM_HINT_T1);                   \
                            }                                                                           \
                            const __m256 p = _mm256_set1_ps(sg[t]);                                     \
                            const T* vr = vbase + row[t] + c;                                           \
                            for (int i = 0; i < nv; i++) o[i] = _mm256_fmadd_ps(p, LD8(vr + 8 * i), o[i]); \
                        }                                                                               \
                        for (int i = 0; i < nv; i++) ST8(og + c + 8 * i, _mm256_mul_ps(o[i], inv));     \
                    }                                                                                   \
                }                                                                                       \
                free(row);                                                                              \
            }                                                                                           \
        }                                                                                               \
    }

PAGED_DECODE_AVX2(decode_f32_avx2_d64, float, ld8_f32, st8_f32, f32_load, 64)
PAGED_DECODE_AVX2(decode_f32_avx2_d128, float, ld8_f32, st8_f32, f32_load, 128)
PAGED_DECODE_AVX2(decode_f32_avx2_any, float, ld8_f32, st8_f32, f32_load, 0)
PAGED_DECODE_AVX2(decode_bf16_avx2_d64, uint16_t, ld8_bf16, st8_bf16, bf16_load, 64)
PAGED_DECODE_AVX2(decode_bf16_avx2_d128, uint16_t, ld8_bf16, st8_bf16, bf16_load, 128)
PAGED_DECODE_AVX2(decode_bf16_avx2_any, uint16_t, ld8_bf16, st8_bf16, bf16_load, 0)
#endif

/* Entry points: the best vector path this build holds for the head dim, else the portable C
 * unrolled for it. */
#define ARGS q, k_new, v_new, slots, k, v, tables, ctx, out, B, H, KVH, D, NB, BS, MAXNB, scale, nthreads
#define SIGNATURE(T)                                                                                    \
    (const T* q, const T* k_new, const T* v_new, const int64_t* slots, T* k, T* v, const int64_t* tables, \
     const int64_t* ctx, T* out, int B, int H, int KVH, int D, int NB, int BS, int MAXNB, float scale,  \
     int nthreads)
#define BY_DIM(PREFIX)                                                                                  \
    do {                                                                                                \
        if (D == 64) PREFIX##_d64(ARGS);                                                                \
        else if (D == 128) PREFIX##_d128(ARGS);                                                         \
        else PREFIX##_any(ARGS);                                                                        \
    } while (0)

/* Head dims 64 and 128 on AVX-512 by the head grouping (PAGED_DECODE_AVX512's HEADS); 0 where none fits. */
#define BY_GROUPING(PREFIX)                                                                             \
    do {                                                                                                \
        const int G = H / KVH;                                                                          \
        if (D == 64 && H == KVH) PREFIX##_d64_mha(AVX512_ARGS);                                         \
        else if (D == 64 && G % 3 == 0 && G % 4 != 0) PREFIX##_d64_g3(AVX512_ARGS);                     \
        else if (D == 64) PREFIX##_d64(AVX512_ARGS);                                                    \
        else if (H == KVH) PREFIX##_d128_mha(AVX512_ARGS);                                              \
        else PREFIX##_d128(AVX512_ARGS);                                                                \
    } while (0)
#define AVX512_ARGS q, k_new, v_new, slots, k, v, tables, ctx, out, B, H, KVH, NB, BS, MAXNB, scale, nthreads

void paged_decode_f32 SIGNATURE(float) {
#ifdef HAVE_AVX512
    if (D == 64 || D == 128) {
        BY_GROUPING(decode_f32_avx512);
        return;
    }
#endif
#ifdef HAVE_AVX2
    if (D % 8 == 0) {
        BY_DIM(decode_f32_avx2);
        return;
    }
#endif
    BY_DIM(decode_f32);
}

void paged_decode_bf16 SIGNATURE(uint16_t) {
#if defined(HAVE_AVX512_BF16)
    if (D == 64 || D == 128) {
        BY_GROUPING(decode_bf16_avx512);
        return;
    }
#elif defined(HAVE_AVX512)
    if (D == 64 || D == 128) {
        BY_GROUPING(decode_bf16_avx512f);
        return;
    }
#endif
#ifdef HAVE_AVX2
    if (D % 8 == 0) {
        BY_DIM(decode_bf16_avx2);
        return;
    }
#endif
    BY_DIM(decode_bf16);
}

#ifdef HAVE_AVX2
/* Small-batch linear layers, fp32: y[M, N] = x[M, K] w[N, K]^T (+ bias[N]) for the few rows of a decode
 * step. Each step of K loads 3 rows of w once for a tile of up to 4 rows of x (12 accumulators in
 * registers) and, every cache line, prefetches the next 3 rows of w, which stream from memory once
 * while the tiles of x re-read the current ones from L1. Threads split N. (Of the shapes measured on
 * an AVX2 AMD EPYC, 3 x 4 beat 4 x 3, 2 x 6 and other prefetch spacings at 4-16 rows.) Built only where
 * AVX2 + FMA are: elsewhere the symbol is missing and callers use torch. */
#define LIN_NB 3
#define LIN_TILE(MB)                                                                                        \
    static inline void lin_tile##MB(const float* x, const float* w, const float* bias, float* y, int m0,  \
                                    int n0, int N, int K) {                                                \
        __m256 acc[MB][LIN_NB];                                                                            \
        const float* wr[LIN_NB];                                                                           \
        const float* xr[MB];                                                                               \
        for (int j = 0; j < LIN_NB; j++) wr[j] = w + (int64_t)(n0 + j) * K;                                \
        for (int i = 0; i < MB; i++) {                                                                     \
            xr[i] = x + (int64_t)(m0 + i) * K;                                                             \
            for (int j = 0; j < LIN_NB; j++) acc[i][j] = _mm256_setzero_ps();                              \
        }                                                                                                  \
        int k = 0;                                                                                         \
        for (; k + 8 <= K; k += 8) {                                                                       \
            __m256 wv[LIN_NB];                                                                             \
            for (int j = 0; j < LIN_NB; j++) wv[j] = _mm256_loadu_ps(wr[j] + k);                           \
            if ((k & 15) == 0)                                                                             \
                for (int j = 0; j < LIN_NB; j++)                                                           \
                    _mm_prefetch((const char*)(wr[j] + LIN_NB * (int64_t)K + k), _MM_HINT_T0);             \
            for (int i = 0; i < MB; i++) {                                                                 \
                const __m256 xv = _mm256_loadu_ps(xr[i] + k);                                              \
                for (int j = 0; j < LIN_NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);        \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MB; i++)                                                                       \
            for (int j = 0; j < LIN_NB; j++) {                                                             \
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1)); \
                h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                                    \
                float s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));                                \
                for (int kk = k; kk < K; kk++) s += xr[i][kk] * wr[j][kk];                                 \
                y[(int64_t)(m0 + i) * N + n0 + j] = s + (bias ? bias[n0 + j] : 0.0f);                      \
            }                                                                                              \
    }
LIN_TILE(1)
LIN_TILE(2)
LIN_TILE(3)
LIN_TILE(4)

/* More rows: torch's linear (prefill). On an AVX2 AMD EPYC this kernel ran at 0.70 / 0.90 / 1.00 /
 * 1.18x of F.linear's time at 16 / 64 / 256 / 1024 rows. */
int pdserve_linear_f32_max_rows(void) { return 256; }

void pdserve_linear_f32(const float* x, const float* w, const float* bias, float* y, int M, int N, int K,
                        int nthreads) {
    const int blocks = N / LIN_NB;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int b = 0; b < blocks; b++) {
        int m = 0;
        for (; m + 4 <= M; m += 4) lin_tile4(x, w, bias, y, m, b * LIN_NB, N, K);
        if (M - m == 3) lin_tile3(x, w, bias, y, m, b * LIN_NB, N, K);
        else if (M - m == 2) lin_tile2(x, w, bias, y, m, b * LIN_NB, N, K);
        else if (M - m == 1) lin_tile1(x, w, bias, y, m, b * LIN_NB, N, K);
    }
    for (int n = blocks * LIN_NB; n < N; n++) /* rows of w past the last block of 3 */
        for (int m = 0; m < M; m++) {
            float s = bias ? bias[n] : 0.0f;
            for (int k = 0; k < K; k++) s += x[(int64_t)m * K + k] * w[(int64_t)n * K + k];
            y[(int64_t)m * N + n] = s;
        }
}

/* Linear layers on a blocked weight, fp32 (`pdserve_linear_bf16_blocked`'s scheme with AVX2 + FMA): w
 * laid out once as wb[ceil(N/8)][K][8] (8 output columns per 32-byte row, zeros past N); x[m][k]
 * broadcast meets 8 columns at once, no horizontal sums. A tile holds BLF_MR rows of x by BLF_NR
 * blocks (12 accumulators of the 16 registers); threads split the blocks; rows go BLF_MB at a time. A panel
 * (NR blocks by all of K) is read once per tile of rows: from memory for its first tile, from cache for the
 * rest. So where a panel takes more than one tile, its tiles prefetch the next panel between them, a line
 * every 4 steps of k: a sixth of a 3-block panel per tile, all of it from 21 rows up. The weights of a decode
 * step at batch 8-64 then stream in while the current panel computes (30 layers of SmolLM2-135M's weights in
 * turn, on a 2-core AVX2 EPYC, calls alternating: 6-12% less time at 8, 16, 32 and 64 rows; none at 1-4, one
 * tile). */
#define BLF_MR 4
#define BLF_NR 3
#define BLF_MB 64
#define BLF_TILE(MR, NR)                                                                                   \
    static void blf_tile_##MR##_##NR(const float* x, const float* wb, const float* bias, float* y, int m0, \
                                     int nb0, int N, int K, const char* pf, int npf) {                     \
        __m256 acc[MR][NR];                                                                                \
        const float* wr[NR];                                                                               \
        for (int j = 0; j < NR; j++) wr[j] = wb + (int64_t)(nb0 + j) * K * 8;                              \
        for (int i = 0; i < MR; i++)                                                                       \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                                  \
        int k = 0;                                                                                         \
        for (int p = 0; p < npf && k + 4 <= K; p++) {                                                      \
            _mm_prefetch(pf + 64 * (int64_t)p, _MM_HINT_T0);                                               \
            for (int kk = 0; kk < 4; kk++, k++) BLF_STEP(MR, NR);                                          \
        }                                                                                                  \
        for (; k < K; k++) BLF_STEP(MR, NR);                                                               \
        for (int j = 0; j < NR; j++) {                                                                     \
            const int n0 = (nb0 + j) * 8, left = N - n0;                                                   \
            const __m256i mask = _mm256_castps_si256(lanes_below(left));                                   \
            const __m256 b = bias ? _mm256_maskload_ps(bias + n0, mask) : _mm256_setzero_ps();              \
            for (int i = 0; i < MR; i++)                                                                   \
                _mm256_maskstore_ps(y + (int64_t)(m0 + i) * N + n0, mask, _mm256_add_ps(acc[i][j], b));    \
        }                                                                                                  \
    }
#define BLF_STEP(MR, NR)                                                                                   \
    do {                                                                                                   \
        __m256 wv[NR];                                                                                     \
        for (int j = 0; j < NR; j++) wv[j] = _mm256_loadu_ps(wr[j] + (int64_t)k * 8);                      \
        for (int i = 0; i < MR; i++) {                                                                     \
            const __m256 xb = _mm256_set1_ps(x[(int64_t)(m0 + i) * K + k]);                                \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xb, wv[j], acc[i][j]);                \
        }                                                                                                  \
    } while (0)
#define BLF_ROWS(NR) BLF_TILE(1, NR) BLF_TILE(2, NR) BLF_TILE(3, NR) BLF_TILE(4, NR)
BLF_ROWS(1)
BLF_ROWS(2)
BLF_ROWS(3)
/* Rows m0..m1 of x by NR blocks, 4 rows at a time; tile t prefetches its share of the `next_lines` cache lines
 * at `next` (the next panel), where there is more than one tile. */
#define BLF_PANEL(NR)                                                                                      \
    static void blf_panel_##NR(const float* x, const float* wb, const float* bias, float* y, int m0, int m1, \
                               int nb0, int N, int K, const float* next, int next_lines) {                 \
        const int tiles = (m1 - m0 + BLF_MR - 1) / BLF_MR;                                                 \
        const int share = tiles > 1 ? (next_lines + tiles - 1) / tiles : 0;                               \
        int m = m0;                                                                                        \
        for (int t = 0; m < m1; m += BLF_MR, t++) {                                                        \
            const int lo = t * share;                                                                      \
            const int n = lo >= next_lines ? 0 : (next_lines - lo < share ? next_lines - lo : share);      \
            const char* pf = (const char*)next + 64 * (int64_t)lo;                                         \
            switch (m1 - m < BLF_MR ? m1 - m : BLF_MR) {                                                   \
                case 4: blf_tile_4_##NR(x, wb, bias, y, m, nb0, N, K, pf, n); break;                       \
                case 3: blf_tile_3_##NR(x, wb, bias, y, m, nb0, N, K, pf, n); break;                       \
                case 2: blf_tile_2_##NR(x, wb, bias, y, m, nb0, N, K, pf, n); break;                       \
                default: blf_tile_1_##NR(x, wb, bias, y, m, nb0, N, K, pf, n); break;                      \
            }                                                                                              \
        }                                                                                                  \
    }
BLF_PANEL(1)
BLF_PANEL(2)
BLF_PANEL(3)

static void linear_f32_blocked_avx2(const float* x, const float* wb, const float* bias, float* y, int M, int N,
                                    int K, int nthreads) {
    const int blocks = (N + 7) / 8;
    if (nthreads > blocks) nthreads = blocks > 0 ? blocks : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
    for (int t = 0; t < nthreads; t++) {
        const int b0 = (int)((int64_t)blocks * t / nthreads), b1 = (int)((int64_t)blocks * (t + 1) / nthreads);
        for (int m0 = 0; m0 < M; m0 += BLF_MB) {
            const int m1 = M - m0 > BLF_MB ? m0 + BLF_MB : M;
            int b = b0;
            for (; b + BLF_NR <= b1; b += BLF_NR) {
                const int nxt = b1 - (b + BLF_NR) < BLF_NR ? b1 - (b + BLF_NR) : BLF_NR; /* blocks in the next panel */
                blf_panel_3(x, wb, bias, y, m0, m1, b, N, K, wb + (int64_t)(b + BLF_NR) * K * 8, nxt * K / 2);
            }
            switch (b1 - b) {
                case 2: blf_panel_2(x, wb, bias, y, m0, m1, b, N, K, wb, 0); break;
                case 1: blf_panel_1(x, wb, bias, y, m0, m1, b, N, K, wb, 0); break;
                default: break;
            }
        }
    }
}
#endif

#ifdef HAVE_AVX512
/* The blocked fp32 linear kernel 16 lanes wide (the builds with AVX-512): `linear_f32_blocked_avx2`'s scheme on
 * 16-column blocks, wb[ceil(N/16)][K][16] (one 64-byte line per k and block), tiles of BLZ_MR rows by BLZ_NR
 * blocks (24 accumulators of the 32 registers: each block row loaded serves 8 rows of x). On a 2-core Ice Lake
 * it took 0.57-0.75x the AVX2 kernel's time from 16 to 2000 rows (280-300 GFLOP/s at 2000, oneDNN's rate), the
 * same at 1-4 rows (memory-bound). (The small-batch kernel 16 lanes wide ran slower than its AVX2 form there:
 * not kept.) */
#define BLZ_MR 8
#define BLZ_NR 3
#define BLZ_TILE(MR, NR)                                                                                   \
    static void blz_tile_##MR##_##NR(const float* x, const float* wb, const float* bias, float* y, int m0, \
                                     int nb0, int N, int K) {                                              \
        __m512 acc[MR][NR];                                                                                \
        const float* wr[NR];                                                                               \
        for (int j = 0; j < NR; j++) wr[j] = wb + (int64_t)(nb0 + j) * K * 16;                             \
        for (int i = 0; i < MR; i++)                                                                       \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();                                  \
        for (int k = 0; k < K; k++) {                                                                      \
            __m512 wv[NR];                                                                                 \
            for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_ps(wr[j] + (int64_t)k * 16);                 \
            for (int i = 0; i < MR; i++) {                                                                 \
                const __m512 xb = _mm512_set1_ps(x[(int64_t)(m0 + i) * K + k]);                            \
                for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]);            \
            }                                                                                              \
        }                                                                                                  \
        for (int j = 0; j < NR; j++) {                                                                     \
            const int n0 = (nb0 + j) * 16, left = N - n0;                                                  \
            const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);        \
            const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();          \
            for (int i = 0; i < MR; i++)                                                                   \
                _mm512_mask_storeu_ps(y + (int64_t)(m0 + i) * N + n0, mask, _mm512_add_ps(acc[i][j], b));  \
        }                                                                                                  \
    }
#define BLZ_ROWS(NR) BLZ_TILE(1, NR) BLZ_TILE(2, NR) BLZ_TILE(3, NR) BLZ_TILE(4, NR) BLZ_TILE(5, NR) \
    BLZ_TILE(6, NR) BLZ_TILE(7, NR) BLZ_TILE(8, NR)
BLZ_ROWS(1)
BLZ_ROWS(2)
BLZ_ROWS(3)
#define BLZ_PANEL(NR)                                                                                      \
    static void blz_panel_##NR(const float* x, const float* wb, const float* bias, float* y, int m0, int m1, \
                               int nb0, int N, int K) {                                                    \
        int m = m0;                                                                                        \
        for (; m + BLZ_MR <= m1; m += BLZ_MR) blz_tile_8_##NR(x, wb, bias, y, m, nb0, N, K);               \
        switch (m1 - m) {                                                                                  \
            case 7: blz_tile_7_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 6: blz_tile_6_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 5: blz_tile_5_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 4: blz_tile_4_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 3: blz_tile_3_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 2: blz_tile_2_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 1: blz_tile_1_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            default: break;                                                                                \
        }                                                                                                  \
    }
BLZ_PANEL(1)
BLZ_PANEL(2)
BLZ_PANEL(3)

static void linear_f32_blocked_avx512(const float* x, const float* wb, const float* bias, float* y, int M, int N,
                                      int K, int nthreads) {
    const int blocks = (N + 15) / 16;
    if (nthreads > blocks) nthreads = blocks > 0 ? blocks : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
    for (int t = 0; t < nthreads; t++) {
        const int b0 = (int)((int64_t)blocks * t / nthreads), b1 = (int)((int64_t)blocks * (t + 1) / nthreads);
        for (int m0 = 0; m0 < M; m0 += BLF_MB) {
            const int m1 = M - m0 > BLF_MB ? m0 + BLF_MB : M;
            int b = b0;
            for (; b + BLZ_NR <= b1; b += BLZ_NR) blz_panel_3(x, wb, bias, y, m0, m1, b, N, K);
            switch (b1 - b) {
                case 2: blz_panel_2(x, wb, bias, y, m0, m1, b, N, K); break;
                case 1: blz_panel_1(x, wb, bias, y, m0, m1, b, N, K); break;
                default: break;
            }
        }
    }
}
#endif

#ifdef HAVE_AVX2
/* The blocked fp32 kernel: 16 lanes wide where the build has AVX-512, else 8; a blocked weight's block holds
 * `pdserve_linear_f32_block_cols()` output columns (engine.kernels.Kernel.block_shape). */
int pdserve_linear_f32_block_cols(void) {
#ifdef HAVE_AVX512
    return 16;
#else
    return 8;
#endif
}

void pdserve_linear_f32_blocked(const float* x, const float* wb, const float* bias, float* y, int M, int N, int K,
                                int nthreads) {
#ifdef HAVE_AVX512
    linear_f32_blocked_avx512(x, wb, bias, y, M, N, K, nthreads);
#else
    linear_f32_blocked_avx2(x, wb, bias, y, M, N, K, nthreads);
#endif
}
#endif

#ifdef HAVE_AVX512
/* Prefill attention in fp32 (the builds with AVX-512): `pdserve_prefill_attn_bf16`'s scheme (below) with fp32
 * FMAs. K and V are packed once per call and kv head: kt [key blocks of 16][D][16 keys] (scores: lanes are 16
 * keys, a query dim broadcast) and vf [keys][D] (P.V: lanes are 16 dims, a row's P broadcast). A task is R rows
 * of one query head, 32 keys at a time, online softmax whose maximum moves only by PX_SLACK, O in registers.
 * The entry point, `pdserve_prefill_attn_f32`, is shared with the AVX2 build's (after it). */
#define PX_KEYS 32
#define PXF_BLOCK 16    /* keys per block of kt */
#define PXF_TILE PX_KEYS /* keys per step of a task */
#define PXF_R64 4       /* rows per task at head dim 64 */
#define PXF_R128 2      /* and 128 */

/* Keys [t0, t0 + 16) of one kv head into kt and vf (zeros past ctx). */
static void pxf_pack(const float* k_head, const float* v_head, const int64_t* table, int bs, int D, int ctx, int t0,
                     float* kt, float* vf) {
    const int real = ctx - t0 >= 16 ? 16 : ctx - t0;
    int rows[16] __attribute__((aligned(64))); /* each key's row, in floats from the pool's start */
    for (int j = 0; j < 16; j++) {
        const int t = t0 + (j < real ? j : real - 1);
        rows[j] = (int)((table[t / bs] * bs + t % bs) * D);
    }
    const __m512i idx = _mm512_load_si512(rows);
    const __mmask16 live = real == 16 ? 0xffff : (__mmask16)((1u << real) - 1);
    float* kb = kt + (int64_t)(t0 / 16) * D * 16;
    for (int d = 0; d < D; d++)
        _mm512_store_ps(kb + d * 16, _mm512_maskz_mov_ps(live, _mm512_i32gather_ps(idx, k_head + d, 4)));
    for (int j = 0; j < 16; j++) {
        float* dst = vf + (int64_t)(t0 + j) * D;
        if (j < real) memcpy(dst, v_head + rows[j], sizeof(float) * (size_t)D);
        else memset(dst, 0, sizeof(float) * (size_t)D);
    }
}

#define PXF_ROWS(NAME, R, NF)                                                                                     \
    static void NAME(const float* q, int64_t q_row, int64_t q_head, const float* kt, const float* vf, int start,  \
                     int n, int h, int i0, float scale, float* out, int64_t out_row) {                            \
        enum { D = (NF) * 16 };                                                                                   \
        const float* qr[R];                                                                                       \
        int pos[R];                                                                                               \
        float m[R];                                                                                               \
        __m512 l[R], o[R][NF];                                                                                    \
        for (int r = 0; r < R; r++) {                                                                             \
            const int i = i0 + r < n ? i0 + r : n - 1;                                                            \
            qr[r] = q + (int64_t)i * q_row + (int64_t)h * q_head;                                                 \
            pos[r] = start + i;                                                                                   \
            m[r] = -INFINITY;                                                                                     \
            l[r] = _mm512_setzero_ps();                                                                           \
            for (int f = 0; f < NF; f++) o[r][f] = _mm512_setzero_ps();                                           \
        }                                                                                                         \
        const int last = pos[R - 1];                                                                              \
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);              \
        const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);                            \
        float pf[R][PX_KEYS] __attribute__((aligned(64))); /* P of each row */                                    \
        for (int t0 = 0; t0 <= last; t0 += PX_KEYS) {                                                             \
            const int two = t0 + 16 <= last;                                                                      \
            const float* k0 = kt + (int64_t)(t0 / 16) * D * 16;                                                   \
            __m512 s0[R], s1[R];                                                                                  \
            for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_ps();                                      \
            for (int d = 0; d < D; d++) {                                                                         \
                const __m512 a0 = _mm512_load_ps(k0 + d * 16);                                                    \
                for (int r = 0; r < R; r++) s0[r] = _mm512_fmadd_ps(a0, _mm512_set1_ps(qr[r][d]), s0[r]);         \
                if (two) {                                                                                        \
                    const __m512 a1 = _mm512_load_ps(k0 + D * 16 + d * 16);                                       \
                    for (int r = 0; r < R; r++) s1[r] = _mm512_fmadd_ps(a1, _mm512_set1_ps(qr[r][d]), s1[r]);     \
                }                                                                                                 \
            }                                                                                                     \
            const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32(t0));                                   \
            const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));                                   \
            const int seen = t0 + PX_KEYS - 1 <= pos[0];                                                          \
            for (int r = 0; r < R; r++) {                                                                         \
                __m512 v0 = _mm512_mul_ps(s0[r], vscale), v1 = _mm512_mul_ps(s1[r], vscale);                      \
                if (!seen) {                                                                                      \
                    const __m512i at = _mm512_set1_epi32(pos[r]);                                                 \
                    v0 = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(key0, at), ninf, v0);                       \
                    v1 = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(key1, at), ninf, v1);                       \
                }                                                                                                 \
                const __m512 vmax = _mm512_max_ps(v0, v1);                                                        \
                if (_mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m[r] + PX_SLACK), _CMP_GT_OQ)) {                      \
                    const float mnew = fmaxf(m[r], _mm512_reduce_max_ps(vmax));                                   \
                    const __m512 alpha = _mm512_set1_ps(expf(m[r] - mnew));                                       \
                    l[r] = _mm512_mul_ps(l[r], alpha);                                                            \
                    for (int f = 0; f < NF; f++) o[r][f] = _mm512_mul_ps(o[r][f], alpha);                         \
                    m[r] = mnew;                                                                                  \
                }                                                                                                 \
                const __m512 mv = _mm512_set1_ps(m[r]);                                                           \
                const __m512 p0 = exp512(_mm512_sub_ps(v0, mv)), p1 = exp512(_mm512_sub_ps(v1, mv));              \
                l[r] = _mm512_add_ps(l[r], _mm512_add_ps(p0, p1));                                                \
                _mm512_store_ps(pf[r], p0);                                                                       \
                _mm512_store_ps(pf[r] + 16, p1);                                                                  \
            }                                                                                                     \
            const int keys = last - t0 + 1 < PX_KEYS ? last - t0 + 1 : PX_KEYS;                                  \
            const float* v0p = vf + (int64_t)t0 * D;                                                              \
            for (int t = 0; t < keys; t++)                                                                        \
                for (int f = 0; f < NF; f++) {                                                                    \
                    const __m512 b = _mm512_loadu_ps(v0p + (int64_t)t * D + f * 16);                              \
                    for (int r = 0; r < R; r++) o[r][f] = _mm512_fmadd_ps(_mm512_set1_ps(pf[r][t]), b, o[r][f]);  \
                }                                                                                                 \
        }                                                                                                         \
        for (int r = 0; r < R && i0 + r < n; r++) {                                                               \
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[r]));                                 \
            float* dst = out + (int64_t)(i0 + r) * out_row + (int64_t)h * D;                                      \
            for (int f = 0; f < NF; f++) _mm512_storeu_ps(dst + f * 16, _mm512_mul_ps(o[r][f], inv));             \
        }                                                                                                         \
    }
PXF_ROWS(pxf_rows64, PXF_R64, 4)
PXF_ROWS(pxf_rows128, PXF_R128, 8)
#endif

#if defined(HAVE_AVX2) && !defined(HAVE_AVX512)
/* Prefill attention in fp32 with AVX2 + FMA: the AVX-512 kernel's scheme (above) 8 lanes wide. K is packed once
 * per call and kv head as kt [key blocks of 8][D][8 keys] (scores: lanes are 8 keys, a query dim broadcast),
 * V as vf [keys][D]. A task is PXF_R64 / PXF_R128 rows of one query head, 16 keys at a time, the same online
 * softmax. 16 registers cannot hold O as well, so it lives in a tile on the stack and P.V computes it 16 dims at
 * a time: 4 rows x 2 vectors of accumulators, two vectors of V and a broadcast P. */
#define PXF_BLOCK 8
#define PXF_TILE 16
#define PXF_R64 32 /* rows per task */
#define PXF_R128 32

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Keys [t0, t0 + 8) of one kv head into kt and vf (zeros past ctx). */
static void pxf_pack(const float* k_head, const float* v_head, const int64_t* table, int bs, int D, int ctx, int t0,
                     float* kt, float* vf) {
    float* kb = kt + (int64_t)(t0 / 8) * D * 8;
    for (int j = 0; j < 8; j++) {
        float* dst = vf + (int64_t)(t0 + j) * D;
        const int t = t0 + j;
        if (t < ctx) {
            const int64_t row = (table[t / bs] * bs + t % bs) * D;
            for (int d = 0; d < D; d++) kb[d * 8 + j] = k_head[row + d];
            memcpy(dst, v_head + row, sizeof(float) * (size_t)D);
        } else {
            for (int d = 0; d < D; d++) kb[d * 8 + j] = 0.f;
            memset(dst, 0, sizeof(float) * (size_t)D);
        }
    }
}

/* The scores of 4 rows (queries gq[0..3]) over one tile of 16 keys (kt blocks k0, k0 + 8 * D): both blocks
 * of 8, always (keys past the context are packed as zeros and masked by the caller), in 8 named sums, which
 * stay in registers through the loop (sums in an array the caller indexes were stored at every step). */
static inline void pxf_scores4(const float* k0, const float* const* gq, int D, __m256* s0, __m256* s1) {
    __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a, e = a, f = a, g = a, h = a;
    const float *q0 = gq[0], *q1 = gq[1], *q2 = gq[2], *q3 = gq[3], *k1 = k0 + D * 8;
    for (int i = 0; i < D; i++) {
        const __m256 x0 = _mm256_load_ps(k0 + i * 8), x1 = _mm256_load_ps(k1 + i * 8);
        __m256 y = _mm256_broadcast_ss(q0 + i);
        a = _mm256_fmadd_ps(x0, y, a), b = _mm256_fmadd_ps(x1, y, b);
        y = _mm256_broadcast_ss(q1 + i);
        c = _mm256_fmadd_ps(x0, y, c), d = _mm256_fmadd_ps(x1, y, d);
        y = _mm256_broadcast_ss(q2 + i);
        e = _mm256_fmadd_ps(x0, y, e), f = _mm256_fmadd_ps(x1, y, f);
        y = _mm256_broadcast_ss(q3 + i);
        g = _mm256_fmadd_ps(x0, y, g), h = _mm256_fmadd_ps(x1, y, h);
    }
    s0[0] = a, s1[0] = b, s0[1] = c, s1[1] = d, s0[2] = e, s1[2] = f, s0[3] = g, s1[3] = h;
}

/* A task: rows [i0, i0 + QB) of query head h (those below n), all over each tile of 16 keys in turn, so the
 * tile's packed K and V (8 KB at head dim 64) are read from L1 by every 4 rows of the task rather than from L3
 * by each 4 rows: 4 rows at a time, their scores, softmax and P.V as one step of the AVX-512 kernel. */
#define PXF_ROWS(NAME, QB, DIM)                                                                                   \
    static void NAME(const float* q, int64_t q_row, int64_t q_head, const float* kt, const float* vf, int start,  \
                     int n, int h, int i0, float scale, float* out, int64_t out_row) {                            \
        enum { D = DIM, R = 4 };                                                                                  \
        const int rows = n - i0 < QB ? n - i0 : QB, groups = (rows + R - 1) / R;                                  \
        const float* qr[QB];                                                                                      \
        int pos[QB];                                                                                              \
        float m[QB];                                                                                              \
        __m256 l[QB];                                                                                             \
        float o[QB][D] __attribute__((aligned(32)));                                                              \
        for (int r = 0; r < groups * R; r++) { /* a last group past n repeats row n - 1 */                        \
            const int i = i0 + (r < rows ? r : rows - 1);                                                         \
            qr[r] = q + (int64_t)i * q_row + (int64_t)h * q_head;                                                 \
            pos[r] = start + i;                                                                                   \
            m[r] = -INFINITY;                                                                                     \
            l[r] = _mm256_setzero_ps();                                                                           \
            memset(o[r], 0, sizeof o[r]);                                                                         \
        }                                                                                                         \
        const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);                                               \
        const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);                            \
        float pf[R][PXF_TILE] __attribute__((aligned(32))); /* P of each row of a group */                        \
        for (int t0 = 0; t0 <= pos[groups * R - 1]; t0 += PXF_TILE) {                                             \
            const float* k0 = kt + (int64_t)(t0 / 8) * D * 8;                                                     \
            const float* vt = vf + (int64_t)t0 * D;                                                               \
            const __m256 key0 = _mm256_add_ps(lane, _mm256_set1_ps((float)t0));                                   \
            const __m256 key1 = _mm256_add_ps(key0, _mm256_set1_ps(8.f));                                         \
            for (int g = 0; g < groups; g++) {                                                                    \
                const float* const* gq = qr + g * R;                                                              \
                const int* gp = pos + g * R;                                                                      \
                const int last = gp[R - 1];                                                                       \
                if (t0 > last) continue; /* the group's keys end before this tile */                              \
                __m256 s0[R], s1[R];                                                                              \
                pxf_scores4(k0, gq, D, s0, s1);                                                                   \
                const int seen = t0 + PXF_TILE - 1 <= gp[0];                                                      \
                for (int r = 0; r < R; r++) {                                                                     \
                    const int x = g * R + r;                                                                      \
                    __m256 v0 = _mm256_mul_ps(s0[r], vscale), v1 = _mm256_mul_ps(s1[r], vscale);                  \
                    if (!seen) {                                                                                  \
                        const __m256 at = _mm256_set1_ps((float)gp[r]);                                           \
                        v0 = _mm256_blendv_ps(v0, ninf, _mm256_cmp_ps(key0, at, _CMP_GT_OQ));                     \
                        v1 = _mm256_blendv_ps(v1, ninf, _mm256_cmp_ps(key1, at, _CMP_GT_OQ));                     \
                    }                                                                                             \
                    const __m256 vmax = _mm256_max_ps(v0, v1);                                                    \
                    if (_mm256_movemask_ps(_mm256_cmp_ps(vmax, _mm256_set1_ps(m[x] + PX_SLACK), _CMP_GT_OQ))) {   \
                        const float mnew = fmaxf(m[x], hmax8(vmax));                                              \
                        const __m256 alpha = _mm256_set1_ps(expf(m[x] - mnew));                                   \
                        l[x] = _mm256_mul_ps(l[x], alpha);                                                        \
                        for (int d = 0; d < D; d += 8)                                                            \
                            _mm256_store_ps(o[x] + d, _mm256_mul_ps(_mm256_load_ps(o[x] + d), alpha));            \
                        m[x] = mnew;                                                                              \
                    }                                                                                             \
                    const __m256 mv = _mm256_set1_ps(m[x]);                                                       \
                    const __m256 p0 = exp256(_mm256_sub_ps(v0, mv)), p1 = exp256(_mm256_sub_ps(v1, mv));          \
                    l[x] = _mm256_add_ps(l[x], _mm256_add_ps(p0, p1));                                            \
                    _mm256_store_ps(pf[r], p0);                                                                   \
                    _mm256_store_ps(pf[r] + 8, p1);                                                               \
                }                                                                                                 \
                const int keys = last - t0 + 1 < PXF_TILE ? last - t0 + 1 : PXF_TILE;                             \
                float(*go)[D] = o + g * R;                                                                        \
                for (int c = 0; c < D; c += 16) {                                                                 \
                    __m256 a0[R], a1[R];                                                                          \
                    for (int r = 0; r < R; r++) a0[r] = _mm256_load_ps(go[r] + c), a1[r] = _mm256_load_ps(go[r] + c + 8); \
                    for (int t = 0; t < keys; t++) {                                                              \
                        const __m256 b0 = _mm256_load_ps(vt + t * D + c), b1 = _mm256_load_ps(vt + t * D + c + 8);\
                        for (int r = 0; r < R; r++) {                                                             \
                            const __m256 p = _mm256_broadcast_ss(&pf[r][t]);                                      \
                            a0[r] = _mm256_fmadd_ps(p, b0, a0[r]);                                                \
                            a1[r] = _mm256_fmadd_ps(p, b1, a1[r]);                                                \
                        }                                                                                         \
                    }                                                                                             \
                    for (int r = 0; r < R; r++) _mm256_store_ps(go[r] + c, a0[r]), _mm256_store_ps(go[r] + c + 8, a1[r]); \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < rows; r++) {                                                                          \
            const __m256 inv = _mm256_set1_ps(1.0f / hsum8(l[r]));                                                \
            float* dst = out + (int64_t)(i0 + r) * out_row + (int64_t)h * D;                                      \
            for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_load_ps(o[r] + d), inv)); \
        }                                                                                                         \
    }
PXF_ROWS(pxf_rows64, PXF_R64, 64)
PXF_ROWS(pxf_rows128, PXF_R128, 128)
#endif

#ifdef HAVE_AVX2
/* Prefill attention in fp32, the arguments as for `pdserve_prefill_attn_bf16` (below) with q, the pools and out
 * holding floats: the build's `pxf_pack` and `pxf_rows64` / `pxf_rows128` (16 lanes with AVX-512, else 8). */
int pdserve_prefill_attn_f32(const float* q, int64_t q_row, int64_t q_head, const float* k_pool, const float* v_pool,
                             int64_t pool_head, int bs, const int64_t* table, int start, int n, int H, int KVH, int D,
                             float scale, float* out, int64_t out_row, int nthreads) {
    if ((D != 64 && D != 128) || n < 1 || KVH < 1 || H % KVH != 0 || pool_head > INT32_MAX) return -1;
    const int ctx = start + n, ctx_pad = (ctx + PXF_TILE - 1) / PXF_TILE * PXF_TILE, G = H / KVH;
    const int R = D == 64 ? PXF_R64 : PXF_R128, blocks = ctx_pad / PXF_BLOCK, tiles = (n + R - 1) / R;
    const int64_t per_head = (int64_t)ctx_pad * D; /* floats of kt, and of vf, per kv head */
    float* packed = aligned_alloc(64, (size_t)2 * KVH * per_head * sizeof(float));
    if (packed == NULL) return -1;
    float *kt = packed, *vf = packed + KVH * per_head;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(static)
        for (int c = 0; c < KVH * blocks; c++) {
            const int kh = c / blocks, t0 = (c % blocks) * PXF_BLOCK;
            if (t0 < ctx)
                pxf_pack(k_pool + kh * pool_head, v_pool + kh * pool_head, table, bs, D, ctx, t0, kt + kh * per_head,
                         vf + kh * per_head);
            else { /* past the context: zeros, read by the last tile's products */
                memset(kt + kh * per_head + (int64_t)t0 * D, 0, (size_t)PXF_BLOCK * D * sizeof(float));
                memset(vf + kh * per_head + (int64_t)t0 * D, 0, (size_t)PXF_BLOCK * D * sizeof(float));
            }
        }
#pragma omp for schedule(dynamic, 4)
        for (int task = 0; task < H * tiles; task++) { /* the last rows (most keys) first */
            const int h = task % H, i0 = (tiles - 1 - task / H) * R, kh = h / G;
            if (D == 64)
                pxf_rows64(q, q_row, q_head, kt + kh * per_head, vf + kh * per_head, start, n, h, i0, scale, out,
                           out_row);
            else
                pxf_rows128(q, q_row, q_head, kt + kh * per_head, vf + kh * per_head, start, n, h, i0, scale, out,
                            out_row);
        }
    }
    free(packed);
    return 0;
}

/* Whether fp32 prompts with no cached context go to `pdserve_prefill_attn_f32` too (see its bf16 twin). */
int pdserve_prefill_attn_f32_whole(void) { return 1; }
#endif

#ifdef HAVE_AVX512_BF16
/* Small-batch linear layers, bf16 (fp32 accumulation, rounded to bf16 like oneDNN's): the same
 * y[M, N] = x[M, K] w[N, K]^T (+ bias[N]) with AVX-512 BF16 dot products, 32 elements of K per
 * instruction. Each step of K loads LINB_NB rows of w once for a tile of up to 4 rows of x (16
 * accumulators in registers) and prefetches the next block's rows; a tail of K is loaded masked
 * (zeros add nothing). Threads split N. Built only where AVX-512 BF16 is. */
#define LINB_NB 4
#define LINB_TILE(MB)                                                                                       \
    static inline void linb_tile##MB(const uint16_t* x, const uint16_t* w, const uint16_t* bias,          \
                                     uint16_t* y, int m0, int n0, int N, int K) {                         \
        __m512 acc[MB][LINB_NB];                                                                           \
        const uint16_t* wr[LINB_NB];                                                                       \
        const uint16_t* xr[MB];                                                                            \
        for (int j = 0; j < LINB_NB; j++) wr[j] = w + (int64_t)(n0 + j) * K;                               \
        for (int i = 0; i < MB; i++) {                                                                     \
            xr[i] = x + (int64_t)(m0 + i) * K;                                                             \
            for (int j = 0; j < LINB_NB; j++) acc[i][j] = _mm512_setzero_ps();                             \
        }                                                                                                  \
        for (int k = 0; k < K; k += 32) {                                                                  \
            const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u); \
            __m512i wv[LINB_NB];                                                                           \
            for (int j = 0; j < LINB_NB; j++) {                                                            \
                wv[j] = _mm512_maskz_loadu_epi16(mask, wr[j] + k);                                         \
                _mm_prefetch((const char*)(wr[j] + LINB_NB * (int64_t)K + k), _MM_HINT_T0);                \
            }                                                                                              \
            for (int i = 0; i < MB; i++) {                                                                 \
                const __m512i xv = _mm512_maskz_loadu_epi16(mask, xr[i] + k);                              \
                for (int j = 0; j < LINB_NB; j++)                                                          \
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);                \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < MB; i++)                                                                       \
            for (int j = 0; j < LINB_NB; j++)                                                              \
                y[(int64_t)(m0 + i) * N + n0 + j] =                                                        \
                    bf16_store(_mm512_reduce_add_ps(acc[i][j]) + (bias ? bf16_load(bias[n0 + j]) : 0.0f));  \
    }
LINB_TILE(1)
LINB_TILE(2)
LINB_TILE(3)
LINB_TILE(4)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* With AMX (the amx_bf16 build): w is the tile product's left operand as it lies in memory (16 rows
 * of w by 32 of K per tile load, no repacking of the weight) and x the right one, repacked per call
 * into AMX's pair-interleaved layout (x^T: [K/2][16 rows of x][2]); C tiles hold 16 rows of w by 16
 * rows of x in fp32. Two row blocks of w per step of K (2 C, 2 A tiles, 1 B tile). Needs K % 32 == 0;
 * rows of w past the last pair of blocks go to the AVX-512 tiles. */
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18
#define AMX_AHEAD 128 /* elements of K a tile step prefetches ahead (4 cache lines per row of w) */
#define AMX_MIN_ROWS 4 /* fewer rows of x: the AVX-512 tiles read w faster (measured on a 2-core Xeon) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_ready = 0; /* 1: this process may use AMX tiles; -1: the kernel refused */

static int amx_request(void) {
    if (amx_ready == 0)
        amx_ready = syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_ready == 1;
}

static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { /* 0, 1, 6, 7: C; 2, 3: A (w); 4, 5: B (x) */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* xp[K/32][16][32]: block kb, row r holds x[m][kb*32 + 2r], x[m][kb*32 + 2r + 1] for m = m0..m0+15
 * (zero past M). */
static void amx_pack_x(const uint16_t* x, uint16_t* xp, int m0, int M, int K) {
    const int rows = M - m0 < 16 ? M - m0 : 16;
    memset(xp, 0, (size_t)K * 16 * sizeof(uint16_t));
    for (int m = 0; m < rows; m++) {
        const uint16_t* xr = x + (int64_t)(m0 + m) * K;
        for (int k = 0; k < K; k++) xp[(int64_t)(k >> 5) * 512 + ((k & 31) >> 1) * 32 + m * 2 + (k & 1)] = xr[k];
    }
}

/* y[m][n0 .. n0+15] = c[.][m] + bias for the tile's rows of x: column m of c gathered, rounded to bf16
 * (nearest even) and stored as one contiguous run. */
static void amx_store(const float* c, const uint16_t* bias, uint16_t* y, int m0, int M, int n0, int N) {
    const int rows = M - m0 < 16 ? M - m0 : 16;
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0))), 16))
                          : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
        const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + m, 4), b);
        _mm256_storeu_si256((__m256i*)(y + (int64_t)(m0 + m) * N + n0), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* 32 rows of w (from n0) by 16 rows of x (from m0), or 32 (`two`), over all of K. */
#define AMX_PAIR(TWO)                                                                                       \
    do {                                                                                                   \
        _tile_zero(0);                                                                                     \
        _tile_zero(1);                                                                                     \
        if (TWO) {                                                                                         \
            _tile_zero(6);                                                                                 \
            _tile_zero(7);                                                                                 \
        }                                                                                                  \
        for (int k = 0; k < K; k += 32) {                                                                  \
            if (k + AMX_AHEAD < K)                                                                         \
                for (int r = 0; r < 16; r++) {                                                             \
                    _mm_prefetch((const char*)(w0 + r * (int64_t)K + k + AMX_AHEAD), _MM_HINT_T0);         \
                    _mm_prefetch((const char*)(w1 + r * (int64_t)K + k + AMX_AHEAD), _MM_HINT_T0);         \
                }                                                                                          \
            _tile_loadd(2, w0 + k, stride);                                                                \
            _tile_loadd(3, w1 + k, stride);                                                                \
            _tile_loadd(4, xp + (int64_t)(k >> 5) * 512, 64);                                              \
            _tile_dpbf16ps(0, 2, 4);                                                                       \
            _tile_dpbf16ps(1, 3, 4);                                                                       \
            if (TWO) {                                                                                     \
                _tile_loadd(5, xp + (int64_t)K * 16 + (int64_t)(k >> 5) * 512, 64);                        \
                _tile_dpbf16ps(6, 2, 5);                                                                   \
                _tile_dpbf16ps(7, 3, 5);                                                                   \
            }                                                                                              \
        }                                                                                                  \
    } while (0)

static void linear_bf16_amx(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int M, int N,
                            int K, int nthreads) {
    const int pairs = N / 32;
    uint16_t* xp = aligned_alloc(64, (size_t)K * 32 * sizeof(uint16_t));
    const int64_t stride = (int64_t)K * sizeof(uint16_t);
    for (int m0 = 0; m0 < M; m0 += 32) { /* each pass reads w once for up to 32 rows of x */
        const int two = M - m0 > 16;
        amx_pack_x(x, xp, m0, M, K);
        if (two) amx_pack_x(x, xp + (int64_t)K * 16, m0 + 16, M, K);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
        {
            amx_configure();
            float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int p = 0; p < pairs; p++) {
                const uint16_t* w0 = w + (int64_t)p * 32 * K;
                const uint16_t* w1 = w0 + (int64_t)16 * K;
                if (two) {
                    AMX_PAIR(1);
                    _tile_stored(6, c[2], 64);
                    _tile_stored(7, c[3], 64);
                    amx_store(c[2], bias, y, m0 + 16, M, p * 32, N);
                    amx_store(c[3], bias, y, m0 + 16, M, p * 32 + 16, N);
                } else {
                    AMX_PAIR(0);
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                amx_store(c[0], bias, y, m0, M, p * 32, N);
                amx_store(c[1], bias, y, m0, M, p * 32 + 16, N);
            }
            _tile_release();
        }
    }
    free(xp);
}

/* Prefill attention over the paged pool on AMX tiles (bf16, head dim 64 or 128): the n queries of one
 * prompt chunk, at positions start .. start + n - 1, each attend to the keys up to its own position,
 * read in place through the chunk's block table (the block size a multiple of 16). Transposed, so that
 * the softmax runs down the registers and needs no horizontal reduction: S^T = K Q^T (A: 16 keys as
 * they lie in the pool; B: 16 query rows, pair-interleaved, D / 32 tiles for the whole chunk) and
 * O^T = V^T P^T (A: V transposed, once per call and kv head; B: P^T pair-interleaved; C: O^T by 16
 * dims). fp32 scores, softmax and accumulation; P rounded to bf16 for the second product, as torch's
 * flash attention does. At D = 64, tiles 0, 1: Q^T; 2-5: O^T, kept in tiles and stored only when a
 * row's running maximum grows; at D = 128, tiles 0-3: Q^T, and O^T in memory, two tiles of it (4, 5)
 * at a time. Tile 6: A (K, then V^T); 7: S^T, then P^T. */
#define PA_MAX_D 128
/* Lanes of cvtne2ps_pbh(p1, p0) (p0 in 0-15, p1 in 16-31) in pair-interleaved order. */
static const uint16_t PA_PAIRS[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* vt[d][t] = V[t][d] for the 32 keys from t0 (zero past ctx): 16 keys at a time, each gather taking one
 * pair of dims of 16 keys, split into its two dims. */
static void pa_pack_vt(const uint16_t* v_head, const int64_t* table, int bs, int D, int ctx, int ctx_pad, int t0,
                       uint16_t* vt) {
    for (int t = t0; t < t0 + 32; t += 16) {
        if (t >= ctx) {
            for (int d = 0; d < D; d++) memset(vt + (int64_t)d * ctx_pad + t, 0, 16 * sizeof(uint16_t));
            continue;
        }
        int rows[16] __attribute__((aligned(64))); /* each key's row, in dwords from the block of t */
        const uint16_t* base = v_head + table[t / bs] * bs * D;
        for (int j = 0; j < 16; j++) rows[j] = (t + j < ctx ? (t + j) % bs : t % bs) * (D / 2);
        const __m512i idx = _mm512_load_si512(rows);
        const __mmask16 real = ctx - t >= 16 ? 0xffff : (__mmask16)((1u << (ctx - t)) - 1);
        for (int k = 0; k < D / 2; k++) {
            const __m512i pair = _mm512_maskz_mov_epi32(real, _mm512_i32gather_epi32(idx, (const int*)base + k, 4));
            _mm256_storeu_si256((__m256i*)(vt + (int64_t)(2 * k) * ctx_pad + t), _mm512_cvtepi32_epi16(pair));
            _mm256_storeu_si256((__m256i*)(vt + (int64_t)(2 * k + 1) * ctx_pad + t),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
        }
    }
}

/* One task: rows i0 .. i0 + 15 of query head h (fewer at the chunk's end: the last row stands in for the
 * rest, so every lane stays finite). */
typedef struct {
    const uint16_t* k_head; /* this kv head's keys [blocks][bs][D] */
    const uint16_t* vt;     /* its values transposed [D][ctx_pad] */
    const int64_t* table;
    int bs, D, ctx_pad, start, first, last; /* first, last: the task's first and last row's positions */
    __m512i pos;           /* each lane's position */
    __m512 scale, mref, l; /* the running maximum and sum of each lane */
} pa_task;

/* Q^T pair-interleaved into qt [D/32][16 pairs][16 rows][2], and the lanes' positions. */
static void pa_load_q(pa_task* t, const uint16_t* q, int64_t q_row, int64_t q_head, int n, int h, int i0,
                      uint16_t* qt) {
    const int rows = n - i0 < 16 ? n - i0 : 16;
    int pos[16] __attribute__((aligned(64)));
    for (int m = 0; m < 16; m++) {
        const int i = i0 + (m < rows ? m : rows - 1);
        const uint16_t* qr = q + (int64_t)i * q_row + (int64_t)h * q_head;
        for (int d = 0; d < t->D; d++) qt[(d >> 5) * 512 + ((d & 31) >> 1) * 32 + m * 2 + (d & 1)] = qr[d];
        pos[m] = t->start + i;
    }
    t->pos = _mm512_load_si512(pos);
    t->first = t->start + i0;
    t->last = t->start + i0 + rows - 1;
    t->mref = _mm512_set1_ps(-INFINITY);
    t->l = _mm512_setzero_ps();
}

/* The scores s [32 keys from t0][16 lanes] (S^T, scaled here) become P^T, pair-interleaved in pt; returns
 * 1 and the factor `alpha` the output so far must be scaled by when a lane's maximum grew. */
static int pa_softmax(pa_task* t, int t0, float s[32][16], uint16_t pt[16][16][2], __m512* alpha) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const int masked = t0 + 31 > t->first; /* a key past some lane's position */
    __m512 cmax = ninf;
    for (int j = 0; j < 32; j++) {
        __m512 v = _mm512_mul_ps(_mm512_load_ps(s[j]), t->scale);
        if (masked) v = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(t->pos, _mm512_set1_epi32(t0 + j)), ninf, v);
        _mm512_store_ps(s[j], v);
        cmax = _mm512_max_ps(cmax, v);
    }
    const __m512 mnew = _mm512_max_ps(t->mref, cmax);
    int grew = 0;
    if (_mm512_cmp_ps_mask(mnew, t->mref, _CMP_GT_OQ)) {
        *alpha = exp512(_mm512_sub_ps(t->mref, mnew));
        t->l = _mm512_mul_ps(t->l, *alpha);
        t->mref = mnew;
        grew = 1;
    }
    const __m512i pairs = _mm512_loadu_si512(PA_PAIRS);
    for (int r = 0; r < 16; r++) {
        const __m512 p0 = exp512(_mm512_sub_ps(_mm512_load_ps(s[2 * r]), t->mref));
        const __m512 p1 = exp512(_mm512_sub_ps(_mm512_load_ps(s[2 * r + 1]), t->mref));
        t->l = _mm512_add_ps(t->l, _mm512_add_ps(p0, p1));
        _mm512_store_si512(pt[r], _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
    }
    return grew;
}

/* S^T for the 16 keys from t (all before the table's end) into tile 7, with Q^T in tiles 0 .. D/32 - 1. */
#define PA_SCORES(T, KB, DH)                                                                                  \
    do {                                                                                                     \
        _tile_zero(7);                                                                                       \
        _tile_loadd(6, (KB), (T)->D * 2);                                                                    \
        _tile_dpbf16ps(7, 6, 0);                                                                             \
        _tile_loadd(6, (KB) + 32, (T)->D * 2);                                                               \
        _tile_dpbf16ps(7, 6, 1);                                                                             \
        if ((DH) == 4) {                                                                                     \
            _tile_loadd(6, (KB) + 64, (T)->D * 2);                                                           \
            _tile_dpbf16ps(7, 6, 2);                                                                         \
            _tile_loadd(6, (KB) + 96, (T)->D * 2);                                                           \
            _tile_dpbf16ps(7, 6, 3);                                                                         \
        }                                                                                                    \
    } while (0)

/* The 32 keys from t0: S^T into s (keys past `last`: -inf). */
static void pa_chunk_scores(pa_task* t, int t0, float s[32][16], int dh) {
    for (int half = 0; half < 2; half++) {
        const int k = t0 + half * 16;
        if (k > t->last) { /* past every lane's position (and perhaps the table's end) */
            for (int j = 0; j < 16; j++) _mm512_store_ps(s[half * 16 + j], _mm512_set1_ps(-INFINITY));
            continue;
        }
        const uint16_t* kb = t->k_head + (t->table[k / t->bs] * t->bs + k % t->bs) * t->D;
        if (dh == 4)
            PA_SCORES(t, kb, 4);
        else
            PA_SCORES(t, kb, 2);
        _tile_stored(7, s[half * 16], 64);
    }
}

/* out[i0 + m][h][d] = o[d][m] / l[m] for the task's real rows. */
static void pa_store(const pa_task* t, float o[][16], int rows, uint16_t* out, int64_t out_row, int h, int i0) {
    float inv[16] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), t->l));
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    for (int m = 0; m < rows; m++) {
        uint16_t* dst = out + (int64_t)(i0 + m) * out_row + (int64_t)h * t->D;
        const __m512 w = _mm512_set1_ps(inv[m]);
        for (int d0 = 0; d0 < t->D; d0 += 16) {
            const __m512 v = _mm512_mul_ps(_mm512_i32gather_ps(column, &o[d0][m], 4), w);
            _mm256_storeu_si256((__m256i*)(dst + d0), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

static void pa_rows64(pa_task* t, uint16_t* out, int64_t out_row, int h, int i0, int rows) {
    float s[32][16] __attribute__((aligned(64)));
    float o[64][16] __attribute__((aligned(64)));
    uint16_t pt[16][16][2] __attribute__((aligned(64)));
    const int64_t stride = (int64_t)t->ctx_pad * 2;
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int t0 = 0; t0 <= t->last; t0 += 32) {
        pa_chunk_scores(t, t0, s, 2);
        __m512 alpha;
        if (pa_softmax(t, t0, s, pt, &alpha)) { /* O^T's tiles through memory, scaled */
            _tile_stored(2, o[0], 64);
            _tile_stored(3, o[16], 64);
            _tile_stored(4, o[32], 64);
            _tile_stored(5, o[48], 64);
            for (int d = 0; d < 64; d++) _mm512_store_ps(o[d], _mm512_mul_ps(_mm512_load_ps(o[d]), alpha));
            _tile_loadd(2, o[0], 64);
            _tile_loadd(3, o[16], 64);
            _tile_loadd(4, o[32], 64);
            _tile_loadd(5, o[48], 64);
        }
        _tile_loadd(7, pt, 64);
        _tile_loadd(6, t->vt + t0, stride);
        _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(6, t->vt + (int64_t)16 * t->ctx_pad + t0, stride);
        _tile_dpbf16ps(3, 6, 7);
        _tile_loadd(6, t->vt + (int64_t)32 * t->ctx_pad + t0, stride);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(6, t->vt + (int64_t)48 * t->ctx_pad + t0, stride);
        _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(2, o[0], 64);
    _tile_stored(3, o[16], 64);
    _tile_stored(4, o[32], 64);
    _tile_stored(5, o[48], 64);
    pa_store(t, o, rows, out, out_row, h, i0);
}

static void pa_rows128(pa_task* t, uint16_t* out, int64_t out_row, int h, int i0, int rows) {
    float s[32][16] __attribute__((aligned(64)));
    float o[128][16] __attribute__((aligned(64)));
    uint16_t pt[16][16][2] __attribute__((aligned(64)));
    const int64_t stride = (int64_t)t->ctx_pad * 2;
    memset(o, 0, sizeof o);
    for (int t0 = 0; t0 <= t->last; t0 += 32) {
        pa_chunk_scores(t, t0, s, 4);
        __m512 alpha;
        if (pa_softmax(t, t0, s, pt, &alpha))
            for (int d = 0; d < 128; d++) _mm512_store_ps(o[d], _mm512_mul_ps(_mm512_load_ps(o[d]), alpha));
        _tile_loadd(7, pt, 64);
        for (int d0 = 0; d0 < 128; d0 += 32) {
            _tile_loadd(4, o[d0], 64);
            _tile_loadd(5, o[d0 + 16], 64);
            _tile_loadd(6, t->vt + (int64_t)d0 * t->ctx_pad + t0, stride);
            _tile_dpbf16ps(4, 6, 7);
            _tile_loadd(6, t->vt + (int64_t)(d0 + 16) * t->ctx_pad + t0, stride);
            _tile_dpbf16ps(5, 6, 7);
            _tile_stored(4, o[d0], 64);
            _tile_stored(5, o[d0 + 16], 64);
        }
    }
    pa_store(t, o, rows, out, out_row, h, i0);
}

/* The arguments as for `pdserve_prefill_attn_bf16` (below); -1 also where the OS gives no AMX tiles. */
static int prefill_attn_amx(const uint16_t* q, int64_t q_row, int64_t q_head, const uint16_t* k_pool,
                            const uint16_t* v_pool, int64_t pool_head, int bs, const int64_t* table, int start,
                            int n, int H, int KVH, int D, float scale, uint16_t* out, int64_t out_row, int nthreads) {
    if (!amx_request() || (D != 64 && D != 128) || bs % 16 != 0 || n < 1 || KVH < 1 || H % KVH != 0) return -1;
    const int ctx = start + n, ctx_pad = (ctx + 31) / 32 * 32, G = H / KVH;
    const int tiles = (n + 15) / 16, chunks = ctx_pad / 32;
    uint16_t* vt = aligned_alloc(64, (size_t)KVH * D * ctx_pad * sizeof(uint16_t));
    if (vt == NULL) return -1;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(static)
        for (int c = 0; c < KVH * chunks; c++) {
            const int kh = c / chunks;
            pa_pack_vt(v_pool + kh * pool_head, table, bs, D, ctx, ctx_pad, (c % chunks) * 32,
                       vt + (int64_t)kh * D * ctx_pad);
        }
        amx_configure();
        uint16_t qt[PA_MAX_D / 32 * 512] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic)
        for (int task = 0; task < H * tiles; task++) {
            const int h = task / tiles, kh = h / G, i0 = (task % tiles) * 16;
            pa_task t = {.k_head = k_pool + kh * pool_head, .vt = vt + (int64_t)kh * D * ctx_pad, .table = table,
                         .bs = bs, .D = D, .ctx_pad = ctx_pad, .start = start, .scale = _mm512_set1_ps(scale)};
            pa_load_q(&t, q, q_row, q_head, n, h, i0, qt);
            const int rows = n - i0 < 16 ? n - i0 : 16;
            _tile_loadd(0, qt, 64); /* Q^T: tiles 0 .. D/32 - 1 */
            _tile_loadd(1, qt + 512, 64);
            if (D == 128) {
                _tile_loadd(2, qt + 1024, 64);
                _tile_loadd(3, qt + 1536, 64);
                pa_rows128(&t, out, out_row, h, i0, rows);
            } else {
                pa_rows64(&t, out, out_row, h, i0, rows);
            }
        }
        _tile_release();
    }
    free(vt);
    return 0;
}
#endif

/* Prefill attention with AVX-512 BF16 dot products (every build with them; the AMX build uses its tiles
 * where the OS gives them): a prompt chunk's queries over the keys up to each one's own position, read
 * through the block table. K and V are packed once per call and kv head into the dot product's pair
 * layout: kt [key blocks of 16][D/2 pairs of dims][16 keys] (scores: lanes are 16 keys, each dot product
 * adds a pair of dims for them) and vp [key pairs][D] (P.V: lanes are 16 dims, each dot product adds a
 * pair of keys). A task is R rows of one query head: its scores S = Q K^T, 32 keys at a time, fp32, with
 * the running maximum and sum of each row (online softmax); P rounded to bf16 for P.V, as torch's flash
 * attention does; O in fp32 registers (R rows x D / 16). A row's maximum moves only when one of 32 scores
 * passes it by PX_SLACK (so P <= e^8, far inside fp32 and bf16): most steps skip the reduction and the
 * rescaling, and 32 keys that every row of the task sees take no causal mask. On a 2-core EPYC of family
 * 25 (512-bit ops in two halves) the two took 72 query rows over 1,400 cached keys from 165 to 300 GFLOP/s. */
static const uint16_t PX_LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};

/* Keys [t0, t0 + 16) of one kv head into kt (zero past ctx) and, for t0 even, their 8 pairs into vp. */
static void px_pack(const uint16_t* k_head, const uint16_t* v_head, const int64_t* table, int bs, int D, int ctx,
                    int t0, uint32_t* kt, uint32_t* vp) {
    const int real = ctx - t0 >= 16 ? 16 : ctx - t0;
    int rows[16] __attribute__((aligned(64))); /* each key's row, in dwords from the pool's start */
    for (int j = 0; j < 16; j++) {
        const int t = t0 + (j < real ? j : real - 1);
        rows[j] = (int)((table[t / bs] * bs + t % bs) * (D / 2));
    }
    const __m512i idx = _mm512_load_si512(rows);
    const __mmask16 live = real == 16 ? 0xffff : (__mmask16)((1u << real) - 1);
    uint32_t* kb = kt + (int64_t)(t0 / 16) * (D / 2) * 16;
    for (int p = 0; p < D / 2; p++)
        _mm512_store_si512(kb + p * 16,
                           _mm512_maskz_mov_epi32(live, _mm512_i32gather_epi32(idx, (const int*)k_head + p, 4)));
    const __m512i lo = _mm512_loadu_si512(PX_LO), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int j = 0; j < 16; j += 2) {
        const uint16_t* a = v_head + (int64_t)rows[j] * 2;
        const uint16_t* b = v_head + (int64_t)rows[j + 1] * 2;
        uint32_t* dst = vp + (int64_t)((t0 + j) / 2) * D;
        for (int d0 = 0; d0 < D; d0 += 32) {
            const __m512i va = j < real ? _mm512_loadu_si512(a + d0) : _mm512_setzero_si512();
            const __m512i vb = j + 1 < real ? _mm512_loadu_si512(b + d0) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + d0, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_storeu_si512(dst + d0 + 16, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
}

/* Rows i0 .. i0 + R - 1 of query head h (past the chunk's end: its last row, computed and not stored). */
#define PX_ROWS(NAME, R, NF)                                                                                      \
    static void NAME(const uint16_t* q, int64_t q_row, int64_t q_head, const uint32_t* kt, const uint32_t* vp,   \
                     int start, int n, int h, int i0, float scale, uint16_t* out, int64_t out_row) {              \
        enum { D = (NF) * 16 };                                                                                   \
        const uint32_t* qw[R];                                                                                    \
        int pos[R];                                                                                               \
        float m[R];                                                                                               \
        __m512 l[R], o[R][NF];                                                                                    \
        for (int r = 0; r < R; r++) {                                                                             \
            const int i = i0 + r < n ? i0 + r : n - 1;                                                            \
            qw[r] = (const uint32_t*)(q + (int64_t)i * q_row + (int64_t)h * q_head);                              \
            pos[r] = start + i;                                                                                   \
            m[r] = -INFINITY;                                                                                     \
            l[r] = _mm512_setzero_ps();                                                                           \
            for (int f = 0; f < NF; f++) o[r][f] = _mm512_setzero_ps();                                           \
        }                                                                                                         \
        const int last = pos[R - 1]; /* the block's furthest position */                                          \
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);              \
        const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);                            \
        uint32_t pw[R][PX_KEYS / 2] __attribute__((aligned(64))); /* P of each row, bf16 pairs of keys */         \
        for (int t0 = 0; t0 <= last; t0 += PX_KEYS) {                                                             \
            const int two = t0 + 16 <= last; /* the second 16 keys hold one some row sees */                      \
            const uint32_t* k0 = kt + (int64_t)(t0 / 16) * (D / 2) * 16;                                          \
            __m512 s0[R], s1[R];                                                                                  \
            for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_ps();                                      \
            for (int p = 0; p < D / 2; p++) {                                                                     \
                const __m512bh a0 = (__m512bh)_mm512_load_si512(k0 + p * 16);                                     \
                for (int r = 0; r < R; r++)                                                                       \
                    s0[r] = _mm512_dpbf16_ps(s0[r], a0, (__m512bh)_mm512_set1_epi32((int)qw[r][p]));              \
                if (two) {                                                                                        \
                    const __m512bh a1 = (__m512bh)_mm512_load_si512(k0 + (D / 2) * 16 + p * 16);                  \
                    for (int r = 0; r < R; r++)                                                                   \
                        s1[r] = _mm512_dpbf16_ps(s1[r], a1, (__m512bh)_mm512_set1_epi32((int)qw[r][p]));          \
                }                                                                                                 \
            }                                                                                                     \
            const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32(t0));                                   \
            const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));                                   \
            const int seen = t0 + PX_KEYS - 1 <= pos[0]; /* every row sees all 32 keys: no mask */             \
            for (int r = 0; r < R; r++) {                                                                         \
                __m512 v0 = _mm512_mul_ps(s0[r], vscale), v1 = _mm512_mul_ps(s1[r], vscale);                      \
                if (!seen) {                                                                                      \
                    const __m512i at = _mm512_set1_epi32(pos[r]);                                                 \
                    v0 = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(key0, at), ninf, v0);                       \
                    v1 = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(key1, at), ninf, v1);                       \
                }                                                                                                 \
                const __m512 vmax = _mm512_max_ps(v0, v1);                                                        \
                /* the running max moves only when a score passes it by PX_SLACK: exp(v - m) <= e^PX_SLACK */     \
                if (_mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m[r] + PX_SLACK), _CMP_GT_OQ)) {                      \
                    const float mnew = fmaxf(m[r], _mm512_reduce_max_ps(vmax));                                   \
                    const __m512 alpha = _mm512_set1_ps(expf(m[r] - mnew));                                       \
                    l[r] = _mm512_mul_ps(l[r], alpha);                                                            \
                    for (int f = 0; f < NF; f++) o[r][f] = _mm512_mul_ps(o[r][f], alpha);                         \
                    m[r] = mnew;                                                                                  \
                }                                                                                                 \
                const __m512 mv = _mm512_set1_ps(m[r]);                                                           \
                const __m512 p0 = exp512(_mm512_sub_ps(v0, mv)), p1 = exp512(_mm512_sub_ps(v1, mv));              \
                const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0); /* keys t0 .. t0 + 31 in order */                 \
                /* the sum over what P.V multiplies: P as rounded to bf16 */                                      \
                l[r] = _mm512_dpbf16_ps(l[r], pb, (__m512bh)_mm512_set1_epi32(0x3f803f80));                       \
                _mm512_store_si512(pw[r], (__m512i)pb);                                                           \
            }                                                                                                     \
            const int pairs = (last - t0 + 2) / 2 < PX_KEYS / 2 ? (last - t0 + 2) / 2 : PX_KEYS / 2;              \
            const uint32_t* v0p = vp + (int64_t)(t0 / 2) * D;                                                     \
            for (int i = 0; i < pairs; i++)                                                                       \
                for (int f = 0; f < NF; f++) {                                                                    \
                    const __m512bh b = (__m512bh)_mm512_loadu_si512(v0p + (int64_t)i * D + f * 16);               \
                    for (int r = 0; r < R; r++)                                                                   \
                        o[r][f] = _mm512_dpbf16_ps(o[r][f], b, (__m512bh)_mm512_set1_epi32((int)pw[r][i]));       \
                }                                                                                                 \
        }                                                                                                         \
        for (int r = 0; r < R && i0 + r < n; r++) {                                                               \
            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[r]));                                 \
            uint16_t* dst = out + (int64_t)(i0 + r) * out_row + (int64_t)h * D;                                   \
            for (int f = 0; f < NF; f++)                                                                          \
                _mm256_storeu_si256((__m256i*)(dst + f * 16),                                                     \
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[r][f], inv)));                    \
        }                                                                                                         \
    }
PX_ROWS(px_rows64, 4, 4)
PX_ROWS(px_rows128, 2, 8)

static int prefill_attn_avx512(const uint16_t* q, int64_t q_row, int64_t q_head, const uint16_t* k_pool,
                               const uint16_t* v_pool, int64_t pool_head, int bs, const int64_t* table, int start,
                               int n, int H, int KVH, int D, float scale, uint16_t* out, int64_t out_row,
                               int nthreads) {
    if ((D != 64 && D != 128) || n < 1 || KVH < 1 || H % KVH != 0 || pool_head / 2 > INT32_MAX) return -1;
    const int ctx = start + n, ctx_pad = (ctx + PX_KEYS - 1) / PX_KEYS * PX_KEYS, G = H / KVH, R = D == 64 ? 4 : 2;
    const int blocks16 = ctx_pad / 16, tiles = (n + R - 1) / R;
    const int64_t per_head = (int64_t)ctx_pad * D / 2; /* dwords of kt, and of vp, per kv head */
    uint32_t* packed = aligned_alloc(64, (size_t)2 * KVH * per_head * sizeof(uint32_t));
    if (packed == NULL) return -1;
    uint32_t *kt = packed, *vp = packed + KVH * per_head;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(static)
        for (int c = 0; c < KVH * blocks16; c++) {
            const int kh = c / blocks16, t0 = (c % blocks16) * 16;
            if (t0 < ctx)
                px_pack(k_pool + kh * pool_head, v_pool + kh * pool_head, table, bs, D, ctx, t0, kt + kh * per_head,
                        vp + kh * per_head);
            else { /* past the context: zeros, read by the last 32 keys' products */
                memset(kt + kh * per_head + (int64_t)(t0 / 16) * (D / 2) * 16, 0, (size_t)8 * D * sizeof(uint32_t));
                memset(vp + kh * per_head + (int64_t)(t0 / 2) * D, 0, (size_t)8 * D * sizeof(uint32_t));
            }
        }
#pragma omp for schedule(dynamic, 4)
        for (int task = 0; task < H * tiles; task++) { /* the last rows (most keys) first */
            const int h = task % H, i0 = (tiles - 1 - task / H) * R, kh = h / G;
            if (D == 64)
                px_rows64(q, q_row, q_head, kt + kh * per_head, vp + kh * per_head, start, n, h, i0, scale, out,
                          out_row);
            else
                px_rows128(q, q_row, q_head, kt + kh * per_head, vp + kh * per_head, start, n, h, i0, scale, out,
                           out_row);
        }
    }
    free(packed);
    return 0;
}

/* q: row i of head h at q[i * q_row + h * q_head], D contiguous; k_pool, v_pool: one layer's [KVH, blocks,
 * bs, D], kv head kh at kh * pool_head; table: the chunk's block ids up to position start + n - 1; out:
 * row i of head h at out[i * out_row + h * D]. AMX tiles where the build has them and the OS gives them
 * (block sizes a multiple of 16), else AVX-512 BF16 dot products. Returns 0, or -1 where it cannot run (a
 * head dim other than 64 and 128, or H not a multiple of KVH): the caller computes it another way. */
int pdserve_prefill_attn_bf16(const uint16_t* q, int64_t q_row, int64_t q_head, const uint16_t* k_pool,
                              const uint16_t* v_pool, int64_t pool_head, int bs, const int64_t* table, int start,
                              int n, int H, int KVH, int D, float scale, uint16_t* out, int64_t out_row,
                              int nthreads) {
#ifdef HAVE_AMX
    if (prefill_attn_amx(q, q_row, q_head, k_pool, v_pool, pool_head, bs, table, start, n, H, KVH, D, scale, out,
                         out_row, nthreads) == 0)
        return 0;
#endif
    return prefill_attn_avx512(q, q_row, q_head, k_pool, v_pool, pool_head, bs, table, start, n, H, KVH, D, scale,
                               out, out_row, nthreads);
}

/* Whether the kernel should also take prompts with no cached context (whole prompts, first chunks):
 * torch's flash attention computes them as fast on AMX tiles (within 1% at 200-2,000 tokens on a 2-core
 * Xeon), and without them 3.5x slower than these dot products (one layer of a 1,024-token bf16 prompt,
 * 9 heads of 64 over 3; 2.6x at 32 heads of 128 over 8; a 2-core AVX-512 BF16 EPYC). */
int pdserve_prefill_attn_whole(void) {
#ifdef HAVE_AMX
    if (amx_request()) return 0;
#endif
    return 1;
}

static void linear_bf16_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int M,
                             int N, int K, int n_start, int nthreads);

/* More rows: torch's linear (prefill). On a 2-core Xeon, a decode step's linear layers of the embedded
 * model: on AMX tiles 0.68 / 0.90 / 1.21x of F.linear's time at 32 / 64 / 128 rows (0.45x and 0.80x
 * of oneDNN's packed weights at 1 and 16 rows); with the dot products alone 0.88 / 1.66x at 8 / 16. */
int pdserve_linear_bf16_max_rows(void) {
#ifdef HAVE_AMX
    if (amx_request()) return 64; /* (the OS may refuse the tiles: then the dot products serve) */
#endif
    return 8;
}

void pdserve_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int M, int N,
                         int K, int nthreads) {
#ifdef HAVE_AMX
    if (M > AMX_MIN_ROWS && K % 32 == 0 && N >= 32 && amx_request()) {
        linear_bf16_amx(x, w, bias, y, M, N, K, nthreads);
        linear_bf16_rows(x, w, bias, y, M, N, K, N / 32 * 32, nthreads);
        return;
    }
#endif
    linear_bf16_rows(x, w, bias, y, M, N, K, 0, nthreads);
}

/* Rows [n_start, N) of w on the AVX-512 tiles. */
static void linear_bf16_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int M,
                             int N, int K, int n_start, int nthreads) {
    const int first = n_start / LINB_NB, blocks = N / LINB_NB;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && blocks - first > 8)
    for (int b = first; b < blocks; b++) {
        int m = 0;
        for (; m + 4 <= M; m += 4) linb_tile4(x, w, bias, y, m, b * LINB_NB, N, K);
        if (M - m == 3) linb_tile3(x, w, bias, y, m, b * LINB_NB, N, K);
        else if (M - m == 2) linb_tile2(x, w, bias, y, m, b * LINB_NB, N, K);
        else if (M - m == 1) linb_tile1(x, w, bias, y, m, b * LINB_NB, N, K);
    }
    for (int n = blocks * LINB_NB > n_start ? blocks * LINB_NB : n_start; n < N; n++) /* past the last block */
        for (int m = 0; m < M; m++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += bf16_load(x[(int64_t)m * K + k]) * bf16_load(w[(int64_t)n * K + k]);
            y[(int64_t)m * N + n] = bf16_store(s + (bias ? bf16_load(bias[n]) : 0.0f));
        }
}

/* Linear layers on a blocked weight, bf16 (fp32 accumulation, rounded once to bf16): y[M, N] = x[M, K]
 * w^T (+ bias[N]) with w laid out once as wb[ceil(N/16)][ceil(K/2)][16][2] (`engine.packed_linear.
 * blocked`: 16 output columns by a pair of K per 64-byte row, zeros past N and K; the pair order of a
 * dot product). One dot product takes a pair of x broadcast and a row of wb: 16 columns times 2 of K,
 * no horizontal sums. A tile holds BLK_MR rows of x by BLK_NR blocks of columns (24 accumulators in
 * registers); the BLK_NR rows of wb a step of K loads serve all BLK_MR rows of x. Threads split the
 * blocks of columns; rows go BLK_MB at a time so a prompt chunk's rows stay in cache while each
 * thread's blocks stream past them. Any M: prefill's rows too (as fast as oneDNN's packed weights at
 * 256-2048 rows on a 2-core EPYC, 1.4-3x faster at 4-16). */
#define BLK_MR 6
#define BLK_NR 4
#define BLK_MB 64
#define BLK_TILE(MR, NR)                                                                                   \
    static void blk_tile_##MR##_##NR(const uint16_t* x, const uint16_t* wb, const uint16_t* bias,          \
                                     uint16_t* y, int m0, int nb0, int N, int K) {                         \
        const int K2 = (K + 1) / 2, pairs = K / 2;                                                         \
        __m512 acc[MR][NR];                                                                                \
        const uint16_t* wr[NR];                                                                            \
        for (int j = 0; j < NR; j++) wr[j] = wb + (int64_t)(nb0 + j) * K2 * 32;                           \
        for (int i = 0; i < MR; i++)                                                                       \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();                                  \
        for (int kp = 0; kp < pairs; kp++) {                                                               \
            __m512i wv[NR];                                                                                \
            for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_si512(wr[j] + kp * 32);                      \
            for (int i = 0; i < MR; i++) {                                                                 \
                int32_t xp;                                                                                \
                memcpy(&xp, x + (int64_t)(m0 + i) * K + 2 * kp, 4);                                        \
                const __m512i xb = _mm512_set1_epi32(xp);                                                  \
                for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xb, (__m512bh)wv[j]); \
            }                                                                                              \
        }                                                                                                  \
        if (K & 1) { /* the last pair holds one element of K (its other half is zero in wb and in xb) */   \
            __m512i wv[NR];                                                                                \
            for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_si512(wr[j] + pairs * 32);                   \
            for (int i = 0; i < MR; i++) {                                                                 \
                const __m512i xb = _mm512_set1_epi32((int32_t)x[(int64_t)(m0 + i) * K + K - 1]);           \
                for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xb, (__m512bh)wv[j]); \
            }                                                                                              \
        }                                                                                                  \
        for (int j = 0; j < NR; j++) {                                                                     \
            const int n0 = (nb0 + j) * 16, left = N - n0;                                                  \
            const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);        \
            __m512 b = _mm512_setzero_ps();                                                                \
            if (bias)                                                                                      \
                b = _mm512_castsi512_ps(                                                                   \
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16)); \
            for (int i = 0; i < MR; i++)                                                                   \
                _mm256_mask_storeu_epi16(y + (int64_t)(m0 + i) * N + n0, mask,                             \
                                         (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b)));        \
        }                                                                                                  \
    }
#define BLK_ROWS(NR) BLK_TILE(1, NR) BLK_TILE(2, NR) BLK_TILE(3, NR) BLK_TILE(4, NR) BLK_TILE(5, NR) BLK_TILE(6, NR)
BLK_ROWS(1)
BLK_ROWS(2)
BLK_ROWS(3)
BLK_ROWS(4)
/* Rows [m0, m1) of x by the NR blocks of columns from nb0: tiles of BLK_MR rows, then the rest. */
#define BLK_PANEL(NR)                                                                                      \
    static void blk_panel_##NR(const uint16_t* x, const uint16_t* wb, const uint16_t* bias, uint16_t* y,    \
                               int m0, int m1, int nb0, int N, int K) {                                    \
        int m = m0;                                                                                        \
        for (; m + BLK_MR <= m1; m += BLK_MR) blk_tile_6_##NR(x, wb, bias, y, m, nb0, N, K);               \
        switch (m1 - m) {                                                                                  \
            case 5: blk_tile_5_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 4: blk_tile_4_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 3: blk_tile_3_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 2: blk_tile_2_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            case 1: blk_tile_1_##NR(x, wb, bias, y, m, nb0, N, K); break;                                  \
            default: break;                                                                                \
        }                                                                                                  \
    }
BLK_PANEL(1)
BLK_PANEL(2)
BLK_PANEL(3)
BLK_PANEL(4)

void pdserve_linear_bf16_blocked(const uint16_t* x, const uint16_t* wb, const uint16_t* bias, uint16_t* y, int M,
                                 int N, int K, int nthreads) {
    const int blocks = (N + 15) / 16;
    if (nthreads > blocks) nthreads = blocks > 0 ? blocks : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
    for (int t = 0; t < nthreads; t++) {
        const int b0 = (int)((int64_t)blocks * t / nthreads), b1 = (int)((int64_t)blocks * (t + 1) / nthreads);
        for (int m0 = 0; m0 < M; m0 += BLK_MB) {
            const int m1 = M - m0 > BLK_MB ? m0 + BLK_MB : M;
            int b = b0;
            for (; b + BLK_NR <= b1; b += BLK_NR) blk_panel_4(x, wb, bias, y, m0, m1, b, N, K);
            switch (b1 - b) {
                case 3: blk_panel_3(x, wb, bias, y, m0, m1, b, N, K); break;
                case 2: blk_panel_2(x, wb, bias, y, m0, m1, b, N, K); break;
                case 1: blk_panel_1(x, wb, bias, y, m0, m1, b, N, K); break;
                default: break;
            }
        }
    }
}
#endif

/* Greedy decoding's pick: the index of each row's first maximum, as torch.max(x, dim=-1) gives it (a NaN, the
 * first one, beats every number). Two passes over a row: its maximum (NaNs noted on the way), then the first lane
 * equal to it; a row is a vocabulary of logits, in L2 after the LM head wrote it. The builds with AVX2 or AVX-512
 * (the portable build has none: a scalar loop is no faster than torch's), on the widest vectors the build has:
 * AM_W lanes of am_vec; am_nan / am_eq give a bit per lane. */
#if defined(HAVE_AVX512)
#define AM_W 16
typedef __m512 am_vec;
static inline am_vec am_splat(float x) { return _mm512_set1_ps(x); }
static inline am_vec am_max(am_vec a, am_vec b) { return _mm512_max_ps(a, b); }
static inline unsigned am_nan(am_vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
static inline unsigned am_eq(am_vec a, am_vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline float am_hmax(am_vec v) { return _mm512_reduce_max_ps(v); }
#define am_ld_f32 _mm512_loadu_ps
#define am_ld_bf16 bf16x16_to_f32
#elif defined(HAVE_AVX2)
#define AM_W 8
typedef __m256 am_vec;
static inline am_vec am_splat(float x) { return _mm256_set1_ps(x); }
static inline am_vec am_max(am_vec a, am_vec b) { return _mm256_max_ps(a, b); }
static inline unsigned am_nan(am_vec v) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
static inline unsigned am_eq(am_vec a, am_vec b) {
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ));
}
static inline float am_hmax(am_vec v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    float m = lanes[0];
    for (int j = 1; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    return m;
}
#define am_ld_f32 _mm256_loadu_ps
#define am_ld_bf16 ld8_bf16
#endif

#ifdef AM_W
#define ARGMAX_ROWS(NAME, T, LOAD, LDV)                                                                    \
    static int64_t NAME##_row(const T* x, int64_t n) {                                                     \
        am_vec m = am_splat(-INFINITY);                                                                    \
        unsigned nan = 0;                                                                                  \
        int64_t i = 0;                                                                                     \
        for (; i + AM_W <= n; i += AM_W) {                                                                 \
            const am_vec v = LDV(x + i);                                                                   \
            nan |= am_nan(v);                                                                              \
            m = am_max(m, v); /* a NaN lane may come through: the NaN path below then decides */           \
        }                                                                                                  \
        float mx = am_hmax(m);                                                                             \
        for (int64_t j = i; j < n; j++) {                                                                  \
            const float v = LOAD(x[j]);                                                                    \
            if (v != v) nan = 1;                                                                           \
            else if (v > mx) mx = v;                                                                       \
        }                                                                                                  \
        if (nan) {                                                                                         \
            for (i = 0; i < n; i++)                                                                        \
                if (LOAD(x[i]) != LOAD(x[i])) return i;                                                    \
        }                                                                                                  \
        const am_vec t = am_splat(mx);                                                                     \
        for (i = 0; i + AM_W <= n; i += AM_W) {                                                            \
            const unsigned k = am_eq(LDV(x + i), t);                                                       \
            if (k) return i + __builtin_ctz(k);                                                            \
        }                                                                                                  \
        for (; i < n; i++)                                                                                 \
            if (LOAD(x[i]) == mx) return i;                                                                \
        return 0; /* every lane -inf: the first */                                                         \
    }                                                                                                      \
    /* out[r]: the first maximum's index in row r (`rows` rows of `cols` logits, `stride` elements apart) */ \
    void pdserve_##NAME(const T* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out) {            \
        for (int64_t r = 0; r < rows; r++) out[r] = NAME##_row(x + r * stride, cols);                      \
    }
ARGMAX_ROWS(argmax_f32, float, f32_load, am_ld_f32)
ARGMAX_ROWS(argmax_bf16, uint16_t, bf16_load, am_ld_bf16)
#endif

/* The pointwise parts of a decoder layer that torch runs as several operators each, one pass apiece: RMSNorm
 * (transformers' Llama form: y = w * round(x * rsqrt(mean(x^2) + eps)), the statistics in fp32, `round` to the
 * tensor's dtype) and a gated MLP's SiLU(gate) * up (SiLU rounded to the dtype before the product, as torch's two
 * operators round). Eager steps (prompts, prompt chunks, mixed steps) call them; a compiled decode step fuses its
 * own. Rows (RMSNorm) or PW_CHUNK elements (SiLU * up) split over the threads. The builds with AVX2 or AVX-512,
 * on their widest vectors: PW_W lanes of pw_vec; a scalar loop takes what is left of a row. */
#define PW_EXP_MAX 88.3f /* the largest x whose e^x both vector exps build (2^127 at most) */
static inline float silu1(float a) { return a / (1.f + expf(-a)); } /* torch's: -0 where e^-a passes fp32 */
/* s[j] = silu1(a[j]) for the lanes j set in `far` (those below -PW_EXP_MAX: rare), of a vector of w stored in s, a */
static inline void silu_far(float* s, const float* a, unsigned far, int w) {
    for (int j = 0; j < w; j++)
        if (far >> j & 1u) s[j] = silu1(a[j]);
}
#if defined(HAVE_AVX512)
#define PW_W 16
typedef __m512 pw_vec;
static inline pw_vec pw_splat(float x) { return _mm512_set1_ps(x); }
static inline pw_vec pw_mul(pw_vec a, pw_vec b) { return _mm512_mul_ps(a, b); }
static inline pw_vec pw_fmadd(pw_vec a, pw_vec b, pw_vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float pw_hsum(pw_vec v) { return _mm512_reduce_add_ps(v); }
static inline pw_vec pw_silu(pw_vec a) { /* a / (1 + e^-a); lanes below -PW_EXP_MAX (rare) as silu1 */
    const pw_vec e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), _mm512_set1_ps(PW_EXP_MAX)));
    const pw_vec s = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    const unsigned far = _mm512_cmp_ps_mask(a, _mm512_set1_ps(-PW_EXP_MAX), _CMP_LT_OQ);
    if (!far) return s;
    float av[16], sv[16];
    _mm512_storeu_ps(av, a);
    _mm512_storeu_ps(sv, s);
    silu_far(sv, av, far, 16);
    return _mm512_loadu_ps(sv);
}
static inline pw_vec pw_rnd_bf16(pw_vec x) { /* x rounded to bf16 (nearest even), kept in fp32; NaN kept */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                                       _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}
#define pw_ld_f32 _mm512_loadu_ps
#define pw_st_f32 _mm512_storeu_ps
#define pw_ld_bf16 bf16x16_to_f32
#define pw_st_bf16 st16_bf16
#elif defined(HAVE_AVX2)
#define PW_W 8
typedef __m256 pw_vec;
static inline pw_vec pw_splat(float x) { return _mm256_set1_ps(x); }
static inline pw_vec pw_mul(pw_vec a, pw_vec b) { return _mm256_mul_ps(a, b); }
static inline pw_vec pw_fmadd(pw_vec a, pw_vec b, pw_vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float pw_hsum(pw_vec v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
static inline pw_vec pw_silu(pw_vec a) {
    const pw_vec e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), _mm256_set1_ps(PW_EXP_MAX)));
    const pw_vec s = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    const unsigned far = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(-PW_EXP_MAX), _CMP_LT_OQ));
    if (!far) return s;
    float av[8], sv[8];
    _mm256_storeu_ps(av, a);
    _mm256_storeu_ps(sv, s);
    silu_far(sv, av, far, 8);
    return _mm256_loadu_ps(sv);
}
static inline pw_vec pw_rnd_bf16(pw_vec x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
                                       _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#define pw_ld_f32 ld8_f32
#define pw_st_f32 st8_f32
#define pw_ld_bf16 ld8_bf16
#define pw_st_bf16 st8_bf16
#endif

#ifdef PW_W
#define PW_CHUNK 4096 /* SiLU * up: elements a thread takes at a time */
static inline pw_vec pw_rnd_f32(pw_vec x) { return x; }
static inline float rnd_f32(float x) { return x; }
static inline float rnd_bf16(float x) { return bf16_load(bf16_store(x)); }
#define POINTWISE(SFX, T, LOAD, STORE)                                                                     \
    void pdserve_rms_norm_##SFX(const T* x, const T* w, T* y, int64_t rows, int64_t cols, float eps,       \
                                int nthreads) {                                                            \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows > 1)")   \
        for (int64_t r = 0; r < rows; r++) {                                                               \
            const T* xr = x + r * cols;                                                                    \
            T* yr = y + r * cols;                                                                          \
            pw_vec acc = pw_splat(0.f);                                                                    \
            int64_t i = 0;                                                                                 \
            for (; i + PW_W <= cols; i += PW_W) {                                                          \
                const pw_vec v = pw_ld_##SFX(xr + i);                                                      \
                acc = pw_fmadd(v, v, acc);                                                                 \
            }                                                                                              \
            float ss = pw_hsum(acc);                                                                       \
            for (; i < cols; i++) ss += LOAD(xr[i]) * LOAD(xr[i]);                                         \
            const float inv = 1.0f / sqrtf(ss / (float)cols + eps);                                        \
            const pw_vec vinv = pw_splat(inv);                                                             \
            for (i = 0; i + PW_W <= cols; i += PW_W)                                                       \
                pw_st_##SFX(yr + i, pw_mul(pw_ld_##SFX(w + i), pw_rnd_##SFX(pw_mul(pw_ld_##SFX(xr + i), vinv)))); \
            for (; i < cols; i++) yr[i] = STORE(LOAD(w[i]) * rnd_##SFX(LOAD(xr[i]) * inv));                \
        }                                                                                                  \
    }                                                                                                      \
    void pdserve_silu_mul_##SFX(const T* gate, const T* up, T* y, int64_t n, int nthreads) {              \
        const int64_t chunks = (n + PW_CHUNK - 1) / PW_CHUNK;                                              \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && chunks > 1)") \
        for (int64_t c = 0; c < chunks; c++) {                                                             \
            const int64_t hi = (c + 1) * PW_CHUNK < n ? (c + 1) * PW_CHUNK : n;                            \
            int64_t i = c * PW_CHUNK;                                                                      \
            for (; i + PW_W <= hi; i += PW_W)                                                              \
                pw_st_##SFX(y + i, pw_mul(pw_rnd_##SFX(pw_silu(pw_ld_##SFX(gate + i))), pw_ld_##SFX(up + i))); \
            for (; i < hi; i++) y[i] = STORE(rnd_##SFX(silu1(LOAD(gate[i]))) * LOAD(up[i]));               \
        }                                                                                                  \
    }
POINTWISE(f32, float, f32_load, f32_store)
POINTWISE(bf16, uint16_t, bf16_load, bf16_store)
#endif

/* The widest vector path compiled into this build: the loader checks it is the build it asked for. */
const char* pdserve_kernel_isa(void) {
#if defined(HAVE_AMX)
    return "amx_bf16";
#elif defined(HAVE_AVX512_BF16)
    return "avx512_bf16";
#elif defined(HAVE_AVX512)
    return "avx512";
#elif defined(HAVE_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}
