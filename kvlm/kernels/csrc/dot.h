// A weight row times a tile of rows of 8-bit activations (activations.h), for the instruction set this file is
// built for. Two families, as in llama.cpp:
//
// - 32-weight formats (Q4_0 ... Q8_0), activations in blocks of 32: per block, the float scale times the integer
//   dot product, plus the block's offset times the activations' sum;
// - K-quants (Q4_K, Q5_K, Q6_K), activations in blocks of 256: a super-block's sub-block scales are integers, so
//   its dot products are scaled and summed in integers, and floats come in once per super-block.
//
// The integer parts are exact; the float sums run in an order of each instruction set's own, so the instruction
// sets agree within float rounding.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define KVLM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVLM_AVX2 1
#endif

#include "activations.h"
#include "formats.h"

#if defined(KVLM_AVX512) || defined(KVLM_AVX2)
#include "readers.h"
#endif

namespace kvlm {

template <int TYPE> constexpr bool is_k_quant() { return Traits<TYPE>::weights == 256; }

// Where a tile's activation rows are.
template <int TILE> struct Tile {
    const int8_t* q[TILE];
    const float* step[TILE];
    const float* step_sum[TILE];
    const int16_t* sum16[TILE];

    Tile(const QuantizedRows& act, int64_t r0) {
        for (int t = 0; t < TILE; ++t) {
            q[t] = act.row_values(r0 + t);
            step[t] = act.row_step(r0 + t);
            step_sum[t] = act.row_step_sum(r0 + t);
            sum16[t] = act.row_sum16(r0 + t);
        }
    }
};

#if defined(KVLM_AVX512) || defined(KVLM_AVX2)

inline float sum8(__m256 a) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

// Pairs of level x activation products, added into 16 int16 lanes (no saturation: levels here are at most 127).
inline __m256i pair_products(__m256i levels, const int8_t* q) {
    return _mm256_maddubs_epi16(levels, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}

// Sums of 4 consecutive level x activation products in 8 int32 lanes; `wide` levels (above 127) are split in
// nibbles, since maddubs saturates its int16 pairs.
template <bool WIDE> inline __m256i quad_products(__m256i levels, const int8_t* q) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i act = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    if (!WIDE) return _mm256_madd_epi16(_mm256_maddubs_epi16(levels, act), ones);
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(low_nibbles(levels), act), ones);
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(high_nibbles(levels), act), ones);
    return _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4));
}

// One 32-weight block of a row times each tile row, from memory (a row's blocks past its last whole chunk).
template <int TYPE, int TILE>
inline void legacy_block(const uint8_t* block, int64_t b, const Tile<TILE>& tile, __m256 acc[TILE]) {
    const float scale = Reader<TYPE>::scale(block), offset = Reader<TYPE>::offset(block);
    const __m256i levels = Reader<TYPE>::levels(block, 0);
    for (int t = 0; t < TILE; ++t) {
        const __m256 sums = _mm256_cvtepi32_ps(quad_products<TYPE == Q8_0>(levels, tile.q[t] + 32 * b));
        const float s = scale * tile.step[t][b];
        const float o = offset * tile.step_sum[t][b];
        acc[t] = _mm256_fmadd_ps(sums, _mm256_set1_ps(s), _mm256_add_ps(acc[t], _mm256_setr_ps(o, 0, 0, 0, 0, 0, 0, 0)));
    }
}

#endif

#if defined(KVLM_AVX512)

#if defined(__AVX512VNNI__)
inline const char* dot_isa() { return "avx512-vnni"; }
#else
inline const char* dot_isa() { return "avx512"; }
#endif

constexpr int PREFETCH_BLOCKS = 8;  // how far ahead of a row's super-block its weights are fetched

inline __m512i join(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }

// Sums of 4 consecutive level x activation products in each of 16 int32 lanes.
template <bool WIDE> inline __m512i quad_products512(__m512i levels, const int8_t* q) {
    const __m512i act = _mm512_loadu_si512(q);
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), levels, act);
#else
    const __m512i ones = _mm512_set1_epi16(1);
    if (!WIDE) return _mm512_madd_epi16(_mm512_maddubs_epi16(levels, act), ones);
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(levels, nibble), act), ones);
    const __m512i hi = _mm512_madd_epi16(
        _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(levels, 4), nibble), act), ones);
    return _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 4));
