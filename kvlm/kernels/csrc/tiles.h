// The interleaved layout the products read: the rows of a quantized matrix in tiles of 8, each tile holding, block
// column after block column, the 8 rows' blocks rearranged so that one 32-bit lane of a vector register is one row.
// A product then computes 8 output values per pass in the lanes of one register: each row's levels meet the same
// broadcast activations, the 8 rows' scales load as one vector, and no row is summed across lanes at the end (the
// file's row-by-row layout needs a horizontal sum and a scalar scale conversion per row and block).
//
// The rearrangement is a permutation of the file's bits: a tile takes exactly the bytes its 8 rows take in the file,
// so the weights are rearranged in place at load (kvlm_interleave) and memory stays the file's size. Per block
// column of a tile (one block of each row):
//
//   Q4_0   d[8]                 nibbles(32)                      scales as f16, one per row
//   Q4_1   d[8] m[8]            nibbles(32)
//   Q5_0   d[8]      fifth(32)  nibbles(32)
//   Q5_1   d[8] m[8] fifth(32)  nibbles(32)
//   Q8_0   d[8]                 bytes(32)
//   Q4_K   d[8] dmin[8] A[8] B[8] C[8], then per 32-weight sub-block: nibbles(32)        A, B, C: the three words
//   Q5_K   d[8] dmin[8] A[8] B[8] C[8], then per 32-weight sub-block: fifth(32) nibbles(32)   of packed scales
//   Q6_K   d[8] scales[16][8], then per 16-weight sub-block: high2(16) nibbles(16)
//   MXFP4  e[8]                 nibbles(32)                      E8M0 exponents, one byte per row
//   Q2_K   d[8] dmin[8] scales[16][8], then per 16-weight sub-block: pairs(16)
//   Q3_K   d[8] A[8] B[8] C[8], then per 32 weights: third(32) pairs(16) pairs(16)     A, B, C: its 12 scale bytes
//   IQ4_XS d[8] high[8] low[8], then per 32-weight sub-block: nibbles(32)      the scales' high pairs, low nibbles
//   IQ3_S  d[8] scales[8] index[64][8] ninth[8][8] signs[32][8]                  bytes of the file's block, transposed
//
// where, for w[r][i] the levels of row r (formats.h: unsigned, 0..3, 7, 15, 31, 63; Q8_0 its signed bytes; MXFP4
// and IQ4_XS their 4-bit codes, since their levels do not fit a nibble: the products map codes as they read them):
//   nibbles(n): n/8 registers of 32 bytes; register p, byte 4r + i = (w[r][8p+i] & 15) | (w[r][8p+4+i] & 15) << 4
//   fifth(32):  one register; byte 4r + i, bit g = bit 4 of w[r][4g+i]                          (g = 0..7)
//   high2(16):  one register; byte 4r + i, bits 2g, 2g+1 = bits 4, 5 of w[r][4g+i]              (g = 0..3)
//   bytes(32):  8 registers; register g, byte 4r + i = w[r][4g+i]
//   pairs(16):  one register; byte 4r + i, bits 2q, 2q+1 = bits 0, 1 of w[r][4q+i]                (q = 0..3)
//   third(32):  one register; byte 4r + i, bit g = bit 2 of w[r][4g+i]                          (g = 0..7)
// so the levels of weights 4g..4g+3 of every row are one register (after a mask and a shift), to be multiplied by
// the activations 4g..4g+3 broadcast to every lane.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "formats.h"
#include "low_bit_formats.h"

