/* Attention over packed pairs, fused: one call per layer reads the packed q/k/v rows in place and writes
 * the context rows, with no padding, no gathers and no mask (model/engines/fused.py says why). Plain C
 * with no Python or torch headers: an optional extension built at install and called through ctypes, so a
 * machine without a compiler still installs, and runs torch's kernel instead.
 *
 * Pair p owns key/value rows kstart[p] .. kstart[p] + klen[p] - 1 and query rows qstart[p] .. + qlen[p] - 1
 * (qlen = klen in a whole layer; 1 in the [CLS]-only last layer); its context rows go to the same rows of
 * `out` as its query rows. Head h of a row is the hs elements from column h * hs of that row's q, k, v or
 * out; rows are `*_stride` elements apart. dtype 0: float32; 1: bfloat16 (uint16 storage); 2: bfloat16 held to
 * the float32 arithmetic below (no AVX512-BF16 dot products, no AMX tiles: ModernBERT's pre-norm layers carry
 * their rounding on). The arithmetic is float32 either way; softmax as torch's (the row's max subtracted, exp, divided by the sum).
 *
 * Compiled for x86-64-v4 (AVX-512), v3 (AVX2 + FMA) and a baseline, chosen at load by the CPU (GCC's
 * target_clones), so one binary serves every CPU an image lands on. 8-lane GCC vectors throughout. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* unaligned loads and stores */
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8w __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v8hu __attribute__((vector_size(16), aligned(2)));

#define INLINE __attribute__((always_inline)) static inline
#define LD(p) (*(const v8u *)(p))
#define ST(p, x) (*(v8u *)(p) = (x))
#define BC(x) ((v8){(x), (x), (x), (x), (x), (x), (x), (x)})
#define QB 4 /* query rows per pass over a head's keys */

INLINE v8 vmax(v8 a, v8 b) {
    const v8i gt = a > b;
    return (v8)(((v8i)a & gt) | ((v8i)b & ~gt));
}

/* exp(x) for x <= 0 (scores minus their max): Cephes' expf polynomial on x - n ln 2, scaled by 2^n through
 * the exponent bits; within 2 ulp of expf where exp(x) is a normal number, ~1e-38 below -87. */
INLINE v8 vexp_nonpos(v8 x) {
    x = vmax(x, BC(-87.0f));
    const v8 n = (x * BC(1.44269504088896341f) + BC(12582912.0f)) - BC(12582912.0f); /* round(x / ln 2) */
    const v8 r = x - n * BC(0.693359375f) + n * BC(2.12194440e-4f);
    v8 p = BC(1.9875691500e-4f);
    p = p * r + BC(1.3981999507e-3f);
    p = p * r + BC(8.3334519073e-3f);
    p = p * r + BC(4.1665795894e-2f);
    p = p * r + BC(1.6666665459e-1f);
    p = p * r + BC(5.0000001201e-1f);
    p = p * r * r + r + BC(1.0f);
    const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8)bits;
}

/* 8 elements of a row, as float32 */
INLINE v8 load8(int dtype, const void *base, int64_t i) {
    if (dtype == 0) return LD((const float *)base + i);
    const v8i w = __builtin_convertvector(*(const v8hu *)((const uint16_t *)base + i), v8i);
    return (v8)(w << 16);
}

INLINE void store8(int dtype, void *base, int64_t i, v8 x) {
    if (dtype == 0) {
        ST((float *)base + i, x);
        return;
    }
    const v8w u = (v8w)x;
    const v8w r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; /* round to nearest even, as torch does */
    *(v8hu *)((uint16_t *)base + i) = __builtin_convertvector(r, v8h);
}

/* A silenced head (head mask 0): zeros in its columns of the pair's nq output rows from q0. */
INLINE void silence(int dtype, void *out, int64_t o_stride, int64_t q0, int64_t nq, int64_t col, int64_t hs) {
    for (int64_t i = 0; i < nq; i++)
        for (int64_t d = 0; d < hs; d += 8) store8(dtype, out, (q0 + i) * o_stride + col + d, BC(0.0f));
}

/* __builtin_shufflevector: GCC 12 and clang alike */
#define SHUF_lo(a, b) __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13)
#define SHUF_hi(a, b) __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15)
#define SHUF_ll(a, b) __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13)
#define SHUF_hh(a, b) __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15)
#define SHUF_f0(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
#define SHUF_f1(a, b) __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15)