#endif
}

// acc += int16 pairs x int16 scales, summed in pairs into int32.
inline __m512i scaled_add(__m512i acc, __m512i pairs, __m512i scales) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, pairs, scales);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, scales));
#endif
}

// The 32-weight formats: whole chunks of eight blocks, two blocks per 512-bit step.
template <int TYPE, int TILE>
inline void legacy_row(const uint8_t* row, int64_t k, const Tile<TILE>& tile, float out[TILE]) {
    using B = Traits<TYPE>;
    constexpr bool wide = TYPE == Q8_0;
    __m512 acc[TILE];
    __m256 acc_tail[TILE];
    for (int t = 0; t < TILE; ++t) { acc[t] = _mm512_setzero_ps(); acc_tail[t] = _mm256_setzero_ps(); }
    // Lanes 0-7 of a step belong to its first block, 8-15 to its second.
    const __m512i lane_block = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const int64_t n_blocks = k / 32, whole = n_blocks / 8 * 8;
    for (int64_t b0 = 0; b0 < whole; b0 += 8) {
        const uint8_t* first = row + b0 * B::bytes;
        __m256 per_block_scale, per_block_offset;
        Reader<TYPE>::blocks(first, 8, per_block_scale, per_block_offset);
        __m512i levels[4];
        for (int p = 0; p < 4; ++p)
            levels[p] = join(Reader<TYPE>::levels(first, 2 * p), Reader<TYPE>::levels(first, 2 * p + 1));
        for (int t = 0; t < TILE; ++t) {
            const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(per_block_scale, _mm256_loadu_ps(tile.step[t] + b0)));
            __m512 products[4];
            for (int p = 0; p < 4; ++p) {
                const __m512 sums = _mm512_cvtepi32_ps(quad_products512<wide>(levels[p], tile.q[t] + 32 * b0 + 64 * p));
                const __m512 lane_scale = _mm512_permutexvar_ps(_mm512_add_epi32(lane_block, _mm512_set1_epi32(2 * p)), s);
                products[p] = _mm512_mul_ps(sums, lane_scale);
            }
            const __m256 offsets = _mm256_mul_ps(per_block_offset, _mm256_loadu_ps(tile.step_sum[t] + b0));
            acc[t] = _mm512_add_ps(acc[t], _mm512_add_ps(_mm512_add_ps(products[0], products[1]),
                                                         _mm512_add_ps(products[2], products[3])));
            acc_tail[t] = _mm256_add_ps(acc_tail[t], offsets);
        }
    }
    for (int64_t b = whole; b < n_blocks; ++b) legacy_block<TYPE, TILE>(row + b * B::bytes, b, tile, acc_tail);
    for (int t = 0; t < TILE; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + sum8(acc_tail[t]);
}

// The K-quants' sub-block scales and what their offsets need, per super-block.
template <int TYPE> struct KScales;

// Q4_K, Q5_K: 8 scales and 8 mins, 6 bits each; w = d * sc * q - dmin * m per 32 weights.
inline void k_scale_bytes(const uint8_t* block, __m512i& scales16, __m256i& mins_per_group) {
    uint32_t words[4];
    k_scales_mins(block + 4, words);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words));
    scales16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(bytes));  // int16 0-7: the scales
    // Each min for its two groups of 16: bytes 8..15, each twice.
    const __m128i twice = _mm_shuffle_epi8(bytes, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15));
    mins_per_group = _mm256_cvtepu8_epi16(twice);
}

