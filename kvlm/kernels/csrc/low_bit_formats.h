// The 1- to 4-bit formats llama.cpp writes beside the first nine (formats.h): Q2_K, Q3_K, the ternary TQ1_0 and
// TQ2_0, the I-quants (IQ4_NL, IQ4_XS, and the grid ones IQ1_S ... IQ3_S) and NVFP4, read into the same chunks of 256
// levels with a scale and an offset per 16 weights (formats.h), so that one product and one dequantization serve
// them all. Each is gguf's definition (gguf/quants.py) in the chunk's terms; the tests hold the dequantization to
// gguf's bit for bit.
//
// Every one fits exactly: the grid formats' weights are a scale times a small signed integer (a grid value with its
// sign, IQ1's grid value times 8 plus or minus 1 with the scale divided by 8), read as level = value + center. Their
// products are exact in float32 (an f16 times a few-bit integer), so any order of the same factors gives gguf's bits.
#pragma once

#include <cstdint>

#include "formats.h"

namespace kvlm {

template <> struct Traits<Q2_K> { static constexpr int weights = 256, bytes = 84, center = 0; };
template <> struct Traits<Q3_K> { static constexpr int weights = 256, bytes = 110, center = 4; };
template <> struct Traits<TQ1_0> { static constexpr int weights = 256, bytes = 54, center = 1; };
template <> struct Traits<TQ2_0> { static constexpr int weights = 256, bytes = 66, center = 1; };
template <> struct Traits<IQ4_NL> { static constexpr int weights = 32, bytes = 18, center = 128; };
template <> struct Traits<IQ4_XS> { static constexpr int weights = 256, bytes = 136, center = 128; };
template <> struct Traits<IQ2_XXS> { static constexpr int weights = 256, bytes = 66, center = 64; };
template <> struct Traits<IQ2_XS> { static constexpr int weights = 256, bytes = 74, center = 64; };
template <> struct Traits<IQ2_S> { static constexpr int weights = 256, bytes = 82, center = 64; };
template <> struct Traits<IQ3_XXS> { static constexpr int weights = 256, bytes = 98, center = 64; };
template <> struct Traits<IQ3_S> { static constexpr int weights = 256, bytes = 110, center = 16; };
template <> struct Traits<IQ1_S> { static constexpr int weights = 256, bytes = 50, center = 16; };
template <> struct Traits<IQ1_M> { static constexpr int weights = 256, bytes = 56, center = 16; };
template <> struct Traits<NVFP4> { static constexpr int weights = 64, bytes = 36, center = 12; };

// The grids of the grid formats: each entry 8 (IQ1, IQ2) or 4 (IQ3) small values. They are gguf's tables, handed
// over once when the library is loaded (kvlm_set_grids; kvlm/kernels/native.py), not copied here.
struct Grids {
    int8_t iq2xxs[256][8];
    int8_t iq2xs[512][8];
    int8_t iq2s[1024][8];
    int8_t iq3xxs[256][4];
    int8_t iq3s[512][4];
    uint8_t iq1s[2048][8];  // value + 1: 0, 1, 2 (see iq1_levels)
};
inline Grids grids;

// IQ3_S's entries i and i + 256 side by side (filled with the grids): one 8-byte load per index byte, the ninth bit
// choosing the half, is cheaper than a gather of 9-bit indices.
struct Iq3sPairs {
    uint64_t of[256];
    void fill() {
        for (int i = 0; i < 256; ++i) {
            uint32_t low = 0, high = 0;
            std::memcpy(&low, grids.iq3s[i], 4);
            std::memcpy(&high, grids.iq3s[i + 256], 4);
            of[i] = uint64_t(low) | uint64_t(high) << 32;
        }
    }
};
inline Iq3sPairs iq3s_pairs;

// The sign patterns of IQ2 and IQ3_XXS: 7 stored bits, the eighth making the count of minus signs even.
inline uint8_t ksigns(uint32_t index) { return uint8_t(index | uint32_t(__builtin_popcount(index) & 1) << 7); }

// IQ4's 16 non-linear values, read as levels value + 128.
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// 0xff in byte i where bit i of the index is set, for 8 sign bits at once.
struct SignBytes {
    uint64_t of[256];
    constexpr SignBytes() : of() {
        for (int bits = 0; bits < 256; ++bits)
            for (int i = 0; i < 8; ++i)
                if ((bits >> i) & 1) of[bits] |= uint64_t(0xff) << (8 * i);
    }
};
inline constexpr SignBytes sign_bytes;

// N (8 or 4) grid values (0..127), each negated where its bit of `signs` is set, into levels around `center` (the
// values at most center): eight bytes at a time in a 64-bit word, center + v and center - v never carrying.
template <int N> inline void grid_levels(const int8_t* entry, uint32_t signs, int center, uint8_t* out) {
    uint64_t v = 0;
    std::memcpy(&v, entry, N);
    const uint64_t centers = 0x0101010101010101ull * uint64_t(center), minus = sign_bytes.of[signs & 0xff];
    const uint64_t levels = ((centers + v) & ~minus) | ((centers - v) & minus);
    std::memcpy(out, &levels, N);
}

inline void set_group(Chunk& c, int g, float scale, int center) {
    c.scale[g] = scale;
    c.offset[g] = -float(center) * scale;
}

// Q2_K: 16 bytes of scales (low nibble scale, high nibble min per 16 weights), 64 bytes of 2-bit levels, f16 d,
// f16 dmin; weight 128 h + 32 j + i is bits 2j of byte 32 h + i; w = d * sc * q - dmin * m.
template <> inline void unpack_generic<Q2_K>(const uint8_t* block, int, Chunk& c) {
    for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 32; ++i) c.levels[128 * h + 32 * j + i] = (block[16 + 32 * h + i] >> (2 * j)) & 3;
    const float d = f16_at(block + 80), dmin = f16_at(block + 82);
    for (int g = 0; g < GROUPS; ++g) {
        c.scale[g] = d * float(block[g] & 15);
        c.offset[g] = -(dmin * float(block[g] >> 4));
    }
}