namespace kvlm {

constexpr int TILE_ROWS = 8;

// The formats with a tile layout (below): the other formats' products read the file's layout.
constexpr bool tiled_type(int32_t type) {
    return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == Q4_K ||
           type == Q5_K || type == Q6_K || type == MXFP4 || type == Q2_K || type == Q3_K || type == IQ4_XS ||
           type == IQ3_S;
}

// A part of a block column: levels of weights [first, first + n) of each row in one of the forms above, or a
// side value (scales) copied as it is: `count` items of `size` bytes from the file block at `file`, item k of row
// r at tile offset `at + (8 k + r) size`.
enum SectionKind : int { NIBBLES, FIFTH, HIGH2, BYTES, PAIRS, THIRD, SIDE };

struct Section {
    SectionKind kind;
    int at;           // offset in the tile's block column
    int first, n;     // levels: the weights of each row's block
    int file, size;   // side values: offset in the file's block, and item size
};

template <int TYPE> struct TileLayout;

template <> struct TileLayout<Q4_0> {
    static constexpr Section sections[] = {{SIDE, 0, 0, 1, 0, 2}, {NIBBLES, 16, 0, 32, 0, 0}};
};
template <> struct TileLayout<Q4_1> {
    static constexpr Section sections[] = {{SIDE, 0, 0, 2, 0, 2}, {NIBBLES, 32, 0, 32, 0, 0}};
};
template <> struct TileLayout<Q5_0> {
    static constexpr Section sections[] = {{SIDE, 0, 0, 1, 0, 2}, {FIFTH, 16, 0, 32, 0, 0}, {NIBBLES, 48, 0, 32, 0, 0}};
};
template <> struct TileLayout<Q5_1> {
    static constexpr Section sections[] = {{SIDE, 0, 0, 2, 0, 2}, {FIFTH, 32, 0, 32, 0, 0}, {NIBBLES, 64, 0, 32, 0, 0}};
};
template <> struct TileLayout<Q8_0> {
    static constexpr Section sections[] = {{SIDE, 0, 0, 1, 0, 2}, {BYTES, 16, 0, 32, 0, 0}};
};
template <> struct TileLayout<MXFP4> {
    static constexpr Section sections[] = {{SIDE, 0, 0, 1, 0, 1}, {NIBBLES, 8, 0, 32, 0, 0}};
};

// Q4_K: d, dmin (two f16 from byte 0), the 12 bytes of scales as three words (from byte 4), 8 sub-blocks of nibbles.
#define KVLM_K_SIDES {SIDE, 0, 0, 2, 0, 2}, {SIDE, 32, 0, 3, 4, 4}
template <> struct TileLayout<Q4_K> {
    static constexpr int scales_bytes = 128;
    static constexpr Section sections[] = {
        KVLM_K_SIDES,
        {NIBBLES, 128, 0, 32, 0, 0}, {NIBBLES, 256, 32, 32, 0, 0}, {NIBBLES, 384, 64, 32, 0, 0},
        {NIBBLES, 512, 96, 32, 0, 0}, {NIBBLES, 640, 128, 32, 0, 0}, {NIBBLES, 768, 160, 32, 0, 0},
        {NIBBLES, 896, 192, 32, 0, 0}, {NIBBLES, 1024, 224, 32, 0, 0}};
};
template <> struct TileLayout<Q5_K> {
    static constexpr Section sections[] = {
        KVLM_K_SIDES,
        {FIFTH, 128, 0, 32, 0, 0}, {NIBBLES, 160, 0, 32, 0, 0}, {FIFTH, 288, 32, 32, 0, 0}, {NIBBLES, 320, 32, 32, 0, 0},
        {FIFTH, 448, 64, 32, 0, 0}, {NIBBLES, 480, 64, 32, 0, 0}, {FIFTH, 608, 96, 32, 0, 0}, {NIBBLES, 640, 96, 32, 0, 0},
        {FIFTH, 768, 128, 32, 0, 0}, {NIBBLES, 800, 128, 32, 0, 0}, {FIFTH, 928, 160, 32, 0, 0}, {NIBBLES, 960, 160, 32, 0, 0},
        {FIFTH, 1088, 192, 32, 0, 0}, {NIBBLES, 1120, 192, 32, 0, 0}, {FIFTH, 1248, 224, 32, 0, 0},
        {NIBBLES, 1280, 224, 32, 0, 0}};
};
#undef KVLM_K_SIDES

// Q6_K: d (f16 at byte 208), the 16 signed scales (bytes 192..207, one item each), 16 sub-blocks of 16 weights.
#define KVLM_Q6(j) {HIGH2, 144 + 96 * (j), 16 * (j), 16, 0, 0}, {NIBBLES, 176 + 96 * (j), 16 * (j), 16, 0, 0}
template <> struct TileLayout<Q6_K> {
    static constexpr Section sections[] = {
        {SIDE, 0, 0, 1, 208, 2}, {SIDE, 16, 0, 16, 192, 1},
        KVLM_Q6(0), KVLM_Q6(1), KVLM_Q6(2), KVLM_Q6(3), KVLM_Q6(4), KVLM_Q6(5), KVLM_Q6(6), KVLM_Q6(7),
        KVLM_Q6(8), KVLM_Q6(9), KVLM_Q6(10), KVLM_Q6(11), KVLM_Q6(12), KVLM_Q6(13), KVLM_Q6(14), KVLM_Q6(15)};
};
#undef KVLM_Q6

// Q2_K: d, dmin (two f16 from byte 80), the 16 scale bytes (one item each), 16 sub-blocks of 16 2-bit levels.
#define KVLM_Q2(j) {PAIRS, 160 + 32 * (j), 16 * (j), 16, 0, 0}
template <> struct TileLayout<Q2_K> {
    static constexpr Section sections[] = {
        {SIDE, 0, 0, 2, 80, 2}, {SIDE, 32, 0, 16, 0, 1},
        KVLM_Q2(0), KVLM_Q2(1), KVLM_Q2(2), KVLM_Q2(3), KVLM_Q2(4), KVLM_Q2(5), KVLM_Q2(6), KVLM_Q2(7),
        KVLM_Q2(8), KVLM_Q2(9), KVLM_Q2(10), KVLM_Q2(11), KVLM_Q2(12), KVLM_Q2(13), KVLM_Q2(14), KVLM_Q2(15)};
};
#undef KVLM_Q2

// Q3_K: d (f16 at byte 108), the 12 bytes of scales as three words (from byte 96), then per 32 weights their third
// bits and two sub-blocks of 16 2-bit levels.
#define KVLM_Q3(h) {THIRD, 112 + 96 * (h), 32 * (h), 32, 0, 0}, {PAIRS, 144 + 96 * (h), 32 * (h), 16, 0, 0}, \
                   {PAIRS, 176 + 96 * (h), 32 * (h) + 16, 16, 0, 0}
template <> struct TileLayout<Q3_K> {
    static constexpr Section sections[] = {
        {SIDE, 0, 0, 1, 108, 2}, {SIDE, 16, 0, 3, 96, 4},
        KVLM_Q3(0), KVLM_Q3(1), KVLM_Q3(2), KVLM_Q3(3), KVLM_Q3(4), KVLM_Q3(5), KVLM_Q3(6), KVLM_Q3(7)};
};
#undef KVLM_Q3

// IQ4_XS: d (f16), the word of the scales' high pairs (2 bytes), their low nibbles (4 bytes), 8 sub-blocks of
// 4-bit codes (as MXFP4's, codes: the products map them to values as they read them).
#define KVLM_IQ4(s) {NIBBLES, 64 + 128 * (s), 32 * (s), 32, 0, 0}
template <> struct TileLayout<IQ4_XS> {
    static constexpr Section sections[] = {
        {SIDE, 0, 0, 1, 0, 2}, {SIDE, 16, 0, 1, 2, 2}, {SIDE, 32, 0, 1, 4, 4},
        KVLM_IQ4(0), KVLM_IQ4(1), KVLM_IQ4(2), KVLM_IQ4(3), KVLM_IQ4(4), KVLM_IQ4(5), KVLM_IQ4(6), KVLM_IQ4(7)};
};
#undef KVLM_IQ4

// IQ3_S: side values only, its bytes transposed so that one load gives a byte of each of the 8 rows: d, the scale
// nibbles (a word per row), then item by item the 64 grid indices' low bytes, the 8 bytes of their ninth bits and
// the 32 sign bytes. Its levels come from grid lookups, which take an index a row anyway.
template <> struct TileLayout<IQ3_S> {
    static constexpr Section sections[] = {
        {SIDE, 0, 0, 1, 0, 2}, {SIDE, 16, 0, 1, 106, 4}, {SIDE, 48, 0, 64, 2, 1}, {SIDE, 560, 0, 8, 66, 1},
        {SIDE, 624, 0, 32, 74, 1}};
};

// --- a block's levels in the file's own bytes (the inverse of formats.h's readers) ---

template <int TYPE> void file_levels(const uint8_t* block, uint8_t* levels) {
    Chunk c;
    unpack_generic<TYPE>(block, 1, c);
    std::memcpy(levels, c.levels, Traits<TYPE>::weights);
    if (TYPE == Q8_0)
        for (int i = 0; i < 32; ++i) levels[i] ^= 0x80;  // the signed bytes as stored
}
// 16 bytes of nibbles as 32 levels: the low nibbles, then the high ones. (Written out for AVX2: gcc otherwise builds
// the vectors byte by byte through the stack, a stall per byte, which made 32-weight formats' rearrangement 10x
// slower than the K-quants'.)
inline void split_nibbles(const uint8_t* qs, uint8_t* codes) {
#if defined(__AVX2__)
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(15);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm_and_si128(q, mask));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16), _mm_and_si128(_mm_srli_epi16(q, 4), mask));
#else
    for (int i = 0; i < 16; ++i) { codes[i] = qs[i] & 15; codes[16 + i] = qs[i] >> 4; }
