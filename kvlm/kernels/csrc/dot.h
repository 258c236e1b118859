// Weights times rows of 8-bit activations (activations.h). Two ways, as in llama.cpp:
//
// - 32-weight formats (Q4_0 ... Q8_0, MXFP4, IQ4_NL; and NVFP4's 64), activations in blocks of 32: per block, the
//   float scale times the integer dot product, plus the block's offset times the activations' sum;
// - formats of 256-weight super-blocks (the K-quants, the I-quants but IQ4_NL, TQ), activations in blocks of 256:
//   the K-quant tiles scale a super-block's dot products by its integer sub-block scales and sum them in integers,
//   floats coming in once per super-block; the row kernel scales them in floats per 16 weights.
//
// With AVX2 (and FMA, F16C) the weights are read in the interleaved tiles of tiles.h: 8 rows per pass, one row per
// 32-bit lane, up to MAX_ACT_ROWS activation rows sharing each unpacked register of levels; with VNNI (AVX-512
// VNNI under AVX-512VL, or AVX-VNNI) the 8-bit products are summed by vpdpbusd (Dots, below). Without AVX2, for a
// matrix whose rows do not fill whole tiles, and for the formats without tiles (low_bit_formats.h), rows are read
// one at a time from the file's layout into their chunks, then multiplied by chunks_times (AVX2 or plain C++).
//
// The integer parts are exact; the float sums run in an order of each path's own, so the paths agree within float
// rounding. A row's arithmetic never depends on how many activation rows share the pass.
#pragma once

#include <cstdint>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVLM_TILES 1
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define KVLM_VNNI 1
#endif
#endif

#include "activations.h"
#include "formats.h"
#include "low_bit_formats.h"
#include "tiles.h"

#if defined(KVLM_TILES)
#include "lanes.h"
#include "readers.h"
#endif

namespace kvlm {

template <int TYPE> constexpr bool is_k_quant() { return Traits<TYPE>::weights == 256; }

constexpr int MAX_ACT_ROWS = 4;  // activation rows sharing one read of a row of the file's layout (chunks_times)

// Activation rows a pass over a tile multiplies (tile_times' R), per format. More rows share each unpacked register
// of levels and each broadcast activation's load, but with AVX2's 16 vector registers gcc spills some formats'
// partial sums of 4 rows to the stack, and those products slow down by up to a third (`python -m bench.tile_passes`
// on a Zen 3, at 128 and 256 rows: Q4_K 86 G multiply-adds/s at 2 rows a pass, 60 at 4; Q5_K and the 32-weight
// nibble formats fastest at 3; Q6_K, Q3_K, Q8_0, MXFP4 and IQ3_S as fast or faster at 4). AVX-512VL's 32 registers
// hold more: up to 8 rows a pass there (MAX_PASS_ROWS). On a Zen 5, with the K-quant tiles' sub-blocks as a loop,
// 8 rows were fastest for Q4_K (597 G against 560 at 5, 512 rows),
// Q5_K, the 32-weight formats (Q8_0 496 against 469 at 6) and IQ4_XS; Q6_K at 5 (464 against 415 at 8), Q2_K, Q3_K
// within 3% from 4 to 7, MXFP4 at 7. A test sets other counts (kvlm_set_tile_pass_rows): the bits of a row never
// depend on them.
#if defined(__AVX512VL__)
constexpr int MAX_PASS_ROWS = 8;
#else
constexpr int MAX_PASS_ROWS = 4;
#endif
inline int tile_pass_rows_set[64] = {};  // by type; 0: default_pass_rows

constexpr int default_pass_rows([[maybe_unused]] int32_t type) {
#if defined(__AVX512VL__)
    if (type == Q2_K || type == Q3_K || type == Q6_K) return 5;
    if (type == MXFP4) return 7;
#else
    if (type == Q4_K || type == Q2_K || type == IQ4_XS) return 2;
    if (type == Q5_K || type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1) return 3;
#endif
    return MAX_PASS_ROWS;
}

inline int tile_pass_rows(int32_t type) {
    const int set = type >= 0 && type < 64 ? tile_pass_rows_set[type] : 0;
    return set ? set : default_pass_rows(type);
}

// Where R consecutive activation rows are.
template <int R> struct ActRows {
    const int8_t* q[R];
    const float* step[R];
    const float* step_sum[R];
    const int16_t* sum16[R];
    const int16_t* sum32[R];

    ActRows(const QuantizedRows& act, int64_t r0) {
        for (int t = 0; t < R; ++t) {
            q[t] = act.row_values(r0 + t);
            step[t] = act.row_step(r0 + t);
            step_sum[t] = act.row_step_sum(r0 + t);
            sum16[t] = act.row_sum16(r0 + t);
            sum32[t] = act.row_sum32(r0 + t);
        }
    }
};

// One row of the file's layout, read into its chunks (formats.h), times R activation rows:
//     sum over groups of (scale * levels.q + offset * sum of q) * step,
// In plain C++ the formats of signed levels (center > 0) as scale * (level - center).q, which leaves out their
// offsets. With AVX2 (and FMA): per 32 levels of a chunk, the 8-bit products summed in int32 per 4 (two groups'
// halves side by side in the register's two 128-bit lanes), then each times its group's scale and step; levels up to
// 127 as they are (maddubs' unsigned side) and the offsets apart, wider ones (Q8_0's, IQ4's) as signed levels, |w|
// times the activations with w's sign.
template <int TYPE, int R>
inline void chunks_times(const Chunk* chunks, int64_t k, const ActRows<R>& act, float out[R]) {
    constexpr int block = is_k_quant<TYPE>() ? 256 : 32, center = Traits<TYPE>::center;
#if defined(KVLM_TILES)
    constexpr bool signed_levels = TYPE == Q8_0 || TYPE == IQ4_NL || TYPE == IQ4_XS;  // levels past 127
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i lanes[4];  // groups 2m (low lane) and 2m + 1 (high lane) of eight
    for (int m = 0; m < 4; ++m) lanes[m] = _mm256_setr_epi32(2 * m, 2 * m, 2 * m, 2 * m, 2 * m + 1, 2 * m + 1, 2 * m + 1, 2 * m + 1);
    __m256 acc[R];
    for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t index = 0; index * CHUNK < k; ++index) {
        const Chunk& c = chunks[index];
        const int subs = int(std::min<int64_t>(CHUNK, k - index * CHUNK) / 32);
        __m256 scaled[R][2];  // each group's scale times its activations' step
        for (int t = 0; t < R; ++t)
            for (int h = 0; h < 2; ++h) {
                __m256 step;
                if constexpr (block == 256) {
                    step = _mm256_set1_ps(act.step[t][index]);
                } else {  // a step per 32 weights: blocks 8 index + 4 h .. + 3, each twice
                    const __m128 four = _mm_loadu_ps(act.step[t] + 8 * index + 4 * h);
                    step = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(four), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
                }
                scaled[t][h] = _mm256_mul_ps(_mm256_load_ps(c.scale + 8 * h), step);
                if constexpr (!signed_levels) {  // offset * step * sum of q, per group
                    const __m256 sums = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(act.sum16[t] + 16 * index + 8 * h))));
                    acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_load_ps(c.offset + 8 * h), step), sums, acc[t]);
                }
            }
        for (int s = 0; s < subs; ++s) {
            __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(c.levels + 32 * s)), magnitude = w;
            if constexpr (signed_levels) {
                w = _mm256_sub_epi8(w, _mm256_set1_epi8(char(center)));
                magnitude = _mm256_sign_epi8(w, w);
            }
            for (int t = 0; t < R; ++t) {
                __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act.q[t] + index * CHUNK + 32 * s));
                if constexpr (signed_levels) a = _mm256_sign_epi8(a, w);
                const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), ones);
                const __m256 scale = _mm256_permutevar8x32_ps(scaled[t][s / 4], lanes[s % 4]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[t]);
            }
        }
    }
    for (int t = 0; t < R; ++t) {
        const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
        const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        out[t] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
    }
