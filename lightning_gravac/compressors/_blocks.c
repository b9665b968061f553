/*
 * The two passes of block selection (lightning_gravac/compressors/select.py, class Blocks) for fp32 on CPU.
 *
 * A flat tensor is seen as blocks of 32 entries. lg_block_peaks writes each block's peak (largest magnitude, or
 * largest value when signed) in one read of the tensor; lg_scan lists the entries above a threshold, reading only
 * the blocks whose peak passes it. Eager PyTorch needs two row reductions (amax, amin) for the first and a full
 * hardshrink + nonzero for the second; both here are a single read, on all of torch's threads.
 *
 * Semantics match the eager path exactly: a block holding a NaN has a NaN peak and is scanned; an unsigned scan keeps
 * entries with !(|x| <= t), so NaN entries pass; a signed scan keeps x > t. Indices are int32 (callers check that the
 * tensor has fewer than 2^31 entries).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX__
#include <immintrin.h>
#endif

#define BLOCK 32
#define MAX_PARTS 256
/* Below this many blocks one thread is faster than waking the others. */
#define PARALLEL_BLOCKS 4096
#define MAGNITUDE 0x7fffffffu
#define INF_BITS 0x7f800000u

/* Peaks are computed on bit patterns, read through a uint32_t pointer (built with -fno-strict-aliasing): a float max
 * does not vectorize (the compiler may not reorder it around NaN), an unsigned max does. Non-negative floats order as
 * their bits, and every NaN's magnitude bits exceed infinity's, so the largest magnitude's bits are the unsigned
 * max and a NaN comes out as a NaN. Signed values are mapped to keys that order as the floats do. */
static inline uint32_t signed_key(uint32_t bits)
{
    return bits ^ ((uint32_t)((int32_t)bits >> 31) | 0x80000000u);
}

static inline uint32_t from_signed_key(uint32_t key)
{
    return key & 0x80000000u ? key ^ 0x80000000u : ~key;
}

void lg_block_peaks(const float *x, int64_t blocks, float *peaks, int is_signed, int threads)
{
    const uint32_t *bits = (const uint32_t *)x;
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks > PARALLEL_BLOCKS)
    for (int64_t b = 0; b < blocks; b++) {
        const uint32_t *p = bits + b * BLOCK;
        uint32_t magnitude = 0, key = 0, peak;
        if (is_signed) {
            for (int i = 0; i < BLOCK; i++) {
                uint32_t m = p[i] & MAGNITUDE, k = signed_key(p[i]);
                magnitude = m > magnitude ? m : magnitude;
                key = k > key ? k : key;
            }
            peak = magnitude > INF_BITS ? magnitude : from_signed_key(key);
        } else {
            for (int i = 0; i < BLOCK; i++) {
                uint32_t m = p[i] & MAGNITUDE;
                magnitude = m > magnitude ? m : magnitude;
            }
            peak = magnitude;
        }
        memcpy(peaks + b, &peak, sizeof peak);
    }
}

/* Bit i set when entry i of the block survives. */
static inline uint32_t survivors(const float *p, float t, int is_signed)
{
    uint32_t mask = 0;
#ifdef __AVX__
    __m256 threshold = _mm256_set1_ps(t), sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < BLOCK / 8; j++) {
        __m256 v = _mm256_loadu_ps(p + 8 * j), pass;
        if (is_signed)
            pass = _mm256_cmp_ps(v, threshold, _CMP_GT_OQ);
        else
            pass = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), threshold, _CMP_NLE_UQ);
        mask |= (uint32_t)_mm256_movemask_ps(pass) << (8 * j);
    }
#else
    for (int i = 0; i < BLOCK; i++)
        mask |= (uint32_t)(is_signed ? p[i] > t : !(fabsf(p[i]) <= t)) << i;
#endif
    return mask;
}

/* Entries of blocks [lo, hi) above t, written from out[0]: at most (hi - lo) * BLOCK of them. */
static int64_t scan_range(const float *x, const float *peaks, int64_t lo, int64_t hi, float t, int is_signed,
                          int32_t *out)
{
    int64_t count = 0;
    for (int64_t b = lo; b < hi; b++) {
        if (peaks[b] <= t) /* false for a NaN peak: that block is scanned */
            continue;
        int32_t base = (int32_t)(b * BLOCK);
        for (uint32_t mask = survivors(x + b * BLOCK, t, is_signed); mask; mask &= mask - 1)
            out[count++] = base + __builtin_ctz(mask);
    }
    return count;
}

/* Sorted indices of the entries above t into out (room for blocks * BLOCK); returns how many. Each thread scans a
 * contiguous range of blocks into the slots of its own range, then the ranges are packed together in order. */
