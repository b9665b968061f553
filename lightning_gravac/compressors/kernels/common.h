/*
 * What the kernel files share (all are compiled together into one library): the headers, the block size, when to
 * wake threads, a float's bit masks, the word of packed bits, the counter-based draws and the float64 lanes of the
 * squared norms found beside a pass.
 */
#ifndef LIGHTNING_GRAVAC_COMMON_H
#define LIGHTNING_GRAVAC_COMMON_H

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

/* Entries a block of the selection and of DGC's peaks (kernels.BLOCK). */
#define BLOCK 32
/* Below this many blocks one thread is faster than waking the others. */
#define PARALLEL_BLOCKS 4096
#define MAGNITUDE 0x7fffffffu
#define INF_BITS 0x7f800000u

/* The `count` (at most 8) bytes at `in` as one big-endian word: the first byte's most significant bit highest, as
 * packed codes and sign bits are laid out. */
static inline uint64_t packed_word(const uint8_t *in, int count)
{
    uint64_t word = 0;
    for (int b = 0; b < count; b++)
        word = word << 8 | in[b];
    return word;
}

/*
 * The counter-based draws of stochastic quantization and natural compression. Draw i of a stream is the top 24 bits of
 * SplitMix64's output function applied to stream + (i + 1) * golden, over 2^24: a float in [0, 1) that depends on
 * (stream, i) only, so any thread computes any entry's draw, and the eager path (compressors/uniform.py) computes the
 * same bits with int64 tensors.
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

/* The float64 squared norms found beside a pass (error feedback's sum, the casts): SQ_LANES lanes a block of SQ_BLOCK
 * entries (kernels.SQ_BLOCK, one scratch slot each), the lanes folded in order. */
#define SQ_BLOCK 1024
#define SQ_LANES 32

static inline double fold_lanes(const double *lanes)
{
    double sum = 0.0;
    for (int k = 0; k < SQ_LANES; k++)
        sum += lanes[k];
    return sum;
}

/* signs.c's decode, which onebit.c's single column is. */
void lg_add_signs(const uint8_t *bits, int64_t n, float pos, float neg, float *out, int threads);

#endif
