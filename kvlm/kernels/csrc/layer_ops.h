// The small ops of a decoder layer, each one pass over its rows instead of torch's several eager ops: decode
// attention read straight from the KV cells, RMSNorm (with the residual add before it), RoPE in place, and the
// gated activation. Plain C++ in float32 that the compiler vectorizes for the -march it builds; activations are
// float32 or bfloat16 (rounded once, at the end of each op, where torch rounds after every step).
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

// How a KV plane stores its rows (kvlm.memory.kv_store): dense float types, or q8_0 (int8 with an f16 scale per 32).
enum KVType : int { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };

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

inline void f16_row(const uint16_t* h, int d, float* out) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
    for (; i < d; ++i) out[i] = fp16_to_float(h[i]);
}

// One cached row of d values (one KV head of one cell) as float32.
struct KVPlane {
    const void* data;        // [cells][n_kv][d] of the plane's type (int8 quants for q8_0)
    const uint16_t* scales;  // q8_0 only: [cells][n_kv][d / 32] f16
    int type;
    int n_kv, d;

    void row(int64_t cell, int head, float* out) const {
        const int64_t at = (cell * n_kv + head) * int64_t(d);
        switch (type) {
            case KV_F32: std::copy_n(static_cast<const float*>(data) + at, d, out); break;
            case KV_BF16: {
                const uint16_t* h = static_cast<const uint16_t*>(data) + at;
                for (int i = 0; i < d; ++i) out[i] = bf16_to_float(h[i]);
                break;
            }
            case KV_F16: f16_row(static_cast<const uint16_t*>(data) + at, d, out); break;
            default: {
                const int8_t* q = static_cast<const int8_t*>(data) + at;
                const uint16_t* s = scales + at / 32;
                for (int b = 0; b < d / 32; ++b) {
                    const float scale = fp16_to_float(s[b]);
                    for (int i = 0; i < 32; ++i) out[b * 32 + i] = float(q[b * 32 + i]) * scale;
                }
            }
        }
    }
};

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

inline float sum(const float* a, int64_t n) {
    float partial[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) partial[j] += a[i + j];
    float total = 0.0f;
    for (; i < n; ++i) total += a[i];
    for (int j = 0; j < 16; ++j) total += partial[j];
    return total;
}

inline float maximum(const float* a, int64_t n) {
    float partial[16];
    std::fill(partial, partial + 16, -INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) partial[j] = std::max(partial[j], a[i + j]);
    float top = -INFINITY;
    for (; i < n; ++i) top = std::max(top, a[i]);
    for (int j = 0; j < 16; ++j) top = std::max(top, partial[j]);
    return top;
}

// a[i] = exp(a[i]) for a[i] <= 0 (scores less their maximum), within 2 ulp: Cody-Waite reduction by ln 2 and
// Cephes' polynomial, in a loop the compiler vectorizes (std::exp is a call per value).
inline void exp_nonpositive(float* a, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float x = std::max(a[i], -87.0f);
        const float k = std::floor(x * 1.44269504088896341f + 0.5f);
        const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        const float y = p * r * r + r + 1.0f;
        const int32_t bits = (int32_t(k) + 127) << 23;
        float two_k;
        std::memcpy(&two_k, &bits, 4);
        a[i] = y * two_k;
    }
}

#if defined(__AVX512F__)
// 16 values of a dense plane from element `at`, as float32.
template <int TYPE> inline __m512 kv_chunk(const void* data, int64_t at) {
    if constexpr (TYPE == KV_F32) return _mm512_loadu_ps(static_cast<const float*>(data) + at);
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + at));
    if constexpr (TYPE == KV_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    return _mm512_cvtph_ps(half);
}

// The scores and the weighted sum of V for a dense plane with d a multiple of 16 (at most 256): each row converted
// once into registers, the query heads' partial sums and outputs in whole vectors.
template <int TYPE> void scores_avx512(const float* q, int group, int d, float scale, const int64_t* cells,
                                       int64_t length, const KVPlane& k, int head, float* scores) {
    const int chunks = d / 16;
    __m512 row[16];
    for (int64_t j = 0; j < length; ++j) {
        const int64_t at = (cells[j] * k.n_kv + head) * int64_t(d);
        for (int c = 0; c < chunks; ++c) row[c] = kv_chunk<TYPE>(k.data, at + 16 * c);
        for (int g = 0; g < group; ++g) {
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + g * d), row[0]);
            for (int c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + 16 * c), row[c], acc);
            scores[g * length + j] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
}

