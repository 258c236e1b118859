// Attention read straight from the KV cells, for every token alike (a decode token, a prompt's, a guess being
// verified): each token's query heads over the cells it reads (its own included) in position order, K and V
// converted from the cache's dtype (f32, f16, bf16, q8_0) as they are read, float32 throughout; but for a bf16
// query against a bf16 cache where the CPU has AVX512-BF16, whose scores take the bf16 values as they are
// (bf16_scores_of: exact products, float32 sums).
//
// The work is one task per (token, KV head, chunk of CHUNK_CELLS cells): the query heads sharing that KV head take
// their scores against the chunk's rows, a softmax with the chunk's own maximum, and the weighted sum of its V rows;
// the chunks of a (token, KV head) are then merged (each rescaled by exp(its maximum - the overall one)). So one
// token over a long context is shared among the threads, and since chunks are fixed by position in the token's own
// cell list, its result depends only on that list: neither on the number of threads, nor on the other tokens of
// the step, nor on whether its prefix was computed in this call or an earlier one (batch invariance).
//
// Attention sinks (gpt-oss): one learned logit per query head joins each softmax's denominator, with no value row,
// so a head may attend to "nothing"; the merge starts its maximum and sum from the sink's logit.
#pragma once

#include <omp.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "formats.h"
#include "layer_ops.h"

