// The formats' readers in 128/256-bit vector instructions (AVX2 and F16C, which every AVX-512 CPU also has): the
// same levels, scales and offsets as unpack_generic in formats.h, which tests hold them to bit for bit, but handed
// over in registers, so a product reads a block straight into its dot products.
//
// Reader<TYPE> reads a chunk starting at its first block (`n` blocks present, for 32-weight formats):
//   levels(first, s)  -> the 32 levels of the chunk's sub-block s (0..7)
//   groups(first, n, scale, offset) -> the 16 groups' scales and offsets, as groups 0-7 and 8-15
// and the 32-weight formats' readers one block's scale(block) and offset(block), and eight blocks' as vectors,
// blocks(first, n, scale, offset).
#pragma once

#include <immintrin.h>

#include "formats.h"
#include "low_bit_formats.h"
#include "tiles.h"

namespace kvlm {

inline __m128i low_nibbles(__m128i q) { return _mm_and_si128(q, _mm_set1_epi8(15)); }
inline __m128i high_nibbles(__m128i q) { return _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15)); }
inline __m256i low_nibbles(__m256i q) { return _mm256_and_si256(q, _mm256_set1_epi8(15)); }
inline __m256i high_nibbles(__m256i q) { return _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(15)); }

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline float f16_value(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// The 32 levels of a block whose 16 bytes hold weights 0-15 in their low nibbles and 16-31 in their high ones.
inline __m256i nibble_levels(const uint8_t* qs) {
    const __m128i q = load128(qs);
    return _mm256_set_m128i(high_nibbles(q), low_nibbles(q));
}

// 16 (byte) where bit i of the little-endian word at qh is set, for i = 0..31, else 0.
inline __m256i fifth_bits(const uint8_t* qh) {
    const __m256i spread = _mm256_shuffle_epi8(  // byte i takes byte i / 8 of the word
        _mm256_set1_epi32(int(load_u32(qh))),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));  // byte i tests bit i % 8
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Eight f16 at a stride of `stride` bytes (n of them; the rest read as 0), as floats.
inline __m256 f16_strided(const uint8_t* first, int stride, int n) {
    alignas(16) uint16_t halves[8] = {};
    for (int b = 0; b < n; ++b) halves[b] = load_u16(first + b * stride);
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(halves)));
}

// Per-block values (one per 32 weights) as per-group ones (each twice): groups 0-7, then 8-15.
inline void per_group(__m256 per_block, __m256 out[2]) {
    out[0] = _mm256_permutevar8x32_ps(per_block, _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0));
    out[1] = _mm256_permutevar8x32_ps(per_block, _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4));
}

template <int TYPE> struct Reader;

// The 32-weight formats: a chunk of 256 weights is 8 blocks, each its own group pair (scale, offset per 16).
template <class Blocks> struct BlockGroups {
    static void groups(const uint8_t* first, int n, __m256 scale[2], __m256 offset[2]) {
        __m256 per_block_scale, per_block_offset;
        Blocks::blocks(first, n, per_block_scale, per_block_offset);
        per_group(per_block_scale, scale);
        per_group(per_block_offset, offset);
    }
};

template <> struct Reader<Q4_0> : BlockGroups<Reader<Q4_0>> {
    static float scale(const uint8_t* block) { return f16_value(block); }
    static float offset(const uint8_t* block) { return -8.0f * f16_value(block); }
    static __m256i levels(const uint8_t* first, int s) { return nibble_levels(first + 18 * s + 2); }
    static void blocks(const uint8_t* first, int n, __m256& scale, __m256& offset) {
        scale = f16_strided(first, 18, n);
        offset = _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f));
    }
};

template <> struct Reader<Q4_1> : BlockGroups<Reader<Q4_1>> {
    static float scale(const uint8_t* block) { return f16_value(block); }
    static float offset(const uint8_t* block) { return f16_value(block + 2); }
    static __m256i levels(const uint8_t* first, int s) { return nibble_levels(first + 20 * s + 4); }
    static void blocks(const uint8_t* first, int n, __m256& scale, __m256& offset) {
        scale = f16_strided(first, 20, n);
        offset = f16_strided(first + 2, 20, n);
    }
};

template <> struct Reader<Q5_0> : BlockGroups<Reader<Q5_0>> {
    static float scale(const uint8_t* block) { return f16_value(block); }
    static float offset(const uint8_t* block) { return -16.0f * f16_value(block); }
    static __m256i levels(const uint8_t* first, int s) {
        const uint8_t* block = first + 22 * s;
        return _mm256_or_si256(nibble_levels(block + 6), fifth_bits(block + 2));
    }
    static void blocks(const uint8_t* first, int n, __m256& scale, __m256& offset) {
        scale = f16_strided(first, 22, n);
        offset = _mm256_mul_ps(scale, _mm256_set1_ps(-16.0f));
    }
};

