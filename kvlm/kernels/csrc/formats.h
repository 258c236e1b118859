// GGUF's quantized block formats, and how to read a chunk of 256 weights out of each.
//
// Every format is read the same way: a chunk of up to 256 consecutive weights of one row becomes 256 unsigned
// 8-bit levels plus, for each group of 16 weights, a scale and an offset, so that
//     weight = scale[g] * level + offset[g]
// holds exactly (every format's levels are small integers and its scales and offsets products of an f16, or of
// MXFP4's power of two, and a small integer, which float32 holds exactly). The products read the chunks: the levels
// go into integer dot products with 8-bit activations, the scales and offsets into float arithmetic once per group.
//
// This file holds the plain C++ readers (what any -march builds) of the nine formats the interleaved tiles know;
// low_bit_formats.h those of the 1- to 4-bit formats; readers.h the vector ones.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvlm {

constexpr int CHUNK = 256;  // weights per chunk: one K-quant super-block, or eight 32-weight blocks
constexpr int GROUP = 16;   // weights sharing one scale and offset in a chunk
constexpr int GROUPS = CHUNK / GROUP;

// ggml's type ids (gguf's GGMLQuantizationType).
enum Type : int32_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
                      Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21,
                      IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40 };

struct alignas(64) Chunk {
    uint8_t levels[CHUNK];
    float scale[GROUPS];
    float offset[GROUPS];
};

// A block's size, and for formats of signed levels the center they are read around: level - center is gguf's
// signed value and -center * scale the group's offset. gguf multiplies the signed value, so dequantization does
// too (a zero then keeps the scale's sign, as in gguf).
template <int TYPE> struct Traits;
template <> struct Traits<Q4_0> { static constexpr int weights = 32, bytes = 18, center = 8; };
template <> struct Traits<Q4_1> { static constexpr int weights = 32, bytes = 20, center = 0; };
template <> struct Traits<Q5_0> { static constexpr int weights = 32, bytes = 22, center = 16; };
template <> struct Traits<Q5_1> { static constexpr int weights = 32, bytes = 24, center = 0; };
template <> struct Traits<Q8_0> { static constexpr int weights = 32, bytes = 34, center = 128; };
template <> struct Traits<Q4_K> { static constexpr int weights = 256, bytes = 144, center = 0; };
template <> struct Traits<Q5_K> { static constexpr int weights = 256, bytes = 176, center = 0; };
template <> struct Traits<Q6_K> { static constexpr int weights = 256, bytes = 210, center = 32; };
template <> struct Traits<MXFP4> { static constexpr int weights = 32, bytes = 17, center = 12; };

template <int TYPE> constexpr int64_t row_bytes(int64_t n_cols) {
    return n_cols / Traits<TYPE>::weights * Traits<TYPE>::bytes;
}