namespace kvlm {

// How a KV plane stores its rows (kvlm.memory.kv_store): dense float types, or q8_0 (int8 with an f16 scale per 32).
enum KVType : int { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };

constexpr int64_t CHUNK_CELLS = 256;  // cells per partial softmax
constexpr int MAX_GROUP = 8;          // query heads taking their scores together (more are done 8 at a time)
constexpr int HEAD_DIM_STEP = 16;     // head_dim must be a multiple of this (every vector width divides it)

// One layer's K or V plane: [cells][n_kv][d] of `type` (int8 levels for q8_0, with scales [cells][n_kv][d / 32]).
struct KVPlane {
    const void* data;
    const uint16_t* scales;
    int type;
    int n_kv, d;
};

// --- float vectors of LANES values: AVX2 or one value at a time (the dense products' panels, dense.h) ---
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int LANES = 8;
using fvec = __m256;
inline fvec vzero() { return _mm256_setzero_ps(); }
inline fvec vset(float v) { return _mm256_set1_ps(v); }
inline fvec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline fvec vfma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec vmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
// The sum of a vector's lanes as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): the order vsums8 sums eight
// vectors in, so a sum is the same bits whichever of the two computes it.
inline float vsum(fvec v) {
    const __m256 pairs = _mm256_hadd_ps(v, v);
    const __m256 quads = _mm256_hadd_ps(pairs, pairs);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}
// Lane i: vsum(v[i]), for 8 vectors at once (9 instructions where 8 vsums take 32).
inline fvec vsums8(const fvec* v) {
    const __m256 ab = _mm256_hadd_ps(v[0], v[1]), cd = _mm256_hadd_ps(v[2], v[3]);
    const __m256 ef = _mm256_hadd_ps(v[4], v[5]), gh = _mm256_hadd_ps(v[6], v[7]);
    const __m256 abcd = _mm256_hadd_ps(ab, cd), efgh = _mm256_hadd_ps(ef, gh);
    return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20), _mm256_permute2f128_ps(abcd, efgh, 0x31));
}
inline fvec vhalves(const uint16_t* p, bool bf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}
inline fvec vbytes(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
constexpr int LANES = 1;
using fvec = float;
inline fvec vzero() { return 0.0f; }
inline fvec vset(float v) { return v; }
inline fvec vload(const float* p) { return *p; }
inline void vstore(float* p, fvec v) { *p = v; }
inline fvec vfma(fvec a, fvec b, fvec c) { return a * b + c; }
inline fvec vmul(fvec a, fvec b) { return a * b; }
inline float vsum(fvec v) { return v; }
inline fvec vhalves(const uint16_t* p, bool bf16) { return bf16 ? bf16_to_float(*p) : fp16_to_float(*p); }
inline fvec vbytes(const int8_t* p) { return float(*p); }
#endif

// --- the vectors attention computes in: 16 float lanes with AVX-512F (twice AVX2's values per instruction: the
// scores and weighted sums of a decode step over a long context were half of a 64-sequence step on a Zen 5), else
// fvec's 8 or 1. REGISTERS: the vector registers the loops below may fill. ---
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct KVLanes {
    using V = __m512;
    static constexpr int N = 16, REGISTERS = 32;
    static V zero() { return _mm512_setzero_ps(); }
    static V set(float v) { return _mm512_set1_ps(v); }
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    // Lanes i and i + 8 added, then fvec's order (vsum): so sum and sums8 give a lane sum the same bits.
    static __m256 folded(V v) {  // the high half through a double view: extractf32x8 would need AVX-512DQ
        return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    }
    static float sum(V v) { return vsum(folded(v)); }
    static __m256 sums8(const V* v) {
        fvec halves[8];
        for (int i = 0; i < 8; ++i) halves[i] = folded(v[i]);
        return vsums8(halves);
    }
    static V halves(const uint16_t* p, bool bf16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
    }
    static V bytes(const int8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
};
#else
struct KVLanes {
    using V = fvec;
    static constexpr int N = LANES, REGISTERS = 16;
    static V zero() { return vzero(); }
    static V set(float v) { return vset(v); }
    static V load(const float* p) { return vload(p); }
    static void store(float* p, V v) { vstore(p, v); }
    static V fma(V a, V b, V c) { return vfma(a, b, c); }
    static V mul(V a, V b) { return vmul(a, b); }
    static float sum(V v) { return vsum(v); }
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    static __m256 sums8(const V* v) { return vsums8(v); }
#endif
    static V halves(const uint16_t* p, bool bf16) { return vhalves(p, bf16); }
    static V bytes(const int8_t* p) { return vbytes(p); }
};
#endif
using kv = KVLanes;

// Where one cached row (one KV head of one cell) starts in its plane, in values.
inline int64_t row_start(const KVPlane& plane, int64_t cell, int head) {
    return (cell * plane.n_kv + head) * int64_t(plane.d);
}

// kv::N values of the cached row starting at value `first` of its plane, from value `at` of the row, as float32.
template <int TYPE> inline kv::V row_values(const KVPlane& plane, int64_t first, int at) {
    const int64_t value = first + at;
    if constexpr (TYPE == KV_F32) return kv::load(static_cast<const float*>(plane.data) + value);
    else if constexpr (TYPE == KV_F16 || TYPE == KV_BF16)
        return kv::halves(static_cast<const uint16_t*>(plane.data) + value, TYPE == KV_BF16);
    else  // kv::N divides 32: the values share one scale
        return kv::mul(kv::bytes(static_cast<const int8_t*>(plane.data) + value), kv::set(fp16_to_float(plane.scales[value / 32])));
}

// exp(x) for x <= 0 (scores less their maximum), within 2 ulp: layer_ops.h's exp_float (Cody-Waite reduction by
// ln 2 and Cephes' polynomial, below -87 the value at -87), whose upper clamp such x never reach.
inline float exp_nonpositive(float value) { return exp_float(value); }

#if defined(__AVX2__)
// The same operations on 8 values (AVX2, which AVX-512 CPUs run too): the same results as the scalar one.
inline __m256 exp_nonpositive(__m256 value) {
    const __m256 x = _mm256_max_ps(value, _mm256_set1_ps(-87.0f));
    const __m256 k = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                                   _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(k, _mm256_set1_ps(2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

// The largest of n > 0 scores, 8 lanes at a time where AVX2 is (one scalar max after another is a chain of
// dependent instructions: it took as long as the exps below in a prompt's attention).
inline float maximum(const float* s, int64_t n) {
    float top = s[0];
    int64_t j = 0;
#if defined(__AVX2__)
    if (n >= 8) {
        __m256 lanes = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= n; j += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + j));
        alignas(32) float values[8];
        _mm256_store_ps(values, lanes);
        top = *std::max_element(values, values + 8);
    }
#endif
    for (; j < n; ++j) top = std::max(top, s[j]);
    return top;
}

#if defined(__AVX512F__)
// The same on 16 values (AVX-512F): twice the values per instruction in a prompt's softmax, the same bits.
inline __m512 exp_nonpositive(__m512 value) {
    const __m512 x = _mm512_max_ps(value, _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                        _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693359375f))),
                                   _mm512_mul_ps(k, _mm512_set1_ps(2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
    const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}
#endif

// One head's scores turned into exp(score - their maximum), in place; returns (maximum, sum of the exps).
inline std::pair<float, float> exp_less_maximum(float* s, int64_t n) {
    const float top = maximum(s, n);
    float total = 0.0f;
    int64_t j = 0;
#if defined(__AVX2__)
    __m256 sums = _mm256_setzero_ps();
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {  // each half added as the 8-lane loop adds it: the same sums
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(top)));
        _mm512_storeu_ps(s + j, e);
        sums = _mm256_add_ps(sums, _mm512_castps512_ps256(e));
        sums = _mm256_add_ps(sums, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
        _mm256_storeu_ps(s + j, e);
        sums = _mm256_add_ps(sums, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sums);
    for (const float lane : lanes) total += lane;
#endif
    for (; j < n; ++j) {
        s[j] = exp_nonpositive(s[j] - top);
        total += s[j];
    }
    return {top, total};
}

// How many cells ahead rows are fetched (cells are gathered, not streamed), into L2: a decode step over 64 sequences
// of 300 cells waited on its K and V rows at 8 cells ahead into L1 (bench.decode_attention on a Zen 5: 34% of the
// read bandwidth; 32 ahead into L2 ~45%; 64 ahead, more than the misses in flight the core tracks, slower again).
// V's rows are fetched beside K's, during the scores, and a chunk's first rows before its loops start: 22 -> 18 ms in
// three of four alternations of that bench (the VM's noise is as large), the 7B shape's batch-1 step 2.1 -> 1.8 ms.
constexpr int PREFETCH_CELLS = 32;

// Asks for the row starting at value `first` of the plane (d values of its type) to be brought into L2.
template <int TYPE> inline void prefetch_row(const KVPlane& plane, int64_t first) {
    constexpr int element = TYPE == KV_F32 ? 4 : TYPE == KV_Q8_0 ? 1 : 2;
    const char* row = static_cast<const char*>(plane.data) + first * element;
    for (int64_t line = 0; line < int64_t(plane.d) * element; line += 64) __builtin_prefetch(row + line, 0, 2);
}

// About 8 independent accumulators keep the FMA units busy (each FMA waits ~4 cycles for the one before it in its
// own chain): G query heads times UNROLL cells (scores) or column blocks (values).
template <int G> constexpr int unroll_for() { return G >= 8 ? 1 : 8 / G; }

// Column blocks of kv::N per pass over V's rows: as many as fit in registers beside the G hoisted weights (fewer
// passes over the rows), at most 4.
template <int G> constexpr int blocks_for() { return G >= 8 ? 1 : std::min(4, (kv::REGISTERS - 1 - G) / G); }

// Whether the G query heads' values fit in registers beside the scores' accumulators: then they are loaded once per
// step instead of once per cell.
template <int G> constexpr bool hoisted() { return G * unroll_for<G>() + G + 1 <= kv::REGISTERS; }

// scores[g][c] = kv::sum(acc[c][g]) * scale for J cells of G query heads; 8 sums at a time where they fit.
template <int G, int J> inline void store_scores(const kv::V (&acc)[J][G], float scale, float* scores, int64_t stride) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if constexpr (J * G <= 8) {
        kv::V sums[8];
        for (int i = 0; i < 8; ++i) sums[i] = i < J * G ? acc[i / G][i % G] : kv::zero();
        alignas(32) float values[8];
        vstore(values, vmul(kv::sums8(sums), vset(scale)));
        for (int i = 0; i < J * G; ++i) scores[(i % G) * stride + i / G] = values[i];
        return;
    }
#endif
    for (int c = 0; c < J; ++c)
        for (int g = 0; g < G; ++g) scores[g * stride + c] = kv::sum(acc[c][g]) * scale;
}

// scores[g][j] = scale * q_g . K[rows[j]] for G query heads (q: [G][d]) and the n rows starting at values rows[j]
// of the plane; V's rows (the same places in v) fetched into L2 alongside K's, for values_of. Each score is one
// chain of FMAs over the head's values, kv::N at a time, then kv::sum: how the loops are unrolled changes which
// chains run side by side, never a chain.
template <int TYPE, int G>
inline void scores_of(const float* q, int d, float scale, const int64_t* rows, int64_t n, const KVPlane& k,
                      const KVPlane& v, float* scores, int64_t stride) {
    constexpr int J = unroll_for<G>();
    int64_t j = 0;
    for (; j + J <= n; j += J) {  // J cells at a time
        for (int c = 0; c < J && j + PREFETCH_CELLS + c < n; ++c) {
            prefetch_row<TYPE>(k, rows[j + PREFETCH_CELLS + c]);
            prefetch_row<TYPE>(v, rows[j + PREFETCH_CELLS + c]);
        }
        kv::V acc[J][G];
        for (int c = 0; c < J; ++c)
            for (int g = 0; g < G; ++g) acc[c][g] = kv::zero();
        for (int at = 0; at < d; at += kv::N) {
            kv::V query[G];
            if constexpr (hoisted<G>())
                for (int g = 0; g < G; ++g) query[g] = kv::load(q + g * d + at);
            for (int c = 0; c < J; ++c) {
                const kv::V row = row_values<TYPE>(k, rows[j + c], at);
                for (int g = 0; g < G; ++g)
                    acc[c][g] = kv::fma(hoisted<G>() ? query[g] : kv::load(q + g * d + at), row, acc[c][g]);
            }
        }
        store_scores<G, J>(acc, scale, scores + j, stride);
    }
    for (; j < n; ++j) {
        kv::V acc[G];
        for (int g = 0; g < G; ++g) acc[g] = kv::zero();
        for (int at = 0; at < d; at += kv::N) {
            const kv::V row = row_values<TYPE>(k, rows[j], at);
            for (int g = 0; g < G; ++g) acc[g] = kv::fma(kv::load(q + g * d + at), row, acc[g]);
        }
        for (int g = 0; g < G; ++g) scores[g * stride + j] = kv::sum(acc[g]) * scale;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
// A bfloat16 query against a bfloat16 cache (the defaults where the CPU has AVX512-BF16): the scores by vdpbf16ps,
// which adds pairs of bf16 products (exact in float32) into float32 lanes, 32 values an instruction with no
// conversion of K's rows (two instructions per 16 values above), and 16 scores' lane sums at once (lane_sums16).
// perf of a 64-sequence decode step's attention put scores_of at three times values_of, half of it the lane sums.
// Every score of such a call is taken here, a prompt's tokens' and a decode token's alike: one order of sums for
// all, as above.
#define KVLM_BF16_SCORES 1

// Lane i: the sum of v[i]'s lanes, for 16 vectors at once (45 instructions; 16 kv::sums take about 100). Each
// vector's own tree, whatever the others hold: within each 128-bit quarter (l0 + l2) + (l1 + l3), then the quarters
// (q0 + q1) + (q2 + q3).
inline __m512 lane_sums16(const __m512 (&v)[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; ++i)  // quarter of pairs[i]: v[2i](l0 + l2), v[2i+1](l0 + l2), v[2i](l1 + l3), v[2i+1](l1 + l3)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // quarter of quads[i]: the quarter's sums of v[4i] .. v[4i + 3]
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // quarters (0 + 1) and (2 + 3) of v[0..3], of v[4..7]; then of v[8..11], v[12..15]
    const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xdd));
}

// acc[g * J + c0 + c] += q_g . K[rows[c]] for G query heads and C cells, 32 values a step (a head's last 16 in a
// step of their own, the rest of its register zero): every accumulator the same steps in the same order, however
// many cells are taken together.
template <int G, int C, int J>
inline void bf16_dots(const uint16_t* q, int d, const uint16_t* k, const int64_t* rows, __m512 (&acc)[16], int c0) {
    const auto step = [&](int at, auto load) {  // load(p): 32 bf16 values from p, as a register
        __m512bh query[G];
        for (int g = 0; g < G; ++g) query[g] = load(q + int64_t(g) * d + at);
        for (int c = 0; c < C; ++c) {
            const __m512bh row = load(k + rows[c] + at);
            for (int g = 0; g < G; ++g) acc[g * J + c0 + c] = _mm512_dpbf16_ps(acc[g * J + c0 + c], query[g], row);
        }
    };
    int at = 0;
    for (; at + 32 <= d; at += 32)  // whole rows unmasked: masked loads made a step over rows from memory 5% slower
        step(at, [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); });
    if (at < d)  // a last 16 values, the rest of the registers zero
        step(at, [](const uint16_t* p) { return (__m512bh)_mm512_maskz_loadu_epi16(0xffff, p); });
}

// scores_of for a bfloat16 query q [G][d] and a bfloat16 K plane: J = 16 / G cells at a time, their G x J scores
// summed together, a last partial group cell by cell (the same steps, so the same bits).
template <int G>
inline void bf16_scores_of(const uint16_t* q, int d, float scale, const int64_t* rows, int64_t n, const KVPlane& k,
                           const KVPlane& v, float* scores, int64_t stride) {
    constexpr int J = 16 / G;
    const uint16_t* keys = static_cast<const uint16_t*>(k.data);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j = 0; j < n; j += J) {
        const int count = int(std::min<int64_t>(J, n - j));
        for (int c = 0; c < count && j + PREFETCH_CELLS + c < n; ++c) {
            prefetch_row<KV_BF16>(k, rows[j + PREFETCH_CELLS + c]);
            prefetch_row<KV_BF16>(v, rows[j + PREFETCH_CELLS + c]);
        }
        __m512 acc[16];
        for (__m512& a : acc) a = _mm512_setzero_ps();
        if (count == J)
            bf16_dots<G, J, J>(q, d, keys, rows + j, acc, 0);
        else
            for (int c = 0; c < count; ++c) bf16_dots<G, 1, J>(q, d, keys, rows + j + c, acc, c);
        const __m512 sums = _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(scale));
        for (int g = 0; g < G; ++g)  // head g's scores are lanes g J .. g J + count - 1
            _mm512_mask_storeu_ps(scores + g * stride + j, __mmask16((1u << count) - 1),
                                  _mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(g * J)), sums));
    }
}
#endif