template <> struct Reader<Q5_1> : BlockGroups<Reader<Q5_1>> {
    static float scale(const uint8_t* block) { return f16_value(block); }
    static float offset(const uint8_t* block) { return f16_value(block + 2); }
    static __m256i levels(const uint8_t* first, int s) {
        const uint8_t* block = first + 24 * s;
        return _mm256_or_si256(nibble_levels(block + 8), fifth_bits(block + 4));
    }
    static void blocks(const uint8_t* first, int n, __m256& scale, __m256& offset) {
        scale = f16_strided(first, 24, n);
        offset = f16_strided(first + 2, 24, n);
    }
};

template <> struct Reader<Q8_0> : BlockGroups<Reader<Q8_0>> {
    static float scale(const uint8_t* block) { return f16_value(block); }
    static float offset(const uint8_t* block) { return -128.0f * f16_value(block); }
    static __m256i levels(const uint8_t* first, int s) {
        return _mm256_xor_si256(load256(first + 34 * s + 2), _mm256_set1_epi8(char(0x80)));
    }
    static void blocks(const uint8_t* first, int n, __m256& scale, __m256& offset) {
        scale = f16_strided(first, 34, n);
        offset = _mm256_mul_ps(scale, _mm256_set1_ps(-128.0f));
    }
};

// MXFP4's scales for eight E8M0 exponents (one per 32-bit lane, 0..255): formats.h's e8m0_half_bits lane by lane,
// in integers, so every exponent is exact (e < 2 gives a subnormal).
inline __m256 e8m0_halves(__m256i e) {
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
}

// The codes' levels (formats.h, mxfp4_level) as a pshufb table, repeated in both 128-bit halves.
inline __m256i mxfp4_level_table() {
    alignas(16) uint8_t levels[16];
    for (int code = 0; code < 16; ++code) levels[code] = mxfp4_level(code);
    return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(levels)));
}

template <> struct Reader<MXFP4> : BlockGroups<Reader<MXFP4>> {
    static float scale(const uint8_t* block) { return e8m0_half(block[0]); }
    static float offset(const uint8_t* block) { return -12.0f * e8m0_half(block[0]); }
    static __m256i levels(const uint8_t* first, int s) {
        return _mm256_shuffle_epi8(mxfp4_level_table(), nibble_levels(first + 17 * s + 1));
    }
    static void blocks(const uint8_t* first, int n, __m256& scale, __m256& offset) {
        alignas(32) int32_t e[8] = {};
        for (int b = 0; b < n; ++b) e[b] = first[17 * b];
        // blocks past n get scale 0, as f16_strided gives them (an exponent of 0 would give 2^-128)
        const __m256i present = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        scale = _mm256_and_ps(e8m0_halves(_mm256_load_si256(reinterpret_cast<const __m256i*>(e))),
                              _mm256_castsi256_ps(present));
        offset = _mm256_mul_ps(scale, _mm256_set1_ps(-12.0f));
    }
};

// Q4_K and Q5_K: d * scale and -(dmin * min) per 32 weights.
inline void k_groups(const uint8_t* block, __m256 scale[2], __m256 offset[2]) {
    uint32_t words[4];
    k_scales_mins(block + 4, words);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words));
    const __m256 scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
    per_group(_mm256_mul_ps(_mm256_set1_ps(f16_value(block)), scales), scale);
    per_group(_mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16_value(block + 2)), mins), _mm256_set1_ps(-0.0f)), offset);
}

template <> struct Reader<Q4_K> {
    static __m256i levels(const uint8_t* block, int s) {
        const __m256i q = load256(block + 16 + 32 * (s / 2));
        return s % 2 ? high_nibbles(q) : low_nibbles(q);
    }
    static void groups(const uint8_t* block, int, __m256 scale[2], __m256 offset[2]) {
        k_groups(block, scale, offset);
    }
};

template <> struct Reader<Q5_K> {
    static __m256i levels(const uint8_t* block, int s) {
        const __m256i q = load256(block + 48 + 32 * (s / 2));
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(load256(block + 16), s), _mm256_set1_epi8(1));
        return _mm256_or_si256(s % 2 ? high_nibbles(q) : low_nibbles(q), _mm256_slli_epi16(bit, 4));
    }
    static void groups(const uint8_t* block, int, __m256 scale[2], __m256 offset[2]) {
        k_groups(block, scale, offset);
    }
};

