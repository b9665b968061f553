/*
 * PowerSGD's three products with the gradient matrix (compressors/powersgd.py): P = M Q, Q = M^T P and
 * M += alpha P Q^T, on AVX-512; elsewhere each returns 0 and the caller uses torch's matmul.
 */
#include "common.h"

/*
 * PowerSGD's P = M Q for the gradient matrix M [rows, cols] and Q [cols, r], r <= SKINNY_RANK, row-major fp32. BLAS
 * runs this tall-skinny product at 2.5-4x a copy's time on some CPUs (MKL on AMD: 17-28 ms for 5000 x 5000 at rank
 * 25, where reading M once takes 7); here 4 rows of M at a time against Q's two 16-lane halves, the partial sums in
 * AVX-512 registers, M read once (9.5 ms). Sums run along each row in blocks of SKINNY_BLOCK terms added into a
 * total, so the rounding error grows with the blocks, not the terms (about BLAS's accuracy); each output is one
 * thread's, in a fixed order: the thread count does not change the bits. Built only where the compiler targets
 * AVX-512 (lg_skinny_available); elsewhere the caller uses torch. (Q = M^T P the same way, a strip of M's columns
 * against P, ran no faster than MKL here: walking a strip down the rows is bound by memory latency.)
 */
#define SKINNY_RANK 32
#define SKINNY_BLOCK 256

/* The rows [0, rows) of a product, four at a time on all threads, then the rest one at a time: EACH(4) and EACH(1)
 * with `i` the first row. */
#define BY_FOUR_ROWS(EACH)                                                                                            \
    do {                                                                                                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * cols > PARALLEL_BLOCKS * 32)")    \
        for (int64_t i = 0; i < rows - rows % 4; i += 4)                                                              \
            EACH(4);                                                                                                  \
        for (int64_t i = rows - rows % 4; i < rows; i++)                                                              \
            EACH(1);                                                                                                  \
    } while (0)

