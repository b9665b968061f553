/*
 * The two passes of block selection (lightning_gravac/compressors/select.py, class Blocks) for fp32 on CPU.
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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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
#define SIGN_BIT 0x80000000u
#define NEGATED 2
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
        uint32_t magnitude = 0, key = 0, peak, flip = is_signed == NEGATED ? SIGN_BIT : 0u;
        if (is_signed) {
            for (int i = 0; i < BLOCK; i++) {
                uint32_t m = p[i] & MAGNITUDE, k = signed_key(p[i] ^ flip);
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

/*
 * Sign bits, for the sign methods (signsgd, efsignsgd, onebit): 8 a byte, most significant first, set for x >= 0
 * (so -0.0 sets it and NaN does not, as the eager comparison does); the last byte is zero-padded.
 */

void lg_pack_signs(const float *x, int64_t n, uint8_t *out, int threads)
{
    int64_t bytes = (n + 7) / 8, full = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static) if (bytes > PARALLEL_BLOCKS * 4)
    for (int64_t j = 0; j < full; j++) {
        const float *p = x + j * 8;
        uint8_t b = 0;
        for (int i = 0; i < 8; i++)
            b |= (uint8_t)(p[i] >= 0.0f) << (7 - i);
        out[j] = b;
    }
    if (full < bytes) {
        uint8_t b = 0;
        for (int64_t i = full * 8; i < n; i++)
            b |= (uint8_t)(x[i] >= 0.0f) << (7 - (int)(i - full * 8));
        out[full] = b;
    }
}

/* The `count` (at most 8) bytes at `in` as one big-endian word: the first byte's most significant bit highest, as
 * packed codes and sign bits are laid out. */
static inline uint64_t packed_word(const uint8_t *in, int count)
{
    uint64_t word = 0;
    for (int b = 0; b < count; b++)
        word = word << 8 | in[b];
    return word;
}

/* out[i] = out[i] + (bit i set ? pos : neg): the decoded signs of one payload, added in one pass, 32 entries (a word)
 * at a time, then a byte at a time, then the last entries one by one. The 32 picks of a word compile to vector shifts
 * and blends (a byte at a time ran at half a copy's speed). */
void lg_add_signs(const uint8_t *bits, int64_t n, float pos, float neg, float *out, int threads)
{
    int64_t words = n / 32, full = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t j = 0; j < words; j++) {
        uint32_t word = (uint32_t)packed_word(bits + j * 4, 4); /* entry k of the 32 is bit 31 - k */
        float *o = out + j * 32;
        for (int k = 0; k < 32; k++)
            o[k] = o[k] + ((word >> (31 - k)) & 1u ? pos : neg);
    }
    for (int64_t j = words * 4; j < full; j++) {
        unsigned b = bits[j];
        float *o = out + j * 8;
        for (int k = 0; k < 8; k++)
            o[k] = o[k] + ((b >> (7 - k)) & 1u ? pos : neg);
    }
    for (int64_t i = full * 8; i < n; i++)
        out[i] = out[i] + ((bits[i >> 3] >> (7 - (i & 7))) & 1 ? pos : neg);
}

/* Majority vote of `ranks` rows of sign bits, `stride` bytes apart: out[i] = out[i] + alpha * sign(2 set - ranks),
 * where `set` counts the ranks whose bit i is set (0 on a tie). Counted a chunk of VOTE_BYTES bytes at a time, rank by
 * rank into small counters, so that every loop is a plain pass the compiler vectorizes. */
#define VOTE_BYTES 256

void lg_vote(const uint8_t *bits, int64_t stride, int ranks, int64_t n, float alpha, float *out, int threads)
{
    int64_t bytes = (n + 7) / 8, chunks = (bytes + VOTE_BYTES - 1) / VOTE_BYTES;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t c = 0; c < chunks; c++) {
        int32_t set[VOTE_BYTES * 8];
        int64_t first = c * VOTE_BYTES, count = bytes - first < VOTE_BYTES ? bytes - first : VOTE_BYTES;
        int64_t entries = n - first * 8 < count * 8 ? n - first * 8 : count * 8;
        for (int64_t e = 0; e < count * 8; e++)
            set[e] = 0;
        for (int r = 0; r < ranks; r++) {
            const uint8_t *row = bits + r * stride + first;
            for (int64_t j = 0; j < count; j++)
                for (int k = 0; k < 8; k++)
                    set[j * 8 + k] += (row[j] >> (7 - k)) & 1;
        }
        float *o = out + first * 8;
        for (int64_t e = 0; e < entries; e++) {
            int votes = 2 * set[e] - ranks;
            float sign = votes > 0 ? 1.0f : votes < 0 ? -1.0f : 0.0f;
            o[e] = o[e] + alpha * sign;
        }
    }
}

/*
 * Stochastic quantization (qsgd, terngrad) in one pass: uniform draws from a counter-based generator instead of a
 * gradient-sized tensor of random numbers, and the codes packed as they are made.
 *
 * Draw i of a stream is the top 24 bits of SplitMix64's output function applied to stream + (i + 1) * golden, over
 * 2^24: a float in [0, 1) that depends on (stream, i) only, so any thread computes any entry's draw, and the eager
 * path (compressors/uniform.py) computes the same bits with int64 tensors.
 */
#define GOLDEN 0x9E3779B97F4A7C15ull

static inline float uniform_at(uint64_t stream, int64_t i)
{
    uint64_t z = stream + (uint64_t)(i + 1) * GOLDEN;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

void lg_uniforms(uint64_t stream, int64_t n, float *out, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t i = 0; i < n; i++)
        out[i] = uniform_at(stream, i);
}