/* The 8 x 8 block transposed: c[k] = (r[0][k], ..., r[7][k]). */
INLINE void transpose8(const v8 r[8], v8 c[8]) {
    v8 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = SHUF_lo(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = SHUF_hi(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = SHUF_ll(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = SHUF_hh(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = SHUF_ll(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = SHUF_hh(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        c[k] = SHUF_f0(u[k], u[k + 4]);
        c[k + 4] = SHUF_f1(u[k], u[k + 4]);
    }
}

/* A row of lp scores, L of them real: each replaced by exp(score - max), the rest by ~1e-38 (never read as
 * weights); returns 1 / their sum, or NaN where a score is NaN or infinite, as torch's softmax gives. */
INLINE float softmax_row(float *sr, int64_t L, int64_t lp) {
    for (int64_t j = L; j < lp; j++) sr[j] = -INFINITY;
    v8 m = BC(-INFINITY);
    v8i nan = {0};
    for (int64_t j = 0; j < lp; j += 8) {
        const v8 x = LD(sr + j);
        m = vmax(m, x);
        nan |= x != x;
    }
    float mx = m[0];
    int bad = 0;
    for (int i = 0; i < 8; i++) mx = m[i] > mx ? m[i] : mx, bad |= nan[i];
    v8 sum = {0};
    for (int64_t j = 0; j < lp; j += 8) {
        const v8 e = vexp_nonpos(LD(sr + j) - BC(mx));
        ST(sr + j, e);
        sum += e;
    }
    if (bad || !(mx <= 3.4e38f)) return NAN;
    return 1.0f / (sum[0] + sum[1] + sum[2] + sum[3] + sum[4] + sum[5] + sum[6] + sum[7]);
}

/* One (pair, head). kt: hs x lp, the keys transposed (columns past L hold copies of real keys, never used);
 * vv: L rows of hs, vs apart; qq: nq rows of hs, already scaled; s: QB x lp scratch; ctx: nq rows of hs.
 * hs is a multiple of 8. */
INLINE void attend(const float *restrict kt, const float *restrict vv, int64_t vs, const float *restrict qq,
                   float *restrict ctx, float *restrict s, int64_t L, int64_t lp, int64_t hs, int64_t nq) {
    for (int64_t i0 = 0; i0 < nq; i0 += QB) {
        const int64_t nb = nq - i0 < QB ? nq - i0 : QB;
        const float *q0 = qq + i0 * hs; /* rows past the block's repeat its first (computed, not used) */
        const float *q1 = q0 + (nb > 1) * hs, *q2 = q0 + (nb > 2) * 2 * hs, *q3 = q0 + (nb > 3) * 3 * hs;
        for (int64_t j = 0; j < lp; j += 16) { /* scores: QB rows x 16 keys in 8 accumulators */
            v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
            for (int64_t d = 0; d < hs; d++) {
                const v8 k0 = LD(kt + d * lp + j), k1 = LD(kt + d * lp + j + 8);
                v8 b = BC(q0[d]);
                a00 += b * k0, a01 += b * k1;
                b = BC(q1[d]);
                a10 += b * k0, a11 += b * k1;
                b = BC(q2[d]);
                a20 += b * k0, a21 += b * k1;
                b = BC(q3[d]);
                a30 += b * k0, a31 += b * k1;
            }
            ST(s + j, a00), ST(s + j + 8, a01), ST(s + lp + j, a10), ST(s + lp + j + 8, a11);
            ST(s + 2 * lp + j, a20), ST(s + 2 * lp + j + 8, a21);
            ST(s + 3 * lp + j, a30), ST(s + 3 * lp + j + 8, a31);
        }
        float inv[QB];
        for (int64_t r = 0; r < nb; r++) { /* softmax over the pair's L keys, normalised at the end */
            float *sr = s + r * lp;
            inv[r] = softmax_row(sr, L, lp);
        }
        for (int64_t r = 0; r < nb; r += 2) { /* context: 2 rows x 32 columns of the head at a time */
            const float *p0 = s + r * lp, *p1 = s + (r + 1 < nb ? r + 1 : r) * lp;
            int64_t d0 = 0;
            for (; d0 + 32 <= hs; d0 += 32) {
                v8 c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0}, c10 = {0}, c11 = {0}, c12 = {0}, c13 = {0};
                for (int64_t j = 0; j < L; j++) {
                    const float *vj = vv + j * vs + d0;
                    const v8 v0 = LD(vj), v1 = LD(vj + 8), v2 = LD(vj + 16), v3 = LD(vj + 24);
                    v8 b = BC(p0[j]);
                    c00 += b * v0, c01 += b * v1, c02 += b * v2, c03 += b * v3;
                    b = BC(p1[j]);
                    c10 += b * v0, c11 += b * v1, c12 += b * v2, c13 += b * v3;
                }
                float *o = ctx + (i0 + r) * hs + d0;
                const v8 w0 = BC(inv[r]);
                ST(o, c00 * w0), ST(o + 8, c01 * w0), ST(o + 16, c02 * w0), ST(o + 24, c03 * w0);
                if (r + 1 < nb) {
                    const v8 w1 = BC(inv[r + 1]);
                    o += hs;
                    ST(o, c10 * w1), ST(o + 8, c11 * w1), ST(o + 16, c12 * w1), ST(o + 24, c13 * w1);
                }
            }
            for (; d0 < hs; d0 += 8) { /* head sizes that are not a multiple of 32: 8 columns at a time */
                v8 c0 = {0}, c1 = {0};
                for (int64_t j = 0; j < L; j++) {
                    const v8 v0 = LD(vv + j * vs + d0);
                    c0 += BC(p0[j]) * v0, c1 += BC(p1[j]) * v0;
                }
                float *o = ctx + (i0 + r) * hs + d0;
                ST(o, c0 * BC(inv[r]));
                if (r + 1 < nb) ST(o + hs, c1 * BC(inv[r + 1]));
            }
        }
    }
}

#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__)) && !defined(QTREL_NO_CLONES)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES /* other architectures, or one ISA forced by the flags (the tests build each): as compiled */
#endif

CLONES static void run(int dtype, const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                int64_t v_stride, void *out, int64_t o_stride, const int64_t *qstart, const int64_t *qlen,
                const int64_t *kstart, const int64_t *klen, int64_t u0, int64_t u1, int64_t nh, int64_t hs,
                float scale, const float *head_mask, float *buf, int64_t maxk, int64_t maxq) {
    const int64_t maxlp = (maxk + 15) / 16 * 16;
    float *kt = buf, *vv = kt + hs * maxlp, *qq = vv + maxk * hs, *ctx = qq + maxq * hs, *s = ctx + maxq * hs;
    for (int64_t u = u0; u < u1; u++) { /* unit u: pair u / nh, head u % nh */
        const int64_t p = u / nh, h = u % nh;
        const int64_t L = klen[p], nq = qlen[p], lp = (L + 15) / 16 * 16, k0 = kstart[p], q0 = qstart[p];
        if (L == 0 || nq == 0) continue;
        const int64_t col = h * hs;
        const float w = head_mask ? head_mask[h] : 1.0f;
        if (w == 0.0f) { /* a silenced head contributes zeros */
            silence(dtype, out, o_stride, q0, nq, col, hs);
            continue;
        }
        for (int64_t j0 = 0; j0 < lp; j0 += 8) /* keys transposed, 8 x 8 at a time */
            for (int64_t d0 = 0; d0 < hs; d0 += 8) {
                v8 r[8], c[8];
                for (int i = 0; i < 8; i++) { /* rows past L repeat the last key */
                    const int64_t j = j0 + i < L ? j0 + i : L - 1;
                    r[i] = load8(dtype, k, (k0 + j) * k_stride + col + d0);
                }
                transpose8(r, c);
                for (int i = 0; i < 8; i++) ST(kt + (d0 + i) * lp + j0, c[i]);
            }
        const float *vsrc = (const float *)v + k0 * v_stride + col; /* float32: read in place */
        int64_t vs = v_stride;
        if (dtype != 0) {
            for (int64_t j = 0; j < L; j++)
                for (int64_t d = 0; d < hs; d += 8) ST(vv + j * hs + d, load8(dtype, v, (k0 + j) * v_stride + col + d));
            vsrc = vv, vs = hs;
        }
        for (int64_t i = 0; i < nq; i++)
            for (int64_t d = 0; d < hs; d += 8)
                ST(qq + i * hs + d, load8(dtype, q, (q0 + i) * q_stride + col + d) * BC(scale));
        attend(kt, vsrc, vs, qq, ctx, s, L, lp, hs, nq);
        for (int64_t i = 0; i < nq; i++)
            for (int64_t d = 0; d < hs; d += 8)
                store8(dtype, out, (q0 + i) * o_stride + col + d, LD(ctx + i * hs + d) * BC(w));
    }
}

/* Residual add and LayerNorm in one pass over the rows (qtrel_add_layer_norm): torch runs them as two ops, each
 * a pass over memory and a dispatch, ~12% of the bfloat16 forward on Sapphire Rapids (docs/benchmarks.md). The
 * sum stays float32 (torch rounds it to the dtype before the norm), so bfloat16 output can differ from torch's
 * by one rounding. gb: 2 x width floats, gamma then beta, converted once per call; s: width floats of scratch. */
INLINE float hsum8(v8 a) { return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7]; }

CLONES static void add_norm(int dtype, const void *x, int64_t xs, const void *r, int64_t rs, const float *gb, void *out,
                            int64_t os, int64_t i0, int64_t i1, int64_t width, float eps, float *s) {
    const float inv = 1.0f / (float)width;
    for (int64_t i = i0; i < i1; i++) {
        v8 a[4] = {{0}}; /* four sums: one chain of dependent adds would cost its latency per step */
        int64_t j = 0;
        for (; j + 32 <= width; j += 32)
            for (int u = 0; u < 4; u++) {
                const v8 v = load8(dtype, x, i * xs + j + 8 * u) + load8(dtype, r, i * rs + j + 8 * u);
                ST(s + j + 8 * u, v);
                a[u] += v;
            }
        for (; j < width; j += 8) {
            const v8 v = load8(dtype, x, i * xs + j) + load8(dtype, r, i * rs + j);
            ST(s + j, v);
            a[0] += v;
        }
        const float mean = hsum8((a[0] + a[1]) + (a[2] + a[3])) * inv;
        v8 b[4] = {{0}};
        for (j = 0; j + 32 <= width; j += 32) /* two passes, as torch: no cancellation on large means */
            for (int u = 0; u < 4; u++) {
                const v8 d = LD(s + j + 8 * u) - BC(mean);
                b[u] += d * d;
            }
        for (; j < width; j += 8) {
            const v8 d = LD(s + j) - BC(mean);
            b[0] += d * d;
        }
        const float rstd = 1.0f / sqrtf(hsum8((b[0] + b[1]) + (b[2] + b[3])) * inv + eps);
        for (j = 0; j < width; j += 8)
            store8(dtype, out, i * os + j, (LD(s + j) - BC(mean)) * BC(rstd) * LD(gb + j) + LD(gb + width + j));
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define BF16_DOT 1
#define BF16_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma")))

INLINE uint32_t ld32(const uint16_t *p) { /* two bf16, any alignment */
    uint32_t x;
    memcpy(&x, p, 4);
    return x;
}

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define BC16(x) ((v16){(x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x)})

/* vexp_nonpos on 16 lanes (the same polynomial) */
BF16_TARGET static inline v16 vexp16_nonpos(v16 x) {
    x = (v16)_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f));
    const v16 n = (x * BC16(1.44269504088896341f) + BC16(12582912.0f)) - BC16(12582912.0f);
    const v16 r = x - n * BC16(0.693359375f) + n * BC16(2.12194440e-4f);
    v16 p = BC16(1.9875691500e-4f);
    p = p * r + BC16(1.3981999507e-3f);
    p = p * r + BC16(8.3334519073e-3f);
    p = p * r + BC16(4.1665795894e-2f);
    p = p * r + BC16(1.6666665459e-1f);
    p = p * r + BC16(5.0000001201e-1f);
    p = p * r * r + r + BC16(1.0f);
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16)bits;
}

/* The softmax of nb rows of scores (lp floats each, L real) as the other paths' (the row's max subtracted,
 * exp, normalised at the end; NaN where a score is NaN or infinite), on 16 lanes with the padding keys masked
 * out instead of set to -inf and exponentiated: `scale` applied here, the weights written as bf16 to pb
 * (zeros past L), and w / their sum to inv. With the rows' maxima in a pass of their own (each row's chain
 * short, so the core overlaps rows) this ran about 4x faster than softmax_row and its bf16 conversion on
 * Sapphire Rapids, where that had been 65% of the kernel's time. The AVX512-BF16 and AMX paths use it. */
BF16_TARGET static void softmax_rows(const float *s, uint16_t *pb, int64_t nb, int64_t L, int64_t lp, float scale,
                                    float w, float *inv) {
    float mx[16];
    for (int64_t r0 = 0; r0 < nb; r0 += 16) {
        const int64_t n = nb - r0 < 16 ? nb - r0 : 16;
        for (int64_t r = 0; r < n; r++) {
            const float *sr = s + (r0 + r) * lp;
            __m512 m = _mm512_set1_ps(-INFINITY);
            __mmask16 nan = 0;
            for (int64_t j = 0; j < lp; j += 16) {
                const __mmask16 k = j + 16 <= L ? 0xFFFF : j < L ? (__mmask16)((1u << (L - j)) - 1) : 0;
                const __m512 x = _mm512_mask_loadu_ps(m, k, sr + j);
                nan |= _mm512_mask_cmp_ps_mask(k, x, x, _CMP_UNORD_Q);
                m = _mm512_max_ps(m, x);
            }
            mx[r] = nan ? NAN : _mm512_reduce_max_ps(m);
        }
        for (int64_t r = 0; r < n; r++) {
            const float *sr = s + (r0 + r) * lp;
            __m512 sum = _mm512_setzero_ps();
            const __m512 msc = _mm512_set1_ps(mx[r] * scale), sc = _mm512_set1_ps(scale);
            for (int64_t j = 0; j < lp; j += 16) {
                const __mmask16 k = j + 16 <= L ? 0xFFFF : j < L ? (__mmask16)((1u << (L - j)) - 1) : 0;
                const __m512 x = _mm512_min_ps(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), sc, msc), _mm512_setzero_ps());
                const __m512 e = _mm512_maskz_mov_ps(k, (__m512)vexp16_nonpos((v16)x));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256((__m256i *)(pb + (r0 + r) * lp + j), (__m256i)_mm512_cvtneps_pbh(e));
            }
            inv[r0 + r] = !(mx[r] <= 3.4e38f) ? NAN : w / _mm512_reduce_add_ps(sum); /* NaN or inf in the row */
        }
    }
}

