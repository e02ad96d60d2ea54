/* Weight-only quantized matrix-vector products for decode steps on the CPU (kvblend.model.quant_kernels).
 *
 * A decode step multiplies a few rows of activations by every weight of the model, so it is bound by the
 * bytes the weights take, provided the kernel unpacks them faster than memory delivers them. torch 2.13's
 * CPU kernels for int4 and int8 weights do not (a 1,536 x 576 product: fp32 71 us, int8 520 us, int4 793 us
 * on a 2-core AMD EPYC), so these two read GGUF's own block layouts at the speed of the bytes:
 *
 *   Q4_1: 32 consecutive input weights share a scale d and a minimum m, w = d*q + m, q in 0..15; byte j of a
 *         block holds q[j] in its low nibble and q[j + 16] in its high one (GGUF's order).
 *   Q8_0: 32 consecutive input weights share a scale d, w = d*q, q in -128..127.
 *   Q8_16: Q8_0's codes with a scale per 16 input weights: how GGUF's Q6_K (a scale per 16, 6-bit codes) is
 *         multiplied exactly (kvblend.model.gguf_blocks re-expresses Q4_K as Q4_1, Q4_0/Q5_0 as Q8_0).
 *
 * Activations and accumulation stay in fp32: the products are those of the de-quantised fp32 weights, up to
 * the order of the sums. Scales are fp32 (GGUF keeps fp16 ones; each converts exactly).
 *
 * y[r, n] = sum_k x[r, k] * w[n, k] for r < rows, n < n_out; x is [rows, n_in] and y [rows, n_out], both
 * contiguous; n_in is a multiple of 32. Output rows are shared among `threads` OpenMP threads: the process's
 * own OpenMP runtime, torch's, since libgomp.so.1 is loaded by torch before this library.
 *
 * Built on first use with the machine's C compiler and -march=native, so the AVX-512 or AVX2 path below is
 * the one this CPU runs; a plain C loop otherwise.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define BLOCK 32
#define MAX_ROWS 8 /* rows handled together, so each block is unpacked once for all of them */

int kvb_kernel_version(void) { return 1; }

/* ---------------------------------------------------------------------------------------------------------
 * The vector width this build has, and the few operations both kernels are written in: VW floats a vector.
 * KVB_F16: 16-bit floats can be widened (AVX-512F has it; AVX2 machines need F16C).
 */
#if defined(__AVX512F__)
#define VW 16
#define KVB_F16 1
typedef __m512 vf;
static inline vf v_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_storef(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf v_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf v_set1(float a) { return _mm512_set1_ps(a); }
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); } /* b where either is NaN */
static inline vf v_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline vf v_pow2(vf n) { /* 2^n for whole n in -127..127, built in the exponent bits */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
/* A block's 32 codes as floats in block order: Q4_1's low nibbles are its first 16, the high ones the rest. */
static inline void unpack_q4_1(const uint8_t *b, vf q[BLOCK / VW]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)b), low4 = _mm_set1_epi8(0x0F);
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
}
static inline void unpack_q8_0(const int8_t *b, vf q[BLOCK / VW]) {
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b)));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16))));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#if defined(__F16C__)
#define KVB_F16 1
#endif
typedef __m256 vf;
static inline vf v_loadf(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_storef(float *p, vf a) { _mm256_storeu_ps(p, a); }
#ifdef KVB_F16
static inline vf v_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif
static inline vf v_set1(float a) { return _mm256_set1_ps(a); }
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); } /* b where either is NaN */
static inline vf v_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_pow2(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline float v_sum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline void unpack_q4_1(const uint8_t *b, vf q[BLOCK / VW]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)b), low4 = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
static inline void unpack_q8_0(const int8_t *b, vf q[BLOCK / VW]) {
    __m128i b0 = _mm_loadu_si128((const __m128i *)b), b1 = _mm_loadu_si128((const __m128i *)(b + 16));
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
}
#endif

/* 1 where this build has a vector path (AVX-512, or AVX2 with FMA): without one the plain C loops below are
 * slower than torch's kernels, and the library is not used (kvblend.model.quant_kernels). */