template <int TYPE, int TILE>
inline void k_row(const uint8_t* row, int64_t k, const Tile<TILE>& tile, float out[TILE]) {
    using B = Traits<TYPE>;
    __m512 acc[TILE];
    __m256 acc_offset[TILE];
    for (int t = 0; t < TILE; ++t) { acc[t] = _mm512_setzero_ps(); acc_offset[t] = _mm256_setzero_ps(); }
    for (int64_t c = 0; c < k / 256; ++c) {
        const uint8_t* block = row + c * B::bytes;
        for (int line = 0; line < B::bytes; line += 64)  // the hardware prefetcher alone falls behind on long rows
            _mm_prefetch(reinterpret_cast<const char*>(block + PREFETCH_BLOCKS * B::bytes + line), _MM_HINT_T0);
        __m512i scales16;      // the sub-block scales as int16
        __m256i offset_per_group;  // int16 per group of 16: multiplies the group's activation sum
        float d, d_offset;     // the float factors of the integer sums and of the offsets
        __m512i lane_index[4]; // per 64 weights: each int16 lane's scale
        if constexpr (TYPE == Q6_K) {
            scales16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(load128(block + 192)));
            offset_per_group = _mm512_castsi512_si256(scales16);
            d = f16_value(block + 208);
            d_offset = -32.0f * d;
            for (int p = 0; p < 4; ++p)  // int16 lane l of 64 weights at 64 p: group 4p + l / 8
                lane_index[p] = _mm512_add_epi16(_mm512_srli_epi16(_mm512_set_epi16(
                    31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                    15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3), _mm512_set1_epi16(short(4 * p)));
        } else {
            k_scale_bytes(block, scales16, offset_per_group);
            d = f16_value(block);
            d_offset = -f16_value(block + 2);
            for (int p = 0; p < 4; ++p)  // int16 lane l of 64 weights at 64 p: sub-block 2p + l / 16
                lane_index[p] = _mm512_add_epi16(_mm512_srli_epi16(_mm512_set_epi16(
                    31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                    15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 4), _mm512_set1_epi16(short(2 * p)));
        }
        __m512i levels[4], lane_scales[4];
        for (int p = 0; p < 4; ++p) {
            levels[p] = join(Reader<TYPE>::levels(block, 2 * p), Reader<TYPE>::levels(block, 2 * p + 1));
            lane_scales[p] = _mm512_permutexvar_epi16(lane_index[p], scales16);
        }
        for (int t = 0; t < TILE; ++t) {
            const int8_t* q = tile.q[t] + 256 * c;
            __m512i sums = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p) {
                const __m512i pairs = _mm512_maddubs_epi16(levels[p], _mm512_loadu_si512(q + 64 * p));
                sums = scaled_add(sums, pairs, lane_scales[p]);
            }
            const float step = tile.step[t][c];
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(d * step), acc[t]);
            const __m256i group_sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile.sum16[t] + 16 * c));
            const __m256 offsets = _mm256_cvtepi32_ps(_mm256_madd_epi16(offset_per_group, group_sums));
            acc_offset[t] = _mm256_fmadd_ps(offsets, _mm256_set1_ps(d_offset * step), acc_offset[t]);
        }
    }
    for (int t = 0; t < TILE; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + sum8(acc_offset[t]);
}

#elif defined(KVLM_AVX2)

inline const char* dot_isa() { return "avx2"; }

template <int TYPE, int TILE>
inline void legacy_row(const uint8_t* row, int64_t k, const Tile<TILE>& tile, float out[TILE]) {
    __m256 acc[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 32; ++b) legacy_block<TYPE, TILE>(row + b * Traits<TYPE>::bytes, b, tile, acc);
    for (int t = 0; t < TILE; ++t) out[t] = sum8(acc[t]);
}