#else
    for (int t = 0; t < R; ++t) out[t] = 0.0f;
    for (int64_t index = 0; index * CHUNK < k; ++index) {
        const Chunk& c = chunks[index];
        const int groups = int(std::min<int64_t>(CHUNK, k - index * CHUNK) / GROUP);
        for (int t = 0; t < R; ++t)
            for (int g = 0; g < groups; ++g) {
                const int64_t at = index * CHUNK + g * GROUP;
                int32_t sum = 0;
                for (int i = 0; i < GROUP; ++i)
                    sum += (int32_t(c.levels[GROUP * g + i]) - center) * int32_t(act.q[t][at + i]);
                const float offset = center ? 0.0f : c.offset[g] * float(act.sum16[t][at / GROUP]);
                out[t] += (c.scale[g] * float(sum) + offset) * act.step[t][at / block];
            }
    }
#endif
}

#if defined(KVLM_TILES)

#if defined(KVLM_VNNI) && defined(__AVX512VNNI__)
inline const char* dot_isa() { return "avx2 tiles (avx512-vnni dots)"; }
#elif defined(KVLM_VNNI)
inline const char* dot_isa() { return "avx2 tiles (avx-vnni dots)"; }
#else
inline const char* dot_isa() { return "avx2 tiles"; }
#endif

// f(integral_constant<I>) for I = 0 .. N-1, unrolled: shifts and register choices need constants.
template <class F, int... I> inline void unroll_each(F&& f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F> inline void unroll(F&& f) { unroll_each(f, std::make_integer_sequence<int, N>{}); }

// f(i) for i = 0 .. N-1 over a super-block's sub-blocks: unrolled for a pass of one activation row (decode: the
// weights stream from memory, and unrolled code keeps more loads in flight), a loop for more rows (unrolled, their
// partial sums spilled to the stack: Q4_K's tile at 5 rows reached 42% of the int8 peak unrolled, 54% as a loop;
// Q6_K's 30% and 42%). f takes an int (an integral_constant when unrolled).
template <int N, int R, class F> inline void sub_blocks(F&& f) {
    if constexpr (R == 1)
        unroll<N>(f);
    else
        for (int i = 0; i < N; ++i) f(i);
}

inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(load128(p)); }

// Four activations, the same in every lane.
template <class I = __m256i> inline I broadcast4(const int8_t* a) {
    int32_t v;
    std::memcpy(&v, a, 4);
    return splat32<I>(v);
}