int kvb_simd(void) {
#ifdef VW
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------------------------
 * The products.
 */

/* Per row r and block g: the sum of the block's activations (the minimum's factor in Q4_1). */
static void block_sums(const float *x, int rows, int n_in, float *sums) {
    int groups = n_in / BLOCK;
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < groups; g++) {
            float s = 0.f;
            for (int j = 0; j < BLOCK; j++) s += x[(int64_t)r * n_in + g * BLOCK + j];
            sums[r * groups + g] = s;
        }
}

/* The block formats a kvb_linear holds (its `format`). */
#define KVB_Q8_0 0
#define KVB_Q4_1 1
#define KVB_Q8_16 2

/* One output row n for `rows` (<= MAX_ROWS) activation rows, of Q4_1 (with its minimums m and the activations'
 * block sums), Q8_0 or Q8_16. Inlined with `fmt` a constant, so each format gets its own loop. */
static inline __attribute__((always_inline)) void quant_row(const float *x, int rows, int n_in, const uint8_t *codes,
                                                          int fmt, const float *d, const float *m, const float *sums,
                                                          int n, int n_out, float *y) {
    int groups = n_in / BLOCK, block_bytes = fmt == KVB_Q4_1 ? BLOCK / 2 : BLOCK;
    int scales = fmt == KVB_Q8_16 ? 2 : 1; /* per block */
    const uint8_t *c = codes + (int64_t)n * groups * block_bytes;
    const float *dn = d + (int64_t)n * groups * scales;
#ifdef VW
    vf acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = v_zero();
    for (int g = 0; g < groups; g++) {
        vf q[BLOCK / VW];
        if (fmt == KVB_Q4_1)
            unpack_q4_1(c + g * block_bytes, q);
        else
            unpack_q8_0((const int8_t *)c + g * block_bytes, q);
        if (fmt == KVB_Q8_16) { /* each half of the block (BLOCK / VW / 2 vectors) under its own scale */
            enum { H = BLOCK / VW / 2 };
            vf s0 = v_set1(dn[2 * g]), s1 = v_set1(dn[2 * g + 1]);
            for (int r = 0; r < rows; r++) {
                const float *xr = x + (int64_t)r * n_in + g * BLOCK;
                vf t0 = v_mul(q[0], v_loadf(xr)), t1 = v_mul(q[H], v_loadf(xr + H * VW));
                for (int i = 1; i < H; i++) {
                    t0 = v_fma(q[i], v_loadf(xr + i * VW), t0);
                    t1 = v_fma(q[H + i], v_loadf(xr + (H + i) * VW), t1);
                }
                acc[r] = v_fma(s1, t1, v_fma(s0, t0, acc[r]));
            }
            continue;
        }
        vf scale = v_set1(dn[g]);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (int64_t)r * n_in + g * BLOCK;
            vf t = v_mul(q[0], v_loadf(xr));
            for (int i = 1; i < BLOCK / VW; i++) t = v_fma(q[i], v_loadf(xr + i * VW), t);
            acc[r] = v_fma(scale, t, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float s = v_sum(acc[r]);
        if (fmt == KVB_Q4_1)
            for (int g = 0; g < groups; g++) s += m[(int64_t)n * groups + g] * sums[r * groups + g];
        y[(int64_t)r * n_out + n] = s;
    }
#else
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * n_in;
        float s = 0.f;
        for (int g = 0; g < groups; g++) {
            const uint8_t *b = c + g * block_bytes;
            float t[2] = {0.f, 0.f};
            for (int j = 0; j < BLOCK; j++) {
                float q = fmt == KVB_Q4_1 ? (float)(j < 16 ? b[j] & 0x0F : b[j - 16] >> 4) : (float)((const int8_t *)b)[j];
                t[fmt == KVB_Q8_16 && j >= 16] += q * xr[g * BLOCK + j];
            }
            if (fmt == KVB_Q8_16)
                s += dn[2 * g] * t[0] + dn[2 * g + 1] * t[1];
            else
                s += dn[g] * t[0] + (fmt == KVB_Q4_1 ? m[(int64_t)n * groups + g] * sums[r * groups + g] : 0.f);
        }
        y[(int64_t)r * n_out + n] = s;
    }
#endif
}