#endif
}
// MXFP4's tiles hold its codes (the layout above), so its "levels" here are the codes as stored.
template <> inline void file_levels<MXFP4>(const uint8_t* block, uint8_t* codes) { split_nibbles(block + 1, codes); }
template <> inline void file_levels<Q4_0>(const uint8_t* block, uint8_t* levels) { split_nibbles(block + 2, levels); }
template <> inline void file_levels<Q4_1>(const uint8_t* block, uint8_t* levels) { split_nibbles(block + 4, levels); }

// IQ4_XS's tiles hold its codes too.
template <> inline void file_levels<IQ4_XS>(const uint8_t* block, uint8_t* codes) {
    for (int s = 0; s < 8; ++s) split_nibbles(block + 8 + 16 * s, codes + 32 * s);
}

inline void set_nibble_pairs(uint8_t* qs, const uint8_t* low, const uint8_t* high, int n) {
    for (int i = 0; i < n; ++i) qs[i] = uint8_t((low[i] & 15) | (high[i] & 15) << 4);
}

inline void set_fifth_word(uint8_t* qh, const uint8_t* levels) {
    uint32_t bits = 0;
    for (int i = 0; i < 32; ++i) bits |= uint32_t((levels[i] >> 4) & 1) << i;
    std::memcpy(qh, &bits, 4);
}

