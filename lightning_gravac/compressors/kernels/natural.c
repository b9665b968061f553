/*
 * Natural compression (compressors/natural.py): each finite non-zero entry rounded at random to the power of two just
 * below or just above it, sent as a byte: a sign bit and a 7-bit exponent code counted down from the tensor's largest
 * power `top` (code = top - r + 1 for 2^r; 0 sends 0; 128, the sign with code 0, marks a NaN or Inf). Two passes over
 * the gradient: the largest rounded exponent, then the bytes; both draw entry i's uniform from the counter-based
 * generator, so the second draws what the first did. The eager path computes the same bytes with frexp.
 */
#include "common.h"

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