// out[g] = sum over j of p[g][j] V[rows[j]] for G query heads (out: [G][d]), B column blocks of kv::N at a time:
// per output value one chain of FMAs over the rows in order.
template <int TYPE, int G>
inline void values_of(const float* p, int d, const int64_t* rows, int64_t n, const KVPlane& v, int64_t stride,
                      float* out) {
    constexpr int B = blocks_for<G>();
    int at = 0;
    for (; at + B * kv::N <= d; at += B * kv::N) {
        kv::V acc[B][G];
        for (int b = 0; b < B; ++b)
            for (int g = 0; g < G; ++g) acc[b][g] = kv::zero();
        for (int64_t j = 0; j < n; ++j) {
            constexpr bool hoist = B * G + G + 1 <= kv::REGISTERS;  // the weights in registers beside the sums
            kv::V weight[G];
            if constexpr (hoist)
                for (int g = 0; g < G; ++g) weight[g] = kv::set(p[g * stride + j]);
            for (int b = 0; b < B; ++b) {
                const kv::V row = row_values<TYPE>(v, rows[j], at + b * kv::N);
                for (int g = 0; g < G; ++g)
                    acc[b][g] = kv::fma(hoist ? weight[g] : kv::set(p[g * stride + j]), row, acc[b][g]);
            }
        }
        for (int b = 0; b < B; ++b)
            for (int g = 0; g < G; ++g) kv::store(out + g * d + at + b * kv::N, acc[b][g]);
    }
    for (; at < d; at += kv::N) {
        kv::V acc[G];
        for (int g = 0; g < G; ++g) acc[g] = kv::zero();
        for (int64_t j = 0; j < n; ++j) {
            const kv::V row = row_values<TYPE>(v, rows[j], at);
            for (int g = 0; g < G; ++g) acc[g] = kv::fma(kv::set(p[g * stride + j]), row, acc[g]);
        }
        for (int g = 0; g < G; ++g) kv::store(out + g * d + at, acc[g]);
    }
}

