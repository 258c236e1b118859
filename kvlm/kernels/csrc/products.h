// The products and the dequantization over whole matrices: which kernel reads which part (dot.h: tiles or rows),
// how a matrix's output columns are shared among a team's threads, and gguf's exact values of a row.
//
// Threads: OpenMP, linked against the runtime torch has already loaded (the same libgomp.so.1), so torch's ops
// and these share one pool of threads.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "activations.h"
#include "dot.h"
#include "formats.h"
#include "low_bit_formats.h"
#include "tiles.h"

namespace kvlm {

enum Status : int { OK = 0, UNSUPPORTED_TYPE = 1, BAD_SHAPE = 2 };

template <int TYPE> using TypeTag = std::integral_constant<int, TYPE>;

// Calls f(TypeTag<type>{}) for a type the kernels read; false for any other.
template <class F> bool with_type(int32_t type, F&& f) {
    switch (type) {
        case Q4_0: f(TypeTag<Q4_0>{}); return true;
        case Q4_1: f(TypeTag<Q4_1>{}); return true;
        case Q5_0: f(TypeTag<Q5_0>{}); return true;
        case Q5_1: f(TypeTag<Q5_1>{}); return true;
        case Q8_0: f(TypeTag<Q8_0>{}); return true;
        case Q2_K: f(TypeTag<Q2_K>{}); return true;
        case Q3_K: f(TypeTag<Q3_K>{}); return true;
        case Q4_K: f(TypeTag<Q4_K>{}); return true;
        case Q5_K: f(TypeTag<Q5_K>{}); return true;
        case Q6_K: f(TypeTag<Q6_K>{}); return true;
        case IQ2_XXS: f(TypeTag<IQ2_XXS>{}); return true;
        case IQ2_XS: f(TypeTag<IQ2_XS>{}); return true;
        case IQ3_XXS: f(TypeTag<IQ3_XXS>{}); return true;
        case IQ1_S: f(TypeTag<IQ1_S>{}); return true;
        case IQ4_NL: f(TypeTag<IQ4_NL>{}); return true;
        case IQ3_S: f(TypeTag<IQ3_S>{}); return true;
        case IQ2_S: f(TypeTag<IQ2_S>{}); return true;
        case IQ4_XS: f(TypeTag<IQ4_XS>{}); return true;
        case IQ1_M: f(TypeTag<IQ1_M>{}); return true;
        case TQ1_0: f(TypeTag<TQ1_0>{}); return true;
        case TQ2_0: f(TypeTag<TQ2_0>{}); return true;
        case MXFP4: f(TypeTag<MXFP4>{}); return true;
        case NVFP4: f(TypeTag<NVFP4>{}); return true;
        default: return false;
    }
}

int block_weights(int32_t type) {
    int weights = 0;
    with_type(type, [&](auto tag) { weights = Traits<decltype(tag)::value>::weights; });
    return weights;
}

// Chunk `index` of a row of n_cols weights, in memory; returns its number of groups (fewer only in a row's last
// chunk of a 32-weight format), whose levels, scales and offsets past them are zero.
template <int TYPE> inline int read_chunk(const uint8_t* row, int64_t n_cols, int64_t index, Chunk& c) {
    using B = Traits<TYPE>;
    constexpr int per_chunk = CHUNK / B::weights;
    const int64_t total = n_cols / B::weights, first = index * per_chunk;
    const int n = int(std::min<int64_t>(per_chunk, total - first));
#if defined(KVLM_TILES)
    if constexpr (has_reader(TYPE)) unpack<TYPE>(row + first * B::bytes, n, c);
    else unpack_generic<TYPE>(row + first * B::bytes, n, c);
#else
    unpack_generic<TYPE>(row + first * B::bytes, n, c);
#endif
    const int groups = n * B::weights / GROUP;
    std::fill(c.levels + groups * GROUP, c.levels + CHUNK, uint8_t(0));
    std::fill(c.scale + groups, c.scale + GROUPS, 0.0f);
    std::fill(c.offset + groups, c.offset + GROUPS, 0.0f);
    return groups;
}

void store(void* out, bool bf16, int64_t at, float v) {
    if (bf16) static_cast<uint16_t*>(out)[at] = float_to_bf16(v);
    else static_cast<float*>(out)[at] = v;
}

// One group's weights as gguf computes them: scale * (level - center), or scale * level + offset rounded once.
// Either way the same bits as gguf's dequantize. Straight-line code over 16 values, which the compiler vectorizes.
template <int CENTER, class Out> inline void dequantize_group(const uint8_t* levels, float scale, float offset,
                                                              Out* out) {
    float values[GROUP];
    for (int i = 0; i < GROUP; ++i)
        values[i] = CENTER ? scale * float(int(levels[i]) - CENTER) : std::fma(scale, float(levels[i]), offset);
    if constexpr (sizeof(Out) == 4) {
        std::memcpy(out, values, sizeof(values));
    } else {
        for (int i = 0; i < GROUP; ++i) {  // float_to_bf16, without branches
            uint32_t bits;
            std::memcpy(&bits, &values[i], 4);
            const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
            out[i] = uint16_t((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
        }
    }
}

template <int TYPE, class Out> void dequantize_row(const uint8_t* row, int64_t n_cols, Out* out) {
    Chunk c;
    for (int64_t index = 0; index * CHUNK < n_cols; ++index) {
        const int groups = read_chunk<TYPE>(row, n_cols, index, c);
        for (int g = 0; g < groups; ++g)
            dequantize_group<Traits<TYPE>::center>(c.levels + g * GROUP, c.scale[g], c.offset[g],
                                                  out + index * CHUNK + g * GROUP);
    }
}

// Activation rows r_begin <= r < r_end of `act`: a product's rows (all of them, or one expert's, experts.h).
struct RowSpan {
    int64_t begin, end;
};

// Rows j0 <= j < j1 of one part in the file's layout times the activation rows `span`, into y's columns offset + j
// (y's row r for activation row r). Each row is read into its chunks once, for all the activation rows.
template <int TYPE> void product_rows(const uint8_t* weights, int64_t k, int64_t j0, int64_t j1,
                                      const QuantizedRows& act, RowSpan span, void* y, bool y_bf16, int64_t y_cols,
                                      int64_t y_offset) {
    static thread_local std::vector<Chunk> chunks;
    chunks.resize(size_t((k + CHUNK - 1) / CHUNK));
    float sums[MAX_ACT_ROWS];
    for (int64_t j = j0; j < j1; ++j) {
        const uint8_t* row = weights + j * row_bytes<TYPE>(k);
        for (size_t index = 0; index < chunks.size(); ++index) read_chunk<TYPE>(row, k, int64_t(index), chunks[index]);
        for (int64_t r0 = span.begin; r0 < span.end; r0 += MAX_ACT_ROWS) {
            const int n = int(std::min<int64_t>(MAX_ACT_ROWS, span.end - r0));
            switch (n) {
                case 1: chunks_times<TYPE, 1>(chunks.data(), k, ActRows<1>(act, r0), sums); break;
                case 2: chunks_times<TYPE, 2>(chunks.data(), k, ActRows<2>(act, r0), sums); break;
                case 3: chunks_times<TYPE, 3>(chunks.data(), k, ActRows<3>(act, r0), sums); break;
                default: chunks_times<TYPE, MAX_ACT_ROWS>(chunks.data(), k, ActRows<MAX_ACT_ROWS>(act, r0), sums); break;
            }
            for (int t = 0; t < n; ++t) store(y, y_bf16, (r0 + t) * y_cols + y_offset + j, sums[t]);
        }
    }
}

#if defined(KVLM_TILES)
// f(integral_constant<N>) for the pass of n activation rows (1 <= n <= MAX_PASS_ROWS).
template <class F, int... N> inline void with_pass_rows_of(int n, F&& f, std::integer_sequence<int, N...>) {
    ((n == N + 1 ? (f(std::integral_constant<int, N + 1>{}), true) : false) || ...);
}
template <class F> inline void with_pass_rows(int n, F&& f) {
    with_pass_rows_of(n, f, std::make_integer_sequence<int, MAX_PASS_ROWS>{});
}

inline void store_floats(float* at, __m256 v) { _mm256_storeu_ps(at, v); }
#if defined(KVLM_WIDE_TILES)
inline void store_floats(float* at, __m512 v) { _mm512_storeu_ps(at, v); }
#endif

// The rows of one tile, or of two adjacent ones (V: lanes.h), from `tile` times the activation rows `span`,
// into y's columns from `column`, a pass of tile_pass_rows(TYPE) activation rows at a time.
template <int TYPE, class V> void tile_passes(const V& v, const uint8_t* tile, int64_t k, const QuantizedRows& act,
                                              RowSpan span, void* y, bool y_bf16, int64_t y_cols, int64_t column) {
    const int per_pass = tile_pass_rows(TYPE);
    for (int64_t r0 = span.begin; r0 < span.end; r0 += per_pass) {
        const int n = int(std::min<int64_t>(per_pass, span.end - r0));
        typename V::F out[MAX_PASS_ROWS];
        with_pass_rows(n, [&](auto rows) { tile_times<TYPE, decltype(rows)::value>(v, tile, k, act, r0, out); });
        for (int r = 0; r < n; ++r) {
            const int64_t at = (r0 + r) * y_cols + column;
            if (y_bf16) {
                store_bf16(static_cast<uint16_t*>(y) + at, out[r]);  // float_to_bf16's bits, a register at a time
            } else {
                store_floats(static_cast<float*>(y) + at, out[r]);
            }
        }
    }
}

// Activation rows from which two tiles share each 512-bit register. Below, the products stream the weights from
// memory, and reading two tiles at once streamed them slower: 4 x 18944 x 3584 Q4_K matrices on a Zen 5, 0.68x at
// 1 row, 0.80x at 4, 0.95x at 5 (Q6_K 1.12x), 1.35x at 6, 1.5x at 16.
constexpr int64_t WIDE_MIN_ROWS = 5;

// Activation rows up to which a pair of tiles' passes start by fetching the next pair into L2. At a few dozen rows
// the passes are over before the hardware prefetcher, following the pair's two streams a tile apart, has brought
// the next pair in: SmolLM2 at 64 sequences (bench.profile_step), the products 24.3 -> 22.6-22.9 ms a step on a
// Zen 5. At a prompt's 512 rows the passes hide the reads (no faster fetched, ad hoc). The fetch is a burst of
// prefetches the core waits behind: for pairs up to 16 KB (those of the matrices that read the hidden state of
// SmolLM2, Qwen3.5-0.8B or Gemma 4 E2B) it pays; the 7B shape's 32 KB pairs of Q4_K gate/up rows took 3-5% longer
// with it at 32 and 64 rows (ad hoc, three alternations).
constexpr int64_t FETCH_NEXT_MAX_ROWS = 256, FETCH_NEXT_MAX_BYTES = 16384;

inline void fetch_into_l2(const uint8_t* p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

// Tiles t0 <= t < t1 of one interleaved part times the activation rows `span`, into y's columns offset + 8 t ...
// Two at a time in 512-bit registers where the type has such kernels (wide_tiles) and the rows are many, the odd
// one out alone: a row's bits are the same either way. One tile at a time, the tiles are read as one stream, left
// to the hardware prefetcher: prefetching each next tile whole from here made batch-1 decode slower on Zen 3 (a
// 7B-shaped layer's products 13.4 vs 22.9 GB/s, SmolLM2 93 vs 110 tokens/s), its burst of prefetches filling the
// miss buffers the loads then wait for; pairs of them fetch the next pair where the rows are few (above).
template <int TYPE> void product_tiles(const uint8_t* weights, int64_t k, int64_t t0, int64_t t1,
                                       const QuantizedRows& act, RowSpan span, void* y, bool y_bf16, int64_t y_cols,
                                       int64_t y_offset) {
    const int64_t tile_bytes = TILE_ROWS * row_bytes<TYPE>(k);
    int64_t t = t0;
#if defined(KVLM_WIDE_TILES)
    if constexpr (wide_tiles(TYPE))
        for (; t + 1 < t1 && span.end - span.begin >= WIDE_MIN_ROWS; t += 2) {
            if (span.end - span.begin <= FETCH_NEXT_MAX_ROWS && 2 * tile_bytes <= FETCH_NEXT_MAX_BYTES && t + 3 < t1)
                fetch_into_l2(weights + (t + 2) * tile_bytes, 2 * tile_bytes);
            tile_passes<TYPE>(Rows16{tile_bytes}, weights + t * tile_bytes, k, act, span, y, y_bf16, y_cols,
                              y_offset + TILE_ROWS * t);
        }
#endif
    for (; t < t1; ++t)
        tile_passes<TYPE>(Rows8{}, weights + t * tile_bytes, k, act, span, y, y_bf16, y_cols, y_offset + TILE_ROWS * t);
}
#endif

// A matrix as the products read it: parts stacked by rows, each in its own format and layout, k columns.
struct Matrix {
    int n_parts;
    const int32_t* types;
    const uint8_t* const* weights;
    const int64_t* rows;
    const int32_t* interleaved;
    int64_t k;

    int64_t n_rows() const {
        int64_t n = 0;
        for (int p = 0; p < n_parts; ++p) n += rows[p];
        return n;
    }
};

int check_matrix(const Matrix& w) {
    for (int p = 0; p < w.n_parts; ++p) {
        const int weights_per_block = block_weights(w.types[p]);
        if (weights_per_block == 0) return UNSUPPORTED_TYPE;
#if defined(KVLM_TILES)
        const bool tiles = true;
#else
        const bool tiles = false;
#endif
        if (w.k % weights_per_block || (w.interleaved[p] && (!tiles || !tiled_type(w.types[p]) || w.rows[p] % TILE_ROWS)))
            return BAD_SHAPE;
    }
    return w.k % 32 ? BAD_SHAPE : OK;
}

// The formats a matrix's parts read their activations in: [0] blocks of 32, [1] blocks of 256 (k-quants).
inline void wanted_formats(const Matrix& w, bool wanted[2]) {
    for (int p = 0; p < w.n_parts; ++p) wanted[block_weights(w.types[p]) == 256] = true;
}

// Units of 8 output rows (a tile, or 8 rows read one at a time) of a matrix.
inline int64_t matrix_units(const Matrix& w) {
    int64_t units = 0;
    for (int p = 0; p < w.n_parts; ++p) units += (w.rows[p] + TILE_ROWS - 1) / TILE_ROWS;
    return units;
}

// Units begin <= u < end of the matrix times the activation rows `span` (quantized in `act`), into y's columns.
inline void multiply_units(const Matrix& w, const QuantizedRows act[2], RowSpan span, int64_t begin, int64_t end,
                           void* y, bool y_bf16) {
    const int64_t n = w.n_rows();
    int64_t part_unit = 0, part_column = 0;
    for (int p = 0; p < w.n_parts; ++p) {
        const int64_t part_units = (w.rows[p] + TILE_ROWS - 1) / TILE_ROWS;
        const int64_t u0 = std::max(begin, part_unit) - part_unit, u1 = std::min(end, part_unit + part_units) - part_unit;
        if (u0 < u1)
            with_type(w.types[p], [&](auto tag) {
                constexpr int TYPE = decltype(tag)::value;
                const QuantizedRows& a = act[is_k_quant<TYPE>()];
#if defined(KVLM_TILES)
                if constexpr (tiled_type(TYPE))
                    if (w.interleaved[p]) {
                        product_tiles<TYPE>(w.weights[p], w.k, u0, u1, a, span, y, y_bf16, n, part_column);
                        return;
                    }
#endif
                product_rows<TYPE>(w.weights[p], w.k, u0 * TILE_ROWS, std::min(u1 * TILE_ROWS, w.rows[p]), a, span, y,
                                   y_bf16, n, part_column);
            });
        part_unit += part_units;
        part_column += w.rows[p];
    }
}

// Rows of x [m][k] quantized into `act` in the formats `wanted`, by every thread of the calling team (which waits).
inline void quantize_in_team(const void* x, bool x_bf16, int64_t m, int64_t k, const bool wanted[2],
                             QuantizedRows act[2]) {
#pragma omp single
    for (int f = 0; f < 2; ++f)
        if (wanted[f]) resize_for(act[f], f ? 256 : 32, m, k);
    for (int f = 0; f < 2; ++f) {
        if (!wanted[f]) continue;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) quantize_row(x, x_bf16, r, k, act[f]);
    }
}

// y [m][n_rows] = x [m][k] times the matrix, run by every thread of the calling team: the activations quantized
// in blocks of 32 and/or 256 (as the parts' formats read them) into `act`, then each thread an equal share of the
// units of 8 output columns. No barrier at the end: the caller's.
void product_in_team(const Matrix& w, const void* x, bool x_bf16, int64_t m, QuantizedRows act[2], void* y,
                     bool y_bf16) {
    bool wanted[2] = {false, false};
    wanted_formats(w, wanted);
    quantize_in_team(x, x_bf16, m, w.k, wanted, act);
    const int64_t units = matrix_units(w);
    const int count = omp_get_num_threads(), thread = omp_get_thread_num();
    multiply_units(w, act, RowSpan{0, m}, units * thread / count, units * (thread + 1) / count, y, y_bf16);
}

}  // namespace kvlm