/* A weight in Q4_1, Q8_0 or Q8_16 blocks (`format`), as the products and a decode step read it. */
typedef struct {
    const void *codes; /* Q4_1 nibbles [n_out, n_in/2], or Q8_0/Q8_16 codes [n_out, n_in] */
    const float *d;    /* scales [n_out, n_in/32] (Q8_16: [n_out, n_in/16]) */
    const float *m;    /* Q4_1's minimums [n_out, n_in/32]; NULL otherwise */
    int32_t format, n_in, n_out, unused;
} kvb_linear;

/* outs[j] = x @ W_j.T for `count` products of one input of `rows` (<= MAX_ROWS) rows, output rows shared among
 * the threads as one range (a decode step's q, k and v: 960 rows for SmolLM2, rather than three rounds of 576,
 * 192 and 192). */
static int products(const float *x, int rows, const kvb_linear *const *lins, float *const *outs, int count,
                    int threads) {
    int n_in = lins[0]->n_in, groups = n_in / BLOCK, total = 0, any_q4 = 0;
    for (int j = 0; j < count; j++) {
        total += lins[j]->n_out;
        any_q4 |= lins[j]->format == KVB_Q4_1;
    }
    float *sums = NULL;
    if (any_q4) {
        sums = malloc(sizeof(float) * (size_t)rows * groups);
        if (!sums) return -1;
        block_sums(x, rows, n_in, sums);
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int i = 0; i < total; i++) {
        int j = 0, n = i;
        while (n >= lins[j]->n_out) n -= lins[j++]->n_out;
        const kvb_linear *L = lins[j];
        if (L->format == KVB_Q4_1)
            quant_row(x, rows, n_in, L->codes, KVB_Q4_1, L->d, L->m, sums, n, L->n_out, outs[j]);
        else if (L->format == KVB_Q8_16)
            quant_row(x, rows, n_in, L->codes, KVB_Q8_16, L->d, NULL, NULL, n, L->n_out, outs[j]);
        else
            quant_row(x, rows, n_in, L->codes, KVB_Q8_0, L->d, NULL, NULL, n, L->n_out, outs[j]);
    }
    free(sums);
    return 0;
}

/* y = x @ W.T for W in blocks of `format`, in passes of MAX_ROWS rows. */
static int quant_gemv(const float *x, int rows, int n_in, const uint8_t *codes, int format, const float *d,
                      const float *m, int n_out, float *y, int threads) {
    const kvb_linear w = {codes, d, m, format, n_in, n_out, 0};
    const kvb_linear *lins[1] = {&w};
    for (int r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        float *out[1] = {y + (int64_t)r0 * n_out};
        int rr = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
        if (products(x + (int64_t)r0 * n_in, rr, lins, out, 1, threads) != 0) return -1;
    }
    return 0;
}

int kvb_q4_1_gemv(const float *x, int rows, int n_in, const uint8_t *codes, const float *d, const float *m,
                  int n_out, float *y, int threads) {
    return quant_gemv(x, rows, n_in, codes, KVB_Q4_1, d, m, n_out, y, threads);
}

int kvb_q8_0_gemv(const float *x, int rows, int n_in, const int8_t *codes, const float *d, int n_out, float *y,
                  int threads) {
    return quant_gemv(x, rows, n_in, (const uint8_t *)codes, KVB_Q8_0, d, NULL, n_out, y, threads);
}

int kvb_q8_16_gemv(const float *x, int rows, int n_in, const int8_t *codes, const float *d, int n_out, float *y,
                   int threads) {
    return quant_gemv(x, rows, n_in, (const uint8_t *)codes, KVB_Q8_16, d, NULL, n_out, y, threads);
}

/* ---------------------------------------------------------------------------------------------------------
 * Decode attention: one query per head at the newest position, over a layer's K/V buffer, in fp32 or fp16.
 *
 * q is [heads, hd] fp32; K and V are [kv_heads, capacity, hd] (fp32, or fp16 bits), of which the first n_keys
 * positions are attended; query head i reads kv head i / (heads / kv_heads) (GQA). out is [heads, hd] fp32.
 * The keys are split into chunks of CHUNK, one task per (kv head, chunk) shared among the threads, each
 * keeping a running maximum, sum and weighted V for its query heads (flash-decoding), merged at the end: a
 * 16-bit buffer is read once, widened in registers, instead of widened into a copy.
 * Returns 0, or -1 where this build cannot (no vector path, an AVX2 CPU without F16C, hd not a multiple
 * of 16, too many query heads per KV head).
 */