// VNNI: u8 x s8 products summed per 4 (dpbusd), s16 x s16 products summed per pair (dpwssd) into each int32 lane of
// acc.
#if defined(KVLM_VNNI)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i v_dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
inline __m256i v_dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#else
inline __m256i v_dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline __m256i v_dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#endif
#if defined(KVLM_WIDE_TILES)
inline __m512i v_dpbusd(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline __m512i v_dpwssd(__m512i acc, __m512i a, __m512i b) { return _mm512_dpwssd_epi32(acc, a, b); }
#endif
#endif

// acc plus u times the 4 activations at a in every lane, as v_dpbusd(acc, u, broadcast4(a)). For two tiles in a
// 512-bit register (passes of 5 or more rows: compute-bound) the 4 bytes are vpdpbusd's memory operand, broadcast in
// the instruction ({1to16}): gcc 12 folds such a broadcast into vpaddd but not into vpdpbusd, where a vpbroadcastd of
// its own beside each dot product was half of a tile's inner loop (Q6_K +10%, Q8_0 +8% at 128 rows on a Zen 5;
// Q4_K/Q5_K keep theirs apart, see k45_tile). In 256-bit registers (fewer rows: decode, which streams the weights)
// the broadcast stays apart: folded there, batch-1 products ran ~5% slower.
#if defined(KVLM_VNNI)
inline __m256i dpbusd_activations(__m256i acc, __m256i u, const int8_t* a) {
    return v_dpbusd(acc, u, broadcast4<__m256i>(a));
}
#if defined(KVLM_WIDE_TILES)
inline __m512i dpbusd_activations(__m512i acc, __m512i u, const int8_t* a) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(a)));
    return acc;
}
#endif
#endif

// A row's dot products of 8-bit levels (unsigned, up to 127 or the maddubs bounds each kernel states) with 8-bit
// activations, 4 weights at a time per 32-bit lane (one lane per row), summed in integers. AVX2 has no 8-bit dot
// product into int32: vpmaddubsw makes int16 sums of pairs, which the kernels add while they cannot overflow
// (`narrow`: they then widen them), and vpmaddwd widens them, by ones or by the rows' integer scales as int16 pairs
// (s, s). VNNI's vpdpbusd adds the 4 products straight into int32 (about half the instructions), and a scale
// multiplies the int32 sum. The integers, so the results, are the same bits either way. I: a register of 8 rows
// or of 16 (lanes.h).
template <class I = __m256i> struct Dots {
#if defined(KVLM_VNNI)
    static constexpr bool narrow = false;
    I sum = splat32<I>(0);
    void add(I levels, I a) { sum = v_dpbusd(sum, levels, a); }
    I total() const { return sum; }
    I times(I scale) const { return v_mullo32(sum, scale); }  // scale: row_scales'
#else
    static constexpr bool narrow = true;
    I pairs = splat32<I>(0);
    void add(I levels, I a) { pairs = v_add16(pairs, v_maddubs(levels, a)); }
    I total() const { return v_madd(pairs, splat32<I>(0x00010001)); }
    I times(I scale) const { return v_madd(pairs, scale); }  // scale: row_scales'
#endif
#if defined(KVLM_VNNI)
    void add4(I levels, const int8_t* a) { sum = dpbusd_activations(sum, levels, a); }  // the same 4 activations per row
#else
    void add4(I levels, const int8_t* a) { add(levels, broadcast4<I>(a)); }
#endif
};

// Each row's int32 value v as the int16 pair (v, v), for madd against pairs of 8-bit products.
template <class I> inline I as_pairs(I v) { return v_or(v_and(v, splat32<I>(0xffff)), v_slli32<16>(v)); }

// The rows' integer scales (int32 per lane, within int16) as Dots::times takes them.
template <class I> inline I row_scales(I v) {
#if defined(KVLM_VNNI)
    return v;
#else
    return as_pairs(v);
#endif
}

// What Dots holds added to sums (times a scale where given) and cleared: where int16 pairs would overflow next
// (AVX2), or once at the end.
template <class I> inline void flush(Dots<I>& dots, I& sums) {
    sums = v_add32(sums, dots.total());
    dots = Dots<I>{};
}
template <class I> inline void flush(Dots<I>& dots, I& sums, I scale) {
    sums = v_add32(sums, dots.times(scale));
    dots = Dots<I>{};
}

// Bit FROM of each byte (the only one left set) moved to bit 4: a level's fifth bit.
template <int FROM, class I> inline I to_bit4(I x) {
    if constexpr (FROM < 4) return v_slli16<4 - FROM>(x);
    else if constexpr (FROM == 4) return x;
    else return v_srli16<FROM - 4>(x);
}
template <int G, class I> inline I fifth_bit(I plane) { return to_bit4<G>(v_and(plane, splat8<I>(char(1 << G)))); }
template <int G, class I> inline I high_pair(I plane) {  // bits 2G, 2G+1 to bits 4, 5
    return to_bit4<2 * G>(v_and(plane, splat8<I>(char(3 << (2 * G)))));
}

// The levels of weights 8p..8p+3 and 8p+4..8p+7 of each row, from register p of a nibbles section.
template <class V> inline void nibble_levels(const V& v, const uint8_t* section, int p, typename V::I& low,
                                             typename V::I& high) {
    using I = typename V::I;
    const I x = v.load(section + 32 * p), mask = splat8<I>(15);
    low = v_and(x, mask);
    high = v_and(v_srli16<4>(x), mask);
}
inline void nibble_levels(const uint8_t* section, int p, __m256i& low, __m256i& high) {
    nibble_levels(Rows8{}, section, p, low, high);
}

// The 32-weight formats: per block column, each row's integer dot product with a block of activations, then its
// scale (and offset) times the activations' step (and step times their sum).
template <int TYPE> constexpr int nibbles_at() {  // after d (MXFP4: e), m and the fifth bits (tiles.h)
    if (TYPE == MXFP4) return 8;
    return 16 + 16 * (TYPE == Q4_1 || TYPE == Q5_1) + 32 * (TYPE == Q5_0 || TYPE == Q5_1);
}

// The 8 rows' scales of a block column: f16, or MXFP4's E8M0 exponent bytes.
template <int TYPE> inline __m256 column_scales(const uint8_t* column) {
    if constexpr (TYPE == MXFP4)
        return e8m0_halves(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(column))));
    else
        return f16x8(column);
}