/* Writes 8 codes of `bits` bits (at most 64 bits) as `bits` bytes, most significant first. */
static inline void put_codes(uint8_t *out, const uint8_t *codes, int bits)
{
    uint64_t word = 0;
    for (int k = 0; k < 8; k++)
        word = (word << bits) | codes[k];
    for (int b = bits - 1; b >= 0; b--) {
        out[b] = (uint8_t)word;
        word >>= 8;
    }
}

/* Reads the 8 codes of `bits` bits that `bits` bytes hold, most significant first (put_codes's inverse). */
static inline void get_codes(const uint8_t *in, int *codes, int bits)
{
    uint64_t word = packed_word(in, bits);
    unsigned mask = (1u << bits) - 1;
    for (int k = 7; k >= 0; k--) {
        codes[k] = (int)(word & mask);
        word >>= bits;
    }
}

/* The code of entry i alone (where a group of 8 is cut by a range's ends). */
static inline int code_at(const uint8_t *packed, int64_t nbytes, int bits, int64_t i)
{
    int64_t at = i * bits, k = at >> 3;
    unsigned window = (unsigned)packed[k] << 8 | (k + 1 < nbytes ? packed[k + 1] : 0);
    return (int)((window >> (16 - (int)(at & 7) - bits)) & ((1u << bits) - 1));
}

/* Packs of 8 entries a thread takes at a time. */
#define PACKS 512

/* Packs the codes made by `code_of(i)` of groups [first, last) of 8 entries, each group into `bits` whole bytes. */
#define PACK_GROUPS(first, last, code_of)                                                                             \
    for (int64_t grp = (first); grp < (last); grp++) {                                                                \
        uint8_t codes[8];                                                                                             \
        for (int k = 0; k < 8; k++) {                                                                                 \
            int64_t i = grp * 8 + k;                                                                                  \
            codes[k] = (code_of);                                                                                     \
        }                                                                                                             \
        put_codes(out + grp * bits, codes, bits);                                                                     \
    }

/* Packs the last, short group of 8 (entries [n / 8 * 8, n)), zero-padded; its bytes past the packed size are not
 * written. */
#define PACK_TAIL(code_of)                                                                                            \
    do {                                                                                                              \
        int64_t full = n / 8, nbytes = (n * bits + 7) / 8;                                                            \
        if (full * 8 < n) {                                                                                           \
            uint8_t codes[8] = {0}, bytes[8];                                                                         \
            for (int64_t i = full * 8; i < n; i++)                                                                    \
                codes[i - full * 8] = (code_of);                                                                      \
            put_codes(bytes, codes, bits);                                                                            \
            for (int64_t b = full * bits; b < nbytes; b++)                                                            \
                out[b] = bytes[b - full * bits];                                                                      \
        }                                                                                                             \
    } while (0)

/* Packs codes made by `code_of(i)` for entries [0, n): groups of 8 entries fill `bits` whole bytes, on every thread;
 * then the last group. */
#define PACK_CODES(code_of)                                                                                           \
    do {                                                                                                              \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)")              \
        PACK_GROUPS(0, n / 8, code_of);                                                                               \
        PACK_TAIL(code_of);                                                                                           \
    } while (0)

/* Runs `call`, in which `bits` is then the compile-time constant 1..8 it equals. */
#define CONSTANT_BITS(call)                                                                                           \
    switch (bits) {                                                                                                   \
    case 1: { const int bits = 1; call; } break;                                                                      \
    case 2: { const int bits = 2; call; } break;                                                                      \
    case 3: { const int bits = 3; call; } break;                                                                      \
    case 4: { const int bits = 4; call; } break;                                                                      \
    case 5: { const int bits = 5; call; } break;                                                                      \
    case 6: { const int bits = 6; call; } break;                                                                      \
    case 7: { const int bits = 7; call; } break;                                                                      \
    default: { const int bits = 8; call; } break;                                                                     \
    }

/* QSGD's level of one entry: min(floor(|x| * scale + u), s) with the sign of x, offset by s (a code in [0, 2s]). */
static inline uint8_t qsgd_code(float x, float scale, float u, int s)
{
    float y = fabsf(x) * scale + u;
    y = y >= 0.0f ? y : 0.0f; /* NaN (0 times a zero bucket's infinite scale): level 0, as the eager path */
    int level = y < (float)s ? (int)y : s; /* y >= 0, so truncation is the floor */
    return (uint8_t)(signbit(x) ? s - level : s + level);
}

/* Packs `groups` groups of 8 codes (one byte each) into `bits` bytes each, the width a compile-time constant. */
static void pack_groups(const uint8_t *codes, int64_t groups, int bits, uint8_t *out)
{
    CONSTANT_BITS(for (int64_t g = 0; g < groups; g++) put_codes(out + g * bits, codes + g * 8, bits));
}

