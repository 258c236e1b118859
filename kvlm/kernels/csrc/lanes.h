// The rows one register of a tile kernel holds (dot.h): 8, one tile in a 256-bit register (Rows8), or, with
// AVX-512 (F, BW, DQ, VL), 16, two adjacent tiles in a 512-bit register (Rows16): tile t in the low half, tile t + 1
// in the high one. A kernel written over these reads the same for both; each 32-bit lane is one row, and every
// operation is per lane or per 128-bit lane (pshufb), so a row's bits are the same in either width. Two tiles per
// register halve the instructions per multiply-add (unpacking, broadcasts, dot products, scales), where the CPU
// runs 512-bit operations at the rate of 256-bit ones (Zen 5; Intel's server cores).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "readers.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define KVLM_WIDE_TILES 1
#endif

namespace kvlm {

// --- operations on both widths, by overloading ----------------------------------------------------------------------

inline __m256i v_and(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
inline __m256i v_or(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i v_xor(__m256i a, __m256i b) { return _mm256_xor_si256(a, b); }
inline __m256i v_add16(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }
inline __m256i v_add32(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
inline __m256i v_shuffle(__m256i table, __m256i index) { return _mm256_shuffle_epi8(table, index); }
inline __m256i v_maddubs(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }
inline __m256i v_madd(__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }
inline __m256i v_mullo32(__m256i a, __m256i b) { return _mm256_mullo_epi32(a, b); }
inline __m256i v_magnitude(__m256i w) { return _mm256_sign_epi8(w, w); }   // |w|; -128 stays 0x80 (128 unsigned)
inline __m256i v_signed(__m256i a, __m256i w) { return _mm256_sign_epi8(a, w); }  // a negated where w < 0
inline __m256 v_float(__m256i a) { return _mm256_cvtepi32_ps(a); }
inline __m256 v_mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 v_add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256 v_sub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
inline __m256 v_fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 v_fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
template <class I> inline I splat32(int32_t v);  // v in every 32-bit lane
template <> inline __m256i splat32<__m256i>(int32_t v) { return _mm256_set1_epi32(v); }
template <class I> inline I splat8(char v);  // v in every byte
template <> inline __m256i splat8<__m256i>(char v) { return _mm256_set1_epi8(v); }
template <int N> inline __m256i v_srli16(__m256i a) { return _mm256_srli_epi16(a, N); }
template <int N> inline __m256i v_slli16(__m256i a) { return _mm256_slli_epi16(a, N); }
template <int N> inline __m256i v_srli32(__m256i a) { return _mm256_srli_epi32(a, N); }
template <int N> inline __m256i v_slli32(__m256i a) { return _mm256_slli_epi32(a, N); }

#if defined(KVLM_WIDE_TILES)
inline __m512i v_and(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
inline __m512i v_or(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i v_xor(__m512i a, __m512i b) { return _mm512_xor_si512(a, b); }
inline __m512i v_add16(__m512i a, __m512i b) { return _mm512_add_epi16(a, b); }
inline __m512i v_add32(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
inline __m512i v_shuffle(__m512i table, __m512i index) { return _mm512_shuffle_epi8(table, index); }
inline __m512i v_maddubs(__m512i u, __m512i s) { return _mm512_maddubs_epi16(u, s); }
inline __m512i v_madd(__m512i a, __m512i b) { return _mm512_madd_epi16(a, b); }
inline __m512i v_mullo32(__m512i a, __m512i b) { return _mm512_mullo_epi32(a, b); }
inline __m512i v_magnitude(__m512i w) { return _mm512_abs_epi8(w); }  // as vpsignb: -128 stays 0x80
// a negated where w < 0 (vpsignb also zeroes a where w = 0; the product with |w| = 0 is 0 either way)
inline __m512i v_signed(__m512i a, __m512i w) {
    return _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);
}
inline __m512 v_float(__m512i a) { return _mm512_cvtepi32_ps(a); }
inline __m512 v_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 v_add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 v_sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
inline __m512 v_fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 v_fnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
template <> inline __m512i splat32<__m512i>(int32_t v) { return _mm512_set1_epi32(v); }
template <> inline __m512i splat8<__m512i>(char v) { return _mm512_set1_epi8(v); }
template <int N> inline __m512i v_srli16(__m512i a) { return _mm512_srli_epi16(a, N); }
template <int N> inline __m512i v_slli16(__m512i a) { return _mm512_slli_epi16(a, N); }
template <int N> inline __m512i v_srli32(__m512i a) { return _mm512_srli_epi32(a, N); }
template <int N> inline __m512i v_slli32(__m512i a) { return _mm512_slli_epi32(a, N); }
#endif

// float_to_bf16 (formats.h) of each lane, stored: the same integers (round to nearest even, NaN kept quiet as 0x7fc0).
inline void store_bf16(uint16_t* at, __m256 values) {
    const __m256i bits = _mm256_castps_si256(values);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i words = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(words, words), 0x08);  // words 0-7 in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm256_castsi256_si128(packed));
}

#if defined(KVLM_WIDE_TILES)
inline void store_bf16(uint16_t* at, __m512 values) {
    const __m512i bits = _mm512_castps_si512(values);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i words = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm512_cvtepi32_epi16(words));
}
#endif

// --- the two widths ------------------------------------------------------------------------------------------------

// One tile: its 8 rows in a 256-bit register.
struct Rows8 {
    using I = __m256i;
    using F = __m256;
    I load(const uint8_t* p) const { return load256(p); }
    // f(offset) computed for the tile (offset 0): what is made per tile from a few bytes (scales).
    template <class Fn> static auto per_tile(Fn&& f) { return f(int64_t(0)); }
    static F splat(float v) { return _mm256_set1_ps(v); }
    static I zero() { return _mm256_setzero_si256(); }
    static F zero_f() { return _mm256_setzero_ps(); }
    static I same_halves(__m256i a) { return a; }  // a register of 8 rows whose two 128-bit halves match
    static I lanes4(int32_t a, int32_t b, int32_t c, int32_t d) { return _mm256_setr_epi32(a, b, c, d, a, b, c, d); }
};

#if defined(KVLM_WIDE_TILES)
// Two adjacent tiles (`stride` bytes apart): 16 rows in a 512-bit register, tile t's in the low half.
struct Rows16 {
    using I = __m512i;
    using F = __m512;
    int64_t stride;

    I load(const uint8_t* p) const { return _mm512_inserti64x4(_mm512_castsi256_si512(load256(p)), load256(p + stride), 1); }
    template <class Fn> auto per_tile(Fn&& f) const { return join(f(int64_t(0)), f(stride)); }
    static F splat(float v) { return _mm512_set1_ps(v); }
    static I zero() { return _mm512_setzero_si512(); }
    static F zero_f() { return _mm512_setzero_ps(); }
    static I same_halves(__m256i a) { return _mm512_broadcast_i64x4(a); }
    static I lanes4(int32_t a, int32_t b, int32_t c, int32_t d) { return _mm512_broadcast_i32x4(_mm_setr_epi32(a, b, c, d)); }
    static I join(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }
    static F join(__m256 low, __m256 high) { return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1); }
};
#endif

}  // namespace kvlm
