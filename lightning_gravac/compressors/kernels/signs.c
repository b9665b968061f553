/*
 * Sign bits, for the sign methods (signsgd, efsignsgd, onebit): 8 a byte, most significant first, set for x >= 0
 * (so -0.0 sets it and NaN does not, as the eager comparison does); the last byte is zero-padded.
 */
#include "common.h"

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
