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

/* One output row n for `rows` (<= MAX_ROWS) activation rows, of Q4_1 (`q4`, with its minimums m and the
 * activations' block sums) or Q8_0. Inlined with `q4` a constant, so each format gets its own loop. */
static inline __attribute__((always_inline)) void quant_row(const float *x, int rows, int n_in, const uint8_t *codes,
                                                          int q4, const float *d, const float *m, const float *sums,
                                                          int n, int n_out, float *y) {
    int groups = n_in / BLOCK, block_bytes = q4 ? BLOCK / 2 : BLOCK;
    const uint8_t *c = codes + (int64_t)n * groups * block_bytes;
    const float *dn = d + (int64_t)n * groups;
#ifdef VW
    vf acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = v_zero();
    for (int g = 0; g < groups; g++) {
        vf q[BLOCK / VW];
        if (q4)
            unpack_q4_1(c + g * block_bytes, q);
        else
            unpack_q8_0((const int8_t *)c + g * block_bytes, q);
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
        if (q4)
            for (int g = 0; g < groups; g++) s += m[(int64_t)n * groups + g] * sums[r * groups + g];
        y[(int64_t)r * n_out + n] = s;
    }
#else
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * n_in;
        float s = 0.f;
        for (int g = 0; g < groups; g++) {
            const uint8_t *b = c + g * block_bytes;
            float t = 0.f;
            for (int j = 0; j < BLOCK; j++) {
                float q = q4 ? (float)(j < 16 ? b[j] & 0x0F : b[j - 16] >> 4) : (float)((const int8_t *)b)[j];
                t += q * xr[g * BLOCK + j];
            }
            s += dn[g] * t + (q4 ? m[(int64_t)n * groups + g] * sums[r * groups + g] : 0.f);
        }
        y[(int64_t)r * n_out + n] = s;
    }
#endif
}

/* y = x @ W.T for W in Q4_1 (`q4`) or Q8_0, in passes of MAX_ROWS rows, output rows shared among the threads. */
static int quant_gemv(const float *x, int rows, int n_in, const uint8_t *codes, int q4, const float *d,
                      const float *m, int n_out, float *y, int threads) {
    int groups = n_in / BLOCK;
    float *sums = NULL;
    if (q4) {
        sums = malloc(sizeof(float) * (size_t)rows * groups);
        if (!sums) return -1;
        block_sums(x, rows, n_in, sums);
    }
    for (int r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        int rr = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
        const float *xr = x + (int64_t)r0 * n_in;
        float *yr = y + (int64_t)r0 * n_out;
        const float *sr = q4 ? sums + r0 * groups : NULL;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int n = 0; n < n_out; n++) {
            if (q4)
                quant_row(xr, rr, n_in, codes, 1, d, m, sr, n, n_out, yr);
            else
                quant_row(xr, rr, n_in, codes, 0, d, NULL, NULL, n, n_out, yr);
        }
    }
    free(sums);
    return 0;
}

int kvb_q4_1_gemv(const float *x, int rows, int n_in, const uint8_t *codes, const float *d, const float *m,
                  int n_out, float *y, int threads) {
    return quant_gemv(x, rows, n_in, codes, 1, d, m, n_out, y, threads);
}

int kvb_q8_0_gemv(const float *x, int rows, int n_in, const int8_t *codes, const float *d, int n_out, float *y,
                  int threads) {
    return quant_gemv(x, rows, n_in, (const uint8_t *)codes, 0, d, NULL, n_out, y, threads);
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

#if defined(VW) && defined(KVB_F16)
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
    for (int d0 = 0; d0 < hd; d0 += VW) {
        vf acc[MAX_GROUP];
        for (int j = 0; j < group; j++) acc[j] = v_zero();
        for (int t = 0; t < n; t++) {
            vf vv = v_load(v, base + (int64_t)(t0 + t) * hd + d0, half);
            for (int j = 0; j < group; j++) acc[j] = v_fma(v_set1(s[j][t]), vv, acc[j]);
        }
        for (int j = 0; j < group; j++) v_storef(pacc + (int64_t)j * hd + d0, acc[j]);
    }
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

int kvb_decode_attention(const float *q, const void *k, const void *v, int half, int64_t head_stride, int n_keys,
                         int heads, int kv_heads, int hd, float scale, float *out, int threads) {
#ifndef KVB_ATTENTION
    (void)q; (void)k; (void)v; (void)half; (void)head_stride; (void)n_keys; (void)heads; (void)kv_heads;
    (void)hd; (void)scale; (void)out; (void)threads;
    return -1;
#else
    if (!kvb_attention_takes(heads, kv_heads, hd) || n_keys < 1) return -1;
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
#endif
}