#define CHUNK 256
#define MAX_GROUP 16

/* F16C for the fp16 K/V a decode step writes (every AVX-512 CPU has it; a bare -mavx512f build does not). */
#if defined(VW) && defined(KVB_F16) && defined(__F16C__)
#define KVB_ATTENTION 1
static inline vf v_load(const void *base, int64_t i, int half) {
    return half ? v_load_f16((const uint16_t *)base + i) : v_loadf((const float *)base + i);
}
/* exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial, within 2 ulp of libm's. */
static inline vf v_exp(vf x) {
    x = v_max(v_set1(-87.0f), x); /* NaN in x stays NaN */
    vf n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    vf r = v_fnma(n, v_set1(0.693359375f), x);
    r = v_fnma(n, v_set1(-2.12194440e-4f), r);
    vf p = v_set1(1.9875691500e-4f);
    p = v_fma(p, r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    p = v_fma(p, v_mul(r, r), v_add(r, v_set1(1.0f)));
    return v_mul(p, v_pow2(n));
}
#endif

#ifdef KVB_ATTENTION
/* The weighted sum of n value rows (hd apart, from `at`) for each query head j (weights s[j]), over NC vectors
 * of each row: pacc[j * hd + c * VW ...] for c < NC. A run of NC vectors keeps group * NC independent sums,
 * where one vector at a time kept `group`, each waiting on its last FMA's latency at every key. */
#define V_RUN 4
static inline __attribute__((always_inline)) void weigh_values(const void *v, int half, int64_t at, int hd, int n,
                                                             float s[][CHUNK], int group, const int NC, float *pacc) {
    vf acc[MAX_GROUP][V_RUN];
    for (int j = 0; j < group; j++)
        for (int c = 0; c < NC; c++) acc[j][c] = v_zero();
    for (int t = 0; t < n; t++) {
        vf vv[V_RUN];
        for (int c = 0; c < NC; c++) vv[c] = v_load(v, at + (int64_t)t * hd + c * VW, half);
        for (int j = 0; j < group; j++) {
            vf w = v_set1(s[j][t]);
            for (int c = 0; c < NC; c++) acc[j][c] = v_fma(w, vv[c], acc[j][c]);
        }
    }
    for (int j = 0; j < group; j++)
        for (int c = 0; c < NC; c++) v_storef(pacc + (int64_t)j * hd + c * VW, acc[j][c]);
}

/* One task: kv head h, keys [t0, t1), for its `group` query heads; writes their max, sum and weighted V. */
static inline __attribute__((always_inline)) void
attend_chunk_g(const float *q, const void *k, const void *v, int half, int64_t head_stride, int h, int t0, int t1,
               int group, int hd, float scale, float *pm, float *pl, float *pacc) {
    float s[MAX_GROUP][CHUNK];
    int n = t1 - t0;
    if (n <= 0) return; /* never: every chunk holds a key */
    const int64_t base = (int64_t)h * head_stride;
    for (int t = 0; t < n; t++) {
        int64_t row = base + (int64_t)(t0 + t) * hd;
        vf acc[MAX_GROUP];
        for (int j = 0; j < group; j++) acc[j] = v_zero();
        for (int d0 = 0; d0 < hd; d0 += VW) {
            vf kk = v_load(k, row + d0, half);
            for (int j = 0; j < group; j++) acc[j] = v_fma(kk, v_load(q + (int64_t)(h * group + j) * hd, d0, 0), acc[j]);
        }
        for (int j = 0; j < group; j++) s[j][t] = v_sum(acc[j]) * scale;
    }
    for (int j = 0; j < group; j++) {
        float m = s[j][0];
        for (int t = 1; t < n; t++) m = s[j][t] > m ? s[j][t] : m;
        int t = 0;
        vf lsum = v_zero();
        for (; t + VW <= n; t += VW) {
            vf e = v_exp(v_sub(v_loadf(s[j] + t), v_set1(m)));
            v_storef(s[j] + t, e);
            lsum = v_add(lsum, e);
        }
        float l = v_sum(lsum);
        if (t < n) {  /* the tail, through the same polynomial */
            float tail[VW] = {0};
            int rest = n - t;
            for (int i = 0; i < rest; i++) tail[i] = s[j][t + i] - m;
            for (int i = rest; i < VW; i++) tail[i] = -1e30f;
            vf e = v_exp(v_loadf(tail));
            float out[VW];
            v_storef(out, e);
            for (int i = 0; i < rest; i++) { s[j][t + i] = out[i]; l += out[i]; }
        }
        pm[j] = m;
        pl[j] = l;
    }
    int d0 = 0;
    for (; d0 + V_RUN * VW <= hd; d0 += V_RUN * VW)
        weigh_values(v, half, base + (int64_t)t0 * hd + d0, hd, n, s, group, V_RUN, pacc + d0);
    for (; d0 < hd; d0 += VW) weigh_values(v, half, base + (int64_t)t0 * hd + d0, hd, n, s, group, 1, pacc + d0);
}
/* One task, with the group size a constant where it is a common one: the per-head accumulators can then live
 * in registers (a runtime-sized array of them is kept on the stack). 30 layers of 3,656 keys, GQA groups of 3,
 * interleaved on the 2-core Zen 4 EPYC: fp16 K/V 6.9-7.2 ms -> 5.4-6.0 ms, fp32 10.8-14.1 -> 9.7-10.6 ms. */
static void attend_chunk(const float *q, const void *k, const void *v, int half, int64_t head_stride, int h,
                         int t0, int t1, int group, int hd, float scale, float *pm, float *pl, float *pacc) {
#define KVB_GROUP(G) attend_chunk_g(q, k, v, half, head_stride, h, t0, t1, G, hd, scale, pm, pl, pacc)
    switch (group) {
    case 1: KVB_GROUP(1); break;
    case 2: KVB_GROUP(2); break;
    case 3: KVB_GROUP(3); break;
    case 4: KVB_GROUP(4); break;
    case 5: KVB_GROUP(5); break;
    case 6: KVB_GROUP(6); break;
    case 7: KVB_GROUP(7); break;
    case 8: KVB_GROUP(8); break;
    default: KVB_GROUP(group); break;
    }
#undef KVB_GROUP
}
#endif

/* 1 where this build attends a model of this shape: kvblend decodes over fp16 KV only then
 * (kvblend.model.runner.ModelRunner.decode_kv_dtype). */
int kvb_attention_takes(int heads, int kv_heads, int hd) {
#ifndef KVB_ATTENTION
    (void)heads; (void)kv_heads; (void)hd;
    return 0;
#else
    return kv_heads >= 1 && heads >= 1 && heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP && hd % 16 == 0;
#endif
}

#ifdef KVB_ATTENTION
/* Attention of one sequence's query (all heads) over its first n_keys keys; -1 where a buffer cannot be had. */
static int decode_attention(const float *q, const void *k, const void *v, int half, int64_t head_stride, int n_keys,
                            int heads, int kv_heads, int hd, float scale, float *out, int threads) {
    int group = heads / kv_heads;
    int chunks = (n_keys + CHUNK - 1) / CHUNK, tasks = kv_heads * chunks;
    float *pm = malloc(sizeof(float) * (size_t)tasks * group), *pl = malloc(sizeof(float) * (size_t)tasks * group);
    float *pacc = malloc(sizeof(float) * (size_t)tasks * group * hd);
    if (!pm || !pl || !pacc) { free(pm); free(pl); free(pacc); return -1; }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < tasks; task++) {
        int h = task / chunks, c = task % chunks;
        int t0 = c * CHUNK, t1 = t0 + CHUNK < n_keys ? t0 + CHUNK : n_keys;
        attend_chunk(q, k, v, half, head_stride, h, t0, t1, group, hd, scale, pm + (int64_t)task * group,
                     pl + (int64_t)task * group, pacc + (int64_t)task * group * hd);
    }
    for (int h = 0; h < kv_heads; h++)
        for (int j = 0; j < group; j++) {
            float m = -3.4e38f, l = 0.f;
            for (int c = 0; c < chunks; c++) m = pm[(h * chunks + c) * group + j] > m ? pm[(h * chunks + c) * group + j] : m;
            float *o = out + (int64_t)(h * group + j) * hd;
            for (int d = 0; d < hd; d++) o[d] = 0.f;
            for (int c = 0; c < chunks; c++) {
                int task = h * chunks + c;
                float w = expf(pm[task * group + j] - m);
                l += w * pl[task * group + j];
                const float *a = pacc + ((int64_t)task * group + j) * hd;
                for (int d = 0; d < hd; d++) o[d] += w * a[d];
            }
            for (int d = 0; d < hd; d++) o[d] /= l;
        }
    free(pm); free(pl); free(pacc);
    return 0;
}
#endif