/* bfloat16 input on CPUs with AVX512-BF16: both products as `vdpbf16ps` (two bf16 products summed into each
 * float32 lane), half the instructions of the float32 path. The scores' products are exact as before (bf16 x
 * bf16 fits float32); the context rounds the softmax weights to bf16 first, as torch's bf16 kernels do.
 * kt2: (hs / 2) x lp pairs of d, the keys transposed (columns past L repeat real keys, never used); vv2: the
 * values as pairs of consecutive keys, ((L + 1) / 2) x hs (an odd L's last pair padded with a zero key);
 * q: nq rows of bf16, q_stride apart; s: QB x lp floats; pb: QB x lp bf16; ctx: nq x hs floats. */
BF16_TARGET static void attend_bf16(const uint32_t *restrict kt2, const uint32_t *restrict vv2,
                                    const uint16_t *restrict q, int64_t q_stride, float scale, float *restrict ctx,
                                    float *restrict s, uint16_t *restrict pb, int64_t L, int64_t lp, int64_t hs,
                                    int64_t nq) {
    const int64_t h2 = hs / 2, L2 = (L + 1) / 2;
    for (int64_t i0 = 0; i0 < nq; i0 += QB) {
        const int64_t nb = nq - i0 < QB ? nq - i0 : QB;
        const uint16_t *q0 = q + i0 * q_stride; /* rows past the block's repeat its first (computed, not used) */
        const uint16_t *q1 = q0 + (nb > 1) * q_stride, *q2 = q0 + (nb > 2) * 2 * q_stride,
                       *q3 = q0 + (nb > 3) * 3 * q_stride;
        for (int64_t j = 0; j < lp; j += 16) {
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                   a31 = a00;
            for (int64_t d2 = 0; d2 < h2; d2++) {
                const __m256bh k0 = (__m256bh)_mm256_loadu_si256((const __m256i *)(kt2 + d2 * lp + j));
                const __m256bh k1 = (__m256bh)_mm256_loadu_si256((const __m256i *)(kt2 + d2 * lp + j + 8));
                __m256bh b = (__m256bh)_mm256_set1_epi32((int)ld32(q0 + 2 * d2));
                a00 = _mm256_dpbf16_ps(a00, b, k0), a01 = _mm256_dpbf16_ps(a01, b, k1);
                b = (__m256bh)_mm256_set1_epi32((int)ld32(q1 + 2 * d2));
                a10 = _mm256_dpbf16_ps(a10, b, k0), a11 = _mm256_dpbf16_ps(a11, b, k1);
                b = (__m256bh)_mm256_set1_epi32((int)ld32(q2 + 2 * d2));
                a20 = _mm256_dpbf16_ps(a20, b, k0), a21 = _mm256_dpbf16_ps(a21, b, k1);
                b = (__m256bh)_mm256_set1_epi32((int)ld32(q3 + 2 * d2));
                a30 = _mm256_dpbf16_ps(a30, b, k0), a31 = _mm256_dpbf16_ps(a31, b, k1);
            }
            const __m256 sc = _mm256_set1_ps(scale);
            _mm256_storeu_ps(s + j, _mm256_mul_ps(a00, sc)), _mm256_storeu_ps(s + j + 8, _mm256_mul_ps(a01, sc));
            _mm256_storeu_ps(s + lp + j, _mm256_mul_ps(a10, sc));
            _mm256_storeu_ps(s + lp + j + 8, _mm256_mul_ps(a11, sc));
            _mm256_storeu_ps(s + 2 * lp + j, _mm256_mul_ps(a20, sc));
            _mm256_storeu_ps(s + 2 * lp + j + 8, _mm256_mul_ps(a21, sc));
            _mm256_storeu_ps(s + 3 * lp + j, _mm256_mul_ps(a30, sc));
            _mm256_storeu_ps(s + 3 * lp + j + 8, _mm256_mul_ps(a31, sc));
        }
        float inv[QB];
        softmax_rows(s, pb, nb, L, lp, 1.0f, 1.0f, inv); /* the weights to bf16, zero past L */
        for (int64_t r = 0; r < nb; r += 2) { /* context: 2 rows x 32 columns, two keys per instruction */
            const uint16_t *p0 = pb + r * lp, *p1 = pb + (r + 1 < nb ? r + 1 : r) * lp;
            int64_t d0 = 0;
            for (; d0 + 32 <= hs; d0 += 32) {
                __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00,
                       c13 = c00;
                for (int64_t j2 = 0; j2 < L2; j2++) {
                    const uint32_t *vj = vv2 + j2 * hs + d0;
                    const __m256bh v0 = (__m256bh)_mm256_loadu_si256((const __m256i *)vj);
                    const __m256bh v1 = (__m256bh)_mm256_loadu_si256((const __m256i *)(vj + 8));
                    const __m256bh v2 = (__m256bh)_mm256_loadu_si256((const __m256i *)(vj + 16));
                    const __m256bh v3 = (__m256bh)_mm256_loadu_si256((const __m256i *)(vj + 24));
                    __m256bh b = (__m256bh)_mm256_set1_epi32((int)ld32(p0 + 2 * j2));
                    c00 = _mm256_dpbf16_ps(c00, b, v0), c01 = _mm256_dpbf16_ps(c01, b, v1);
                    c02 = _mm256_dpbf16_ps(c02, b, v2), c03 = _mm256_dpbf16_ps(c03, b, v3);
                    b = (__m256bh)_mm256_set1_epi32((int)ld32(p1 + 2 * j2));
                    c10 = _mm256_dpbf16_ps(c10, b, v0), c11 = _mm256_dpbf16_ps(c11, b, v1);
                    c12 = _mm256_dpbf16_ps(c12, b, v2), c13 = _mm256_dpbf16_ps(c13, b, v3);
                }
                float *o = ctx + (i0 + r) * hs + d0;
                const __m256 w0 = _mm256_set1_ps(inv[r]);
                _mm256_storeu_ps(o, _mm256_mul_ps(c00, w0)), _mm256_storeu_ps(o + 8, _mm256_mul_ps(c01, w0));
                _mm256_storeu_ps(o + 16, _mm256_mul_ps(c02, w0)), _mm256_storeu_ps(o + 24, _mm256_mul_ps(c03, w0));
                if (r + 1 < nb) {
                    const __m256 w1 = _mm256_set1_ps(inv[r + 1]);
                    o += hs;
                    _mm256_storeu_ps(o, _mm256_mul_ps(c10, w1)), _mm256_storeu_ps(o + 8, _mm256_mul_ps(c11, w1));
                    _mm256_storeu_ps(o + 16, _mm256_mul_ps(c12, w1));
                    _mm256_storeu_ps(o + 24, _mm256_mul_ps(c13, w1));
                }
            }
            for (; d0 < hs; d0 += 8) { /* head sizes that are not a multiple of 32 */
                __m256 c0 = _mm256_setzero_ps(), c1 = c0;
                for (int64_t j2 = 0; j2 < L2; j2++) {
                    const __m256bh v0 = (__m256bh)_mm256_loadu_si256((const __m256i *)(vv2 + j2 * hs + d0));
                    c0 = _mm256_dpbf16_ps(c0, (__m256bh)_mm256_set1_epi32((int)ld32(p0 + 2 * j2)), v0);
                    c1 = _mm256_dpbf16_ps(c1, (__m256bh)_mm256_set1_epi32((int)ld32(p1 + 2 * j2)), v0);
                }
                float *o = ctx + (i0 + r) * hs + d0;
                _mm256_storeu_ps(o, _mm256_mul_ps(c0, _mm256_set1_ps(inv[r])));
                if (r + 1 < nb) _mm256_storeu_ps(o + hs, _mm256_mul_ps(c1, _mm256_set1_ps(inv[r + 1])));
            }
        }
    }
}