inline float fp16_to_float(uint16_t h) {
    // Exact: every f16 is a float. Written out so that any -march builds it (the vector readers use F16C).
    const uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int shift = 0;
        while (!(mantissa & 0x400)) { mantissa <<= 1; ++shift; }
        bits = sign | uint32_t(113 - shift) << 23 | ((mantissa & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    // Round to nearest even, NaN kept quiet: what torch's .to(torch.bfloat16) does.
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    bits += 0x7fff + ((bits >> 16) & 1);
    return uint16_t(bits >> 16);
}

inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

inline uint64_t load_u64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
}

inline float f16_at(const uint8_t* p) { return fp16_to_float(load_u16(p)); }

// MXFP4's scale from its E8M0 exponent byte e, as ggml's ggml_e8m0_to_fp32_half: 2^(e - 128), half the E8M0 value
// because the codes below are FP4 (E2M1) values doubled. The bits are built directly (e < 2 gives a subnormal),
// so every e is exact with no float arithmetic.
inline uint32_t e8m0_half_bits(uint8_t e) { return e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23; }

inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e8m0_half_bits(e);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// MXFP4's 16 codes: gguf's kvalues (E2M1 doubled: codes 8-15 are the negatives of 0-7), read as the unsigned
// levels kvalue + 12 (0..24) around Traits<MXFP4>::center.
constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr uint8_t mxfp4_level(int code) { return uint8_t(MXFP4_VALUES[code] + 12); }

// The eight 6-bit scales and mins of Q4_K and Q5_K, packed in 12 bytes: the low 6 bits of bytes 0-3 are scales
// 0-3 and of bytes 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from the nibbles of bytes 8-11 and their
// high 2 bits from the top of bytes 0-3 and 4-7. As four bytes each in a word: scales 0-3, 4-7, mins 0-3, 4-7.
inline void k_scales_mins(const uint8_t* packed, uint32_t words[4]) {
    const uint32_t a = load_u32(packed), b = load_u32(packed + 4), c = load_u32(packed + 8);
    words[0] = a & 0x3f3f3f3fu;
    words[1] = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
    words[2] = b & 0x3f3f3f3fu;
    words[3] = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
}

// --- plain C++ readers: a chunk is up to eight 32-weight blocks (`n` of them present) or one super-block ---

template <int TYPE> void unpack_generic(const uint8_t* block, int n, Chunk& c);

inline void set_block_group(Chunk& c, int b, float scale, float offset) {
    c.scale[2 * b] = c.scale[2 * b + 1] = scale;
    c.offset[2 * b] = c.offset[2 * b + 1] = offset;
}

// Q4_0: f16 d, 16 bytes of nibbles (low nibbles weights 0-15, high 16-31); w = d * (q - 8)
template <> inline void unpack_generic<Q4_0>(const uint8_t* block, int n, Chunk& c) {
    for (int b = 0; b < n; ++b, block += 18) {
        const float d = f16_at(block);
        for (int i = 0; i < 16; ++i) { c.levels[32 * b + i] = block[2 + i] & 15; c.levels[32 * b + 16 + i] = block[2 + i] >> 4; }
        set_block_group(c, b, d, -8.0f * d);
    }
}

// Q4_1: f16 d, f16 m, 16 bytes of nibbles; w = d * q + m
template <> inline void unpack_generic<Q4_1>(const uint8_t* block, int n, Chunk& c) {
    for (int b = 0; b < n; ++b, block += 20) {
        for (int i = 0; i < 16; ++i) { c.levels[32 * b + i] = block[4 + i] & 15; c.levels[32 * b + 16 + i] = block[4 + i] >> 4; }
        set_block_group(c, b, f16_at(block), f16_at(block + 2));
    }
}

// Q5_0 and Q5_1: as Q4_0 and Q4_1 with a fifth bit per weight in a 32-bit word (bit i for weight i) before the
// nibbles.
inline void fifth_bit_levels(const uint8_t* qh, const uint8_t* qs, uint8_t* out) {
    const uint32_t bits = load_u32(qh);
    for (int i = 0; i < 16; ++i) {
        out[i] = (qs[i] & 15) | (((bits >> i) & 1) << 4);
        out[i + 16] = (qs[i] >> 4) | (((bits >> (i + 16)) & 1) << 4);
    }
}

// Q5_0: f16 d, qh, nibbles; w = d * (q - 16)
template <> inline void unpack_generic<Q5_0>(const uint8_t* block, int n, Chunk& c) {
    for (int b = 0; b < n; ++b, block += 22) {
        const float d = f16_at(block);
        fifth_bit_levels(block + 2, block + 6, c.levels + 32 * b);
        set_block_group(c, b, d, -16.0f * d);
    }
}

// Q5_1: f16 d, f16 m, qh, nibbles; w = d * q + m
template <> inline void unpack_generic<Q5_1>(const uint8_t* block, int n, Chunk& c) {
    for (int b = 0; b < n; ++b, block += 24) {
        fifth_bit_levels(block + 4, block + 8, c.levels + 32 * b);
        set_block_group(c, b, f16_at(block), f16_at(block + 2));
    }
}

// Q8_0: f16 d, 32 signed bytes; w = d * q, read as level q + 128 with offset -128 d
template <> inline void unpack_generic<Q8_0>(const uint8_t* block, int n, Chunk& c) {
    for (int b = 0; b < n; ++b, block += 34) {
        const float d = f16_at(block);
        for (int i = 0; i < 32; ++i) c.levels[32 * b + i] = block[2 + i] ^ 0x80;
        set_block_group(c, b, d, -128.0f * d);
    }
}

// Q4_K and Q5_K: f16 d, f16 dmin, 12 bytes of scales and mins; w = d * sc * q - dmin * m per 32 weights
inline void k_groups(const uint8_t* block, Chunk& c) {
    const float d = f16_at(block), dmin = f16_at(block + 2);
    uint32_t words[4];
    k_scales_mins(block + 4, words);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(words);
    for (int j = 0; j < 8; ++j) set_block_group(c, j, d * float(bytes[j]), -(dmin * float(bytes[8 + j])));
}

// Q4_K: then 128 bytes of nibbles, 32 bytes per 64 weights: their low nibbles the first 32, high the next
template <> inline void unpack_generic<Q4_K>(const uint8_t* block, int, Chunk& c) {
    k_groups(block, c);
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 32; ++i) {
            c.levels[64 * j + i] = block[16 + 32 * j + i] & 15;
            c.levels[64 * j + 32 + i] = block[16 + 32 * j + i] >> 4;
        }
}