/* QSGD: `scales[b]` is s / max(norm of bucket b, FLT_MIN) as float32 (computed by the caller, as the eager path). */
void lg_qsgd_encode(const float *x, int64_t n, const float *scales, int64_t bucket, int s, int bits, uint64_t stream,
                    uint8_t *out, int threads)
{
    if (bucket % 8 == 0) {
        /* A chunk of PACKS groups at a time: its codes into a byte each (a loop of draws and levels alone, which
         * vectorizes, a bucket at a time with its scale read once), then packed from cache at a constant width (one
         * copy of the packing loop a width: the quantizing loop copied for every width took the file from 5 s to 90 s
         * to compile). */
        int64_t full = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
        for (int64_t chunk = 0; chunk < (full + PACKS - 1) / PACKS; chunk++) {
            uint8_t codes[PACKS * 8];
            int64_t start = chunk * PACKS * 8, end = (chunk + 1) * PACKS < full ? (chunk + 1) * PACKS * 8 : full * 8;
            for (int64_t first = start, last; first < end; first = last) {
                int64_t b = first / bucket;
                float scale = scales[b];
                last = (b + 1) * bucket < end ? (b + 1) * bucket : end;
                for (int64_t i = first; i < last; i++)
                    codes[i - start] = qsgd_code(x[i], scale, uniform_at(stream, i), s);
            }
            pack_groups(codes, (end - start) / 8, bits, out + chunk * PACKS * bits);
        }
        PACK_TAIL(qsgd_code(x[i], scales[i / bucket], uniform_at(stream, i), s));
    } else {
        PACK_CODES(qsgd_code(x[i], scales[i / bucket], uniform_at(stream, i), s));
    }
}

/* TernGrad's statistics in one read: the standard deviation (n - 1 in the denominator) and the smallest and largest
 * entry. Blocks of MOMENT_BLOCK entries: a block's sum, then (from cache) its squared deviations from its own mean,
 * in float64, and its min and max (NaN propagates, as torch.aminmax); the blocks are then combined in block order,
 * M2 = sum of (m2_b + n_b (mean_b - mean)^2), which does not cancel when the mean is large against the spread (as
 * sum x^2 - n mean^2 would). `scratch` holds 4 doubles a block; out = {std, min, max} (std in float64). */
#define MOMENT_BLOCK 4096
#define MOMENT_LANES 16

void lg_moments(const float *x, int64_t n, double *scratch, double *out, int threads)
{
    if (n < 2) { /* no deviation (the wrapper refuses these) */
        out[0] = out[1] = out[2] = NAN;
        return;
    }
    int64_t blocks = (n + MOMENT_BLOCK - 1) / MOMENT_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * MOMENT_BLOCK, end = start + MOMENT_BLOCK < n ? start + MOMENT_BLOCK : n;
        /* MOMENT_LANES independent sums (a vector's worth, no chain of dependent adds), added in lane order. */
        double sums[MOMENT_LANES] = {0}, m2s[MOMENT_LANES] = {0}, sum = 0.0, m2 = 0.0;
        float los[MOMENT_LANES], his[MOMENT_LANES], lo = x[start], hi = x[start];
        int nans[MOMENT_LANES] = {0}, nan = 0;
        int64_t i = start;
        for (int k = 0; k < MOMENT_LANES; k++)
            los[k] = his[k] = x[start];
        for (; i + MOMENT_LANES <= end; i += MOMENT_LANES)
            for (int k = 0; k < MOMENT_LANES; k++) {
                float v = x[i + k];
                sums[k] += v;
                los[k] = v < los[k] ? v : los[k];
                his[k] = v > his[k] ? v : his[k];
                nans[k] |= v != v;
            }
        for (int k = 0; k < MOMENT_LANES; k++) {
            sum += sums[k];
            lo = los[k] < lo ? los[k] : lo;
            hi = his[k] > hi ? his[k] : hi;
            nan |= nans[k];
        }
        for (; i < end; i++) {
            sum += x[i];
            lo = x[i] < lo ? x[i] : lo;
            hi = x[i] > hi ? x[i] : hi;
            nan |= x[i] != x[i];
        }
        double mean = sum / (double)(end - start);
        for (i = start; i + MOMENT_LANES <= end; i += MOMENT_LANES)
            for (int k = 0; k < MOMENT_LANES; k++) {
                double d = (double)x[i + k] - mean;
                m2s[k] += d * d;
            }
        for (int k = 0; k < MOMENT_LANES; k++)
            m2 += m2s[k];
        for (; i < end; i++) {
            double d = (double)x[i] - mean;
            m2 += d * d;
        }
        scratch[4 * b] = sum, scratch[4 * b + 1] = m2;
        scratch[4 * b + 2] = nan ? NAN : lo, scratch[4 * b + 3] = nan ? NAN : hi;
    }
    double sum = 0.0, m2 = 0.0, lo = scratch[2], hi = scratch[3];
    for (int64_t b = 0; b < blocks; b++)
        sum += scratch[4 * b];
    double mean = sum / (double)n;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t size = b + 1 < blocks ? MOMENT_BLOCK : n - b * MOMENT_BLOCK;
        double d = scratch[4 * b] / (double)size - mean;
        m2 += scratch[4 * b + 1] + (double)size * d * d;
        double blo = scratch[4 * b + 2], bhi = scratch[4 * b + 3];
        lo = blo != blo || blo < lo ? blo : lo;
        hi = bhi != bhi || bhi > hi ? bhi : hi;
    }
    out[0] = sqrt(m2 / (double)(n - 1));
    out[1] = lo, out[2] = hi;
}

/* TernGrad's code of one entry: 1 + sign(c) if u * scale < |c| else 1, c = x clipped to [-bound, bound]. */
static inline uint8_t terngrad_code(float x, float bound, float scale, float u)
{
    float c = x < -bound ? -bound : x > bound ? bound : x;
    /* Without branches (a random draw decides: a branch would be mispredicted half the time). NaN keeps nothing. */
    int keep = u * scale < fabsf(c), positive = c > 0;
    return (uint8_t)(1 + keep * (2 * positive - 1));
}