int kvb_decode_attention(const float *q, const void *k, const void *v, int half, int64_t head_stride, int n_keys,
                         int heads, int kv_heads, int hd, float scale, float *out, int threads) {
#ifndef KVB_ATTENTION
    (void)q; (void)k; (void)v; (void)half; (void)head_stride; (void)n_keys; (void)heads; (void)kv_heads;
    (void)hd; (void)scale; (void)out; (void)threads;
    return -1;
#else
    if (!kvb_attention_takes(heads, kv_heads, hd) || n_keys < 1) return -1;
    return decode_attention(q, k, v, half, head_stride, n_keys, heads, kv_heads, hd, scale, out, threads);
#endif
}

/* ---------------------------------------------------------------------------------------------------------
 * A whole decode step of a Llama-shaped model (kvblend.model.fused_step): every layer's pre-norm, q/k/v
 * products, RoPE, the new K/V written into each sequence's buffer, attention, o product and residual,
 * post-norm, gate/up products, SiLU, down product and residual, in one call.
 *
 * Why: the products and attention of a step over 3,656 keys took 14-15 ms on the 2-core Zen 4 EPYC, and the
 * step 23: 8 ms went to the ~25 small torch operations per layer around them (norms, RoPE, slicing, KV
 * writes, residuals, SiLU) and to reaching the kernels through Python. Here they are loops over a few
 * hundred floats. The arithmetic is the eager path's, in fp32, up to the order of sums: the norms'
 * mean of squares, RoPE's x*cos + rotate_half(x)*sin (contracted into FMAs by the compiler), SiLU's
 * x * sigmoid(x) through the vector exp, and K/V rounded to fp16 to nearest-even as torch's cast does.
 */
