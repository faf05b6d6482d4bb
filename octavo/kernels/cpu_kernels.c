/* octavo's CPU kernels: float32 products with float32, 4-bit or 8-bit weights, and attention
 * over the paged KV cache, each computing a row the same way whatever else is in the batch.
 *
 * Every output element is one fixed sequence of float32 operations that depends only on its
 * own inputs and the weight's shape: a dot product is accumulated in 16 lanes (lane l takes
 * the columns k = l mod 16, in order) and the lanes are summed in one fixed tree. Rows are
 * tiled and the output columns split between threads, but no tile or split ever changes
 * that sequence, so a token's result does not depend on how many rows share its step, on
 * how a prompt is chunked, or on the thread count. No -ffast-math: the compiler may not
 * reorder a sum. `a * b + c` is contracted to one fused multiply-add everywhere
 * (-ffp-contract=fast), and octavo_self_check() confirms a 1-row product equals its row
 * of a larger one before octavo uses the library.
 *
 * Quantized weights are dequantized in registers, w = code * scale + min with float32
 * scale and minimum per group: for GGUF's Q4_0/Q4_1/Q8_0 blocks that is exactly the float
 * the file stands for, so the product equals a float32 matmul on the dequantized weights up
 * to the order of its sum.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* vf: 16 float32 lanes, one AVX-512 register or two AVX2 ones (generic vectors elsewhere).
 * Each lane's arithmetic is the same on every path; only the hardware differs. */
#define VL 16
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
typedef __m512 vf;
#define MR 4 /* rows of a tile: 16 accumulators, 4 weight vectors and an input in 32 registers */
#define NR 4 /* output columns of a tile */
static inline vf load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf load_part(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline void store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf splat(float x) { return _mm512_set1_ps(x); }
static inline vf zero(void) { return _mm512_setzero_ps(); }
static inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf fma_v(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
/* 2^n for whole n in [-126, 127]. */
static inline vf pow2i(vf n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
/* Lanes of r where x >= lim, zero elsewhere. */
static inline vf keep_at_least(vf r, vf x, float lim) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, splat(lim), _CMP_GE_OQ), r);
}
/* Codes of 16 bytes as floats: each byte (Q8), or its low or high nibble (Q4). */
static inline vf bytes_f(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf nibbles_f(const uint8_t *p, int high) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    c = high ? _mm512_srli_epi32(c, 4) : _mm512_and_si512(c, _mm512_set1_epi32(15));
    return _mm512_cvtepi32_ps(c);
}
/* The lanes' sum in one fixed tree: ((v_i + v_i+8) + (v_i+4 + v_i+12)) for i < 4, then
 * (s_0 + s_2) + (s_1 + s_3). */