void lg_terngrad_encode(const float *x, int64_t n, float bound, float scale, uint64_t stream, uint8_t *out, int threads)
{
    const int bits = 2;
    PACK_CODES(terngrad_code(x[i], bound, scale, uniform_at(stream, i)));
}

/* out[i] = out[i] + ((code_i - offset) * steps[i / group]) * alpha, code_i read from the packed `bits`-bit codes: eight
 * entries (`bits` whole bytes) at a time, the group's step looked up once for the eight where they share it. The
 * width is made a constant (CONSTANT_BITS) so that unpacking compiles to fixed shifts. */
static inline void codes_add_one(float *out, int code, int offset, float step, float alpha)
{
    float value = (float)(code - offset) * step;
    value = value * alpha;
    *out = *out + value;
}

static inline __attribute__((always_inline)) void codes_add_packs(const uint8_t *packed, int64_t j0, int64_t j1,
                                                                  int bits, int offset, const float *steps,
                                                                  int64_t group, float alpha, float *out)
{
    for (int64_t j = j0; j < j1; j++) {
        int codes[8];
        int64_t first = j * 8, g = first / group;
        get_codes(packed + j * bits, codes, bits);
        if ((first + 7) / group == g) {
            float step = steps[g];
            for (int k = 0; k < 8; k++)
                codes_add_one(out + first + k, codes[k], offset, step, alpha);
        } else {
            for (int k = 0; k < 8; k++)
                codes_add_one(out + first + k, codes[k], offset, steps[(first + k) / group], alpha);
        }
    }
}

void lg_codes_add(const uint8_t *packed, int64_t n, int bits, int offset, const float *steps, int64_t group, float alpha,
                  float *out, int threads)
{
    int64_t nbytes = (n * bits + 7) / 8, full = n / 8, chunks = (full + PACKS - 1) / PACKS;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t j0 = c * PACKS, j1 = j0 + PACKS < full ? j0 + PACKS : full;
        CONSTANT_BITS(codes_add_packs(packed, j0, j1, bits, offset, steps, group, alpha, out));
    }
    for (int64_t i = full * 8; i < n; i++)
        codes_add_one(out + i, code_at(packed, nbytes, bits, i), offset, steps[i / group], alpha);
}

/* The energy of packed codes, for the statistics header: sums[g] = sum over the entries of group g (`group` entries
 * each, the last one short) of (code_i - offset)^2, as an integer: exact, so the same whatever the thread count and
 * order. The caller weighs each by its step^2 in float64. */
static inline __attribute__((always_inline)) int64_t codes_sq_packs(const uint8_t *packed, int64_t i, int64_t hi,
                                                                     int bits, int offset, const int32_t *table)
{
    int64_t sum = 0;
    if (bits <= 4 && table != NULL) { /* each half of a pack (4 codes, 4 x bits bits) indexes their sum of squares */
        unsigned half = 4 * bits, mask = (1u << half) - 1;
        for (; i + 8 <= hi; i += 8) {
            uint32_t word = (uint32_t)packed_word(packed + (i / 8) * bits, bits);
            sum += table[word >> half] + table[word & mask];
        }
        return sum;
    }
    for (; i + 8 <= hi; i += 8) {
        int codes[8];
        get_codes(packed + (i / 8) * bits, codes, bits);
        for (int k = 0; k < 8; k++)
            sum += (codes[k] - offset) * (codes[k] - offset);
    }
    return sum;
}

static inline int64_t codes_sq_range(const uint8_t *packed, int64_t nbytes, int bits, int offset, int64_t lo,
                                     int64_t hi, const int32_t *table)
{
    int64_t sum = 0, i = lo;
    for (; i < hi && (i & 7); i++) {
        int v = code_at(packed, nbytes, bits, i) - offset;
        sum += v * v;
    }
    int64_t packs = (hi - i) / 8 * 8;
    CONSTANT_BITS(sum += codes_sq_packs(packed, i, i + packs, bits, offset, table));
    i += packs;
    for (; i < hi; i++) {
        int v = code_at(packed, nbytes, bits, i) - offset;
        sum += v * v;
    }
    return sum;
}

void lg_codes_sq(const uint8_t *packed, int64_t n, int bits, int offset, int64_t group, int64_t *sums, int threads)
{
    int64_t nbytes = (n * bits + 7) / 8, groups = (n + group - 1) / group;
    /* Codes of up to 4 bits: a table of the sum of squares of every 4 codes (16 to 65536 entries), worth building
     * where the codes outnumber its entries 4 to 1. Sums of integers: the same result either way. */
    int32_t *table = NULL;
    if (bits <= 4 && n >= (int64_t)4 << (4 * bits) && (table = malloc(sizeof(int32_t) << (4 * bits))) != NULL)
        for (uint32_t h = 0; h < 1u << (4 * bits); h++) {
            int32_t sum = 0;
            for (int k = 0; k < 4; k++) {
                int v = (int)((h >> (bits * k)) & ((1u << bits) - 1)) - offset;
                sum += v * v;
            }
            table[h] = sum;
        }
    if (groups == 1) { /* one group (a tensor-wide step): its entries shared out, the integer sums added */
        int64_t sum = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sum) if (n > PARALLEL_BLOCKS * 32)
        for (int64_t c = 0; c < (n + 4095) / 4096; c++)
            sum += codes_sq_range(packed, nbytes, bits, offset, c * 4096, (c + 1) * 4096 < n ? (c + 1) * 4096 : n,
                                  table);
        sums[0] = sum;
    } else {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
        for (int64_t g = 0; g < groups; g++)
            sums[g] = codes_sq_range(packed, nbytes, bits, offset, g * group, (g + 1) * group < n ? (g + 1) * group : n,
                                     table);
    }
    free(table);
}