template <int TYPE, int R, class V>
inline void legacy_tile(const V& v, const uint8_t* tile, int64_t n_blocks, const ActRows<R>& act,
                        typename V::F out[R]) {
    using I = typename V::I;
    using F = typename V::F;
    constexpr int COLUMN = TILE_ROWS * Traits<TYPE>::bytes;
    constexpr bool five = TYPE == Q5_0 || TYPE == Q5_1, with_min = TYPE == Q4_1 || TYPE == Q5_1;
    constexpr bool coded = TYPE == MXFP4;  // nibbles are codes, mapped to levels 0..24 by a table
    const I levels_of = coded ? V::same_halves(mxfp4_level_table()) : V::zero();
    F acc[R];
    for (int t = 0; t < R; ++t) acc[t] = V::zero_f();
    for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t* column = tile + b * COLUMN;
        I sums[R];
        for (int t = 0; t < R; ++t) sums[t] = V::zero();
        if constexpr (TYPE == Q8_0 && !Dots<I>::narrow) {
            // Signed levels as w + 128 (w xor 0x80, unsigned: vpdpbusd's int32 sums hold 32 * 255 * 127), less 128
            // times the block's activation sum: the same integers as w . a, one xor per register of levels where
            // the sign trick below costs a vpsignb per row.
            const I bias = splat8<I>(char(0x80)), minus128 = splat32<I>(0xff80);  // int16 pairs (-128, 0)
            Dots<I> dots[R];
            unroll<8>([&](auto g_) {
                constexpr int g = decltype(g_)::value;
                const I biased = v_xor(v.load(column + 16 + 32 * g), bias);
                for (int t = 0; t < R; ++t) dots[t].add4(biased, act.q[t] + 32 * b + 4 * g);
            });
            for (int t = 0; t < R; ++t) {  // sum32 holds a spare value past its end for this pair's second half
                int32_t block_sums;
                std::memcpy(&block_sums, act.sum32[t] + b, 4);
                sums[t] = v_dpwssd(dots[t].total(), minus128, splat32<I>(block_sums));
            }
        } else if constexpr (TYPE == Q8_0) {
            // Signed levels: |w| times the activation with w's sign (maddubs wants one unsigned side); int16 pairs
            // hold one register's products (2 * 128 * 127).
            Dots<I> dots[R];
            unroll<8>([&](auto g_) {
                constexpr int g = decltype(g_)::value;
                const I w = v.load(column + 16 + 32 * g), magnitude = v_magnitude(w);
                for (int t = 0; t < R; ++t) {
                    dots[t].add(magnitude, v_signed(broadcast4<I>(act.q[t] + 32 * b + 4 * g), w));
                    if constexpr (Dots<I>::narrow) flush(dots[t], sums[t]);
                }
            });
        } else {
            // Each int16 of the pair sums gains 4 products per register of nibbles. 4-bit levels fit all 4
            // registers' (16 * 15 * 127 < 2^15); 5-bit levels and MXFP4's (up to 24) only 2 registers' (8 * 31 * 127),
            // so theirs are widened to int32 halfway.
            Dots<I> dots[R];
            const I plane = five ? v.load(column + (with_min ? 32 : 16)) : V::zero();
            unroll<4>([&](auto p_) {
                constexpr int p = decltype(p_)::value;
                I low, high;
                nibble_levels(v, column + nibbles_at<TYPE>(), p, low, high);
                if constexpr (five) {
                    low = v_or(low, fifth_bit<2 * p>(plane));
                    high = v_or(high, fifth_bit<2 * p + 1>(plane));
                }
                if constexpr (coded) {
                    low = v_shuffle(levels_of, low);
                    high = v_shuffle(levels_of, high);
                }
                for (int t = 0; t < R; ++t) {
                    const int8_t* a = act.q[t] + 32 * b + 8 * p;
                    dots[t].add4(low, a);
                    dots[t].add4(high, a + 4);
                }
                if constexpr ((five || coded) && p == 1 && Dots<I>::narrow)
                    for (int t = 0; t < R; ++t) flush(dots[t], sums[t]);
            });
            for (int t = 0; t < R; ++t) flush(dots[t], sums[t]);
        }
        const F d = v.per_tile([&](int64_t at) { return column_scales<TYPE>(column + at); });
        for (int t = 0; t < R; ++t)
            acc[t] = v_fmadd(v_float(sums[t]), v_mul(d, V::splat(act.step[t][b])), acc[t]);
        if constexpr (TYPE != Q8_0) {
            const F m = with_min ? v.per_tile([&](int64_t at) { return f16x8(column + 16 + at); })
                                 : v_mul(d, V::splat(-float(Traits<TYPE>::center)));
            for (int t = 0; t < R; ++t) acc[t] = v_fmadd(m, V::splat(act.step_sum[t][b]), acc[t]);
        }
    }
    for (int t = 0; t < R; ++t) out[t] = acc[t];
}

// pshufb masks over words of 4 bytes (one row per 32-bit lane): byte S twice as int16 (0, S) and (0, S), or bytes
// S and S + 1 as int16 (0, S), (0, S + 1).
template <class V> inline typename V::I byte_pairs(int first, int second) {
    const auto word = [&](int lane) { return int(0x80000000u | uint32_t(4 * lane + second) << 16 | 0x8000u) | (4 * lane + first); };
    return V::lanes4(word(0), word(1), word(2), word(3));
}

// pshufb mask taking byte S of each row's word as the row's scale in row_scales' form.
template <class V> inline typename V::I scale_bytes(int s) {
#if defined(KVLM_VNNI)
    const auto word = [&](int lane) { return int(0x80808000u | uint32_t(4 * lane + s)); };  // int32 (0, 0, 0, S)
    return V::lanes4(word(0), word(1), word(2), word(3));
#else
    return byte_pairs<V>(s, s);
#endif
}

