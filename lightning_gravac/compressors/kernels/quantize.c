/*
 * Quantization in one pass: stochastic (qsgd, terngrad), with uniform draws from the counter-based generator
 * (common.h) instead of a gradient-sized tensor of random numbers, or to the nearest level (the block codes), the codes
 * packed as they are made; TernGrad's statistics; the codes' decode and their exact energy.
 */
#include "common.h"

/* The draws alone, for the eager twin's tests (compressors/uniform.py). */
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

/* One entry's level, min(floor(|x| * scale + u), s), with the sign of x, offset by s (a code in [0, 2s]): QSGD's with
 * u a draw, the nearest level with u = 1/2. */
static inline uint8_t level_code(float x, float scale, float u, int s)
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

/* out += ((code - offset) * step) * alpha, each product rounded to fp32 (the decode's, and the residual's with
 * alpha = -1). */
static inline void codes_add_one(float *out, int code, int offset, float step, float alpha)
{
    float value = (float)(code - offset) * step;
    value = value * alpha;
    *out = *out + value;
}

/* The packed codes of `x`, bucket b's entries scaled by `scales[b]`: a level is floor(|x| scale + u) with u the
 * stream's draw i (QSGD's stochastic rounding), or with u = 1/2 where `draws` is 0 (rounding to the nearest level, the
 * block codes'). `draws` is a constant at each call, so each caller's loop is compiled without the other's branch.
 * With `residual` (whole groups of 8 a bucket only), each entry becomes x - (code - s) * steps[b] in place as it is
 * coded: decoding's value, rounded as lg_codes_add rounds it, so the bits of the separate decode-and-subtract. */
static inline void encode_codes(float *x, int64_t n, const float *scales, int64_t bucket, int s, int bits,
                                uint64_t stream, const int draws, const float *steps, uint8_t *out, int threads)
{
#define LEVEL_U(i) (draws ? uniform_at(stream, (i)) : 0.5f)
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
                    codes[i - start] = level_code(x[i], scale, LEVEL_U(i), s);
                if (steps != NULL) {
                    float step = steps[b];
                    for (int64_t i = first; i < last; i++)
                        codes_add_one(x + i, codes[i - start], s, step, -1.0f);
                }
            }
            pack_groups(codes, (end - start) / 8, bits, out + chunk * PACKS * bits);
        }
        PACK_TAIL(level_code(x[i], scales[i / bucket], LEVEL_U(i), s));
        if (steps != NULL) {
            int64_t nbytes = (n * bits + 7) / 8;
            for (int64_t i = full * 8; i < n; i++)
                codes_add_one(x + i, code_at(out, nbytes, bits, i), s, steps[i / bucket], -1.0f);
        }
    } else {
        PACK_CODES(level_code(x[i], scales[i / bucket], LEVEL_U(i), s));
    }
#undef LEVEL_U
}

/* QSGD: `scales[b]` is s / max(norm of bucket b, FLT_MIN) as float32 (computed by the caller, as the eager path). */
void lg_qsgd_encode(const float *x, int64_t n, const float *scales, int64_t bucket, int s, int bits, uint64_t stream,
                    uint8_t *out, int threads)
{
    encode_codes((float *)x, n, scales, bucket, s, bits, stream, 1, NULL, out, threads);
}

/* The largest magnitude of each block of `block` entries (the last one short), NaN where a block holds one: one read of
 * the magnitudes' bits as unsigned integers (a float's magnitude orders as its bits do, and every NaN's exceed
 * infinity's, so the integer max is the largest magnitude or a NaN), in lanes of 16 that vectorize. */
void lg_block_absmax(const float *x, int64_t n, int64_t block, float *out, int threads)
{
    const uint32_t *bits = (const uint32_t *)x;
    int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > PARALLEL_BLOCKS * 32)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * block, end = start + block < n ? start + block : n, i = start;
        uint32_t lanes[16] = {0}, peak = 0;
        for (; i + 16 <= end; i += 16)
            for (int k = 0; k < 16; k++) {
                uint32_t m = bits[i + k] & 0x7fffffffu;
                lanes[k] = m > lanes[k] ? m : lanes[k];
            }
        for (; i < end; i++) {
            uint32_t m = bits[i] & 0x7fffffffu;
            peak = m > peak ? m : peak;
        }
        for (int k = 0; k < 16; k++)
            peak = lanes[k] > peak ? lanes[k] : peak;
        memcpy(out + b, &peak, sizeof peak);
    }
}

/* The block codes: `scales[b]` is s / (largest magnitude of block b) as float32, 0 for a block of zeros (computed by
 * the caller, as the eager path); each entry rounded to the nearest level (a tie away from zero). With `steps` (the
 * decoding steps, whole groups of 8 a block), `x` becomes the residual x - decoded in the same pass. */
void lg_block_encode(float *x, int64_t n, const float *scales, int64_t block, int s, int bits, const float *steps,
                     uint8_t *out, int threads)
{
    encode_codes(x, n, scales, block, s, bits, 0, 0, steps, out, threads);
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