int lg_skinny_available(void)
{
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
static inline __mmask16 lanes_mask(int64_t n)
{
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* P rows [i, i + ROWS) of M Q: ROWS rows of M against Q's two 16-lane halves of columns. */
#define SKINNY_MQ_ROWS(ROWS)                                                                                          \
    do {                                                                                                              \
        __m512 total[ROWS][2], part[ROWS][2];                                                                         \
        for (int a = 0; a < ROWS; a++)                                                                                \
            total[a][0] = total[a][1] = _mm512_setzero_ps();                                                          \
        for (int64_t k0 = 0; k0 < cols; k0 += SKINNY_BLOCK) {                                                        \
            int64_t k1 = k0 + SKINNY_BLOCK < cols ? k0 + SKINNY_BLOCK : cols;                                        \
            for (int a = 0; a < ROWS; a++)                                                                            \
                part[a][0] = part[a][1] = _mm512_setzero_ps();                                                        \
            for (int64_t k = k0; k < k1; k++) {                                                                       \
                __m512 q0 = _mm512_maskz_loadu_ps(low, q + k * r);                                                    \
                __m512 q1 = r > 16 ? _mm512_maskz_loadu_ps(high, q + k * r + 16) : _mm512_setzero_ps();              \
                for (int a = 0; a < ROWS; a++) {                                                                      \
                    __m512 b = _mm512_set1_ps(m[(i + a) * cols + k]);                                                 \
                    part[a][0] = _mm512_fmadd_ps(b, q0, part[a][0]);                                                  \
                    part[a][1] = _mm512_fmadd_ps(b, q1, part[a][1]);                                                  \
                }                                                                                                     \
            }                                                                                                         \
            for (int a = 0; a < ROWS; a++) {                                                                          \
                total[a][0] = _mm512_add_ps(total[a][0], part[a][0]);                                                 \
                total[a][1] = _mm512_add_ps(total[a][1], part[a][1]);                                                 \
            }                                                                                                         \
        }                                                                                                             \
        for (int a = 0; a < ROWS; a++) {                                                                              \
            _mm512_mask_storeu_ps(p + (i + a) * r, low, total[a][0]);                                                 \
            if (r > 16)                                                                                               \
                _mm512_mask_storeu_ps(p + (i + a) * r + 16, high, total[a][1]);                                       \
        }                                                                                                             \
    } while (0)
#endif

int lg_skinny_mq(const float *restrict m, int64_t rows, int64_t cols, const float *restrict q, int64_t r,
                 float *restrict p, int threads)
{
#ifdef __AVX512F__
    if (r < 1 || r > SKINNY_RANK || rows < 0 || cols < 0)
        return 0;
    __mmask16 low = lanes_mask(r), high = lanes_mask(r - 16);
    BY_FOUR_ROWS(SKINNY_MQ_ROWS);
    return 1;
#else
    (void)m, (void)rows, (void)cols, (void)q, (void)r, (void)p, (void)threads;
    return 0;
#endif
}

/*
 * PowerSGD's Q = M^T P for M [rows, cols] and P [rows, r], r <= SKINNY_RANK, row-major fp32, streaming M by rows:
 * each thread owns a contiguous range of Q's rows (M's columns) and walks down M four rows at a time, reading its
 * part of each row in order, adding the outer products M[i, k] P[i, :] into Q's rows, which stay in cache. Sums run
 * down each column in blocks of SKINNY_BLOCK rows added into a total (`partial`, scratch of cols x r floats), so
 * the rounding error grows with the blocks, not the terms; each output is one thread's, summed in row order: the
 * thread count does not change the bits.
 */
#ifdef __AVX512F__
#define SKINNY_MTP_ROWS(ROWS)                                                                                         \
    do {                                                                                                              \
        __m512 p0[ROWS], p1[ROWS];                                                                                    \
        for (int a = 0; a < ROWS; a++) {                                                                              \
            p0[a] = _mm512_maskz_loadu_ps(low, p + (i + a) * r);                                                      \
            p1[a] = r > 16 ? _mm512_maskz_loadu_ps(high, p + (i + a) * r + 16) : _mm512_setzero_ps();                \
        }                                                                                                             \
        for (int64_t k = first; k < last; k++) {                                                                      \
            float *row = partial + k * stride;                                                                        \
            __m512 s0 = _mm512_load_ps(row), s1 = stride > 16 ? _mm512_load_ps(row + 16) : _mm512_setzero_ps();      \
            for (int a = 0; a < ROWS; a++) {                                                                          \
                __m512 b = _mm512_set1_ps(m[(i + a) * cols + k]);                                                     \
                s0 = _mm512_fmadd_ps(b, p0[a], s0);                                                                   \
                s1 = _mm512_fmadd_ps(b, p1[a], s1);                                                                   \
            }                                                                                                         \
            _mm512_store_ps(row, s0);                                                                                 \
            if (stride > 16)                                                                                          \
                _mm512_store_ps(row + 16, s1);                                                                        \
        }                                                                                                             \
    } while (0)
#endif

int lg_skinny_mtp(const float *restrict m, int64_t rows, int64_t cols, const float *restrict p, int64_t r,
                  float *restrict q, float *restrict partial, int threads)
{
#ifdef __AVX512F__
    if (r < 1 || r > SKINNY_RANK || rows < 0 || cols < 0 || (uintptr_t)partial % 64 != 0)
        return 0;
    __mmask16 low = lanes_mask(r), high = lanes_mask(r - 16);
    /* The partial sums' rows padded to whole, aligned vectors (P's lanes past r are zero): masked stores of rows
     * packed r floats apart overlapped the next row's loads, which waited for them (four times slower). */
    int64_t stride = r > 16 ? 32 : 16;
#pragma omp parallel num_threads(threads) if (rows * cols > PARALLEL_BLOCKS * 32)
    {
        int part = 0, parts = 1;
#ifdef _OPENMP
        part = omp_get_thread_num();
        parts = omp_get_num_threads();
#endif
        int64_t first = cols * part / parts, last = cols * (part + 1) / parts;
        memset(q + first * r, 0, (size_t)((last - first) * r) * sizeof(float));
        for (int64_t i0 = 0; i0 < rows; i0 += SKINNY_BLOCK) {
            int64_t i1 = i0 + SKINNY_BLOCK < rows ? i0 + SKINNY_BLOCK : rows, i = i0;
            memset(partial + first * stride, 0, (size_t)((last - first) * stride) * sizeof(float));
            for (; i + 4 <= i1; i += 4)
                SKINNY_MTP_ROWS(4);
            for (; i < i1; i++)
                SKINNY_MTP_ROWS(1);
            for (int64_t k = first; k < last; k++)
                for (int64_t j = 0; j < r; j++)
                    q[k * r + j] += partial[k * stride + j];
        }
    }
    return 1;
#else
    (void)m, (void)rows, (void)cols, (void)p, (void)r, (void)q, (void)partial, (void)threads;
    return 0;
#endif
}

/*
 * PowerSGD's decode and residual: C += alpha P Q^T for C [rows, cols], P [rows, r] and Q^T given as qt [r, cols]
 * (rows contiguous), r <= SKINNY_RANK, row-major fp32; with a divisor (> 0), C = P Q^T / divisor instead, C not read
 * (the hook's average of the summed factors). Four rows of C a step, sixteen columns at a time: each output's sum
 * over the r terms in a register from zero, then C + alpha * sum in one rounding, or sum / divisor (on this project's
 * CPU the same bits as MKL's addmm_ for alpha = +-1 and powers of two, and as its mm then div_; within an ulp of the
 * sum otherwise). Each output one thread's: the thread count does not change the bits. BLAS took 1.5-2.5x longer on
 * 5000 x 5000 at ranks 1-25.
 */
#ifdef __AVX512F__
#define SKINNY_ADD_ROWS(ROWS)                                                                                         \
    do {                                                                                                              \
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {                                                                   \
            __mmask16 lanes = lanes_mask(cols - c0);                                                                  \
            __m512 sum[ROWS];                                                                                         \
            for (int a = 0; a < ROWS; a++)                                                                            \
                sum[a] = _mm512_setzero_ps();                                                                         \
            for (int64_t j = 0; j < r; j++) {                                                                         \
                __m512 column = _mm512_maskz_loadu_ps(lanes, qt + j * cols + c0);                                     \
                for (int a = 0; a < ROWS; a++)                                                                        \
                    sum[a] = _mm512_fmadd_ps(_mm512_set1_ps(p[(i + a) * r + j]), column, sum[a]);                     \
            }                                                                                                         \
            for (int a = 0; a < ROWS; a++) {                                                                          \
                float *out = c + (i + a) * cols + c0;                                                                 \
                if (divisor > 0.0f)                                                                                   \
                    _mm512_mask_storeu_ps(out, lanes, _mm512_div_ps(sum[a], divide));                                 \
                else                                                                                                  \
                    _mm512_mask_storeu_ps(out, lanes,                                                                 \
                                          _mm512_fmadd_ps(scale, sum[a], _mm512_maskz_loadu_ps(lanes, out)));         \
            }                                                                                                         \
        }                                                                                                             \
    } while (0)
#endif

int lg_skinny_add_pqt(float *restrict c, int64_t rows, int64_t cols, const float *restrict p,
                      const float *restrict qt, int64_t r, float alpha, float divisor, int threads)
{
#ifdef __AVX512F__
    if (r < 1 || r > SKINNY_RANK || rows < 0 || cols < 0)
        return 0;
    __m512 scale = _mm512_set1_ps(alpha), divide = _mm512_set1_ps(divisor);
    BY_FOUR_ROWS(SKINNY_ADD_ROWS);
    return 1;
#else
    (void)c, (void)rows, (void)cols, (void)p, (void)qt, (void)r, (void)alpha, (void)divisor, (void)threads;
    return 0;
#endif
}