// Q4_K and Q5_K: per super-block, the 8 sub-blocks' dot products times their 6-bit scales summed in int32 per row,
// the mins times the activations' 32-sums likewise; then d and dmin times the activations' step.
template <int TYPE, int R, class V>
inline void k45_tile(const V& v, const uint8_t* tile, int64_t n_super, const ActRows<R>& act, typename V::F out[R]) {
    using I = typename V::I;
    using F = typename V::F;
    constexpr int COLUMN = TILE_ROWS * Traits<TYPE>::bytes;
    constexpr bool five = TYPE == Q5_K;
    constexpr int SUB = five ? 160 : 128;  // bytes of a sub-block's levels
    const I low6 = splat32<I>(0x3f3f3f3f), low4 = splat32<I>(0x0f0f0f0f), top2 = splat32<I>(0x30303030);
    // pshufb masks of a sub-block's scale byte in each row's word, made once: built from a loop's counter each time,
    // they cost a dozen scalar and insert instructions per sub-block.
    const I scale_masks[4] = {scale_bytes<V>(0), scale_bytes<V>(1), scale_bytes<V>(2), scale_bytes<V>(3)};
    F acc[R], mins[R];
    for (int t = 0; t < R; ++t) acc[t] = mins[t] = V::zero_f();
    for (int64_t c = 0; c < n_super; ++c) {
        const uint8_t* column = tile + c * COLUMN;
        // The packed scales' three words per row (formats.h, k_scales_mins), unpacked for all rows at once.
        const I a = v.load(column + 32), b = v.load(column + 64), w = v.load(column + 96);
        const I scales[2] = {v_and(a, low6), v_or(v_and(w, low4), v_and(v_srli32<2>(a), top2))};
        const I min_bytes[2] = {v_and(b, low6), v_or(v_and(v_srli32<4>(w), low4), v_and(v_srli32<2>(b), top2))};
        I sums[R];
        for (int t = 0; t < R; ++t) sums[t] = V::zero();
        sub_blocks<8, R>([&](auto s_) {
            const int s = s_;
            const I scale = v_shuffle(scales[s / 4], scale_masks[s % 4]);
            const uint8_t* sub = column + 128 + SUB * s;
            const I plane = five ? v.load(sub) : V::zero();
            Dots<I> dots[R];
            unroll<4>([&](auto p_) {
                constexpr int p = decltype(p_)::value;
                I low, high;
                nibble_levels(v, sub + (five ? 32 : 0), p, low, high);
                if constexpr (five) {
                    low = v_or(low, fifth_bit<2 * p>(plane));
                    high = v_or(high, fifth_bit<2 * p + 1>(plane));
                }
                for (int t = 0; t < R; ++t) {  // broadcasts apart: folded into vpdpbusd, Q5_K's passes ran slower
                    const int8_t* q = act.q[t] + 256 * c + 32 * s + 8 * p;
                    dots[t].add(low, broadcast4<I>(q));
                    dots[t].add(high, broadcast4<I>(q + 4));
                }
                if constexpr (five && p == 1 && Dots<I>::narrow)
                    for (int t = 0; t < R; ++t) flush(dots[t], sums[t], scale);
            });
            for (int t = 0; t < R; ++t) flush(dots[t], sums[t], scale);
        });
        const F d = v.per_tile([&](int64_t at) { return f16x8(column + at); });
        const F dmin = v.per_tile([&](int64_t at) { return f16x8(column + 16 + at); });
        for (int t = 0; t < R; ++t) {
            I min_sum = V::zero();
            for (int k = 0; k < 4; ++k) {  // mins 2k and 2k + 1 times the activations' 32-sums 2k and 2k + 1
                const I pair = v_shuffle(min_bytes[k / 2], byte_pairs<V>(2 * (k % 2), 2 * (k % 2) + 1));
                int32_t sums32;
                std::memcpy(&sums32, act.sum32[t] + 8 * c + 2 * k, 4);
                min_sum = v_add32(min_sum, v_madd(pair, splat32<I>(sums32)));
            }
            const F step = V::splat(act.step[t][c]);
            acc[t] = v_fmadd(v_float(sums[t]), v_mul(d, step), acc[t]);
            mins[t] = v_fmadd(v_float(min_sum), v_mul(dmin, step), mins[t]);
        }
    }
    for (int t = 0; t < R; ++t) out[t] = v_sub(acc[t], mins[t]);
}

