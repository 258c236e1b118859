// Activations quantized to 8 bits for the products, as llama.cpp quantizes them: per block of values a float step
// d = max|x| / 127 and integers q = round(x / d), the block matching the weights' format: 32 for the 32-weight
// formats (each block of weights has its own float scale anyway), 256 for the K-quants (their super-block, whose
// sub-block scales are integers: a whole super-block's dot products then add up in integers).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "formats.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvlm {

struct QuantizedRows {
    int block = 0;                 // values per step: 32 or 256
    int64_t n_rows = 0, padded_cols = 0;  // columns rounded up to a whole chunk; the padding is zero
    std::vector<int8_t> values;    // [n_rows][padded_cols]
    std::vector<float> step;       // [n_rows][padded_cols / block]
    std::vector<float> step_sum;   // [n_rows][padded_cols / block]: step * sum of the block's q
    std::vector<int16_t> sum16;    // [n_rows][padded_cols / 16]: sum of each 16 q
    std::vector<int16_t> sum32;    // [n_rows][padded_cols / 32] and a spare: sum of each 32 q (read in pairs)

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
    out.sum32.resize(size_t(n_rows * out.padded_cols / 32) + 1);  // a pair read at the last one stays inside
}

// Block b of row r (values first .. first + block of x, zero past n_cols) into `out`'s levels, its 16-sums, its step
// and step times the levels' sum.
inline void quantize_block(const void* x, bool bf16, int64_t r, int64_t n_cols, int64_t b, QuantizedRows& out) {
    const int block = out.block;
    const int64_t first = b * block;
    int8_t* q = out.values.data() + r * out.padded_cols + first;
    int16_t* sum16 = out.sum16.data() + r * (out.padded_cols / GROUP) + first / GROUP;
    float values[CHUNK];
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
            q[i] = int8_t(v);
            sum += v;
        }
        sum16[g] = int16_t(sum);
        total += sum;
    }
    const int64_t step = r * (out.padded_cols / block) + b;
    out.step[step] = d;
    out.step_sum[step] = d * float(total);
}

#if defined(__AVX2__)
// 8 activations from x[i] as float32 (bfloat16 widened exactly).
inline __m256 load8(const void* x, bool bf16, int64_t i) {
    if (!bf16) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// quantize_block for a block wholly inside the row, 8 values at a time: the same max (vmaxps passes over a NaN as
// the scalar comparison does), the same rounding (to nearest, ties to even, as nearbyint in the default mode), the
// same integers; each level is its int32's low byte, as the int8_t conversion.
inline void quantize_block8(const void* x, bool bf16, int64_t r, int64_t n_cols, int64_t b, QuantizedRows& out) {
    const int block = out.block;
    const int64_t first = b * block, at = r * n_cols + first;
    int8_t* q = out.values.data() + r * out.padded_cols + first;
    int16_t* sum16 = out.sum16.data() + r * (out.padded_cols / GROUP) + first / GROUP;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 most = _mm256_setzero_ps();
    for (int i = 0; i < block; i += 8) most = _mm256_max_ps(_mm256_and_ps(load8(x, bf16, at + i), magnitude), most);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, most);
    float amax = 0.0f;
    for (float lane : lanes) amax = lane > amax ? lane : amax;
    const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 scale = _mm256_set1_ps(inverse);
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    int total = 0;
    for (int g = 0; g < block / GROUP; ++g) {
        __m256i sums = _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h) {
            const int i = g * GROUP + 8 * h;
            const __m256 scaled = _mm256_mul_ps(load8(x, bf16, at + i), scale);
            const __m256i v = _mm256_cvttps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            sums = _mm256_add_epi32(sums, v);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, low_bytes),
                                                              _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm256_castsi256_si128(bytes));
        }
        alignas(32) int32_t parts[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sums);
        int sum = 0;
        for (int32_t part : parts) sum += part;
        sum16[g] = int16_t(sum);
        total += sum;
    }
    const int64_t step = r * (out.padded_cols / block) + b;
    out.step[step] = d;
    out.step_sum[step] = d * float(total);
}
#endif

// Block b of row r wholly past the row's end (the padding to a whole chunk), as quantize_block makes it from zeros:
// levels, sums, step and step times sum all zero. A 576-wide row (SmolLM2's) pads 6 of its 24 blocks of 32, which
// through quantize_block's scalar loop took longer than the 18 real ones.
inline void quantize_padding(int64_t r, int64_t b, QuantizedRows& out) {
    const int block = out.block;
    std::memset(out.values.data() + r * out.padded_cols + b * block, 0, size_t(block));
    std::memset(out.sum16.data() + r * (out.padded_cols / GROUP) + b * block / GROUP, 0, sizeof(int16_t) * (block / GROUP));
    const int64_t step = r * (out.padded_cols / block) + b;
    out.step[step] = 0.0f;
    out.step_sum[step] = 0.0f;
}

// Row r of x ([n_rows][n_cols], float32 or bfloat16) into `out`.
inline void quantize_row(const void* x, bool bf16, int64_t r, int64_t n_cols, QuantizedRows& out) {
    for (int64_t b = 0; b * out.block < out.padded_cols; ++b) {
        if (b * out.block >= n_cols) {
            quantize_padding(r, b, out);
            continue;
        }
#if defined(__AVX2__)
        if ((b + 1) * out.block <= n_cols) {
            quantize_block8(x, bf16, r, n_cols, b, out);
            continue;
        }
#endif
        quantize_block(x, bf16, r, n_cols, b, out);
    }
    const int16_t* sum16 = out.row_sum16(r);
    int16_t* sum32 = out.sum32.data() + r * (out.padded_cols / 32);
    for (int64_t g = 0; g < out.padded_cols / 32; ++g) sum32[g] = int16_t(sum16[2 * g] + sum16[2 * g + 1]);
}

}  // namespace kvlm