/* One (pair, head)'s keys and values, from k0 on in columns col .. col + hs - 1, in the layouts both bf16 paths
 * read (which are also AMX's VNNI layout). kt2: (hs / 2) x lp, the keys transposed as pairs of d (columns past L
 * repeat the last key, never weighted). vv2: vrows x hs, the values interleaved by pairs of keys, the keys past L
 * zero (an odd L's last pair; the AMX path's padding rows), so that a zero weight never meets junk. */
/* add_norm on 16 lanes where the CPU has AVX512-BF16 (whose conversion rounds to nearest even, as store8 does):
 * half the instructions of the 8-lane code, 80 against 146 us on 830 rows of 384 bf16 (Sapphire Rapids). */
BF16_TARGET static inline __m512 ld16(int dtype, const void *base, int64_t i) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

BF16_TARGET static inline void st16(int dtype, void *base, int64_t i, __m512 x) {
    if (dtype == 0)
        _mm512_storeu_ps((float *)base + i, x);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), (__m256i)_mm512_cvtneps_pbh(x));
}

BF16_TARGET static void add_norm16(int dtype, const void *x, int64_t xs, const void *r, int64_t rs, const float *gb,
                                   void *out, int64_t os, int64_t i0, int64_t i1, int64_t width, float eps, float *s) {
    const float inv = 1.0f / (float)width;
    for (int64_t i = i0; i < i1; i++) {
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        int64_t j = 0;
        for (; j + 64 <= width; j += 64)
            for (int u = 0; u < 4; u++) {
                const __m512 v = _mm512_add_ps(ld16(dtype, x, i * xs + j + 16 * u), ld16(dtype, r, i * rs + j + 16 * u));
                _mm512_storeu_ps(s + j + 16 * u, v);
                a[u] = _mm512_add_ps(a[u], v);
            }
        for (; j < width; j += 16) {
            const __m512 v = _mm512_add_ps(ld16(dtype, x, i * xs + j), ld16(dtype, r, i * rs + j));
            _mm512_storeu_ps(s + j, v);
            a[0] = _mm512_add_ps(a[0], v);
        }
        const __m512 mean = _mm512_set1_ps(
            _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]))) * inv);
        __m512 b[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (j = 0; j + 64 <= width; j += 64)
            for (int u = 0; u < 4; u++) {
                const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(s + j + 16 * u), mean);
                b[u] = _mm512_fmadd_ps(d, d, b[u]);
            }
        for (; j < width; j += 16) {
            const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(s + j), mean);
            b[0] = _mm512_fmadd_ps(d, d, b[0]);
        }
        const float var = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(b[0], b[1]), _mm512_add_ps(b[2], b[3])));
        const __m512 rstd = _mm512_set1_ps(1.0f / sqrtf(var * inv + eps));
        for (j = 0; j < width; j += 16) {
            const __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), mean), rstd);
            st16(dtype, out, i * os + j, _mm512_fmadd_ps(y, _mm512_loadu_ps(gb + j), _mm512_loadu_ps(gb + width + j)));
        }
    }
}

