/*
 * 1-bit SGD on a row-major [rows, cols] matrix. lg_onebit_sums gives, per column, the count of entries >= 0, their sum
 * and the sum of all (`out`: three arrays of `cols` doubles). Rows are cut into blocks of ONEBIT_ROWS; a block's sums
 * are one thread's (row by row, so the inner loop runs along a row's contiguous columns) and the blocks' sums are
 * added in block order, so the result does not depend on the thread count. `scratch` holds 3 x cols doubles a block.
 * A single column sums a block in eight float32 lanes (32 entries each), then in float64.
 * lg_onebit_add decodes: out[i] = out[i] + (bit i set ? pos : neg)[column of i], where the caller has multiplied the
 * means by the scale (in float32, as the eager decode does; by -1 for the exact residual x - decoded).
 */
#include "common.h"

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