/*
 * 1-bit SGD on a row-major [rows, cols] matrix. lg_onebit_sums gives, per column, the count of entries >= 0, their sum
 * and the sum of all (`out`: three arrays of `cols` doubles). Rows are cut into blocks of ONEBIT_ROWS; a block's sums
 * are one thread's (row by row, so the inner loop runs along a row's contiguous columns) and the blocks' sums are
 * added in block order, so the result does not depend on the thread count. `scratch` holds 3 x cols doubles a block.
 * A single column sums a block in eight float32 lanes (32 entries each), then in float64.
 * lg_onebit_add decodes: out[i] = out[i] + (bit i set ? pos : neg)[column of i], where the caller has multiplied the
 * means by the scale (in float32, as the eager decode does; by -1 for the exact residual x - decoded).
 */
#define ONEBIT_ROWS 256

/* v where v >= 0 (-0.0 included), else +0.0 (NaN too), without a branch: a random sign would mispredict it. */
static inline float non_negative(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u &= -(uint32_t)(v >= 0.0f);
    memcpy(&v, &u, sizeof v);
    return v;
}

void lg_onebit_sums(const float *x, int64_t rows, int64_t cols, double *scratch, double *out, int threads)
{
    if (cols == 1) { /* one column (a 1-D tensor): eight float32 lanes a block, the blocks' sums in float64 */
        int64_t blocks = (rows + ONEBIT_ROWS - 1) / ONEBIT_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > PARALLEL_BLOCKS * 32)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t r = b * ONEBIT_ROWS, r1 = r + ONEBIT_ROWS < rows ? r + ONEBIT_ROWS : rows;
            float n8[8] = {0}, a8[8] = {0}, t8[8] = {0};
            for (; r + 8 <= r1; r += 8)
                for (int k = 0; k < 8; k++) {
                    float v = x[r + k];
                    n8[k] += (float)(v >= 0.0f);
                    a8[k] += non_negative(v);
                    t8[k] += v;
                }
            double *part = scratch + b * 3;
            part[0] = part[1] = part[2] = 0.0;
            for (int k = 0; k < 8; k++) {
                part[0] += n8[k];
                part[1] += a8[k];
                part[2] += t8[k];
            }
            for (; r < r1; r++) {
                float v = x[r];
                part[0] += v >= 0.0f;
                part[1] += v >= 0.0f ? (double)v : 0.0;
                part[2] += (double)v;
            }
        }
        out[0] = out[1] = out[2] = 0.0;
        for (int64_t b = 0; b < blocks; b++)
            for (int s = 0; s < 3; s++)
                out[s] += scratch[b * 3 + s];
        return;
    }
    int64_t blocks = (rows + ONEBIT_ROWS - 1) / ONEBIT_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols > PARALLEL_BLOCKS * 32)
    for (int64_t b = 0; b < blocks; b++) {
        double *count = scratch + b * 3 * cols, *above = count + cols, *total = above + cols;
        int64_t r1 = (b + 1) * ONEBIT_ROWS < rows ? (b + 1) * ONEBIT_ROWS : rows;
        for (int64_t c = 0; c < cols; c++)
            count[c] = above[c] = total[c] = 0.0;
        for (int64_t r = b * ONEBIT_ROWS; r < r1; r++) {
            const float *row = x + r * cols;
            for (int64_t c = 0; c < cols; c++) {
                float v = row[c];
                count[c] += (double)(v >= 0.0f);
                above[c] += (double)non_negative(v);
                total[c] += (double)v;
            }
        }
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks * cols > PARALLEL_BLOCKS)
    for (int64_t c = 0; c < cols; c++) {
        double count = 0.0, above = 0.0, total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            const double *part = scratch + b * 3 * cols;
            count += part[c];
            above += part[cols + c];
            total += part[2 * cols + c];
        }
        out[c] = count;
        out[cols + c] = above;
        out[2 * cols + c] = total;
    }
}

/* bit ? a : b (bit 0 or 1) by masking, without a branch: the bits are signs, as good as random. */
static inline float pick(uint32_t bit, float a, float b)
{
    uint32_t ua, ub, mask = -bit;
    memcpy(&ua, &a, sizeof ua);
    memcpy(&ub, &b, sizeof ub);
    ua = (ua & mask) | (ub & ~mask);
    memcpy(&a, &ua, sizeof a);
    return a;
}

void lg_onebit_add(const uint8_t *restrict bits, int64_t rows, int64_t cols, const float *restrict pos,
                   const float *restrict neg, float *restrict out, int threads)
{
    if (cols == 1) { /* one column: the sign decode with two values */
        lg_add_signs(bits, rows, pos[0], neg[0], out, threads);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols > PARALLEL_BLOCKS * 32)
    for (int64_t r = 0; r < rows; r++) {
        float *restrict row = out + r * cols;
        int64_t first = r * cols, c = 0;
        if (!(first & 7)) { /* a row that starts a byte: 32 entries (4 bytes, most significant bit first) a step */
            for (; c + 32 <= cols; c += 32) {
                uint32_t word = (uint32_t)packed_word(bits + ((first + c) >> 3), 4);
                for (int k = 0; k < 32; k++)
                    row[c + k] = row[c + k] + pick((word >> (31 - k)) & 1u, pos[c + k], neg[c + k]);
            }
        }
        if (!(first & 7)) /* then eight entries a byte */
            for (; c + 8 <= cols; c += 8) {
                unsigned b = bits[(first + c) >> 3];
                for (int k = 0; k < 8; k++)
                    row[c + k] = row[c + k] + pick((b >> (7 - k)) & 1u, pos[c + k], neg[c + k]);
            }
        for (; c < cols; c++) {
            int64_t i = first + c;
            row[c] = row[c] + ((bits[i >> 3] >> (7 - (i & 7))) & 1 ? pos[c] : neg[c]);
        }
    }
}

