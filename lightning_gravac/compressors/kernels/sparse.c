/*
 * The sparsifiers' kernels for fp32 on CPU: the two passes of block selection (lightning_gravac/compressors/select.py,
 * class Blocks) and the sparse decode (compressors/sparse.py).
 *
 * A flat tensor is seen as blocks of 32 entries. lg_block_peaks writes each block's peak (largest magnitude, or
 * largest value when signed) in one read of the tensor; lg_scan lists the entries above a threshold, reading only
 * the blocks whose peak passes it. Eager PyTorch needs two row reductions (amax, amin) for the first and a full
 * hardshrink + nonzero for the second; both here are a single read, on all of torch's threads.
 *
 * Semantics match the eager path exactly: a block holding a NaN has a NaN peak and is scanned; an unsigned scan keeps
 * entries with !(|x| <= t), so NaN entries pass; a signed scan keeps x > t. A negated one (is_signed == NEGATED) is
 * the signed one of -x without the copy: peaks max(-x), entries with x < -t (-x > t exactly: negation is exact).
 * Indices are int32 (callers check that the tensor has fewer than 2^31 entries).
 */
#include "common.h"

#define MAX_PARTS 256
#define SIGN_BIT 0x80000000u
#define NEGATED 2

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

void lg_block_absmax(const float *x, int64_t n, int64_t block, float *out, int threads);

void lg_block_peaks(const float *x, int64_t blocks, float *peaks, int is_signed, int threads)
{
    if (!is_signed) { /* the largest magnitude of each block: the block codes' kernel, at 32 entries a block */
        lg_block_absmax(x, blocks * BLOCK, BLOCK, peaks, threads);
        return;
    }
    const uint32_t *bits = (const uint32_t *)x;
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks > PARALLEL_BLOCKS)
    for (int64_t b = 0; b < blocks; b++) {
        const uint32_t *p = bits + b * BLOCK;
        uint32_t magnitude = 0, key = 0, peak, flip = is_signed == NEGATED ? SIGN_BIT : 0u;
        for (int i = 0; i < BLOCK; i++) {
            uint32_t m = p[i] & MAGNITUDE, k = signed_key(p[i] ^ flip);
            magnitude = m > magnitude ? m : magnitude;
            key = k > key ? k : key;
        }
        peak = magnitude > INF_BITS ? magnitude : from_signed_key(key);
        memcpy(peaks + b, &peak, sizeof peak);
    }
}

/* Both signed peaks of each block in one read: high[b] = max(x), low[b] = max(-x) (a NaN in the block: NaN in both),
 * as lg_block_peaks gives them signed and NEGATED. The key of -x is ~key(x) (for every non-NaN pattern), so the
 * largest key of -x is the complement of the smallest key of x. */
void lg_block_extremes(const float *x, int64_t blocks, float *high, float *low, int threads)
{
    const uint32_t *bits = (const uint32_t *)x;
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks > PARALLEL_BLOCKS)
    for (int64_t b = 0; b < blocks; b++) {
        const uint32_t *p = bits + b * BLOCK;
        uint32_t magnitude = 0, largest = 0, smallest = 0xffffffffu;
        for (int i = 0; i < BLOCK; i++) {
            uint32_t m = p[i] & MAGNITUDE, k = signed_key(p[i]);
            magnitude = m > magnitude ? m : magnitude;
            largest = k > largest ? k : largest;
            smallest = k < smallest ? k : smallest;
        }
        uint32_t top = magnitude > INF_BITS ? magnitude : from_signed_key(largest);
        uint32_t bottom = magnitude > INF_BITS ? magnitude : from_signed_key(~smallest);
        memcpy(high + b, &top, sizeof top);
        memcpy(low + b, &bottom, sizeof bottom);
    }
}

