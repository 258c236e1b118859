// The small ops of a decoder layer, each one pass over its rows instead of torch's several eager ops: RMSNorm (with
// the residual add before it), QK-norm and RoPE in place, the gated activation, a sigmoid gate and the logits'
// softcap (attention: attention.h). Plain C++ in float32 that the compiler vectorizes for the -march it builds;
// activations are float32 or bfloat16 (rounded once, at the end of each op, where torch rounds after every step).
// An element's result depends only on its row's values and its place in the row, never on how many rows a call
// holds (torch's own elementwise ops round a value differently in a tensor's vectorized body and its scalar tail):
// a token's activations do not depend on its batch. Transcendental functions are scalar calls (g++ vectorizes them
// only under -ffast-math), so every element takes the same code.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "formats.h"

namespace kvlm {

inline float load_value(const void* x, bool bf16, int64_t i) {
    return bf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

inline void store_value(void* x, bool bf16, int64_t i, float v) {
    if (bf16) static_cast<uint16_t*>(x)[i] = float_to_bf16(v);
    else static_cast<float*>(x)[i] = v;
}

inline void load_floats(const void* x, bool bf16, int64_t n, float* out) {
    if (bf16) {
        const uint16_t* h = static_cast<const uint16_t*>(x);
        for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(h[i]);
    } else {
        std::copy_n(static_cast<const float*>(x), n, out);
    }
}

// Sum of a[i] * b[i] in 16 interleaved partial sums, a fixed order of additions (a single running sum is one the
// compiler may not vectorize); with AVX-512 or AVX2 the partial sums stay in one register to the end.
inline float dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    total = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#else
    float partial[16] = {};
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) partial[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 16; ++j) total += partial[j];
#endif
    for (; i < n; ++i) total += a[i] * b[i];
    return total;
}

// out = normalized rows of (x + residual), times weight; sum (may alias x) gets x + residual when residual is
// given. n: a row's length.
inline void rms_norm_row(const void* x, const void* residual, bool bf16, int64_t r, int64_t n, const void* weight,
                         float eps, void* out, void* sum, std::vector<float>& values) {
    values.resize(n);
    load_floats(static_cast<const char*>(x) + r * n * (bf16 ? 2 : 4), bf16, n, values.data());
    if (residual) {
        for (int64_t i = 0; i < n; ++i) {
            const float added = values[i] + load_value(residual, bf16, r * n + i);
            store_value(sum, bf16, r * n + i, added);
            values[i] = bf16 ? bf16_to_float(float_to_bf16(added)) : added;  // the stream as stored
        }
    }
    const float squares = dot(values.data(), values.data(), n);
    const float inverse = 1.0f / std::sqrt(squares / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) store_value(out, bf16, r * n + i, values[i] * inverse * load_value(weight, bf16, i));
}

// RMSNorm over each of n_heads heads of d values of one token, in place, each head with its own weight [n_heads][d]
// (QK-norm): the same arithmetic as rms_norm_row, rounded once.
inline void head_norm_token(void* x, bool bf16, int64_t at, int n_heads, int d, const void* weight, float eps,
                            std::vector<float>& values) {
    values.resize(d);
    for (int h = 0; h < n_heads; ++h) {
        const int64_t base = at + int64_t(h) * d;
        load_floats(static_cast<char*>(x) + base * (bf16 ? 2 : 4), bf16, d, values.data());
        const float inverse = 1.0f / std::sqrt(dot(values.data(), values.data(), d) / float(d) + eps);
        for (int i = 0; i < d; ++i)
            store_value(x, bf16, base + i, values[i] * inverse * load_value(weight, bf16, int64_t(h) * d + i));
    }
}

// RoPE of n_heads heads of one token in place (pairs i, i + d/2: the Hugging Face layout), cos and sin [d] float32.
inline void rope_token(void* x, bool bf16, int64_t at, int n_heads, int d, const float* cos, const float* sin) {
    const int half = d / 2;
    for (int h = 0; h < n_heads; ++h) {
        const int64_t base = at + int64_t(h) * d;
        for (int i = 0; i < half; ++i) {
            const float a = load_value(x, bf16, base + i), b = load_value(x, bf16, base + half + i);
            store_value(x, bf16, base + i, a * cos[i] - b * sin[i]);
            store_value(x, bf16, base + half + i, b * cos[half + i] + a * sin[half + i]);
        }
    }
}

inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// out [n] = act(gate) * up for one row of gate_up [2n] (gate first).
inline void gated_row(const void* gate_up, bool bf16, int64_t r, int64_t n, bool gelu, void* out) {
    for (int64_t i = 0; i < n; ++i) {
        const float g = load_value(gate_up, bf16, r * 2 * n + i), u = load_value(gate_up, bf16, r * 2 * n + n + i);
        const float a = gelu ? gelu_tanh(g) : g / (1.0f + std::exp(-g));
        store_value(out, bf16, r * n + i, a * u);
    }
}

// out [n] = x * sigmoid(gate) for one row: gate [n], or [1] for the whole row (gate_cols 1); gate float32.
inline void sigmoid_gate_row(const void* x, bool bf16, int64_t r, int64_t n, const float* gate, int64_t gate_cols,
                             void* out) {
    for (int64_t i = 0; i < n; ++i) {
        const float g = gate[r * gate_cols + (gate_cols == 1 ? 0 : i)];
        store_value(out, bf16, r * n + i, load_value(x, bf16, r * n + i) / (1.0f + std::exp(-g)));
    }
}

// cap * tanh(x / cap) over one row of n float32 logits, in place (Gemma's final softcap).
inline void softcap_row(float* logits, int64_t r, int64_t n, float cap) {
    for (int64_t i = 0; i < n; ++i) logits[r * n + i] = cap * std::tanh(logits[r * n + i] / cap);
}

}  // namespace kvlm