// Q3_K's 16 6-bit scales from 12 bytes: low nibbles from bytes 0-7 (scale s: byte s % 8, nibble s / 8), high pairs
// from bytes 8-11 (scale s: byte 8 + s % 4, bits 2 (s / 4)); stored plus 32.
inline int q3k_scale(const uint8_t* packed, int s) {
    const int low = (packed[s % 8] >> (4 * (s / 8))) & 15, high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
    return (low | high << 4) - 32;
}

// Q3_K: 32 bytes of high bits (weight 32 b + i: bit b of byte i), 64 bytes of low pairs (as Q2_K's), the scales, f16
// d; w = d * sc * (q - 4) where q is the low pair plus 4 times the high bit.
template <> inline void unpack_generic<Q3_K>(const uint8_t* block, int, Chunk& c) {
    for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 32; ++i) {
                const int w = 128 * h + 32 * j + i;
                c.levels[w] = uint8_t(((block[32 + 32 * h + i] >> (2 * j)) & 3) | ((block[i] >> (w / 32)) & 1) << 2);
            }
    const float d = f16_at(block + 108);
    for (int g = 0; g < GROUPS; ++g) set_group(c, g, d * float(q3k_scale(block + 96, g)), 4);
}

// TQ1_0: base-3 digits, 5 per byte in 48 bytes and 4 per byte in the next 4, read by multiplying the byte by 3^j
// (mod 256) and taking the top of 3 times that; f16 d; w = d * (digit - 1).
inline uint8_t ternary_digit(uint8_t byte, int j) {
    constexpr uint8_t powers[5] = {1, 3, 9, 27, 81};
    return uint8_t((uint8_t(byte * powers[j]) * 3) >> 8);
}