typedef struct {
    const float *input_norm, *post_norm; /* RMSNorm weights [dim]: before attention, and before the MLP */
    kvb_linear q, k, v, o, gate, up, down;
    const float *q_norm, *k_norm;              /* per-head RMSNorms [head_dim] before RoPE (Qwen3, Gemma 3); NULL */
    const float *attn_out_norm, *mlp_out_norm; /* Gemma's sandwich: on each block's output before its residual; NULL */
    int32_t window;    /* a sliding window of this many keys (0: every key) */
    int32_t rope_kind; /* which of the step's cos/sin tables this layer rotates with (Gemma 3: local or global) */
} kvb_layer;

typedef struct {
    int32_t n_layers, dim, heads, kv_heads, head_dim, inter, half, gelu; /* gelu: tanh-GELU MLP, else SiLU */
    float eps, scale;
    int32_t rope_kinds, unused; /* cos/sin hold rope_kinds tables of head_dim side by side per row */
} kvb_shape;

#ifdef KVB_ATTENTION
#if defined(__AVX512F__)
static inline vf v_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf v_pick_ge0(vf x, vf yes, vf no) { /* yes where x >= 0, else no (NaN: no) */
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, v_zero(), _CMP_GE_OQ), no, yes);
}
#else
static inline vf v_abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline vf v_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf v_pick_ge0(vf x, vf yes, vf no) {
    return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(x, v_zero(), _CMP_GE_OQ));
}
#endif