/*
 * The squared L2 norm of 16-bit floats (the casts' payload, for the statistics header), in float64: a norm read
 * straight from 16-bit values is about 10x slower in eager PyTorch. Each value widened to float32 exactly (fp16 by its
 * bits: normal, subnormal, inf and NaN; bf16 by a shift), squared and summed in float64 (a bf16 value's square can
 * overflow float32) in SQ_LANES lanes a block of SQ_BLOCK entries, the lanes folded in order, then the block's
 * tail, the blocks in block order: the thread count does not change the result. Thirty-two lanes are four
 * independent chains of eight-wide additions: eight lanes (one chain) left the sum bound by the addition's latency,
 * at twice a copy's time for half a copy's bytes.
 */
#define SQ_BLOCK 1024
#define SQ_LANES 32

static inline float half_to_float(uint16_t h)
{
    /* Without branches: exponent and mantissa moved into place and rebiased; inf/NaN rebiased once more; zero and
     * subnormals built as 2^-14 (1 + m 2^-10) and 2^-14 subtracted, exactly. */
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13, exp = o & 0x0f800000u, magic_bits = 113u << 23, bits;
    o += 112u << 23;
    o += exp == 0x0f800000u ? 112u << 23 : 0u;
    o += exp == 0u ? 1u << 23 : 0u;
    float f, magic;
    memcpy(&f, &o, sizeof f);
    memcpy(&magic, &magic_bits, sizeof magic);
    f = exp == 0u ? f - magic : f;
    memcpy(&bits, &f, sizeof bits);
    bits |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bf16_to_float(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* SQ_LANES 16-bit values widened exactly to float32. */
static inline void widen_lanes(const uint16_t *x, float *widened, int is_bf16)
{
    if (is_bf16)
        for (int k = 0; k < SQ_LANES; k++)
            widened[k] = bf16_to_float(x[k]);
    else {
#ifdef __F16C__
        for (int k = 0; k < SQ_LANES; k += 8)
            _mm256_storeu_ps(widened + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + k))));
#else
        for (int k = 0; k < SQ_LANES; k++)
            widened[k] = half_to_float(x[k]);
#endif
    }
}

static inline double fold_lanes(const double *lanes)
{
    double sum = 0.0;
    for (int k = 0; k < SQ_LANES; k++)
        sum += lanes[k];
    return sum;
}

/* The squared norm of x[start, end) widened exactly, in float64: SQ_LANES lanes folded in order, then the tail (the
 * order both the norm kernel and the cast keep, so they give the same bits). */
static inline double half_block_sq(const uint16_t *x, int64_t start, int64_t end, int is_bf16)
{
    double lanes[SQ_LANES] = {0};
    int64_t i = start;
    for (; i + SQ_LANES <= end; i += SQ_LANES) {
        float widened[SQ_LANES];
        widen_lanes(x + i, widened, is_bf16);
        for (int k = 0; k < SQ_LANES; k++)
            lanes[k] += (double)widened[k] * widened[k];
    }
    double sum = fold_lanes(lanes);
    for (; i < end; i++) {
        double v = is_bf16 ? bf16_to_float(x[i]) : half_to_float(x[i]);
        sum += v * v;
    }
    return sum;
}

double lg_half_sq(const uint16_t *x, int64_t n, int is_bf16, double *scratch, int threads)
{
    int64_t blocks = (n + SQ_BLOCK - 1) / SQ_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * SQ_BLOCK, end = start + SQ_BLOCK < n ? start + SQ_BLOCK : n;
        scratch[b] = half_block_sq(x, start, end, is_bf16);
    }
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++)
        total += scratch[b];
    return total;
}

/*
 * Natural compression (compressors/natural.py): each finite non-zero entry rounded at random to the power of two just
 * below or just above it, sent as a byte: a sign bit and a 7-bit exponent code counted down from the tensor's largest
 * power `top` (code = top - r + 1 for 2^r; 0 sends 0; 128, the sign with code 0, marks a NaN or Inf). Two passes over
 * the gradient: the largest rounded exponent, then the bytes; both draw entry i's uniform from the counter-based
 * generator, so the second draws what the first did. The eager path computes the same bytes with frexp.
 */
static inline int natural_exponent(uint32_t bits, float u, int maxexp)
{
    /* |x| = 2^(e-1) (1 + frac), frac in [0, 1): rounded up to 2^e with probability frac. A subnormal is scaled by
     * 2^64 first (exactly) so that its exponent field is a normal one's, without a branch. */
    uint32_t magnitude = bits & MAGNITUDE, subnormal = (magnitude >> 23) == 0u;
    float value;
    memcpy(&value, &magnitude, sizeof value);
    value *= subnormal ? 0x1p64f : 1.0f;
    uint32_t scaled;
    memcpy(&scaled, &value, sizeof scaled);
    int e = (int)(scaled >> 23) - 126 - (subnormal ? 64 : 0);
    float frac = (float)(scaled & 0x7fffffu) * 0x1p-23f;
    int r = e - 1 + (u < frac);
    return r < maxexp ? r : maxexp;
}