// Q6_K: per super-block, 16 sub-blocks of 16 weights with signed 8-bit scales, levels centered at 32 (the center
// times the scales and the activations' 16-sums is subtracted once per super-block).
template <int R, class V>
inline void q6k_tile(const V& v, const uint8_t* tile, int64_t n_super, const ActRows<R>& act, typename V::F out[R]) {
    using I = typename V::I;
    using F = typename V::F;
    constexpr int COLUMN = TILE_ROWS * Traits<Q6_K>::bytes;
    const I low16 = splat32<I>(0xffff);
    F acc[R], centers[R];
    for (int t = 0; t < R; ++t) acc[t] = centers[t] = V::zero_f();
    for (int64_t c = 0; c < n_super; ++c) {
        const uint8_t* column = tile + c * COLUMN;
        I sums[R], center_sums[R];
        for (int t = 0; t < R; ++t) sums[t] = center_sums[t] = V::zero();
        sub_blocks<8, R>([&](auto pair_) {
            const int pair = pair_;
            I scale[2];  // sub-blocks 2 pair and 2 pair + 1: each row's scale as Dots::times takes it
            I wide[2];
            for (int h = 0; h < 2; ++h) {
                wide[h] = v.per_tile([&](int64_t at) {
                    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(column + at + 16 + 8 * (2 * pair + h))));
                });
                scale[h] = row_scales(wide[h]);
            }
            const I both = v_or(v_and(wide[0], low16), v_slli32<16>(wide[1]));
            for (int h = 0; h < 2; ++h) {
                const uint8_t* sub = column + 144 + 96 * (2 * pair + h);
                const I plane = v.load(sub);
                I l0, l1, l2, l3;
                nibble_levels(v, sub + 32, 0, l0, l1);
                nibble_levels(v, sub + 32, 1, l2, l3);
                l0 = v_or(l0, high_pair<0>(plane));
                l1 = v_or(l1, high_pair<1>(plane));
                l2 = v_or(l2, high_pair<2>(plane));
                l3 = v_or(l3, high_pair<3>(plane));
                for (int t = 0; t < R; ++t) {  // int16 pairs hold 2 registers' products of 6-bit levels
                    const int8_t* q = act.q[t] + 256 * c + 16 * (2 * pair + h);
                    Dots<I> dots;
                    dots.add4(l0, q);
                    dots.add4(l1, q + 4);
                    if constexpr (Dots<I>::narrow) flush(dots, sums[t], scale[h]);
                    dots.add4(l2, q + 8);
                    dots.add4(l3, q + 12);
                    flush(dots, sums[t], scale[h]);
                }
            }
            for (int t = 0; t < R; ++t) {
                int32_t sums16;
                std::memcpy(&sums16, act.sum16[t] + 16 * c + 2 * pair, 4);
                center_sums[t] = v_add32(center_sums[t], v_madd(both, splat32<I>(sums16)));
            }
        });
        const F d = v.per_tile([&](int64_t at) { return f16x8(column + at); });
        for (int t = 0; t < R; ++t) {
            const F step = v_mul(d, V::splat(act.step[t][c]));
            acc[t] = v_fmadd(v_float(sums[t]), step, acc[t]);
            centers[t] = v_fmadd(v_float(center_sums[t]), step, centers[t]);
        }
    }
    for (int t = 0; t < R; ++t) out[t] = v_fnmadd(centers[t], V::splat(32.0f), acc[t]);
}

// Rows' int32 values a, b as int16 pairs (a, b): madd with two activation sums (s_a, s_b) gives a s_a + b s_b.
inline __m256i two_pairs(__m256i a, __m256i b) {
    return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(b, 16));
}

inline __m256i two_sums16(const int16_t* sums) {
    int32_t both;
    std::memcpy(&both, sums, 4);
    return _mm256_set1_epi32(both);
}

// The 2-bit levels of weights 4q .. 4q + 3 of each row, from a pairs(16) register.
template <int Q> inline __m256i pair_levels(__m256i x) {
    return _mm256_and_si256(_mm256_srli_epi16(x, 2 * Q), _mm256_set1_epi8(3));
}

// Q2_K: per super-block, 16 sub-blocks of 16 2-bit levels with 4-bit scales and mins: the levels' dot products
// times the scales summed in int32 per row, the mins times the activations' 16-sums likewise; then d and dmin
// times the activations' step.
template <int R>
inline void q2k_tile(const uint8_t* tile, int64_t n_super, const ActRows<R>& act, __m256 out[R]) {
    constexpr int COLUMN = TILE_ROWS * Traits<Q2_K>::bytes;
    __m256 acc[R], mins[R];
    for (int t = 0; t < R; ++t) acc[t] = mins[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n_super; ++c) {
        const uint8_t* column = tile + c * COLUMN;
        __m256i sums[R], min_sums[R];
        for (int t = 0; t < R; ++t) sums[t] = min_sums[t] = _mm256_setzero_si256();
        unroll<8>([&](auto pair_) {
            constexpr int pair = decltype(pair_)::value;
            __m256i bytes[2];
            for (int h = 0; h < 2; ++h) {
                const int j = 2 * pair + h;
                bytes[h] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(column + 32 + 8 * j)));
                const __m256i scale = row_scales(_mm256_and_si256(bytes[h], _mm256_set1_epi32(15)));
                const __m256i x = load256(column + 160 + 32 * j);
                for (int t = 0; t < R; ++t) {  // int16 pairs: 4 registers' 2 products of levels <= 3
                    const int8_t* q = act.q[t] + 256 * c + 16 * j;
                    Dots<> dots;
                    dots.add4(pair_levels<0>(x), q);
                    dots.add4(pair_levels<1>(x), q + 4);
                    dots.add4(pair_levels<2>(x), q + 8);
                    dots.add4(pair_levels<3>(x), q + 12);
                    flush(dots, sums[t], scale);
                }
            }
            const __m256i min_pair = two_pairs(_mm256_srli_epi32(bytes[0], 4), _mm256_srli_epi32(bytes[1], 4));
            for (int t = 0; t < R; ++t)
                min_sums[t] = _mm256_add_epi32(min_sums[t], _mm256_madd_epi16(min_pair, two_sums16(act.sum16[t] + 16 * c + 2 * pair)));
        });
        const __m256 d = f16x8(column), dmin = f16x8(column + 16);
        for (int t = 0; t < R; ++t) {
            const __m256 step = _mm256_set1_ps(act.step[t][c]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_mul_ps(d, step), acc[t]);
            mins[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_sums[t]), _mm256_mul_ps(dmin, step), mins[t]);
        }
    }
    for (int t = 0; t < R; ++t) out[t] = _mm256_sub_ps(acc[t], mins[t]);
}