template <int TYPE> void values_avx512(const float* probs, int group, int d, const int64_t* cells, int64_t length,
                                       const KVPlane& v, int head, float* out) {
    const int chunks = d / 16;
    __m512 row[16];
    for (int64_t j = 0; j < length; ++j) {
        const int64_t at = (cells[j] * v.n_kv + head) * int64_t(d);
        for (int c = 0; c < chunks; ++c) row[c] = kv_chunk<TYPE>(v.data, at + 16 * c);
        for (int g = 0; g < group; ++g) {
            const __m512 p = _mm512_set1_ps(probs[g * length + j]);
            float* o = out + g * d;
            for (int c = 0; c < chunks; ++c)
                _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(p, row[c], _mm512_loadu_ps(o + 16 * c)));
        }
    }
}

template <class F> bool with_dense_plane(const KVPlane& plane, F&& f) {
    if (plane.d % 16 || plane.d > 256) return false;
    switch (plane.type) {
        case KV_F32: f(std::integral_constant<int, KV_F32>{}); return true;
        case KV_BF16: f(std::integral_constant<int, KV_BF16>{}); return true;
        case KV_F16: f(std::integral_constant<int, KV_F16>{}); return true;
        default: return false;
    }
}
#endif

// Scores of a token's query heads against its cells, row by row, for any plane.
inline void scores_any(const float* q, int group, int d, float scale, const int64_t* cells, int64_t length,
                       const KVPlane& k, int head, std::vector<float>& row, float* scores) {
    for (int64_t j = 0; j < length; ++j) {
        k.row(cells[j], head, row.data());
        for (int g = 0; g < group; ++g) scores[g * length + j] = dot(q + int64_t(g) * d, row.data(), d) * scale;
    }
}

inline void values_any(const float* probs, int group, int d, const int64_t* cells, int64_t length,
                       const KVPlane& v, int head, std::vector<float>& row, float* out) {
    for (int64_t j = 0; j < length; ++j) {
        v.row(cells[j], head, row.data());
        for (int g = 0; g < group; ++g) {
            const float p = probs[g * length + j];
            float* og = out + int64_t(g) * d;
            for (int i = 0; i < d; ++i) og[i] += p * row[i];
        }
    }
}

// Each query head's scores turned into probabilities in place: the maximum subtracted, exp, normalized.
inline void softmax_rows(float* scores, int group, int64_t length) {
    for (int g = 0; g < group; ++g) {
        float* s = scores + g * length;
        const float top = maximum(s, length);
        for (int64_t j = 0; j < length; ++j) s[j] -= top;
        exp_nonpositive(s, length);
        const float inverse = 1.0f / sum(s, length);
        for (int64_t j = 0; j < length; ++j) s[j] *= inverse;
    }
}

// Attention of one token's query heads sharing KV head `head` over its `length` cells (`cells`), float32
// throughout: scores, a softmax with the maximum subtracted, and the weighted sum of V.
inline void attend_one_head(const float* q, int group, int d, float scale, const int64_t* cells, int64_t length,
                            const KVPlane& k, const KVPlane& v, int head, std::vector<float>& scores,
                            std::vector<float>& row, float* out) {
    scores.resize(size_t(group) * length);
    row.resize(d);
    std::fill(out, out + int64_t(group) * d, 0.0f);
#if defined(__AVX512F__)
    const bool vectors = with_dense_plane(k, [&](auto tag) {
        constexpr int TYPE = decltype(tag)::value;
        scores_avx512<TYPE>(q, group, d, scale, cells, length, k, head, scores.data());
        softmax_rows(scores.data(), group, length);
        values_avx512<TYPE>(scores.data(), group, d, cells, length, v, head, out);
    });
    if (vectors) return;
#endif
    scores_any(q, group, d, scale, cells, length, k, head, row, scores.data());
    softmax_rows(scores.data(), group, length);
    values_any(scores.data(), group, d, cells, length, v, head, row, out);
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

}  // namespace kvlm