// Q5_K: as Q4_K with 32 bytes of fifth bits (bit k of byte i for weight 32 k + i) before the nibbles
template <> inline void unpack_generic<Q5_K>(const uint8_t* block, int, Chunk& c) {
    k_groups(block, c);
    const uint8_t* qh = block + 16;
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 32; ++i) {
            c.levels[64 * j + i] = (block[48 + 32 * j + i] & 15) | (((qh[i] >> (2 * j)) & 1) << 4);
            c.levels[64 * j + 32 + i] = (block[48 + 32 * j + i] >> 4) | (((qh[i] >> (2 * j + 1)) & 1) << 4);
        }
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed scales, f16 d; w = d * sc * (q - 32)
// per 16 weights. Weight 128 h + 32 k + i takes nibble k / 2 of ql[64 h + 32 (k % 2) + i] and bits 2k, 2k + 1 of
// qh[32 h + i].
template <> inline void unpack_generic<Q6_K>(const uint8_t* block, int, Chunk& c) {
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int i = 0; i < 32; ++i)
                c.levels[128 * h + 32 * k + i] = ((ql[64 * h + 32 * (k % 2) + i] >> (4 * (k / 2))) & 15) |
                                                 (((qh[32 * h + i] >> (2 * k)) & 3) << 4);
    const float d = f16_at(block + 208);
    for (int g = 0; g < GROUPS; ++g) {
        c.scale[g] = d * float(int8_t(block[192 + g]));
        c.offset[g] = -32.0f * c.scale[g];
    }
}

// MXFP4: an E8M0 exponent e, 16 bytes of 4-bit codes (low nibbles weights 0-15, high 16-31);
// w = e8m0_half(e) * kvalue[code], read as level kvalue + 12 with offset -12 d. Near the top of e's range the level
// form leaves float32 where gguf's d * kvalue does not: d * 24 is infinite for e >= 252 (24 * 2^124 > FLT_MAX), the
// offset -12 d for e >= 253. Dequantization computes d * (level - 12), gguf's own product, so it is exact for every
// e (infinite exactly where gguf's is); products over such blocks are not (no real weights have scales near 2^124).
template <> inline void unpack_generic<MXFP4>(const uint8_t* block, int n, Chunk& c) {
    for (int b = 0; b < n; ++b, block += 17) {
        const float d = e8m0_half(block[0]);
        for (int i = 0; i < 16; ++i) {
            c.levels[32 * b + i] = mxfp4_level(block[1 + i] & 15);
            c.levels[32 * b + 16 + i] = mxfp4_level(block[1 + i] >> 4);
        }
        set_block_group(c, b, d, -12.0f * d);
    }
}

}  // namespace kvlm