// Bit G of each byte (the only one left set) moved to bit 2: a Q3_K level's third bit.
template <int G> inline __m256i third_bit(__m256i plane) {
    const __m256i bit = _mm256_and_si256(plane, _mm256_set1_epi8(char(1 << G)));
    if constexpr (G < 2) return _mm256_slli_epi16(bit, 2 - G);
    else if constexpr (G == 2) return bit;
    else return _mm256_srli_epi16(bit, G - 2);
}

// Q3_K's scale J (formats.h, q3k_scale) of 8 rows, from the three words A, B, C of each row's scale bytes.
template <int J> inline __m256i q3k_scales(const __m256i words[3]) {
    const __m256i low = _mm256_and_si256(_mm256_srli_epi32(words[(J % 8) / 4], 8 * (J % 4) + 4 * (J / 8)), _mm256_set1_epi32(15));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi32(words[2], 8 * (J % 4) + 2 * (J / 4)), _mm256_set1_epi32(3));
    return _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
}

// Q3_K: as Q6_K, 16 sub-blocks of 16 with signed scales, levels 0..7 centered at 4.
template <int R>
inline void q3k_tile(const uint8_t* tile, int64_t n_super, const ActRows<R>& act, __m256 out[R]) {
    constexpr int COLUMN = TILE_ROWS * Traits<Q3_K>::bytes;
    __m256 acc[R], centers[R];
    for (int t = 0; t < R; ++t) acc[t] = centers[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n_super; ++c) {
        const uint8_t* column = tile + c * COLUMN;
        const __m256i words[3] = {load256(column + 16), load256(column + 48), load256(column + 80)};
        __m256i sums[R], center_sums[R];
        for (int t = 0; t < R; ++t) sums[t] = center_sums[t] = _mm256_setzero_si256();
        unroll<8>([&](auto h_) {
            constexpr int h = decltype(h_)::value;  // sub-blocks 2h and 2h + 1
            const __m256i scales[2] = {q3k_scales<2 * h>(words), q3k_scales<2 * h + 1>(words)};
            const __m256i plane = load256(column + 112 + 96 * h);
            unroll<2>([&](auto half_) {
                constexpr int half = decltype(half_)::value;
                const __m256i x = load256(column + 144 + 96 * h + 32 * half);
                const __m256i l0 = _mm256_or_si256(pair_levels<0>(x), third_bit<4 * half>(plane));
                const __m256i l1 = _mm256_or_si256(pair_levels<1>(x), third_bit<4 * half + 1>(plane));
                const __m256i l2 = _mm256_or_si256(pair_levels<2>(x), third_bit<4 * half + 2>(plane));
                const __m256i l3 = _mm256_or_si256(pair_levels<3>(x), third_bit<4 * half + 3>(plane));
                const __m256i scale = row_scales(scales[half]);
                for (int t = 0; t < R; ++t) {  // int16 pairs: 4 registers' 2 products of levels <= 7
                    const int8_t* q = act.q[t] + 256 * c + 32 * h + 16 * half;
                    Dots<> dots;
                    dots.add4(l0, q);
                    dots.add4(l1, q + 4);
                    dots.add4(l2, q + 8);
                    dots.add4(l3, q + 12);
                    flush(dots, sums[t], scale);
                }
            });
            const __m256i both = two_pairs(scales[0], scales[1]);
            for (int t = 0; t < R; ++t)
                center_sums[t] = _mm256_add_epi32(center_sums[t], _mm256_madd_epi16(both, two_sums16(act.sum16[t] + 16 * c + 2 * h)));
        });
        const __m256 d = f16x8(column);
        for (int t = 0; t < R; ++t) {
            const __m256 step = _mm256_mul_ps(d, _mm256_set1_ps(act.step[t][c]));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), step, acc[t]);
            centers[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(center_sums[t]), step, centers[t]);
        }
    }
    for (int t = 0; t < R; ++t) out[t] = _mm256_fnmadd_ps(centers[t], _mm256_set1_ps(4.0f), acc[t]);
}

// IQ4_XS: per super-block, 8 sub-blocks of 32 4-bit codes mapped to signed values (IQ4_VALUES) and 6-bit scales:
// |value| times the activations with the value's sign (maddubs), times the row's scale (madd) summed in int32.
template <int R>
inline void iq4xs_tile(const uint8_t* tile, int64_t n_super, const ActRows<R>& act, __m256 out[R]) {
    constexpr int COLUMN = TILE_ROWS * Traits<IQ4_XS>::bytes;
    const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
    __m256 acc[R];
    for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n_super; ++c) {
        const uint8_t* column = tile + c * COLUMN;
        const __m256i high = _mm256_cvtepu16_epi32(load128(column + 16)), low = load256(column + 32);
        __m256i sums[R];
        for (int t = 0; t < R; ++t) sums[t] = _mm256_setzero_si256();
        unroll<8>([&](auto s_) {
            constexpr int s = decltype(s_)::value;
            const __m256i scale = row_scales(_mm256_sub_epi32(
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(low, 4 * s), _mm256_set1_epi32(15)),
                                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * s), _mm256_set1_epi32(3)), 4)),
                _mm256_set1_epi32(32)));
            Dots<> dots[R];  // int16 pairs hold one register's products (2 * 127 * 127)
            for (int p = 0; p < 4; ++p) {
                __m256i codes[2];
                nibble_levels(column + 64 + 128 * s, p, codes[0], codes[1]);
                for (int half = 0; half < 2; ++half) {
                    const __m256i w = _mm256_shuffle_epi8(values, codes[half]), magnitude = _mm256_sign_epi8(w, w);
                    for (int t = 0; t < R; ++t) {
                        dots[t].add(magnitude, _mm256_sign_epi8(broadcast4(act.q[t] + 256 * c + 32 * s + 8 * p + 4 * half), w));
                        if constexpr (Dots<>::narrow) flush(dots[t], sums[t], scale);
                    }
                }
            }
            if constexpr (!Dots<>::narrow)
                for (int t = 0; t < R; ++t) flush(dots[t], sums[t], scale);
        });
        const __m256 d = f16x8(column);
        for (int t = 0; t < R; ++t)
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_mul_ps(d, _mm256_set1_ps(act.step[t][c])), acc[t]);
    }
    for (int t = 0; t < R; ++t) out[t] = acc[t];
}