BF16_TARGET static void pack_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                                     int64_t k0, int64_t col, int64_t L, int64_t lp, int64_t hs, int64_t vrows,
                                     uint32_t *kt2, uint32_t *vv2) {
    const int64_t h2 = hs / 2;
    for (int64_t j0 = 0; j0 < lp; j0 += 8) { /* 8 keys x 8 pairs of d at a time */
        const uint16_t *kr[8];
        for (int i = 0; i < 8; i++) kr[i] = k + (k0 + (j0 + i < L ? j0 + i : L - 1)) * k_stride + col;
        int64_t d2 = 0;
        for (; d2 + 8 <= h2; d2 += 8) {
            v8 r[8], c[8];
            for (int i = 0; i < 8; i++) memcpy(&r[i], kr[i] + 2 * d2, 32);
            transpose8(r, c); /* bits moved, not computed on */
            for (int i = 0; i < 8; i++) ST(kt2 + (d2 + i) * lp + j0, c[i]);
        }
        for (; d2 < h2; d2++)
            for (int i = 0; i < 8; i++) kt2[d2 * lp + j0 + i] = ld32(kr[i] + 2 * d2);
    }
    for (int64_t j2 = 0; j2 < vrows; j2++) {
        uint32_t *row = vv2 + j2 * hs;
        if (2 * j2 >= L) {
            memset(row, 0, 4 * hs);
            continue;
        }
        const uint16_t *a = v + (k0 + 2 * j2) * v_stride + col;
        const uint16_t *b = 2 * j2 + 1 < L ? a + v_stride : NULL;
        for (int64_t d = 0; d < hs; d += 8) {
            const __m128i x = _mm_loadu_si128((const __m128i *)(a + d));
            const __m128i y = b ? _mm_loadu_si128((const __m128i *)(b + d)) : _mm_setzero_si128();
            _mm_storeu_si128((__m128i *)(row + d), _mm_unpacklo_epi16(x, y));
            _mm_storeu_si128((__m128i *)(row + d + 4), _mm_unpackhi_epi16(x, y));
        }
    }
}

/* `run` for bfloat16 on AVX512-BF16: the same units, each through attend_bf16. */
BF16_TARGET static void run_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                                 const uint16_t *v, int64_t v_stride, uint16_t *out, int64_t o_stride,
                                 const int64_t *qstart, const int64_t *qlen, const int64_t *kstart, const int64_t *klen,
                                 int64_t u0, int64_t u1, int64_t nh, int64_t hs, float scale, const float *head_mask,
                                 float *buf, int64_t maxk, int64_t maxq) {
    const int64_t maxlp = (maxk + 15) / 16 * 16, h2 = hs / 2;
    uint32_t *kt2 = (uint32_t *)buf, *vv2 = kt2 + h2 * maxlp;
    float *ctx = (float *)(vv2 + (maxk + 1) / 2 * hs), *s = ctx + maxq * hs;
    uint16_t *pb = (uint16_t *)(s + QB * maxlp);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t p = u / nh, h = u % nh;
        const int64_t L = klen[p], nq = qlen[p], lp = (L + 15) / 16 * 16, k0 = kstart[p], q0 = qstart[p];
        if (L == 0 || nq == 0) continue;
        const int64_t col = h * hs;
        const float w = head_mask ? head_mask[h] : 1.0f;
        if (w == 0.0f) {
            silence(1, out, o_stride, q0, nq, col, hs);
            continue;
        }
        pack_kv_bf16(k, k_stride, v, v_stride, k0, col, L, lp, hs, (L + 1) / 2, kt2, vv2);
        attend_bf16(kt2, vv2, q + q0 * q_stride + col, q_stride, scale, ctx, s, pb, L, lp, hs, nq);
        for (int64_t i = 0; i < nq; i++)
            for (int64_t d = 0; d < hs; d += 8)
                store8(1, out, (q0 + i) * o_stride + col + d, LD(ctx + i * hs + d) * BC(w));
    }
}
#endif