/* out = w * (x / sqrt(mean(x^2) + eps)), as kvblend.model.transformer.RMSNorm computes it in fp32. */
static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    vf acc = v_zero();
    int i = 0;
    for (; i + VW <= n; i += VW) acc = v_fma(v_loadf(x + i), v_loadf(x + i), acc);
    float ss = v_sum(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* RoPE in place on `heads` vectors of hd: x*cos + rotate_half(x)*sin, rotate_half(x) = (-x2, x1). */
static void rope(float *x, int heads, int hd, const float *cos, const float *sin) {
    int h2 = hd / 2;
    for (int h = 0; h < heads; h++) {
        float *p = x + (int64_t)h * hd;
        for (int i = 0; i < h2; i++) {
            float a = p[i], b = p[i + h2];
            p[i] = a * cos[i] - b * sin[i];
            p[i + h2] = b * cos[i + h2] + a * sin[i + h2];
        }
    }
}

/* gate <- silu(gate) * up over n floats; silu(g) = g * sigmoid(g), the exp taken of -|g| so it never overflows. */
static void silu_mul(float *gate, const float *up, int n) {
    int i = 0;
    vf one = v_set1(1.0f);
    for (; i + VW <= n; i += VW) {
        vf g = v_loadf(gate + i);
        vf e = v_exp(v_sub(v_zero(), v_abs(g)));
        vf sig = v_div(v_pick_ge0(g, one, e), v_add(one, e));
        v_storef(gate + i, v_mul(v_mul(g, sig), v_loadf(up + i)));
    }
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* gate <- gelu_tanh(gate) * up over n floats: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), as torch's
 * F.gelu(approximate="tanh"); tanh|y| = (1 - e) / (1 + e) with e = exp(-2|y|), which never overflows. */
static void gelu_mul(float *gate, const float *up, int n) {
    int i = 0;
    const float c = 0.7978845608028654f, a = 0.044715f;
    vf one = v_set1(1.0f), half = v_set1(0.5f);
    for (; i + VW <= n; i += VW) {
        vf g = v_loadf(gate + i);
        vf y = v_mul(v_set1(c), v_fma(v_mul(v_set1(a), g), v_mul(g, g), g));
        vf e = v_exp(v_mul(v_set1(-2.0f), v_abs(y)));
        vf t = v_div(v_sub(one, e), v_add(one, e));
        t = v_pick_ge0(y, t, v_sub(v_zero(), t));
        v_storef(gate + i, v_mul(v_mul(v_mul(half, g), v_add(one, t)), v_loadf(up + i)));
    }
    for (; i < n; i++) {
        float g = gate[i];
        gate[i] = 0.5f * g * (1.0f + tanhf(c * (g + a * g * g * g))) * up[i];
    }
}

/* hidden += out over rows of D, `out` first normed in place by `norm` where there is one (Gemma's sandwich norms
 * on the attention's and the MLP's outputs); NULL: the plain residual add. */
static void add_residual(float *hidden, float *out, const float *norm, int rows, int D, float eps) {
    if (norm)
        for (int r = 0; r < rows; r++) rms_norm(out + r * D, norm, D, eps, out + r * D);
    for (int i = 0; i < rows * D; i++) hidden[i] += out[i];
}

static void store_kv(const float *x, void *buf, int half, int64_t at) {
    if (half)
        ((uint16_t *)buf)[at] = _cvtss_sh(*x, _MM_FROUND_TO_NEAREST_INT);
    else
        ((float *)buf)[at] = *x;
}
#endif

/* 1 where this build runs kvb_decode_step for a model of this shape. */
int kvb_step_takes(const kvb_shape *s) {
#ifndef KVB_ATTENTION
    (void)s;
    return 0;
#else
    return s->n_layers >= 1 && kvb_attention_takes(s->heads, s->kv_heads, s->head_dim) && s->dim % BLOCK == 0 &&
           s->inter % BLOCK == 0 && (s->heads * s->head_dim) % BLOCK == 0 && s->rope_kinds >= 1;
#endif
}

/* One decode step for `rows` (<= MAX_ROWS) sequences: hidden [rows, dim] (their tokens' embeddings) becomes the
 * last layer's output, before the final norm. Sequence r is at position pos[r] with cos/sin [rows, rope_kinds *
 * head_dim] (a layer rotates with table rope_kind);
 * its layer-l K/V buffers are k[l * rows + r], v[...] ([kv_heads, capacity, head_dim], heads head_stride[r]
 * apart; fp16 where s->half, else fp32), with room at pos[r] (the caller checks). Returns 0; -1 where this
 * build cannot (kvb_step_takes) or memory ran out, with hidden then undefined. */
int kvb_decode_step(const kvb_shape *s, const kvb_layer *layers, float *hidden, int rows, const float *cos,
                    const float *sin, void *const *k, void *const *v, const int64_t *head_stride, const int64_t *pos,
                    int threads) {
#ifndef KVB_ATTENTION
    (void)s; (void)layers; (void)hidden; (void)rows; (void)cos; (void)sin; (void)k; (void)v; (void)head_stride;
    (void)pos; (void)threads;
    return -1;
#else
    if (!kvb_step_takes(s) || rows < 1 || rows > MAX_ROWS) return -1;
    const int D = s->dim, hd = s->head_dim, qn = s->heads * hd, kvn = s->kv_heads * hd, I = s->inter;
    float *buf = malloc(sizeof(float) * (size_t)rows * (2 * D + 2 * qn + 2 * kvn + 2 * I));
    if (!buf) return -1;
    float *xn = buf, *q = xn + rows * D, *kk = q + rows * qn, *vv = kk + rows * kvn, *att = vv + rows * kvn;
    float *gate = att + rows * qn, *up = gate + rows * I, *o = up + rows * I;
    int status = 0;
    for (int l = 0; l < s->n_layers && status == 0; l++) {
        const kvb_layer *L = layers + l;
        for (int r = 0; r < rows; r++) rms_norm(hidden + r * D, L->input_norm, D, s->eps, xn + r * D);
        const kvb_linear *qkv[3] = {&L->q, &L->k, &L->v};
        float *qkv_out[3] = {q, kk, vv};
        status = products(xn, rows, qkv, qkv_out, 3, threads);
        for (int r = 0; r < rows && status == 0; r++) {
            float *qr = q + r * qn, *kr = kk + r * kvn;
            if (L->q_norm)
                for (int h = 0; h < s->heads; h++) rms_norm(qr + h * hd, L->q_norm, hd, s->eps, qr + h * hd);
            if (L->k_norm)
                for (int h = 0; h < s->kv_heads; h++) rms_norm(kr + h * hd, L->k_norm, hd, s->eps, kr + h * hd);
            const int64_t table = (int64_t)r * s->rope_kinds * hd + (int64_t)L->rope_kind * hd;
            rope(qr, s->heads, hd, cos + table, sin + table);
            rope(kr, s->kv_heads, hd, cos + table, sin + table);
            void *kb = k[l * rows + r], *vb = v[l * rows + r];
            for (int h = 0; h < s->kv_heads; h++)
                for (int i = 0; i < hd; i++) {
                    int64_t at = h * head_stride[r] + pos[r] * hd + i;
                    store_kv(kr + h * hd + i, kb, s->half, at);
                    store_kv(vv + r * kvn + h * hd + i, vb, s->half, at);
                }
            /* a sliding window sees its last `window` keys, the newest included: the buffers from there on */
            int64_t n_keys = pos[r] + 1, first = L->window > 0 && n_keys > L->window ? n_keys - L->window : 0;
            size_t skip = (size_t)first * hd * (s->half ? 2 : 4);
            status = decode_attention(qr, (const char *)kb + skip, (const char *)vb + skip, s->half, head_stride[r],
                                      (int)(n_keys - first), s->heads, s->kv_heads, hd, s->scale, att + r * qn,
                                      threads);
        }
        if (status != 0) break;
        const kvb_linear *op[1] = {&L->o};
        float *o_out[1] = {o};
        if ((status = products(att, rows, op, o_out, 1, threads)) != 0) break;
        add_residual(hidden, o, L->attn_out_norm, rows, D, s->eps);
        for (int r = 0; r < rows; r++) rms_norm(hidden + r * D, L->post_norm, D, s->eps, xn + r * D);
        const kvb_linear *gu[2] = {&L->gate, &L->up};
        float *gu_out[2] = {gate, up};
        if ((status = products(xn, rows, gu, gu_out, 2, threads)) != 0) break;
        if (s->gelu)
            gelu_mul(gate, up, rows * I);
        else
            silu_mul(gate, up, rows * I);
        const kvb_linear *dn[1] = {&L->down};
        float *dn_out[1] = {o};
        if ((status = products(gate, rows, dn, dn_out, 1, threads)) != 0) break;
        add_residual(hidden, o, L->mlp_out_norm, rows, D, s->eps);
    }
    free(buf);
    return status;
#endif
}