template <> inline void unpack_generic<TQ1_0>(const uint8_t* block, int, Chunk& c) {
    for (int j = 0; j < 5; ++j) {
        for (int i = 0; i < 32; ++i) c.levels[32 * j + i] = ternary_digit(block[i], j);
        for (int i = 0; i < 16; ++i) c.levels[160 + 16 * j + i] = ternary_digit(block[32 + i], j);
    }
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i) c.levels[240 + 4 * j + i] = ternary_digit(block[48 + i], j);
    const float d = f16_at(block + 52);
    for (int g = 0; g < GROUPS; ++g) set_group(c, g, d, 1);
}

// TQ2_0: 64 bytes of 2-bit levels (as Q2_K's), f16 d; w = d * (q - 1).
template <> inline void unpack_generic<TQ2_0>(const uint8_t* block, int, Chunk& c) {
    for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 32; ++i) c.levels[128 * h + 32 * j + i] = (block[32 * h + i] >> (2 * j)) & 3;
    const float d = f16_at(block + 64);
    for (int g = 0; g < GROUPS; ++g) set_group(c, g, d, 1);
}

// 16 bytes of 4-bit codes (low nibbles weights 0-15, high 16-31) as IQ4 levels.
inline void iq4_levels(const uint8_t* qs, uint8_t* out) {
    for (int i = 0; i < 16; ++i) {
        out[i] = uint8_t(IQ4_VALUES[qs[i] & 15] + 128);
        out[16 + i] = uint8_t(IQ4_VALUES[qs[i] >> 4] + 128);
    }
}

// IQ4_NL: f16 d, 16 bytes of codes; w = d * value[code].
template <> inline void unpack_generic<IQ4_NL>(const uint8_t* block, int n, Chunk& c) {
    for (int b = 0; b < n; ++b, block += 18) {
        iq4_levels(block + 2, c.levels + 32 * b);
        const float d = f16_at(block);
        set_block_group(c, b, d, -128.0f * d);
    }
}

// IQ4_XS: f16 d, a 16-bit word of the scales' high pairs, 4 bytes of their low nibbles, 8 x 16 bytes of codes;
// w = d * (scale - 32) * value[code] per 32 weights.
inline int iq4xs_scale(const uint8_t* block, int s) {
    return (((block[4 + s / 2] >> (4 * (s % 2))) & 15) | ((load_u16(block + 2) >> (2 * s)) & 3) << 4) - 32;
}

template <> inline void unpack_generic<IQ4_XS>(const uint8_t* block, int, Chunk& c) {
    const float d = f16_at(block);
    for (int s = 0; s < 8; ++s) {
        iq4_levels(block + 8 + 16 * s, c.levels + 32 * s);
        const float scale = d * float(iq4xs_scale(block, s));
        set_block_group(c, s, scale, -128.0f * scale);
    }
}

// The IQ2/IQ3_XXS sub-block scale d * (0.5 + ls) * f, in gguf's order (exact anyway: an f16 times a 5-bit number).
inline float half_step_scale(float d, uint32_t ls, float f) { return d * (0.5f + float(ls)) * f; }

// IQ2_XXS: f16 d, then per 32 weights two words: four grid indices (bytes), and four 7-bit sign patterns with the
// scale in the top 4 bits; w = d * (0.5 + ls) / 4 * grid * sign.
template <> inline void unpack_generic<IQ2_XXS>(const uint8_t* block, int, Chunk& c) {
    const float d = f16_at(block);
    for (int s = 0; s < 8; ++s) {
        const uint8_t* sub = block + 2 + 8 * s;
        const uint32_t aux = load_u32(sub + 4);
        for (int l = 0; l < 4; ++l)
            grid_levels<8>(grids.iq2xxs[sub[l]], ksigns((aux >> (7 * l)) & 127), 64, c.levels + 32 * s + 8 * l);
        const float scale = half_step_scale(d, aux >> 28, 0.25f);
        set_group(c, 2 * s, scale, 64);
        set_group(c, 2 * s + 1, scale, 64);
    }
}