#if defined(BF16_DOT) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#define AMX_TARGET                                                                                                   \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma")))
#define TQ 16 /* query rows per tile */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* Whether the CPU has AMX-BF16 tiles and the kernel (Linux) lets this process use them. */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return 0;
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* c (16 rows x 32 floats, c_stride bytes apart) = the sum over `steps` of a (16 rows x 32 bf16, a_stride bytes
 * apart; each step 64 bytes on) times b (16 rows of VNNI pairs, b_stride bytes apart, its two 16-column tiles 64
 * bytes apart; each step b_step bytes on). Tiles 0 and 3 accumulate, two products in flight; 1 takes a, 2 and 4 b. */
AMX_TARGET static inline void tiles_16x32(const void *a, int64_t a_stride, const void *b, int64_t b_stride,
                                          int64_t b_step, int64_t steps, float *c, int64_t c_stride) {
    _tile_zero(0);
    _tile_zero(3);
    for (int64_t i = 0; i < steps; i++) {
        _tile_loadd(1, (const char *)a + 64 * i, a_stride);
        _tile_loadd(2, (const char *)b + b_step * i, b_stride);
        _tile_loadd(4, (const char *)b + b_step * i + 64, b_stride);
        _tile_dpbf16ps(0, 1, 2);
        _tile_dpbf16ps(3, 1, 4);
    }
    _tile_stored(0, c, c_stride);
    _tile_stored(3, c + 16, c_stride);
}

/* `run_bf16` on AMX tiles, for head sizes that are multiples of 32: per (pair, head), the scores of 16 query
 * rows at a time as 16 x 16 tiles (Q: 16 rows x 32 bf16 of d; K^T as pairs of d, the layout `run_bf16` builds),
 * the softmax on AVX-512 as the other paths', the weights rounded to bf16, then the context as 16 x 16 tiles
 * (weights: 16 rows x 32 keys; V as pairs of keys). Keys are padded to a multiple of 32 with zero weights and
 * zero values (tiles_16x32 does the products). Scratch: kt2 (hs / 2) x lp u32, vv2 (lp / 2) x hs u32, qb TQ x hs
 * bf16, s TQ x lp floats, pb TQ x lp bf16, ctx TQ x hs floats. */
AMX_TARGET static void run_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                               const uint16_t *v, int64_t v_stride, uint16_t *out, int64_t o_stride,
                               const int64_t *qstart, const int64_t *qlen, const int64_t *kstart, const int64_t *klen,
                               int64_t u0, int64_t u1, int64_t nh, int64_t hs, float scale, const float *head_mask,
                               float *buf, int64_t maxk) {
    const int64_t maxlp = (maxk + 31) / 32 * 32, h2 = hs / 2;
    uint32_t *kt2 = (uint32_t *)buf, *vv2 = kt2 + h2 * maxlp;
    uint16_t *qb = (uint16_t *)(vv2 + maxlp / 2 * hs);
    float *s = (float *)(qb + TQ * hs), *ctx = s + TQ * maxlp;
    uint16_t *pb = (uint16_t *)(ctx + TQ * hs);
    tilecfg_t cfg = {0}, was;
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_storeconfig(&was);
    _tile_loadconfig(&cfg);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t p = u / nh, h = u % nh;
        const int64_t L = klen[p], nq = qlen[p], lp = (L + 31) / 32 * 32, k0 = kstart[p], q0 = qstart[p];
        if (L == 0 || nq == 0) continue;
        const int64_t col = h * hs;
        const float w = head_mask ? head_mask[h] : 1.0f;
        if (w == 0.0f) {
            silence(1, out, o_stride, q0, nq, col, hs);
            continue;
        }
        pack_kv_bf16(k, k_stride, v, v_stride, k0, col, L, lp, hs, lp / 2, kt2, vv2);
        for (int64_t i0 = 0; i0 < nq; i0 += TQ) {
            const int64_t nb = nq - i0 < TQ ? nq - i0 : TQ; /* tile rows past nb: stale, computed, never read */
            const uint16_t *qa = q + (q0 + i0) * q_stride + col; /* a whole tile of query rows: read in place */
            int64_t qs = q_stride;
            if (nb < TQ) { /* the last rows: copied, so that the tile reads nothing past the tensor */
                for (int64_t r = 0; r < nb; r++)
                    for (int64_t d = 0; d < hs; d += 16)
                        _mm256_storeu_si256((__m256i *)(qb + r * hs + d), _mm256_loadu_si256((const __m256i *)(qa + r * q_stride + d)));
                qa = qb, qs = hs;
            }
            for (int64_t j = 0; j < lp; j += 32) /* scores: 16 rows x 32 keys a call */
                tiles_16x32(qa, 2 * qs, kt2 + j, 4 * lp, 64 * lp, hs / 32, s + j, 4 * lp);
            float inv[TQ];
            softmax_rows(s, pb, nb, L, lp, scale, w, inv);
            for (int64_t d = 0; d < hs; d += 32) /* context: 16 rows x 32 columns a call */
                tiles_16x32(pb, 2 * lp, vv2 + d, 4 * hs, 64 * hs, lp / 32, ctx + d, 4 * hs);
            for (int64_t r = 0; r < nb; r++) { /* rounded to nearest even, as torch does */
                uint16_t *o = out + (q0 + i0 + r) * o_stride + col;
                const __m512 wr = _mm512_set1_ps(inv[r]);
                for (int64_t d = 0; d < hs; d += 16)
                    _mm256_storeu_si256((__m256i *)(o + d),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(ctx + r * hs + d), wr)));
            }
        }
    }
    if (was.palette) /* whoever ran tiles on this thread before finds its configuration as it left it */
        _tile_loadconfig(&was);
    else
        _tile_release();
}