/* The largest rounded exponent of the finite non-zero entries (INT32_MIN when there are none). An entry in a lower
 * exponent field than one already seen cannot round above it, so only the others are drawn (a branch rarely taken
 * after the first few entries). */
int lg_natural_top(const float *x, int64_t n, uint64_t stream, int maxexp, int threads)
{
    const uint32_t *bits = (const uint32_t *)x;
    int top = INT32_MIN;
#pragma omp parallel num_threads(threads) reduction(max : top) if (n > PARALLEL_BLOCKS * 32)
    {
        uint32_t field = 0; /* the largest exponent field of this thread's finite non-zero entries so far */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            uint32_t magnitude = bits[i] & MAGNITUDE;
            if (magnitude >> 23 >= field && magnitude != 0u && magnitude < INF_BITS) {
                field = magnitude >> 23;
                int r = natural_exponent(bits[i], uniform_at(stream, i), maxexp);
                top = r > top ? r : top;
            }
        }
    }
    return top;
}

/* Entry i's byte, without a branch. */
static inline uint8_t natural_byte(uint32_t bits, float u, int maxexp, int top)
{
    uint32_t magnitude = bits & MAGNITUDE, counted = magnitude != 0u && magnitude < INF_BITS;
    int code = top - natural_exponent(bits, u, maxexp) + 1;
    code = counted && code <= 127 ? code : 0;
    uint32_t byte = (uint32_t)code | ((bits >> 31) & (code != 0)) << 7; /* unsigned 0: the sign with 0 is NaN's */
    return (uint8_t)(magnitude >= INF_BITS ? 128u : byte);
}

#define NATURAL_BLOCK 4096

/* The bytes of `x` for the largest exponent `top`; returns the squared norm of what they decode to (0 below
 * 2^smallest, the payload dtype's smallest subnormal; NaN if an entry is not finite), each block's bytes read back
 * from cache through a table of the 256 squares, summed in float64 in eight lanes a block of NATURAL_BLOCK entries,
 * the blocks in block order (the thread count does not change it). */
double lg_natural_encode(const float *x, int64_t n, uint64_t stream, int maxexp, int top, int smallest, uint8_t *out,
                         double *scratch, int threads)
{
    const uint32_t *bits = (const uint32_t *)x;
    double squares[256];
    for (int byte = 0; byte < 256; byte++) {
        int code = byte & 127, r = top - code + 1; /* 2^r: its square 2^(2r) a normal double (r >= -149 - 126) */
        uint64_t square = code != 0 && r >= smallest ? (uint64_t)(2 * r + 1023) << 52 : 0u;
        memcpy(&squares[byte], &square, sizeof square);
    }
    squares[128] = NAN;
    int64_t blocks = (n + NATURAL_BLOCK - 1) / NATURAL_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * NATURAL_BLOCK, end = start + NATURAL_BLOCK < n ? start + NATURAL_BLOCK : n, i;
        for (i = start; i < end; i++)
            out[i] = natural_byte(bits[i], uniform_at(stream, i), maxexp, top);
        double lanes[8] = {0}, sum = 0.0;
        for (i = start; i + 8 <= end; i += 8)
            for (int k = 0; k < 8; k++)
                lanes[k] += squares[out[i + k]];
        for (int k = 0; k < 8; k++)
            sum += lanes[k];
        for (; i < end; i++)
            sum += squares[out[i]];
        scratch[b] = sum;
    }
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++)
        total += scratch[b];
    return total;
}

/* out[i] = out[i] + table[bytes[i]]: the decode of every byte (times a scale) looked up. */
void lg_natural_add(const uint8_t *restrict bytes, int64_t n, const float *restrict table, float *restrict out,
                    int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t i = 0; i < n; i++)
        out[i] = out[i] + table[bytes[i]];
}

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

/*
 * The casts (compressors/cast.py) in one pass: each fp32 entry rounded to fp16 or bf16 (to nearest, ties to even, as
 * torch rounds; NaN as a quiet NaN), written to `out`, with the two norms the statistics header needs: ||x||^2 of the
 * input and ||wire||^2 of the 16-bit values (each widened exactly), both in float64, SQ_LANES lanes a block of
 * SQ_BLOCK entries, the blocks in block order (the thread count does not change them).
 */
static inline float from_bits(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_half(float f)
{
    /* Without branches. The float addition does the rounding: |f| scaled up and down by powers of two (so that an
     * overflow becomes inf and the exponent is kept), then added to a power of two whose exponent places fp16's last
     * mantissa bit at fp32's last, so the sum is rounded to nearest even exactly where fp16 would round; a subnormal
     * result takes the smallest such bias (2^-14's). The fp16 bits are then the sum's low bits. */
    uint32_t w, twice, bias, bits;
    memcpy(&w, &f, sizeof w);
    twice = w + w; /* the sign shifted out */
    bias = twice & 0xff000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    float base = (fabsf(f) * 0x1p112f) * 0x1p-110f;
    base = from_bits((bias >> 1) + 0x07800000u) + base;
    memcpy(&bits, &base, sizeof bits);
    uint32_t magnitude = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)(((w & 0x80000000u) >> 16) | (twice > 0xff000000u ? 0x7e00u : magnitude));
}