// IQ2_XS: f16 d, 32 16-bit words (9-bit grid index, 7-bit sign pattern) per 8 weights, 16 4-bit scales per 16.
template <> inline void unpack_generic<IQ2_XS>(const uint8_t* block, int, Chunk& c) {
    const float d = f16_at(block);
    for (int g = 0; g < 32; ++g) {
        const uint32_t q = load_u16(block + 2 + 2 * g);
        grid_levels<8>(grids.iq2xs[q & 511], ksigns(q >> 9), 64, c.levels + 8 * g);
    }
    for (int g = 0; g < GROUPS; ++g) set_group(c, g, half_step_scale(d, (block[66 + g / 2] >> (4 * (g % 2))) & 15, 0.25f), 64);
}

// IQ2_S: f16 d, 32 bytes of grid indices' low 8 bits, 32 bytes of signs (a byte per 8 weights), 8 bytes of the
// indices' top 2 bits, 16 4-bit scales per 16 weights.
template <> inline void unpack_generic<IQ2_S>(const uint8_t* block, int, Chunk& c) {
    const float d = f16_at(block);
    for (int g = 0; g < 32; ++g) {
        const int index = block[2 + g] | ((block[66 + g / 4] >> (2 * (g % 4))) & 3) << 8;
        grid_levels<8>(grids.iq2s[index], block[34 + g], 64, c.levels + 8 * g);
    }
    for (int g = 0; g < GROUPS; ++g) set_group(c, g, half_step_scale(d, (block[74 + g / 2] >> (4 * (g % 2))) & 15, 0.25f), 64);
}

// IQ3_XXS: f16 d, 64 bytes of grid indices (4 weights each), then per 32 weights a word of four 7-bit sign patterns
// and the scale in the top 4 bits; w = d * (0.5 + ls) / 2 * grid * sign.
template <> inline void unpack_generic<IQ3_XXS>(const uint8_t* block, int, Chunk& c) {
    const float d = f16_at(block);
    for (int s = 0; s < 8; ++s) {
        const uint32_t aux = load_u32(block + 66 + 4 * s);
        for (int l = 0; l < 4; ++l) {
            const uint32_t signs = ksigns((aux >> (7 * l)) & 127);
            uint8_t* out = c.levels + 32 * s + 8 * l;
            grid_levels<4>(grids.iq3xxs[block[2 + 8 * s + 2 * l]], signs, 64, out);
            grid_levels<4>(grids.iq3xxs[block[3 + 8 * s + 2 * l]], signs >> 4, 64, out + 4);
        }
        const float scale = half_step_scale(d, aux >> 28, 0.5f);
        set_group(c, 2 * s, scale, 64);
        set_group(c, 2 * s + 1, scale, 64);
    }
}

// IQ3_S: f16 d, 64 bytes of grid indices' low 8 bits (4 weights each), 8 bytes of their ninth bits, 32 bytes of
// signs (a byte per 8 weights), 8 4-bit scales per 32 weights; w = d * (1 + 2 ls) * grid * sign.
inline int iq3s_index(const uint8_t* block, int j) { return block[2 + j] | ((block[66 + j / 8] >> (j % 8)) & 1) << 8; }

template <> inline void unpack_generic<IQ3_S>(const uint8_t* block, int, Chunk& c) {
    const float d = f16_at(block);
    for (int j = 0; j < 64; ++j) grid_levels<4>(grids.iq3s[iq3s_index(block, j)], block[74 + j / 2] >> (4 * (j % 2)), 16, c.levels + 4 * j);
    for (int s = 0; s < 8; ++s) {
        const float scale = d * float(1 + 2 * ((block[106 + s / 2] >> (4 * (s % 2))) & 15));
        set_group(c, 2 * s, scale, 16);
        set_group(c, 2 * s + 1, scale, 16);
    }
}

