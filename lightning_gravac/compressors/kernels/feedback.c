/*
 * Error feedback's sum of a gradient and its residual (adaptations/residuals.py; also the squared norm of fp32 on CPU,
 * compressors/base.py's sq_norm) and DGC's accumulation (compressors/dgc.py), each with the norm it is asked for
 * found in the same pass.
 */
#include "common.h"

/*
 * Error feedback's sum x = g + r (r NULL: x = g; x NULL: nothing written, the norm of g + r alone) with ||x||^2 in
 * float64 in the same pass, which the gain's denominator needs and the eager path reads the tensor again for: the one
 * squared norm of fp32 on CPU (sq_norm). The sum is fp32's own (torch.add's bits); the squares summed in SQ_LANES lanes
 * a block of SQ_BLOCK entries, the lanes folded in order, then the block's tail, the blocks in block order: the thread
 * count does not change the result, and neither does whether x is written.
 */
static inline double add_sq_block(const float *restrict g, const float *restrict r, float *restrict x, int64_t start,
                                  int64_t end)
{
    double lanes[SQ_LANES] = {0};
    int64_t i = start;
    for (; i + SQ_LANES <= end; i += SQ_LANES)
        for (int k = 0; k < SQ_LANES; k++) {
            float v = r != NULL ? g[i + k] + r[i + k] : g[i + k];
            if (x != NULL)
                x[i + k] = v;
            lanes[k] += (double)v * v;
        }
    double sum = fold_lanes(lanes);
    for (; i < end; i++) {
        float v = r != NULL ? g[i] + r[i] : g[i];
        if (x != NULL)
            x[i] = v;
        sum += (double)v * v;
    }
    return sum;
}

double lg_add_sq(const float *restrict g, const float *restrict r, float *restrict x, int64_t n, double *scratch,
                 int threads)
{
    int64_t blocks = (n + SQ_BLOCK - 1) / SQ_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * SQ_BLOCK, end = start + SQ_BLOCK < n ? start + SQ_BLOCK : n;
        /* Each combination its own inlined copy, so that no loop tests a pointer per entry. */
        if (r != NULL)
            scratch[b] = x != NULL ? add_sq_block(g, r, x, start, end) : add_sq_block(g, r, NULL, start, end);
        else
            scratch[b] = x != NULL ? add_sq_block(g, NULL, x, start, end) : add_sq_block(g, NULL, NULL, start, end);
    }
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++)
        total += scratch[b];
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