// The level bits of a file block from its levels; the block's other bytes (scales) are left as they are.
template <int TYPE> void set_file_levels(uint8_t* block, const uint8_t* w);
template <> inline void set_file_levels<Q4_0>(uint8_t* block, const uint8_t* w) { set_nibble_pairs(block + 2, w, w + 16, 16); }
template <> inline void set_file_levels<Q4_1>(uint8_t* block, const uint8_t* w) { set_nibble_pairs(block + 4, w, w + 16, 16); }
template <> inline void set_file_levels<Q5_0>(uint8_t* block, const uint8_t* w) {
    set_fifth_word(block + 2, w);
    set_nibble_pairs(block + 6, w, w + 16, 16);
}
template <> inline void set_file_levels<Q5_1>(uint8_t* block, const uint8_t* w) {
    set_fifth_word(block + 4, w);
    set_nibble_pairs(block + 8, w, w + 16, 16);
}
template <> inline void set_file_levels<Q8_0>(uint8_t* block, const uint8_t* w) { std::memcpy(block + 2, w, 32); }
template <> inline void set_file_levels<MXFP4>(uint8_t* block, const uint8_t* w) { set_nibble_pairs(block + 1, w, w + 16, 16); }
template <> inline void set_file_levels<Q4_K>(uint8_t* block, const uint8_t* w) {
    for (int j = 0; j < 4; ++j) set_nibble_pairs(block + 16 + 32 * j, w + 64 * j, w + 64 * j + 32, 32);
}
template <> inline void set_file_levels<Q5_K>(uint8_t* block, const uint8_t* w) {
    uint8_t* qh = block + 16;
    std::memset(qh, 0, 32);
    for (int j = 0; j < 4; ++j) {
        set_nibble_pairs(block + 48 + 32 * j, w + 64 * j, w + 64 * j + 32, 32);
        for (int i = 0; i < 32; ++i)
            qh[i] |= uint8_t(((w[64 * j + i] >> 4) & 1) << (2 * j) | ((w[64 * j + 32 + i] >> 4) & 1) << (2 * j + 1));
    }
}
// Q2_K's and Q3_K's 2-bit fields: weight 128 h + 32 j + i in bits 2j of byte 32 h + i.
inline void set_pair_fields(uint8_t* qs, const uint8_t* w) {
    std::memset(qs, 0, 64);
    for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 32; ++i) qs[32 * h + i] |= uint8_t((w[128 * h + 32 * j + i] & 3) << (2 * j));
}
template <> inline void set_file_levels<Q2_K>(uint8_t* block, const uint8_t* w) { set_pair_fields(block + 16, w); }
template <> inline void set_file_levels<Q3_K>(uint8_t* block, const uint8_t* w) {
    set_pair_fields(block + 32, w);
    std::memset(block, 0, 32);
    for (int b = 0; b < 8; ++b)
        for (int i = 0; i < 32; ++i) block[i] |= uint8_t(((w[32 * b + i] >> 2) & 1) << b);
}
template <> inline void set_file_levels<IQ4_XS>(uint8_t* block, const uint8_t* codes) {
    for (int s = 0; s < 8; ++s) set_nibble_pairs(block + 8 + 16 * s, codes + 32 * s, codes + 32 * s + 16, 16);
}
template <> inline void set_file_levels<IQ3_S>(uint8_t*, const uint8_t*) {}  // all its bytes are side values
template <> inline void set_file_levels<Q6_K>(uint8_t* block, const uint8_t* w) {
    uint8_t* ql = block;
    uint8_t* qh = block + 128;
    std::memset(ql, 0, 192);
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int i = 0; i < 32; ++i) {
                const uint8_t level = w[128 * h + 32 * k + i];
                ql[64 * h + 32 * (k % 2) + i] |= uint8_t((level & 15) << (4 * (k / 2)));
                qh[32 * h + i] |= uint8_t(((level >> 4) & 3) << (2 * k));
            }
}