/* Bit i set when entry i of the block survives. */
static inline uint32_t survivors(const float *p, float t, int is_signed)
{
    uint32_t mask = 0;
#ifdef __AVX__
    __m256 threshold = _mm256_set1_ps(t), below = _mm256_set1_ps(-t), sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < BLOCK / 8; j++) {
        __m256 v = _mm256_loadu_ps(p + 8 * j), pass;
        if (is_signed == NEGATED)
            pass = _mm256_cmp_ps(v, below, _CMP_LT_OQ);
        else if (is_signed)
            pass = _mm256_cmp_ps(v, threshold, _CMP_GT_OQ);
        else
            pass = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), threshold, _CMP_NLE_UQ);
        mask |= (uint32_t)_mm256_movemask_ps(pass) << (8 * j);
    }
#else
    for (int i = 0; i < BLOCK; i++)
        mask |= (uint32_t)(is_signed == NEGATED ? p[i] < -t : is_signed ? p[i] > t : !(fabsf(p[i]) <= t)) << i;
#endif
    return mask;
}

/* Blocks a scan lists at a time, and how many listed blocks ahead it asks the memory for. */
#define SCAN_CHUNK 1024
#define PREFETCH_AHEAD 16

/* Entries of blocks [lo, hi) above t, written from out[0]: at most (hi - lo) * BLOCK of them. The hot blocks (peak
 * above t, or NaN) of a chunk are listed first without a branch, then read with the blocks PREFETCH_AHEAD further down
 * the list requested: a hot block is a random 128 bytes of the tensor, and reading them one after another waited on
 * memory's latency for each (25M entries, a fifth of the blocks hot: 6.0 ms, 2.8 with the prefetch; 8 ahead: 4.3). */
static int64_t scan_range(const float *x, const float *peaks, int64_t lo, int64_t hi, float t, int is_signed,
                          int32_t *out)
{
    int64_t count = 0;
    int32_t hot[SCAN_CHUNK];
    for (int64_t first = lo; first < hi; first += SCAN_CHUNK) {
        int64_t last = first + SCAN_CHUNK < hi ? first + SCAN_CHUNK : hi;
        int listed = 0;
        for (int64_t b = first; b < last; b++) {
            hot[listed] = (int32_t)(b - first);
            listed += !(peaks[b] <= t); /* true for a NaN peak: that block is scanned */
        }
        for (int j = 0; j < listed; j++) {
#if defined(__GNUC__)
            if (j + PREFETCH_AHEAD < listed) {
                const float *ahead = x + (first + hot[j + PREFETCH_AHEAD]) * BLOCK;
                __builtin_prefetch(ahead);
                __builtin_prefetch(ahead + BLOCK / 2);
            }
#endif
            int64_t b = first + hot[j];
            int32_t base = (int32_t)(b * BLOCK);
            for (uint32_t mask = survivors(x + b * BLOCK, t, is_signed); mask; mask &= mask - 1)
                out[count++] = base + __builtin_ctz(mask);
        }
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

/*
 * Sparse decoding: out[positions[j]] += values[j] * scale (values NULL: += constant) for j in order, one thread, as
 * index_add_ adds on a CPU (the product rounded to fp32, then the sum; a position listed twice gets both, in order).
 * Each position is a random cache line of out: reading them one after another waited on memory's latency for each,
 * so the line SCATTER_AHEAD positions further down the list is requested first. Positions come from other ranks'
 * payloads: all are checked against n first, and none is written unless all are in range (returns 0, else 1).
 */
#define SCATTER_AHEAD 16

int lg_scatter_add(float *out, int64_t n, const int32_t *positions, int64_t k, const float *values, float constant,
                   float scale)
{
    int32_t low = 0, high = 0;
    for (int64_t j = 0; j < k; j++) {
        low = positions[j] < low ? positions[j] : low;
        high = positions[j] > high ? positions[j] : high;
    }
    if (low < 0 || (k > 0 && high >= n))
        return 0;
    for (int64_t j = 0; j < k; j++) {
#if defined(__GNUC__)
        if (j + SCATTER_AHEAD < k)
            __builtin_prefetch(out + positions[j + SCATTER_AHEAD], 1);
#endif
        out[positions[j]] += values != NULL ? values[j] * scale : constant;
    }
    return 1;
}