int64_t lg_scan(const float *x, int64_t blocks, const float *peaks, float t, int is_signed, int32_t *out, int threads)
{
    int64_t counts[MAX_PARTS];
    int parts = 1;
    if (threads > MAX_PARTS)
        threads = MAX_PARTS;
#pragma omp parallel num_threads(threads) if (blocks > PARALLEL_BLOCKS)
    {
        int part = 0;
#ifdef _OPENMP
        part = omp_get_thread_num();
#pragma omp single
        parts = omp_get_num_threads(); /* the barrier after `single` publishes it */
#endif
        int64_t lo = blocks * part / parts, hi = blocks * (part + 1) / parts;
        counts[part] = scan_range(x, peaks, lo, hi, t, is_signed, out + lo * BLOCK);
    }
    int64_t total = counts[0];
    for (int part = 1; part < parts; part++) {
        memmove(out + total, out + blocks * part / parts * BLOCK, (size_t)counts[part] * sizeof(int32_t));
        total += counts[part];
    }
    return total;
}

/* DGC's accumulation (lightning_gravac/compressors/dgc.py) in one pass, with the block peaks of the new v and its
 * squared norm, which would otherwise take two more reads of v:
 *
 *     a = g * scale;  u = fma(u_old, momentum, a) (or a);  v = v_old + u (or u)
 *
 * u_old, u and v_old may be NULL (no momentum correction, or a first step). The arithmetic is the eager path's:
 * torch's add with alpha is a fused multiply-add on CPU, and this file is built in ISO C mode, where the compiler does
 * not contract other products into one. The squared norm is summed per 8 lanes in fp32 within a block, per chunk in
 * fp64, then over chunks in order: the same bits whatever the thread count. */
#define CHUNK_BLOCKS 4096

/* dst[0, len) = a[0, len). With `stream` (a whole block, dst 32-byte aligned) by streaming stores, which write
 * whole lines without first reading them into the cache: u and v are written, never read, here, and are too large for
 * any cache, so this saves two of the seven 100 MB transfers of a 25M-entry step. */
static inline void put(float *dst, const float *a, int len, int stream)
{
#ifdef __AVX__
    if (stream) {
        for (int i = 0; i < BLOCK; i += 8)
            _mm256_stream_ps(dst + i, _mm256_loadu_ps(a + i));
        return;
    }
#endif
    (void)stream;
    for (int i = 0; i < len; i++)
        dst[i] = a[i];
}

/* Entries [lo, lo + len) of the accumulation; the block's peak into *peak unless NULL; returns their squared norm.
 * Inlined with len = BLOCK for whole blocks, so that every loop below has a constant trip count and vectorizes. */
static inline double accumulate_range(const float *g, float scale, const float *u_old, float momentum, float *u,
                                      const float *v_old, float *v, int64_t lo, int len, uint32_t *peak, int stream)
{
    float a[BLOCK], lanes[8] = {0};
    uint32_t magnitude = 0;
    for (int i = 0; i < len; i++)
        a[i] = g[lo + i] * scale;
    if (u != NULL) {
        if (u_old != NULL)
            for (int i = 0; i < len; i++)
                a[i] = fmaf(u_old[lo + i], momentum, a[i]);
        put(u + lo, a, len, stream);
    }
    if (v_old != NULL)
        for (int i = 0; i < len; i++)
            a[i] = v_old[lo + i] + a[i];
    const uint32_t *bits = (const uint32_t *)a;
    put(v + lo, a, len, stream);
    for (int i = 0; i < len; i++) {
        uint32_t m = bits[i] & MAGNITUDE;
        magnitude = m > magnitude ? m : magnitude;
    }
    /* Lane l sums entries l, l + 8, ...: eight independent sums (one vector register), not one serial chain. */
    for (int j = 0; j + 8 <= len; j += 8)
        for (int l = 0; l < 8; l++)
            lanes[l] += a[j + l] * a[j + l];
    for (int i = len - len % 8; i < len; i++)
        lanes[i % 8] += a[i] * a[i];
    if (peak != NULL)
        *peak = magnitude;
    double sum = 0;
    for (int j = 0; j < 8; j++)
        sum += lanes[j];
    return sum;
}

double lg_accumulate(const float *g, float scale, const float *u_old, float momentum, float *u, const float *v_old,
                     float *v, int64_t n, float *peaks, int threads)
{
    int64_t blocks = n / BLOCK, chunks = (blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
    double partial[chunks > 0 ? chunks : 1];
    int stream = (uintptr_t)u % 32 == 0 && (uintptr_t)v % 32 == 0; /* every block then starts aligned */
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks > PARALLEL_BLOCKS)
    for (int64_t c = 0; c < chunks; c++) {
        double sum = 0;
        int64_t last = (c + 1) * CHUNK_BLOCKS < blocks ? (c + 1) * CHUNK_BLOCKS : blocks;
        for (int64_t b = c * CHUNK_BLOCKS; b < last; b++)
            sum += accumulate_range(g, scale, u_old, momentum, u, v_old, v, b * BLOCK, BLOCK, (uint32_t *)(peaks + b),
                                    stream);
        partial[c] = sum;
#ifdef __AVX__
        _mm_sfence(); /* the streamed lines are visible before the work is handed back */
#endif
    }
    double total = 0;
    for (int64_t c = 0; c < chunks; c++)
        total += partial[c];
    if (blocks * BLOCK < n) /* the tail: elementwise the same, no peak (Blocks scans it apart) */
        total += accumulate_range(g, scale, u_old, momentum, u, v_old, v, blocks * BLOCK, (int)(n - blocks * BLOCK), NULL,
                                  0);
    return total;
}