/* run_amx's scratch, in floats */
static int64_t amx_scratch(int64_t hs, int64_t maxk) {
    const int64_t maxlp = (maxk + 31) / 32 * 32;
    return hs / 2 * maxlp + maxlp / 2 * hs + TQ * hs / 2 + TQ * maxlp + TQ * hs + TQ * maxlp / 2 + 16;
}
#endif

/* -1 until asked: then whether this CPU runs run_amx for bfloat16; qtrel_amx(0) turns it off (the A/Bs). */
static int amx = -1;

int qtrel_amx(int want) {
#ifdef AMX
    static int usable = -1;
    if (usable < 0) usable = amx_usable();
    const int can = usable;
#else
    const int can = 0;
#endif
    if (want >= 0 || amx < 0) amx = can && want != 0;
    return amx;
}

/* Whether this CPU runs the BF16_TARGET code (attend_bf16, add_norm16). */
static int cpu_bf16_code(void) {
#ifdef BF16_DOT
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

/* -1 until asked: then whether this CPU runs attend_bf16; qtrel_bf16_dot(0) turns it off (the A/Bs). */
static int bf16_dot = -1;

int qtrel_bf16_dot(int want) {
    if (want >= 0 || bf16_dot < 0) bf16_dot = cpu_bf16_code() && want != 0;
    return bf16_dot;
}

/* Several threads: the OpenMP runtime the process already has (torch's), handed over by the caller
 * (qtrel_use_openmp), so the kernel runs on the team that runs torch's kernels, warm and never
 * oversubscribed; a team of our own, started per call, cost more than it saved (docs/benchmarks.md). */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn gomp_parallel;
static int (*omp_thread_num)(void), (*omp_num_threads)(void);

void qtrel_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    gomp_parallel = (gomp_parallel_fn)parallel;
    omp_thread_num = (int (*)(void))thread_num;
    omp_num_threads = (int (*)(void))num_threads;
}

#define MAX_THREADS 256

/* The parts a call splits into: as many as asked, at most MAX_THREADS and `units`, one without a team. */
static int team_size(int threads, int64_t units) {
    if (!gomp_parallel || threads > MAX_THREADS) threads = threads > MAX_THREADS ? MAX_THREADS : 1;
    if (threads > units) threads = (int)units;
    return threads < 1 ? 1 : threads;
}

typedef struct {
    int dtype;
    const void *q, *k, *v;
    void *out;
    int64_t q_stride, k_stride, v_stride, o_stride, nh, hs, maxk, maxq, per;
    const int64_t *qstart, *qlen, *kstart, *klen;
    float scale;
    const float *head_mask;
    float *buf;
    int64_t bound[MAX_THREADS + 1]; /* part t: units bound[t] .. bound[t + 1] - 1 */
    int parts;
} job_t;

static void run_part(job_t *j, int t) {
#ifdef AMX
    if (j->dtype == 1 && amx == 1 && j->hs % 32 == 0) {
        run_amx(j->q, j->q_stride, j->k, j->k_stride, j->v, j->v_stride, j->out, j->o_stride, j->qstart, j->qlen,
                j->kstart, j->klen, j->bound[t], j->bound[t + 1], j->nh, j->hs, j->scale, j->head_mask,
                j->buf + t * j->per, j->maxk);
        return;
    }
#endif
#ifdef BF16_DOT
    if (j->dtype == 1 && bf16_dot == 1) {
        run_bf16(j->q, j->q_stride, j->k, j->k_stride, j->v, j->v_stride, j->out, j->o_stride, j->qstart, j->qlen,
                 j->kstart, j->klen, j->bound[t], j->bound[t + 1], j->nh, j->hs, j->scale, j->head_mask,
                 j->buf + t * j->per, j->maxk, j->maxq);
        return;
    }
#endif
    run(j->dtype, j->q, j->q_stride, j->k, j->k_stride, j->v, j->v_stride, j->out, j->o_stride, j->qstart, j->qlen,
        j->kstart, j->klen, j->bound[t], j->bound[t + 1], j->nh, j->hs, j->scale, j->head_mask, j->buf + t * j->per,
        j->maxk, j->maxq);
}

static void team_member(void *arg) {
    job_t *j = arg;
    /* a team smaller than asked for (the runtime may give fewer) still covers every part */
    for (int t = omp_thread_num(), n = omp_num_threads(); t < j->parts; t += n) run_part(j, t);
}

/* Returns 0; -1 when scratch memory cannot be had, -2 for a head size that is not a multiple of 8 (nothing
 * written then). The caller checks that every row it names lies inside its tensors. `threads` > 1 splits the
 * (pair, head) units into that many runs of about equal work, on the OpenMP team where one was handed over:
 * each unit is computed as on one thread, so the result is the same bit for bit. */
int qtrel_packed_attention(int dtype, const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                           const void *v, int64_t v_stride, void *out, int64_t o_stride, const int64_t *qstart,
                           const int64_t *qlen, const int64_t *kstart, const int64_t *klen, int64_t npairs,
                           int64_t nh, int64_t hs, float scale, const float *head_mask, int threads) {
    if (hs <= 0 || hs % 8) return -2;
    int64_t maxk = 0, maxq = 0, work = 0;
    for (int64_t p = 0; p < npairs; p++) {
        if (klen[p] > maxk) maxk = klen[p];
        if (qlen[p] > maxq) maxq = qlen[p];
        work += klen[p] * (qlen[p] + 1); /* scores and context, plus the keys' transpose */
    }
    if (maxk == 0 || maxq == 0) return 0;
    if (bf16_dot < 0) qtrel_bf16_dot(-1);
    if (amx < 0) qtrel_amx(-1);
    const int64_t units = npairs * nh;
    work *= nh;
    threads = team_size(threads, units);
    const int64_t maxlp = (maxk + 15) / 16 * 16;
    job_t j = {dtype, q, k, v, out, q_stride, k_stride, v_stride, o_stride, nh, hs, maxk, maxq,
               hs * maxlp + maxk * hs + 2 * maxq * hs + QB * maxlp, qstart, qlen, kstart, klen, scale, head_mask};
    /* per thread: the float32 path's scratch, which also holds run_bf16's (kt2 and pb fit in its hs x lp) */
#ifdef AMX
    if (dtype == 1 && amx == 1 && hs % 32 == 0 && amx_scratch(hs, maxk) > j.per) j.per = amx_scratch(hs, maxk);
#endif
    j.buf = malloc(sizeof(float) * (size_t)(j.per * threads));
    if (!j.buf) return -1;
    j.parts = threads;
    j.bound[0] = 0;
    int t = 1;
    for (int64_t u = 0, done = 0; u < units && t < threads; u++) { /* cut where the work so far passes t/threads */
        done += klen[u / nh] * (qlen[u / nh] + 1);
        if (done * threads >= work * t) j.bound[t++] = u + 1;
    }
    while (t <= threads) j.bound[t++] = units;
    if (threads == 1)
        run_part(&j, 0);
    else
        gomp_parallel(team_member, &j, (unsigned)threads, 0);
    free(j.buf);
    return 0;
}