template <> struct Reader<Q6_K> {
    // Sub-block s = 4 h + k: nibble k / 2 of the 32 bytes at 64 h + 32 (k % 2), bits 2k of the qh bytes at 32 h.
    static __m256i levels(const uint8_t* block, int s) {
        const int h = s / 4, k = s % 4;
        const __m256i q = load256(block + 64 * h + 32 * (k % 2));
        const __m256i pair = _mm256_and_si256(_mm256_srli_epi16(load256(block + 128 + 32 * h), 2 * k),
                                              _mm256_set1_epi8(3));
        return _mm256_or_si256(k / 2 ? high_nibbles(q) : low_nibbles(q), _mm256_slli_epi16(pair, 4));
    }
    static void groups(const uint8_t* block, int, __m256 scale[2], __m256 offset[2]) {
        const __m128i scales = load128(block + 192);
        const __m256 d = _mm256_set1_ps(f16_value(block + 208)), center = _mm256_set1_ps(-32.0f);
        for (int h = 0; h < 2; ++h) {
            scale[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8 * h))));
            offset[h] = _mm256_mul_ps(center, scale[h]);
        }
    }
};

// --- the low-bit formats with readers of their own (low_bit_formats.h): Q2_K, Q3_K, IQ4_NL, IQ4_XS, IQ3_S ---

// 32 bytes of 2-bit fields: field j (bits 2j) of each byte.
inline __m256i pair_field(const uint8_t* bytes, int j) {
    return _mm256_and_si256(_mm256_srl_epi16(load256(bytes), _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3));
}

// Sixteen per-16 scales given as int8, times d, with offsets -center * scale.
inline void centered_groups(float d, __m128i all, int center, __m256 scale[2], __m256 offset[2]) {
    for (int h = 0; h < 2; ++h) {
        scale[h] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(all, 8 * h))));
        offset[h] = _mm256_mul_ps(_mm256_set1_ps(-float(center)), scale[h]);
    }
}

template <> struct Reader<Q2_K> {
    static __m256i levels(const uint8_t* block, int s) { return pair_field(block + 16 + 32 * (s / 4), s % 4); }
    static void groups(const uint8_t* block, int, __m256 scale[2], __m256 offset[2]) {
        const __m128i packed = load128(block);
        const __m256 d = _mm256_set1_ps(f16_value(block + 80)), dmin = _mm256_set1_ps(f16_value(block + 82));
        for (int h = 0; h < 2; ++h) {
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8 * h));
            const __m256i sc = _mm256_and_si256(bytes, _mm256_set1_epi32(15)), m = _mm256_srli_epi32(bytes, 4);
            scale[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
            offset[h] = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)), _mm256_set1_ps(-0.0f));
        }
    }
};

// Per 32-bit lane j, the word's bytes shifted right by 2j bits, each masked to its low 2 bits: byte i of lane j is
// bits 2j, 2j + 1 of byte i.
inline __m128i pairs_by_lane(uint32_t word) {
    return _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(int(word)), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
}

template <> struct Reader<Q3_K> {
    static __m256i levels(const uint8_t* block, int s) {
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(load256(block), _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1));
        return _mm256_or_si256(pair_field(block + 32 + 32 * (s / 4), s % 4), _mm256_slli_epi16(high, 2));
    }
    // formats.h's q3k_scale for all 16 at once: low nibbles of bytes 0-7 then their high ones, high pairs from the
    // word of bytes 8-11 (pairs_by_lane: scale 4 j + i from byte i, bits 2j).
    static void groups(const uint8_t* block, int, __m256 scale[2], __m256 offset[2]) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 96));
        const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(bytes, _mm_set1_epi8(15)),
                                               _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15)));
        const __m128i ints = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(pairs_by_lane(load_u32(block + 104)), 4)),
                                          _mm_set1_epi8(32));
        centered_groups(f16_value(block + 108), ints, 4, scale, offset);
    }
};

// The 8 nibbles of 4 bytes, low nibble first, as int32 lanes: a 4-bit value per 32 weights (IQ4_XS, IQ3_S).
inline __m256i nibbles_by_block(const uint8_t* bytes) {
    const __m128i x = _mm_cvtsi32_si128(int(load_u32(bytes)));
    const __m128i both = _mm_unpacklo_epi8(_mm_and_si128(x, _mm_set1_epi8(15)),
                                           _mm_and_si128(_mm_srli_epi16(x, 4), _mm_set1_epi8(15)));
    return _mm256_cvtepu8_epi32(both);
}

