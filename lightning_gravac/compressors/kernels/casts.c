/*
 * The 16-bit casts (compressors/cast.py): the squared norm of fp16 and bf16 values, and the cast from fp32 with
 * both norms in the same pass.
 */
#include "common.h"

/*
 * The squared L2 norm of 16-bit floats (the casts' payload, for the statistics header), in float64: a norm read
 * straight from 16-bit values is about 10x slower in eager PyTorch. Each value widened to float32 exactly (fp16 by its
 * bits: normal, subnormal, inf and NaN; bf16 by a shift), squared and summed in float64 (a bf16 value's square can
 * overflow float32) in SQ_LANES lanes a block of SQ_BLOCK entries, the lanes folded in order, then the block's
 * tail, the blocks in block order: the thread count does not change the result. Thirty-two lanes are four
 * independent chains of eight-wide additions: eight lanes (one chain) left the sum bound by the addition's latency,
 * at twice a copy's time for half a copy's bytes.
 */
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