template <class F> inline void with_kv_type(int type, F&& f) {
    switch (type) {
        case KV_F32: f(std::integral_constant<int, KV_F32>{}); break;
        case KV_F16: f(std::integral_constant<int, KV_F16>{}); break;
        case KV_BF16: f(std::integral_constant<int, KV_BF16>{}); break;
        default: f(std::integral_constant<int, KV_Q8_0>{}); break;
    }
}

template <class F> inline void with_group(int g, F&& f) {
    switch (g) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

// One chunk of one token's cells for `group` query heads (q: [group][d] float32, or q16 its bf16 values where
// bf16_scores takes them): each head's maximum score, the sum of exp(score - maximum), and the unnormalized sum of
// V rows weighted by those exps (out: [group][d]).
inline void attend_chunk(const float* q, const uint16_t* q16, int group, int d, float scale, const int64_t* cells,
                         int64_t n, const KVPlane& k, const KVPlane& v, int head, float* maxima, float* sums,
                         float* out, std::vector<float>& scores) {
    scores.resize(size_t(group) * n);
    int64_t rows[CHUNK_CELLS];  // where each cell's row of this KV head starts (K and V planes share the layout)
    for (int64_t j = 0; j < n; ++j) rows[j] = row_start(k, cells[j], head);
    with_kv_type(k.type, [&](auto type) {
        constexpr int TYPE = decltype(type)::value;
        // The rows the loops reach before their own fetches run ahead of them: K's first, needed now, and V's, needed
        // after the scores (the V pass then finds every row in L2, fetched alongside K's).
        for (int64_t j = 0; j < std::min<int64_t>(n, PREFETCH_CELLS); ++j) {
            prefetch_row<TYPE>(k, rows[j]);
            prefetch_row<TYPE>(v, rows[j]);
        }
        for (int g0 = 0; g0 < group; g0 += MAX_GROUP)
            with_group(std::min(MAX_GROUP, group - g0), [&](auto width) {
                constexpr int G = decltype(width)::value;
#if defined(KVLM_BF16_SCORES)
                if constexpr (TYPE == KV_BF16)
                    if (q16) {
                        bf16_scores_of<G>(q16 + int64_t(g0) * d, d, scale, rows, n, k, v, scores.data() + g0 * n, n);
                        return;
                    }
#endif
                scores_of<TYPE, G>(q + int64_t(g0) * d, d, scale, rows, n, k, v, scores.data() + g0 * n, n);
            });
        for (int g = 0; g < group; ++g)
            std::tie(maxima[g], sums[g]) = exp_less_maximum(scores.data() + int64_t(g) * n, n);
        for (int g0 = 0; g0 < group; g0 += MAX_GROUP)
            with_group(std::min(MAX_GROUP, group - g0), [&](auto width) {
                constexpr int G = decltype(width)::value;
                values_of<TYPE, G>(scores.data() + g0 * n, d, rows, n, v, n, out + int64_t(g0) * d);
            });
    });
}

// Where a step's attention reads and writes: per token its query heads (float32 or bfloat16, q_stride values
// apart from one token to the next), its cells (cells[offsets[t]] onwards, lengths[t] of them: the tokens of one
// sequence's prompt point into one shared list) and its output row (out_stride apart).
struct AttentionWork {
    const void* q;
    bool bf16;
    int64_t q_stride;
    int64_t n_tokens;
    int n_head, n_kv, d;
    float scale;
    const int64_t* cells;
    const int64_t* offsets;
    const int64_t* lengths;
    KVPlane k, v;
    void* out;
    int64_t out_stride;
    const float* sinks;  // [n_head] logits, or null
};

// Whether a bfloat16 query's scores against this K plane are taken from its bf16 values (bf16_scores_of).
inline bool bf16_scores(const KVPlane& k) {
#if defined(KVLM_BF16_SCORES)
    return k.type == KV_BF16;
#else
    return (void)k, false;
#endif
}

inline int64_t chunks_of(int64_t length) { return std::max<int64_t>(1, (length + CHUNK_CELLS - 1) / CHUNK_CELLS); }

// The attention of a step, run by every thread of the calling team; `partials` is the caller's, shared (one
// team's). Ends with a barrier.
inline void attention_in_team(const AttentionWork& w, std::vector<float>& partials) {
    const int group = w.n_head / w.n_kv, d = w.d;
    int64_t max_chunks = 1;
    for (int64_t t = 0; t < w.n_tokens; ++t) max_chunks = std::max(max_chunks, chunks_of(w.lengths[t]));
    const int64_t per_chunk = int64_t(group) * (d + 2);  // maxima, sums, then outputs of the chunk's heads
    const int64_t per_head = max_chunks * per_chunk;
#pragma omp single
    partials.resize(size_t(w.n_tokens * w.n_kv * per_head));
    static thread_local std::vector<float> query, scores, weights;
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < w.n_tokens * w.n_kv * max_chunks; ++task) {
        const int64_t chunk = task % max_chunks, t = task / max_chunks / w.n_kv;
        const int head = int(task / max_chunks % w.n_kv);
        const int64_t first = chunk * CHUNK_CELLS, n = std::min(CHUNK_CELLS, w.lengths[t] - first);
        if (n <= 0) continue;
        query.resize(size_t(group) * d);
        const int64_t q_at = t * w.q_stride + int64_t(head) * group * d;
        const uint16_t* q16 = w.bf16 && bf16_scores(w.k) ? static_cast<const uint16_t*>(w.q) + q_at : nullptr;
        // the query as float32, unless the scores read its bf16 values as they are
        if (!q16 && w.bf16)
            for (int64_t i = 0; i < int64_t(group) * d; ++i) query[i] = bf16_to_float(static_cast<const uint16_t*>(w.q)[q_at + i]);
        else if (!q16)
            std::copy_n(static_cast<const float*>(w.q) + q_at, int64_t(group) * d, query.data());
        float* part = partials.data() + (t * w.n_kv + head) * per_head + chunk * per_chunk;
        attend_chunk(query.data(), q16, group, d, w.scale, w.cells + w.offsets[t] + first, n, w.k, w.v, head, part,
                     part + group, part + 2 * group, scores);
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < w.n_tokens * w.n_kv; ++task) {  // the chunks merged
        const int64_t t = task / w.n_kv;
        const int head = int(task % w.n_kv);
        const int64_t n_chunks = chunks_of(w.lengths[t]);
        const float* parts = partials.data() + task * per_head;
        weights.resize(size_t(n_chunks));
        query.resize(size_t(d));  // the merged row, before its store
        for (int g = 0; g < group; ++g) {
            const float sink = w.sinks ? w.sinks[head * group + g] : -INFINITY;
            float top = sink;
            for (int64_t c = 0; c < n_chunks; ++c) top = std::max(top, parts[c * per_chunk + g]);
            float total = w.sinks ? exp_nonpositive(sink - top) : 0.0f;
            for (int64_t c = 0; c < n_chunks; ++c) {
                weights[c] = exp_nonpositive(parts[c * per_chunk + g] - top);
                total += weights[c] * parts[c * per_chunk + group + g];
            }
            const float inverse = 1.0f / total;
            float* row = query.data();
            const float* first = parts + 2 * group + int64_t(g) * d;
            for (int i = 0; i < d; ++i) row[i] = weights[0] * first[i];
            for (int64_t c = 1; c < n_chunks; ++c) {
                const float* chunk = parts + c * per_chunk + 2 * group + int64_t(g) * d;
                for (int i = 0; i < d; ++i) row[i] += weights[c] * chunk[i];
            }
            const int64_t out_at = t * w.out_stride + (int64_t(head) * group + g) * d;
            if (w.bf16)
                for (int i = 0; i < d; ++i) static_cast<uint16_t*>(w.out)[out_at + i] = float_to_bf16(row[i] * inverse);
            else
                for (int i = 0; i < d; ++i) static_cast<float*>(w.out)[out_at + i] = row[i] * inverse;
        }
    }
}

}  // namespace kvlm
