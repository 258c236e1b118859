// Activations quantized to 8 bits for the products, as llama.cpp quantizes them: per block of values a float step
// d = max|x| / 127 and integers q = round(x / d), the block matching the weights' format: 32 for the 32-weight
// formats (each block of weights has its own float scale anyway), 256 for the K-quants (their super-block, whose
// sub-block scales are integers: a whole super-block's dot products then add up in integers).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "formats.h"

namespace kvlm {

struct QuantizedRows {
    int block = 0;                 // values per step: 32 or 256
    int64_t n_rows = 0, padded_cols = 0;  // columns rounded up to a whole chunk; the padding is zero
    std::vector<int8_t> values;    // [n_rows][padded_cols]
    std::vector<float> step;       // [n_rows][padded_cols / block]
    std::vector<float> step_sum;   // [n_rows][padded_cols / block]: step * sum of the block's q
    std::vector<int16_t> sum16;    // [n_rows][padded_cols / 16]: sum of each 16 q
    std::vector<int16_t> sum32;    // [n_rows][padded_cols / 32]: sum of each 32 q

    const int8_t* row_values(int64_t r) const { return values.data() + r * padded_cols; }
    const float* row_step(int64_t r) const { return step.data() + r * (padded_cols / block); }
    const float* row_step_sum(int64_t r) const { return step_sum.data() + r * (padded_cols / block); }
    const int16_t* row_sum16(int64_t r) const { return sum16.data() + r * (padded_cols / GROUP); }
    const int16_t* row_sum32(int64_t r) const { return sum32.data() + r * (padded_cols / 32); }
};

inline float load_activation(const void* x, bool bf16, int64_t i) {
    return bf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

inline void resize_for(QuantizedRows& out, int block, int64_t n_rows, int64_t n_cols) {
    out.block = block;
    out.n_rows = n_rows;
    out.padded_cols = (n_cols + CHUNK - 1) / CHUNK * CHUNK;
    out.values.resize(size_t(n_rows * out.padded_cols));
    out.step.resize(size_t(n_rows * out.padded_cols / block));
    out.step_sum.resize(size_t(n_rows * out.padded_cols / block));
    out.sum16.resize(size_t(n_rows * out.padded_cols / GROUP));
    out.sum32.resize(size_t(n_rows * out.padded_cols / 32));
}

// Row r of x ([n_rows][n_cols], float32 or bfloat16; n_cols a multiple of out.block) into `out`.
inline void quantize_row(const void* x, bool bf16, int64_t r, int64_t n_cols, QuantizedRows& out) {
    int8_t* q = out.values.data() + r * out.padded_cols;
    float* step = out.step.data() + r * (out.padded_cols / out.block);
    float* step_sum = out.step_sum.data() + r * (out.padded_cols / out.block);
    int16_t* sum16 = out.sum16.data() + r * (out.padded_cols / GROUP);
    int16_t* sum32 = out.sum32.data() + r * (out.padded_cols / 32);
    const int block = out.block;
    float values[CHUNK];
    for (int64_t b = 0; b * block < out.padded_cols; ++b) {
        const int64_t first = b * block;
        float amax = 0.0f;
        for (int i = 0; i < block; ++i) {
            values[i] = first + i < n_cols ? load_activation(x, bf16, r * n_cols + first + i) : 0.0f;
            const float magnitude = std::fabs(values[i]);
            amax = magnitude > amax ? magnitude : amax;  // fmax's result (a NaN is passed over), but inlined: vmaxps
        }
        const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
        int total = 0;
        for (int g = 0; g < block / GROUP; ++g) {
            int sum = 0;
            for (int i = g * GROUP; i < (g + 1) * GROUP; ++i) {
                const int v = int(std::nearbyint(values[i] * inverse));  // ties to even
                q[first + i] = int8_t(v);
                sum += v;
            }
            sum16[first / GROUP + g] = int16_t(sum);
            total += sum;
        }
        step[b] = d;
        step_sum[b] = d * float(total);
    }
    for (int64_t g = 0; g < out.padded_cols / 32; ++g) sum32[g] = int16_t(sum16[2 * g] + sum16[2 * g + 1]);
}

}  // namespace kvlm