// --- one section of a block column, for the 8 rows' levels w[r] (each a block's worth) ---

#if defined(__AVX2__)
// A row's nibble bytes of n levels v (n = 16 or 32): dword p (p < n / 8) = the bytes (v[8p+i] & 15) | (v[8p+4+i] & 15)
// << 4 for i = 0..3, which the tile puts at byte 4r of register p.
template <int N> inline __m128i row_nibble_words(const uint8_t* v) {
    const __m256i levels = N == 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v))
                                   : _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
    const __m256i low = _mm256_and_si256(levels, _mm256_set1_epi8(15));
    // each 8 levels' second four moved onto their first four (a qword's high dword to its low one), a nibble up
    const __m256i bytes = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_srli_epi64(low, 32), 4));
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)));
}

// put_levels for a NIBBLES section: rows' dwords (row_nibble_words) transposed into registers of 8 rows.
template <int N> inline void put_nibbles(const uint8_t* const w[TILE_ROWS], int first, uint8_t* out) {
    __m128i rows[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r) rows[r] = row_nibble_words<N>(w[r] + first);
    // rows r and r + 4 side by side: a 4 x 4 dword transpose in each 128-bit half gives register p
    __m256i x[4];
    for (int r = 0; r < 4; ++r) x[r] = _mm256_set_m128i(rows[r + 4], rows[r]);
    const __m256i t0 = _mm256_unpacklo_epi32(x[0], x[1]), t1 = _mm256_unpacklo_epi32(x[2], x[3]);
    const __m256i t2 = _mm256_unpackhi_epi32(x[0], x[1]), t3 = _mm256_unpackhi_epi32(x[2], x[3]);
    const __m256i registers[4] = {_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1),
                                  _mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3)};
    for (int p = 0; p < N / 8; ++p) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * p), registers[p]);
}
#endif

