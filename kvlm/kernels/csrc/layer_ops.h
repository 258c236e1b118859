// The small ops of a decoder layer, each one pass over its rows instead of torch's several eager ops: RMSNorm (with
// the residual add before it), QK-norm and RoPE in place, the gated activation, a sigmoid gate and the logits'
// softcap (attention: attention.h). Plain C++ in float32 that the compiler vectorizes for the -march it builds;
// activations are float32 or bfloat16 (rounded once, at the end of each op, where torch rounds after every step).
// An element's result depends only on its row's values and its place in the row, never on how many rows a call
// holds (torch's own elementwise ops round a value differently in a tensor's vectorized body and its scalar tail):
// a token's activations do not depend on its batch. The activations, sigmoid and tanh are written here in basic
// IEEE operations (exp_float), which the compiler vectorizes (it never vectorizes libm's calls without -ffast-math)
// and which round alike in its vector body and scalar tail (no contraction: -ffp-contract=off), so every element of a
// row takes the same arithmetic wherever it lies.
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

// v as the activation dtype holds it.
inline float rounded(bool bf16, float v) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

inline void load_floats(const void* x, bool bf16, int64_t n, float* out) {
    if (bf16) {
        const uint16_t* h = static_cast<const uint16_t*>(x);
        for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(h[i]);
    } else {
        std::copy_n(static_cast<const float*>(x), n, out);
    }
}

inline void store_floats(void* x, bool bf16, int64_t n, const float* values) {
    if (bf16) {
        uint16_t* h = static_cast<uint16_t*>(x);
        for (int64_t i = 0; i < n; ++i) h[i] = float_to_bf16(values[i]);
    } else {
        std::copy_n(values, n, static_cast<float*>(x));
    }
}

// exp(x) within 2 ulp from exp(-87) up (below -87 the value at -87, from about 88.4 infinity: what the activations
// and attention's softmax need): Cody-Waite reduction by ln 2 and Cephes' polynomial, in basic operations the
// compiler vectorizes (with -fno-trapping-math), each element rounding alike in vector and scalar code (attention.h's
// AVX2 twin computes the same operations for x <= 0).
inline float exp_float(float value) {
    const float x = std::min(std::max(value, -87.0f), 88.72f);
    const float k = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = (int32_t(k) + 127) * (1 << 23);
    float two_k;
    std::memcpy(&two_k, &bits, 4);
    return y * two_k;
}

// tanh(x) within a few ulp: Cephes' odd polynomial below |x| 0.625, else 1 - 2 / (exp(2|x|) + 1) with x's sign.
inline float tanh_float(float x) {
    const float a = std::fabs(x), z = x * x;
    const float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                          1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
    const float large = std::copysign(1.0f - 2.0f / (exp_float(2.0f * a) + 1.0f), x);
    return a < 0.625f ? small : large;
}

inline float sigmoid_float(float x) { return 1.0f / (1.0f + exp_float(-x)); }

inline float silu_float(float x) { return x / (1.0f + exp_float(-x)); }

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
            values[i] = rounded(bf16, added);  // the stream as stored
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

// RoPE of n_heads heads of d values of one token in place, over each head's first `rotated` values (pairs i,
// i + rotated/2: the Hugging Face layout; the rest as they are: partial RoPE), cos and sin [rotated] float32.
// Through float buffers of SPAN pairs: loops the compiler vectorizes (each value element by element, it read and
// stored one at a time: 4% of a SmolLM2 prefill), the same operations on each value.
inline void rope_token(void* x, bool bf16, int64_t at, int n_heads, int d, int rotated, const float* cos,
                       const float* sin) {
    constexpr int SPAN = 64;
    const int half = rotated / 2;
    const int64_t element = bf16 ? 2 : 4;
    float a[SPAN], b[SPAN], first[SPAN], second[SPAN];
    for (int h = 0; h < n_heads; ++h) {
        char* head = static_cast<char*>(x) + (at + int64_t(h) * d) * element;
        for (int i0 = 0; i0 < half; i0 += SPAN) {
            const int n = std::min(SPAN, half - i0);
            load_floats(head + i0 * element, bf16, n, a);
            load_floats(head + (half + i0) * element, bf16, n, b);
            const float *c = cos + i0, *s = sin + i0, *c2 = cos + half + i0, *s2 = sin + half + i0;
            for (int i = 0; i < n; ++i) {
                first[i] = a[i] * c[i] - b[i] * s[i];
                second[i] = b[i] * c2[i] + a[i] * s2[i];
            }
            store_floats(head + i0 * element, bf16, n, first);
            store_floats(head + (half + i0) * element, bf16, n, second);
        }
    }
}