static inline float hsum(vf v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef struct { __m256 a, b; } vf; /* lanes 0-7, 8-15 */
#define MR 2
#define NR 2
#define BOTH(f, x, y) ((vf){f((x).a, (y).a), f((x).b, (y).b)})
static inline vf load(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline vf load_part(const float *p, int n) {
    float tmp[16] = {0};
    memcpy(tmp, p, (size_t)n * sizeof(float));
    return load(tmp);
}
static inline void store(float *p, vf v) { _mm256_storeu_ps(p, v.a), _mm256_storeu_ps(p + 8, v.b); }
static inline vf splat(float x) { return (vf){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline vf zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf add(vf a, vf b) { return BOTH(_mm256_add_ps, a, b); }
static inline vf mul(vf a, vf b) { return BOTH(_mm256_mul_ps, a, b); }
static inline vf fma_v(vf a, vf b, vf c) {
    return (vf){_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)};
}
static inline vf vmax(vf a, vf b) { return BOTH(_mm256_max_ps, a, b); }
static inline vf vmin(vf a, vf b) { return BOTH(_mm256_min_ps, a, b); }
static inline vf vfloor(vf a) { return (vf){_mm256_floor_ps(a.a), _mm256_floor_ps(a.b)}; }
static inline __m256 pow2i8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf pow2i(vf n) { return (vf){pow2i8(n.a), pow2i8(n.b)}; }
static inline vf keep_at_least(vf r, vf x, float lim) {
    const __m256 l = _mm256_set1_ps(lim);
    return (vf){_mm256_and_ps(r.a, _mm256_cmp_ps(x.a, l, _CMP_GE_OQ)),
                _mm256_and_ps(r.b, _mm256_cmp_ps(x.b, l, _CMP_GE_OQ))};
}
static inline __m256i bytes8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vf bytes_f(const uint8_t *p) {
    return (vf){_mm256_cvtepi32_ps(bytes8(p)), _mm256_cvtepi32_ps(bytes8(p + 8))};
}
static inline __m256 nib8(const uint8_t *p, int high) {
    const __m256i c = bytes8(p);
    return _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, _mm256_set1_epi32(15)));
}
static inline vf nibbles_f(const uint8_t *p, int high) { return (vf){nib8(p, high), nib8(p + 8, high)}; }
static inline float hsum(vf v) {
    const __m256 a = _mm256_add_ps(v.a, v.b);
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#else
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
#define MR 2
#define NR 2
static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf load_part(const float *p, int n) {
    vf v = {0};
    memcpy(&v, p, (size_t)n * sizeof(float));
    return v;
}
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){0} + x; }
static inline vf zero(void) { return (vf){0}; }
static inline vf add(vf a, vf b) { return a + b; }
static inline vf mul(vf a, vf b) { return a * b; }
static inline vf fma_v(vf a, vf b, vf c) {
    vf r;
    for (int i = 0; i < VL; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
}
static inline vf pick(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf vmax(vf a, vf b) { return pick(a > b, a, b); }
static inline vf vmin(vf a, vf b) { return pick(a < b, a, b); }
static inline vf vfloor(vf a) {
    vf r;
    for (int i = 0; i < VL; i++) r[i] = floorf(a[i]);
    return r;
}
static inline vf pow2i(vf n) { return (vf)((__builtin_convertvector(n, vi) + 127) << 23); }
static inline vf keep_at_least(vf r, vf x, float lim) { return pick(x >= lim, r, (vf){0}); }
static inline vf bytes_f(const uint8_t *p) {
    vb b;
    memcpy(&b, p, 16);
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}
static inline vf nibbles_f(const uint8_t *p, int high) {
    vb b;
    memcpy(&b, p, 16);
    const vi c = __builtin_convertvector(b, vi);
    return __builtin_convertvector(high ? c >> 4 : c & 15, vf);
}
static inline float hsum(vf v) {
    float a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = v[i] + v[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif
#define MBLOCK 64 /* rows whose inputs stay in the cache while a thread's columns pass */

enum { W_F32 = 0, W_Q4 = 1, W_Q8 = 2 };
#define UNROLL _Pragma("GCC unroll 8")

/* A quantized weight row is a run of blocks, one per group of `group` columns: float32
 * scale, float32 min, then the group's codes
 *   W_Q4: 16 bytes per 32 columns, byte j = code[j] | code[j + 16] << 4
 *   W_Q8: one byte a code
 * and w = code * scale + min. */
static inline long block_bytes(int kind, int group) { return 8 + (kind == W_Q4 ? group / 2 : group); }

/* Columns [k, k + 32) of a block's codes at `at` columns into it, dequantized to two vectors
 * (lanes past K zero, as load_part gives them). */
static inline void dequantize32(int kind, const uint8_t *block, int at, int k, int K, vf *lo,
                                vf *hi) {
    float scale, min;
    memcpy(&scale, block, 4);
    memcpy(&min, block + 4, 4);
    const uint8_t *codes = block + 8 + (kind == W_Q4 ? at / 2 : at);
    const vf s = splat(scale), m = splat(min);
    if (kind == W_Q4) {
        *lo = fma_v(nibbles_f(codes, 0), s, m);
        *hi = fma_v(nibbles_f(codes, 1), s, m);
    } else {
        *lo = fma_v(bytes_f(codes), s, m);
        *hi = fma_v(bytes_f(codes + 16), s, m);
    }
    if (k + 2 * VL <= K) return;
    float tmp[2 * VL];
    store(tmp, *lo), store(tmp + VL, *hi);
    const int valid = K - k;
    *lo = load_part(tmp, valid < VL ? valid : VL);
    *hi = valid > VL ? load_part(tmp + VL, valid - VL) : zero();
}

static inline vf load_x(const float *row, int k, int K) {
    return k + VL <= K ? load(row + k) : (k < K ? load_part(row + k, K - k) : zero());
}

/* One tile: rows [0, mr) of x against weight rows [0, nr) (row_bytes apart), written to y.
 * Each output's lanes take x[k] w[k] for k = 0, 16, 32, ... + lane, in that order: float32
 * rows 16 columns a step, quantized ones 32 (the same order). */
static inline __attribute__((always_inline)) void tile(
    int kind, int mr, int nr, const float *x, long ldx, int K, const uint8_t *w, long row_bytes,
    int group, float *y, long ldy) {
    vf acc[MR][NR];
    UNROLL for (int t = 0; t < MR; t++)
        UNROLL for (int n = 0; n < NR; n++) acc[t][n] = zero();
    if (kind == W_F32) {
        for (int k = 0; k < K; k += VL) {
            vf wv[NR];
            UNROLL for (int n = 0; n < nr; n++) wv[n] = load_x((const float *)(w + n * row_bytes), k, K);
            UNROLL for (int t = 0; t < mr; t++) {
                const vf xv = load_x(x + t * ldx, k, K);
                UNROLL for (int n = 0; n < nr; n++) acc[t][n] = fma_v(xv, wv[n], acc[t][n]);
            }
        }
    } else {
        const long bb = block_bytes(kind, group);
        for (int k0 = 0, g = 0; k0 < K; k0 += group, g++)
            for (int at = 0, k = k0; at < group && k < K; at += 2 * VL, k += 2 * VL) {
                vf lo[NR], hi[NR];
                UNROLL for (int n = 0; n < nr; n++)
                    dequantize32(kind, w + n * row_bytes + g * bb, at, k, K, &lo[n], &hi[n]);
                UNROLL for (int t = 0; t < mr; t++) {
                    const vf x0 = load_x(x + t * ldx, k, K), x1 = load_x(x + t * ldx, k + VL, K);
                    UNROLL for (int n = 0; n < nr; n++) {
                        acc[t][n] = fma_v(x0, lo[n], acc[t][n]);
                        if (k + VL < K) acc[t][n] = fma_v(x1, hi[n], acc[t][n]);
                    }
                }
            }
    }
    UNROLL for (int t = 0; t < mr; t++)
        UNROLL for (int n = 0; n < nr; n++) y[t * ldy + n] = hsum(acc[t][n]);
}

/* The tile specialized for its kind and common sizes (a full tile, one row), else generic. */
static void tile_any(int kind, int mr, int nr, const float *x, long ldx, int K, const uint8_t *w,
                     long row_bytes, int group, float *y, long ldy) {
#define TILE(KIND, ROWS, COLS) tile(KIND, ROWS, COLS, x, ldx, K, w, row_bytes, group, y, ldy)
#define SIZES(KIND)                                                                            \
    if (mr == MR && nr == NR) TILE(KIND, MR, NR);                                              \
    else if (mr == 1 && nr == NR) TILE(KIND, 1, NR);                                           \
    else TILE(KIND, mr, nr);                                                                   \
    break;
    switch (kind) {
    case W_F32: SIZES(W_F32)
    case W_Q4: SIZES(W_Q4)
    default: SIZES(W_Q8)
    }
#undef SIZES
#undef TILE
}

/* Weight rows [0, nr) dequantized into buf [nr, K16] float32 (K16: K in whole 16s, zeros
 * past K): the values tile() forms. */
static void dequantize_rows(int kind, int nr, int K, const uint8_t *w, long row_bytes, int group,
                            float *buf) {
    const int K16 = (K + VL - 1) / VL * VL;
    const long bb = block_bytes(kind, group);
    for (int n = 0; n < nr; n++)
        for (int k = 0; k < K; k += 2 * VL) {
            vf lo, hi;
            dequantize32(kind, w + n * row_bytes + (k / group) * bb, k % group, k, K, &lo, &hi);
            store(buf + (long)n * K16 + k, lo);
            if (k + VL < K) store(buf + (long)n * K16 + k + VL, hi);
        }
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T, W's rows row_bytes apart:
 * float32 (W_F32), or blocks of `group` columns (W_Q4, W_Q8; see weight16). A product of
 * more rows than one tile dequantizes each thread's weight rows once per block of rows and
 * runs the float32 tile on them: the same values, the same sums. `threads`: how many share
 * the work (torch's count: OpenMP's own is per calling thread). */
void octavo_linear(int kind, const float *x, long ldx, int M, int K, const void *w,
                   long row_bytes, int group, int N, float *y, long ldy, int threads) {
    const int ntiles = (N + NR - 1) / NR, staged = kind != W_F32 && M > MR;
#pragma omp parallel num_threads(threads)
    {
        const int K16 = (K + VL - 1) / VL * VL;
        float *buf = staged ? malloc((size_t)NR * K16 * sizeof(float)) : NULL;
        for (int m0 = 0; m0 < M; m0 += MBLOCK) {
            const int m1 = m0 + MBLOCK < M ? m0 + MBLOCK : M;
#pragma omp for schedule(static) nowait
            for (int nt = 0; nt < ntiles; nt++) {
                const int n0 = nt * NR, nr = N - n0 < NR ? N - n0 : NR;
                const uint8_t *wn = (const uint8_t *)w + n0 * row_bytes;
                if (staged) dequantize_rows(kind, nr, K, wn, row_bytes, group, buf);
                for (int t = m0; t < m1; t += MR) {
                    const int mr = m1 - t < MR ? m1 - t : MR;
                    if (staged)
                        tile_any(W_F32, mr, nr, x + t * ldx, ldx, K, (const uint8_t *)buf,
                                 (long)K16 * sizeof(float), group, y + t * ldy + n0, ldy);
                    else
                        tile_any(kind, mr, nr, x + t * ldx, ldx, K, wn, row_bytes, group,
                                 y + t * ldy + n0, ldy);
                }
            }
        }
        free(buf);
    }
}

/* exp(x) for each lane: Cody-Waite reduction by ln 2 and a degree-6 polynomial, within 2 ulp;
 * below -87 (-inf included) it gives 0. */
static inline vf exp_v(vf x) {
    const vf xc = vmin(vmax(x, splat(-87.0f)), splat(88.0f));
    const vf n = vfloor(fma_v(xc, splat(1.44269504f), splat(0.5f)));
    const vf r = fma_v(n, splat(-1.42860677e-06f), fma_v(n, splat(-0.693145752f), xc));
    vf p = splat(1.0f / 720);
    p = fma_v(p, r, splat(1.0f / 120));
    p = fma_v(p, r, splat(1.0f / 24));
    p = fma_v(p, r, splat(1.0f / 6));
    p = fma_v(p, r, splat(0.5f));
    p = fma_v(p, r, splat(1.0f));
    p = fma_v(p, r, splat(1.0f));
    return keep_at_least(mul(p, pow2i(n)), x, -87.0f);
}

/* out[i] = hsum(v[i]) * scale for 16 vectors, each sum in hsum's own tree: on AVX-512 all
 * sixteen at once, every level adding lanes l and l + 8, then l and l + 4, ... across
 * vectors, which leaves key i in lane LANE_OF[i]. */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
static inline void hsum16(const vf *v, float scale, float *out) {
    vf t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = add(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        u[i] = add(_mm512_shuffle_f32x4(t[i], t[i + 4], 0x88), _mm512_shuffle_f32x4(t[i], t[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = add(_mm512_shuffle_ps(u[i], u[i + 2], 0x44), _mm512_shuffle_ps(u[i], u[i + 2], 0xEE));
    const vf r = add(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    const __m512i lane_of = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    store(out, mul(_mm512_permutexvar_ps(lane_of, r), splat(scale)));
}
#else
static inline void hsum16(const vf *v, float scale, float *out) {
    for (int i = 0; i < VL; i++) out[i] = hsum(v[i]) * scale;
}
#endif

/* o0 += sum of e0[i] v[i] over the first n0 (at most 16) positions i, in order, and the
 * same for o1 (n1 may be 0); nd vectors a row, a constant where inlined. */
static inline __attribute__((always_inline)) void values16(const int nd, const float *const *v,
                                                           const float *e0, int n0, vf *o0,
                                                           const float *e1, int n1, vf *o1) {
    vf a0[16], a1[16]; /* D <= 256 */
    for (int d = 0; d < nd; d++) a0[d] = o0[d], a1[d] = o1[d];
    for (int i = 0; i < VL; i++) {
        if (i < n0) {
            const vf e = splat(e0[i]);
            for (int d = 0; d < nd; d++) a0[d] = fma_v(e, load(v[i] + d * VL), a0[d]);
        }
        if (i < n1) {
            const vf e = splat(e1[i]);
            for (int d = 0; d < nd; d++) a1[d] = fma_v(e, load(v[i] + d * VL), a1[d]);
        }
    }
    for (int d = 0; d < nd; d++) o0[d] = a0[d];
    if (n1 > 0)
        for (int d = 0; d < nd; d++) o1[d] = a1[d];
}

/* Causal attention of T query tokens over the paged cache. q, out [T, H, D]; kcache, vcache
 * [blocks, block_size, KVH, D]; block_tables [S, bt_stride] int32; token t belongs to
 * sequence seq[t] and sees its first ctx[t] cached positions, or with window > 0 only the
 * last `window` of them (a sliding window); with softcap > 0 a score x becomes
 * softcap tanh(x / softcap) (Gemma 2). D is a multiple of 16.
 * Work items are a KV head and a tile of up to TQ consecutive tokens of one sequence (a
 * prefill chunk), so that each K and V row read serves the tile's TQ x H / KVH query heads.
 * For each query its scores, their softmax and the weighted sum of values each run over
 * positions 0, 1, 2, ... in order, whatever else the call or its tile holds. `threads` as
 * in octavo_linear. */
#define TQ 8
void octavo_paged_attention(const float *q, float *out, int T, int H, int KVH, int D,
                            const float *kcache, const float *vcache, int block_size,
                            const int32_t *block_tables, long bt_stride, const int32_t *seq,
                            const int32_t *ctx, float softmax_scale, int window, float softcap,
                            int threads) {
    const int G = H / KVH, nd = D / VL;
    const long slot = (long)KVH * D; /* floats from one position to the next in a block */
    int *tiles = malloc((T + 1) * sizeof(int)), num_tiles = 0;
    for (int t = 0; t < T; num_tiles++) {
        tiles[num_tiles] = t;
        const int first = t;
        while (++t < T && t - first < TQ && seq[t] == seq[first]) {}
    }
    tiles[num_tiles] = T;
#pragma omp parallel num_threads(threads)
    {
        float *s = NULL, *inv = malloc(TQ * G * sizeof(float)), *none = calloc(D, sizeof(float));
        vf *o = aligned_alloc(64, (size_t)TQ * G * nd * sizeof(vf)); /* sizeof(vf) is 64 */
        long cap = 0;
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < (long)num_tiles * KVH; item++) {
            const int t0 = tiles[item / KVH], n = tiles[item / KVH + 1] - t0, h = (int)(item % KVH);
            const int32_t *bt = block_tables + seq[t0] * bt_stride;
            int L = 0, lo = 1 << 30; /* the tile's last position, and its first in a window */
            for (int i = 0; i < n; i++) {
                L = ctx[t0 + i] > L ? ctx[t0 + i] : L;
                const int first = window > 0 && ctx[t0 + i] > window ? ctx[t0 + i] - window : 0;
                lo = first < lo ? first : lo;
            }
            const int j_first = lo / VL * VL; /* positions before it: no row sees them */
            const long L16 = (L + VL - 1) / VL * VL, rows = (long)n * G; /* row r: query r / G, head r % G */
            if (rows * L16 > cap) {
                free(s);
                cap = rows * L16;
                s = malloc(cap * sizeof(float));
            }
            for (int j0 = j_first; j0 < L; j0 += VL) { /* scores of 16 positions at a time */
                const float *k[VL];
                for (int i = 0, j = j0; i < VL; i++, j++)
                    k[i] = j >= L ? none
                                  : kcache + ((long)bt[j / block_size] * block_size + j % block_size) * slot + (long)h * D;
                for (int r = 0; r < rows; r++) {
                    if (j0 >= ctx[t0 + r / G]) continue;
                    const float *qr = q + ((long)(t0 + r / G) * H + (long)h * G + r % G) * D;
                    vf acc[VL]; /* sixteen independent chains, one per position */
                    for (int i = 0; i < VL; i++) acc[i] = zero();
                    for (int d = 0; d < D; d += VL) {
                        const vf qd = load(qr + d);
                        for (int i = 0; i < VL; i++) acc[i] = fma_v(qd, load(k[i] + d), acc[i]);
                    }
                    hsum16(acc, softmax_scale, s + r * L16 + j0);
                }
            }
            for (int r = 0; r < rows; r++) {
                const int Lr = ctx[t0 + r / G];
                float *sr = s + r * L16, mx = -INFINITY, lanes[VL];
                const int L16r = (Lr + VL - 1) / VL * VL, lo_r = window > 0 && Lr > window ? Lr - window : 0;
                for (int j = Lr; j < L16r; j++) sr[j] = -INFINITY;
                if (softcap > 0)
                    for (int j = lo_r; j < Lr; j++) sr[j] = softcap * tanhf(sr[j] / softcap);
                for (int j = j_first; j < lo_r; j++) sr[j] = -INFINITY; /* out of its window */
                vf m = splat(-INFINITY); /* max is exact in any order */
                for (int j = j_first; j < L16r; j += VL) m = vmax(m, load(sr + j));
                store(lanes, m);
                for (int i = 0; i < VL; i++) mx = lanes[i] > mx ? lanes[i] : mx;
                vf sum = zero();
                for (int j = j_first; j < L16r; j += VL) {
                    const vf e = exp_v(add(load(sr + j), splat(-mx)));
                    store(sr + j, e);
                    sum = add(sum, e);
                }
                inv[r] = 1.0f / hsum(sum);
            }
            for (long i = 0; i < rows * nd; i++) o[i] = zero();
            for (int j0 = j_first; j0 < L; j0 += VL) { /* values of 16 positions at a time */
                const float *v[VL];
                for (int i = 0, j = j0; i < VL; i++, j++)
                    v[i] = j >= L ? none
                                  : vcache + ((long)bt[j / block_size] * block_size + j % block_size) * slot + (long)h * D;
                for (int r = 0; r < rows; r += 2) { /* two rows: twice the chains in flight */
                    const int r1 = r + 1 < rows ? r + 1 : r, n0 = ctx[t0 + r / G] - j0;
                    const int n1 = r1 == r ? 0 : ctx[t0 + r1 / G] - j0;
                    const float *e0 = s + r * L16 + j0, *e1 = s + r1 * L16 + j0;
                    if (nd == 4)
                        values16(4, v, e0, n0, o + r * nd, e1, n1, o + r1 * nd);
                    else if (nd == 8)
                        values16(8, v, e0, n0, o + r * nd, e1, n1, o + r1 * nd);
                    else
                        values16(nd, v, e0, n0, o + r * nd, e1, n1, o + r1 * nd);
                }
            }
            for (int r = 0; r < rows; r++)
                for (int d = 0; d < nd; d++)
                    store(out + ((long)(t0 + r / G) * H + (long)h * G + r % G) * D + d * VL,
                          mul(o[r * nd + d], splat(inv[r])));
        }
        free(s), free(inv), free(o), free(none);
    }
    free(tiles);
}

/* A 1-row product equals row 0 of a 7-row one, for each kind: the compiler kept the
 * operation sequence of a row the same in every tile. Returns 0 if so. */
int octavo_self_check(void) {
    enum { K = 96, N = 9, M = 7, G = K / 32 };
    static float x[M * K], w[N * K], y1[N], y7[M * N];
    static uint8_t q[N * G * (8 + 32)];
    for (int i = 0; i < M * K; i++) x[i] = (float)((i * 7919) % 997) / 997.0f - 0.5f;
    for (int i = 0; i < N * K; i++) w[i] = (float)((i * 104729) % 991) / 991.0f - 0.5f;
    for (int kind = 0; kind < 3; kind++) {
        const int block = 8 + (kind == W_Q4 ? 16 : 32);
        for (int i = 0; i < N * G * block; i++) q[i] = (uint8_t)((i * 31) % 251);
        for (int i = 0; i < N * G; i++) { /* each block's scale and min */
            const float s = 0.01f + i * 1e-4f, m = -0.3f + i * 1e-3f;
            memcpy(q + i * block, &s, 4), memcpy(q + i * block + 4, &m, 4);
        }
        const void *wk = kind == W_F32 ? (const void *)w : (const void *)q;
        const long row_bytes = kind == W_F32 ? K * 4 : G * block;
        octavo_linear(kind, x, K, 1, K, wk, row_bytes, 32, N, y1, N, 2);
        octavo_linear(kind, x, K, M, K, wk, row_bytes, 32, N, y7, N, 2);
        if (memcmp(y1, y7, sizeof y1)) return 1 + kind;
    }
    return 0;
}