// Everything but the levels is known when the section is: its kind, width and offsets are template arguments, so
// every loop below has fixed bounds and offsets (a switch per byte made the rearrangement at load 1.7x slower).
template <SectionKind KIND, int N, int AT, int FIRST>
inline void put_levels(const uint8_t* const w[TILE_ROWS], uint8_t* column) {
    uint8_t* out = column + AT;
#if defined(__AVX2__)
    if constexpr (KIND == NIBBLES) {  // the same bytes as below, a register at a time
        static_assert(N == 16 || N == 32, "nibble sections are 16 or 32 weights");
        put_nibbles<N>(w, FIRST, out);
        return;
    }
#endif
    for (int r = 0; r < TILE_ROWS; ++r) {
        const uint8_t* v = w[r] + FIRST;
        for (int i = 0; i < 4; ++i) {
            const int at = 4 * r + i;
            if constexpr (KIND == NIBBLES) {
                for (int p = 0; p < N / 8; ++p) out[32 * p + at] = uint8_t((v[8 * p + i] & 15) | (v[8 * p + 4 + i] & 15) << 4);
            } else if constexpr (KIND == BYTES) {
                for (int g = 0; g < 8; ++g) out[32 * g + at] = v[4 * g + i];
            } else {  // bit fields: (bits taken from each level, their shift, levels per byte)
                constexpr int shift = KIND == FIFTH || KIND == HIGH2 ? 4 : KIND == THIRD ? 2 : 0;
                constexpr int width = KIND == HIGH2 || KIND == PAIRS ? 2 : 1;
                constexpr int count = width == 2 ? 4 : 8;
                uint8_t bits = 0;
                for (int g = 0; g < count; ++g) bits |= uint8_t(((v[4 * g + i] >> shift) & ((1 << width) - 1)) << (width * g));
                out[at] = bits;
            }
        }
    }
}

// The inverse for one row r: its levels of the section, added into w (sections of one block never overlap).
inline void get_levels(const Section& s, const uint8_t* column, int r, uint8_t* w) {
    const uint8_t* in = column + s.at;
    uint8_t* v = w + s.first;
    for (int i = 0; i < 4; ++i) {
        const int at = 4 * r + i;
        switch (s.kind) {
            case NIBBLES:
                for (int p = 0; p < s.n / 8; ++p) {
                    v[8 * p + i] |= in[32 * p + at] & 15;
                    v[8 * p + 4 + i] |= in[32 * p + at] >> 4;
                }
                break;
            case FIFTH:
                for (int g = 0; g < 8; ++g) v[4 * g + i] |= uint8_t(((in[at] >> g) & 1) << 4);
                break;
            case HIGH2:
                for (int g = 0; g < 4; ++g) v[4 * g + i] |= uint8_t(((in[at] >> (2 * g)) & 3) << 4);
                break;
            case BYTES:
                for (int g = 0; g < 8; ++g) v[4 * g + i] = in[32 * g + at];
                break;
            case PAIRS:
                for (int q = 0; q < 4; ++q) v[4 * q + i] |= uint8_t((in[at] >> (2 * q)) & 3);
                break;
            case THIRD:
                for (int g = 0; g < 8; ++g) v[4 * g + i] |= uint8_t(((in[at] >> g) & 1) << 2);
                break;
            case SIDE:
                break;
        }
    }
}