// GELU, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as x sigmoid(2u) (the
// same function, without 1 + tanh's cancellation where x is well below 0).
inline float gelu_tanh(float x) {
    return x / (1.0f + exp_float(-1.5957691216057308f * (x + 0.044715f * x * x * x)));
}

// g[i] = act(g[i]) * u[i] for m values: GELU (tanh) or SiLU.
inline void gate_values(float* g, const float* u, int64_t m, bool gelu) {
    if (gelu)
        for (int64_t i = 0; i < m; ++i) g[i] = gelu_tanh(g[i]) * u[i];
    else
        for (int64_t i = 0; i < m; ++i) g[i] = silu_float(g[i]) * u[i];
}

// out[i] = act(gate[i]) * up[i] for m values of the activation dtype, through float buffers of 256.
inline void gated_span(const void* gate, const void* up, bool bf16, int64_t m, bool gelu, void* out) {
    constexpr int64_t CHUNK = 256;
    float g[CHUNK], u[CHUNK];
    const int64_t element = bf16 ? 2 : 4;
    for (int64_t at = 0; at < m; at += CHUNK) {
        const int64_t count = std::min(CHUNK, m - at);
        load_floats(static_cast<const char*>(gate) + at * element, bf16, count, g);
        load_floats(static_cast<const char*>(up) + at * element, bf16, count, u);
        gate_values(g, u, count, gelu);
        store_floats(static_cast<char*>(out) + at * element, bf16, count, g);
    }
}

// out [n] = act(gate) * up for one row of gate_up [2n] (gate first), its columns first .. last - 1.
inline void gated_row(const void* gate_up, bool bf16, int64_t r, int64_t n, bool gelu, void* out, int64_t first = 0,
                      int64_t last = -1) {
    const int64_t element = bf16 ? 2 : 4, at = r * 2 * n + first;
    const char* row = static_cast<const char*>(gate_up);
    gated_span(row + at * element, row + (at + n) * element, bf16, (last < 0 ? n : last) - first, gelu,
               static_cast<char*>(out) + (r * n + first) * element);
}

// out [n] = x * sigmoid(gate) for one row: gate [n], or [1] for the whole row (gate_cols 1); gate float32. Through
// float buffers of 256, so the compiler vectorizes it.
inline void sigmoid_gate_row(const void* x, bool bf16, int64_t r, int64_t n, const float* gate, int64_t gate_cols,
                             void* out) {
    constexpr int64_t CHUNK = 256;
    float values[CHUNK];
    const int64_t element = bf16 ? 2 : 4;
    for (int64_t at = 0; at < n; at += CHUNK) {
        const int64_t count = std::min(CHUNK, n - at), first = r * n + at;
        load_floats(static_cast<const char*>(x) + first * element, bf16, count, values);
        if (gate_cols == 1)
            for (int64_t i = 0; i < count; ++i) values[i] = values[i] / (1.0f + exp_float(-gate[r]));
        else
            for (int64_t i = 0; i < count; ++i) values[i] = values[i] / (1.0f + exp_float(-gate[first + i]));
        store_floats(static_cast<char*>(out) + first * element, bf16, count, values);
    }
}

// cap * tanh(x / cap) over n float32 logits, in place (Gemma's final softcap).
inline void softcap_values(float* logits, int64_t n, float cap) {
    for (int64_t i = 0; i < n; ++i) logits[i] = cap * tanh_float(logits[i] / cap);
}

// A router's choice for one token (kvlm/model/moe.py's route): softmax over the n_expert logits (each plus its bias
// where given), the k most probable in descending order (the lower index first among equals), their probabilities
// renormalised to sum to 1 where asked. `values`: n_expert floats of scratch.
inline void route_token(const float* logits, const float* bias, int n_expert, int k, bool normalize, int32_t* ids,
                        float* weights, float* values) {
    float top = -INFINITY;
    for (int i = 0; i < n_expert; ++i) {
        values[i] = bias ? logits[i] + bias[i] : logits[i];
        top = std::max(top, values[i]);
    }
    float sum = 0.0f;
    for (int i = 0; i < n_expert; ++i) {
        values[i] = std::exp(values[i] - top);
        sum += values[i];
    }
    float chosen = 0.0f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int i = 0; i < n_expert; ++i)
            if (values[i] >= 0.0f && (best < 0 || values[i] > values[best])) best = i;
        if (best < 0) best = j;  // NaN logits: no probability to rank, the result NaN
        ids[j] = best;
        weights[j] = values[best] / sum;
        chosen += weights[j];
        values[best] = -1.0f;  // taken (a NaN one too)
    }
    if (normalize)
        for (int j = 0; j < k; ++j) weights[j] /= chosen;
}

}  // namespace kvlm