// IQ1: grid values -1, 0, 1 plus a delta of +-1/8, read as 8 * value +- 1 with the scale divided by 8, around 16:
// 8 (value + 2) +- 1, eight at a time in a 64-bit word (the grid holds value + 1, kvlm_set_grids).
inline void iq1_levels(const uint8_t* entry_plus_one, bool minus, uint8_t* out) {
    constexpr uint64_t ones = 0x0101010101010101ull;
    uint64_t v;
    std::memcpy(&v, entry_plus_one, 8);
    const uint64_t levels = ((v + ones) << 3) + (minus ? -ones : ones);  // bytes 8..24 +- 1: no carry between them
    std::memcpy(out, &levels, 8);
}

// IQ1_S: f16 d, 32 bytes of grid indices' low 8 bits, then per 32 weights a 16-bit word: the indices' top 3 bits
// (four of them), a 3-bit scale and the delta's sign; w = d * (2 ls + 1) * (grid + delta).
template <> inline void unpack_generic<IQ1_S>(const uint8_t* block, int, Chunk& c) {
    const float d = f16_at(block);
    for (int s = 0; s < 8; ++s) {
        const uint32_t qh = load_u16(block + 34 + 2 * s);
        for (int l = 0; l < 4; ++l)
            iq1_levels(grids.iq1s[block[2 + 4 * s + l] | ((qh >> (3 * l)) & 7) << 8], qh & 0x8000, c.levels + 32 * s + 8 * l);
        const float scale = d * float(2 * ((qh >> 12) & 7) + 1) * 0.125f;
        set_group(c, 2 * s, scale, 16);
        set_group(c, 2 * s + 1, scale, 16);
    }
}

// IQ1_M: 32 bytes of grid indices' low 8 bits, 16 bytes of nibbles (an index's top 3 bits and its delta's sign per 8
// weights), 4 16-bit words holding 16 3-bit scales (per 16 weights) and, in their top nibbles, the f16 d.
template <> inline void unpack_generic<IQ1_M>(const uint8_t* block, int, Chunk& c) {
    uint16_t words[4], d_bits = 0;
    for (int u = 0; u < 4; ++u) {
        words[u] = load_u16(block + 48 + 2 * u);
        d_bits |= uint16_t((words[u] >> 12) << (4 * u));
    }
    const float d = fp16_to_float(d_bits);
    for (int g = 0; g < 32; ++g) {
        const int nibble = (block[32 + g / 2] >> (4 * (g % 2))) & 15;
        iq1_levels(grids.iq1s[block[g] | (nibble & 7) << 8], nibble & 8, c.levels + 8 * g);
    }
    for (int g = 0; g < GROUPS; ++g) set_group(c, g, d * float(2 * ((words[g / 4] >> (3 * (g % 4))) & 7) + 1) * 0.125f, 16);
}

// NVFP4's scale from its unsigned E4M3 byte, halved (its codes are MXFP4's doubled FP4 values); 0 and 0x7F read 0.
// Exact: mantissa * 2^-10 when the exponent is 0, else (1 + mantissa / 8) * 2^(exponent - 8), its bits built directly.
inline float ue4m3_half(uint8_t x) {
    if (x == 0 || x == 0x7f) return 0.0f;
    const uint32_t exponent = (x >> 3) & 15, mantissa = x & 7;
    if (exponent == 0) return float(mantissa) * (1.0f / 1024.0f);
    const uint32_t bits = (exponent + 119) << 23 | mantissa << 20;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// NVFP4: 4 E4M3 scales (one per 16 weights), then per 16 weights 8 bytes of codes (low nibbles weights 0-7, high
// 8-15); w = scale * kvalue[code], as MXFP4's levels around 12.
template <> inline void unpack_generic<NVFP4>(const uint8_t* block, int n, Chunk& c) {
    for (int b = 0; b < n; ++b, block += 36)
        for (int u = 0; u < 4; ++u) {
            uint8_t* out = c.levels + 64 * b + 16 * u;
            for (int i = 0; i < 8; ++i) {
                out[i] = mxfp4_level(block[4 + 8 * u + i] & 15);
                out[8 + i] = mxfp4_level(block[4 + 8 * u + i] >> 4);
            }
            set_group(c, 4 * b + u, ue4m3_half(block[u]), 12);
        }
}

}  // namespace kvlm