// IQ4's codes' levels (value + 128) as a pshufb table, in both 128-bit halves.
inline __m256i iq4_level_table() {
    alignas(16) uint8_t levels[16];
    for (int code = 0; code < 16; ++code) levels[code] = uint8_t(IQ4_VALUES[code] + 128);
    return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(levels)));
}

template <> struct Reader<IQ4_NL> : BlockGroups<Reader<IQ4_NL>> {
    static __m256i levels(const uint8_t* first, int s) {
        return _mm256_shuffle_epi8(iq4_level_table(), nibble_levels(first + 18 * s + 2));
    }
    static void blocks(const uint8_t* first, int n, __m256& scale, __m256& offset) {
        scale = f16_strided(first, 18, n);
        offset = _mm256_mul_ps(scale, _mm256_set1_ps(-128.0f));
    }
};

template <> struct Reader<IQ4_XS> {
    static __m256i levels(const uint8_t* block, int s) {
        return _mm256_shuffle_epi8(iq4_level_table(), nibble_levels(block + 8 + 16 * s));
    }
    // formats.h's iq4xs_scale for all 8 at once.
    static void groups(const uint8_t* block, int, __m256 scale[2], __m256 offset[2]) {
        const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(load_u16(block + 2)),
                                                                 _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                              _mm256_set1_epi32(3));
        const __m256i ints = _mm256_sub_epi32(_mm256_or_si256(nibbles_by_block(block + 4), _mm256_slli_epi32(high, 4)),
                                              _mm256_set1_epi32(32));
        const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(f16_value(block)), _mm256_cvtepi32_ps(ints));
        per_group(scales, scale);
        per_group(_mm256_mul_ps(_mm256_set1_ps(-128.0f), scales), offset);
    }
};

// 0xff in byte i where bit i of `bits` is set.
inline __m256i bit_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

template <> struct Reader<IQ3_S> {
    static __m256i levels(const uint8_t* block, int s) {
        // grid indices 8s .. 8s + 7 (formats.h, iq3s_index) made in a vector, then their entries (4 values each)
        // loaded one by one (a gather is slower on the CPUs measured)
        const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * s)));
        const __m256i ninth = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(block[66 + s]),
                                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                               _mm256_set1_epi32(1));
        alignas(32) int32_t index[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(index), _mm256_or_si256(low, _mm256_slli_epi32(ninth, 8)));
        const auto entry = [&index](int i) { return int(load_u32(reinterpret_cast<const uint8_t*>(grids.iq3s[index[i]]))); };
        const __m256i values = _mm256_setr_epi32(entry(0), entry(1), entry(2), entry(3), entry(4), entry(5), entry(6),
                                                 entry(7));
        const __m256i minus = bit_bytes(load_u32(block + 74 + 4 * s));
        const __m256i signed_values = _mm256_sub_epi8(_mm256_xor_si256(values, minus), minus);
        return _mm256_add_epi8(signed_values, _mm256_set1_epi8(16));
    }
    static void groups(const uint8_t* block, int, __m256 scale[2], __m256 offset[2]) {
        const __m256i odd = _mm256_add_epi32(_mm256_slli_epi32(nibbles_by_block(block + 106), 1), _mm256_set1_epi32(1));
        const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(f16_value(block)), _mm256_cvtepi32_ps(odd));
        per_group(scales, scale);
        per_group(_mm256_mul_ps(_mm256_set1_ps(-16.0f), scales), offset);
    }
};

// Whether a format has a vector reader above (the others are read by formats.h's plain C++ readers).
constexpr bool has_reader(int32_t type) {
    return tiled_type(type) || type == Q2_K || type == Q3_K || type == IQ4_NL || type == IQ4_XS || type == IQ3_S;
}

// A chunk into memory (for dequantization): the same readers, stored.
template <int TYPE> inline void unpack(const uint8_t* first, int n, Chunk& c) {
    constexpr int per_block = Traits<TYPE>::weights;
    const int subs = per_block == 32 ? n : 8;
    for (int s = 0; s < subs; ++s)
        _mm256_store_si256(reinterpret_cast<__m256i*>(c.levels + 32 * s), Reader<TYPE>::levels(first, s));
    __m256 scale[2], offset[2];
    Reader<TYPE>::groups(first, n, scale, offset);
    for (int h = 0; h < 2; ++h) {
        _mm256_store_ps(c.scale + 8 * h, scale[h]);
        _mm256_store_ps(c.offset + 8 * h, offset[h]);
    }
}

}  // namespace kvlm