// Whether a format's tiles hold levels (IQ3_S's hold side values only).
template <int TYPE> constexpr bool levels_in_tiles() {
    for (const Section& s : TileLayout<TYPE>::sections)
        if (s.kind != SIDE) return true;
    return false;
}

// Section I of a block column of a tile from the 8 rows' blocks (and their levels w).
template <int TYPE, size_t I>
inline void pack_section(const uint8_t* const blocks[TILE_ROWS], const uint8_t* const w[TILE_ROWS], uint8_t* column) {
    constexpr Section s = TileLayout<TYPE>::sections[I];
    if constexpr (s.kind != SIDE) {
        put_levels<s.kind, s.n, s.at, s.first>(w, column);
    } else {
        for (int k = 0; k < s.n; ++k)
            for (int r = 0; r < TILE_ROWS; ++r)
                std::memcpy(column + s.at + (8 * k + r) * s.size, blocks[r] + s.file + k * s.size, s.size);
    }
}

template <int TYPE, size_t... I>
inline void pack_sections(const uint8_t* const blocks[TILE_ROWS], const uint8_t* const w[TILE_ROWS], uint8_t* column,
                          std::index_sequence<I...>) {
    (pack_section<TYPE, I>(blocks, w, column), ...);
}

// One block column of a tile from the 8 rows' blocks in the file's layout.
template <int TYPE> void pack_column(const uint8_t* const blocks[TILE_ROWS], uint8_t* column) {
    uint8_t levels[TILE_ROWS][256];
    const uint8_t* w[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; ++r) {
        if constexpr (levels_in_tiles<TYPE>()) file_levels<TYPE>(blocks[r], levels[r]);
        w[r] = levels[r];
    }
    constexpr size_t n_sections = sizeof(TileLayout<TYPE>::sections) / sizeof(Section);
    pack_sections<TYPE>(blocks, w, column, std::make_index_sequence<n_sections>{});
}

// Row r's block of a tile's block column, in the file's layout.
template <int TYPE> void unpack_column(const uint8_t* column, int r, uint8_t* block) {
    uint8_t levels[256] = {};
    for (const Section& s : TileLayout<TYPE>::sections) {
        if (s.kind != SIDE) {
            get_levels(s, column, r, levels);
            continue;
        }
        for (int k = 0; k < s.n; ++k) std::memcpy(block + s.file + k * s.size, column + s.at + (8 * k + r) * s.size, s.size);
    }
    set_file_levels<TYPE>(block, levels);
}

// Rows 8t .. 8t+7 of a matrix (rows of n_blocks blocks) rearranged in place into one tile.
template <int TYPE> void interleave_tile(uint8_t* rows, int64_t n_blocks, uint8_t* scratch) {
    constexpr int B = Traits<TYPE>::bytes;
    std::memcpy(scratch, rows, size_t(TILE_ROWS * n_blocks * B));
    for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t* blocks[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; ++r) blocks[r] = scratch + (r * n_blocks + b) * B;
        pack_column<TYPE>(blocks, rows + b * TILE_ROWS * B);
    }
}

// Row `row` of an interleaved matrix, in the file's layout (for dequantization).
template <int TYPE> void deinterleave_row(const uint8_t* weights, int64_t n_blocks, int64_t row, uint8_t* out) {
    constexpr int B = Traits<TYPE>::bytes;
    const uint8_t* tile = weights + (row / TILE_ROWS) * TILE_ROWS * n_blocks * B;
    for (int64_t b = 0; b < n_blocks; ++b) unpack_column<TYPE>(tile + b * TILE_ROWS * B, int(row % TILE_ROWS), out + b * B);
}

}  // namespace kvlm