// IQ3_S: per 4 weights of the 8 rows, each row's entry pair (i, i + 256) loaded by its index byte and the ninth bit
// picking the half (vpermd; 8 such loads cost 0.7x a gather of the 9-bit indices on Zen 3), 4 values of 1..15 each;
// the activations' signs flipped where the weights' are (maddubs then takes the values as they are); a sub-block's
// int16 pair sums (8 registers' 2 products of values <= 15) times its odd scale 1 + 2 ls (madd).
template <int R>
inline void iq3s_tile(const uint8_t* tile, int64_t n_super, const ActRows<R>& act, __m256 out[R]) {
    constexpr int COLUMN = TILE_ROWS * Traits<IQ3_S>::bytes;
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                            0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    const __m256i low_bits = _mm256_set1_epi32(0x08040201), high_bits = _mm256_set1_epi32(int(0x80402010)), even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    __m256 acc[R];
    for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n_super; ++c) {
        const uint8_t* column = tile + c * COLUMN;
        const __m256i scale_words = load256(column + 16);
        __m256i sums[R];
        for (int t = 0; t < R; ++t) sums[t] = _mm256_setzero_si256();
        for (int s = 0; s < 8; ++s) {
            const __m256i scale = row_scales(_mm256_add_epi32(
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(scale_words, _mm256_set1_epi32(4 * s)), _mm256_set1_epi32(15)), 1),
                _mm256_set1_epi32(1)));
            const __m256i ninth = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(column + 560 + 8 * s)));
            Dots<> dots[R];
            unroll<8>([&](auto g_) {  // weights 32 s + 4 g .. + 3 of each row
                constexpr int g = decltype(g_)::value;
                const uint8_t* index = column + 48 + 8 * (8 * s + g);
                const uint64_t bytes = load_u64(index);
                const auto entries = [bytes](int i) { return int64_t(iq3s_pairs.of[(bytes >> (8 * i)) & 0xff]); };
                const __m256i first = _mm256_setr_epi64x(entries(0), entries(1), entries(2), entries(3));
                const __m256i second = _mm256_setr_epi64x(entries(4), entries(5), entries(6), entries(7));
                const __m256i pick = _mm256_add_epi32(even, _mm256_and_si256(_mm256_srli_epi32(ninth, g), _mm256_set1_epi32(1)));
                const __m256i values = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(first, pick),
                                                          _mm256_permutevar8x32_epi32(second, pick), 0xf0);
                const __m256i sign_byte = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(column + 624 + 8 * (4 * s + g / 2))));
                const __m256i bit = g % 2 ? high_bits : low_bits;  // this group's 4 signs: a nibble of the byte
                const __m256i minus = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(sign_byte, spread), bit), bit);
                for (int t = 0; t < R; ++t) {
                    const __m256i a = broadcast4(act.q[t] + 256 * c + 32 * s + 4 * g);
                    const __m256i signed_a = _mm256_sub_epi8(_mm256_xor_si256(a, minus), minus);
                    dots[t].add(values, signed_a);
                }
            });
            for (int t = 0; t < R; ++t) flush(dots[t], sums[t], scale);
        }
        const __m256 d = f16x8(column);
        for (int t = 0; t < R; ++t)
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_mul_ps(d, _mm256_set1_ps(act.step[t][c])), acc[t]);
    }
    for (int t = 0; t < R; ++t) out[t] = acc[t];
}

// Whether two adjacent tiles of this type are multiplied in one 512-bit register (lanes.h): the kernels written
// over Rows8 / Rows16; the others read 8 rows at a time.
constexpr bool wide_tiles([[maybe_unused]] int type) {
#if defined(KVLM_WIDE_TILES)
    return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == MXFP4 ||
           type == Q4_K || type == Q5_K || type == Q6_K;
#else
    return false;
#endif
}

// An interleaved tile (or two: Rows16) of k columns times R activation rows from r0: a register of outputs per
// activation row.
template <int TYPE, int R, class V>
inline void tile_times(const V& v, const uint8_t* tile, int64_t k, const QuantizedRows& act, int64_t r0,
                       typename V::F out[R]) {
    const ActRows<R> rows(act, r0);
    if constexpr (TYPE == Q6_K) q6k_tile<R>(v, tile, k / 256, rows, out);
    else if constexpr (TYPE == Q4_K || TYPE == Q5_K) k45_tile<TYPE, R>(v, tile, k / 256, rows, out);
    else if constexpr (!is_k_quant<TYPE>()) legacy_tile<TYPE, R>(v, tile, k / 32, rows, out);
    else if constexpr (TYPE == Q2_K) q2k_tile<R>(tile, k / 256, rows, out);
    else if constexpr (TYPE == Q3_K) q3k_tile<R>(tile, k / 256, rows, out);
    else if constexpr (TYPE == IQ4_XS) iq4xs_tile<R>(tile, k / 256, rows, out);
    else if constexpr (TYPE == IQ3_S) iq3s_tile<R>(tile, k / 256, rows, out);
}

#else

inline const char* dot_isa() { return "generic"; }

#endif

}  // namespace kvlm