static inline uint16_t float_to_bf16(float f)
{
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    uint32_t rounded = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16; /* to nearest, ties to even */
    return (uint16_t)((w & MAGNITUDE) > INF_BITS ? 0x7fc0u : rounded);
}

/* The portable conversions alone (the cast's path on CPUs without F16C, and bf16's everywhere): for the tests. */
void lg_half_bits(const float *x, int64_t n, int is_bf16, uint16_t *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = is_bf16 ? float_to_bf16(x[i]) : float_to_half(x[i]);
}

/* SQ_LANES fp32 values rounded to 16 bits. */
static inline void narrow_lanes(const float *x, uint16_t *out, int is_bf16)
{
    if (is_bf16)
        for (int k = 0; k < SQ_LANES; k++)
            out[k] = float_to_bf16(x[k]);
    else {
#ifdef __F16C__ /* the hardware's conversion (to nearest even; a NaN keeps its payload's top bits, quieted) */
        for (int k = 0; k < SQ_LANES; k += 8)
            _mm_storeu_si128((__m128i *)(out + k), _mm256_cvtps_ph(_mm256_loadu_ps(x + k), _MM_FROUND_TO_NEAREST_INT));
#else
        for (int k = 0; k < SQ_LANES; k++)
            out[k] = float_to_half(x[k]);
#endif
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* acc[j] += the squares of lanes 8j..8j+7 of (a, b), widened to float64: the portable loop's arithmetic per lane
 * (a product, then a sum), four registers of eight lanes. */
static inline void add_squares(__m512d acc[4], __m512 a, __m512 b)
{
    __m512d part[4] = {_mm512_cvtps_pd(_mm512_castps512_ps256(a)),
                       _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))),
                       _mm512_cvtps_pd(_mm512_castps512_ps256(b)),
                       _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b), 1)))};
    for (int j = 0; j < 4; j++)
        acc[j] = _mm512_add_pd(acc[j], _mm512_mul_pd(part[j], part[j]));
}

/* Sixteen fp32 values rounded to bf16 (float_to_bf16's integer rounding and quiet NaN), stored, and widened back. */
static inline __m512 narrow_bf16(__m512 v, uint16_t *out)
{
    __m512i w = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(w, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(_mm512_srli_epi32(w, 16), one)),
        16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(w, _mm512_set1_epi32((int)MAGNITUDE)),
                                            _mm512_set1_epi32((int)INF_BITS));
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(rounded));
    return _mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16));
}

/* Sixteen fp32 values rounded to fp16 by the hardware (as narrow_lanes' F16C path), stored, and widened back. */
static inline __m512 narrow_fp16(__m512 v, uint16_t *out)
{
    __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256((__m256i *)out, h);
    return _mm512_cvtph_ps(h);
}

/* The cast's SQ_LANES-entry steps over [i, end) in registers, the lanes' sums added into given and wired (the same
 * bits as the portable loop); returns where the steps stopped. */
static inline int64_t cast_steps(const float *x, int64_t i, int64_t end, int is_bf16, uint16_t *out, double *given,
                                 double *wired)
{
    __m512d g[4], s[4];
    for (int j = 0; j < 4; j++)
        g[j] = s[j] = _mm512_setzero_pd();
    for (; i + SQ_LANES <= end; i += SQ_LANES) {
        __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        __m512 wa = is_bf16 ? narrow_bf16(a, out + i) : narrow_fp16(a, out + i);
        __m512 wb = is_bf16 ? narrow_bf16(b, out + i + 16) : narrow_fp16(b, out + i + 16);
        add_squares(g, a, b);
        add_squares(s, wa, wb);
    }
    for (int j = 0; j < 4; j++) {
        _mm512_storeu_pd(given + 8 * j, g[j]);
        _mm512_storeu_pd(wired + 8 * j, s[j]);
    }
    return i;
}
#endif

double lg_cast_half(const float *x, int64_t n, int is_bf16, uint16_t *out, double *scratch, double *sent, int threads)
{
    int64_t blocks = (n + SQ_BLOCK - 1) / SQ_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * SQ_BLOCK, end = start + SQ_BLOCK < n ? start + SQ_BLOCK : n, i = start;
        /* Cast, widen back and both squares in one pass, from registers: the sent norm's lanes and tail as
         * half_block_sq sums them. */
        double given[SQ_LANES] = {0}, wired[SQ_LANES] = {0};
#if defined(__AVX512F__) && defined(__AVX512BW__)
        i = cast_steps(x, i, end, is_bf16, out, given, wired);
#endif
        for (; i + SQ_LANES <= end; i += SQ_LANES) {
            float widened[SQ_LANES];
            narrow_lanes(x + i, out + i, is_bf16);
            widen_lanes(out + i, widened, is_bf16);
            for (int k = 0; k < SQ_LANES; k++) {
                double v = x[i + k], w = widened[k];
                given[k] += v * v;
                wired[k] += w * w;
            }
        }
        double g = fold_lanes(given), s = fold_lanes(wired);
        for (; i < end; i++) {
            out[i] = is_bf16 ? float_to_bf16(x[i]) : float_to_half(x[i]);
            double v = x[i], w = is_bf16 ? bf16_to_float(out[i]) : half_to_float(out[i]);
            g += v * v;
            s += w * w;
        }
        scratch[2 * b] = g;
        scratch[2 * b + 1] = s;
    }
    double total = 0.0, total_sent = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        total += scratch[2 * b];
        total_sent += scratch[2 * b + 1];
    }
    *sent = total_sent;
    return total;
}

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