/* 1: the 16-lane add_norm where it can run; 0: the 8-lane code everywhere (the tests compare the two) */
int qtrel_norm16 = 1;

typedef struct {
    int dtype;
    const void *x, *r;
    void *out;
    int64_t xs, rs, os, rows, width;
    float eps;
    const float *gb;
    float *buf;
    int parts;
} norm_job_t;

typedef void (*norm_fn)(int, const void *, int64_t, const void *, int64_t, const float *, void *, int64_t, int64_t,
                        int64_t, int64_t, float, float *);

/* The 16-lane code where the CPU has AVX512-BF16 and the rows split into 16s; the 8-lane clones elsewhere. */
static norm_fn norm_code(int64_t width) {
#ifdef BF16_DOT
    static int wide = -1;
    if (wide < 0) wide = cpu_bf16_code();
    if (wide && width % 16 == 0 && qtrel_norm16 != 0) return add_norm16;
#endif
    (void)width;
    return add_norm;
}

static void norm_member(void *arg) {
    norm_job_t *j = arg;
    const norm_fn f = norm_code(j->width);
    for (int t = omp_thread_num(), n = omp_num_threads(); t < j->parts; t += n)
        f(j->dtype, j->x, j->xs, j->r, j->rs, j->gb, j->out, j->os, j->rows * t / j->parts, j->rows * (t + 1) / j->parts,
          j->width, j->eps, j->buf + t * j->width);
}

/* out = LayerNorm(x + r) * gamma + beta, row by row; rows are `*s` elements apart and `out` may be x or r
 * (each row is read whole before it is written). gamma and beta are in `dtype`, width of them. Returns 0;
 * -1 when scratch memory cannot be had, -2 for a width that is not a multiple of 8 (nothing written then).
 * `threads` > 1 splits the rows on the OpenMP team where one was handed over; the result is the same. */
int qtrel_add_layer_norm(int dtype, const void *x, int64_t xs, const void *r, int64_t rs, const void *gamma,
                         const void *beta, void *out, int64_t os, int64_t rows, int64_t width, float eps, int threads) {
    if (width <= 0 || width % 8) return -2;
    if (rows <= 0) return 0;
    threads = team_size(threads, rows);
    float *buf = malloc(sizeof(float) * (size_t)(width * (2 + threads)));
    if (!buf) return -1;
    for (int64_t j = 0; j < width; j += 8) {
        ST(buf + j, load8(dtype, gamma, j));
        ST(buf + width + j, load8(dtype, beta, j));
    }
    norm_job_t job = {dtype, x, r, out, xs, rs, os, rows, width, eps, buf, buf + 2 * width, threads};
    if (threads == 1)
        norm_code(width)(dtype, x, xs, r, rs, buf, out, os, 0, rows, width, eps, job.buf);
    else
        gomp_parallel(norm_member, &job, (unsigned)threads, 0);
    free(buf);
    return 0;
}

/* Rotary positions in place on packed rows (ModernBERT's q and k, right after their projection): the `heads`
 * heads of row n (hs elements each from column h * hs; q's heads then k's, one projection's columns) at
 * position pos[n] become x * cos + turn(x) * sin, turn(x) = (-x[hs/2:], x[:hs/2]). `cs` holds float32 rows
 * of cos then sin (2 * hs per position), already rounded to the dtype as transformers rounds them; the
 * arithmetic is float32, rounded once to the dtype, as the reference's. */
CLONES static void rotary_rows(int dtype, void *x, int64_t xs, int64_t r0, int64_t r1, const int64_t *pos,
                               int64_t heads, int64_t hs, const float *cs) {
    const int64_t half = hs / 2, vec = half / 8 * 8;
    for (int64_t n = r0; n < r1; n++) {
        const float *c = cs + pos[n] * 2 * hs, *s = c + hs;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = n * xs + h * hs;
            for (int64_t d = 0; d < vec; d += 8) {
                const v8 a = load8(dtype, x, at + d), b = load8(dtype, x, at + half + d);
                store8(dtype, x, at + d, a * LD(c + d) - b * LD(s + d));
                store8(dtype, x, at + half + d, b * LD(c + half + d) + a * LD(s + half + d));
            }
            for (int64_t d = vec; d < half; d++) { /* head sizes whose half is not a multiple of 8 */
                float a, b;
                if (dtype == 0) {
                    a = ((float *)x)[at + d], b = ((float *)x)[at + half + d];
                    ((float *)x)[at + d] = a * c[d] - b * s[d];
                    ((float *)x)[at + half + d] = b * c[half + d] + a * s[half + d];
                } else {
                    uint16_t *y = x;
                    uint32_t ua = (uint32_t)y[at + d] << 16, ub = (uint32_t)y[at + half + d] << 16, u;
                    memcpy(&a, &ua, 4), memcpy(&b, &ub, 4);
                    const float lo = a * c[d] - b * s[d], hi = b * c[half + d] + a * s[half + d];
                    memcpy(&u, &lo, 4), y[at + d] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
                    memcpy(&u, &hi, 4), y[at + half + d] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
                }
            }
        }
    }
}

typedef struct {
    int dtype;
    void *x;
    int64_t xs, rows, heads, hs;
    const int64_t *pos;
    const float *cs;
    int parts;
} rotary_job_t;

static void rotary_member(void *arg) {
    rotary_job_t *j = arg;
    for (int t = omp_thread_num(), n = omp_num_threads(); t < j->parts; t += n)
        rotary_rows(j->dtype, j->x, j->xs, j->rows * t / j->parts, j->rows * (t + 1) / j->parts, j->pos, j->heads,
                    j->hs, j->cs);
}

/* Returns 0; -2 for an odd head size (nothing written then). The caller checks that every row and position
 * lies inside its tensors. `threads` > 1 splits the rows on the OpenMP team; the result is the same. */
int qtrel_rotary(int dtype, void *x, int64_t xs, int64_t rows, const int64_t *pos, int64_t heads, int64_t hs,
                 const float *cs, int threads) {
    if (hs <= 0 || hs % 2) return -2;
    if (rows <= 0) return 0;
    threads = team_size(threads, rows);
    rotary_job_t job = {dtype, x, xs, rows, heads, hs, pos, cs, threads};
    if (threads == 1)
        rotary_rows(dtype, x, xs, 0, rows, pos, heads, hs, cs);
    else
        gomp_parallel(rotary_member, &job, (unsigned)threads, 0);
    return 0;
}