template <int TYPE, int TILE>
inline void k_row(const uint8_t* row, int64_t k, const Tile<TILE>& tile, float out[TILE]) {
    using B = Traits<TYPE>;
    __m256 acc[TILE], acc_offset[TILE];
    for (int t = 0; t < TILE; ++t) acc[t] = acc_offset[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k / 256; ++c) {
        const uint8_t* block = row + c * B::bytes;
        alignas(16) int16_t scales[16];  // per group of 16 (each 32-weight scale twice for Q4_K and Q5_K)
        __m256i offset_per_group;
        float d, d_offset;
        if constexpr (TYPE == Q6_K) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(scales), _mm256_cvtepi8_epi16(load128(block + 192)));
            offset_per_group = _mm256_load_si256(reinterpret_cast<const __m256i*>(scales));
            d = f16_value(block + 208);
            d_offset = -32.0f * d;
        } else {
            uint32_t words[4];
            k_scales_mins(block + 4, words);
            const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words);
            for (int g = 0; g < 16; ++g) scales[g] = bytes[g / 2];
            const __m128i twice = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words)),
                                                   _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15));
            offset_per_group = _mm256_cvtepu8_epi16(twice);
            d = f16_value(block);
            d_offset = -f16_value(block + 2);
        }
        for (int t = 0; t < TILE; ++t) {
            const int8_t* q = tile.q[t] + 256 * c;
            __m256i sums = _mm256_setzero_si256();
            for (int s = 0; s < 8; ++s) {  // int16 lanes 0-7 of 32 weights: group 2s; 8-15: group 2s + 1
                const __m256i lane_scale = _mm256_set_m128i(_mm_set1_epi16(scales[2 * s + 1]), _mm_set1_epi16(scales[2 * s]));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pair_products(Reader<TYPE>::levels(block, s), q + 32 * s),
                                                                lane_scale));
            }
            const float step = tile.step[t][c];
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d * step), acc[t]);
            const __m256i group_sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile.sum16[t] + 16 * c));
            const __m256 offsets = _mm256_cvtepi32_ps(_mm256_madd_epi16(offset_per_group, group_sums));
            acc_offset[t] = _mm256_fmadd_ps(offsets, _mm256_set1_ps(d_offset * step), acc_offset[t]);
        }
    }
    for (int t = 0; t < TILE; ++t) out[t] = sum8(_mm256_add_ps(acc[t], acc_offset[t]));
}

#else

inline const char* dot_isa() { return "generic"; }

// Every format from its chunks in memory: sum over groups of (scale * levels.q + offset * sum of q) * step.
template <int TYPE, int TILE>
inline void any_row(const uint8_t* row, int64_t k, const Tile<TILE>& tile, int block, float out[TILE]) {
    using B = Traits<TYPE>;
    for (int t = 0; t < TILE; ++t) out[t] = 0.0f;
    Chunk c;
    for (int64_t index = 0; index * CHUNK < k; ++index) {
        const int n = int(std::min<int64_t>(CHUNK / B::weights, (k - index * CHUNK) / B::weights));
        unpack_generic<TYPE>(row + index * (CHUNK / B::weights) * B::bytes, n, c);
        for (int t = 0; t < TILE; ++t)
            for (int g = 0; g < n * B::weights / GROUP; ++g) {
                const int64_t at = index * CHUNK + g * GROUP;
                int32_t sum = 0;
                for (int i = 0; i < GROUP; ++i) sum += int32_t(c.levels[GROUP * g + i]) * int32_t(tile.q[t][at + i]);
                out[t] += (c.scale[g] * float(sum) + c.offset[g] * float(tile.sum16[t][at / GROUP])) * tile.step[t][at / block];
            }
    }
}

template <int TYPE, int TILE>
inline void legacy_row(const uint8_t* row, int64_t k, const Tile<TILE>& tile, float out[TILE]) {
    any_row<TYPE, TILE>(row, k, tile, 32, out);
}

template <int TYPE, int TILE>
inline void k_row(const uint8_t* row, int64_t k, const Tile<TILE>& tile, float out[TILE]) {
    any_row<TYPE, TILE>(row, k, tile, 256, out);
}

#endif

template <int TYPE, int TILE>
inline void dot_row(const uint8_t* row, int64_t k, const QuantizedRows& act, int64_t r0, float out[TILE]) {
    const Tile<TILE> tile(act, r0);
    if constexpr (is_k_quant<TYPE>()) k_row<TYPE, TILE>(row, k, tile, out);
    else legacy_row<TYPE, TILE>(row, k, tile, out);
}

}  // namespace kvlm
